//! Where a model's hyperparameters and weights come from: a GGUF file, or a Hugging Face model
//! directory translated to the same names.
//!
//! Everything above this module (the [`ModelConfig`](super::ModelConfig) reader, the loader, the
//! forward pass) speaks llama.cpp's vocabulary: GGUF metadata keys (`llama.block_count`,
//! `gemma2.attn_logit_softcapping`, ...) and GGUF tensor names (`blk.3.attn_q.weight`, shapes in
//! ggml order). A [`WeightSource`] answers in that vocabulary, so a new container format is a
//! translation, not a second graph.

use std::fmt::Debug;

use weight_cache::{GgmlType, Gguf};

/// A tensor of a [`WeightSource`], under its llama.cpp name.
#[derive(Clone, Debug)]
pub struct SourceTensor<'a> {
    /// Element type (a safetensors F32/F16/BF16 tensor reports `F32`/`F16`/`BF16`).
    pub dtype: GgmlType,
    /// Shape in ggml order: `shape[0]` is the row length (a PyTorch `[out, in]` weight is
    /// `[in, out]` here; the bytes are the same).
    pub shape: Vec<u64>,
    /// The data: a sub-slice of [`WeightSource::file_bytes`]`(file)`.
    pub data: &'a [u8],
    /// Which of the source's files holds the data.
    pub file: usize,
    /// Index of the tensor in a GGUF file's tensor list (for weight-cache profiling); `None` for
    /// other sources.
    pub gguf_index: Option<usize>,
}

impl SourceTensor<'_> {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Number of rows (product of `shape[1..]`).
    pub fn rows(&self) -> usize {
        self.shape.iter().skip(1).product::<u64>() as usize
    }

    /// The values as f32 (reference dequantizer).
    pub fn to_f32(&self) -> Result<Vec<f32>, weight_cache::DequantError> {
        let mut out = vec![0.0; self.n_elements() as usize];
        weight_cache::dequantize(self.dtype, self.data, &mut out)?;
        Ok(out)
    }
}

/// Metadata and weights of a model under llama.cpp's GGUF key and tensor names.
///
/// Besides llama.cpp's keys, a translating source may set these (a GGUF file never does):
/// - `zerolayer.rope.layout` (string `"norm"` / `"neox"`): overrides the architecture's RoPE
///   pairing (Hugging Face Llama checkpoints rotate halves; llama.cpp's converter permutes Q/K
///   to adjacent pairs instead).
/// - `zerolayer.norm.weight_offset` (f32): added to every RMSNorm weight as it is read (Gemma
///   checkpoints store `w - 1`; llama.cpp's converter adds the 1).
/// - `zerolayer.expert_weights_norm` (bool): whether the chosen experts' weights are divided by
///   their sum, over the family's default (Hugging Face's `norm_topk_prob`).
/// - `zerolayer.expert_layers` (bool per layer): which layers have experts; the others run the
///   dense `ffn_gate`/`ffn_up`/`ffn_down` of `feed_forward_length` (Qwen MoE's
///   `mlp_only_layers`, `decoder_sparse_step`).
///
/// Besides llama.cpp's stacked expert tensors (`blk.L.ffn_{gate,up,down}_exps.weight`, or
/// `ffn_gate_up_exps` with each expert's gate rows then its up rows), a source may serve each
/// expert's matrix on its own, 2-D: `blk.L.ffn_{gate,up,down}_exps.N.weight` for expert `N`.
///
/// ```
/// use gpu_pipeline::WeightSource;
/// # fn f(src: &dyn WeightSource) {
/// let layers = src.get_u32("llama.block_count");
/// let q = src.tensor("blk.0.attn_q.weight");
/// # }
/// ```
pub trait WeightSource: Send + Sync + Debug {
    /// A string value.
    fn get_str(&self, key: &str) -> Option<&str>;
    /// An unsigned integer value (any integer type that fits).
    fn get_u32(&self, key: &str) -> Option<u32>;
    /// A float value.
    fn get_f32(&self, key: &str) -> Option<f32>;
    /// A boolean value.
    fn get_bool(&self, key: &str) -> Option<bool>;
    /// An array of booleans (e.g. `{arch}.attention.sliding_window_pattern` per layer).
    fn get_bool_array(&self, key: &str) -> Option<Vec<bool>>;
    /// An array of floats.
    fn get_f32_array(&self, key: &str) -> Option<Vec<f32>>;
    /// An array of unsigned integers (e.g. a per-layer `{arch}.expert_used_count`). Required,
    /// not defaulted, so that a wrapping source cannot drop it by forgetting to forward it.
    fn get_u32_array(&self, key: &str) -> Option<Vec<u32>>;
    /// The tensor named `name` (llama.cpp's name), if present.
    fn tensor(&self, name: &str) -> Option<SourceTensor<'_>>;
    /// The bytes of file `file` (tensor data are sub-slices of these).
    fn file_bytes(&self, file: usize) -> &[u8];
    /// The GGUF file, when the source is one (weight-cache profiling, file watching).
    fn gguf(&self) -> Option<&std::sync::Arc<Gguf>> {
        None
    }
    /// Tells the source that bytes `range` of file `file` will not be read again (the model
    /// keeps its own copy): a mapped file drops those pages from the process's resident set.
    /// The default does nothing.
    fn release(&self, file: usize, range: std::ops::Range<usize>) {
        let _ = (file, range);
    }
    /// A name for the model: `general.name`, else the file or directory name.
    fn model_name(&self) -> Option<String> {
        self.get_str("general.name").map(str::to_string)
    }
    /// The chat template the model ships (Jinja source): GGUF `tokenizer.chat_template`, a
    /// Hugging Face directory's `tokenizer_config.json`.
    fn chat_template(&self) -> Option<String> {
        self.get_str("tokenizer.chat_template").map(str::to_string)
    }
}

impl WeightSource for Gguf {
    fn get_str(&self, key: &str) -> Option<&str> {
        Self::get_str(self, key)
    }
    fn get_u32(&self, key: &str) -> Option<u32> {
        Self::get_u32(self, key)
    }
    fn get_f32(&self, key: &str) -> Option<f32> {
        Self::get_f32(self, key)
    }
    fn get_bool(&self, key: &str) -> Option<bool> {
        Self::get_bool(self, key)
    }
    fn get_bool_array(&self, key: &str) -> Option<Vec<bool>> {
        let a = self.get_array(key)?;
        a.iter()
            .map(|v| match v {
                weight_cache::MetaValue::Bool(b) => Some(b),
                other => other.as_int().map(|i| i != 0),
            })
            .collect()
    }
    fn get_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        Self::get_f32_array(self, key)
    }
    fn get_u32_array(&self, key: &str) -> Option<Vec<u32>> {
        let a = self.get_array(key)?;
        a.iter()
            .map(|v| v.as_int().and_then(|i| u32::try_from(i).ok()))
            .collect()
    }
    fn tensor(&self, name: &str) -> Option<SourceTensor<'_>> {
        let t = Self::tensor(self, name)?;
        Some(SourceTensor {
            dtype: t.dtype,
            shape: t.shape.to_vec(),
            data: t.data,
            file: 0,
            gguf_index: Some(t.index),
        })
    }
    fn file_bytes(&self, _file: usize) -> &[u8] {
        self.bytes()
    }
    fn model_name(&self) -> Option<String> {
        if let Some(n) = Self::get_str(self, "general.name").filter(|n| !n.trim().is_empty()) {
            return Some(n.trim().to_string());
        }
        let p = self.path()?;
        Some(p.file_stem()?.to_string_lossy().into_owned())
    }
}

/// A shared GGUF file as a [`WeightSource`] that also hands out the file itself
/// ([`WeightSource::gguf`]) for weight-cache profiling and file watching.
///
/// ```no_run
/// use std::sync::Arc;
/// use gpu_pipeline::{GgufSource, WeightSource};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // SAFETY: the model file is not modified while mapped.
/// let gguf = Arc::new(unsafe { weight_cache::Gguf::open(weight_cache::locate_default_model()?)? });
/// let src = GgufSource(gguf);
/// assert_eq!(src.get_str("general.architecture"), Some("llama"));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct GgufSource(pub std::sync::Arc<Gguf>);

impl WeightSource for GgufSource {
    fn get_str(&self, key: &str) -> Option<&str> {
        self.0.get_str(key)
    }
    fn get_u32(&self, key: &str) -> Option<u32> {
        self.0.get_u32(key)
    }
    fn get_f32(&self, key: &str) -> Option<f32> {
        self.0.get_f32(key)
    }
    fn get_bool(&self, key: &str) -> Option<bool> {
        self.0.get_bool(key)
    }
    fn get_bool_array(&self, key: &str) -> Option<Vec<bool>> {
        WeightSource::get_bool_array(&*self.0, key)
    }
    fn get_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        self.0.get_f32_array(key)
    }
    fn get_u32_array(&self, key: &str) -> Option<Vec<u32>> {
        WeightSource::get_u32_array(&*self.0, key)
    }
    fn tensor(&self, name: &str) -> Option<SourceTensor<'_>> {
        WeightSource::tensor(&*self.0, name)
    }
    fn file_bytes(&self, _file: usize) -> &[u8] {
        self.0.bytes()
    }
    fn gguf(&self) -> Option<&std::sync::Arc<Gguf>> {
        Some(&self.0)
    }
    fn release(&self, file: usize, range: std::ops::Range<usize>) {
        if file == 0 {
            // Best effort: a file read into memory (not mapped) keeps its pages.
            let _ = self.0.release(range);
        }
    }
    fn model_name(&self) -> Option<String> {
        WeightSource::model_name(&*self.0)
    }
}
