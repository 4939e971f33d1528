//! The service stops reporting ready once the model file it maps changes on disk: the gateway's
//! `/health` answers 503 naming the file, the change is logged once at error level, and new
//! generations are refused (503) rather than served from the stale mapping.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::json;
use zerolayer::EngineService;
use zerolayer::claudelink_proto::InferenceService;

/// A private copy of the default model, removed on drop (the test changes it).
struct PrivateCopy(std::path::PathBuf);

impl Drop for PrivateCopy {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn ready_turns_false_when_the_model_file_is_modified_while_mapped() {
    let model = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
    let copy = PrivateCopy(std::env::temp_dir().join(format!(
        "zerolayer-model-file-change-{}.gguf",
        std::process::id()
    )));
    std::fs::copy(&model, &copy.0).unwrap();
    // SAFETY: the copy's bytes are never changed: the test only moves its modification time,
    // which is what the watch notices.
    let svc = unsafe { EngineService::load(&copy.0, Default::default(), Default::default()) }
        .expect("load");
    assert!(svc.ready(), "no warm-up and an unchanged file: ready");

    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&copy.0)
        .unwrap();
    file.set_modified(std::time::SystemTime::now() + Duration::from_secs(60))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while svc.ready() {
        assert!(
            Instant::now() < deadline,
            "ready() still true 10 s after the model file changed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // And it stays false.
    std::thread::sleep(Duration::from_millis(1100));
    assert!(!svc.ready());
}

/// Everything logged in this test binary (from the first call on), as text.
fn captured_log() -> Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || Sink(sink.clone()))
            .finish();
        tracing::subscriber::set_global_default(subscriber).unwrap();
        log
    })
    .clone()
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_model_file_rewritten_in_place_is_named_by_health_logged_once_and_serves_nothing_more() {
    let log = captured_log();
    let model = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
    let copy = PrivateCopy(std::env::temp_dir().join(format!(
        "zerolayer-model-file-change-gateway-{}.gguf",
        std::process::id()
    )));
    std::fs::copy(&model, &copy.0).unwrap();
    // SAFETY: the copy's bytes are never changed: the test only moves its modification time,
    // which is what the watch notices.
    let svc = unsafe { EngineService::load(&copy.0, Default::default(), Default::default()) }
        .expect("load");
    let addr = common::serve(svc);
    let ask = json!({"model": "m", "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hi"}]});
    let (status, v) = common::http_json(addr, "GET", "/health", None);
    assert_eq!((status, &v["status"]), (200, &json!("ok")), "{v}");
    let (status, v) = common::http_json(addr, "POST", "/v1/messages", Some(&ask));
    assert_eq!(status, 200, "{v}");

    std::fs::OpenOptions::new()
        .write(true)
        .open(&copy.0)
        .unwrap()
        .set_modified(std::time::SystemTime::now() + Duration::from_secs(60))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let health = loop {
        let (status, v) = common::http_json(addr, "GET", "/health", None);
        if status != 200 {
            assert_eq!(status, 503, "{v}");
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "/health still ok 10 s after the change"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let path = copy.0.to_str().unwrap();
    assert_eq!(health["status"], "model_file_changed", "{health}");
    assert_eq!(health["path"], path, "{health}");
    assert!(
        health["detail"].as_str().unwrap().contains("modified"),
        "{health}"
    );

    // New generations are refused on both APIs, without the server's file path.
    for (route, body) in [
        ("/v1/messages", ask.clone()),
        ("/v1/chat/completions", ask.clone()),
    ] {
        let (status, v) = common::http_json(addr, "POST", route, Some(&body));
        assert_eq!(status, 503, "{route}: {v}");
        assert_eq!(v["error"]["type"], "api_error", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains("changed on disk"), "{message}");
        assert!(!message.contains(path), "{message}");
    }
    let (status, again) = common::http_json(addr, "GET", "/health", None);
    assert_eq!((status, &again), (503, &health));

    let log = String::from_utf8(log.lock().unwrap().clone()).unwrap();
    let errors: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("ERROR") && l.contains(path))
        .collect();
    assert_eq!(errors.len(), 1, "{log}");
}
