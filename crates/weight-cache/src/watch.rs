//! Noticing that a mapped model file changed on disk.
//!
//! The whole file is mapped once, at open ([`Gguf::open`]); nothing maps further ranges later, so
//! there is no later point where a change would be seen. A file truncated while mapped makes the
//! next read of a page past its new end raise SIGBUS (see [`install_sigbus_handler`]); a file
//! rewritten in place changes the weights under running requests. [`Gguf::check_unchanged`]
//! compares the file with what it was at open (device, inode, size, modification time) with two
//! cheap `stat` calls; [`FileWatch`] runs that check at most once per interval (from a caller such
//! as a health check, or its own background thread), keeps the first change it finds, and logs it
//! once at error level.
//!
//! [`install_sigbus_handler`]: crate::install_sigbus_handler

use std::fs::{File, Metadata};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use crate::Gguf;

/// Why [`Gguf::check_unchanged`] (or [`FileWatch`]) considers the mapped file changed.
///
/// ```
/// use weight_cache::FileChanged;
/// let e = FileChanged::Resized { path: "/m/model.gguf".into(), from: 98_000_000, to: 4096 };
/// assert_eq!(
///     e.to_string(),
///     "model file /m/model.gguf changed size from 98000000 to 4096 bytes while mapped"
/// );
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FileChanged {
    /// The open file's size differs from the mapping's: truncated (reads past the new end raise
    /// SIGBUS) or extended.
    #[error("model file {} changed size from {from} to {to} bytes while mapped", path.display())]
    Resized {
        /// The file.
        path: PathBuf,
        /// Size when mapped.
        from: u64,
        /// Size now.
        to: u64,
    },
    /// Same size, but the open file's modification time moved: rewritten in place, so the
    /// mapped weights may have changed under running requests.
    #[error(
        "model file {} was modified while mapped (mtime from {} to {})",
        path.display(), unix_time(from), unix_time(to)
    )]
    Modified {
        /// The file.
        path: PathBuf,
        /// Modification time when mapped.
        from: SystemTime,
        /// Modification time now.
        to: SystemTime,
    },
    /// The path now names another file (replaced, e.g. by a rename over it): the mapping still
    /// shows the old one, so the server is not serving what is on disk.
    #[error(
        "model file {} was replaced while mapped (device {}, inode {} is now device {}, inode {})",
        path.display(), from.0, from.1, to.0, to.1
    )]
    Replaced {
        /// The path.
        path: PathBuf,
        /// (device, inode) of the mapped file.
        from: (u64, u64),
        /// (device, inode) the path names now.
        to: (u64, u64),
    },
    /// The path no longer names a file (removed, or renamed away).
    #[error("model file {} was removed while mapped: {source}", path.display())]
    Removed {
        /// The path.
        path: PathBuf,
        /// The error of stat on the path.
        #[source]
        source: io::Error,
    },
    /// fstat on the open file failed, so nothing can be said about it.
    #[error("cannot stat the mapped model file {}: {source}", path.display())]
    Stat {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// `secs.nanos` since the Unix epoch (negative times as `-secs`).
fn unix_time(t: &SystemTime) -> String {
    match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => format!("{}.{:09}", d.as_secs(), d.subsec_nanos()),
        Err(e) => format!("-{}", e.duration().as_secs_f64()),
    }
}

/// What a file was when mapped: enough to notice a truncation, an in-place rewrite or a
/// replacement without reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FileIdentity {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: Option<SystemTime>,
}

impl FileIdentity {
    pub(crate) fn of(meta: &Metadata) -> Self {
        #[cfg(unix)]
        let (dev, ino) = {
            use std::os::unix::fs::MetadataExt;
            (meta.dev(), meta.ino())
        };
        #[cfg(not(unix))]
        let (dev, ino) = (0, 0);
        Self {
            dev,
            ino,
            len: meta.len(),
            mtime: meta.modified().ok(),
        }
    }

    /// The same identity with the size the mapping actually has.
    pub(crate) fn with_len(self, len: usize) -> Self {
        Self {
            len: len as u64,
            ..self
        }
    }

    /// Compares the open `file` (fstat) and then `path` (stat) with `self`.
    pub(crate) fn check(&self, file: &File, path: &Path) -> Result<(), FileChanged> {
        let now = file.metadata().map_err(|source| FileChanged::Stat {
            path: path.to_path_buf(),
            source,
        })?;
        let now = Self::of(&now);
        if now.len != self.len {
            return Err(FileChanged::Resized {
                path: path.to_path_buf(),
                from: self.len,
                to: now.len,
            });
        }
        if let (Some(from), Some(to)) = (self.mtime, now.mtime)
            && from != to
        {
            return Err(FileChanged::Modified {
                path: path.to_path_buf(),
                from,
                to,
            });
        }
        let at_path = std::fs::metadata(path).map_err(|source| FileChanged::Removed {
            path: path.to_path_buf(),
            source,
        })?;
        let at_path = Self::of(&at_path);
        if (at_path.dev, at_path.ino) != (self.dev, self.ino) {
            return Err(FileChanged::Replaced {
                path: path.to_path_buf(),
                from: (self.dev, self.ino),
                to: (at_path.dev, at_path.ino),
            });
        }
        Ok(())
    }
}

/// A rate-limited, sticky check that a mapped [`Gguf`] file is unchanged.
///
/// [`check`](Self::check) runs [`Gguf::check_unchanged`] at most once per interval (1 s by
/// default) and answers from the last result in between; the first change found is kept (a file
/// that changed while mapped stays suspect even if it is changed back) and logged once at error
/// level. [`spawn_checker`](Self::spawn_checker) runs the check on a background thread, so the
/// change is logged even when nobody asks; a health check calls `check` to answer.
///
/// ```
/// use std::sync::Arc;
/// use std::time::{Duration, Instant};
/// use weight_cache::{FileChanged, FileWatch, GgmlType, Gguf, GgufBuilder};
///
/// let dir = tempfile::tempdir()?;
/// let path = dir.path().join("m.gguf");
/// let file = GgufBuilder::new().tensor("w", GgmlType::F32, &[1024], vec![0; 4096]).build();
/// std::fs::write(&path, &file)?;
/// // SAFETY: the file is only changed below, and no tensor is read after that.
/// let gguf = Arc::new(unsafe { Gguf::open(&path)? });
/// let watch = FileWatch::new(gguf).with_interval(Duration::ZERO);
/// assert!(watch.check(Instant::now()).is_none());
///
/// std::fs::OpenOptions::new().write(true).open(&path)?.set_len(100)?; // truncated
/// let change = watch.check(Instant::now()).expect("noticed");
/// assert!(matches!(change, FileChanged::Resized { to: 100, .. }));
/// assert!(watch.changed().is_some());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct FileWatch {
    gguf: Arc<Gguf>,
    interval: Duration,
    /// Time base of `next_check`.
    epoch: Instant,
    /// Nanoseconds after `epoch` before which `check` does not stat again.
    next_check: AtomicU64,
    changed: OnceLock<FileChanged>,
}

/// Default time between two checks of a [`FileWatch`].
pub const DEFAULT_WATCH_INTERVAL: Duration = Duration::from_secs(1);

impl FileWatch {
    /// A watch over `gguf`'s file, checking at most every [`DEFAULT_WATCH_INTERVAL`]. A `Gguf`
    /// made with [`Gguf::from_bytes`] never changes.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use weight_cache::{FileWatch, Gguf, GgufBuilder};
    /// let gguf = Arc::new(Gguf::from_bytes(GgufBuilder::new().build())?);
    /// assert!(FileWatch::new(gguf).check(std::time::Instant::now()).is_none());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(gguf: Arc<Gguf>) -> Self {
        Self {
            gguf,
            interval: DEFAULT_WATCH_INTERVAL,
            epoch: Instant::now(),
            next_check: AtomicU64::new(0),
            changed: OnceLock::new(),
        }
    }

    /// Sets the least time between two checks (`Duration::ZERO`: every call checks).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use weight_cache::{FileWatch, Gguf, GgufBuilder};
    /// # let gguf = Arc::new(Gguf::from_bytes(GgufBuilder::new().build())?);
    /// let watch = FileWatch::new(gguf).with_interval(std::time::Duration::from_millis(250));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// The file watched.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use weight_cache::{FileWatch, Gguf, GgufBuilder};
    /// let gguf = Arc::new(Gguf::from_bytes(GgufBuilder::new().build())?);
    /// assert!(Arc::ptr_eq(FileWatch::new(gguf.clone()).gguf(), &gguf));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn gguf(&self) -> &Arc<Gguf> {
        &self.gguf
    }

    /// The change found so far, if any, without checking again.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use weight_cache::{FileWatch, Gguf, GgufBuilder};
    /// let gguf = Arc::new(Gguf::from_bytes(GgufBuilder::new().build())?);
    /// assert!(FileWatch::new(gguf).changed().is_none());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn changed(&self) -> Option<&FileChanged> {
        self.changed.get()
    }

    /// The change found so far; when none and the interval has passed since the last check
    /// (measured with `now`), checks the file first. Only one of concurrent callers checks; the
    /// others answer from the last result. The first change found is logged at error level.
    ///
    /// See the type's example.
    pub fn check(&self, now: Instant) -> Option<&FileChanged> {
        if let Some(c) = self.changed.get() {
            return Some(c);
        }
        let now_ns =
            u64::try_from(now.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX);
        let due = self.next_check.load(Ordering::Relaxed);
        if now_ns < due {
            return None;
        }
        let next =
            now_ns.saturating_add(u64::try_from(self.interval.as_nanos()).unwrap_or(u64::MAX));
        if self
            .next_check
            .compare_exchange(due, next, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return self.changed.get();
        }
        let Err(change) = self.gguf.check_unchanged() else {
            return None;
        };
        let message = change.to_string();
        if self.changed.set(change).is_ok() {
            tracing::error!(
                "{message}: not ready from now on; the mapping no longer matches the file on \
                 disk (after a truncation, the next read past the new end kills the process \
                 with SIGBUS). Restart to serve the file on disk."
            );
        }
        self.changed.get()
    }

    /// Starts a thread (`weight-cache-watch`) that calls [`check`](Self::check) every interval
    /// (at least every 10 ms), so a change is logged when it happens rather than when someone
    /// asks. It holds a weak reference: it ends within one interval after the last `Arc` of the
    /// watch is dropped, or once a change was found.
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # use weight_cache::{FileWatch, Gguf, locate_default_model};
    /// // SAFETY: the model file is not modified while mapped (the watch reports it if it is).
    /// let gguf = Arc::new(unsafe { Gguf::open(locate_default_model()?)? });
    /// let watch = Arc::new(FileWatch::new(gguf));
    /// FileWatch::spawn_checker(&watch)?;
    /// // ... later, in a health check:
    /// let healthy = watch.changed().is_none();
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn spawn_checker(this: &Arc<Self>) -> io::Result<()> {
        let weak = Arc::downgrade(this);
        let pause = this.interval.max(Duration::from_millis(10));
        std::thread::Builder::new()
            .name("weight-cache-watch".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(pause);
                    let Some(watch) = weak.upgrade() else { return };
                    if watch.check(Instant::now()).is_some() {
                        return;
                    }
                }
            })?;
        Ok(())
    }
}
