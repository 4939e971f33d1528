//! Finding the default model on disk.

use std::path::PathBuf;

/// File name of the default model (SmolLM2-135M-Instruct, GGUF Q4_1).
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The default model could not be found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the default model is not at {}; run `zerolayer pull` or `scripts/fetch-model` (they read $ZEROLAYER_HOME, default ~/.cache/zerolayer/models), or set ZEROLAYER_MODEL to a GGUF file",
    .looked_at.display()
)]
pub struct ModelNotFound {
    /// The path that was checked.
    pub looked_at: PathBuf,
}

/// The directory where `scripts/fetch-model` stores models: `$ZEROLAYER_HOME`, else
/// `~/.cache/zerolayer/models`.
pub fn model_cache_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("ZEROLAYER_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(home);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("zerolayer").join("models")
}

/// Path of the default model: `$ZEROLAYER_MODEL` if set, else the file in [`model_cache_dir`].
/// Fails with a message naming `scripts/fetch-model` when the file is absent.
///
/// ```no_run
/// let path = weight_cache::locate_default_model().expect("run scripts/fetch-model first");
/// println!("{}", path.display());
/// ```
pub fn locate_default_model() -> Result<PathBuf, ModelNotFound> {
    let path = match std::env::var_os("ZEROLAYER_MODEL").filter(|v| !v.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => model_cache_dir().join(DEFAULT_MODEL_FILE),
    };
    if path.is_file() {
        Ok(path)
    } else {
        Err(ModelNotFound { looked_at: path })
    }
}
