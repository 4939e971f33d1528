//! The service stops reporting ready (so the gateway's `/health` answers 503) once the model file
//! it maps changes on disk.

use std::time::{Duration, Instant};

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
