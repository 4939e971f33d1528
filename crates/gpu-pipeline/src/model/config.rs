//! Model hyperparameters read from GGUF metadata.

use weight_cache::Gguf;

use super::ModelError;

/// How RoPE pairs the dimensions of a head.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent pairs `(x[2i], x[2i+1])` (llama.cpp `LLAMA_ROPE_TYPE_NORM`: llama, mistral).
    Normal,
    /// Halves `(x[i], x[i + n_rot/2])` (GPT-NeoX style, llama.cpp `LLAMA_ROPE_TYPE_NEOX`: qwen2).
    Neox,
}

/// RoPE frequency scaling from `{arch}.rope.scaling.*`.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// No scaling.
    None,
    /// Linear position interpolation: positions are multiplied by `1 / factor`.
    Linear {
        /// `{arch}.rope.scaling.factor`.
        factor: f32,
    },
}

/// RoPE parameters.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    /// Pairing layout (from the architecture).
    pub layout: RopeLayout,
    /// Base frequency `{arch}.rope.freq_base` (10000 when absent).
    pub theta: f32,
    /// Rotated dimensions per head, `{arch}.rope.dimension_count` (head_dim when absent).
    pub n_rot: usize,
    /// Frequency scaling.
    pub scaling: RopeScaling,
    /// Per-frequency divisors from a `rope_freqs.weight` tensor (Llama 3.1 style), if the file
    /// has one: frequency `i` is divided by `freq_factors[i]`.
    pub freq_factors: Option<Vec<f32>>,
}

/// Hyperparameters of a Llama-family model, from GGUF metadata (nothing is hard-coded).
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let path = weight_cache::locate_default_model()?;
/// // SAFETY: the model file is not modified while mapped.
/// let gguf = unsafe { weight_cache::Gguf::open(path)? };
/// let cfg = gpu_pipeline::ModelConfig::from_gguf(&gguf)?;
/// assert_eq!((cfg.n_layers, cfg.n_embd, cfg.n_heads, cfg.n_kv_heads), (30, 576, 9, 3));
/// # Ok(()) }
/// ```
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// `general.architecture` (`llama`, `mistral`, `qwen2`).
    pub arch: String,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention when smaller than `n_heads`).
    pub n_kv_heads: usize,
    /// Elements per head (`{arch}.attention.key_length`, else `n_embd / n_heads`).
    pub head_dim: usize,
    /// MLP inner size.
    pub n_ff: usize,
    /// Vocabulary size (rows of the output head).
    pub vocab_size: usize,
    /// Trained context length.
    pub context_length: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// RoPE.
    pub rope: RopeConfig,
    /// End-of-sequence token (`tokenizer.ggml.eos_token_id`).
    pub eos_token_id: Option<u32>,
    /// End-of-turn token (`tokenizer.ggml.eot_token_id`), when the file names one.
    pub eot_token_id: Option<u32>,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
}

impl ModelConfig {
    /// Reads the configuration. Errors name the architecture or the missing/invalid key.
    pub fn from_gguf(g: &Gguf) -> Result<Self, ModelError> {
        let arch = g
            .get_str("general.architecture")
            .ok_or(ModelError::MissingMetadata {
                key: "general.architecture".into(),
            })?
            .to_string();
        let layout = match arch.as_str() {
            "llama" | "mistral" => RopeLayout::Normal,
            "qwen2" => RopeLayout::Neox,
            _ => return Err(ModelError::UnsupportedArchitecture { arch }),
        };
        let key = |k: &str| format!("{arch}.{k}");
        let req = |k: &str| -> Result<usize, ModelError> {
            let full = key(k);
            match g.get_u32(&full) {
                Some(v) if v > 0 => Ok(v as usize),
                Some(v) => Err(ModelError::InvalidMetadata {
                    key: full,
                    value: v.to_string(),
                }),
                None => Err(ModelError::MissingMetadata { key: full }),
            }
        };
        let n_layers = req("block_count")?;
        let n_embd = req("embedding_length")?;
        let n_heads = req("attention.head_count")?;
        let n_kv_heads = match g.get_u32(&key("attention.head_count_kv")) {
            Some(_) => req("attention.head_count_kv")?,
            None => n_heads,
        };
        let n_ff = req("feed_forward_length")?;
        let context_length = req("context_length")?;
        let head_dim = match g.get_u32(&key("attention.key_length")) {
            Some(_) => req("attention.key_length")?,
            None => n_embd / n_heads,
        };
        if n_heads % n_kv_heads != 0 || head_dim == 0 || head_dim % 2 != 0 {
            return Err(ModelError::InvalidMetadata {
                key: key("attention.head_count_kv"),
                value: format!("heads {n_heads}, kv heads {n_kv_heads}, head_dim {head_dim}"),
            });
        }
        let rms_eps = g
            .get_f32(&key("attention.layer_norm_rms_epsilon"))
            .unwrap_or(1e-5);
        if !(rms_eps > 0.0 && rms_eps < 1.0) {
            return Err(ModelError::InvalidMetadata {
                key: key("attention.layer_norm_rms_epsilon"),
                value: rms_eps.to_string(),
            });
        }
        let theta = g.get_f32(&key("rope.freq_base")).unwrap_or(10_000.0);
        if !(theta > 1.0 && theta.is_finite()) {
            return Err(ModelError::InvalidMetadata {
                key: key("rope.freq_base"),
                value: theta.to_string(),
            });
        }
        let n_rot = match g.get_u32(&key("rope.dimension_count")) {
            Some(_) => req("rope.dimension_count")?,
            None => head_dim,
        };
        if n_rot > head_dim || n_rot % 2 != 0 {
            return Err(ModelError::InvalidMetadata {
                key: key("rope.dimension_count"),
                value: n_rot.to_string(),
            });
        }
        let scaling = match g.get_str(&key("rope.scaling.type")) {
            None | Some("none") => RopeScaling::None,
            Some("linear") => {
                let factor = g.get_f32(&key("rope.scaling.factor")).unwrap_or(1.0);
                if !(factor > 0.0 && factor.is_finite()) {
                    return Err(ModelError::InvalidMetadata {
                        key: key("rope.scaling.factor"),
                        value: factor.to_string(),
                    });
                }
                if factor == 1.0 {
                    RopeScaling::None
                } else {
                    RopeScaling::Linear { factor }
                }
            }
            Some(other) => {
                return Err(ModelError::UnsupportedRopeScaling {
                    kind: other.to_string(),
                });
            }
        };
        let vocab_size = match g.tensor("token_embd.weight") {
            Some(t) => t.rows(),
            None => {
                return Err(ModelError::MissingTensor {
                    name: "token_embd.weight".into(),
                });
            }
        };
        let freq_factors = match g.tensor("rope_freqs.weight") {
            None => None,
            Some(t) => {
                if t.n_elements() != (n_rot / 2) as u64 {
                    return Err(ModelError::BadShape {
                        tensor: t.name.to_string(),
                        expected: vec![(n_rot / 2) as u64],
                        actual: t.shape.to_vec(),
                    });
                }
                let v = t.to_f32().map_err(|source| ModelError::Dequantize {
                    tensor: t.name.to_string(),
                    dtype: t.dtype,
                    source,
                })?;
                Some(v)
            }
        };
        Ok(Self {
            n_layers,
            n_embd,
            n_heads,
            n_kv_heads,
            head_dim,
            n_ff,
            vocab_size,
            context_length,
            rms_eps,
            rope: RopeConfig {
                layout,
                theta,
                n_rot,
                scaling,
                freq_factors,
            },
            eos_token_id: g.get_u32("tokenizer.ggml.eos_token_id"),
            eot_token_id: g.get_u32("tokenizer.ggml.eot_token_id"),
            bos_token_id: g.get_u32("tokenizer.ggml.bos_token_id"),
            arch,
        })
    }

    /// Query heads per key/value head.
    pub fn gqa_group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }
}
