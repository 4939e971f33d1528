//! Finding libcuda and libnvrtc before cudarc does: cudarc's dynamic loading panics when a
//! library is absent, so every entry point of the CUDA executor checks here first and returns
//! a typed error instead.
//!
//! `ZEROLAYER_NVRTC_LIB` may name libnvrtc's file (or the directory holding `libnvrtc.so.12`,
//! as the PyPI wheel `nvidia-cuda-nvrtc-cu12` installs it): it is loaded and kept loaded, and
//! cudarc's own `dlopen("libnvrtc.so.12")` then finds it by its soname without any
//! `LD_LIBRARY_PATH`.

use std::path::PathBuf;
use std::sync::OnceLock;

use super::CudaError;

/// The environment variable naming libnvrtc's file or directory.
pub const NVRTC_LIB_ENV: &str = "ZEROLAYER_NVRTC_LIB";

/// The file names cudarc tries for `lib` (`"cuda"`, `"nvrtc"`), in its order.
fn candidates(lib: &str) -> Vec<String> {
    cudarc::get_lib_name_candidates(lib)
}

/// The libcuda (driver) library is loadable. It does not say a GPU is there: creating the
/// context does.
pub(crate) fn driver() -> Result<(), CudaError> {
    // SAFETY: loads (and unloads) libcuda by the names cudarc uses; running the library's
    // initializers is what any CUDA program does, and nothing of it is kept.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::NoDriver {
            tried: candidates("cuda"),
        })
    }
}

/// The library preloaded from [`NVRTC_LIB_ENV`] (kept loaded for the process's life).
static PRELOADED: OnceLock<Result<Option<libloading::Library>, String>> = OnceLock::new();

/// libnvrtc is loadable (after preloading [`NVRTC_LIB_ENV`] if set).
pub(crate) fn nvrtc() -> Result<(), CudaError> {
    let env = std::env::var_os(NVRTC_LIB_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from);
    let pre = PRELOADED.get_or_init(|| {
        let Some(path) = &env else { return Ok(None) };
        let file = if path.is_dir() {
            path.join("libnvrtc.so.12")
        } else {
            path.clone()
        };
        // SAFETY: loads the NVRTC library the user named; its initializers are NVIDIA's and run
        // in any program that uses NVRTC.
        unsafe { libloading::Library::new(&file) }
            .map(Some)
            .map_err(|e| format!("{}: {e}", file.display()))
    });
    if let Err(reason) = pre {
        return Err(CudaError::NvrtcEnv {
            var: NVRTC_LIB_ENV,
            reason: reason.clone(),
        });
    }
    // SAFETY: as above, for the names cudarc tries (one of them is the preloaded soname).
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::NoNvrtc {
            tried: candidates("nvrtc"),
        })
    }
}
