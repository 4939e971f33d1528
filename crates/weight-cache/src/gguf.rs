//! GGUF (v2, v3) parsing over a read-only mapping: metadata and zero-copy tensor views.
//!
//! Layout (little-endian): magic `GGUF`, `u32` version, `u64` tensor count, `u64` metadata count,
//! metadata key/value pairs, tensor infos (name, dims, type, offset relative to the data section),
//! padding to `general.alignment` (default 32), tensor data.
//!
//! Every count and length read from the file is checked against the bytes that remain before anything
//! is allocated for it, so a hostile header cannot make the parser allocate more than a small multiple
//! of the file size.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};

use crate::sys::Backing;
use crate::{DequantError, FileChanged, GgmlType, dequantize};

/// `GGUF` as a little-endian `u32`.
const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of arrays of arrays accepted in metadata.
const MAX_ARRAY_DEPTH: u32 = 4;

/// Error of [`Gguf::open`] / [`Gguf::from_bytes`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("cannot open or map {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The file ends inside a header field.
    #[error(
        "truncated GGUF: {what} at byte {offset} needs {needed} bytes, only {available} remain"
    )]
    Truncated {
        /// Which field was being read.
        what: &'static str,
        /// Byte offset of the field.
        offset: usize,
        /// Bytes the field needs.
        needed: u64,
        /// Bytes left in the file at that offset.
        available: usize,
    },
    /// The file does not start with `GGUF`.
    #[error("not a GGUF file: magic is {found:?}")]
    BadMagic {
        /// The first four bytes.
        found: [u8; 4],
    },
    /// Only versions 2 and 3 (little-endian) are supported.
    #[error("unsupported GGUF version {version} (supported: 2, 3)")]
    UnsupportedVersion {
        /// The version field.
        version: u32,
    },
    /// A declared count cannot fit in the bytes that remain.
    #[error("{what} count {count} cannot fit in the {available} bytes after offset {offset}")]
    CountTooLarge {
        /// What is counted (tensors, metadata entries, array elements).
        what: &'static str,
        /// The declared count.
        count: u64,
        /// Byte offset after the count field.
        offset: usize,
        /// Bytes that remain.
        available: usize,
    },
    /// A key, string value or tensor name is not UTF-8.
    #[error("{what} at byte {offset} is not valid UTF-8")]
    InvalidUtf8 {
        /// Which kind of string.
        what: &'static str,
        /// Byte offset of the string's bytes.
        offset: usize,
    },
    /// A metadata value has an unknown type id.
    #[error("metadata {key:?}: unknown value type {type_id} at byte {offset}")]
    UnknownValueType {
        /// The metadata key.
        key: String,
        /// The type id.
        type_id: u32,
        /// Byte offset of the type field.
        offset: usize,
    },
    /// A boolean metadata value is neither 0 nor 1.
    #[error("metadata {key:?}: invalid bool byte {value} at byte {offset}")]
    InvalidBool {
        /// The metadata key.
        key: String,
        /// The byte found.
        value: u8,
        /// Its offset.
        offset: usize,
    },
    /// Arrays of arrays nest deeper than this parser allows.
    #[error("metadata {key:?}: arrays nested deeper than {MAX_ARRAY_DEPTH}")]
    NestingTooDeep {
        /// The metadata key.
        key: String,
    },
    /// The same metadata key appears twice.
    #[error("duplicate metadata key {key:?}")]
    DuplicateKey {
        /// The key.
        key: String,
    },
    /// `general.alignment` is not a `u32` power of two that is a multiple of 8.
    #[error("invalid general.alignment: {value:?} (must be a u32 power of two, >= 8)")]
    BadAlignment {
        /// The value as read (None when it has a non-integer type).
        value: Option<u64>,
    },
    /// A tensor declares more than [`MAX_DIMS`] dimensions.
    #[error("tensor {tensor:?} has {n_dims} dimensions (max {MAX_DIMS})")]
    TooManyDims {
        /// Tensor name.
        tensor: String,
        /// Declared dimension count.
        n_dims: u32,
    },
    /// A tensor has an unknown ggml type id.
    #[error("tensor {tensor:?} has unknown ggml type {type_id}")]
    UnknownTensorType {
        /// Tensor name.
        tensor: String,
        /// The type id.
        type_id: u32,
    },
    /// A tensor's element count or byte size overflows.
    #[error("tensor {tensor:?}: shape {shape:?} overflows")]
    ShapeOverflow {
        /// Tensor name.
        tensor: String,
        /// The declared shape.
        shape: Vec<u64>,
    },
    /// A tensor's row length is not a multiple of its type's block size.
    #[error("tensor {tensor:?}: row length {row_len} is not a multiple of the {dtype} block size")]
    RowNotBlockAligned {
        /// Tensor name.
        tensor: String,
        /// Its type.
        dtype: GgmlType,
        /// `shape[0]`.
        row_len: u64,
    },
    /// A tensor's data extends past the end of the file.
    #[error(
        "tensor {tensor:?}: {size} bytes at file offset {offset} run past the end ({file_len})"
    )]
    TensorOutOfBounds {
        /// Tensor name.
        tensor: String,
        /// Absolute file offset (saturated on overflow).
        offset: u64,
        /// Byte size.
        size: u64,
        /// File length.
        file_len: usize,
    },
    /// A tensor's offset is not a multiple of the file's alignment.
    #[error("tensor {tensor:?}: offset {offset} is not a multiple of the alignment {alignment}")]
    TensorMisaligned {
        /// Tensor name.
        tensor: String,
        /// Offset relative to the data section.
        offset: u64,
        /// The file's alignment.
        alignment: u64,
    },
    /// Two tensors' data overlap.
    #[error("tensors {first:?} and {second:?} overlap")]
    TensorOverlap {
        /// The tensor starting first.
        first: String,
        /// The tensor starting inside it.
        second: String,
    },
    /// Two tensors have the same name.
    #[error("duplicate tensor name {name:?}")]
    DuplicateTensor {
        /// The name.
        name: String,
    },
}

/// Type of a metadata value (GGUF `gguf_metadata_value_type`).
#[non_exhaustive]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum MetaType {
    /// `u8`.
    U8,
    /// `i8`.
    I8,
    /// `u16`.
    U16,
    /// `i16`.
    I16,
    /// `u32`.
    U32,
    /// `i32`.
    I32,
    /// `f32`.
    F32,
    /// bool (one byte, 0 or 1).
    Bool,
    /// UTF-8 string (`u64` length + bytes).
    String,
    /// Array (`u32` element type, `u64` count, elements).
    Array,
    /// `u64`.
    U64,
    /// `i64`.
    I64,
    /// `f64`.
    F64,
}

impl MetaType {
    /// GGUF's value type id (the inverse of `from_id`).
    pub(crate) fn id(self) -> u32 {
        match self {
            Self::U8 => 0,
            Self::I8 => 1,
            Self::U16 => 2,
            Self::I16 => 3,
            Self::U32 => 4,
            Self::I32 => 5,
            Self::F32 => 6,
            Self::Bool => 7,
            Self::String => 8,
            Self::Array => 9,
            Self::U64 => 10,
            Self::I64 => 11,
            Self::F64 => 12,
        }
    }

    fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::U8,
            1 => Self::I8,
            2 => Self::U16,
            3 => Self::I16,
            4 => Self::U32,
            5 => Self::I32,
            6 => Self::F32,
            7 => Self::Bool,
            8 => Self::String,
            9 => Self::Array,
            10 => Self::U64,
            11 => Self::I64,
            12 => Self::F64,
            _ => return None,
        })
    }

    /// Encoded size of a value of this type, for fixed-size types.
    fn fixed_size(self) -> Option<usize> {
        match self {
            Self::U8 | Self::I8 | Self::Bool => Some(1),
            Self::U16 | Self::I16 => Some(2),
            Self::U32 | Self::I32 | Self::F32 => Some(4),
            Self::U64 | Self::I64 | Self::F64 => Some(8),
            Self::String | Self::Array => None,
        }
    }

    /// Smallest encoded size of a value of this type.
    fn min_size(self) -> usize {
        match self {
            Self::String => 8,
            Self::Array => 12,
            t => t.fixed_size().unwrap_or(1),
        }
    }
}

/// A metadata value, borrowed from the file.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MetaValue<'a> {
    /// `u8`.
    U8(u8),
    /// `i8`.
    I8(i8),
    /// `u16`.
    U16(u16),
    /// `i16`.
    I16(i16),
    /// `u32`.
    U32(u32),
    /// `i32`.
    I32(i32),
    /// `u64`.
    U64(u64),
    /// `i64`.
    I64(i64),
    /// `f32`.
    F32(f32),
    /// `f64`.
    F64(f64),
    /// bool.
    Bool(bool),
    /// A UTF-8 string.
    String(&'a str),
    /// An array.
    Array(MetaArray<'a>),
}

impl MetaValue<'_> {
    /// The value's type.
    pub fn meta_type(&self) -> MetaType {
        match self {
            Self::U8(_) => MetaType::U8,
            Self::I8(_) => MetaType::I8,
            Self::U16(_) => MetaType::U16,
            Self::I16(_) => MetaType::I16,
            Self::U32(_) => MetaType::U32,
            Self::I32(_) => MetaType::I32,
            Self::U64(_) => MetaType::U64,
            Self::I64(_) => MetaType::I64,
            Self::F32(_) => MetaType::F32,
            Self::F64(_) => MetaType::F64,
            Self::Bool(_) => MetaType::Bool,
            Self::String(_) => MetaType::String,
            Self::Array(_) => MetaType::Array,
        }
    }

    /// The value as an `i128` if it is an integer.
    pub fn as_int(&self) -> Option<i128> {
        Some(match *self {
            Self::U8(v) => v.into(),
            Self::I8(v) => v.into(),
            Self::U16(v) => v.into(),
            Self::I16(v) => v.into(),
            Self::U32(v) => v.into(),
            Self::I32(v) => v.into(),
            Self::U64(v) => v.into(),
            Self::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as an `f64` if it is a float.
    pub fn as_float(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => None,
        }
    }
}

/// A metadata array, borrowed from the file; elements are decoded on access.
#[derive(Clone, Copy, PartialEq)]
pub struct MetaArray<'a> {
    elem: MetaType,
    len: usize,
    /// The encoded elements (already validated by the parser).
    bytes: &'a [u8],
}

impl std::fmt::Debug for MetaArray<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetaArray")
            .field("elem", &self.elem)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl<'a> MetaArray<'a> {
    /// Element type.
    pub fn elem_type(&self) -> MetaType {
        self.elem
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the array is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Element `i`; O(1) for fixed-size element types, O(i) for strings and arrays.
    pub fn get(&self, i: usize) -> Option<MetaValue<'a>> {
        if i >= self.len {
            return None;
        }
        match self.elem.fixed_size() {
            Some(sz) => decode_fixed(self.elem, self.bytes.get(i * sz..i * sz + sz)?),
            None => self.iter().nth(i),
        }
    }

    /// The elements in order.
    pub fn iter(&self) -> MetaArrayIter<'a> {
        MetaArrayIter {
            elem: self.elem,
            remaining: self.len,
            cur: Cursor {
                buf: self.bytes,
                pos: 0,
            },
        }
    }
}

/// Iterator over a [`MetaArray`].
#[derive(Clone, Debug)]
pub struct MetaArrayIter<'a> {
    elem: MetaType,
    remaining: usize,
    cur: Cursor<'a>,
}

impl<'a> Iterator for MetaArrayIter<'a> {
    type Item = MetaValue<'a>;

    fn next(&mut self) -> Option<MetaValue<'a>> {
        if self.remaining == 0 {
            return None;
        }
        self.remaining -= 1;
        // The bytes were validated when the file was parsed, so decoding cannot fail here; if it
        // somehow did, the iterator simply ends.
        match self.elem {
            MetaType::String => {
                let s = self.cur.string("array string").ok()?;
                Some(MetaValue::String(s))
            }
            MetaType::Array => {
                let elem = MetaType::from_id(self.cur.u32("array type").ok()?)?;
                let len = self.cur.u64("array length").ok()? as usize;
                let data_start = self.cur.pos;
                skip_array_elems(&mut self.cur, elem, len).ok()?;
                Some(MetaValue::Array(MetaArray {
                    elem,
                    len,
                    bytes: &self.cur.buf[data_start..self.cur.pos],
                }))
            }
            t => {
                let sz = t.fixed_size()?;
                let b = self.cur.take(sz as u64, "array element").ok()?;
                decode_fixed(t, b)
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining, Some(self.remaining))
    }
}

fn decode_fixed<'a>(t: MetaType, b: &[u8]) -> Option<MetaValue<'a>> {
    Some(match t {
        MetaType::U8 => MetaValue::U8(b[0]),
        MetaType::I8 => MetaValue::I8(b[0] as i8),
        MetaType::Bool => MetaValue::Bool(b[0] != 0),
        MetaType::U16 => MetaValue::U16(u16::from_le_bytes(b.try_into().ok()?)),
        MetaType::I16 => MetaValue::I16(i16::from_le_bytes(b.try_into().ok()?)),
        MetaType::U32 => MetaValue::U32(u32::from_le_bytes(b.try_into().ok()?)),
        MetaType::I32 => MetaValue::I32(i32::from_le_bytes(b.try_into().ok()?)),
        MetaType::F32 => MetaValue::F32(f32::from_le_bytes(b.try_into().ok()?)),
        MetaType::U64 => MetaValue::U64(u64::from_le_bytes(b.try_into().ok()?)),
        MetaType::I64 => MetaValue::I64(i64::from_le_bytes(b.try_into().ok()?)),
        MetaType::F64 => MetaValue::F64(f64::from_le_bytes(b.try_into().ok()?)),
        MetaType::String | MetaType::Array => return None,
    })
}

/// A bounds-checked little-endian reader.
#[derive(Clone, Debug)]
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: u64, what: &'static str) -> Result<&'a [u8], GgufError> {
        let available = self.remaining();
        if n > available as u64 {
            return Err(GgufError::Truncated {
                what,
                offset: self.pos,
                needed: n,
                available,
            });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A `u64`-length-prefixed UTF-8 string.
    fn string(&mut self, what: &'static str) -> Result<&'a str, GgufError> {
        let len = self.u64(what)?;
        let offset = self.pos;
        let bytes = self.take(len, what)?;
        std::str::from_utf8(bytes).map_err(|_| GgufError::InvalidUtf8 { what, offset })
    }

    /// A count of items of at least `min_size` bytes each, checked against the remaining bytes.
    fn count(&mut self, what: &'static str, min_size: usize) -> Result<usize, GgufError> {
        let count = self.u64(what)?;
        let available = self.remaining();
        if count > (available / min_size.max(1)) as u64 {
            return Err(GgufError::CountTooLarge {
                what,
                count,
                offset: self.pos,
                available,
            });
        }
        Ok(count as usize)
    }
}

/// Skip `len` validated array elements of type `elem` (the count was already checked).
fn skip_array_elems(cur: &mut Cursor<'_>, elem: MetaType, len: usize) -> Result<(), GgufError> {
    match elem.fixed_size() {
        Some(sz) => {
            cur.take((len as u64).saturating_mul(sz as u64), "array elements")?;
        }
        None => {
            for _ in 0..len {
                if elem == MetaType::String {
                    cur.string("array string")?;
                } else {
                    let e = MetaType::from_id(cur.u32("array type")?).ok_or(
                        GgufError::UnknownValueType {
                            key: String::new(),
                            type_id: 0,
                            offset: cur.pos,
                        },
                    )?;
                    let n = cur.u64("array length")? as usize;
                    skip_array_elems(cur, e, n)?;
                }
            }
        }
    }
    Ok(())
}

/// A parsed metadata value, as positions in the file.
#[derive(Clone, Copy, Debug)]
enum RawValue {
    Scalar(MetaType, [u8; 8]),
    Str {
        start: usize,
        len: usize,
    },
    Array {
        elem: MetaType,
        len: usize,
        start: usize,
        end: usize,
    },
}

#[derive(Debug)]
struct TensorInfo {
    name: Box<str>,
    dtype: GgmlType,
    n_dims: usize,
    dims: [u64; MAX_DIMS],
    /// Absolute file offset.
    start: usize,
    size: usize,
}

/// A parsed GGUF file: metadata and tensor views over a read-only mapping.
///
/// `Send + Sync`; share it through `Arc<Gguf>`.
///
/// ```no_run
/// let path = weight_cache::locate_default_model()?;
/// // SAFETY: the model file is not modified while mapped.
/// let gguf = unsafe { weight_cache::Gguf::open(&path)? };
/// let n_layers = gguf.get_u32("llama.block_count").unwrap();
/// let emb = gguf.tensor("token_embd.weight").unwrap();
/// println!("{n_layers} layers, embeddings {:?} {}", emb.shape, emb.dtype);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Gguf {
    backing: Backing,
    path: Option<PathBuf>,
    version: u32,
    alignment: u64,
    data_offset: usize,
    meta: Vec<(Box<str>, RawValue)>,
    meta_index: HashMap<Box<str>, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<Box<str>, usize>,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("len", &self.bytes().len())
            .field("metadata", &self.meta.len())
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

/// A tensor in a GGUF file: a zero-copy view of its bytes in the mapping.
#[derive(Clone, Copy)]
pub struct TensorView<'a> {
    /// Tensor name.
    pub name: &'a str,
    /// Element type.
    pub dtype: GgmlType,
    /// Shape in ggml order: `shape[0]` is the innermost (row length, `ne0`), `shape[1]` the rows.
    pub shape: &'a [u64],
    /// Absolute file offset of the data.
    pub offset: u64,
    /// The data (`dtype.row_bytes(shape[0]) * rows` bytes).
    pub data: &'a [u8],
    /// Index of the tensor in the file's tensor list (what the block table and profile use).
    pub index: usize,
}

impl std::fmt::Debug for TensorView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorView")
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("offset", &self.offset)
            .field("bytes", &self.data.len())
            .field("index", &self.index)
            .finish()
    }
}

impl TensorView<'_> {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Row length (`shape[0]`, 1 for a scalar).
    pub fn row_len(&self) -> usize {
        self.shape.first().copied().unwrap_or(1) as usize
    }

    /// Number of rows (product of `shape[1..]`; the parser refuses shapes where it overflows).
    pub fn rows(&self) -> usize {
        self.shape.iter().skip(1).product::<u64>() as usize
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.row_len()).unwrap_or(0)
    }

    /// Dequantize row `row` into `dst` (`row_len()` values) with the reference dequantizer.
    pub fn dequantize_row(&self, row: usize, dst: &mut [f32]) -> Result<(), DequantError> {
        let rb = self.row_bytes();
        let src = self.data.get(row * rb..(row + 1) * rb).unwrap_or(&[]);
        dequantize(self.dtype, src, dst)
    }

    /// Dequantize the whole tensor to f32 with the reference dequantizer.
    pub fn to_f32(&self) -> Result<Vec<f32>, DequantError> {
        let mut out = vec![0.0; self.n_elements() as usize];
        dequantize(self.dtype, self.data, &mut out)?;
        Ok(out)
    }
}

impl Gguf {
    /// Map the file at `path` read-only and parse its header. Only the header pages are read; tensor
    /// data stays on disk until touched.
    ///
    /// # Safety
    /// The file must not be modified or truncated while the returned value (or any view borrowed
    /// from it) lives: the tensor views are plain `&[u8]` into the mapping.
    pub unsafe fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        // SAFETY: forwarded to our caller (see `# Safety`).
        let backing = unsafe { Backing::open(path) }.map_err(|source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mut g = Self::parse(backing)?;
        g.path = Some(path.to_path_buf());
        Ok(g)
    }

    /// Parse a GGUF image held in memory (the same parser as [`open`](Self::open); the bytes are
    /// copied into an aligned buffer).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(Backing::owned(&bytes))
    }

    fn parse(backing: Backing) -> Result<Self, GgufError> {
        let buf = backing.bytes();
        let mut cur = Cursor { buf, pos: 0 };
        let magic: [u8; 4] = cur.array("magic")?;
        if magic != MAGIC {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = cur.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion { version });
        }
        // Smallest tensor info: name length (8) + n_dims (4) + type (4) + offset (8).
        let raw_tensor_count = cur.u64("tensor count")?;
        // Smallest metadata entry: key length (8) + type (4) + one byte of value.
        let meta_count = cur.count("metadata entry", 13)?;
        let tensor_bound = cur.remaining() / 24;
        if raw_tensor_count > tensor_bound as u64 {
            return Err(GgufError::CountTooLarge {
                what: "tensor",
                count: raw_tensor_count,
                offset: 16,
                available: cur.remaining(),
            });
        }
        let tensor_count = raw_tensor_count as usize;

        let mut meta = Vec::with_capacity(meta_count);
        let mut meta_index = HashMap::with_capacity(meta_count);
        for _ in 0..meta_count {
            let key = cur.string("metadata key")?;
            let value = parse_value(&mut cur, key)?;
            if meta_index.insert(Box::from(key), meta.len()).is_some() {
                return Err(GgufError::DuplicateKey { key: key.into() });
            }
            meta.push((Box::from(key), value));
        }

        let mut alignment = DEFAULT_ALIGNMENT;
        if let Some(&i) = meta_index.get("general.alignment") {
            alignment = match meta[i].1 {
                RawValue::Scalar(MetaType::U32, b) => {
                    let v = u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                    if !v.is_power_of_two() || v < 8 {
                        return Err(GgufError::BadAlignment { value: Some(v) });
                    }
                    v
                }
                _ => return Err(GgufError::BadAlignment { value: None }),
            };
        }

        if tensor_count > cur.remaining() / 24 {
            return Err(GgufError::CountTooLarge {
                what: "tensor",
                count: raw_tensor_count,
                offset: cur.pos,
                available: cur.remaining(),
            });
        }
        let mut infos = Vec::with_capacity(tensor_count);
        let mut rel_offsets = Vec::with_capacity(tensor_count);
        for _ in 0..tensor_count {
            let name = cur.string("tensor name")?;
            let n_dims = cur.u32("tensor n_dims")?;
            if n_dims as usize > MAX_DIMS {
                return Err(GgufError::TooManyDims {
                    tensor: name.into(),
                    n_dims,
                });
            }
            let mut dims = [1u64; MAX_DIMS];
            for d in dims.iter_mut().take(n_dims as usize) {
                *d = cur.u64("tensor dim")?;
            }
            let type_id = cur.u32("tensor type")?;
            let dtype = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType {
                tensor: name.into(),
                type_id,
            })?;
            let offset = cur.u64("tensor offset")?;
            infos.push((name, dtype, n_dims as usize, dims));
            rel_offsets.push(offset);
        }

        let data_offset = cur.pos.next_multiple_of(alignment as usize);
        let file_len = buf.len();
        let mut tensors = Vec::with_capacity(tensor_count);
        let mut tensor_index = HashMap::with_capacity(tensor_count);
        for ((name, dtype, n_dims, dims), rel) in infos.into_iter().zip(rel_offsets) {
            let shape = &dims[..n_dims];
            let overflow = || GgufError::ShapeOverflow {
                tensor: name.into(),
                shape: shape.to_vec(),
            };
            let n_elements = shape
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(overflow)?;
            // With a zero dimension the total is 0 whatever the others are, but the row count
            // (product of dims[1..]) must still fit: `TensorView::rows` relies on it.
            shape
                .iter()
                .skip(1)
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .filter(|&rows| usize::try_from(rows).is_ok())
                .ok_or_else(overflow)?;
            let row_len = dims[0];
            let bs = dtype.block_size() as u64;
            if row_len % bs != 0 {
                return Err(GgufError::RowNotBlockAligned {
                    tensor: name.into(),
                    dtype,
                    row_len,
                });
            }
            let size = (n_elements / bs)
                .checked_mul(dtype.type_size() as u64)
                .ok_or_else(overflow)?;
            if rel % alignment != 0 {
                return Err(GgufError::TensorMisaligned {
                    tensor: name.into(),
                    offset: rel,
                    alignment,
                });
            }
            let start = (data_offset as u64).checked_add(rel);
            let end = start.and_then(|s| s.checked_add(size));
            match (start, end) {
                (Some(s), Some(e)) if e <= file_len as u64 => {
                    if tensor_index
                        .insert(Box::from(name), tensors.len())
                        .is_some()
                    {
                        return Err(GgufError::DuplicateTensor { name: name.into() });
                    }
                    tensors.push(TensorInfo {
                        name: name.into(),
                        dtype,
                        n_dims,
                        dims,
                        start: s as usize,
                        size: size as usize,
                    });
                }
                _ => {
                    return Err(GgufError::TensorOutOfBounds {
                        tensor: name.into(),
                        offset: start.unwrap_or(u64::MAX),
                        size,
                        file_len,
                    });
                }
            }
        }

        let mut order: Vec<usize> = (0..tensors.len())
            .filter(|&i| tensors[i].size > 0)
            .collect();
        order.sort_by_key(|&i| tensors[i].start);
        for w in order.windows(2) {
            let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
            if b.start < a.start + a.size {
                return Err(GgufError::TensorOverlap {
                    first: a.name.to_string(),
                    second: b.name.to_string(),
                });
            }
        }

        Ok(Self {
            backing,
            path: None,
            version,
            alignment,
            data_offset,
            meta,
            meta_index,
            tensors,
            tensor_index,
        })
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data section alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset of the data section (the header is `bytes()[..data_offset()]`).
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }

    /// The path the file was opened from (`None` for [`from_bytes`](Self::from_bytes)).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Whether the file is still what was mapped: compares the open file (fstat: size,
    /// modification time) and the path (stat: device and inode) with what they were at
    /// [`open`](Self::open). Two system calls, no reads of the mapping; `Ok` for
    /// [`from_bytes`](Self::from_bytes).
    ///
    /// The whole file is mapped at open and nothing maps further ranges later, so a change is not
    /// noticed by this crate on its own: call this (or let a [`FileWatch`](crate::FileWatch)
    /// call it) periodically. It cannot see a rewrite that keeps the size and restores the
    /// modification time.
    ///
    /// ```
    /// use weight_cache::{FileChanged, GgmlType, Gguf, GgufBuilder};
    /// let dir = tempfile::tempdir()?;
    /// let path = dir.path().join("m.gguf");
    /// let file = GgufBuilder::new().tensor("w", GgmlType::F32, &[1024], vec![0; 4096]).build();
    /// std::fs::write(&path, &file)?;
    /// // SAFETY: the file is only replaced below (a rename: the mapping keeps the old inode).
    /// let gguf = unsafe { Gguf::open(&path)? };
    /// gguf.check_unchanged()?;
    /// let other = dir.path().join("new.gguf");
    /// std::fs::write(&other, &file)?;
    /// std::fs::rename(&other, &path)?;
    /// assert!(matches!(gguf.check_unchanged(), Err(FileChanged::Replaced { .. })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn check_unchanged(&self) -> Result<(), FileChanged> {
        match (self.backing.file_identity(), self.path.as_deref()) {
            (Some((file, identity)), Some(path)) => identity.check(file, path),
            _ => Ok(()),
        }
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.backing.bytes()
    }

    pub(crate) fn backing(&self) -> &Backing {
        &self.backing
    }

    /// Drops the pages covering `range` of the file's bytes from this process (madvise
    /// DONTNEED on the read-only file mapping): they leave the process's resident set, stay in
    /// the page cache, and a later read faults them back in unchanged. For data the caller has
    /// copied (e.g. re-arranged weights) and will not read here again. A file read into an owned
    /// buffer cannot drop pages: `Unsupported`.
    pub fn release(&self, range: std::ops::Range<usize>) -> io::Result<()> {
        crate::sys::advise(&self.backing, range, crate::sys::Advice::DontNeed)
    }

    /// [`release`](Self::release)s the header (metadata and tensor index: `..data_offset()`):
    /// for a caller that has built what it needs from the metadata (tokenizer, configuration).
    /// The parsed index stays; a later metadata read faults its pages back in.
    ///
    /// ```no_run
    /// # fn f(g: &weight_cache::Gguf) -> std::io::Result<()> {
    /// g.release_header()?;
    /// # Ok(()) }
    /// ```
    pub fn release_header(&self) -> io::Result<()> {
        self.release(0..self.data_offset)
    }

    /// Metadata keys in file order.
    pub fn metadata_keys(&self) -> impl Iterator<Item = &str> {
        self.meta.iter().map(|(k, _)| &**k)
    }

    /// The metadata value for `key`.
    pub fn metadata(&self, key: &str) -> Option<MetaValue<'_>> {
        let &i = self.meta_index.get(key)?;
        let buf = self.bytes();
        Some(match self.meta[i].1 {
            RawValue::Scalar(t, b) => decode_fixed(t, &b[..t.fixed_size()?])?,
            RawValue::Str { start, len } => {
                MetaValue::String(std::str::from_utf8(buf.get(start..start + len)?).ok()?)
            }
            RawValue::Array {
                elem,
                len,
                start,
                end,
            } => MetaValue::Array(MetaArray {
                elem,
                len,
                bytes: buf.get(start..end)?,
            }),
        })
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        match self.metadata(key)? {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// An integer value of any integer type that fits in `u32`.
    pub fn get_u32(&self, key: &str) -> Option<u32> {
        self.metadata(key)?.as_int()?.try_into().ok()
    }

    /// An integer value of any integer type that fits in `u64`.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.metadata(key)?.as_int()?.try_into().ok()
    }

    /// A float value (`f32` or `f64`, the latter rounded).
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.metadata(key)?.as_float().map(|v| v as f32)
    }

    /// A bool value.
    pub fn get_bool(&self, key: &str) -> Option<bool> {
        match self.metadata(key)? {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// An array value.
    pub fn get_array(&self, key: &str) -> Option<MetaArray<'_>> {
        match self.metadata(key)? {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// An array of strings (e.g. `tokenizer.ggml.tokens`).
    pub fn get_str_array(&self, key: &str) -> Option<Vec<&str>> {
        let a = self.get_array(key)?;
        if a.elem_type() != MetaType::String {
            return None;
        }
        a.iter()
            .map(|v| match v {
                MetaValue::String(s) => Some(s),
                _ => None,
            })
            .collect()
    }

    /// An array of integers that all fit in `i32` (e.g. `tokenizer.ggml.token_type`).
    pub fn get_i32_array(&self, key: &str) -> Option<Vec<i32>> {
        self.get_array(key)?
            .iter()
            .map(|v| v.as_int()?.try_into().ok())
            .collect()
    }

    /// An array of floats (`f32`, or `f64` rounded; e.g. `tokenizer.ggml.scores`).
    pub fn get_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        self.get_array(key)?
            .iter()
            .map(|v| v.as_float().map(|f| f as f32))
            .collect()
    }

    /// Number of tensors.
    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    /// Tensor number `index` in file order.
    pub fn tensor_at(&self, index: usize) -> Option<TensorView<'_>> {
        let t = self.tensors.get(index)?;
        Some(TensorView {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.dims[..t.n_dims],
            offset: t.start as u64,
            data: self.bytes().get(t.start..t.start + t.size)?,
            index,
        })
    }

    /// All tensors in file order.
    pub fn tensors(&self) -> impl Iterator<Item = TensorView<'_>> {
        (0..self.tensors.len()).filter_map(|i| self.tensor_at(i))
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.tensor_at(*self.tensor_index.get(name)?)
    }

    /// Index of the tensor called `name`.
    pub fn tensor_index(&self, name: &str) -> Option<usize> {
        self.tensor_index.get(name).copied()
    }
}

/// Parse one metadata value of the type given by the next `u32`.
fn parse_value(cur: &mut Cursor<'_>, key: &str) -> Result<RawValue, GgufError> {
    let type_offset = cur.pos;
    let type_id = cur.u32("metadata value type")?;
    let t = MetaType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
        key: key.into(),
        type_id,
        offset: type_offset,
    })?;
    match t {
        MetaType::String => {
            let s = cur.string("metadata string")?;
            Ok(RawValue::Str {
                start: cur.pos - s.len(),
                len: s.len(),
            })
        }
        MetaType::Array => {
            let (elem, len, start) = parse_array(cur, key, 0)?;
            Ok(RawValue::Array {
                elem,
                len,
                start,
                end: cur.pos,
            })
        }
        t => {
            let sz = t.fixed_size().unwrap_or(1);
            let offset = cur.pos;
            let b = cur.take(sz as u64, "metadata value")?;
            if t == MetaType::Bool && b[0] > 1 {
                return Err(GgufError::InvalidBool {
                    key: key.into(),
                    value: b[0],
                    offset,
                });
            }
            let mut raw = [0u8; 8];
            raw[..sz].copy_from_slice(b);
            Ok(RawValue::Scalar(t, raw))
        }
    }
}

/// Parse and validate an array (after its `Array` type id): returns element type, length and the
/// start of the elements.
fn parse_array(
    cur: &mut Cursor<'_>,
    key: &str,
    depth: u32,
) -> Result<(MetaType, usize, usize), GgufError> {
    if depth >= MAX_ARRAY_DEPTH {
        return Err(GgufError::NestingTooDeep { key: key.into() });
    }
    let type_offset = cur.pos;
    let type_id = cur.u32("array element type")?;
    let elem = MetaType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
        key: key.into(),
        type_id,
        offset: type_offset,
    })?;
    let len = cur.count("array element", elem.min_size())?;
    let start = cur.pos;
    match elem {
        MetaType::String => {
            for _ in 0..len {
                cur.string("array string")?;
            }
        }
        MetaType::Array => {
            for _ in 0..len {
                parse_array(cur, key, depth + 1)?;
            }
        }
        MetaType::Bool => {
            let b = cur.take(len as u64, "array elements")?;
            if let Some(i) = b.iter().position(|&v| v > 1) {
                return Err(GgufError::InvalidBool {
                    key: key.into(),
                    value: b[i],
                    offset: start + i,
                });
            }
        }
        t => {
            let sz = t.fixed_size().unwrap_or(1);
            cur.take(len as u64 * sz as u64, "array elements")?;
        }
    }
    Ok((elem, len, start))
}
