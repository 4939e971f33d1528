//! A model file changed under its mapping: the SIGBUS handler names the file and offset before
//! the process dies, and `check_unchanged` / `FileWatch` notice truncation, in-place rewrites,
//! replacement by rename and removal.

use std::path::{Path, PathBuf};
#[cfg(target_os = "linux")]
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use weight_cache::{FileChanged, FileWatch, GgmlType, Gguf, GgufBuilder};

/// A GGUF file with one 64 KiB tensor (16 pages), so a truncated file leaves whole pages of the
/// tensor past its end.
fn write_model(path: &Path, fill: u8) {
    let file = GgufBuilder::new()
        .kv_str("general.architecture", "llama")
        .tensor("w", GgmlType::F32, &[16384], vec![fill; 65536])
        .build();
    std::fs::write(path, file).unwrap();
}

#[cfg(target_os = "linux")]
/// The child's side of the SIGBUS test: map, truncate, read a weight byte past the new end.
const SIGBUS_CHILD: &str = "WEIGHT_CACHE_SIGBUS_CHILD";

#[cfg(target_os = "linux")]
/// Byte of the tensor the child reads (the tensor starts in the first page; this is pages away).
const READ_AT: usize = 40_000;

#[cfg(target_os = "linux")]
fn sigbus_child(path: &Path) -> ! {
    no_core_dump();
    weight_cache::install_sigbus_handler().unwrap();
    // SAFETY: deliberately violated below: this child process exists to fault.
    let gguf = unsafe { Gguf::open(path) }.unwrap();
    let t = gguf.tensor("w").unwrap();
    println!("expected offset {}", t.offset as usize + READ_AT);
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(0)
        .unwrap();
    // SAFETY: in bounds of the mapping; the file behind it is gone, which is the point (SIGBUS).
    let byte = unsafe { std::ptr::read_volatile(t.data.as_ptr().add(READ_AT)) };
    println!("read {byte} without a fault");
    std::process::exit(0);
}

#[cfg(target_os = "linux")]
#[test]
fn truncated_mapping_dies_of_sigbus_naming_the_file_and_offset() {
    if let Some(path) = std::env::var_os(SIGBUS_CHILD) {
        sigbus_child(Path::new(&path));
    }
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("doomed-model.gguf");
    write_model(&path, 7);
    let out = run_child(
        "truncated_mapping_dies_of_sigbus_naming_the_file_and_offset",
        path.as_os_str(),
    );
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGBUS),
        "the child must still die of SIGBUS: {:?}\nstdout: {stdout}\nstderr: {stderr}",
        out.status
    );
    // The test harness prints "test <name> ... " on the same line before the child's output.
    let offset: String = stdout
        .split("expected offset ")
        .nth(1)
        .unwrap_or_else(|| panic!("child printed no offset: {stdout}"))
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    let expected = format!(
        "zerolayer: SIGBUS reading {} at offset {offset} (of ",
        path.display()
    );
    assert!(
        stderr.contains(&expected),
        "stderr lacks {expected:?}: {stderr}"
    );
    assert!(
        stderr.contains("the file was truncated or changed while mapped"),
        "{stderr}"
    );
    println!("the child's stderr: {stderr}");
}

/// Runs test `name` of this binary again as a child with `SIGBUS_CHILD=mode`.
#[cfg(target_os = "linux")]
fn run_child(name: &str, mode: &std::ffi::OsStr) -> std::process::Output {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(SIGBUS_CHILD, mode)
        .output()
        .unwrap()
}

/// No core file for a crash we cause on purpose.
#[cfg(target_os = "linux")]
fn no_core_dump() {
    let no_core = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: setrlimit reads the struct we pass; lowering RLIMIT_CORE has no memory effects.
    unsafe { libc::setrlimit(libc::RLIMIT_CORE, &no_core) };
}

#[cfg(target_os = "linux")]
#[test]
fn a_sigbus_outside_model_mappings_goes_to_the_default_action_without_a_file_message() {
    use std::os::unix::process::ExitStatusExt;
    if std::env::var_os(SIGBUS_CHILD).is_some() {
        no_core_dump();
        // SAFETY: resetting SIGBUS to its default action before anything else handles it.
        unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
        weight_cache::install_sigbus_handler().unwrap();
        // SAFETY: raise only sends a signal to this thread.
        unsafe { libc::raise(libc::SIGBUS) };
        println!("survived");
        std::process::exit(0);
    }
    let out = run_child(
        "a_sigbus_outside_model_mappings_goes_to_the_default_action_without_a_file_message",
        "default".as_ref(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), Some(libc::SIGBUS), "{stderr}");
    assert!(!stderr.contains("zerolayer: SIGBUS"), "{stderr}");
}

#[cfg(target_os = "linux")]
extern "C" fn previous_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let msg = b"previous handler ran\n";
    // SAFETY: write(2) from a valid buffer and _exit(2) are async-signal-safe.
    unsafe {
        libc::write(libc::STDERR_FILENO, msg.as_ptr().cast(), msg.len());
        libc::_exit(42);
    }
}

#[cfg(target_os = "linux")]
#[test]
fn a_sigbus_outside_model_mappings_is_chained_to_the_previous_handler() {
    if std::env::var_os(SIGBUS_CHILD).is_some() {
        // SAFETY: all-zero is a valid sigaction; it is filled in before use.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            previous_handler;
        action.sa_sigaction = handler as libc::sighandler_t;
        action.sa_flags = libc::SA_SIGINFO;
        // SAFETY: a complete action whose handler has the SA_SIGINFO signature.
        unsafe { libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) };
        weight_cache::install_sigbus_handler().unwrap();
        // SAFETY: raise only sends a signal to this thread.
        unsafe { libc::raise(libc::SIGBUS) };
        println!("survived");
        std::process::exit(0);
    }
    let out = run_child(
        "a_sigbus_outside_model_mappings_is_chained_to_the_previous_handler",
        "chain".as_ref(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(42), "{stderr}");
    assert!(stderr.contains("previous handler ran"), "{stderr}");
}

/// Open `path` (written by `write_model`).
fn open(path: &Path) -> Arc<Gguf> {
    // SAFETY: the tests below change the file but never read tensor data afterwards.
    Arc::new(unsafe { Gguf::open(path) }.unwrap())
}

fn model_in(dir: &Path) -> PathBuf {
    let path = dir.join("model.gguf");
    write_model(&path, 1);
    path
}

#[test]
fn an_unchanged_file_passes_the_check() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = open(&model_in(dir.path()));
    gguf.check_unchanged().unwrap();
    let watch = FileWatch::new(gguf).with_interval(Duration::ZERO);
    assert!(watch.check(Instant::now()).is_none());
    assert!(watch.changed().is_none());
}

#[test]
fn truncation_is_reported_with_both_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let path = model_in(dir.path());
    let gguf = open(&path);
    let len = gguf.bytes().len() as u64;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(4096)
        .unwrap();
    let err = gguf.check_unchanged().unwrap_err();
    assert!(
        matches!(&err, FileChanged::Resized { from, to: 4096, .. } if *from == len),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains(&format!("from {len} to 4096 bytes")), "{msg}");
}

#[test]
fn an_in_place_rewrite_of_the_same_size_is_reported_by_mtime() {
    let dir = tempfile::tempdir().unwrap();
    let path = model_in(dir.path());
    let gguf = open(&path);
    // File timestamps come from a coarse clock (a few ms): make sure it moved.
    std::thread::sleep(Duration::from_millis(50));
    write_model(&path, 9); // same size, new bytes, same inode
    let err = gguf.check_unchanged().unwrap_err();
    assert!(matches!(err, FileChanged::Modified { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains("was modified while mapped (mtime from ")
    );
}

#[test]
fn replacement_by_rename_is_reported_with_both_inodes() {
    let dir = tempfile::tempdir().unwrap();
    let path = model_in(dir.path());
    let gguf = open(&path);
    let staged = dir.path().join("staged.gguf");
    write_model(&staged, 1); // identical bytes: only the inode tells
    std::fs::rename(&staged, &path).unwrap();
    let err = gguf.check_unchanged().unwrap_err();
    match &err {
        FileChanged::Replaced { from, to, .. } => assert_ne!(from, to),
        other => panic!("{other:?}"),
    }
    assert!(
        err.to_string().contains("was replaced while mapped"),
        "{err}"
    );
}

#[test]
fn removal_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let path = model_in(dir.path());
    let gguf = open(&path);
    std::fs::remove_file(&path).unwrap();
    let err = gguf.check_unchanged().unwrap_err();
    assert!(matches!(err, FileChanged::Removed { .. }), "{err:?}");
}

#[test]
fn the_watch_flag_flips_on_a_change_and_stays_flipped() {
    let dir = tempfile::tempdir().unwrap();
    let path = model_in(dir.path());
    let watch = FileWatch::new(open(&path)).with_interval(Duration::from_secs(3600));
    let t0 = Instant::now();
    assert!(watch.check(t0).is_none());
    let original = std::fs::read(&path).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(100).unwrap();
    // Within the interval the last answer stands (no stat per call).
    assert!(watch.check(t0 + Duration::from_secs(1)).is_none());
    // After it, the change is found.
    let change = watch.check(t0 + Duration::from_secs(3601)).expect("found");
    assert!(
        matches!(change, FileChanged::Resized { to: 100, .. }),
        "{change:?}"
    );
    // Putting the bytes back does not make the file trustworthy again.
    f.set_len(0).unwrap();
    std::fs::write(&path, original).unwrap();
    assert!(watch.check(t0 + Duration::from_secs(9000)).is_some());
    assert!(watch.changed().is_some());
}

#[test]
fn the_background_checker_notices_a_truncation_within_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let path = model_in(dir.path());
    let watch = Arc::new(FileWatch::new(open(&path)).with_interval(Duration::from_millis(20)));
    FileWatch::spawn_checker(&watch).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(0)
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while watch.changed().is_none() {
        assert!(Instant::now() < deadline, "not noticed within 10 s");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(matches!(
        watch.changed(),
        Some(FileChanged::Resized { to: 0, .. })
    ));
}
