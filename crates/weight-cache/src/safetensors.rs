//! safetensors parsing over a read-only mapping: `u64` header length, JSON header, raw data.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};

use half::{bf16, f16};

use crate::sys::Backing;

/// Largest accepted JSON header (the reference implementation's limit).
pub const MAX_SAFETENSORS_HEADER: usize = 100_000_000;

/// Error of [`Safetensors::open`] / [`Safetensors::from_bytes`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SafetensorsError {
    /// The file could not be opened or mapped.
    #[error("cannot open or map {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The file is shorter than the 8-byte header length.
    #[error("file of {len} bytes has no safetensors header length")]
    TooShort {
        /// File length.
        len: usize,
    },
    /// The declared header length is above [`MAX_SAFETENSORS_HEADER`] or past the end of the file.
    #[error(
        "header length {declared} exceeds the file ({file_len} bytes) or the {MAX_SAFETENSORS_HEADER}-byte cap"
    )]
    HeaderTooLarge {
        /// Declared length.
        declared: u64,
        /// File length.
        file_len: usize,
    },
    /// The header is not a JSON object of the expected form.
    #[error("invalid safetensors JSON header: {reason}")]
    BadHeader {
        /// What is wrong (the JSON parser's message or the structural problem).
        reason: String,
    },
    /// A tensor entry lacks a field or has one of the wrong form.
    #[error("tensor {tensor:?}: field {field:?} is missing or malformed")]
    BadEntry {
        /// Tensor name.
        tensor: String,
        /// The field.
        field: &'static str,
    },
    /// A tensor has a dtype this crate does not know.
    #[error("tensor {tensor:?}: unknown dtype {dtype:?}")]
    UnknownDtype {
        /// Tensor name.
        tensor: String,
        /// The dtype string.
        dtype: String,
    },
    /// A tensor's byte range does not match its shape and dtype (or overflows).
    #[error("tensor {tensor:?}: shape {shape:?} of {dtype:?} does not take {bytes} bytes")]
    ShapeMismatch {
        /// Tensor name.
        tensor: String,
        /// Declared shape.
        shape: Vec<u64>,
        /// Its dtype.
        dtype: StDtype,
        /// `end - begin` of its data offsets.
        bytes: u64,
    },
    /// A tensor's data range is reversed or past the end of the file.
    #[error("tensor {tensor:?}: data [{begin}, {end}) outside the {data_len}-byte data section")]
    OutOfBounds {
        /// Tensor name.
        tensor: String,
        /// Start, relative to the data section.
        begin: u64,
        /// End, relative to the data section.
        end: u64,
        /// Data section length.
        data_len: usize,
    },
    /// Two tensors' data overlap.
    #[error("tensors {first:?} and {second:?} overlap")]
    Overlap {
        /// The tensor starting first.
        first: String,
        /// The tensor starting inside it.
        second: String,
    },
}

/// A safetensors element type.
#[non_exhaustive]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum StDtype {
    /// bool (1 byte).
    Bool,
    /// u8.
    U8,
    /// i8.
    I8,
    /// fp8 e5m2.
    F8E5M2,
    /// fp8 e4m3.
    F8E4M3,
    /// i16.
    I16,
    /// u16.
    U16,
    /// f16.
    F16,
    /// bf16.
    BF16,
    /// i32.
    I32,
    /// u32.
    U32,
    /// f32.
    F32,
    /// f64.
    F64,
    /// i64.
    I64,
    /// u64.
    U64,
}

impl StDtype {
    /// Parse the header's dtype string.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "BOOL" => Self::Bool,
            "U8" => Self::U8,
            "I8" => Self::I8,
            "F8_E5M2" => Self::F8E5M2,
            "F8_E4M3" => Self::F8E4M3,
            "I16" => Self::I16,
            "U16" => Self::U16,
            "F16" => Self::F16,
            "BF16" => Self::BF16,
            "I32" => Self::I32,
            "U32" => Self::U32,
            "F32" => Self::F32,
            "F64" => Self::F64,
            "I64" => Self::I64,
            "U64" => Self::U64,
            _ => return None,
        })
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::Bool | Self::U8 | Self::I8 | Self::F8E5M2 | Self::F8E4M3 => 1,
            Self::I16 | Self::U16 | Self::F16 | Self::BF16 => 2,
            Self::I32 | Self::U32 | Self::F32 => 4,
            Self::F64 | Self::I64 | Self::U64 => 8,
        }
    }
}

#[derive(Debug)]
struct StInfo {
    name: Box<str>,
    dtype: StDtype,
    shape: Vec<u64>,
    start: usize,
    size: usize,
}

/// A tensor in a safetensors file: a zero-copy view of its bytes.
#[derive(Clone, Copy)]
pub struct StTensorView<'a> {
    /// Tensor name.
    pub name: &'a str,
    /// Element type.
    pub dtype: StDtype,
    /// Shape, outermost first (row-major, as in PyTorch).
    pub shape: &'a [u64],
    /// Absolute file offset of the data.
    pub offset: u64,
    /// The data.
    pub data: &'a [u8],
}

impl std::fmt::Debug for StTensorView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StTensorView")
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("offset", &self.offset)
            .field("bytes", &self.data.len())
            .finish()
    }
}

impl StTensorView<'_> {
    /// The values as f32, for F32/F16/BF16 tensors (`None` for other dtypes).
    pub fn to_f32(&self) -> Option<Vec<f32>> {
        let d = self.data;
        Some(match self.dtype {
            StDtype::F32 => d
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            StDtype::F16 => d
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            StDtype::BF16 => d
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => return None,
        })
    }
}

/// A parsed safetensors file over a read-only mapping. `Send + Sync`.
///
/// ```
/// let header = br#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
/// let mut file = (header.len() as u64).to_le_bytes().to_vec();
/// file.extend(header);
/// file.extend(1.5f32.to_le_bytes());
/// file.extend(2.5f32.to_le_bytes());
/// let st = weight_cache::Safetensors::from_bytes(file).unwrap();
/// assert_eq!(st.tensor("w").unwrap().to_f32().unwrap(), [1.5, 2.5]);
/// ```
pub struct Safetensors {
    backing: Backing,
    path: Option<PathBuf>,
    data_start: usize,
    tensors: Vec<StInfo>,
    index: HashMap<Box<str>, usize>,
    metadata: Vec<(String, String)>,
}

impl std::fmt::Debug for Safetensors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Safetensors")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

impl Safetensors {
    /// Map the file at `path` read-only and parse its header.
    ///
    /// # Safety
    /// The file must not be modified or truncated while the returned value (or any view borrowed
    /// from it) lives.
    pub unsafe fn open(path: impl AsRef<Path>) -> Result<Self, SafetensorsError> {
        let path = path.as_ref();
        // SAFETY: forwarded to our caller.
        let backing = unsafe { Backing::open(path) }.map_err(|source| SafetensorsError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mut s = Self::parse(backing)?;
        s.path = Some(path.to_path_buf());
        Ok(s)
    }

    /// Parse a safetensors image held in memory (same parser as [`open`](Self::open)).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, SafetensorsError> {
        Self::parse(Backing::owned(&bytes))
    }

    fn parse(backing: Backing) -> Result<Self, SafetensorsError> {
        let buf = backing.bytes();
        let file_len = buf.len();
        let Some(len_bytes) = buf.get(..8) else {
            return Err(SafetensorsError::TooShort { len: file_len });
        };
        let declared = u64::from_le_bytes(len_bytes.try_into().unwrap_or([0; 8]));
        if declared > MAX_SAFETENSORS_HEADER as u64 || declared > (file_len - 8) as u64 {
            return Err(SafetensorsError::HeaderTooLarge { declared, file_len });
        }
        let data_start = 8 + declared as usize;
        let header = &buf[8..data_start];
        let bad = |reason: String| SafetensorsError::BadHeader { reason };
        let json: serde_json::Value =
            serde_json::from_slice(header).map_err(|e| bad(e.to_string()))?;
        let obj = json
            .as_object()
            .ok_or_else(|| bad("not a JSON object".into()))?;
        let data_len = file_len - data_start;
        let mut tensors = Vec::with_capacity(obj.len());
        let mut index = HashMap::with_capacity(obj.len());
        let mut metadata = Vec::new();
        for (name, entry) in obj {
            if name == "__metadata__" {
                let m = entry
                    .as_object()
                    .ok_or_else(|| bad("__metadata__ is not an object".into()))?;
                for (k, v) in m {
                    let v = v
                        .as_str()
                        .ok_or_else(|| bad(format!("__metadata__ value {k:?} is not a string")))?;
                    metadata.push((k.clone(), v.to_string()));
                }
                continue;
            }
            let bad_entry = |field| SafetensorsError::BadEntry {
                tensor: name.clone(),
                field,
            };
            let dtype_str = entry["dtype"].as_str().ok_or_else(|| bad_entry("dtype"))?;
            let dtype =
                StDtype::parse(dtype_str).ok_or_else(|| SafetensorsError::UnknownDtype {
                    tensor: name.clone(),
                    dtype: dtype_str.to_string(),
                })?;
            let shape = entry["shape"]
                .as_array()
                .ok_or_else(|| bad_entry("shape"))?
                .iter()
                .map(|v| v.as_u64())
                .collect::<Option<Vec<u64>>>()
                .ok_or_else(|| bad_entry("shape"))?;
            let offs = entry["data_offsets"]
                .as_array()
                .filter(|a| a.len() == 2)
                .ok_or_else(|| bad_entry("data_offsets"))?;
            let (begin, end) = match (offs[0].as_u64(), offs[1].as_u64()) {
                (Some(b), Some(e)) => (b, e),
                _ => return Err(bad_entry("data_offsets")),
            };
            if begin > end || end > data_len as u64 {
                return Err(SafetensorsError::OutOfBounds {
                    tensor: name.clone(),
                    begin,
                    end,
                    data_len,
                });
            }
            let bytes = end - begin;
            let n = shape
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .and_then(|n| n.checked_mul(dtype.size() as u64));
            if n != Some(bytes) {
                return Err(SafetensorsError::ShapeMismatch {
                    tensor: name.clone(),
                    shape,
                    dtype,
                    bytes,
                });
            }
            index.insert(Box::from(name.as_str()), tensors.len());
            tensors.push(StInfo {
                name: name.as_str().into(),
                dtype,
                shape,
                start: data_start + begin as usize,
                size: bytes as usize,
            });
        }
        let mut order: Vec<usize> = (0..tensors.len())
            .filter(|&i| tensors[i].size > 0)
            .collect();
        order.sort_by_key(|&i| tensors[i].start);
        for w in order.windows(2) {
            let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
            if b.start < a.start + a.size {
                return Err(SafetensorsError::Overlap {
                    first: a.name.to_string(),
                    second: b.name.to_string(),
                });
            }
        }
        Ok(Self {
            backing,
            path: None,
            data_start,
            tensors,
            index,
            metadata,
        })
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.backing.bytes()
    }

    /// Absolute offset of the data section.
    pub fn data_offset(&self) -> usize {
        self.data_start
    }

    /// The path the file was opened from.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// A `__metadata__` value.
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.metadata
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Number of tensors.
    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    fn view<'a>(&'a self, t: &'a StInfo) -> Option<StTensorView<'a>> {
        Some(StTensorView {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            offset: t.start as u64,
            data: self.bytes().get(t.start..t.start + t.size)?,
        })
    }

    /// All tensors (in name order).
    pub fn tensors(&self) -> impl Iterator<Item = StTensorView<'_>> {
        self.tensors.iter().filter_map(|t| self.view(t))
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<StTensorView<'_>> {
        self.view(&self.tensors[*self.index.get(name)?])
    }
}
