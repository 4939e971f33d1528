//! A small GGUF writer, for tests, fuzz seeds and tiny synthetic models.

use crate::GgmlType;
use crate::gguf::MetaValue;

/// Builds a GGUF v3 image in memory.
///
/// ```
/// use weight_cache::{GgmlType, Gguf, GgufBuilder, quantize};
/// let w: Vec<f32> = (0..64).map(|i| i as f32).collect();
/// let bytes = GgufBuilder::new()
///     .kv_str("general.architecture", "llama")
///     .kv_u32("llama.block_count", 1)
///     .tensor("w", GgmlType::Q8_0, &[32, 2], quantize(GgmlType::Q8_0, &w).unwrap())
///     .build();
/// let g = Gguf::from_bytes(bytes).unwrap();
/// assert_eq!(g.get_u32("llama.block_count"), Some(1));
/// assert_eq!(g.tensor("w").unwrap().shape, &[32, 2]);
/// ```
#[derive(Clone, Debug)]
pub struct GgufBuilder {
    version: u32,
    alignment: usize,
    kv: Vec<u8>,
    n_kv: u64,
    tensors: Vec<(String, GgmlType, Vec<u64>, Vec<u8>)>,
}

impl Default for GgufBuilder {
    fn default() -> Self {
        Self::new()
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// `v` encoded as a GGUF value, without its type id (an array's elements recursively).
fn put_value(out: &mut Vec<u8>, v: &MetaValue<'_>) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.extend(x.to_le_bytes()),
        MetaValue::U16(x) => out.extend(x.to_le_bytes()),
        MetaValue::I16(x) => out.extend(x.to_le_bytes()),
        MetaValue::U32(x) => out.extend(x.to_le_bytes()),
        MetaValue::I32(x) => out.extend(x.to_le_bytes()),
        MetaValue::U64(x) => out.extend(x.to_le_bytes()),
        MetaValue::I64(x) => out.extend(x.to_le_bytes()),
        MetaValue::F32(x) => out.extend(x.to_le_bytes()),
        MetaValue::F64(x) => out.extend(x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(u8::from(*x)),
        MetaValue::String(s) => put_str(out, s),
        MetaValue::Array(a) => {
            out.extend(a.elem_type().id().to_le_bytes());
            out.extend((a.len() as u64).to_le_bytes());
            for e in a.iter() {
                put_value(out, &e);
            }
        }
    }
}

impl GgufBuilder {
    /// An empty v3 file with the default alignment (32).
    pub fn new() -> Self {
        Self {
            version: 3,
            alignment: 32,
            kv: Vec::new(),
            n_kv: 0,
            tensors: Vec::new(),
        }
    }

    /// Set the version field (2 or 3 are valid).
    pub fn version(mut self, version: u32) -> Self {
        self.version = version;
        self
    }

    /// Set `general.alignment` (written as a `u32` entry) and use it for the data layout.
    pub fn alignment(mut self, alignment: u32) -> Self {
        self.alignment = alignment.max(1) as usize;
        self.kv_u32("general.alignment", alignment)
    }

    /// Add a raw entry: `key`, value type id and its encoded bytes.
    pub fn kv_raw(mut self, key: &str, type_id: u32, value: &[u8]) -> Self {
        put_str(&mut self.kv, key);
        self.kv.extend(type_id.to_le_bytes());
        self.kv.extend(value);
        self.n_kv += 1;
        self
    }

    /// Add an entry with the value `v` as read from another file ([`crate::Gguf::metadata`]),
    /// whatever its type (arrays included): how a file's metadata is copied into a new one.
    ///
    /// ```
    /// use weight_cache::{Gguf, GgufBuilder};
    /// let src = Gguf::from_bytes(
    ///     GgufBuilder::new().kv_str_array("tokenizer.ggml.tokens", &["a", "b"]).build(),
    /// )
    /// .unwrap();
    /// let v = src.metadata("tokenizer.ggml.tokens").unwrap();
    /// let copy = Gguf::from_bytes(GgufBuilder::new().kv_value("tokenizer.ggml.tokens", &v).build())
    ///     .unwrap();
    /// assert_eq!(copy.metadata("tokenizer.ggml.tokens"), Some(v));
    /// ```
    pub fn kv_value(self, key: &str, v: &MetaValue<'_>) -> Self {
        let mut b = Vec::new();
        put_value(&mut b, v);
        self.kv_raw(key, v.meta_type().id(), &b)
    }

    /// Add a `u32` entry.
    pub fn kv_u32(self, key: &str, v: u32) -> Self {
        self.kv_raw(key, 4, &v.to_le_bytes())
    }

    /// Add a `u64` entry.
    pub fn kv_u64(self, key: &str, v: u64) -> Self {
        self.kv_raw(key, 10, &v.to_le_bytes())
    }

    /// Add an `i32` entry.
    pub fn kv_i32(self, key: &str, v: i32) -> Self {
        self.kv_raw(key, 5, &v.to_le_bytes())
    }

    /// Add an `f32` entry.
    pub fn kv_f32(self, key: &str, v: f32) -> Self {
        self.kv_raw(key, 6, &v.to_le_bytes())
    }

    /// Add a bool entry.
    pub fn kv_bool(self, key: &str, v: bool) -> Self {
        self.kv_raw(key, 7, &[u8::from(v)])
    }

    /// Add a string entry.
    pub fn kv_str(self, key: &str, v: &str) -> Self {
        let mut b = Vec::new();
        put_str(&mut b, v);
        self.kv_raw(key, 8, &b)
    }

    /// Add an array-of-strings entry.
    pub fn kv_str_array(self, key: &str, v: &[&str]) -> Self {
        let mut b = Vec::new();
        b.extend(8u32.to_le_bytes());
        b.extend((v.len() as u64).to_le_bytes());
        for s in v {
            put_str(&mut b, s);
        }
        self.kv_raw(key, 9, &b)
    }

    /// Add an array-of-`i32` entry.
    pub fn kv_i32_array(self, key: &str, v: &[i32]) -> Self {
        let mut b = Vec::new();
        b.extend(5u32.to_le_bytes());
        b.extend((v.len() as u64).to_le_bytes());
        v.iter().for_each(|x| b.extend(x.to_le_bytes()));
        self.kv_raw(key, 9, &b)
    }

    /// Add an array-of-`f32` entry.
    pub fn kv_f32_array(self, key: &str, v: &[f32]) -> Self {
        let mut b = Vec::new();
        b.extend(6u32.to_le_bytes());
        b.extend((v.len() as u64).to_le_bytes());
        v.iter().for_each(|x| b.extend(x.to_le_bytes()));
        self.kv_raw(key, 9, &b)
    }

    /// Add a tensor with its encoded data (`dtype.row_bytes(shape[0]) * rows` bytes for a valid
    /// file; not checked here, so invalid files can be built too).
    pub fn tensor(mut self, name: &str, dtype: GgmlType, shape: &[u64], data: Vec<u8>) -> Self {
        self.tensors
            .push((name.to_string(), dtype, shape.to_vec(), data));
        self
    }

    /// The encoded file.
    pub fn build(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(b"GGUF");
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend(&self.kv);
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        for (name, dtype, shape, data) in &self.tensors {
            put_str(&mut out, name);
            out.extend((shape.len() as u32).to_le_bytes());
            shape.iter().for_each(|d| out.extend(d.to_le_bytes()));
            out.extend(dtype.id().to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len()).next_multiple_of(self.alignment);
        }
        let data_start = out.len().next_multiple_of(self.alignment);
        out.resize(data_start, 0);
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + off, 0);
            out.extend(data);
        }
        out
    }
}
