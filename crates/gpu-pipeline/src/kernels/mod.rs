//! CPU kernels over quantized weights in place (matrix-vector and matrix-matrix products).
//!
//! The weights stay in their ggml block encoding, nothing is dequantized to a copy: read in place
//! from the GGUF mapping, or (Q4_0, Q4_1, Q8_0 on AVX-512; those and Q5_0, Q5_1, Q4_K, Q6_K on
//! AVX2) from a [`PackedWeights`] copy
//! made once at load, whose 16-row interleaving lets the decode kernel skip the per-pass shuffles
//! (same bytes per weight, bit-identical results). For the integer-quantized types (Q4_0, Q4_1,
//! Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) the f32 activations are
//! quantized on the fly to 8 bits per 32-element block (one f32 scale per block, as llama.cpp's q8
//! formats do) and the products run as integer dot products (AVX-512 VNNI `vpdpbusd` where the CPU
//! has it), with the block scales applied in f32. Float weights (F32, F16, BF16) are multiplied
//! with the f32 activations directly.
//!
//! Backends are picked at run time ([`CpuIsa::detect`]): AVX-512 (F, BW, VL, VNNI, VBMI, GFNI), AVX2 +
//! FMA (every format, without VNNI), the same with AVX-VNNI's 256-bit `vpdpbusd` in the
//! many-token and packed integer kernels (CPUs with AVX2 and AVX-VNNI but no AVX-512: Intel's
//! client cores since Alder Lake), and a
//! portable scalar backend that computes the same quantities with the same operations in the
//! same order (it is the reference the SIMD code is tested against, bit for bit). Block layouts
//! and their scalar decoding are weight-cache's ([`weight_cache::quant`]), shared with its
//! dequantization.
//!
//! **Batch invariance.** Row `i` of [`matmul`] over `n` tokens equals [`matvec`] on token `i`
//! bit for bit, for every `n`, thread count and partitioning: each output element is reduced in
//! a fixed order that depends only on the column count, and threads split rows, never columns.
//!
//! ```
//! use gpu_pipeline::ThreadPool;
//! use gpu_pipeline::kernels::{GgmlType, WeightMatrix, matvec};
//!
//! // A 2 x 4 F32 matrix.
//! let w: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0, -1.0, 0.5, 0.0, 2.0];
//! let bytes: &[u8] = bytemuck::cast_slice(&w);
//! let m = WeightMatrix::new(GgmlType::F32, 2, 4, bytes)?;
//! let mut y = [0.0f32; 2];
//! matvec(m, &[1.0, 1.0, 1.0, 1.0], &mut y, &ThreadPool::new(1))?;
//! assert_eq!(y, [10.0, 1.5]);
//! # Ok::<(), gpu_pipeline::kernels::KernelError>(())
//! ```

mod act;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_packed;
#[cfg(target_arch = "x86_64")]
mod avx2_quant;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod float512;
mod format;
mod ops;
mod packed;
#[cfg(target_arch = "x86_64")]
mod panel;
#[cfg(target_arch = "x86_64")]
pub(crate) use ops::has_avx2;
pub(crate) use ops::{
    EXP_C, EXP_MIN, LN2_HI, LN2_LO, LOG2E, add_rows, exp_f, gelu_tanh_mul_rows, multiversion,
    rmsnorm_rows, silu_mul_rows, softcap_rows, split_residual, tanh_f,
};

/// Whether the AVX-512 kernels run on this machine (detected, and not overridden by
/// `$ZEROLAYER_KERNELS`).
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx512() -> bool {
    CpuIsa::detect() == CpuIsa::Avx512
}
mod scalar;

use std::cell::RefCell;
use std::sync::{Mutex, OnceLock};

use crate::ThreadPool;
pub use weight_cache::GgmlType;

#[cfg(target_arch = "x86_64")]
use act::ActBlock;
use act::ActQuad;
use format::Fmt;
pub use ops::{
    OpsError, add_assign, axpy, axpy_f16, dot, dot_f16, rmsnorm, rope, silu_mul, softmax,
};
pub(crate) use ops::{hadamard_rows, rope_head};
pub use packed::PackedWeights;

/// How a [`WeightMatrix`]'s bytes are arranged.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Layout {
    /// As in the model file: row after row, each row its ggml blocks in order.
    #[default]
    File,
    /// Row-interleaved for the AVX-512 and AVX2 packed kernels ([`PackedWeights`]).
    Rows16,
}

/// A row-major weight matrix in its ggml encoding, borrowed from a model file mapping (or a
/// [`PackedWeights`] re-arrangement of one).
///
/// `cols` is the row length (ggml `ne0`, `shape[0]`), `rows` the number of rows (`shape[1]`).
#[derive(Clone, Copy, Debug)]
pub struct WeightMatrix<'a> {
    /// Element encoding.
    pub dtype: GgmlType,
    /// Number of rows (outputs of a product).
    pub rows: usize,
    /// Elements per row (inputs of a product).
    pub cols: usize,
    /// `rows * dtype.row_bytes(cols)` bytes (file layout).
    pub data: &'a [u8],
    /// The arrangement of `data` ([`Layout::File`] from [`new`](Self::new)).
    pub layout: Layout,
}

impl<'a> WeightMatrix<'a> {
    /// A checked matrix: the dtype is supported, `cols` is a multiple of its block size and `data`
    /// has exactly the right length.
    pub fn new(
        dtype: GgmlType,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, KernelError> {
        let m = Self {
            dtype,
            rows,
            cols,
            data,
            layout: Layout::File,
        };
        m.check()?;
        Ok(m)
    }

    /// The matrix of a 2-D tensor view (`cols = shape[0]`, `rows = shape[1]`; a 1-D tensor is one
    /// row).
    pub fn from_tensor(t: &weight_cache::TensorView<'a>) -> Result<Self, KernelError> {
        let cols = t.shape.first().copied().unwrap_or(1);
        let rows: u64 = t.shape.iter().skip(1).product();
        let to_usize =
            |v: u64| usize::try_from(v).map_err(|_| KernelError::SizeOverflow { rows: v, cols });
        Self::new(t.dtype, to_usize(rows)?, to_usize(cols)?, t.data)
    }

    /// Bytes of one encoded row.
    pub fn row_bytes(&self) -> usize {
        Fmt::of(self.dtype).map_or(0, |f| f.row_bytes(self.cols))
    }

    fn check(&self) -> Result<Fmt, KernelError> {
        let fmt = Fmt::of(self.dtype).ok_or(KernelError::UnsupportedDtype { dtype: self.dtype })?;
        if !self.cols.is_multiple_of(fmt.block_elems()) {
            return Err(KernelError::ColsNotBlockAligned {
                dtype: self.dtype,
                cols: self.cols,
                block: fmt.block_elems(),
            });
        }
        let overflow = KernelError::SizeOverflow {
            rows: self.rows as u64,
            cols: self.cols as u64,
        };
        let expected = match self.layout {
            Layout::File => fmt.row_bytes(self.cols).checked_mul(self.rows),
            Layout::Rows16 => {
                if packed::block_bytes(fmt).is_none() {
                    return Err(KernelError::UnsupportedDtype { dtype: self.dtype });
                }
                packed::packed_len(fmt, self.rows, self.cols)
            }
        }
        .ok_or(overflow)?;
        if self.data.len() != expected {
            return Err(KernelError::DataLength {
                dtype: self.dtype,
                rows: self.rows,
                cols: self.cols,
                expected,
                actual: self.data.len(),
            });
        }
        Ok(fmt)
    }
}

/// Errors of [`matvec`], [`matmul`] and [`dequantize_row`].
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The weight encoding has no kernel here.
    #[error("no CPU kernel for weights of type {}", dtype.name())]
    UnsupportedDtype {
        /// The encoding.
        dtype: GgmlType,
    },
    /// The row length is not a whole number of blocks of the encoding.
    #[error("{cols} columns are not a multiple of the {} block size {block}", dtype.name())]
    ColsNotBlockAligned {
        /// The encoding.
        dtype: GgmlType,
        /// Row length.
        cols: usize,
        /// Elements per block.
        block: usize,
    },
    /// The weight bytes do not have the length the shape implies.
    #[error("a {rows} x {cols} {} matrix needs {expected} bytes, got {actual}", dtype.name())]
    DataLength {
        /// The encoding.
        dtype: GgmlType,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// `rows * row_bytes(cols)`.
        expected: usize,
        /// Bytes given.
        actual: usize,
    },
    /// `matmul_many` got a different number of outputs than matrices.
    #[error("{matrices} matrices but {outputs} outputs")]
    OutputCount {
        /// Matrices given.
        matrices: usize,
        /// Outputs given.
        outputs: usize,
    },
    /// The shape does not fit in memory sizes.
    #[error("a {rows} x {cols} matrix overflows usize")]
    SizeOverflow {
        /// Rows.
        rows: u64,
        /// Columns.
        cols: u64,
    },
    /// The input has the wrong length (`n * cols` expected).
    #[error("input has {actual} elements, expected {expected}")]
    InputLength {
        /// Expected elements.
        expected: usize,
        /// Given elements.
        actual: usize,
    },
    /// The output has the wrong length (`n * rows` expected, or `cols` for a row).
    #[error("output has {actual} elements, expected {expected}")]
    OutputLength {
        /// Expected elements.
        expected: usize,
        /// Given elements.
        actual: usize,
    },
    /// [`dequantize_row`] was asked for a row past the end.
    #[error("row {row} out of range for a matrix of {rows} rows")]
    RowOutOfRange {
        /// Requested row.
        row: usize,
        /// Rows in the matrix.
        rows: usize,
    },
    /// Two products of [`matmul_batch`] write overlapping ranges of its output.
    #[error("products write overlapping output ranges {first:?} and {second:?}")]
    OverlappingOutputs {
        /// The earlier product's output range.
        first: std::ops::Range<usize>,
        /// The later product's output range.
        second: std::ops::Range<usize>,
    },
    /// The requested backend is not supported by this CPU.
    #[error("backend {backend:?} is not available on this CPU")]
    BackendUnavailable {
        /// The backend.
        backend: CpuIsa,
    },
    /// The backend has no kernel for the matrix's layout (packed weights need AVX-512 or AVX2).
    #[error("backend {backend:?} has no kernel for {} weights in layout {layout:?}", dtype.name())]
    LayoutUnsupported {
        /// The backend.
        backend: CpuIsa,
        /// The encoding.
        dtype: GgmlType,
        /// The layout.
        layout: Layout,
    },
}

/// The CPU instruction set a kernel runs with (chosen at run time; see [`CpuIsa::detect`]).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CpuIsa {
    /// Portable Rust; same quantities as the SIMD backends.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// [`Avx2`](Self::Avx2) plus AVX-VNNI (the VEX-encoded 256-bit `vpdpbusd`: Intel Alder Lake
    /// and later client CPUs, Sierra Forest, Zen 5): the AVX2 kernels, with the integer dot
    /// products of the many-token and packed kernels one instruction per 4 products. Same bits.
    Avx2Vnni,
    /// x86-64 AVX-512 F/BW/VL/DQ + VNNI + VBMI, and GFNI (which the CPUs with that set, Ice Lake
    /// and Zen 4 onwards, all have).
    Avx512,
}

impl CpuIsa {
    /// Whether this CPU can run the backend.
    pub fn is_available(self) -> bool {
        match self {
            Self::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx2Vnni => avx2_quant::HasAvxVnni::detect().is_some(),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => {
                Self::Avx2.is_available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512dq")
                    && is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("avx512vbmi")
                    && is_x86_feature_detected!("gfni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// All backends this CPU can run, slowest first.
    pub fn available() -> Vec<Self> {
        [Self::Scalar, Self::Avx2, Self::Avx2Vnni, Self::Avx512]
            .into_iter()
            .filter(|b| b.is_available())
            .collect()
    }

    /// The backend [`matvec`] and [`matmul`] use: the fastest available, unless
    /// `$ZEROLAYER_KERNELS` names another available one (`scalar`, `avx2`, `avx2vnni`, `avx512`).
    pub fn detect() -> Self {
        static DETECTED: OnceLock<CpuIsa> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            let forced = std::env::var("ZEROLAYER_KERNELS").ok().and_then(|v| {
                match v.trim().to_ascii_lowercase().as_str() {
                    "scalar" => Some(Self::Scalar),
                    "avx2" => Some(Self::Avx2),
                    "avx2vnni" => Some(Self::Avx2Vnni),
                    "avx512" => Some(Self::Avx512),
                    _ => None,
                }
            });
            match forced {
                Some(b) if b.is_available() => b,
                _ => *Self::available().last().unwrap_or(&Self::Scalar),
            }
        })
    }
}

/// Whether the products of a `dtype` matrix quantize their activations to 8 bits (the
/// integer-quantized formats) rather than taking them as f32 (F32, F16, BF16): the same test
/// [`matmul`] picks its path by.
pub(crate) fn quantizes_activations(dtype: GgmlType) -> bool {
    Fmt::of(dtype).is_some_and(|f| !f.is_float())
}

/// Whether `dtype` is one of the 256-element super-block formats (the K-quants Q2_K to Q6_K and
/// IQ4_XS), whose products llama.cpp runs against activations quantized per 256 elements
/// (`Q8_K`), eight times coarser than the kernels' 32-element activation blocks.
pub(crate) fn has_super_blocks(dtype: GgmlType) -> bool {
    Fmt::of(dtype).is_some_and(|f| f.block_elems() == 256)
}

/// `y = W x` for one token: `x` has `cols` elements, `y` has `rows`.
pub fn matvec(
    w: WeightMatrix<'_>,
    x: &[f32],
    y: &mut [f32],
    pool: &ThreadPool,
) -> Result<(), KernelError> {
    matmul_with(CpuIsa::detect(), w, x, 1, y, pool)
}

/// `Y = X Wᵀ` for `n` tokens: `x` is `n x cols` row-major, `y` is `n x rows` row-major.
/// Row `i` of `y` equals `matvec` on row `i` of `x` bit for bit.
pub fn matmul(
    w: WeightMatrix<'_>,
    x: &[f32],
    n: usize,
    y: &mut [f32],
    pool: &ThreadPool,
) -> Result<(), KernelError> {
    matmul_with(CpuIsa::detect(), w, x, n, y, pool)
}

/// [`matmul`] on a chosen backend (for tests and benchmarks).
pub fn matmul_with(
    backend: CpuIsa,
    w: WeightMatrix<'_>,
    x: &[f32],
    n: usize,
    y: &mut [f32],
    pool: &ThreadPool,
) -> Result<(), KernelError> {
    if !backend.is_available() {
        return Err(KernelError::BackendUnavailable { backend });
    }
    check_layout(backend, w)?;
    let Some(fmt) = validate(w, x, n, y)? else {
        return Ok(());
    };
    let _span = matmul_span(w, n, false);
    if fmt.is_float() {
        run_rows(w, n, y, pool, &|rows, out| {
            float_rows(backend, fmt, w, x, n, rows, out)
        });
        return Ok(());
    }
    quant_group(backend, fmt, &[w], x, n, &mut [y], pool);
    Ok(())
}

/// The trace span of one product (`split`: [`matmul_split_parts`]).
fn matmul_span(w: WeightMatrix<'_>, n: usize, split: bool) -> tracing::span::EnteredSpan {
    tracing::trace_span!(
        "matmul",
        dtype = w.dtype.name(),
        rows = w.rows,
        cols = w.cols,
        n,
        split
    )
    .entered()
}

/// The two products of an activation split, for about 15 bits of activation precision instead
/// of the kernels' 8: `y` (`2n x w.rows`) gets `matmul(w, x, n)` in its first half, bit for
/// bit, and in its second the product of the residual that the 8-bit quantization of `x` leaves
/// (per 32-element block `x - d * round(x / d)`, `d = amax / 127`), so the
/// two halves summed are `x · wᵀ` with the activations' rounding error multiplied too. Each
/// token is quantized once, and its residual computed from those quants, on the fly (no stored
/// parts, no separate pass). Float weights, whose products take the activations as they are,
/// get their product and a zero second half.
///
/// ```
/// use gpu_pipeline::ThreadPool;
/// use gpu_pipeline::kernels::{GgmlType, WeightMatrix, matmul_split_parts};
///
/// // One Q8_0 row of 32 ones (f16 scale 1.0, then 32 quants of 1).
/// let mut row = half::f16::from_f32(1.0).to_le_bytes().to_vec();
/// row.extend([1u8; 32]);
/// let w = WeightMatrix::new(GgmlType::Q8_0, 1, 32, &row)?;
/// let x: Vec<f32> = (0..32).map(|i| 0.01 * i as f32 + 0.001).collect();
/// let mut y = [0.0f32; 2];
/// matmul_split_parts(w, &x, 1, &mut y, &ThreadPool::new(1))?;
/// let exact: f32 = x.iter().sum();
/// assert!((y[0] + y[1] - exact).abs() < 1e-5 && (y[0] - exact).abs() > 1e-5);
/// # Ok::<(), gpu_pipeline::kernels::KernelError>(())
/// ```
pub fn matmul_split_parts(
    w: WeightMatrix<'_>,
    x: &[f32],
    n: usize,
    y: &mut [f32],
    pool: &ThreadPool,
) -> Result<(), KernelError> {
    let backend = CpuIsa::detect();
    check_layout(backend, w)?;
    let half = n.saturating_mul(w.rows);
    if y.len() != 2 * half {
        return Err(KernelError::OutputLength {
            expected: 2 * half,
            actual: y.len(),
        });
    }
    let Some(fmt) = validate(w, x, n, &mut y[..half])? else {
        return Ok(());
    };
    if fmt.is_float() {
        // Float weights never quantize their activations: nothing is left to multiply.
        let (hi, lo) = y.split_at_mut(half);
        lo.fill(0.0);
        return matmul_with(backend, w, x, n, hi, pool);
    }
    let _span = matmul_span(w, n, true);
    let job = Job::new(w, 0, 2 * n, y.as_mut_ptr());
    quant_jobs(backend, &mut [job], Input::Split(x), w.cols, 2 * n, pool);
    Ok(())
}

/// Several [`matmul`]s of the same input (`ws` share `cols`; `ys[i]` is `n x ws[i].rows`), e.g.
/// the query, key and value projections: the activations are quantized once and all rows of
/// all matrices are split over the pool in one go. Each `ys[i]` equals `matmul(ws[i], ..)` bit
/// for bit.
///
/// ```
/// use gpu_pipeline::ThreadPool;
/// use gpu_pipeline::kernels::{GgmlType, WeightMatrix, matmul_many};
///
/// let a: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0];
/// let b: Vec<f32> = vec![-1.0, 0.5];
/// let wa = WeightMatrix::new(GgmlType::F32, 2, 2, bytemuck::cast_slice(&a))?;
/// let wb = WeightMatrix::new(GgmlType::F32, 1, 2, bytemuck::cast_slice(&b))?;
/// let pool = ThreadPool::new(1);
/// let (mut ya, mut yb) = ([0.0f32; 2], [0.0f32; 1]);
/// matmul_many(&[wa, wb], &[1.0, 1.0], 1, &mut [&mut ya[..], &mut yb[..]], &pool)?;
/// assert_eq!((ya, yb), ([3.0, 7.0], [-0.5]));
/// # Ok::<(), gpu_pipeline::kernels::KernelError>(())
/// ```
pub fn matmul_many(
    ws: &[WeightMatrix<'_>],
    x: &[f32],
    n: usize,
    ys: &mut [&mut [f32]],
    pool: &ThreadPool,
) -> Result<(), KernelError> {
    if ws.len() != ys.len() {
        return Err(KernelError::OutputCount {
            matrices: ws.len(),
            outputs: ys.len(),
        });
    }
    let backend = CpuIsa::detect();
    // The shared quantized format, if every product has the same one (no allocation: this is
    // on the decode path).
    let mut group: Option<Option<Fmt>> = None;
    for (w, y) in ws.iter().zip(ys.iter_mut()) {
        check_layout(backend, *w)?;
        let f = validate(*w, x, n, y)?
            .filter(|f| !f.is_float() && w.cols == ws[0].cols && w.layout == ws[0].layout);
        group = Some(match group {
            None => f,
            Some(g) => g.filter(|&g| Some(g) == f),
        });
    }
    match group {
        Some(Some(fmt)) => {
            quant_group(backend, fmt, ws, x, n, ys, pool);
            Ok(())
        }
        _ => {
            for (w, y) in ws.iter().zip(ys.iter_mut()) {
                matmul_with(backend, *w, x, n, y, pool)?;
            }
            Ok(())
        }
    }
}

/// One product of [`matmul_batch`]: `w` times the `n` input tokens from token `first` on, its
/// `n x w.rows` results written at element `out` of the batch's output.
#[derive(Clone, Copy, Debug)]
pub struct Product<'a> {
    /// The weights (`cols` columns, as the batch's input).
    pub w: WeightMatrix<'a>,
    /// First input token (row of the batch's input).
    pub first: usize,
    /// Tokens.
    pub n: usize,
    /// Where the results start in the batch's output (token-major, `w.rows` per token).
    pub out: usize,
}

/// Most products [`matmul_batch`] describes on the stack; more are described in a heap buffer.
const BATCH_INLINE: usize = 32;

/// Several products over parts of one input, in one pool call: each [`Product`] multiplies its
/// own run of the `x.len() / cols` tokens of `x` (quantized once, whatever product reads them)
/// and writes its own range of `y`. This is a mixture of experts' layer: every chosen expert's
/// gate and up rows over that expert's tokens as one call, then the down rows. Each product's
/// results equal `matmul(p.w, tokens, ..)` bit for bit (batch invariance). Output ranges must
/// not overlap. Allocation-free for up to 32 products.
///
/// ```
/// use gpu_pipeline::ThreadPool;
/// use gpu_pipeline::kernels::{GgmlType, Product, WeightMatrix, matmul_batch};
///
/// let a: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0];
/// let b: Vec<f32> = vec![-1.0, 0.5];
/// let wa = WeightMatrix::new(GgmlType::F32, 2, 2, bytemuck::cast_slice(&a))?;
/// let wb = WeightMatrix::new(GgmlType::F32, 1, 2, bytemuck::cast_slice(&b))?;
/// // Token 0 through `wa` (2 outputs), tokens 1..3 through `wb` (1 output each).
/// let x = [1.0, 1.0, 2.0, 0.0, 0.0, 2.0];
/// let mut y = [0.0f32; 4];
/// let ps = [
///     Product { w: wa, first: 0, n: 1, out: 0 },
///     Product { w: wb, first: 1, n: 2, out: 2 },
/// ];
/// matmul_batch(&ps, &x, 2, &mut y, &ThreadPool::new(1))?;
/// assert_eq!(y, [3.0, 7.0, -2.0, 1.0]);
/// # Ok::<(), gpu_pipeline::kernels::KernelError>(())
/// ```
pub fn matmul_batch(
    products: &[Product<'_>],
    x: &[f32],
    cols: usize,
    y: &mut [f32],
    pool: &ThreadPool,
) -> Result<(), KernelError> {
    let backend = CpuIsa::detect();
    let tokens = x.len().checked_div(cols).unwrap_or(0);
    if tokens * cols != x.len() {
        return Err(KernelError::InputLength {
            expected: tokens * cols,
            actual: x.len(),
        });
    }
    // Checks, and whether every product is integer-quantized (one grouped call) or not.
    let mut grouped = true;
    for (i, p) in products.iter().enumerate() {
        check_layout(backend, p.w)?;
        let fmt = p.w.check()?;
        if p.w.cols != cols {
            return Err(KernelError::InputLength {
                expected: p.w.cols,
                actual: cols,
            });
        }
        let in_end = p.first.checked_add(p.n).filter(|&e| e <= tokens);
        let len = p.n.checked_mul(p.w.rows);
        let out_end = len.and_then(|l| p.out.checked_add(l));
        if in_end.is_none() {
            return Err(KernelError::InputLength {
                expected: (p.first + p.n) * cols,
                actual: x.len(),
            });
        }
        let Some(out_end) = out_end.filter(|&e| e <= y.len()) else {
            return Err(KernelError::OutputLength {
                expected: out_end.unwrap_or(usize::MAX),
                actual: y.len(),
            });
        };
        // Disjoint outputs (the tasks write them through raw pointers).
        for q in &products[..i] {
            let q_end = q.out + q.n * q.w.rows;
            if p.out < q_end && q.out < out_end && p.n * p.w.rows > 0 && q.n * q.w.rows > 0 {
                return Err(KernelError::OverlappingOutputs {
                    first: q.out..q_end,
                    second: p.out..out_end,
                });
            }
        }
        grouped &= !fmt.is_float();
    }
    if !grouped || cols == 0 {
        for p in products {
            let out = &mut y[p.out..p.out + p.n * p.w.rows];
            let xs = &x[p.first * cols..(p.first + p.n) * cols];
            matmul_with(backend, p.w, xs, p.n, out, pool)?;
        }
        return Ok(());
    }
    let _span = tracing::trace_span!("matmul_batch", products = products.len(), tokens).entered();
    let y_ptr = y.as_mut_ptr();
    with_jobs(
        products.len(),
        |i| {
            let p = &products[i];
            // SAFETY: `p.out + p.n * p.w.rows <= y.len()` (checked above), so the pointer stays
            // inside `y`, and the products' output ranges are disjoint.
            Job::new(p.w, p.first, p.n, unsafe { y_ptr.add(p.out) })
        },
        |jobs| quant_jobs(backend, jobs, Input::Plain(x), cols, tokens, pool),
    );
    Ok(())
}

/// Checks that `backend` has a kernel for `w`'s layout.
fn check_layout(backend: CpuIsa, w: WeightMatrix<'_>) -> Result<(), KernelError> {
    match w.layout {
        Layout::File => Ok(()),
        #[cfg(target_arch = "x86_64")]
        Layout::Rows16 if Fmt::of(w.dtype).is_some_and(|f| packed::runs_on(f, backend)) => Ok(()),
        layout => Err(KernelError::LayoutUnsupported {
            backend,
            dtype: w.dtype,
            layout,
        }),
    }
}

/// Checks the shapes of one product; `None` when there is nothing to compute (zero-sized, or
/// `cols == 0`, for which `y` is zeroed).
fn validate(
    w: WeightMatrix<'_>,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) -> Result<Option<Fmt>, KernelError> {
    let fmt = w.check()?;
    let expected_in = n.checked_mul(w.cols).ok_or(KernelError::SizeOverflow {
        rows: n as u64,
        cols: w.cols as u64,
    })?;
    if x.len() != expected_in {
        return Err(KernelError::InputLength {
            expected: expected_in,
            actual: x.len(),
        });
    }
    let expected_out = n.checked_mul(w.rows).ok_or(KernelError::SizeOverflow {
        rows: n as u64,
        cols: w.rows as u64,
    })?;
    if y.len() != expected_out {
        return Err(KernelError::OutputLength {
            expected: expected_out,
            actual: y.len(),
        });
    }
    if n == 0 || w.rows == 0 {
        return Ok(None);
    }
    if w.cols == 0 {
        y.fill(0.0);
        return Ok(None);
    }
    Ok(Some(fmt))
}

/// The integer-quantized products of `ws` (validated, all in format `fmt` with the same `cols`)
/// with the `n` tokens of `x`, into `ys`.
fn quant_group(
    backend: CpuIsa,
    fmt: Fmt,
    ws: &[WeightMatrix<'_>],
    x: &[f32],
    n: usize,
    ys: &mut [&mut [f32]],
    pool: &ThreadPool,
) {
    debug_assert!(ws.iter().all(|w| Fmt::of(w.dtype) == Some(fmt)));
    let mut ys = ys.iter_mut();
    with_jobs(
        ws.len(),
        |i| {
            Job::new(
                ws[i],
                0,
                n,
                ys.next().map_or(std::ptr::null_mut(), |y| y.as_mut_ptr()),
            )
        },
        |jobs| quant_jobs(backend, jobs, Input::Plain(x), ws[0].cols, n, pool),
    );
}

/// One product of a pool call: `w` times the `n` input tokens from token `first` on, into
/// `out`; `chunk` and `first_task` are set by [`run_jobs`].
#[derive(Clone, Copy)]
struct Job<'w, 'y> {
    w: WeightMatrix<'w>,
    first: usize,
    n: usize,
    out: OutRows<'y>,
    /// Rows per task (up to `tail_from`).
    chunk: usize,
    /// Where the tail's smaller tasks start (`w.rows`: none).
    tail_from: usize,
    /// Rows per task of the tail.
    tail_chunk: usize,
    /// Index of the job's first task.
    first_task: usize,
}

impl<'w, 'y> Job<'w, 'y> {
    const EMPTY: Self = Self::new(
        WeightMatrix {
            dtype: GgmlType::F32,
            rows: 0,
            cols: 0,
            data: &[],
            layout: Layout::File,
        },
        0,
        0,
        std::ptr::null_mut(),
    );

    /// The job of `w` over tokens `first..first + n`, writing `n x w.rows` outputs at `out`
    /// (which must stay valid and unaliased for `'y`).
    const fn new(w: WeightMatrix<'w>, first: usize, n: usize, out: *mut f32) -> Self {
        Self {
            w,
            first,
            n,
            out: OutRows {
                ptr: out,
                stride: w.rows,
                _y: std::marker::PhantomData,
            },
            chunk: 1,
            tail_from: 0,
            tail_chunk: 1,
            first_task: 0,
        }
    }

    /// Whether the AVX-512 block kernels (packed, panel) run this job, with [`ActBlock`]s;
    /// otherwise the quad kernels with [`ActQuad`]s.
    fn uses_blocks(&self, backend: CpuIsa) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            backend == CpuIsa::Avx512
                && (self.w.layout == Layout::Rows16
                    || Fmt::of(self.w.dtype).is_some_and(|f| panel::applies(f, self.n)))
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = backend;
            false
        }
    }
}

/// Calls `f` with the `count` jobs `make(0..count)`: on the stack for up to [`BATCH_INLINE`]
/// (the decode path must not allocate), else in a heap buffer.
fn with_jobs<'w, 'y, R>(
    count: usize,
    mut make: impl FnMut(usize) -> Job<'w, 'y>,
    f: impl FnOnce(&mut [Job<'w, 'y>]) -> R,
) -> R {
    if count <= BATCH_INLINE {
        let mut inline = [Job::EMPTY; BATCH_INLINE];
        for (i, slot) in inline[..count].iter_mut().enumerate() {
            *slot = make(i);
        }
        f(&mut inline[..count])
    } else {
        let mut heap: Vec<Job<'w, 'y>> = (0..count).map(make).collect();
        f(&mut heap)
    }
}

/// The activations of a [`quant_jobs`] call.
#[derive(Clone, Copy)]
enum Input<'a> {
    /// The tokens as they are.
    Plain(&'a [f32]),
    /// `n` tokens, then their [`split_residual`]s: the call's `2n` tokens.
    Split(&'a [f32]),
}

/// The integer-quantized `jobs` (validated, all with `cols` columns) over the `tokens` tokens of
/// `input`: the tokens are quantized once (in the layouts the jobs' kernels read), then every
/// job's rows are split over the pool in one call.
fn quant_jobs(
    backend: CpuIsa,
    jobs: &mut [Job<'_, '_>],
    input: Input<'_>,
    cols: usize,
    tokens: usize,
    pool: &ThreadPool,
) {
    let blocks = jobs.iter().any(|j| j.uses_blocks(backend));
    let quads = jobs.iter().any(|j| !j.uses_blocks(backend));
    let nb = cols / 32;
    let nq = act::quads_per_token(cols);
    // Quantize the activations once per layout, then share them read-only.
    with_block_acts(blocks, tokens * nb, |block_acts| {
        ACT_SCRATCH.with(|scratch| {
            let mut quad_acts = scratch.borrow_mut();
            let quad_len = if quads { tokens * nq } else { 0 };
            if quad_acts.len() < quad_len {
                quad_acts.resize(quad_len, ActQuad::ZERO);
            }
            let quad_acts = &mut quad_acts[..quad_len];
            #[cfg(target_arch = "x86_64")]
            if blocks {
                quantize_par(
                    pool,
                    input,
                    cols,
                    (block_acts, nb),
                    &|xs, a| act::quantize_blocks(backend, xs, a),
                    &act::block_residual,
                );
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = block_acts;
            if quads {
                quantize_par(
                    pool,
                    input,
                    cols,
                    (quad_acts, nq),
                    &|xs, a| act::quantize_tokens(backend, xs, cols, a),
                    &|xt, _, lo| split_residual(xt, lo),
                );
            }
            #[cfg(target_arch = "x86_64")]
            let block_acts: &[ActBlock] = block_acts;
            let quad_acts: &[ActQuad] = quad_acts;
            // The kernels that read the per-token quads (every backend but the AVX-512 blocks).
            let quads = |j: &Job<'_, '_>, fmt, rows, out: &mut RowsOut<'_>| {
                let acts = &quad_acts[j.first * nq..];
                quant_rows(backend, fmt, j.w, acts, j.n, rows, out)
            };
            #[cfg(target_arch = "x86_64")]
            with_offsets(backend, jobs, block_acts, |jobs, offsets| {
                run_jobs(jobs, pool, &|j, rows, out| {
                    let Some(fmt) = Fmt::of(j.w.dtype) else {
                        return;
                    };
                    if !j.uses_blocks(backend) {
                        return quads(j, fmt, rows, out);
                    }
                    let acts = &block_acts[j.first * nb..];
                    let offs = offsets.of(fmt, j.first * nb);
                    // SAFETY: the AVX-512 backend is available (`uses_blocks` checked it is the
                    // one picked, and callers check availability); a packed matrix's format
                    // has a packed layout (checked with its length), else `applies` checked it.
                    unsafe {
                        if j.w.layout == Layout::Rows16 {
                            packed::quant_rows(fmt, j.w, acts, offs, j.n, rows, out)
                        } else {
                            panel::quant_rows(fmt, j.w, acts, offs, j.n, rows, out)
                        }
                    }
                })
            });
            #[cfg(not(target_arch = "x86_64"))]
            run_jobs(jobs, pool, &|j, rows, out| {
                if let Some(fmt) = Fmt::of(j.w.dtype) {
                    quads(j, fmt, rows, out)
                }
            });
        })
    });
}

/// The offset starts ([`panel::fill_offsets`]) of a product's activation blocks, one table per
/// [`panel::OffsetKey`] its panel jobs read.
#[cfg(target_arch = "x86_64")]
struct Offsets<'a> {
    keys: &'a [panel::OffsetKey],
    /// The tables, key after key, `per_key` entries each.
    tables: &'a [[i32; 2]],
    per_key: usize,
}

#[cfg(target_arch = "x86_64")]
impl Offsets<'_> {
    /// `fmt`'s table from entry `from` on (empty for a format without an offset).
    fn of(&self, fmt: Fmt, from: usize) -> &[[i32; 2]] {
        let key = panel::offset_key(fmt);
        match self.keys.iter().position(|k| Some(*k) == key) {
            Some(i) => &self.tables[i * self.per_key..(i + 1) * self.per_key][from..],
            None => &[],
        }
    }
}

/// Calls `f` with the offset tables of the panel kernel's jobs among `jobs` over `acts`
/// (computed once here for every token, not per task: each of a product's ~16 tasks per
/// thread would otherwise compute them all again).
#[cfg(target_arch = "x86_64")]
fn with_offsets<'w, 'y, R>(
    backend: CpuIsa,
    jobs: &mut [Job<'w, 'y>],
    acts: &[ActBlock],
    f: impl FnOnce(&mut [Job<'w, 'y>], &Offsets<'_>) -> R,
) -> R {
    // At most one key per format with an offset (8 of them).
    let mut keys = [panel::OffsetKey::default(); 8];
    let mut count = 0;
    for j in jobs.iter() {
        if j.uses_blocks(backend)
            && panel::runs(j.w.layout, j.n)
            && let Some(key) = Fmt::of(j.w.dtype).and_then(panel::offset_key)
            && !keys[..count].contains(&key)
        {
            keys[count] = key;
            count += 1;
        }
    }
    if count == 0 {
        return f(
            jobs,
            &Offsets {
                keys: &[],
                tables: &[],
                per_key: 0,
            },
        );
    }
    OFFSET_SCRATCH.with(|scratch| {
        let mut tables = scratch.borrow_mut();
        let per_key = acts.len();
        if tables.len() < count * per_key {
            tables.resize(count * per_key, [0; 2]);
        }
        for (key, table) in keys[..count].iter().zip(tables.chunks_exact_mut(per_key)) {
            panel::fill_offsets(*key, acts, table);
        }
        f(
            jobs,
            &Offsets {
                keys: &keys[..count],
                tables: &tables[..count * per_key],
                per_key,
            },
        )
    })
}

/// Calls `f` with `len` reusable [`ActBlock`]s of this thread when `needed` (else none).
#[cfg(target_arch = "x86_64")]
fn with_block_acts<R>(needed: bool, len: usize, f: impl FnOnce(&mut [ActBlock]) -> R) -> R {
    if !needed {
        return f(&mut []);
    }
    BLOCK_SCRATCH.with(|scratch| {
        let mut acts = scratch.borrow_mut();
        if acts.len() < len {
            acts.resize(len, ActBlock::ZERO);
        }
        f(&mut acts[..len])
    })
}

#[cfg(not(target_arch = "x86_64"))]
fn with_block_acts<R>(_needed: bool, _len: usize, f: impl FnOnce(&mut [()]) -> R) -> R {
    f(&mut [])
}

/// Runs `f` over the tokens of `input` (`cols` each) and their `per_token` entries of `acts`:
/// in parallel chunks of tokens for 16+ tokens, else on this thread. Each token's result is the
/// same either way. A split input's tokens are quantized into the first half of `acts`, and
/// the residual each leaves (`residual(token, its entries, out)`, computed into a per-thread
/// row) into the second: the residuals are never stored whole.
#[allow(clippy::type_complexity)]
fn quantize_par<A: Send + Sync>(
    pool: &ThreadPool,
    input: Input<'_>,
    cols: usize,
    (acts, per_token): (&mut [A], usize),
    f: &(dyn Fn(&[f32], &mut [A]) + Sync),
    residual: &(dyn Fn(&[f32], &[A], &mut [f32]) + Sync),
) {
    let threads = pool.n_threads();
    let (x, split) = match input {
        Input::Plain(x) => (x, false),
        Input::Split(x) => (x, true),
    };
    let n = x.len() / cols.max(1);
    // Split: the tokens' entries, then their residuals'.
    let (hi, lo) = acts.split_at_mut(if split { n * per_token } else { acts.len() });
    let work = |xs: &[f32], hi: &mut [A], lo: &mut [A]| {
        if !split {
            return f(xs, hi);
        }
        SPLIT_SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            if s.len() < cols {
                s.resize(cols, 0.0);
            }
            let l = &mut s[..cols];
            let tokens = xs.chunks_exact(cols).zip(hi.chunks_exact_mut(per_token));
            for ((xt, ht), lt) in tokens.zip(lo.chunks_exact_mut(per_token)) {
                f(xt, ht);
                residual(xt, ht, l);
                f(l, lt);
            }
        })
    };
    if n * (1 + usize::from(split)) < 16 || threads < 2 {
        return work(x, hi, lo);
    }
    let per = n.div_ceil(2 * threads);
    // Each task takes the next chunk of tokens (no per-call allocation: batched decode runs
    // this for every product); a plain input has no residual chunks (empty ones instead).
    let lo_chunks = lo
        .chunks_mut(per * per_token)
        .chain(std::iter::repeat_with(|| &mut [][..]));
    let chunks = Mutex::new(
        x.chunks(per * cols)
            .zip(hi.chunks_mut(per * per_token))
            .zip(lo_chunks),
    );
    pool.run(n.div_ceil(per), &|_, _| {
        let next = chunks.lock().unwrap_or_else(|e| e.into_inner()).next();
        if let Some(((xs, h), l)) = next {
            work(xs, h, l);
        }
    });
}

thread_local! {
    /// Reused per calling thread so a decode step does not allocate.
    static ACT_SCRATCH: RefCell<Vec<ActQuad>> = const { RefCell::new(Vec::new()) };
    /// The compact activation blocks of the panel kernel, likewise.
    #[cfg(target_arch = "x86_64")]
    static BLOCK_SCRATCH: RefCell<Vec<ActBlock>> = const { RefCell::new(Vec::new()) };
    /// The panel kernel's offset tables ([`with_offsets`]), likewise.
    #[cfg(target_arch = "x86_64")]
    static OFFSET_SCRATCH: RefCell<Vec<[i32; 2]>> = const { RefCell::new(Vec::new()) };
    /// One token's [`split_residual`], while [`quantize_par`] quantizes it.
    static SPLIT_SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Output rows `rows` for all `n` tokens; `out` writes `y[t * w.rows + r]`.
#[derive(Clone, Copy)]
struct OutRows<'y> {
    ptr: *mut f32,
    stride: usize,
    _y: std::marker::PhantomData<&'y mut [f32]>,
}

// SAFETY: tasks write disjoint row ranges of `y` (see `run_rows`); the pointer is only used
// through `set`, whose callers stay inside their own range.
unsafe impl Send for OutRows<'_> {}
// SAFETY: as above.
unsafe impl Sync for OutRows<'_> {}

/// A task's window onto the output: rows `start..end` of every token.
pub(crate) struct RowsOut<'a> {
    base: &'a OutRows<'a>,
    start: usize,
    end: usize,
    n: usize,
}

impl RowsOut<'_> {
    /// Stores `y[token][row]`; `row` must be in this task's range.
    #[inline(always)]
    pub(crate) fn set(&mut self, token: usize, row: usize, v: f32) {
        assert!(row >= self.start && row < self.end && token < self.n);
        // SAFETY: `row` is inside this task's exclusive range and `token < n`, so the index is in
        // bounds of `y` (length `n * stride`) and no other task writes it.
        unsafe { *self.base.ptr.add(token * self.base.stride + row) = v };
    }

    /// Stores `y[token][row0 + i] = v[i]` for consecutive rows, all in this task's range.
    #[inline(always)]
    pub(crate) fn set_run(&mut self, token: usize, row0: usize, v: &[f32]) {
        assert!(row0 >= self.start && row0 + v.len() <= self.end && token < self.n);
        // SAFETY: the rows `row0..row0 + v.len()` are inside this task's exclusive range and
        // `token < n`, so the destination is inside `y` and written by no other task.
        unsafe {
            let dst = self.base.ptr.add(token * self.base.stride + row0);
            match v.len() {
                // Fixed sizes compile to vector moves instead of a `memmove` call.
                16 => dst
                    .cast::<[f32; 16]>()
                    .write_unaligned(*v.as_ptr().cast::<[f32; 16]>()),
                4 => dst
                    .cast::<[f32; 4]>()
                    .write_unaligned(*v.as_ptr().cast::<[f32; 4]>()),
                len => std::ptr::copy_nonoverlapping(v.as_ptr(), dst, len),
            }
        };
    }
}

/// Decode (n <= 2) tasks per thread.
#[cfg(target_arch = "x86_64")]
use avx512::DECODE_TASKS_PER_THREAD;
#[cfg(not(target_arch = "x86_64"))]
const DECODE_TASKS_PER_THREAD: usize = 4;

fn run_rows(
    w: WeightMatrix<'_>,
    n: usize,
    y: &mut [f32],
    pool: &ThreadPool,
    f: &(dyn Fn(std::ops::Range<usize>, &mut RowsOut<'_>) + Sync),
) {
    with_jobs(
        1,
        |_| Job::new(w, 0, n, y.as_mut_ptr()),
        |jobs| run_jobs(jobs, pool, &|_, rows, out| f(rows, out)),
    );
}

/// Splits the rows of every job into tasks (whole 4-row groups, or 16-row panels for many
/// tokens or a packed matrix) and runs them all in one pool call: `f(job, rows, out)`.
fn run_jobs(
    jobs: &mut [Job<'_, '_>],
    pool: &ThreadPool,
    f: &(dyn Fn(&Job<'_, '_>, std::ops::Range<usize>, &mut RowsOut<'_>) + Sync),
) {
    // Chunks of whole 4-row groups; aim for ~8 chunks per thread so a descheduled thread delays
    // an operation by little, but not so small that the claiming overhead shows.
    let threads = pool.n_threads().max(1);
    let mut tasks = 0;
    for j in jobs.iter_mut() {
        let n = j.n;
        let min_rows = if n >= 8 { 16 } else { 32 };
        // Many tokens: whole 16-row panels (see `panel`).
        #[cfg(target_arch = "x86_64")]
        let align = if n >= panel::PANEL_MIN_TOKENS || j.w.layout == Layout::Rows16 {
            panel::PANEL_ROWS
        } else {
            4
        };
        #[cfg(not(target_arch = "x86_64"))]
        let align = 4;
        j.chunk =
            (j.w.rows
                .div_ceil(threads * if n <= 2 { DECODE_TASKS_PER_THREAD } else { 8 }))
            .max(min_rows)
            .next_multiple_of(align);
        // Decode: the last `threads` tasks' worth of rows goes in quarter-size tasks, so the
        // thread that finishes first waits on a small task, not a whole one (tasks are claimed
        // in order).
        (j.tail_from, j.tail_chunk) = (j.w.rows, j.chunk);
        let whole = j.w.rows / j.chunk;
        if n <= 2 && threads > 1 && whole > threads {
            j.tail_from = (whole - threads) * j.chunk;
            j.tail_chunk = (j.chunk / 4).next_multiple_of(align).max(align);
        }
        j.first_task = tasks;
        // A job without tokens has no tasks.
        if n > 0 {
            tasks +=
                j.tail_from.div_ceil(j.chunk) + (j.w.rows - j.tail_from).div_ceil(j.tail_chunk);
        }
    }
    let jobs: &[Job<'_, '_>] = jobs;
    let task = |t: usize, _thread: usize| {
        // The job whose task range holds `t` (tasks are numbered job after job; a job without
        // tasks shares its `first_task` with the next one, which `partition_point` skips).
        let i = jobs.partition_point(|j| j.first_task <= t) - 1;
        let j = &jobs[i];
        // `tail_from` is a multiple of `chunk` where there is a tail, else `w.rows`.
        let (k, big) = (t - j.first_task, j.tail_from.div_ceil(j.chunk));
        let (start, len) = if k < big {
            (k * j.chunk, j.chunk)
        } else {
            (j.tail_from + (k - big) * j.tail_chunk, j.tail_chunk)
        };
        let end = (start + len).min(j.w.rows);
        let mut rows_out = RowsOut {
            base: &j.out,
            start,
            end,
            n: j.n,
        };
        f(j, start..end, &mut rows_out);
    };
    if tasks == 1 {
        task(0, 0);
    } else {
        pool.run(tasks, &task);
    }
}

fn float_rows(
    backend: CpuIsa,
    fmt: Fmt,
    w: WeightMatrix<'_>,
    x: &[f32],
    n: usize,
    rows: std::ops::Range<usize>,
    out: &mut RowsOut<'_>,
) {
    match backend {
        #[cfg(target_arch = "x86_64")]
        CpuIsa::Avx512 if n > avx2::FEW_TOKENS => {
            // SAFETY: `backend.is_available()` was checked by the caller.
            unsafe { float512::float_rows(fmt, w, x, n, rows, out) }
        }
        #[cfg(target_arch = "x86_64")]
        CpuIsa::Avx512 | CpuIsa::Avx2 | CpuIsa::Avx2Vnni => {
            // SAFETY: `backend.is_available()` was checked by the caller (AVX-512 and AVX-VNNI
            // imply AVX2).
            unsafe { avx2::float_rows(fmt, w, x, n, rows, out) }
        }
        _ => scalar::float_rows(fmt, w, x, n, rows, out),
    }
}

fn quant_rows(
    backend: CpuIsa,
    fmt: Fmt,
    w: WeightMatrix<'_>,
    acts: &[ActQuad],
    n: usize,
    rows: std::ops::Range<usize>,
    out: &mut RowsOut<'_>,
) {
    match backend {
        #[cfg(target_arch = "x86_64")]
        CpuIsa::Avx512 => {
            // SAFETY: `backend.is_available()` was checked by the caller.
            unsafe { avx512::quant_rows(fmt, w, acts, n, rows, out) }
        }
        #[cfg(target_arch = "x86_64")]
        CpuIsa::Avx2 | CpuIsa::Avx2Vnni => {
            let vnni = if backend == CpuIsa::Avx2Vnni {
                avx2_quant::HasAvxVnni::detect()
            } else {
                None
            };
            if w.layout == Layout::Rows16 {
                // SAFETY: `backend.is_available()` was checked by the caller; a packed matrix's
                // format has a packed layout (checked with its length) and its tasks start on
                // whole 16-row groups (`run_jobs`).
                unsafe { avx2_packed::quant_rows(fmt, w, acts, n, rows, out, vnni) }
            } else {
                // SAFETY: `backend.is_available()` was checked by the caller.
                unsafe { avx2::quant_rows(fmt, w, acts, n, rows, out, vnni) }
            }
        }
        _ => scalar::quant_rows(fmt, w, acts, n, rows, out),
    }
}

/// Dequantizes row `row` of `w` into `out` (`cols` elements), e.g. for an embedding lookup.
pub fn dequantize_row(w: WeightMatrix<'_>, row: usize, out: &mut [f32]) -> Result<(), KernelError> {
    check_layout(CpuIsa::Scalar, w)?;
    let fmt = w.check()?;
    if row >= w.rows {
        return Err(KernelError::RowOutOfRange { row, rows: w.rows });
    }
    if out.len() != w.cols {
        return Err(KernelError::OutputLength {
            expected: w.cols,
            actual: out.len(),
        });
    }
    let rb = fmt.row_bytes(w.cols);
    format::dequantize_row(fmt, &w.data[row * rb..(row + 1) * rb], out);
    Ok(())
}
