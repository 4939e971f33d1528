//! The crate's unsafe corner: file mapping, mincore, madvise, mlock, posix_fadvise.
//!
//! Everything here is private; the rest of the crate sees safe functions over byte ranges of a
//! [`Backing`].

use std::fs::File;
use std::io;
use std::ops::Range;
use std::sync::OnceLock;

/// The bytes of a model file: a read-only file mapping, or an owned, 8-byte aligned copy.
pub(crate) enum Backing {
    /// A read-only shared mapping of a file (the file is kept for posix_fadvise).
    Mapped { map: memmap2::Mmap, file: File },
    /// An owned buffer (tests, `from_bytes`); stored as `u64`s so tensor data is 8-byte aligned.
    Owned { words: Vec<u64>, len: usize },
}

impl Backing {
    /// Map `file` read-only.
    ///
    /// # Safety
    /// The file must not be modified or truncated while the mapping lives (that would change or
    /// invalidate memory behind `&[u8]` references).
    pub(crate) unsafe fn map(file: File) -> io::Result<Self> {
        // SAFETY: forwarded to the caller (see the function's safety section).
        let map = unsafe { memmap2::MmapOptions::new().map(&file)? };
        Ok(Self::Mapped { map, file })
    }

    /// The mapped file, if any.
    pub(crate) fn file(&self) -> Option<&File> {
        match self {
            Self::Mapped { file, .. } => Some(file),
            Self::Owned { .. } => None,
        }
    }

    /// Copy `bytes` into an aligned owned buffer.
    pub(crate) fn owned(bytes: &[u8]) -> Self {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
        Self::Owned {
            words,
            len: bytes.len(),
        }
    }

    /// All bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Self::Mapped { map, .. } => map,
            Self::Owned { words, len } => &bytemuck::cast_slice::<u64, u8>(words)[..*len],
        }
    }

    /// Whether the bytes are a file mapping (so pages can be dropped and re-read from the file).
    pub(crate) fn is_file_backed(&self) -> bool {
        matches!(self, Self::Mapped { .. })
    }
}

/// The system page size.
pub(crate) fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        #[cfg(unix)]
        {
            // SAFETY: sysconf has no memory-safety preconditions.
            let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
            if v > 0 { v as usize } else { 4096 }
        }
        #[cfg(not(unix))]
        {
            4096
        }
    })
}

/// The page-aligned address range covering `bytes[range]`, as (start address, length), or `None`
/// for an empty or out-of-bounds range.
fn page_span(bytes: &[u8], range: &Range<usize>) -> Option<(usize, usize)> {
    if range.start >= range.end || range.end > bytes.len() {
        return None;
    }
    let page = page_size();
    let base = bytes.as_ptr() as usize;
    let start = (base + range.start) & !(page - 1);
    let end = (base + range.end).div_ceil(page) * page;
    Some((start, end - start))
}

/// Residency of the pages covering `bytes[range]`: `out` is cleared and gets one entry per page,
/// `true` when resident. Uses mincore(2); on platforms without it reports an error.
pub(crate) fn residency(bytes: &[u8], range: Range<usize>, out: &mut Vec<u8>) -> io::Result<()> {
    out.clear();
    let Some((start, len)) = page_span(bytes, &range) else {
        return Ok(());
    };
    let pages = len / page_size();
    out.resize(pages, 0);
    #[cfg(unix)]
    {
        // SAFETY: [start, start+len) is the page-rounded span of memory we hold a reference to (the
        // first and last page each contain at least one byte of `bytes`, so they are mapped), and
        // `out` has exactly one byte per page of the span as mincore requires.
        let rc = unsafe { libc::mincore(start as *mut libc::c_void, len, out.as_mut_ptr() as _) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        for v in out.iter_mut() {
            *v &= 1;
        }
        Ok(())
    }
    #[cfg(not(unix))]
    {
        let _ = start;
        Err(io::Error::new(io::ErrorKind::Unsupported, "mincore"))
    }
}

/// An madvise(2) hint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Advice {
    /// MADV_WILLNEED: start reading ahead.
    WillNeed,
    /// MADV_DONTNEED: drop the pages from this mapping (re-read from the file on next access).
    DontNeed,
    /// MADV_COLD (Linux >= 5.4): deactivate the pages, reclaim them first under pressure.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    Cold,
    /// MADV_PAGEOUT (Linux >= 5.4): reclaim the pages now.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    PageOut,
}

/// madvise the pages covering `backing.bytes()[range]`. Releasing advice (DontNeed, Cold, PageOut)
/// is only applied to file mappings: on an owned buffer it would discard data, so it returns
/// `Unsupported` there.
pub(crate) fn advise(backing: &Backing, range: Range<usize>, advice: Advice) -> io::Result<()> {
    if advice != Advice::WillNeed && !backing.is_file_backed() {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "releasing pages of an owned buffer would discard data",
        ));
    }
    let Some((start, len)) = page_span(backing.bytes(), &range) else {
        return Ok(());
    };
    #[cfg(unix)]
    {
        let flag = match advice {
            Advice::WillNeed => libc::MADV_WILLNEED,
            Advice::DontNeed => libc::MADV_DONTNEED,
            #[cfg(target_os = "linux")]
            Advice::Cold => libc::MADV_COLD,
            #[cfg(target_os = "linux")]
            Advice::PageOut => libc::MADV_PAGEOUT,
            #[cfg(not(target_os = "linux"))]
            Advice::Cold | Advice::PageOut => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "MADV_COLD/PAGEOUT",
                ));
            }
        };
        // SAFETY: the span lies within pages we hold a shared reference to. For release advice the
        // backing is a read-only shared file mapping (checked above): dropping its pages does not
        // change the bytes any reference observes, the kernel re-reads them from the file.
        let rc = unsafe { libc::madvise(start as *mut libc::c_void, len, flag) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
    #[cfg(not(unix))]
    {
        let _ = (start, len);
        Err(io::Error::new(io::ErrorKind::Unsupported, "madvise"))
    }
}

/// mlock(2) (`lock == true`) or munlock(2) the pages covering `bytes[range]`.
pub(crate) fn lock(bytes: &[u8], range: Range<usize>, lock: bool) -> io::Result<()> {
    let Some((start, len)) = page_span(bytes, &range) else {
        return Ok(());
    };
    #[cfg(unix)]
    {
        // SAFETY: the span lies within pages we hold a reference to; (un)locking does not change
        // their contents.
        let rc = unsafe {
            if lock {
                libc::mlock(start as *const libc::c_void, len)
            } else {
                libc::munlock(start as *const libc::c_void, len)
            }
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
    #[cfg(not(unix))]
    {
        let _ = (start, len, lock);
        Err(io::Error::new(io::ErrorKind::Unsupported, "mlock"))
    }
}

/// posix_fadvise(POSIX_FADV_DONTNEED) on `range` of the file (the whole file for `0..0`): drop its
/// clean pages from the page cache (pages some process still maps stay). Linux only; elsewhere
/// `Unsupported`.
pub(crate) fn fadvise_dontneed(file: &File, range: Range<usize>) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: posix_fadvise only reads its integer arguments; the fd is open for the call.
        let rc = unsafe {
            libc::posix_fadvise(
                file.as_raw_fd(),
                range.start as libc::off_t,
                (range.end - range.start) as libc::off_t,
                libc::POSIX_FADV_DONTNEED,
            )
        };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(())
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (file, range);
        Err(io::Error::new(io::ErrorKind::Unsupported, "posix_fadvise"))
    }
}
