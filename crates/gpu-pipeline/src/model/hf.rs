//! A Hugging Face model directory (`config.json`, `*.safetensors`, `tokenizer.json`) as a
//! [`WeightSource`]: `config.json` is translated to llama.cpp's GGUF metadata keys and the
//! checkpoint's tensor names to llama.cpp's, following llama.cpp's converter
//! (`convert_hf_to_gguf.py`, `gguf-py/gguf/tensor_mapping.py`). F32, F16 and BF16 weights are
//! served in place from the mapping; nothing is copied or converted.
//!
//! What differs from a converted GGUF file is said with the `zerolayer.*` keys that
//! [`WeightSource`] documents: Hugging Face checkpoints rotate halves of each head (llama.cpp's
//! converter permutes Llama's Q/K instead), Gemma stores RMSNorm weights as `w - 1`, and the
//! per-layer features (sliding windows, SmolLM3's layers without RoPE) come as arrays.
//!
//! Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): checkpoints hold one 2-D matrix
//! per expert (`block_sparse_moe.experts.N.w1/w2/w3`, `mlp.experts.N.{gate,up,down}_proj`, what
//! `save_pretrained` writes), served in place as `blk.L.ffn_{gate,up,down}_exps.N.weight`; or,
//! as transformers 5 holds them in memory, 3-D `mlp.experts.gate_up_proj` (`[experts, 2 ff,
//! hidden]`, gate first) and `mlp.experts.down_proj`, served as llama.cpp's stacked
//! `ffn_gate_up_exps` / `ffn_down_exps` (the same bytes). `norm_topk_prob` is said with
//! `zerolayer.expert_weights_norm`, dense layers among sparse ones (`mlp_only_layers`,
//! `decoder_sparse_step`) with `zerolayer.expert_layers`.
//!
//! One difference from transformers is llama.cpp's on purpose: LongRoPE (Phi-3) picks its short
//! or long factors by the served context ([`ModelOptions::with_context`](super::ModelOptions)),
//! once, where transformers picks them by the length of each sequence. Serve at most
//! `original_max_position_embeddings` to get transformers' results on shorter sequences.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use weight_cache::{GgmlType, Safetensors, SafetensorsError, StDtype};

use super::source::{SourceTensor, WeightSource};

/// More layers than any released model has by far: a config saying more is refused before
/// anything is sized by it.
const MAX_LAYERS: u32 = 1 << 16;

/// The `architectures[0]` values [`open`] accepts, with the llama.cpp architecture each maps to.
pub const HF_ARCHITECTURES: &[(&str, &str)] = &[
    ("LlamaForCausalLM", "llama"),
    ("MistralForCausalLM", "mistral"),
    ("Qwen2ForCausalLM", "qwen2"),
    ("Qwen3ForCausalLM", "qwen3"),
    ("Gemma2ForCausalLM", "gemma2"),
    ("Gemma3ForCausalLM", "gemma3"),
    ("Phi3ForCausalLM", "phi3"),
    ("SmolLM3ForCausalLM", "smollm3"),
    ("MixtralForCausalLM", "llama"),
    ("Qwen2MoeForCausalLM", "qwen2moe"),
    ("Qwen3MoeForCausalLM", "qwen3moe"),
    ("OlmoeForCausalLM", "olmoe"),
];

/// Why a Hugging Face model directory could not be opened.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// A file the directory must have is not there (`config.json`; a safetensors file).
    #[error("{path}: missing")]
    MissingFile {
        /// The file looked for.
        path: PathBuf,
    },
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A JSON file is not valid JSON (or not an object).
    #[error("{path}: bad JSON: {reason}")]
    BadJson {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        reason: String,
    },
    /// A key the translation needs is missing from a JSON file.
    #[error("{path}: missing key `{key}`")]
    MissingKey {
        /// The file.
        path: PathBuf,
        /// The key (dotted for nested keys).
        key: String,
    },
    /// A key has a value of the wrong type or out of range.
    #[error("{path}: key `{key}`: invalid value {value}")]
    BadValue {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// The value, as JSON.
        value: String,
    },
    /// `architectures[0]` of `config.json` is not one we serve.
    #[error(
        "{path}: architecture {found:?} is not supported (supported: {})",
        supported.join(", ")
    )]
    UnsupportedArchitecture {
        /// `config.json`.
        path: PathBuf,
        /// `architectures[0]`.
        found: String,
        /// The supported names.
        supported: Vec<&'static str>,
    },
    /// A RoPE scaling type other than default, linear, llama3 and longrope.
    #[error(
        "{path}: RoPE scaling type {kind:?} is not supported (default, linear, llama3, longrope)"
    )]
    UnsupportedRopeScaling {
        /// `config.json`.
        path: PathBuf,
        /// `rope_type`.
        kind: String,
    },
    /// `config.json` asks for something the forward pass does not compute (an MLP bias, an
    /// activation other than the family's, Gemma 3 attention soft-capping, ...).
    #[error("{path}: `{key}` = {value} is not supported: {reason}")]
    UnsupportedFeature {
        /// `config.json`.
        path: PathBuf,
        /// The key.
        key: String,
        /// Its value, as JSON.
        value: String,
        /// What the forward pass does instead.
        reason: &'static str,
    },
    /// A safetensors file could not be parsed.
    #[error("{path}: {source}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        source: SafetensorsError,
    },
    /// `model.safetensors.index.json` names a tensor that its shard does not hold.
    #[error("{shard}: tensor {tensor:?} (named by model.safetensors.index.json) is missing")]
    TensorMissingFromShard {
        /// The tensor.
        tensor: String,
        /// The shard the index names.
        shard: PathBuf,
    },
    /// A weight the model uses has a dtype other than F32, F16 or BF16.
    #[error("{path}: tensor {tensor:?} has dtype {dtype:?} (F32, F16 or BF16 are served)")]
    UnsupportedDtype {
        /// The file.
        path: PathBuf,
        /// The tensor (Hugging Face name).
        tensor: String,
        /// Its dtype.
        dtype: StDtype,
    },
    /// Two files hold a tensor of the same name.
    #[error("tensor {tensor:?} is in both {first} and {second}")]
    DuplicateTensor {
        /// The tensor (Hugging Face name).
        tensor: String,
        /// The first file holding it.
        first: PathBuf,
        /// The second.
        second: PathBuf,
    },
}

#[derive(Clone, Debug, PartialEq)]
enum Meta {
    Str(String),
    U32(u32),
    F32(f32),
    Bool(bool),
    Bools(Vec<bool>),
    F32s(Vec<f32>),
}

#[derive(Clone, Debug)]
struct TensorRef {
    file: usize,
    hf_name: String,
}

/// A Hugging Face model directory served as a [`WeightSource`] (see the [module](self) docs).
///
/// ```no_run
/// use std::sync::Arc;
/// use gpu_pipeline::{HfModel, Model, ModelOptions};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // SAFETY: the model files are not modified while mapped.
/// let src = unsafe { HfModel::open("models/SmolLM3-3B")? };
/// let tokenizer = token_stream::Tokenizer::from_tokenizer_json_file(src.tokenizer_json_path())?;
/// let template = match src.chat_template() {
///     Some(t) => Some(token_stream::ChatTemplate::new(&t, "", "<|im_end|>")?),
///     None => None,
/// };
/// let model = Model::load_source(Arc::new(src), ModelOptions::default())?;
/// # let _ = (tokenizer, template, model);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct HfModel {
    dir: PathBuf,
    name: String,
    files: Vec<Safetensors>,
    meta: HashMap<String, Meta>,
    tensors: HashMap<String, TensorRef>,
    eos_token_ids: Vec<u32>,
    chat_template: Option<String>,
}

/// Opens the Hugging Face model directory `dir`: reads `config.json` (and
/// `generation_config.json`, `tokenizer_config.json` when present) and maps `model.safetensors`,
/// or every shard named by `model.safetensors.index.json` (one [`SourceTensor::file`] per
/// shard).
///
/// # Safety
/// The safetensors files must not be modified or truncated while the returned value (or a
/// model loaded from it) lives.
pub unsafe fn open(dir: impl AsRef<Path>) -> Result<HfModel, HfError> {
    let dir = dir.as_ref().to_path_buf();
    let config_path = dir.join("config.json");
    let config = read_json(&config_path, true)?.unwrap_or_default();
    let generation = read_json(&dir.join("generation_config.json"), false)?;
    let tokenizer_config = read_json(&dir.join("tokenizer_config.json"), false)?;

    let translated = translate_config(&config_path, &config, generation.as_ref())?;
    let arch = translated.arch;

    // Shards: the index's, in order of first appearance, or the single file.
    let index_path = dir.join("model.safetensors.index.json");
    let (shard_names, index_map): (Vec<String>, Vec<(String, String)>) =
        match read_json(&index_path, false)? {
            Some(index) => {
                let map = index
                    .get("weight_map")
                    .and_then(Value::as_object)
                    .ok_or_else(|| HfError::MissingKey {
                        path: index_path.clone(),
                        key: "weight_map".into(),
                    })?;
                let mut names: Vec<String> = Vec::new();
                let mut pairs = Vec::with_capacity(map.len());
                for (tensor, shard) in map {
                    let shard = shard.as_str().ok_or_else(|| HfError::BadValue {
                        path: index_path.clone(),
                        key: format!("weight_map.{tensor}"),
                        value: shard.to_string(),
                    })?;
                    if !names.iter().any(|n| n == shard) {
                        names.push(shard.to_string());
                    }
                    pairs.push((tensor.clone(), shard.to_string()));
                }
                (names, pairs)
            }
            None => (vec!["model.safetensors".into()], Vec::new()),
        };
    let mut files = Vec::with_capacity(shard_names.len());
    for name in &shard_names {
        let path = dir.join(name);
        if !path.is_file() {
            return Err(HfError::MissingFile { path });
        }
        // SAFETY: forwarded to our caller.
        let st = unsafe { Safetensors::open(&path) }.map_err(|source| HfError::Safetensors {
            path: path.clone(),
            source,
        })?;
        files.push(st);
    }
    for (tensor, shard) in &index_map {
        let file = shard_names.iter().position(|n| n == shard).unwrap_or(0);
        if files[file].tensor(tensor).is_none() {
            return Err(HfError::TensorMissingFromShard {
                tensor: tensor.clone(),
                shard: dir.join(shard),
            });
        }
    }

    let mut tensors: HashMap<String, TensorRef> = HashMap::new();
    for (file, st) in files.iter().enumerate() {
        for t in st.tensors() {
            let Some(gguf_name) = gguf_tensor_name(&arch, t.name) else {
                continue;
            };
            if ggml_dtype(t.dtype).is_none() {
                return Err(HfError::UnsupportedDtype {
                    path: dir.join(&shard_names[file]),
                    tensor: t.name.to_string(),
                    dtype: t.dtype,
                });
            }
            if let Some(prev) = tensors.get(&gguf_name) {
                return Err(HfError::DuplicateTensor {
                    tensor: t.name.to_string(),
                    first: dir.join(&shard_names[prev.file]),
                    second: dir.join(&shard_names[file]),
                });
            }
            tensors.insert(
                gguf_name,
                TensorRef {
                    file,
                    hf_name: t.name.to_string(),
                },
            );
        }
    }

    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut meta = translated.meta;
    meta.insert("general.name".into(), Meta::Str(name.clone()));
    let chat_template = tokenizer_config.as_ref().and_then(chat_template_of);
    Ok(HfModel {
        dir,
        name,
        files,
        meta,
        tensors,
        eos_token_ids: translated.eos_token_ids,
        chat_template,
    })
}

impl HfModel {
    /// [`open`]: opens the Hugging Face model directory `dir`.
    ///
    /// # Safety
    /// As for [`open`]: the safetensors files must not be modified or truncated while the
    /// returned value (or a model loaded from it) lives.
    pub unsafe fn open(dir: impl AsRef<Path>) -> Result<Self, HfError> {
        // SAFETY: forwarded to our caller.
        unsafe { open(dir) }
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `tokenizer.json` in the directory (for `token_stream::Tokenizer::from_tokenizer_json_file`).
    pub fn tokenizer_json_path(&self) -> PathBuf {
        self.dir.join("tokenizer.json")
    }

    /// The chat template of `tokenizer_config.json` (`chat_template` as a string, or the
    /// `default` entry of its list form, else the first entry).
    pub fn chat_template(&self) -> Option<String> {
        self.chat_template.clone()
    }

    /// Every end-of-sequence token (`eos_token_id` may be a list; `generation_config.json`'s
    /// wins over `config.json`'s). The first is `tokenizer.ggml.eos_token_id`.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// The Hugging Face name of the tensor served as `gguf_name` (llama.cpp's name).
    pub fn hf_tensor_name(&self, gguf_name: &str) -> Option<&str> {
        self.tensors.get(gguf_name).map(|t| t.hf_name.as_str())
    }

    /// The llama.cpp names of the served tensors.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }
}

impl WeightSource for HfModel {
    fn get_str(&self, key: &str) -> Option<&str> {
        match self.meta.get(key)? {
            Meta::Str(s) => Some(s),
            _ => None,
        }
    }
    fn get_u32(&self, key: &str) -> Option<u32> {
        match self.meta.get(key)? {
            Meta::U32(v) => Some(*v),
            _ => None,
        }
    }
    fn get_f32(&self, key: &str) -> Option<f32> {
        match self.meta.get(key)? {
            Meta::F32(v) => Some(*v),
            Meta::U32(v) => Some(*v as f32),
            _ => None,
        }
    }
    fn get_bool(&self, key: &str) -> Option<bool> {
        match self.meta.get(key)? {
            Meta::Bool(v) => Some(*v),
            _ => None,
        }
    }
    fn get_bool_array(&self, key: &str) -> Option<Vec<bool>> {
        match self.meta.get(key)? {
            Meta::Bools(v) => Some(v.clone()),
            _ => None,
        }
    }
    fn get_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        match self.meta.get(key)? {
            Meta::F32s(v) => Some(v.clone()),
            _ => None,
        }
    }
    fn get_u32_array(&self, key: &str) -> Option<Vec<u32>> {
        // config.json translates to no integer arrays (one `num_experts_per_tok` for all layers).
        let _ = key;
        None
    }
    fn tensor(&self, name: &str) -> Option<SourceTensor<'_>> {
        let r = self.tensors.get(name)?;
        let t = self.files[r.file].tensor(&r.hf_name)?;
        Some(SourceTensor {
            dtype: ggml_dtype(t.dtype)?,
            // PyTorch [out, in] is ggml [in, out]: the same bytes, the shape reversed.
            shape: t.shape.iter().rev().copied().collect(),
            data: t.data,
            file: r.file,
            gguf_index: None,
        })
    }
    fn file_bytes(&self, file: usize) -> &[u8] {
        self.files.get(file).map_or(&[], |f| f.bytes())
    }
    fn model_name(&self) -> Option<String> {
        Some(self.name.clone())
    }
    fn chat_template(&self) -> Option<String> {
        Self::chat_template(self)
    }
}

fn ggml_dtype(d: StDtype) -> Option<GgmlType> {
    match d {
        StDtype::F32 => Some(GgmlType::F32),
        StDtype::F16 => Some(GgmlType::F16),
        StDtype::BF16 => Some(GgmlType::BF16),
        _ => None,
    }
}

/// llama.cpp's name of a Hugging Face tensor of architecture `arch` (llama.cpp's name), or
/// `None` for tensors the forward pass does not use.
fn gguf_tensor_name(arch: &str, hf: &str) -> Option<String> {
    let gemma = arch == "gemma2" || arch == "gemma3";
    // transformers 5's fused experts: 3-D parameters without a `.weight` suffix.
    if let Some(rest) = hf.strip_prefix("model.layers.") {
        let (layer, part) = rest.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        match part {
            "mlp.experts.gate_up_proj" => {
                return Some(format!("blk.{layer}.ffn_gate_up_exps.weight"));
            }
            "mlp.experts.down_proj" => return Some(format!("blk.{layer}.ffn_down_exps.weight")),
            _ => {}
        }
    }
    let (stem, suffix) = hf.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let stem = stem.strip_prefix("model.").unwrap_or(stem);
    let base = match stem {
        "embed_tokens" => Some("token_embd".to_string()),
        "norm" => Some("output_norm".to_string()),
        "lm_head" => Some("output".to_string()),
        _ => None,
    };
    if let Some(b) = base {
        return Some(format!("{b}.{suffix}"));
    }
    let rest = stem.strip_prefix("layers.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let name = match part {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.qkv_proj" => "attn_qkv",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        // Gemma norms the attention output with it; everyone else norms the MLP input.
        "post_attention_layernorm" if gemma => "post_attention_norm",
        "post_attention_layernorm" => "ffn_norm",
        "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.gate_up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        // Mixtures of experts: the router, the shared expert and its gate (Qwen2-MoE).
        "mlp.gate" | "block_sparse_moe.gate" => "ffn_gate_inp",
        "mlp.shared_expert.gate_proj" => "ffn_gate_shexp",
        "mlp.shared_expert.up_proj" => "ffn_up_shexp",
        "mlp.shared_expert.down_proj" => "ffn_down_shexp",
        "mlp.shared_expert_gate" => "ffn_gate_inp_shexp",
        _ => return expert_tensor_name(layer, part, suffix),
    };
    Some(format!("blk.{layer}.{name}.{suffix}"))
}

/// One expert's matrix (`mlp.experts.N.gate_proj`, Mixtral's `block_sparse_moe.experts.N.w1`,
/// ...) as expert `N` of llama.cpp's stack: `blk.L.ffn_gate_exps.N.weight`.
fn expert_tensor_name(layer: usize, part: &str, suffix: &str) -> Option<String> {
    let rest = part
        .strip_prefix("mlp.experts.")
        .or_else(|| part.strip_prefix("block_sparse_moe.experts."))?;
    let (expert, proj) = rest.split_once('.')?;
    let expert: usize = expert.parse().ok()?;
    let name = match proj {
        "gate_proj" | "w1" => "ffn_gate_exps",
        "up_proj" | "w3" => "ffn_up_exps",
        "down_proj" | "w2" => "ffn_down_exps",
        _ => return None,
    };
    (suffix == "weight").then(|| format!("blk.{layer}.{name}.{expert}.weight"))
}

fn read_json(path: &Path, required: bool) -> Result<Option<Value>, HfError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return if required {
                Err(HfError::MissingFile {
                    path: path.to_path_buf(),
                })
            } else {
                Ok(None)
            };
        }
        Err(source) => {
            return Err(HfError::Io {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    let v: Value = serde_json::from_str(&text).map_err(|e| HfError::BadJson {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    if !v.is_object() {
        return Err(HfError::BadJson {
            path: path.to_path_buf(),
            reason: "not a JSON object".into(),
        });
    }
    Ok(Some(v))
}

fn chat_template_of(tc: &Value) -> Option<String> {
    match tc.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => {
            let entry = |e: &Value| -> Option<(String, String)> {
                Some((
                    e.get("name")?.as_str()?.to_string(),
                    e.get("template")?.as_str()?.to_string(),
                ))
            };
            let all: Vec<(String, String)> = list.iter().filter_map(entry).collect();
            all.iter()
                .find(|(n, _)| n == "default")
                .or(all.first())
                .map(|(_, t)| t.clone())
        }
        _ => None,
    }
}

struct Translated {
    arch: String,
    meta: HashMap<String, Meta>,
    eos_token_ids: Vec<u32>,
}

/// Reads `config.json` keys with typed errors naming the file and key.
struct Reader<'a> {
    path: &'a Path,
    obj: &'a Map<String, Value>,
}

impl<'a> Reader<'a> {
    /// A key that is absent or `null` reads as `None`.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }
    fn bad(&self, key: &str, v: &Value) -> HfError {
        HfError::BadValue {
            path: self.path.to_path_buf(),
            key: key.into(),
            value: v.to_string(),
        }
    }
    fn u32_opt(&self, key: &str) -> Result<Option<u32>, HfError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| self.bad(key, v)),
        }
    }
    fn u32_req(&self, key: &str) -> Result<u32, HfError> {
        self.u32_opt(key)?.ok_or_else(|| HfError::MissingKey {
            path: self.path.to_path_buf(),
            key: key.into(),
        })
    }
    fn f32_opt(&self, key: &str) -> Result<Option<f32>, HfError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| self.bad(key, v)),
        }
    }
    fn bool_opt(&self, key: &str) -> Result<Option<bool>, HfError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.bad(key, v)),
        }
    }
    fn str_opt(&self, key: &str) -> Result<Option<&'a str>, HfError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.bad(key, v)),
        }
    }
    fn f32_list(&self, key: &str) -> Result<Option<Vec<f32>>, HfError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_array()
                .and_then(|a| a.iter().map(|x| x.as_f64().map(|f| f as f32)).collect())
                .map(Some)
                .ok_or_else(|| self.bad(key, v)),
        }
    }
    /// A token id or a list of them.
    fn ids(&self, key: &str) -> Result<Option<Vec<u32>>, HfError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                let one = |x: &Value| x.as_u64().and_then(|i| u32::try_from(i).ok());
                match v {
                    Value::Array(a) => a.iter().map(one).collect::<Option<Vec<u32>>>(),
                    _ => one(v).map(|i| vec![i]),
                }
                .map(Some)
                .ok_or_else(|| self.bad(key, v))
            }
        }
    }
}

/// The RoPE parameters of a layer type: `rope_parameters` (transformers 5; per layer type for
/// Gemma 3), else `rope_theta` and `rope_scaling` (older files).
fn rope_parameters<'a>(cfg: &Reader<'a>, layer_type: &str) -> Result<Option<Reader<'a>>, HfError> {
    if let Some(v) = cfg.get("rope_parameters") {
        let obj = v.as_object().ok_or_else(|| cfg.bad("rope_parameters", v))?;
        let per_type = obj.get(layer_type).and_then(Value::as_object);
        return Ok(Some(Reader {
            path: cfg.path,
            obj: per_type.unwrap_or(obj),
        }));
    }
    match cfg.get("rope_scaling") {
        None => Ok(None),
        Some(v) => {
            let obj = v.as_object().ok_or_else(|| cfg.bad("rope_scaling", v))?;
            Ok(Some(Reader {
                path: cfg.path,
                obj,
            }))
        }
    }
}

/// Refuses settings the forward pass would silently ignore.
fn check_features(cfg: &Reader<'_>, arch: &str) -> Result<(), HfError> {
    let gemma = arch == "gemma2" || arch == "gemma3";
    let unsupported = |key: &str, v: &Value, reason| HfError::UnsupportedFeature {
        path: cfg.path.to_path_buf(),
        key: key.into(),
        value: v.to_string(),
        reason,
    };
    let (act_key, act_ok, reason): (&str, &[&str], _) = if gemma {
        (
            "hidden_activation",
            &["gelu_pytorch_tanh", "gelu_tanh"],
            "Gemma's MLP is GeGLU with tanh-approximated GELU",
        )
    } else {
        ("hidden_act", &["silu", "swish"], "the MLP is SwiGLU (SiLU)")
    };
    if let Some(v) = cfg.get(act_key)
        && !v.as_str().is_some_and(|a| act_ok.contains(&a))
    {
        return Err(unsupported(act_key, v, reason));
    }
    if let Some(v) = cfg.get("mlp_bias")
        && v.as_bool() != Some(false)
    {
        return Err(unsupported("mlp_bias", v, "the MLP has no biases"));
    }
    if let Some(v) = cfg.get("clip_qkv") {
        return Err(unsupported(
            "clip_qkv",
            v,
            "queries, keys and values are not clipped",
        ));
    }
    if arch == "gemma3"
        && let Some(v) = cfg.get("attn_logit_softcapping")
    {
        return Err(unsupported(
            "attn_logit_softcapping",
            v,
            "Gemma 3 attention scores are not soft-capped",
        ));
    }
    if arch == "gemma3"
        && let Some(kind) = cfg
            .get("rope_parameters")
            .and_then(|r| r.get("sliding_attention"))
            .and_then(|r| r.get("rope_type"))
            .filter(|t| t.as_str() != Some("default"))
    {
        return Err(unsupported(
            "rope_parameters.sliding_attention.rope_type",
            kind,
            "Gemma 3's local layers rotate without scaling",
        ));
    }
    Ok(())
}

/// The mixture-of-experts keys: counts, the expert FFN sizes, whether the chosen experts'
/// weights are renormalised, which layers have experts.
fn experts(
    cfg: &Reader<'_>,
    arch: &str,
    n_layers: u32,
    put: &mut impl FnMut(String, Meta),
) -> Result<(), HfError> {
    let k = |s: &str| format!("{arch}.{s}");
    // Mixtral says `num_local_experts`; the others `num_experts` (transformers 5 writes
    // `num_local_experts` for Qwen3-MoE too).
    let count = match cfg.u32_opt("num_experts")? {
        Some(n) => Some(n),
        None => cfg.u32_opt("num_local_experts")?,
    };
    let Some(count) = count.filter(|&n| n > 0) else {
        return Ok(());
    };
    put(k("expert_count"), Meta::U32(count));
    put(
        k("expert_used_count"),
        Meta::U32(cfg.u32_req("num_experts_per_tok")?),
    );
    if let Some(ff) = cfg.u32_opt("moe_intermediate_size")? {
        put(k("expert_feed_forward_length"), Meta::U32(ff));
    }
    if let Some(ff) = cfg.u32_opt("shared_expert_intermediate_size")? {
        put(k("expert_shared_feed_forward_length"), Meta::U32(ff));
    }
    // transformers: Mixtral always renormalises; the others as `norm_topk_prob` says (false
    // when absent).
    let norm = arch == "llama" || cfg.bool_opt("norm_topk_prob")?.unwrap_or(false);
    put("zerolayer.expert_weights_norm".into(), Meta::Bool(norm));
    // Qwen MoE: layer `il` has experts unless listed in `mlp_only_layers`, and only every
    // `decoder_sparse_step`-th.
    let step = cfg.u32_opt("decoder_sparse_step")?.unwrap_or(1);
    if step == 0 {
        return Err(cfg.bad("decoder_sparse_step", &Value::from(0)));
    }
    let dense: Vec<u64> = match cfg.get("mlp_only_layers") {
        None => Vec::new(),
        Some(v) => v
            .as_array()
            .and_then(|a| a.iter().map(Value::as_u64).collect())
            .ok_or_else(|| cfg.bad("mlp_only_layers", v))?,
    };
    let sparse: Vec<bool> = (0..n_layers)
        .map(|il| !dense.contains(&u64::from(il)) && (il + 1) % step == 0)
        .collect();
    if sparse.iter().any(|s| !s) {
        put("zerolayer.expert_layers".into(), Meta::Bools(sparse));
    }
    Ok(())
}

fn translate_config(
    path: &Path,
    config: &Value,
    generation: Option<&Value>,
) -> Result<Translated, HfError> {
    let obj = config.as_object().ok_or_else(|| HfError::BadJson {
        path: path.to_path_buf(),
        reason: "not a JSON object".into(),
    })?;
    let cfg = Reader { path, obj };
    let hf_arch = match cfg.get("architectures") {
        None => {
            return Err(HfError::MissingKey {
                path: path.to_path_buf(),
                key: "architectures".into(),
            });
        }
        Some(v) => v
            .as_array()
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .ok_or_else(|| cfg.bad("architectures", v))?,
    };
    let arch = HF_ARCHITECTURES
        .iter()
        .find(|(hf, _)| *hf == hf_arch)
        .map(|(_, a)| a.to_string())
        .ok_or_else(|| HfError::UnsupportedArchitecture {
            path: path.to_path_buf(),
            found: hf_arch.to_string(),
            supported: HF_ARCHITECTURES.iter().map(|(hf, _)| *hf).collect(),
        })?;
    let mut meta: HashMap<String, Meta> = HashMap::new();
    let k = |s: &str| format!("{arch}.{s}");
    let mut put = |key: String, v: Meta| {
        meta.insert(key, v);
    };
    put("general.architecture".into(), Meta::Str(arch.clone()));
    // Hugging Face checkpoints of every family rotate halves.
    put("zerolayer.rope.layout".into(), Meta::Str("neox".into()));
    let gemma = arch == "gemma2" || arch == "gemma3";
    if gemma {
        put("zerolayer.norm.weight_offset".into(), Meta::F32(1.0));
    }

    check_features(&cfg, &arch)?;
    let n_layers = cfg.u32_req("num_hidden_layers")?;
    if n_layers == 0 || n_layers > MAX_LAYERS {
        return Err(cfg.bad("num_hidden_layers", &Value::from(n_layers)));
    }
    let n_embd = cfg.u32_req("hidden_size")?;
    let n_heads = cfg.u32_req("num_attention_heads")?;
    if n_heads == 0 {
        return Err(cfg.bad("num_attention_heads", &Value::from(0)));
    }
    let n_kv = cfg.u32_opt("num_key_value_heads")?.unwrap_or(n_heads);
    let head_dim = cfg.u32_opt("head_dim")?.unwrap_or(n_embd / n_heads);
    put(k("block_count"), Meta::U32(n_layers));
    put(k("embedding_length"), Meta::U32(n_embd));
    put(
        k("feed_forward_length"),
        Meta::U32(cfg.u32_req("intermediate_size")?),
    );
    put(k("attention.head_count"), Meta::U32(n_heads));
    put(k("attention.head_count_kv"), Meta::U32(n_kv));
    put(k("attention.key_length"), Meta::U32(head_dim));
    put(k("attention.value_length"), Meta::U32(head_dim));
    let context = cfg.u32_req("max_position_embeddings")?;
    put(k("context_length"), Meta::U32(context));
    if let Some(eps) = cfg.f32_opt("rms_norm_eps")? {
        put(k("attention.layer_norm_rms_epsilon"), Meta::F32(eps));
    }
    if let Some(f) = cfg.f32_opt("partial_rotary_factor")? {
        let n_rot = (head_dim as f32 * f) as u32;
        put(k("rope.dimension_count"), Meta::U32(n_rot));
    }

    // ---- RoPE
    let global = rope_parameters(&cfg, "full_attention")?;
    let theta = match global
        .as_ref()
        .map(|r| r.f32_opt("rope_theta"))
        .transpose()?
    {
        Some(Some(t)) => Some(t),
        _ => cfg.f32_opt("rope_theta")?,
    };
    if let Some(t) = theta {
        put(k("rope.freq_base"), Meta::F32(t));
    }
    if let Some(r) = &global {
        let kind = match r.str_opt("rope_type")? {
            Some(t) => Some(t),
            None => r.str_opt("type")?,
        };
        let original = match r.u32_opt("original_max_position_embeddings")? {
            Some(o) => Some(o),
            None => cfg.u32_opt("original_max_position_embeddings")?,
        };
        match kind.unwrap_or("default") {
            "default" => {}
            "linear" => {
                put(k("rope.scaling.type"), Meta::Str("linear".into()));
                if let Some(f) = r.f32_opt("factor")? {
                    put(k("rope.scaling.factor"), Meta::F32(f));
                }
            }
            "llama3" => {
                put(k("rope.scaling.type"), Meta::Str("llama3".into()));
                if let Some(f) = r.f32_opt("factor")? {
                    put(k("rope.scaling.factor"), Meta::F32(f));
                }
                if let Some(o) = original {
                    put(k("rope.scaling.original_context_length"), Meta::U32(o));
                }
                if let Some(f) = r.f32_opt("low_freq_factor")? {
                    put("zerolayer.rope.llama3.low_freq_factor".into(), Meta::F32(f));
                }
                if let Some(f) = r.f32_opt("high_freq_factor")? {
                    put(
                        "zerolayer.rope.llama3.high_freq_factor".into(),
                        Meta::F32(f),
                    );
                }
            }
            "longrope" => {
                put(k("rope.scaling.type"), Meta::Str("longrope".into()));
                let original = original.unwrap_or(context);
                put(
                    k("rope.scaling.original_context_length"),
                    Meta::U32(original),
                );
                if let Some(v) = r.f32_list("short_factor")? {
                    put("zerolayer.rope.factors_short".into(), Meta::F32s(v));
                }
                if let Some(v) = r.f32_list("long_factor")? {
                    put("zerolayer.rope.factors_long".into(), Meta::F32s(v));
                }
                // transformers' _compute_longrope_parameters (and llama.cpp's converter).
                let attn_factor = match r.f32_opt("attention_factor")? {
                    Some(a) => a,
                    None => {
                        let factor = match r.f32_opt("factor")? {
                            Some(f) => f64::from(f),
                            None => f64::from(context) / f64::from(original),
                        };
                        if factor <= 1.0 {
                            1.0
                        } else {
                            (1.0 + factor.ln() / (original as f64).ln()).sqrt() as f32
                        }
                    }
                };
                put(k("rope.scaling.attn_factor"), Meta::F32(attn_factor));
            }
            other => {
                return Err(HfError::UnsupportedRopeScaling {
                    path: path.to_path_buf(),
                    kind: other.to_string(),
                });
            }
        }
    }
    if arch == "gemma3" {
        let local = match cfg
            .get("rope_parameters")
            .and_then(|v| v.get("sliding_attention"))
        {
            Some(v) => match v.as_object() {
                Some(obj) => Reader { path, obj }.f32_opt("rope_theta")?,
                None => return Err(cfg.bad("rope_parameters.sliding_attention", v)),
            },
            None => None,
        };
        let local = match local {
            Some(t) => Some(t),
            None => cfg.f32_opt("rope_local_base_freq")?,
        };
        if let Some(t) = local {
            put(k("rope.freq_base_swa"), Meta::F32(t));
        }
    }

    // ---- per-layer features
    let layer_types: Option<Vec<bool>> = match cfg.get("layer_types") {
        None => None,
        Some(v) => Some(
            v.as_array()
                .filter(|a| a.len() == n_layers as usize)
                .and_then(|a| {
                    a.iter()
                        .map(|t| t.as_str().map(|s| s == "sliding_attention"))
                        .collect()
                })
                .ok_or_else(|| cfg.bad("layer_types", v))?,
        ),
    };
    let window = cfg.u32_opt("sliding_window")?.filter(|&w| w > 0);
    let sliding: Vec<bool> = match layer_types {
        Some(v) => v,
        None => (0..n_layers as usize)
            .map(|il| match arch.as_str() {
                // transformers' defaults when `layer_types` is absent.
                "gemma2" => il % 2 == 0,
                "gemma3" => {
                    let p = cfg
                        .u32_opt("sliding_window_pattern")
                        .ok()
                        .flatten()
                        .unwrap_or(6) as usize;
                    p <= 1 || (il + 1) % p != 0
                }
                "qwen2" | "qwen3" | "smollm3" | "qwen2moe" | "qwen3moe" => {
                    cfg.bool_opt("use_sliding_window").ok().flatten() == Some(true)
                        && il
                            >= cfg.u32_opt("max_window_layers").ok().flatten().unwrap_or(0) as usize
                }
                _ => true,
            })
            .collect(),
    };
    match window.filter(|_| sliding.iter().any(|&s| s)) {
        Some(w) => {
            put("zerolayer.attention.sliding_window".into(), Meta::U32(w));
            put(k("attention.sliding_window"), Meta::U32(w));
            put(k("attention.sliding_window_pattern"), Meta::Bools(sliding));
        }
        None => put("zerolayer.attention.sliding_window".into(), Meta::U32(0)),
    }
    if let Some(v) = cfg.get("no_rope_layers") {
        let on: Vec<bool> = v
            .as_array()
            .filter(|a| a.len() == n_layers as usize)
            .and_then(|a| a.iter().map(|x| x.as_u64().map(|i| i != 0)).collect())
            .ok_or_else(|| cfg.bad("no_rope_layers", v))?;
        put("zerolayer.rope.layers".into(), Meta::Bools(on));
    } else if arch == "smollm3" {
        // transformers' default: every `no_rope_layer_interval`-th layer (4) without RoPE.
        let every = cfg.u32_opt("no_rope_layer_interval")?.unwrap_or(4);
        if every == 0 || n_layers > MAX_LAYERS {
            return Err(cfg.bad("no_rope_layer_interval", &Value::from(every)));
        }
        put(
            "zerolayer.rope.layers".into(),
            Meta::Bools((0..n_layers).map(|il| (il + 1) % every != 0).collect()),
        );
    }
    if gemma {
        // transformers: a null cap means none; llama.cpp's defaults (50, 30) apply only to
        // keys that are absent, so say 0 (none) explicitly.
        for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
            put(k(key), Meta::F32(cfg.f32_opt(key)?.unwrap_or(0.0)));
        }
        if let Some(s) = cfg.f32_opt("query_pre_attn_scalar")? {
            put(k("attention.scale"), Meta::F32(1.0 / s.sqrt()));
        }
    }

    experts(&cfg, &arch, n_layers, &mut put)?;

    // ---- special tokens
    let gen_path = path.with_file_name("generation_config.json");
    let gen_cfg = generation.and_then(Value::as_object).map(|obj| Reader {
        path: &gen_path,
        obj,
    });
    let gen_ids = |key: &str| -> Result<Option<Vec<u32>>, HfError> {
        match &gen_cfg {
            Some(g) => g.ids(key),
            None => Ok(None),
        }
    };
    let eos_token_ids = match gen_ids("eos_token_id")? {
        Some(v) => v,
        None => cfg.ids("eos_token_id")?.unwrap_or_default(),
    };
    let bos = match gen_ids("bos_token_id")? {
        Some(v) => v,
        None => cfg.ids("bos_token_id")?.unwrap_or_default(),
    };
    if let Some(&e) = eos_token_ids.first() {
        put("tokenizer.ggml.eos_token_id".into(), Meta::U32(e));
    }
    if let Some(&b) = bos.first() {
        put("tokenizer.ggml.bos_token_id".into(), Meta::U32(b));
    }
    Ok(Translated {
        arch,
        meta,
        eos_token_ids,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use serde_json::json;

    use super::*;

    /// A fresh empty directory under the system temp dir.
    fn temp_dir() -> PathBuf {
        static N: AtomicUsize = AtomicUsize::new(0);
        let d = std::env::temp_dir().join(format!(
            "zerolayer-hf-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A safetensors image of `(name, dtype, shape)` tensors, each filled with `0..n` as bytes.
    fn safetensors(tensors: &[(&str, &str, &[u64])]) -> Vec<u8> {
        let mut header = Map::new();
        let mut data = Vec::new();
        for (name, dtype, shape) in tensors {
            let size =
                StDtype::parse(dtype).unwrap().size() * shape.iter().product::<u64>() as usize;
            let start = data.len();
            data.extend((0..size).map(|i| i as u8));
            header.insert(
                (*name).into(),
                json!({"dtype": dtype, "shape": shape, "data_offsets": [start, start + size]}),
            );
        }
        let mut h = Value::Object(header).to_string().into_bytes();
        while !h.len().is_multiple_of(8) {
            h.push(b' ');
        }
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend(h);
        out.extend(data);
        out
    }

    fn llama_config() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,
            "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": [2, 3],
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16},
        })
    }

    fn write(dir: &Path, file: &str, v: &Value) {
        std::fs::write(dir.join(file), v.to_string()).unwrap();
    }

    fn translate(cfg: Value) -> Result<Translated, HfError> {
        translate_config(Path::new("config.json"), &cfg, None)
    }

    fn meta(t: &Translated, key: &str) -> Meta {
        t.meta
            .get(key)
            .cloned()
            .unwrap_or_else(|| panic!("{key} is not set"))
    }

    #[test]
    fn llama_config_translates_to_llama_cpp_keys() {
        let t = translate(llama_config()).unwrap();
        assert_eq!(t.arch, "llama");
        for (key, want) in [
            ("general.architecture", Meta::Str("llama".into())),
            ("zerolayer.rope.layout", Meta::Str("neox".into())),
            ("llama.block_count", Meta::U32(1)),
            ("llama.embedding_length", Meta::U32(8)),
            ("llama.feed_forward_length", Meta::U32(16)),
            ("llama.attention.head_count", Meta::U32(2)),
            ("llama.attention.head_count_kv", Meta::U32(1)),
            ("llama.attention.key_length", Meta::U32(4)),
            ("llama.context_length", Meta::U32(64)),
            ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
            ("llama.rope.freq_base", Meta::F32(500000.0)),
            ("llama.rope.scaling.type", Meta::Str("llama3".into())),
            ("llama.rope.scaling.factor", Meta::F32(8.0)),
            ("llama.rope.scaling.original_context_length", Meta::U32(16)),
            ("zerolayer.rope.llama3.low_freq_factor", Meta::F32(1.0)),
            ("zerolayer.rope.llama3.high_freq_factor", Meta::F32(4.0)),
            ("zerolayer.attention.sliding_window", Meta::U32(0)),
            ("tokenizer.ggml.bos_token_id", Meta::U32(1)),
            ("tokenizer.ggml.eos_token_id", Meta::U32(2)),
        ] {
            assert_eq!(meta(&t, key), want, "{key}");
        }
        assert_eq!(t.eos_token_ids, [2, 3]);
    }

    #[test]
    fn older_rope_theta_and_rope_scaling_keys_are_read() {
        let mut cfg = llama_config();
        let obj = cfg.as_object_mut().unwrap();
        obj.remove("rope_parameters");
        obj.insert("rope_theta".into(), json!(1000.0));
        obj.insert(
            "rope_scaling".into(),
            json!({"type": "linear", "factor": 2.0}),
        );
        let t = translate(cfg).unwrap();
        assert_eq!(meta(&t, "llama.rope.freq_base"), Meta::F32(1000.0));
        assert_eq!(
            meta(&t, "llama.rope.scaling.type"),
            Meta::Str("linear".into())
        );
        assert_eq!(meta(&t, "llama.rope.scaling.factor"), Meta::F32(2.0));
    }

    #[test]
    fn gemma2_gets_norm_offset_caps_scale_and_alternating_windows() {
        let t = translate(json!({
            "architectures": ["Gemma2ForCausalLM"],
            "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 4,
            "num_attention_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
            "sliding_window": 4, "query_pre_attn_scalar": 16,
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": null,
        }))
        .unwrap();
        assert_eq!(meta(&t, "zerolayer.norm.weight_offset"), Meta::F32(1.0));
        assert_eq!(meta(&t, "gemma2.attention.key_length"), Meta::U32(8));
        assert_eq!(meta(&t, "gemma2.attn_logit_softcapping"), Meta::F32(50.0));
        // null: no cap (not llama.cpp's default of 30).
        assert_eq!(meta(&t, "gemma2.final_logit_softcapping"), Meta::F32(0.0));
        assert_eq!(meta(&t, "gemma2.attention.scale"), Meta::F32(0.25));
        assert_eq!(meta(&t, "zerolayer.attention.sliding_window"), Meta::U32(4));
        assert_eq!(
            meta(&t, "gemma2.attention.sliding_window_pattern"),
            Meta::Bools(vec![true, false, true, false])
        );
    }

    #[test]
    fn gemma3_layer_types_and_local_base_are_read_in_both_forms() {
        let base = json!({
            "architectures": ["Gemma3ForCausalLM"],
            "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 3,
            "num_attention_heads": 2, "max_position_embeddings": 64, "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        });
        let mut new = base.clone();
        new["rope_parameters"] = json!({
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        });
        let mut old = base;
        old["rope_theta"] = json!(1000000.0);
        old["rope_local_base_freq"] = json!(10000.0);
        for cfg in [new, old] {
            let t = translate(cfg).unwrap();
            assert_eq!(meta(&t, "gemma3.rope.freq_base"), Meta::F32(1e6));
            assert_eq!(meta(&t, "gemma3.rope.freq_base_swa"), Meta::F32(1e4));
            assert_eq!(
                meta(&t, "gemma3.attention.sliding_window_pattern"),
                Meta::Bools(vec![true, false, true])
            );
        }
    }

    #[test]
    fn phi3_longrope_factors_and_attention_factor() {
        let t = translate(json!({
            "architectures": ["Phi3ForCausalLM"],
            "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 256,
            "original_max_position_embeddings": 64, "sliding_window": 32,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                "short_factor": [1.0, 1.5], "long_factor": [2.0, 3.0]},
        }))
        .unwrap();
        assert_eq!(
            meta(&t, "phi3.rope.scaling.original_context_length"),
            Meta::U32(64)
        );
        assert_eq!(
            meta(&t, "zerolayer.rope.factors_short"),
            Meta::F32s(vec![1.0, 1.5])
        );
        assert_eq!(
            meta(&t, "zerolayer.rope.factors_long"),
            Meta::F32s(vec![2.0, 3.0])
        );
        let want = (1.0 + 4f64.ln() / 64f64.ln()).sqrt() as f32;
        assert_eq!(meta(&t, "phi3.rope.scaling.attn_factor"), Meta::F32(want));
        assert_eq!(
            meta(&t, "zerolayer.attention.sliding_window"),
            Meta::U32(32)
        );
    }

    #[test]
    fn smollm3_no_rope_layers_and_qwen2_windows_above_max_window_layers() {
        let t = translate(json!({
            "architectures": ["SmolLM3ForCausalLM"],
            "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 4,
            "num_attention_heads": 2, "max_position_embeddings": 64,
            "no_rope_layers": [1, 1, 1, 0],
        }))
        .unwrap();
        assert_eq!(
            meta(&t, "zerolayer.rope.layers"),
            Meta::Bools(vec![true, true, true, false])
        );
        let t = translate(json!({
            "architectures": ["Qwen2ForCausalLM"],
            "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 3,
            "num_attention_heads": 2, "max_position_embeddings": 64,
            "use_sliding_window": true, "sliding_window": 4, "max_window_layers": 1,
        }))
        .unwrap();
        assert_eq!(
            meta(&t, "qwen2.attention.sliding_window_pattern"),
            Meta::Bools(vec![false, true, true])
        );
    }

    #[test]
    fn moe_configs_translate_counts_norms_and_dense_layers() {
        let mut c = llama_config();
        c["architectures"] = json!(["Qwen3MoeForCausalLM"]);
        c["num_hidden_layers"] = json!(4);
        c.as_object_mut().unwrap().remove("rope_parameters");
        // transformers 5 writes Qwen3-MoE's count as `num_local_experts`.
        for (k, v) in [
            ("num_local_experts", json!(8)),
            ("num_experts_per_tok", json!(2)),
            ("moe_intermediate_size", json!(4)),
            ("norm_topk_prob", json!(true)),
            ("decoder_sparse_step", json!(2)),
            ("mlp_only_layers", json!([3])),
            ("sliding_window", json!(4)),
            ("use_sliding_window", json!(false)),
        ] {
            c[k] = v;
        }
        let t = translate(c.clone()).unwrap();
        assert_eq!(t.arch, "qwen3moe");
        assert_eq!(meta(&t, "qwen3moe.expert_count"), Meta::U32(8));
        assert_eq!(meta(&t, "qwen3moe.expert_used_count"), Meta::U32(2));
        assert_eq!(
            meta(&t, "qwen3moe.expert_feed_forward_length"),
            Meta::U32(4)
        );
        assert_eq!(meta(&t, "zerolayer.expert_weights_norm"), Meta::Bool(true));
        // Every second layer, less layer 3.
        assert_eq!(
            meta(&t, "zerolayer.expert_layers"),
            Meta::Bools(vec![false, true, false, false])
        );
        // `use_sliding_window` false: no window despite `sliding_window`.
        assert_eq!(meta(&t, "zerolayer.attention.sliding_window"), Meta::U32(0));
        c["decoder_sparse_step"] = json!(0);
        assert!(
            matches!(translate(c), Err(HfError::BadValue { key, .. }) if key == "decoder_sparse_step")
        );

        // OLMoE: `num_experts`, no renormalisation by default, every layer sparse; clip_qkv refused.
        let mut c = llama_config();
        c["architectures"] = json!(["OlmoeForCausalLM"]);
        c.as_object_mut().unwrap().remove("rope_parameters");
        c["num_experts"] = json!(4);
        c["num_experts_per_tok"] = json!(2);
        let t = translate(c.clone()).unwrap();
        assert_eq!(meta(&t, "olmoe.expert_count"), Meta::U32(4));
        assert_eq!(meta(&t, "zerolayer.expert_weights_norm"), Meta::Bool(false));
        assert!(!t.meta.contains_key("zerolayer.expert_layers"));
        c["clip_qkv"] = json!(8.0);
        assert!(
            matches!(translate(c), Err(HfError::UnsupportedFeature { key, .. }) if key == "clip_qkv")
        );

        // Mixtral: `num_local_experts`, always renormalised, served as llama.
        let mut c = llama_config();
        c["architectures"] = json!(["MixtralForCausalLM"]);
        c["num_local_experts"] = json!(4);
        c["num_experts_per_tok"] = json!(2);
        let t = translate(c).unwrap();
        assert_eq!(t.arch, "llama");
        assert_eq!(meta(&t, "llama.expert_count"), Meta::U32(4));
        assert_eq!(meta(&t, "zerolayer.expert_weights_norm"), Meta::Bool(true));
    }

    #[test]
    fn tensor_names_follow_llama_cpp() {
        for (arch, hf, want) in [
            (
                "llama",
                "model.embed_tokens.weight",
                Some("token_embd.weight"),
            ),
            ("llama", "lm_head.weight", Some("output.weight")),
            ("llama", "model.norm.weight", Some("output_norm.weight")),
            (
                "llama",
                "model.layers.3.input_layernorm.weight",
                Some("blk.3.attn_norm.weight"),
            ),
            (
                "qwen2",
                "model.layers.0.self_attn.q_proj.bias",
                Some("blk.0.attn_q.bias"),
            ),
            (
                "llama",
                "model.layers.0.self_attn.o_proj.weight",
                Some("blk.0.attn_output.weight"),
            ),
            (
                "phi3",
                "model.layers.1.self_attn.qkv_proj.weight",
                Some("blk.1.attn_qkv.weight"),
            ),
            (
                "phi3",
                "model.layers.1.mlp.gate_up_proj.weight",
                Some("blk.1.ffn_up.weight"),
            ),
            (
                "qwen3",
                "model.layers.0.self_attn.k_norm.weight",
                Some("blk.0.attn_k_norm.weight"),
            ),
            (
                "llama",
                "model.layers.0.post_attention_layernorm.weight",
                Some("blk.0.ffn_norm.weight"),
            ),
            (
                "gemma2",
                "model.layers.0.post_attention_layernorm.weight",
                Some("blk.0.post_attention_norm.weight"),
            ),
            (
                "gemma3",
                "model.layers.0.pre_feedforward_layernorm.weight",
                Some("blk.0.ffn_norm.weight"),
            ),
            (
                "gemma3",
                "model.layers.0.post_feedforward_layernorm.weight",
                Some("blk.0.post_ffw_norm.weight"),
            ),
            (
                "llama",
                "model.layers.0.mlp.down_proj.weight",
                Some("blk.0.ffn_down.weight"),
            ),
            (
                "llama",
                "model.layers.0.self_attn.rotary_emb.inv_freq",
                None,
            ),
            (
                "llama",
                "model.layers.2.block_sparse_moe.gate.weight",
                Some("blk.2.ffn_gate_inp.weight"),
            ),
            (
                "llama",
                "model.layers.2.block_sparse_moe.experts.7.w1.weight",
                Some("blk.2.ffn_gate_exps.7.weight"),
            ),
            (
                "llama",
                "model.layers.2.block_sparse_moe.experts.7.w2.weight",
                Some("blk.2.ffn_down_exps.7.weight"),
            ),
            (
                "llama",
                "model.layers.2.block_sparse_moe.experts.7.w3.weight",
                Some("blk.2.ffn_up_exps.7.weight"),
            ),
            (
                "qwen3moe",
                "model.layers.1.mlp.gate.weight",
                Some("blk.1.ffn_gate_inp.weight"),
            ),
            (
                "qwen3moe",
                "model.layers.1.mlp.experts.12.up_proj.weight",
                Some("blk.1.ffn_up_exps.12.weight"),
            ),
            (
                "qwen3moe",
                "model.layers.1.mlp.experts.x.up_proj.weight",
                None,
            ),
            (
                "qwen3moe",
                "model.layers.1.mlp.experts.gate_up_proj",
                Some("blk.1.ffn_gate_up_exps.weight"),
            ),
            (
                "qwen3moe",
                "model.layers.1.mlp.experts.down_proj",
                Some("blk.1.ffn_down_exps.weight"),
            ),
            (
                "qwen2moe",
                "model.layers.0.mlp.shared_expert.down_proj.weight",
                Some("blk.0.ffn_down_shexp.weight"),
            ),
            (
                "qwen2moe",
                "model.layers.0.mlp.shared_expert_gate.weight",
                Some("blk.0.ffn_gate_inp_shexp.weight"),
            ),
        ] {
            assert_eq!(gguf_tensor_name(arch, hf).as_deref(), want, "{arch} {hf}");
        }
    }

    #[test]
    fn opens_shards_with_one_file_index_each_and_reversed_shapes() {
        let d = temp_dir();
        write(&d, "config.json", &llama_config());
        write(
            &d,
            "generation_config.json",
            &json!({"eos_token_id": [7, 8]}),
        );
        write(
            &d,
            "tokenizer_config.json",
            &json!({"chat_template": [{"name": "tool_use", "template": "T"},
                                      {"name": "default", "template": "D"}]}),
        );
        let a = safetensors(&[("model.embed_tokens.weight", "F32", &[5, 8])]);
        let b = safetensors(&[
            ("model.layers.0.self_attn.k_proj.weight", "BF16", &[4, 8]),
            ("model.layers.0.self_attn.rotary_emb.inv_freq", "I64", &[2]),
        ]);
        std::fs::write(d.join("a.safetensors"), &a).unwrap();
        std::fs::write(d.join("b.safetensors"), &b).unwrap();
        write(
            &d,
            "model.safetensors.index.json",
            &json!({"weight_map": {"model.embed_tokens.weight": "a.safetensors",
                                   "model.layers.0.self_attn.k_proj.weight": "b.safetensors"}}),
        );
        // SAFETY: the test's files are not modified while mapped.
        let m = unsafe { open(&d) }.unwrap();
        let e = m.tensor("token_embd.weight").unwrap();
        assert_eq!(
            (e.dtype, e.shape.clone(), e.file),
            (GgmlType::F32, vec![8, 5], 0)
        );
        let k = m.tensor("blk.0.attn_k.weight").unwrap();
        assert_eq!(
            (k.dtype, k.shape.clone(), k.file),
            (GgmlType::BF16, vec![8, 4], 1)
        );
        assert_eq!(k.data.len(), 64);
        assert_eq!(k.data[..4], [0, 1, 2, 3]);
        assert!(m.file_bytes(1).as_ptr_range().contains(&k.data.as_ptr()));
        assert_eq!(
            m.hf_tensor_name("blk.0.attn_k.weight"),
            Some("model.layers.0.self_attn.k_proj.weight")
        );
        // generation_config.json's eos list wins over config.json's.
        assert_eq!(m.eos_token_ids(), [7, 8]);
        assert_eq!(m.get_u32("tokenizer.ggml.eos_token_id"), Some(7));
        assert_eq!(m.chat_template().as_deref(), Some("D"));
        assert_eq!(m.get_str("general.name"), d.file_name().unwrap().to_str());
        assert_eq!(m.tokenizer_json_path(), d.join("tokenizer.json"));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn experts_are_served_in_place_per_expert_or_fused() {
        let d = temp_dir();
        let mut c = llama_config();
        c["architectures"] = json!(["MixtralForCausalLM"]);
        c["num_local_experts"] = json!(2);
        c["num_experts_per_tok"] = json!(1);
        write(&d, "config.json", &c);
        let st = safetensors(&[
            (
                "model.layers.0.block_sparse_moe.experts.1.w3.weight",
                "BF16",
                &[16, 8],
            ),
            (
                "model.layers.1.mlp.experts.gate_up_proj",
                "F32",
                &[2, 32, 8],
            ),
            ("model.layers.1.mlp.experts.down_proj", "F32", &[2, 8, 16]),
        ]);
        std::fs::write(d.join("model.safetensors"), &st).unwrap();
        // SAFETY: the test's files are not modified while mapped.
        let m = unsafe { open(&d) }.unwrap();
        for (name, dtype, shape, len) in [
            (
                "blk.0.ffn_up_exps.1.weight",
                GgmlType::BF16,
                vec![8, 16],
                256,
            ),
            (
                "blk.1.ffn_gate_up_exps.weight",
                GgmlType::F32,
                vec![8, 32, 2],
                2048,
            ),
            (
                "blk.1.ffn_down_exps.weight",
                GgmlType::F32,
                vec![16, 8, 2],
                1024,
            ),
        ] {
            let t = m.tensor(name).unwrap_or_else(|| panic!("{name}"));
            assert_eq!(
                (t.dtype, t.shape.clone(), t.data.len()),
                (dtype, shape, len)
            );
            // The mapping's own bytes: nothing copied or converted.
            assert!(m.file_bytes(0).as_ptr_range().contains(&t.data.as_ptr()));
        }
        assert_eq!(m.get_u32("llama.expert_count"), Some(2));
        assert_eq!(m.get_bool("zerolayer.expert_weights_norm"), Some(true));
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Opens a directory with `config` and one `model.safetensors` of `tensors`.
    fn open_with(config: Option<&str>, tensors: &[(&str, &str, &[u64])]) -> HfError {
        let d = temp_dir();
        if let Some(c) = config {
            std::fs::write(d.join("config.json"), c).unwrap();
        }
        std::fs::write(d.join("model.safetensors"), safetensors(tensors)).unwrap();
        // SAFETY: the test's files are not modified while mapped.
        let e = unsafe { open(&d) }.unwrap_err();
        let _ = std::fs::remove_dir_all(&d);
        e
    }

    #[test]
    fn each_error_names_the_file_and_key() {
        let llama = llama_config().to_string();
        let embd: &[(&str, &str, &[u64])] = &[("model.embed_tokens.weight", "F32", &[2, 8])];
        match open_with(None, embd) {
            HfError::MissingFile { path } => assert!(path.ends_with("config.json")),
            e => panic!("{e}"),
        }
        match open_with(Some("{not json"), embd) {
            HfError::BadJson { path, .. } => assert!(path.ends_with("config.json")),
            e => panic!("{e}"),
        }
        let gpt2 = r#"{"architectures": ["GPT2LMHeadModel"]}"#;
        let e = open_with(Some(gpt2), embd);
        assert!(e.to_string().contains("GPT2LMHeadModel"), "{e}");
        assert!(
            e.to_string().contains("Gemma3ForCausalLM"),
            "lists the supported: {e}"
        );
        assert!(matches!(e, HfError::UnsupportedArchitecture { .. }));
        let mut no_hidden = llama_config();
        no_hidden.as_object_mut().unwrap().remove("hidden_size");
        match open_with(Some(&no_hidden.to_string()), embd) {
            HfError::MissingKey { key, .. } => assert_eq!(key, "hidden_size"),
            e => panic!("{e}"),
        }
        let mut bad = llama_config();
        bad["num_hidden_layers"] = json!("two");
        match open_with(Some(&bad.to_string()), embd) {
            HfError::BadValue { key, value, .. } => {
                assert_eq!(
                    (key.as_str(), value.as_str()),
                    ("num_hidden_layers", "\"two\"")
                );
            }
            e => panic!("{e}"),
        }
        let mut yarn = llama_config();
        yarn["rope_parameters"] = json!({"rope_type": "yarn", "factor": 4.0});
        match open_with(Some(&yarn.to_string()), embd) {
            HfError::UnsupportedRopeScaling { kind, .. } => assert_eq!(kind, "yarn"),
            e => panic!("{e}"),
        }
        match open_with(
            Some(&llama),
            &[("model.embed_tokens.weight", "I32", &[2, 8])],
        ) {
            HfError::UnsupportedDtype { tensor, dtype, .. } => {
                assert_eq!(
                    (tensor.as_str(), dtype),
                    ("model.embed_tokens.weight", StDtype::I32)
                );
            }
            e => panic!("{e}"),
        }
    }

    #[test]
    fn missing_weights_shards_and_tensors_are_named() {
        let d = temp_dir();
        write(&d, "config.json", &llama_config());
        // SAFETY: the test's files are not modified while mapped.
        match unsafe { open(&d) }.unwrap_err() {
            HfError::MissingFile { path } => assert!(path.ends_with("model.safetensors")),
            e => panic!("{e}"),
        }
        write(
            &d,
            "model.safetensors.index.json",
            &json!({"weight_map": {"model.embed_tokens.weight": "model-1.safetensors",
                                   "lm_head.weight": "model-2.safetensors"}}),
        );
        let one = safetensors(&[("model.embed_tokens.weight", "F32", &[2, 8])]);
        std::fs::write(d.join("model-1.safetensors"), &one).unwrap();
        // SAFETY: as above.
        match unsafe { open(&d) }.unwrap_err() {
            HfError::MissingFile { path } => assert!(path.ends_with("model-2.safetensors")),
            e => panic!("{e}"),
        }
        std::fs::write(d.join("model-2.safetensors"), &one).unwrap();
        // SAFETY: as above.
        match unsafe { open(&d) }.unwrap_err() {
            HfError::TensorMissingFromShard { tensor, shard } => {
                assert_eq!(tensor, "lm_head.weight");
                assert!(shard.ends_with("model-2.safetensors"));
            }
            e => panic!("{e}"),
        }
        std::fs::write(d.join("model-2.safetensors"), b"short").unwrap();
        // SAFETY: as above.
        match unsafe { open(&d) }.unwrap_err() {
            HfError::Safetensors { path, .. } => assert!(path.ends_with("model-2.safetensors")),
            e => panic!("{e}"),
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    mod fuzz {
        //! Translation never panics (or sizes anything by a wild value) on what a config.json
        //! may hold: any value at any key of each family's config.

        use super::*;
        use proptest::prelude::*;

        fn family(i: usize) -> Value {
            let mut c = llama_config();
            let (arch, extra) = [
                ("LlamaForCausalLM", json!({})),
                ("MistralForCausalLM", json!({"sliding_window": 4})),
                ("Qwen2ForCausalLM", json!({"use_sliding_window": false})),
                ("Qwen3ForCausalLM", json!({"head_dim": 4})),
                ("Gemma2ForCausalLM", json!({"query_pre_attn_scalar": 4, "attn_logit_softcapping": 50.0,
                    "final_logit_softcapping": 30.0, "sliding_window": 4,
                    "hidden_activation": "gelu_pytorch_tanh"})),
                ("Gemma3ForCausalLM", json!({"sliding_window": 4, "rope_local_base_freq": 10000.0,
                    "hidden_activation": "gelu_pytorch_tanh", "layer_types": ["sliding_attention"]})),
                ("Phi3ForCausalLM", json!({"original_max_position_embeddings": 16})),
                ("SmolLM3ForCausalLM", json!({"no_rope_layers": [1]})),
                ("MixtralForCausalLM", json!({"num_local_experts": 4, "num_experts_per_tok": 2})),
                ("Qwen3MoeForCausalLM", json!({"num_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 4, "norm_topk_prob": true,
                    "decoder_sparse_step": 1, "mlp_only_layers": [0]})),
                ("OlmoeForCausalLM", json!({"num_experts": 4, "num_experts_per_tok": 2})),
                ("Qwen2MoeForCausalLM", json!({"num_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 4, "shared_expert_intermediate_size": 8})),
            ][i % 12]
                .clone();
            c["architectures"] = json!([arch]);
            if !i.is_multiple_of(12) {
                c.as_object_mut().unwrap().remove("rope_parameters");
            }
            for (k, v) in extra.as_object().unwrap() {
                c[k] = v.clone();
            }
            c
        }

        fn wild() -> impl Strategy<Value = Value> {
            prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::from),
                any::<u32>().prop_map(Value::from),
                any::<i64>().prop_map(Value::from),
                prop_oneof![
                    Just(0.0f64),
                    Just(-1.0),
                    Just(f64::MAX),
                    Just(1e-30),
                    -1e6f64..1e6
                ]
                .prop_map(|f| json!(f)),
                "[a-z_]{0,8}".prop_map(Value::from),
                Just(json!([])),
                Just(json!([1, 2, 3])),
                Just(json!({"rope_type": "yarn", "factor": 0})),
                Just(json!({"rope_type": "longrope", "long_factor": [1.0], "short_factor": []})),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]
            #[test]
            fn any_value_at_any_key(i in 0usize..12, key in 0usize..24, v in wild()) {
                let mut c = family(i);
                let keys: Vec<String> = c.as_object().unwrap().keys().cloned().collect();
                let k = keys[key % keys.len()].clone();
                c[k.as_str()] = v;
                let _ = translate(c);
            }
        }
    }
}
