//! Every libc call of the emulator: TUN devices, `ppoll`, `setns`.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

/// `struct ifreq` as `TUNSETIFF` reads it: the name, then the flags (the rest is padding).
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// A TUN device (layer 3, no packet-information header), non-blocking. The device exists while
/// this descriptor is open.
#[derive(Debug)]
pub(crate) struct Tun {
    fd: OwnedFd,
    name: String,
}

impl Tun {
    /// Creates TUN device `name` (at most 15 bytes) in the calling thread's network namespace.
    pub(crate) fn create(name: &str) -> io::Result<Self> {
        if name.len() >= libc::IFNAMSIZ || name.contains('\0') {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "interface name too long",
            ));
        }
        let path = CString::new("/dev/net/tun").expect("no NUL");
        // SAFETY: `path` is a valid NUL-terminated string; open has no other preconditions.
        let raw = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a descriptor we just opened and own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            flags: (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short,
            _pad: [0; 22],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: TUNSETIFF reads (and writes back the name into) a `struct ifreq`, which
        // `IfReq` lays out (name, then the flags union member, padded to 40 bytes); `req`
        // lives across the call.
        if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF, &mut req) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            fd,
            name: name.to_owned(),
        })
    }

    /// The interface name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Reads one packet into `buf`; `Ok(None)` when none is waiting.
    pub(crate) fn recv(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the duration of the call.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::WouldBlock {
            Ok(None)
        } else {
            Err(e)
        }
    }

    /// Writes one packet (the kernel takes it whole or not at all; a full device queue drops
    /// it, as a real link would).
    pub(crate) fn send(&self, packet: &[u8]) -> io::Result<()> {
        // SAFETY: `packet` is valid for reads of `packet.len()` bytes for the duration of the call.
        let n = unsafe { libc::write(self.fd.as_raw_fd(), packet.as_ptr().cast(), packet.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::WouldBlock {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Waits until a packet can be read or `timeout` passes (nanosecond resolution).
    pub(crate) fn wait_readable(&self, timeout: Duration) -> io::Result<()> {
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ts = libc::timespec {
            tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
        };
        // SAFETY: one valid `pollfd` and a valid timespec; no signal mask is changed (null).
        let r = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
        Ok(())
    }
}

/// Moves the calling thread into the network namespace at `path` (e.g.
/// `/run/netns/NAME`); other threads are not affected.
pub fn enter_netns(path: &Path) -> io::Result<()> {
    let file = std::fs::File::open(path)?;
    // SAFETY: `file` is an open namespace file; setns only changes this thread's namespace.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

static SIGNALLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    SIGNALLED.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Installs a SIGINT/SIGTERM handler that only sets a flag, and returns the flag.
pub fn stop_on_signals() -> &'static std::sync::atomic::AtomicBool {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe); `signal` has no
        // other preconditions.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
    &SIGNALLED
}
