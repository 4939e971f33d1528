//! The crate's unsafe corner: file mapping, mincore, madvise, mlock, posix_fadvise, and the
//! SIGBUS handler with its registry of live mappings.
//!
//! Everything here is private; the rest of the crate sees safe functions over byte ranges of a
//! [`Backing`].

use std::fs::File;
use std::io;
use std::ops::Range;
use std::path::Path;
use std::sync::OnceLock;

use crate::watch::FileIdentity;

/// The bytes of a model file: a read-only file mapping, or an owned, 8-byte aligned copy.
pub(crate) enum Backing {
    /// A read-only shared mapping of a file (the file is kept for posix_fadvise). `registration`
    /// (held for its `Drop`) is declared first so that it is dropped (the range leaves the SIGBUS registry) before the
    /// mapping is unmapped and its addresses can be reused.
    Mapped {
        _registration: Option<Registration>,
        map: memmap2::Mmap,
        file: File,
        identity: FileIdentity,
    },
    /// An owned buffer (tests, `from_bytes`); stored as `u64`s so tensor data is 8-byte aligned.
    Owned { words: Vec<u64>, len: usize },
}

impl Backing {
    /// Open the file at `path` and map it read-only.
    ///
    /// # Safety
    /// The file must not be modified or truncated while the mapping lives (that would change or
    /// invalidate memory behind `&[u8]` references).
    /// The whole file is mapped here, once: nothing maps further ranges later. The mapping is
    /// entered in the SIGBUS registry under `path` (so a fault in it is reported by name).
    pub(crate) unsafe fn open(path: &Path) -> io::Result<Self> {
        let file = File::open(path)?;
        let meta = file.metadata()?;
        // SAFETY: forwarded to the caller (see the function's safety section).
        let map = unsafe { memmap2::MmapOptions::new().map(&file)? };
        let registration = Registration::new(map.as_ptr() as usize, map.len(), path);
        let identity = FileIdentity::of(&meta).with_len(map.len());
        Ok(Self::Mapped {
            _registration: registration,
            map,
            file,
            identity,
        })
    }

    /// The mapped file and what it was when mapped, if any.
    pub(crate) fn file_identity(&self) -> Option<(&File, &FileIdentity)> {
        match self {
            Self::Mapped { file, identity, .. } => Some((file, identity)),
            Self::Owned { .. } => None,
        }
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
/// Bytes this process has caused to be read from storage (`read_bytes` of `/proc/self/io`);
/// `None` where the file is absent or unreadable (other systems, no task I/O accounting).
pub(crate) fn process_read_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/io").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("read_bytes:"))
        .and_then(|v| v.trim().parse().ok())
}

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
    /// MADV_RANDOM: no read-ahead around faults (only the pages read come in).
    Random,
}

/// madvise the pages covering `backing.bytes()[range]`. Releasing advice (DontNeed, Cold, PageOut)
/// is only applied to file mappings: on an owned buffer it would discard data, so it returns
/// `Unsupported` there.
pub(crate) fn advise(backing: &Backing, range: Range<usize>, advice: Advice) -> io::Result<()> {
    if !matches!(advice, Advice::WillNeed | Advice::Random) && !backing.is_file_backed() {
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
            Advice::Random => libc::MADV_RANDOM,
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

// ---------------------------------------------------------------------------------------------
// SIGBUS: a registry of live mappings and a handler that names the file before the process dies.
//
// Reading a page of a shared file mapping that lies past the file's current end raises SIGBUS
// (the file was truncated after it was mapped). The default action kills the process without a
// word; the handler below looks the faulting address up in a fixed table of live mappings and
// writes which file and which offset, then lets the default action kill the process as before.
//
// Everything the handler touches is a static of atomics: no allocation, no locks, no std
// formatting; it writes with write(2) and formats numbers by hand.
// ---------------------------------------------------------------------------------------------

use std::sync::atomic::{AtomicU8, AtomicU32, AtomicUsize, Ordering};

/// Most mappings the SIGBUS registry tracks at once; further mappings work, but a fault in one of
/// them is reported without the file's name.
pub(crate) const MAX_REGISTERED_MAPPINGS: usize = 64;

/// Bytes of a path kept per registry slot; a longer path keeps its tail (the file name),
/// prefixed with `...`.
const PATH_CAPACITY: usize = 512;

const SLOT_FREE: u8 = 0;
const SLOT_BUSY: u8 = 1;
const SLOT_LIVE: u8 = 2;

/// One registry entry. `state` guards the other fields: they are written only while the slot is
/// `SLOT_BUSY` (owned by one registering or unregistering thread) and read by the handler only
/// after an acquire load saw `SLOT_LIVE`; `generation` changes on every registration, so the
/// handler can tell that a slot was reused while it copied the path.
struct Slot {
    state: AtomicU8,
    generation: AtomicU32,
    start: AtomicUsize,
    len: AtomicUsize,
    path_len: AtomicUsize,
    path: [AtomicU8; PATH_CAPACITY],
}

impl Slot {
    const fn new() -> Self {
        Self {
            state: AtomicU8::new(SLOT_FREE),
            generation: AtomicU32::new(0),
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            path_len: AtomicUsize::new(0),
            path: [const { AtomicU8::new(0) }; PATH_CAPACITY],
        }
    }
}

static REGISTRY: [Slot; MAX_REGISTERED_MAPPINGS] = [const { Slot::new() }; MAX_REGISTERED_MAPPINGS];

/// A mapping's entry in the SIGBUS registry; dropping it removes the entry.
pub(crate) struct Registration {
    slot: usize,
}

impl Registration {
    /// Enter `[start, start + len)` under `path`. `None` when the table is full (the fault is then
    /// reported without a name) or the range is empty.
    fn new(start: usize, len: usize, path: &Path) -> Option<Self> {
        if len == 0 {
            return None;
        }
        let bytes = path.as_os_str().as_encoded_bytes();
        for (i, slot) in REGISTRY.iter().enumerate() {
            if slot
                .state
                .compare_exchange(SLOT_FREE, SLOT_BUSY, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            let kept = if bytes.len() > PATH_CAPACITY {
                let tail = &bytes[bytes.len() - (PATH_CAPACITY - 3)..];
                for (dst, &b) in slot.path.iter().zip(b"...".iter().chain(tail)) {
                    dst.store(b, Ordering::Relaxed);
                }
                PATH_CAPACITY
            } else {
                for (dst, &b) in slot.path.iter().zip(bytes) {
                    dst.store(b, Ordering::Relaxed);
                }
                bytes.len()
            };
            slot.path_len.store(kept, Ordering::Relaxed);
            slot.start.store(start, Ordering::Relaxed);
            slot.len.store(len, Ordering::Relaxed);
            slot.generation.fetch_add(1, Ordering::Relaxed);
            slot.state.store(SLOT_LIVE, Ordering::Release);
            return Some(Self { slot: i });
        }
        tracing::debug!(
            max = MAX_REGISTERED_MAPPINGS,
            "SIGBUS registry full: a fault in this mapping will not name the file"
        );
        None
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let slot = &REGISTRY[self.slot];
        slot.state.store(SLOT_BUSY, Ordering::Relaxed);
        slot.start.store(0, Ordering::Relaxed);
        slot.len.store(0, Ordering::Relaxed);
        slot.state.store(SLOT_FREE, Ordering::Release);
    }
}

/// A fixed buffer for the handler's message (no allocation in a signal handler).
struct Message {
    buf: [u8; 1024],
    len: usize,
}

impl Message {
    const fn new() -> Self {
        Self {
            buf: [0; 1024],
            len: 0,
        }
    }

    fn push(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.push_byte(b);
        }
    }

    fn push_byte(&mut self, b: u8) {
        if let Some(dst) = self.buf.get_mut(self.len) {
            *dst = b;
            self.len += 1;
        }
    }

    /// `v` in decimal.
    fn push_decimal(&mut self, mut v: usize) {
        let mut digits = [0u8; 20];
        let mut n = 0;
        loop {
            digits[n] = b'0' + (v % 10) as u8;
            n += 1;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        for i in (0..n).rev() {
            self.push_byte(digits[i]);
        }
    }

    /// `v` as `0x` and lower-case hex.
    fn push_hex(&mut self, v: usize) {
        self.push(b"0x");
        let mut started = false;
        for shift in (0..usize::BITS).step_by(4).rev() {
            let nibble = (v >> shift) & 0xf;
            if nibble != 0 || started || shift == 0 {
                started = true;
                self.push_byte(b"0123456789abcdef"[nibble]);
            }
        }
    }

    fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

/// Appends the description of `addr` to `msg` when it lies in a registered mapping: `reading
/// <path> at offset <n> (of <len> mapped bytes)`. Returns whether it did. Async-signal-safe:
/// atomic loads only.
fn describe_fault(addr: usize, msg: &mut Message) -> bool {
    for slot in &REGISTRY {
        if slot.state.load(Ordering::Acquire) != SLOT_LIVE {
            continue;
        }
        let generation = slot.generation.load(Ordering::Relaxed);
        let (start, len) = (
            slot.start.load(Ordering::Relaxed),
            slot.len.load(Ordering::Relaxed),
        );
        if addr < start || addr - start >= len {
            continue;
        }
        let mark = msg.len;
        msg.push(b"reading ");
        let path_len = slot.path_len.load(Ordering::Relaxed).min(PATH_CAPACITY);
        for b in &slot.path[..path_len] {
            msg.push_byte(b.load(Ordering::Relaxed));
        }
        msg.push(b" at offset ");
        msg.push_decimal(addr - start);
        msg.push(b" (of ");
        msg.push_decimal(len);
        msg.push(b" mapped bytes)");
        // Unregistered or reused while we copied: not this mapping after all.
        if slot.state.load(Ordering::Acquire) != SLOT_LIVE
            || slot.generation.load(Ordering::Relaxed) != generation
        {
            msg.len = mark;
            continue;
        }
        return true;
    }
    false
}

/// The disposition SIGBUS had before [`install_sigbus_handler`] (read by the handler to chain).
#[cfg(any(target_os = "linux", target_os = "android"))]
static PREVIOUS_SIGBUS: OnceLock<PreviousAction> = OnceLock::new();

/// A `libc::sigaction` kept in a static.
#[cfg(any(target_os = "linux", target_os = "android"))]
struct PreviousAction(libc::sigaction);

/// Outcome of the one installation attempt: `Ok`, or the OS error number.
#[cfg(any(target_os = "linux", target_os = "android"))]
static INSTALLED: OnceLock<Result<(), i32>> = OnceLock::new();

/// Installs the SIGBUS handler, once per process (later calls return the first call's outcome).
/// The previous disposition is kept: faults outside registered mappings (and signals sent with
/// kill) go to it. Linux and Android only; elsewhere `Unsupported`.
pub(crate) fn install_sigbus_handler() -> io::Result<()> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        let outcome = INSTALLED.get_or_init(|| {
            // SAFETY: an all-zero sigaction is a valid value (SIG_DFL, empty mask, no flags).
            let mut previous: libc::sigaction = unsafe { std::mem::zeroed() };
            // SAFETY: a null new action only queries; `previous` is a valid out pointer.
            if unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut previous) } != 0 {
                return Err(io::Error::last_os_error().raw_os_error().unwrap_or(0));
            }
            // Stored before the handler goes in, so the handler always finds it.
            let _ = PREVIOUS_SIGBUS.set(PreviousAction(previous));
            // SAFETY: as above, all-zero is a valid sigaction to fill in.
            let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
            let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                on_sigbus;
            action.sa_sigaction = handler as libc::sighandler_t;
            // SA_ONSTACK: threads with an alternate signal stack (Rust's main and spawned
            // threads set one up) run the handler there; others on their own stack, which is
            // fine: a SIGBUS from a mapping is not a stack overflow, and the handler needs
            // little more than its 1 KiB message buffer.
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            // SAFETY: `action.sa_mask` is a valid sigset_t to initialise.
            unsafe { libc::sigemptyset(&mut action.sa_mask) };
            // SAFETY: `action` is fully initialised and its handler has the SA_SIGINFO
            // signature; a null old-action pointer is allowed.
            if unsafe { libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) } != 0 {
                return Err(io::Error::last_os_error().raw_os_error().unwrap_or(0));
            }
            Ok(())
        });
        outcome.map_err(io::Error::from_raw_os_error)
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "the SIGBUS handler is implemented for Linux only",
        ))
    }
}

/// Writes all of `bytes` to stderr with write(2) (async-signal-safe), giving up on an error.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn write_stderr(mut bytes: &[u8]) {
    while !bytes.is_empty() {
        // SAFETY: `bytes` is a valid readable buffer of `bytes.len()` bytes for the call.
        let n = unsafe { libc::write(libc::STDERR_FILENO, bytes.as_ptr().cast(), bytes.len()) };
        if n <= 0 {
            return;
        }
        bytes = &bytes[(n as usize).min(bytes.len())..];
    }
}

/// The SIGBUS handler. For an address in a registered mapping: write the file, offset and cause
/// to stderr, restore the default action and re-raise (SIGBUS is blocked while the handler runs,
/// so it is delivered, and kills the process, when the handler returns). Otherwise chain to the
/// previous disposition.
#[cfg(any(target_os = "linux", target_os = "android"))]
extern "C" fn on_sigbus(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    let addr = if info.is_null() {
        0
    } else {
        // SAFETY: with SA_SIGINFO the kernel passes a valid siginfo_t; si_addr is the field for
        // SIGBUS (a fault address, or unspecified for a kill(), which no mapping matches anyway).
        unsafe { (*info).si_addr() as usize }
    };
    let mut msg = Message::new();
    msg.push(b"zerolayer: SIGBUS ");
    if describe_fault(addr, &mut msg) {
        msg.push(b": the file was truncated or changed while mapped (fault address ");
        msg.push_hex(addr);
        msg.push(b")\n");
        write_stderr(msg.bytes());
        die_by_default(signal);
        return;
    }
    let Some(PreviousAction(previous)) = PREVIOUS_SIGBUS.get() else {
        die_by_default(signal);
        return;
    };
    match previous.sa_sigaction {
        libc::SIG_DFL => die_by_default(signal),
        // A fault with SIGBUS ignored repeats on return and the kernel then kills the process;
        // a kill() with SIGBUS ignored is ignored, as before.
        libc::SIG_IGN => {}
        f if previous.sa_flags & libc::SA_SIGINFO != 0 => {
            // SAFETY: the previous handler was installed with SA_SIGINFO, so `f` is a function
            // of this signature; we pass it the arguments the kernel gave us.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute::<libc::sighandler_t, _>(f) };
            f(signal, info, context);
        }
        f => {
            // SAFETY: the previous handler was installed without SA_SIGINFO, so `f` is a plain
            // `void (*)(int)` handler.
            let f: extern "C" fn(libc::c_int) =
                unsafe { std::mem::transmute::<libc::sighandler_t, _>(f) };
            f(signal);
        }
    }
}

/// Restore the default action for `signal` and raise it: it is blocked inside the handler, so it
/// is delivered when the handler returns, and the process ends "killed by SIGBUS" as without us.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn die_by_default(signal: libc::c_int) {
    // SAFETY: signal(2) and raise(3) are async-signal-safe and take only integers.
    unsafe {
        libc::signal(signal, libc::SIG_DFL);
        libc::raise(signal);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn describe(addr: usize) -> Option<String> {
        let mut msg = Message::new();
        describe_fault(addr, &mut msg).then(|| String::from_utf8_lossy(msg.bytes()).into_owned())
    }

    #[test]
    fn the_registry_names_the_file_and_offset_of_an_address_until_dropped() {
        // Far from any real mapping.
        let start = usize::MAX / 2;
        let reg = Registration::new(start, 1 << 20, Path::new("/models/m.gguf")).unwrap();
        assert_eq!(
            describe(start + 123_456).as_deref(),
            Some("reading /models/m.gguf at offset 123456 (of 1048576 mapped bytes)")
        );
        assert_eq!(describe(start - 1), None);
        assert_eq!(describe(start + (1 << 20)), None);
        drop(reg);
        assert_eq!(describe(start + 123_456), None);
    }

    #[test]
    fn a_long_path_keeps_its_tail() {
        let start = usize::MAX / 2 + (1 << 30);
        let long = format!("/{}/model.gguf", "d".repeat(2 * PATH_CAPACITY));
        let _reg = Registration::new(start, 4096, Path::new(&long)).unwrap();
        let text = describe(start).unwrap();
        assert!(text.starts_with("reading ..."), "{text}");
        assert!(
            text.contains("ddd/model.gguf at offset 0 (of 4096"),
            "{text}"
        );
    }

    #[test]
    fn numbers_are_formatted_by_hand() {
        let mut msg = Message::new();
        msg.push_decimal(0);
        msg.push(b" ");
        msg.push_decimal(usize::MAX);
        msg.push(b" ");
        msg.push_hex(0);
        msg.push(b" ");
        msg.push_hex(0x7f00_dead_beef);
        assert_eq!(
            msg.bytes(),
            format!("0 {} 0x0 0x7f00deadbeef", usize::MAX).as_bytes()
        );
        // The buffer never overflows: extra bytes are dropped.
        let mut msg = Message::new();
        msg.push(&[b'x'; 2000]);
        assert_eq!(msg.bytes().len(), 1024);
    }
}
