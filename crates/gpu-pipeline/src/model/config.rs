//! Model hyperparameters, read from metadata under llama.cpp's GGUF key names.
//!
//! A family is a mapping from its metadata to the features below (norm placement, activation,
//! biases, RoPE per layer, window per layer, soft-caps, head and embedding scales); the forward
//! pass is one graph over those features. The mapping follows llama.cpp's per-architecture
//! loaders (`src/models/<arch>.cpp`), defaults included.

use weight_cache::Gguf;

use super::ModelError;
use super::source::WeightSource;

/// How RoPE pairs the dimensions of a head.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent pairs `(x[2i], x[2i+1])` (llama.cpp `LLAMA_ROPE_TYPE_NORM`: llama, smollm3).
    Normal,
    /// Halves `(x[i], x[i + n_rot/2])` (GPT-NeoX style, llama.cpp `LLAMA_ROPE_TYPE_NEOX`: qwen2,
    /// qwen3, gemma2, gemma3, phi3; Hugging Face checkpoints of every family).
    Neox,
}

/// RoPE frequency scaling from `{arch}.rope.scaling.*`.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// No scaling (Llama 3.1-style and LongRoPE factors are per-frequency
    /// [`RopeConfig::freq_factors`] instead).
    None,
    /// Linear position interpolation: positions are multiplied by `1 / factor`.
    Linear {
        /// `{arch}.rope.scaling.factor`.
        factor: f32,
    },
}

/// RoPE parameters of a group of layers.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    /// Pairing layout (from the architecture).
    pub layout: RopeLayout,
    /// Base frequency `{arch}.rope.freq_base` (10000 when absent; `rope.freq_base_swa` for
    /// sliding-window layers that have their own).
    pub theta: f32,
    /// Rotated dimensions per head, `{arch}.rope.dimension_count` (head_dim when absent).
    pub n_rot: usize,
    /// Frequency scaling.
    pub scaling: RopeScaling,
    /// Per-frequency divisors: frequency `i` is divided by `freq_factors[i]`. From a
    /// `rope_freqs.weight` tensor (Llama 3.1 files), computed from `rope.scaling.type = llama3`
    /// metadata, or LongRoPE's short factors (`rope_factors_short.weight`).
    pub freq_factors: Option<Vec<f32>>,
    /// LongRoPE's long factors (`rope_factors_long.weight`): used instead of `freq_factors`
    /// when the served context exceeds [`original_context`](Self::original_context), as
    /// llama.cpp chooses.
    pub long_freq_factors: Option<Vec<f32>>,
    /// `{arch}.rope.scaling.original_context_length` (the trained context when absent).
    pub original_context: usize,
    /// `{arch}.rope.scaling.attn_factor`: cos and sin are multiplied by it (1 when absent).
    pub attn_factor: f32,
}

/// The MLP's gated activation: `down(act(gate(x)) * up(x))`.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (SwiGLU): Llama, Qwen, Phi-3, SmolLM3.
    Silu,
    /// GELU, tanh approximation (GeGLU): Gemma.
    GeluTanh,
}

/// Which RoPE a layer applies.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerRope {
    /// [`ModelConfig::rope`].
    Global,
    /// [`ModelConfig::rope_local`] (sliding-window layers with their own base).
    Local,
    /// None (SmolLM3's every fourth layer).
    Off,
}

/// RMSNorm of the queries and keys before RoPE.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    /// None.
    Off,
    /// Each head's query and key over `head_dim` (Qwen 3, Qwen3-MoE, Gemma 3).
    PerHead,
    /// The whole query and key rows, all heads together (OLMoE: weights of `n_heads * head_dim`
    /// and `n_kv_heads * head_dim`).
    Full,
}

/// The mixture-of-experts feed-forward block of a model (llama.cpp's `build_moe_ffn`): a router
/// (`ffn_gate_inp`, in f32) scores every expert per token, softmax turns the scores into
/// probabilities, the `n_used` most probable experts run their gated MLPs (`ffn_gate_exps`,
/// `ffn_up_exps`, `ffn_down_exps`: `n_experts` matrices each, stacked), and their outputs are
/// summed weighted by those probabilities (renormalised to sum 1 where the family does).
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// `{arch}.expert_count`.
    pub n_experts: usize,
    /// `{arch}.expert_used_count`: experts per token (top-k); the most of any layer when the
    /// file gives one count per layer.
    pub n_used: usize,
    /// Experts per token in each layer: `{arch}.expert_used_count` as a per-layer array (which
    /// llama.cpp reads), else `n_used` everywhere.
    pub n_used_per_layer: Vec<usize>,
    /// Inner size of one expert's MLP: `{arch}.expert_feed_forward_length` (Qwen MoE; else
    /// `feed_forward_length / n_used` there), `feed_forward_length` (Mixtral, OLMoE).
    pub n_ff_expert: usize,
    /// The chosen experts' probabilities are divided by their sum (Mixtral, Qwen3-MoE: yes;
    /// OLMoE, Qwen2-MoE: no; llama.cpp's `norm_w` per family).
    pub norm_weights: bool,
    /// The weights are then multiplied by this (`{arch}.expert_weights_scale` where llama.cpp
    /// reads it; 1 for the families here).
    pub weights_scale: f32,
    /// Inner size of the shared expert every token runs (Qwen2-MoE,
    /// `{arch}.expert_shared_feed_forward_length`, else `feed_forward_length`); its output is
    /// scaled by `sigmoid(ffn_gate_inp_shexp · x)`.
    pub n_ff_shared: Option<usize>,
}

/// Most experts a layer may have (llama.cpp's `LLAMA_MAX_EXPERTS`).
pub const MAX_EXPERTS: usize = 1024;

/// Per-layer attention features.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerConfig {
    /// Sliding window: a query at position `p` sees keys at positions `> p - window`.
    pub window: Option<usize>,
    /// The layer's RoPE.
    pub rope: LayerRope,
    /// The layer's feed-forward block is the model's mixture of experts ([`ModelConfig::moe`]);
    /// `false`: a dense MLP of `n_ff` (every layer of a dense model; Qwen MoE's
    /// `mlp_only_layers`).
    pub experts: bool,
}

/// Hyperparameters of a decoder-only transformer, from metadata (nothing is hard-coded per
/// file; per-family defaults are llama.cpp's).
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
    /// `general.architecture` (`llama`, `mistral`, `qwen2`, `qwen3`, `gemma2`, `gemma3`,
    /// `phi3`, `smollm3`).
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
    /// Added to every RMSNorm weight as it is loaded (Gemma checkpoints store `w - 1`).
    pub norm_weight_offset: f32,
    /// RoPE of the full-attention layers.
    pub rope: RopeConfig,
    /// RoPE of sliding-window layers with their own base (Gemma 3's local layers).
    pub rope_local: Option<RopeConfig>,
    /// Per-layer window and RoPE, `n_layers` long.
    pub layers: Vec<LayerConfig>,
    /// MLP activation.
    pub activation: Activation,
    /// The token embedding is multiplied by this (Gemma: `sqrt(n_embd)`; else 1).
    pub embedding_scale: f32,
    /// Attention scores are `q·k * attention_scale` (`1/sqrt(head_dim)` unless the family or
    /// `{arch}.attention.scale` says otherwise).
    pub attention_scale: f32,
    /// Attention scores pass through `cap * tanh(s / cap)` (Gemma 2).
    pub attn_softcap: Option<f32>,
    /// Logits pass through `cap * tanh(l / cap)` (Gemma 2; Gemma 3 when the file sets it).
    pub final_softcap: Option<f32>,
    /// RMSNorm of queries and keys before RoPE.
    pub qk_norm: QkNorm,
    /// RMSNorm of the attention and MLP outputs before their residual adds (Gemma 2 and 3).
    pub post_norms: bool,
    /// End-of-sequence token (`tokenizer.ggml.eos_token_id`).
    pub eos_token_id: Option<u32>,
    /// End-of-turn token (`tokenizer.ggml.eot_token_id`), when the file names one.
    pub eot_token_id: Option<u32>,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// The mixture-of-experts block that replaces every layer's dense MLP (`None`: dense).
    pub moe: Option<MoeConfig>,
}

/// The architectures [`ModelConfig`] reads.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &[
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "smollm3", "qwen2moe",
    "qwen3moe", "olmoe",
];

impl ModelConfig {
    /// Reads the configuration of a GGUF file. Errors name the architecture or the
    /// missing/invalid key.
    pub fn from_gguf(g: &Gguf) -> Result<Self, ModelError> {
        Self::from_source(g)
    }

    /// Reads the configuration from any [`WeightSource`].
    pub fn from_source(g: &dyn WeightSource) -> Result<Self, ModelError> {
        let arch = g
            .get_str("general.architecture")
            .ok_or(ModelError::MissingMetadata {
                key: "general.architecture".into(),
            })?
            .to_string();
        let mut layout = match arch.as_str() {
            "llama" | "mistral" | "smollm3" => RopeLayout::Normal,
            "qwen2" | "qwen3" | "gemma2" | "gemma3" | "phi3" | "qwen2moe" | "qwen3moe"
            | "olmoe" => RopeLayout::Neox,
            _ => return Err(ModelError::UnsupportedArchitecture { arch }),
        };
        match g.get_str("zerolayer.rope.layout") {
            None => {}
            Some("norm") => layout = RopeLayout::Normal,
            Some("neox") => layout = RopeLayout::Neox,
            Some(other) => {
                return Err(ModelError::InvalidMetadata {
                    key: "zerolayer.rope.layout".into(),
                    value: other.to_string(),
                });
            }
        }
        let key = |k: &str| format!("{arch}.{k}");
        let invalid = |k: String, v: String| ModelError::InvalidMetadata { key: k, value: v };
        let req = |k: &str| -> Result<usize, ModelError> {
            let full = key(k);
            match g.get_u32(&full) {
                Some(v) if v > 0 => Ok(v as usize),
                Some(v) => Err(invalid(full, v.to_string())),
                None => Err(ModelError::MissingMetadata { key: full }),
            }
        };
        let opt = |k: &str| -> Result<Option<usize>, ModelError> {
            match g.get_u32(&key(k)) {
                Some(_) => req(k).map(Some),
                None => Ok(None),
            }
        };
        let n_layers = req("block_count")?;
        // Before anything is sized by it: the last block must exist (a corrupt count could
        // otherwise ask for gigabytes of per-layer tables).
        let last = format!("blk.{}.attn_norm.weight", n_layers - 1);
        if g.tensor(&last).is_none() {
            return Err(ModelError::MissingTensor { name: last });
        }
        let n_embd = req("embedding_length")?;
        let n_heads = req("attention.head_count")?;
        let n_kv_heads = opt("attention.head_count_kv")?.unwrap_or(n_heads);
        let n_ff = req("feed_forward_length")?;
        let context_length = req("context_length")?;
        let head_dim = opt("attention.key_length")?.unwrap_or(n_embd / n_heads);
        if let Some(v) = opt("attention.value_length")?
            && v != head_dim
        {
            return Err(invalid(
                key("attention.value_length"),
                format!("{v} (key_length {head_dim}; different K and V head sizes)"),
            ));
        }
        if n_heads % n_kv_heads != 0 || head_dim == 0 || head_dim % 2 != 0 {
            return Err(invalid(
                key("attention.head_count_kv"),
                format!("heads {n_heads}, kv heads {n_kv_heads}, head_dim {head_dim}"),
            ));
        }
        let rms_eps = g
            .get_f32(&key("attention.layer_norm_rms_epsilon"))
            .unwrap_or(1e-5);
        if !(rms_eps > 0.0 && rms_eps < 1.0) {
            return Err(invalid(
                key("attention.layer_norm_rms_epsilon"),
                rms_eps.to_string(),
            ));
        }
        let positive = |k: String, v: f32| -> Result<f32, ModelError> {
            if v > 0.0 && v.is_finite() {
                Ok(v)
            } else {
                Err(invalid(k, v.to_string()))
            }
        };
        let theta = g.get_f32(&key("rope.freq_base")).unwrap_or(10_000.0);
        if !(theta > 1.0 && theta.is_finite()) {
            return Err(invalid(key("rope.freq_base"), theta.to_string()));
        }
        let n_rot = opt("rope.dimension_count")?.unwrap_or(head_dim);
        if n_rot > head_dim || n_rot % 2 != 0 {
            return Err(invalid(key("rope.dimension_count"), n_rot.to_string()));
        }
        let original_context =
            opt("rope.scaling.original_context_length")?.unwrap_or(context_length);
        let attn_factor = match g.get_f32(&key("rope.scaling.attn_factor")) {
            Some(f) => positive(key("rope.scaling.attn_factor"), f)?,
            None => 1.0,
        };
        let factor = match g.get_f32(&key("rope.scaling.factor")) {
            Some(f) => positive(key("rope.scaling.factor"), f)?,
            None => 1.0,
        };
        let half = n_rot / 2;
        let factors = |tensor: &str, meta: &str| -> Result<Option<Vec<f32>>, ModelError> {
            if let Some(t) = g.tensor(tensor) {
                if t.n_elements() != half as u64 {
                    return Err(ModelError::BadShape {
                        tensor: tensor.into(),
                        expected: vec![half as u64],
                        actual: t.shape.clone(),
                    });
                }
                let v = t.to_f32().map_err(|source| ModelError::Dequantize {
                    tensor: tensor.into(),
                    dtype: t.dtype,
                    source,
                })?;
                return check_factors(tensor, v).map(Some);
            }
            match g.get_f32_array(meta) {
                Some(v) if v.len() == half => check_factors(meta, v).map(Some),
                Some(v) => Err(invalid(
                    meta.into(),
                    format!("{} values, need {half}", v.len()),
                )),
                None => Ok(None),
            }
        };
        let mut freq_factors = factors("rope_freqs.weight", "zerolayer.rope.freq_factors")?;
        let mut long_freq_factors = None;
        let mut scaling = RopeScaling::None;
        match g.get_str(&key("rope.scaling.type")) {
            None | Some("none") => {}
            Some("linear") => {
                if factor != 1.0 {
                    scaling = RopeScaling::Linear { factor };
                }
            }
            Some("llama3") => {
                if freq_factors.is_none() {
                    let low = g
                        .get_f32("zerolayer.rope.llama3.low_freq_factor")
                        .unwrap_or(1.0);
                    let high = g
                        .get_f32("zerolayer.rope.llama3.high_freq_factor")
                        .unwrap_or(4.0);
                    freq_factors = Some(llama3_factors(
                        theta,
                        n_rot,
                        factor,
                        low,
                        high,
                        original_context,
                    ));
                }
            }
            Some("longrope") => {}
            Some(other) => {
                return Err(ModelError::UnsupportedRopeScaling {
                    kind: other.to_string(),
                });
            }
        }
        if arch == "phi3" || g.tensor("rope_factors_short.weight").is_some() {
            if let Some(short) =
                factors("rope_factors_short.weight", "zerolayer.rope.factors_short")?
            {
                freq_factors = Some(short);
            }
            long_freq_factors = factors("rope_factors_long.weight", "zerolayer.rope.factors_long")?;
        }
        let rope = RopeConfig {
            layout,
            theta,
            n_rot,
            scaling,
            freq_factors,
            long_freq_factors,
            original_context,
            attn_factor,
        };

        // ---- per-family features (llama.cpp's src/models/<arch>.cpp)
        let gemma = arch == "gemma2" || arch == "gemma3";
        // A window of 0 means none (llama.cpp's gemma3: `found_swa && n_swa > 0`).
        let file_window = g
            .get_u32(&key("attention.sliding_window"))
            .map(|w| w as usize)
            .filter(|&w| w > 0);
        let (window, default_pattern): (Option<usize>, usize) = match arch.as_str() {
            "gemma2" => (Some(file_window.unwrap_or(4096)), 2),
            "gemma3" => (file_window, 6),
            // llama.cpp ignores Phi-3's window (converter bug, llama.cpp PR 13676); Qwen2 files
            // carry none. A Llama/Mistral file that sets one gets it on every layer.
            "llama" | "mistral" => (file_window, 0),
            _ => (None, 0),
        };
        let window = match g.get_u32("zerolayer.attention.sliding_window") {
            Some(0) => None,
            Some(w) => Some(w as usize),
            None => window,
        };
        let swa_layers: Vec<bool> = match window {
            None => vec![false; n_layers],
            Some(_) => match g.get_bool_array(&key("attention.sliding_window_pattern")) {
                Some(v) if v.len() == n_layers => v,
                Some(v) => {
                    return Err(invalid(
                        key("attention.sliding_window_pattern"),
                        format!("{} entries for {n_layers} layers", v.len()),
                    ));
                }
                None => {
                    let n = g
                        .get_u32(&key("attention.sliding_window_pattern"))
                        .map_or(default_pattern, |p| p as usize);
                    // llama.cpp's set_swa_pattern: layer il slides when il % n < n - 1 (the
                    // last of every n is global); n == 0: every layer slides.
                    (0..n_layers).map(|il| n == 0 || il % n < n - 1).collect()
                }
            },
        };
        // llama.cpp: Gemma 2's local layers default to the global base and scaling, Gemma 3's to
        // base 10000 without scaling; `rope.freq_base_swa` sets the base.
        let theta_swa = match g.get_f32(&key("rope.freq_base_swa")) {
            Some(t) if t > 1.0 && t.is_finite() => Some(t),
            Some(t) => return Err(invalid(key("rope.freq_base_swa"), t.to_string())),
            None => None,
        };
        let rope_local = match arch.as_str() {
            _ if window.is_none() => None,
            "gemma2" => Some(RopeConfig {
                theta: theta_swa.unwrap_or(theta),
                ..rope.clone()
            }),
            "gemma3" => Some(RopeConfig {
                theta: theta_swa.unwrap_or(10_000.0),
                scaling: RopeScaling::None,
                ..rope.clone()
            }),
            _ => None,
        }
        .filter(|l| *l != rope);
        let rope_on: Vec<bool> = match g.get_bool_array("zerolayer.rope.layers") {
            Some(v) if v.len() == n_layers => v,
            Some(v) => {
                return Err(invalid(
                    "zerolayer.rope.layers".into(),
                    format!("{} entries for {n_layers} layers", v.len()),
                ));
            }
            None if arch == "smollm3" => (0..n_layers).map(|il| (il + 1) % 4 != 0).collect(),
            None => vec![true; n_layers],
        };
        let mut layers = (0..n_layers)
            .map(|il| LayerConfig {
                window: window.filter(|_| swa_layers[il]),
                rope: if !rope_on[il] {
                    LayerRope::Off
                } else if swa_layers[il] && rope_local.is_some() {
                    LayerRope::Local
                } else {
                    LayerRope::Global
                },
                experts: false,
            })
            .collect::<Vec<_>>();
        let attention_scale = match g.get_f32(&key("attention.scale")) {
            Some(s) => positive(key("attention.scale"), s)?,
            // llama.cpp: Gemma 27B models scale by n_embd / n_head (query_pre_attn_scalar).
            None if (arch == "gemma2" && n_layers == 46)
                || (arch == "gemma3" && n_layers == 62) =>
            {
                1.0 / ((n_embd / n_heads) as f32).sqrt()
            }
            None => 1.0 / (head_dim as f32).sqrt(),
        };
        let cap = |k: &str, default: Option<f32>| -> Result<Option<f32>, ModelError> {
            match g.get_f32(&key(k)).or(default) {
                Some(0.0) => Ok(None),
                Some(c) => positive(key(k), c).map(Some),
                None => Ok(None),
            }
        };
        let (attn_softcap, final_softcap) = match arch.as_str() {
            "gemma2" => (
                cap("attn_logit_softcapping", Some(50.0))?,
                cap("final_logit_softcapping", Some(30.0))?,
            ),
            "gemma3" => (None, cap("final_logit_softcapping", None)?),
            _ => (None, None),
        };
        let moe = moe_config(g, &arch, n_ff, n_layers)?;
        let expert_layers: Vec<bool> = match g.get_bool_array("zerolayer.expert_layers") {
            Some(v) if v.len() == n_layers => v,
            Some(v) => {
                return Err(invalid(
                    "zerolayer.expert_layers".into(),
                    format!("{} entries for {n_layers} layers", v.len()),
                ));
            }
            None => vec![true; n_layers],
        };
        for (l, e) in layers.iter_mut().zip(&expert_layers) {
            l.experts = moe.is_some() && *e;
        }
        let vocab_size = match g.tensor("token_embd.weight") {
            Some(t) => t.rows(),
            None => {
                return Err(ModelError::MissingTensor {
                    name: "token_embd.weight".into(),
                });
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
            norm_weight_offset: g.get_f32("zerolayer.norm.weight_offset").unwrap_or(0.0),
            rope,
            rope_local,
            layers,
            activation: if gemma {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
            embedding_scale: if gemma { (n_embd as f32).sqrt() } else { 1.0 },
            attention_scale,
            attn_softcap,
            final_softcap,
            qk_norm: match arch.as_str() {
                "qwen3" | "qwen3moe" | "gemma3" => QkNorm::PerHead,
                "olmoe" => QkNorm::Full,
                _ => QkNorm::Off,
            },
            post_norms: gemma,
            eos_token_id: g.get_u32("tokenizer.ggml.eos_token_id"),
            eot_token_id: g.get_u32("tokenizer.ggml.eot_token_id"),
            bos_token_id: g.get_u32("tokenizer.ggml.bos_token_id"),
            moe,
            arch,
        })
    }

    /// Query heads per key/value head.
    pub fn gqa_group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// The RoPE of layer `il` (`None`: the layer has none).
    pub fn layer_rope(&self, il: usize) -> Option<&RopeConfig> {
        match self.layers.get(il)?.rope {
            LayerRope::Global => Some(&self.rope),
            LayerRope::Local => self.rope_local.as_ref(),
            LayerRope::Off => None,
        }
    }
}

/// The expert block of `arch`, from `{arch}.expert_*` (llama.cpp's loaders: `llama` is dense
/// without `expert_count`, the MoE families need it).
fn moe_config(
    g: &dyn WeightSource,
    arch: &str,
    n_ff: usize,
    n_layers: usize,
) -> Result<Option<MoeConfig>, ModelError> {
    let key = |k: &str| format!("{arch}.{k}");
    let moe_family = matches!(arch, "qwen2moe" | "qwen3moe" | "olmoe");
    if !moe_family && arch != "llama" {
        return Ok(None);
    }
    let experts = g.get_u32(&key("expert_count")).unwrap_or(0);
    if experts == 0 && !moe_family {
        return Ok(None);
    }
    // One count, or one per layer (llama.cpp's get_key_or_arr).
    let per_layer: Vec<u32> = match g.get_u32(&key("expert_used_count")) {
        Some(u) => vec![u; n_layers],
        None => match g.get_u32_array(&key("expert_used_count")) {
            Some(v) if v.len() == n_layers => v,
            Some(v) => {
                return Err(ModelError::InvalidMetadata {
                    key: key("expert_used_count"),
                    value: format!("{} entries for {n_layers} layers", v.len()),
                });
            }
            None => vec![0; n_layers.max(1)],
        },
    };
    let bad = per_layer
        .iter()
        .copied()
        .find(|&u| u == 0 || u > experts)
        .or_else(|| {
            (experts as usize > MAX_EXPERTS || experts == 0)
                .then_some(per_layer.first().copied().unwrap_or(0))
        });
    if let Some(used) = bad {
        return Err(ModelError::ExpertCount {
            arch: arch.to_string(),
            experts,
            used,
        });
    }
    let used = per_layer.iter().copied().max().unwrap_or(0);
    let (n_experts, n_used) = (experts as usize, used as usize);
    // llama.cpp: a length of 0 (or none) means the default.
    let sized = |k: &str, default: usize| {
        g.get_u32(&key(k))
            .filter(|&v| v > 0)
            .map_or(default, |v| v as usize)
    };
    let qwen = arch.starts_with("qwen");
    let n_ff_expert = if qwen {
        sized("expert_feed_forward_length", n_ff / n_used)
    } else {
        n_ff
    };
    if n_ff_expert == 0 {
        return Err(ModelError::InvalidMetadata {
            key: key("expert_feed_forward_length"),
            value: format!("0 (feed_forward_length {n_ff} / expert_used_count {n_used})"),
        });
    }
    let n_ff_shared = if arch == "qwen2moe" {
        Some(sized("expert_shared_feed_forward_length", n_ff))
    } else {
        None
    };
    Ok(Some(MoeConfig {
        n_experts,
        n_used,
        n_used_per_layer: per_layer.iter().map(|&u| u as usize).collect(),
        n_ff_expert,
        norm_weights: g
            .get_bool("zerolayer.expert_weights_norm")
            .unwrap_or(matches!(arch, "llama" | "qwen3moe")),
        weights_scale: 1.0,
        n_ff_shared,
    }))
}

fn check_factors(name: &str, v: Vec<f32>) -> Result<Vec<f32>, ModelError> {
    match v.iter().find(|f| !(**f > 0.0 && f.is_finite())) {
        Some(f) => Err(ModelError::InvalidMetadata {
            key: name.into(),
            value: format!("frequency factor {f}"),
        }),
        None => Ok(v),
    }
}

/// Llama 3.1's per-frequency RoPE divisors (what llama.cpp's converter writes as
/// `rope_freqs.weight`): wavelengths longer than `original / low` are divided by `factor`,
/// shorter than `original / high` kept, and smoothly blended between.
fn llama3_factors(
    theta: f32,
    n_rot: usize,
    factor: f32,
    low: f32,
    high: f32,
    original: usize,
) -> Vec<f32> {
    let (low_wl, high_wl) = (original as f64 / low as f64, original as f64 / high as f64);
    (0..n_rot / 2)
        .map(|i| {
            let freq = 1.0 / f64::from(theta).powf(2.0 * i as f64 / n_rot as f64);
            let wl = 2.0 * std::f64::consts::PI / freq;
            if wl < high_wl {
                1.0
            } else if wl > low_wl {
                factor
            } else {
                let smooth = (original as f64 / wl - low as f64) / (high as f64 - low as f64);
                (1.0 / ((1.0 - smooth) / factor as f64 + smooth)) as f32
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_factors_follow_the_three_bands() {
        // theta 500000, 128 dims, factor 8, original 8192 (Llama 3.1).
        let f = llama3_factors(500_000.0, 128, 8.0, 1.0, 4.0, 8192);
        assert_eq!(f.len(), 64);
        assert_eq!(f[0], 1.0); // highest frequency: kept
        assert_eq!(f[63], 8.0); // lowest: divided by the factor
        assert!(f.windows(2).all(|w| w[0] <= w[1]), "monotone: {f:?}");
        assert!(f.iter().any(|&x| x > 1.0 && x < 8.0), "a blended band");
    }
}
