//! A SIGBUS handler that says which mapped model file failed before the process dies.

/// Why [`install_sigbus_handler`] could not install the handler.
///
/// ```
/// use weight_cache::SigbusHandlerError;
/// let e = SigbusHandlerError::Unsupported;
/// assert!(e.to_string().contains("Linux"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SigbusHandlerError {
    /// This platform has no implementation (Linux and Android only).
    #[error("the SIGBUS handler is implemented for Linux and Android only")]
    Unsupported,
    /// sigaction(2) failed.
    #[error("sigaction(SIGBUS) failed: {0}")]
    Sigaction(#[source] std::io::Error),
}

/// Installs, once per process, a SIGBUS handler that names the model file and the offset whose
/// read failed before the process dies.
///
/// A read of a mapped page past the end of a file that was truncated after [`Gguf::open`] mapped
/// it raises SIGBUS, which by default kills the process without a word. With the handler, a fault
/// inside a mapping made by [`Gguf::open`] or [`Safetensors::open`] (the first 64 live ones)
/// first writes, with write(2) to stderr:
///
/// ```text
/// zerolayer: SIGBUS reading /models/model.gguf at offset 123456 (of 98234567 mapped bytes): the file was truncated or changed while mapped (fault address 0x7f...)
/// ```
///
/// and then restores the default action and re-raises, so the process still ends "killed by
/// SIGBUS" (exit status 135 in a shell). Faults elsewhere, and SIGBUS sent with kill, go to the
/// disposition that was in place before (Rust's own handler, another library's, or the default).
///
/// Idempotent: later calls return the first call's outcome. The handler runs on the thread's
/// alternate signal stack when it has one (`SA_ONSTACK`; Rust's runtime gives its threads one),
/// else on the thread's stack; it uses about 1 KiB, allocates nothing and takes no locks.
///
/// ```
/// weight_cache::install_sigbus_handler()?;
/// weight_cache::install_sigbus_handler()?; // a no-op the second time
/// # Ok::<(), weight_cache::SigbusHandlerError>(())
/// ```
///
/// [`Gguf::open`]: crate::Gguf::open
/// [`Safetensors::open`]: crate::Safetensors::open
pub fn install_sigbus_handler() -> Result<(), SigbusHandlerError> {
    crate::sys::install_sigbus_handler().map_err(|e| {
        if e.kind() == std::io::ErrorKind::Unsupported {
            SigbusHandlerError::Unsupported
        } else {
            SigbusHandlerError::Sigaction(e)
        }
    })
}
