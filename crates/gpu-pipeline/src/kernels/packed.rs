//! Weights re-arranged once, at load time, for the packed 16-row kernels ("row-interleaved":
//! AVX-512, and AVX2 in `avx2_packed.rs`).
//!
//! In a ggml file a row's blocks follow each other, so a kernel that wants 16 rows' block `b` in
//! one vector (lane `r` = row `r`, the layout `vpdpbusd` with broadcast activations needs) must
//! gather and transpose them on every pass: the [`super::panel`] kernel does that per task, and
//! the decode kernel instead reduces 4 rows horizontally. Decoding reads every weight once per
//! token, so that shuffling is paid per byte streamed, and it caps decode well below the
//! machine's read bandwidth. [`PackedWeights`] does the transpose once: for each group of 16 rows
//! and each 32-element block, the 16 rows' quants as 64-byte vectors (lane `r` holds 4 bytes of
//! row `r`: Q4_0/Q4_1 nibble bytes `4c..4c + 4`, i.e. elements `4c..4c + 4` in the low nibbles and
//! `16 + 4c..16 + 4c + 4` in the high ones; Q8_0 quants `4j..4j + 4`, offset by 128 to u8), then
//! the 16 f16 scales (and Q4_1's 16 f16 minimums). Same bytes per weight as the file.
//!
//! Q5_0/Q5_1 pack as well (the nibbles as Q4_0's, then each row's 32 fifth bits in one lane,
//! ordered so that a shift and a mask give a weight vector's, [`q5_bit`]), and so do the
//! K-quants that Q4_K_M/Q5_K_M/Q6_K files are made of, Q4_K, Q5_K and Q6_K, packed per
//! 256-element super-block ([`Q4K_SUPER`], [`Q5K_SUPER`], [`Q6K_SUPER`]): each 32-element
//! sub-block's low 4 bits as a packed Q4_0 block (Q5_K's fifth bits in one more lane per row, as
//! Q5_0's; Q6_K's high 2 bits in two, [`q6_bit`]), then the 16 rows' super-block scales and
//! their 6-bit (Q4_K, Q5_K) or 8-bit (Q6_K) sub-block scales side by side, so
//! one load gives 16 (AVX2: 8) rows' scale fields. Q2_K and Q3_K pack per super-block too
//! ([`Q2K_SUPER`], [`Q3K_SUPER`]): each sub-block's 2-bit quants in two lanes per row (ordered as
//! Q6_K's high bits, so one `vgf2p8affineqb` or a shift and a mask give a weight vector's),
//! Q3_K's third bits in one more (ordered as Q5_0's fifth bits), then the rows' `d` (Q2_K: and
//! `dmin`) and their scale bytes side by side. Both backends decode a packed block the same
//! way ([`block16`], and 8 rows at a time `avx2_packed`'s `half_block`).
//!
//! **Same arithmetic.** The kernel accumulates each output exactly as the other AVX-512 kernels
//! do (exact integer block dot product, one FMA by `d_w * d_x`, then `m_w * d_x * sum(q_x)` for
//! the formats with a minimum; Q6_K one product and FMA per 16-element half; four f32 chains by
//! block index modulo 4, summed as `(c0 + c2) + (c1 + c3)`), so a packed matrix gives
//! bit-identical results to its file layout, and batch invariance holds.

// The AVX-512 intrinsics are stable since Rust 1.89; the workspace toolchain is 1.95.
#![allow(clippy::incompatible_msrv)]

use super::format::Fmt;
use super::{GgmlType, KernelError, Layout, WeightMatrix};
use crate::ThreadPool;

/// Rows per group (one per 32-bit lane of a 512-bit vector).
pub(crate) const GROUP_ROWS: usize = 16;

/// One cache line: the unit of a packed buffer (keeps every packed block 64-byte aligned).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

/// A weight matrix in the row-interleaved layout of the packed 16-row kernels (see the module
/// docs), owned. Built once per matrix at load time; [`matrix`](Self::matrix) lends it to the
/// products ([`super::matmul`], [`super::matmul_many`]), which give bit-identical results to
/// the file layout, faster.
///
/// ```
/// use gpu_pipeline::ThreadPool;
/// use gpu_pipeline::kernels::{GgmlType, PackedWeights, WeightMatrix, matvec};
///
/// // A 2 x 32 Q8_0 matrix: per row an f16 scale (1.0) and 32 quants.
/// let mut bytes = Vec::new();
/// for r in 0..2i8 {
///     bytes.extend_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
///     bytes.extend((0..32i8).map(|i| (i - 16 + r) as u8));
/// }
/// let w = WeightMatrix::new(GgmlType::Q8_0, 2, 32, &bytes)?;
/// let pool = ThreadPool::new(1);
/// let x = vec![0.5f32; 32];
/// let (mut a, mut b) = ([0.0f32; 2], [0.0f32; 2]);
/// matvec(w, &x, &mut a, &pool)?;
/// if let Some(p) = PackedWeights::pack(w, &pool)? {
///     matvec(p.matrix(), &x, &mut b, &pool)?;
///     assert_eq!(a, b);
/// }
/// # Ok::<(), gpu_pipeline::kernels::KernelError>(())
/// ```
pub struct PackedWeights {
    dtype: GgmlType,
    rows: usize,
    cols: usize,
    /// Bytes of packed data at the front of `lines`.
    len: usize,
    lines: Vec<Line>,
}

impl std::fmt::Debug for PackedWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedWeights")
            .field("dtype", &self.dtype)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("bytes", &self.bytes().len())
            .finish()
    }
}

/// Bytes of one packed block (16 rows x 32 elements) of `fmt`, if the layout exists for it
/// (K-quants: an eighth of a packed super-block, see [`Q4K_SUPER`]).
pub(crate) fn block_bytes(fmt: Fmt) -> Option<usize> {
    match fmt {
        Fmt::Q4_0 => Some(256 + 32),
        Fmt::Q4_1 => Some(256 + 64),
        Fmt::Q8_0 => Some(512 + 32),
        Fmt::Q4K => Some(Q4K_SUPER / 8),
        Fmt::Q5K => Some(Q5K_SUPER / 8),
        Fmt::Q6K => Some(Q6K_SUPER / 8),
        Fmt::Q2K => Some(Q2K_SUPER / 8),
        Fmt::Q3K => Some(Q3K_SUPER / 8),
        Fmt::IQ4NL => Some(256 + 32),
        Fmt::IQ4XS => Some(IQ4XS_SUPER / 8),
        Fmt::Q5_0 => Some(256 + 64 + 32),
        Fmt::Q5_1 => Some(256 + 64 + 64),
        _ => None,
    }
}

/// Bytes of one packed Q6_K super-block (16 rows x 256 elements, as many bytes as the file's 16
/// blocks): per sub-block, [`Q6K_SUB`] bytes: the low 4 bits as a packed Q4_0 block's quants
/// (256 bytes), then the high 2 bits as two 64-byte vectors (lane `r` = row `r`, see
/// [`q6_bit`]); then the 16 rows' `d` as f16 ([`Q6K_D`]), then their 16 signed 8-bit scales as 4
/// vectors ([`Q6K_SCALES`]: vector `v` lane `r` = scales `4v..4v + 4` of row `r`).
pub(crate) const Q6K_SUPER: usize = 8 * Q6K_SUB + 32 + 4 * 64;
/// Bytes of one sub-block's quants in a packed Q6_K super-block.
pub(crate) const Q6K_SUB: usize = 256 + 128;
/// Offset of the `d` values in a packed Q6_K super-block.
pub(crate) const Q6K_D: usize = 8 * Q6K_SUB;
/// Offset of the scale vectors in a packed Q6_K super-block.
pub(crate) const Q6K_SCALES: usize = Q6K_D + 32;

/// Bytes of one packed Q2_K super-block (16 rows x 256 elements, as many bytes as the file's 16
/// blocks): per sub-block, the 16 rows' 2-bit quants as two 64-byte vectors ([`Q2K_SUB`] bytes,
/// ordered as Q6_K's high bits, [`q6_bit`], so that one shift by `2(j % 4)` and a mask give
/// weight vector `j`); then the 16 rows' `d` ([`Q2K_D`]) and `dmin` ([`Q2K_DMIN`]) as f16, then
/// their 16 scale bytes (scale in the low nibble, minimum in the high one, per 16 elements) as 4
/// vectors ([`Q2K_SCALES`]: vector `v` lane `r` = scale bytes `4v..4v + 4` of row `r`).
pub(crate) const Q2K_SUPER: usize = 8 * Q2K_SUB + 32 + 32 + 4 * 64;
/// Bytes of one sub-block's quants in a packed Q2_K super-block.
pub(crate) const Q2K_SUB: usize = 128;
/// Offset of the `d` values in a packed Q2_K super-block.
pub(crate) const Q2K_D: usize = 8 * Q2K_SUB;
/// Offset of the `dmin` values in a packed Q2_K super-block.
pub(crate) const Q2K_DMIN: usize = Q2K_D + 32;
/// Offset of the scale vectors in a packed Q2_K super-block.
pub(crate) const Q2K_SCALES: usize = Q2K_DMIN + 32;

/// Bytes of one packed Q3_K super-block (16 rows x 256 elements, as many bytes as the file's 16
/// blocks): per sub-block ([`Q3K_SUB`] bytes), the low 2 bits of the quants as a packed Q2_K
/// sub-block's, then each row's 32 third bits in one lane (ordered as Q5_0's fifth bits,
/// [`q5_bit`]); then the 16 rows' `d` as f16 ([`Q3K_D`]), then the 12 bytes of 6-bit scales as 3
/// vectors ([`Q3K_SCALES`]: vector `k` lane `r` = bytes `4k..4k + 4` of row `r`'s `scales`, the
/// file's packing, see [`weight_cache::quant::scale_k3`]).
pub(crate) const Q3K_SUPER: usize = 8 * Q3K_SUB + 32 + 3 * 64;
/// Bytes of one sub-block's quants in a packed Q3_K super-block.
pub(crate) const Q3K_SUB: usize = 128 + 64;
/// Offset of the `d` values in a packed Q3_K super-block.
pub(crate) const Q3K_D: usize = 8 * Q3K_SUB;
/// Offset of the scale vectors in a packed Q3_K super-block.
pub(crate) const Q3K_SCALES: usize = Q3K_D + 32;

/// Bytes of one packed IQ4_XS super-block (16 rows x 256 elements, as many bytes as the file's
/// 16 blocks): the 8 sub-blocks' code-book indices, 256 bytes each and laid out as a packed Q4_0
/// block's, then the 16 rows' `d` as f16 ([`IQ4XS_D`]), their `scales_l` as one vector
/// ([`IQ4XS_SL`]: lane `r` = row `r`'s 4 bytes) and their `scales_h` as 16 u16 ([`IQ4XS_SH`]).
pub(crate) const IQ4XS_SUPER: usize = 8 * 256 + 32 + 64 + 32;
/// Offset of the `d` values in a packed IQ4_XS super-block.
pub(crate) const IQ4XS_D: usize = 8 * 256;
/// Offset of the `scales_l` vector in a packed IQ4_XS super-block.
pub(crate) const IQ4XS_SL: usize = IQ4XS_D + 32;
/// Offset of the `scales_h` values in a packed IQ4_XS super-block.
pub(crate) const IQ4XS_SH: usize = IQ4XS_SL + 64;

/// Q3_K: where scale `i` (0..16) of a row sits in the packed scale vectors ([`Q3K_SCALES`],
/// the file's `scales` bytes `4k..4k + 4` in vector `k`): the vector holding its low 4 bits
/// (byte `i % 8`, its high nibble for `i >= 8`) and their right shift in the lane, then the
/// right shift of its high 2 bits in vector 2 (byte `8 + i % 4`): `scale_k3`'s fields, shared by
/// both backends' decoders.
pub(crate) const fn q3k_scale_at(i: usize) -> (usize, usize, usize) {
    (
        i % 8 / 4,
        8 * (i % 4) + 4 * (i / 8),
        8 * (i % 4) + 2 * (i / 4),
    )
}

/// IQ4_XS: the right shifts of sub-block `s`'s scale bits in a row's `scales_l` lane
/// ([`IQ4XS_SL`]: the low 4 bits, nibble `s % 2` of byte `s / 2`) and in its `scales_h`
/// ([`IQ4XS_SH`]: the high 2 bits): `scale_iq4xs`'s fields, shared by both backends' decoders.
pub(crate) const fn iq4xs_scale_at(s: usize) -> (usize, usize) {
    (8 * (s / 2) + 4 * (s % 2), 2 * s)
}

/// Q6_K: where the high 2 bits of element `e` (0..32) of a sub-block go among the row's 64 packed
/// bits (two 32-bit lanes, the first for the kernel's weight vectors 0..4, the second for 4..8):
/// bits `8k + 2(j % 4)..+2` of lane `j / 4`, for the element in byte `k` of weight vector `j`, so
/// that one shift by `4 - 2(j % 4)` and a mask put them at bits 4..6 of each byte.
pub(crate) fn q6_bit(e: usize) -> usize {
    let (j, k) = vector_byte(e);
    32 * (j / 4) + 8 * k + 2 * (j % 4)
}

/// The kernel's weight vector `j` and byte `k` of its lane that hold element `e` (0..32) of a
/// block: vectors 0..4 take elements `4j + k` (the low nibbles), 4..8 elements `16 + 4(j - 4) + k`.
fn vector_byte(e: usize) -> (usize, usize) {
    (e % 16 / 4 + 4 * (e / 16), e % 4)
}

/// Q5_0/Q5_1: where the fifth bit of element `e` (0..32) of a block goes in the row's packed
/// 32-bit `qh` lane: bit `8k + j` for the element in byte `k` of the kernel's weight vector `j`
/// (elements `4j + k`, `j < 4`, from the low nibbles; `16 + 4(j - 4) + k` from the high ones), so
/// that one shift by `4 - j` and a mask put vector `j`'s fifth bits at bit 4 of each byte.
pub(crate) fn q5_bit(e: usize) -> usize {
    let (j, k) = vector_byte(e);
    8 * k + j
}

/// Bytes of one packed Q4_K super-block (16 rows x 256 elements, as many bytes as the file's 16
/// blocks): the 8 sub-blocks' quants, 256 bytes each and laid out as a packed Q4_0 block's (lane
/// `r` = 4 nibble bytes of row `r`, nibble byte `i` = elements `i` and `16 + i` of the
/// sub-block), then the 16 rows' `d` ([`Q4K_D`]) and `dmin` ([`Q4K_DMIN`]) as f16, then the
/// 12 bytes of 6-bit scales and minimums as 3 vectors ([`Q4K_SCALES`]): vector `k` lane `r` =
/// bytes `4k..4k + 4` of row `r`'s `scales` (the file's packing, see
/// [`weight_cache::quant::scale_min_k4`]).
pub(crate) const Q4K_SUPER: usize = 8 * 256 + 32 + 32 + 3 * 64;
/// Offset of the `d` values in a packed Q4_K super-block.
pub(crate) const Q4K_D: usize = 8 * 256;
/// Offset of the `dmin` values in a packed Q4_K super-block.
pub(crate) const Q4K_DMIN: usize = Q4K_D + 32;
/// Offset of the scale vectors in a packed Q4_K super-block.
pub(crate) const Q4K_SCALES: usize = Q4K_DMIN + 32;

/// Bytes of one packed Q5_K super-block (16 rows x 256 elements, as many bytes as the file's 16
/// blocks): a packed Q4_K super-block whose sub-blocks each add the 16 rows' fifth bits as one
/// more 64-byte vector (lane `r` = row `r`'s 32 fifth bits, ordered as Q5_0's, [`q5_bit`]), so a
/// sub-block takes [`Q5K_SUB`] bytes; then `d`, `dmin` and the scale vectors as Q4_K's.
pub(crate) const Q5K_SUPER: usize = 8 * Q5K_SUB + 32 + 32 + 3 * 64;
/// Bytes of one sub-block's quants in a packed Q5_K super-block.
pub(crate) const Q5K_SUB: usize = 256 + 64;
/// Offset of the `d` values in a packed Q5_K super-block.
pub(crate) const Q5K_D: usize = 8 * Q5K_SUB;
/// Offset of the `dmin` values in a packed Q5_K super-block.
pub(crate) const Q5K_DMIN: usize = Q5K_D + 32;
/// Offset of the scale vectors in a packed Q5_K super-block.
pub(crate) const Q5K_SCALES: usize = Q5K_DMIN + 32;

/// Q4_K (`five` false) and Q5_K: bytes per packed sub-block, and the offsets of `d`, `dmin` and
/// the scale vectors in the packed super-block.
pub(crate) const fn k45_fields(five: bool) -> (usize, usize, usize, usize) {
    if five {
        (Q5K_SUB, Q5K_D, Q5K_DMIN, Q5K_SCALES)
    } else {
        (256, Q4K_D, Q4K_DMIN, Q4K_SCALES)
    }
}

/// Whether `isa` has a kernel for packed matrices of `fmt` (the AVX-512 and AVX2 backends read
/// every packed layout).
#[cfg(target_arch = "x86_64")]
pub(crate) fn runs_on(fmt: Fmt, isa: super::CpuIsa) -> bool {
    block_bytes(fmt).is_some()
        && matches!(
            isa,
            super::CpuIsa::Avx512 | super::CpuIsa::Avx2 | super::CpuIsa::Avx2Vnni
        )
}

/// Bytes of a `rows x cols` matrix of `fmt` in the packed layout (rows rounded up to whole groups).
pub(crate) fn packed_len(fmt: Fmt, rows: usize, cols: usize) -> Option<usize> {
    let bb = block_bytes(fmt)?;
    rows.div_ceil(GROUP_ROWS)
        .checked_mul(cols / 32)?
        .checked_mul(bb)
}

impl PackedWeights {
    /// Whether matrices of `dtype` can be packed (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K,
    /// Q5_K, Q6_K), and
    /// the kernels that read the layout run on this CPU (the AVX-512 or AVX2 backend, whichever
    /// [`super::CpuIsa::detect`] selects).
    pub fn supported(dtype: GgmlType) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            Fmt::of(dtype).is_some_and(|f| runs_on(f, super::CpuIsa::detect()))
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = dtype;
            false
        }
    }

    /// Packs a file-layout matrix, splitting the work over `pool`; `Ok(None)` when the format
    /// (or this CPU, see [`supported`](Self::supported)) has no packed kernel, so the caller
    /// keeps using the file layout.
    pub fn pack(w: WeightMatrix<'_>, pool: &ThreadPool) -> Result<Option<Self>, KernelError> {
        Self::pack_releasing(w, pool, &mut |_| {})
    }

    /// Source bytes packed between two calls of `pack_releasing`'s `done` (about).
    const RELEASE_STEP: usize = 2 << 20;

    /// [`pack`](Self::pack), calling `done(range)` with each range of `w.data` it has finished
    /// reading (a few MiB at a time, in order), so the caller can drop the file's pages as it
    /// goes: packing then never holds a large matrix twice (its file pages and its copy).
    pub fn pack_releasing(
        w: WeightMatrix<'_>,
        pool: &ThreadPool,
        done: &mut dyn FnMut(std::ops::Range<usize>),
    ) -> Result<Option<Self>, KernelError> {
        let fmt = w.check()?;
        if w.layout != Layout::File || !Self::supported(w.dtype) {
            return Ok(None);
        }
        let Some(bb) = block_bytes(fmt) else {
            return Ok(None);
        };
        let len = packed_len(fmt, w.rows, w.cols).ok_or(KernelError::SizeOverflow {
            rows: w.rows as u64,
            cols: w.cols as u64,
        })?;
        let mut lines = vec![Line([0; 64]); len.div_ceil(64)];
        let nb = w.cols / 32;
        let group_bytes = nb * bb;
        let groups = w.rows.div_ceil(GROUP_ROWS);
        if group_bytes > 0 && groups > 0 {
            let bytes: &mut [u8] = bytemuck_lines(&mut lines);
            let src_group = fmt.row_bytes(w.cols) * GROUP_ROWS;
            let step = (Self::RELEASE_STEP / src_group.max(1)).max(1);
            let mut outs = bytes.chunks_mut(group_bytes).enumerate();
            let mut first = 0;
            while first < groups {
                let n = step.min(groups - first);
                let chunks = std::sync::Mutex::new(outs.by_ref().take(n));
                pool.run(n, &|_, _| {
                    let next = chunks.lock().unwrap_or_else(|e| e.into_inner()).next();
                    if let Some((g, out)) = next {
                        pack_group(fmt, w, g, out);
                    }
                });
                let end = ((first + n) * src_group).min(w.data.len());
                done(first * src_group..end);
                first += n;
            }
        }
        Ok(Some(Self {
            dtype: w.dtype,
            rows: w.rows,
            cols: w.cols,
            len,
            lines,
        }))
    }

    /// The packed matrix, for the products.
    pub fn matrix(&self) -> WeightMatrix<'_> {
        WeightMatrix {
            dtype: self.dtype,
            rows: self.rows,
            cols: self.cols,
            data: self.bytes(),
            layout: Layout::Rows16,
        }
    }

    /// Dequantizes row `row` into `out` (`cols` values), exactly as weight-cache dequantizes the
    /// file's row (each block is put back into its file encoding first): embedding lookups in a
    /// table whose file pages were released after packing.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) -> Result<(), KernelError> {
        let fmt = Fmt::of(self.dtype).ok_or(KernelError::UnsupportedDtype { dtype: self.dtype })?;
        if row >= self.rows {
            return Err(KernelError::RowOutOfRange {
                row,
                rows: self.rows,
            });
        }
        if out.len() != self.cols {
            return Err(KernelError::OutputLength {
                expected: self.cols,
                actual: out.len(),
            });
        }
        let bb = block_bytes(fmt).ok_or(KernelError::UnsupportedDtype { dtype: self.dtype })?;
        let nb = self.cols / 32;
        let (g, r) = (row / GROUP_ROWS, row % GROUP_ROWS);
        let group = &self.bytes()[g * nb * bb..(g + 1) * nb * bb];
        let (unit, fb) = (unit_bytes(fmt, bb), fmt.block_bytes());
        let mut blk = [0u8; 210]; // the largest file block (Q6_K)
        for (b, y) in out.chunks_exact_mut(fmt.block_elems()).enumerate() {
            let blk = &mut blk[..fb];
            unpack(fmt, &group[b * unit..][..unit], r, blk);
            weight_cache::dequantize(self.dtype, blk, y)
                .map_err(|_| KernelError::UnsupportedDtype { dtype: self.dtype })?;
        }
        Ok(())
    }

    /// Bytes held (the packed data).
    pub fn bytes_len(&self) -> usize {
        self.bytes().len()
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `Line` is 64 plain bytes with no padding, so the lines are `64 * len` bytes.
        let all = unsafe {
            std::slice::from_raw_parts(self.lines.as_ptr().cast::<u8>(), self.lines.len() * 64)
        };
        &all[..self.len]
    }
}

fn bytemuck_lines(lines: &mut [Line]) -> &mut [u8] {
    // SAFETY: `Line` is 64 plain bytes with no padding and any bit pattern is valid.
    unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr().cast::<u8>(), lines.len() * 64) }
}

/// Bytes of the packed unit that holds one file block of 16 rows: a 32-element block, or a
/// K-quant's 256-element super-block (`bb` is [`block_bytes`]).
fn unit_bytes(fmt: Fmt, bb: usize) -> usize {
    bb * fmt.block_elems() / 32
}

/// Row `r` of the packed unit `pu`, back in the file's block encoding (`blk`, one file block):
/// [`pack_group`]'s inverse.
fn unpack(fmt: Fmt, pu: &[u8], r: usize, blk: &mut [u8]) {
    match fmt {
        Fmt::Q4K | Fmt::Q5K => k45_unpack(fmt == Fmt::Q5K, pu, r, blk),
        Fmt::Q6K => q6k_unpack(pu, r, blk),
        Fmt::Q2K | Fmt::Q3K => k23_unpack(fmt == Fmt::Q3K, pu, r, blk),
        Fmt::Q5_0 | Fmt::Q5_1 => {
            // d, (Q5_1: m,) qh as a little-endian u32, then the 16 nibble bytes.
            let hdr = if fmt == Fmt::Q5_1 { 4 } else { 2 };
            blk[0..2].copy_from_slice(&pu[320 + 2 * r..][..2]);
            if fmt == Fmt::Q5_1 {
                blk[2..4].copy_from_slice(&pu[352 + 2 * r..][..2]);
            }
            let packed = u32::from_le_bytes(pu[256 + 4 * r..][..4].try_into().unwrap());
            let qh = (0..32).fold(0u32, |h, e| h | (((packed >> q5_bit(e)) & 1) << e));
            blk[hdr..hdr + 4].copy_from_slice(&qh.to_le_bytes());
            for c in 0..4 {
                blk[hdr + 4 + 4 * c..][..4].copy_from_slice(&pu[64 * c + 4 * r..][..4]);
            }
        }
        Fmt::Q4_0 | Fmt::Q4_1 | Fmt::IQ4NL | Fmt::IQ4XS => {
            byte_moves(fmt, r, |file, packed, len| {
                blk[file..file + len].copy_from_slice(&pu[packed..packed + len]);
            })
        }
        _ => {
            blk[0..2].copy_from_slice(&pu[512 + 2 * r..][..2]);
            for j in 0..8 {
                for i in 0..4 {
                    blk[2 + 4 * j + i] = pu[64 * j + 4 * r + i] ^ 0x80;
                }
            }
        }
    }
}

/// Packs row `r` of a group's Q4_K (`five` false: the file's 144 bytes) or Q5_K (176 bytes)
/// super-block `blk` into the packed super-block `out`. The file's quants: byte `32j + l` of
/// `qs` holds element `l` of sub-block `2j` (low nibble) and of sub-block `2j + 1` (high
/// nibble); Q5_K's fifth bit of element `l` of sub-block `s` is bit `s` of `qh[l]`, as
/// weight-cache's decoder reads them. Both files start with `d`, `dmin` and the 12 scale bytes.
fn k45_pack(five: bool, blk: &[u8], r: usize, out: &mut [u8]) {
    use std::mem::offset_of;
    use weight_cache::quant::{BlockQ4K, BlockQ5K};
    let (sub, d_at, dmin_at, sc_at) = k45_fields(five);
    let qs_at = if five {
        offset_of!(BlockQ5K, qs)
    } else {
        offset_of!(BlockQ4K, qs)
    };
    let qs = &blk[qs_at..][..128];
    for s in 0..8 {
        let (chunk, shift) = (&qs[32 * (s / 2)..][..32], 4 * (s % 2));
        let q = |e: usize| (chunk[e] >> shift) & 0xF;
        let out = &mut out[sub * s..][..sub];
        for c in 0..4 {
            for i in 0..4 {
                let e = 4 * c + i;
                out[64 * c + 4 * r + i] = q(e) | (q(16 + e) << 4);
            }
        }
        if five {
            let qh = &blk[offset_of!(BlockQ5K, qh)..][..32];
            let bits = (0..32).fold(0u32, |h, e| h | (u32::from((qh[e] >> s) & 1) << q5_bit(e)));
            out[256 + 4 * r..][..4].copy_from_slice(&bits.to_le_bytes());
        }
    }
    out[d_at + 2 * r..][..2].copy_from_slice(&blk[offset_of!(BlockQ4K, d)..][..2]);
    out[dmin_at + 2 * r..][..2].copy_from_slice(&blk[offset_of!(BlockQ4K, dmin)..][..2]);
    let sc = offset_of!(BlockQ4K, scales);
    for k in 0..3 {
        out[sc_at + 64 * k + 4 * r..][..4].copy_from_slice(&blk[sc + 4 * k..][..4]);
    }
}

/// Row `r` of the packed Q4_K or Q5_K (`five`) super-block `sup`, back in the file's encoding
/// (`blk`, 144 or 176 bytes): [`k45_pack`]'s inverse.
fn k45_unpack(five: bool, sup: &[u8], r: usize, blk: &mut [u8]) {
    use std::mem::offset_of;
    use weight_cache::quant::{BlockQ4K, BlockQ5K};
    let (sub, d_at, dmin_at, sc_at) = k45_fields(five);
    blk.fill(0);
    blk[offset_of!(BlockQ4K, d)..][..2].copy_from_slice(&sup[d_at + 2 * r..][..2]);
    blk[offset_of!(BlockQ4K, dmin)..][..2].copy_from_slice(&sup[dmin_at + 2 * r..][..2]);
    let sc = offset_of!(BlockQ4K, scales);
    for k in 0..3 {
        blk[sc + 4 * k..][..4].copy_from_slice(&sup[sc_at + 64 * k + 4 * r..][..4]);
    }
    let (qs_at, qh_at) = if five {
        (offset_of!(BlockQ5K, qs), offset_of!(BlockQ5K, qh))
    } else {
        (offset_of!(BlockQ4K, qs), 0)
    };
    for s in 0..8 {
        let sup = &sup[sub * s..][..sub];
        // Q5_K: the row's fifth-bit lane of this sub-block.
        let lane = if five {
            u32::from_le_bytes(sup[256 + 4 * r..][..4].try_into().unwrap())
        } else {
            0
        };
        for e in 0..32 {
            let byte = sup[64 * (e % 16 / 4) + 4 * r + e % 4];
            let q = if e < 16 { byte & 0xF } else { byte >> 4 };
            blk[qs_at + 32 * (s / 2) + e] |= q << (4 * (s % 2));
            if five {
                blk[qh_at + e] |= (((lane >> q5_bit(e)) & 1) as u8) << s;
            }
        }
    }
}

/// Packs row `r` of a group's Q6_K super-block `blk` (the file's 210 bytes) into the packed
/// super-block `out`. The file's element `l` of sub-block `s = 4 half + j` (weight-cache's
/// decoder): low bits in `ql[64 half + l + 32 (j % 2)]` (low nibble for `j < 2`), high bits at
/// `2j` of `qh[32 half + l]`.
fn q6k_pack(blk: &[u8], r: usize, out: &mut [u8]) {
    use std::mem::offset_of;
    use weight_cache::quant::BlockQ6K;
    let ql = &blk[offset_of!(BlockQ6K, ql)..][..128];
    let qh = &blk[offset_of!(BlockQ6K, qh)..][..64];
    for s in 0..8 {
        let (half, j) = (s / 4, s % 4);
        let lo = |e: usize| (ql[64 * half + e + 32 * (j % 2)] >> (4 * (j / 2))) & 0xF;
        let hi = |e: usize| (qh[32 * half + e] >> (2 * j)) & 3;
        let sub = &mut out[Q6K_SUB * s..][..Q6K_SUB];
        for c in 0..4 {
            for i in 0..4 {
                let e = 4 * c + i;
                sub[64 * c + 4 * r + i] = lo(e) | (lo(16 + e) << 4);
            }
        }
        let bits = (0..32).fold(0u64, |h, e| h | (u64::from(hi(e)) << q6_bit(e)));
        sub[256 + 4 * r..][..4].copy_from_slice(&(bits as u32).to_le_bytes());
        sub[320 + 4 * r..][..4].copy_from_slice(&((bits >> 32) as u32).to_le_bytes());
    }
    let d = offset_of!(BlockQ6K, d);
    out[Q6K_D + 2 * r..][..2].copy_from_slice(&blk[d..d + 2]);
    let sc = offset_of!(BlockQ6K, scales);
    for v in 0..4 {
        out[Q6K_SCALES + 64 * v + 4 * r..][..4].copy_from_slice(&blk[sc + 4 * v..][..4]);
    }
}

/// Row `r` of the packed Q6_K super-block `sup`, back in the file's encoding (`blk`, 210
/// bytes): [`q6k_pack`]'s inverse.
fn q6k_unpack(sup: &[u8], r: usize, blk: &mut [u8]) {
    use std::mem::offset_of;
    use weight_cache::quant::BlockQ6K;
    blk.fill(0);
    let (ql, qh) = (offset_of!(BlockQ6K, ql), offset_of!(BlockQ6K, qh));
    for s in 0..8 {
        let sub = &sup[Q6K_SUB * s..][..Q6K_SUB];
        let lane = |at: usize| u32::from_le_bytes(sub[at + 4 * r..][..4].try_into().unwrap());
        let hi = u64::from(lane(256)) | (u64::from(lane(320)) << 32);
        // The file's element `l` of sub-block `s = 4 half + j` (weight-cache's decoder): low
        // bits in `ql[64 half + l + 32 (j % 2)]` (low nibble for j < 2), high bits at `2j` of
        // `qh[32 half + l]`.
        let (half, j) = (s / 4, s % 4);
        for e in 0..32 {
            let byte = sub[64 * (e % 16 / 4) + 4 * r + e % 4];
            let lo = if e < 16 { byte & 0xF } else { byte >> 4 };
            let h = ((hi >> q6_bit(e)) & 3) as u8;
            blk[ql + 64 * half + e + 32 * (j % 2)] |= lo << (4 * (j / 2));
            blk[qh + 32 * half + e] |= h << (2 * j);
        }
    }
    let d = offset_of!(BlockQ6K, d);
    blk[d..d + 2].copy_from_slice(&sup[Q6K_D + 2 * r..][..2]);
    let sc = offset_of!(BlockQ6K, scales);
    for v in 0..4 {
        blk[sc + 4 * v..][..4].copy_from_slice(&sup[Q6K_SCALES + 64 * v + 4 * r..][..4]);
    }
}

/// Packs row `r` of a group's Q2_K (`three` false: the file's 84 bytes) or Q3_K (110 bytes)
/// super-block `blk` into the packed super-block `out`: each sub-block's quants as weight-cache
/// decodes them (Q3_K: the low 2 bits and the third bit), the scale bytes, `d` and `dmin` as the
/// file has them.
fn k23_pack(three: bool, blk: &[u8], r: usize, out: &mut [u8]) {
    use std::mem::offset_of;
    use weight_cache::quant::{BlockQ2K, BlockQ3K};
    let (fmt, sub) = if three {
        (Fmt::Q3K, Q3K_SUB)
    } else {
        (Fmt::Q2K, Q2K_SUB)
    };
    let mut q = [0u8; 32];
    for s in 0..8 {
        super::format::decode_sub(fmt, blk, s, &mut q);
        let out = &mut out[sub * s..][..sub];
        let low = (0..32).fold(0u64, |h, e| h | (u64::from(q[e] & 3) << q6_bit(e)));
        out[4 * r..][..4].copy_from_slice(&(low as u32).to_le_bytes());
        out[64 + 4 * r..][..4].copy_from_slice(&((low >> 32) as u32).to_le_bytes());
        if three {
            let high = (0..32).fold(0u32, |h, e| h | (u32::from(q[e] >> 2) << q5_bit(e)));
            out[128 + 4 * r..][..4].copy_from_slice(&high.to_le_bytes());
        }
    }
    if three {
        out[Q3K_D + 2 * r..][..2].copy_from_slice(&blk[offset_of!(BlockQ3K, d)..][..2]);
        let sc = offset_of!(BlockQ3K, scales);
        for k in 0..3 {
            out[Q3K_SCALES + 64 * k + 4 * r..][..4].copy_from_slice(&blk[sc + 4 * k..][..4]);
        }
    } else {
        out[Q2K_D + 2 * r..][..2].copy_from_slice(&blk[offset_of!(BlockQ2K, d)..][..2]);
        out[Q2K_DMIN + 2 * r..][..2].copy_from_slice(&blk[offset_of!(BlockQ2K, dmin)..][..2]);
        let sc = offset_of!(BlockQ2K, scales);
        for v in 0..4 {
            out[Q2K_SCALES + 64 * v + 4 * r..][..4].copy_from_slice(&blk[sc + 4 * v..][..4]);
        }
    }
}

/// Row `r` of the packed Q2_K or Q3_K (`three`) super-block `sup`, back in the file's encoding
/// (`blk`, 84 or 110 bytes): [`k23_pack`]'s inverse. The file's element `l` of sub-block
/// `s = 4 half + j`: bits `2j..2j + 2` of `qs[32 half + l]`, Q3_K's third bit at bit `s` of
/// `hmask[l]` (weight-cache's decoder).
fn k23_unpack(three: bool, sup: &[u8], r: usize, blk: &mut [u8]) {
    use std::mem::offset_of;
    use weight_cache::quant::{BlockQ2K, BlockQ3K};
    blk.fill(0);
    let (sub, qs) = if three {
        (Q3K_SUB, offset_of!(BlockQ3K, qs))
    } else {
        (Q2K_SUB, offset_of!(BlockQ2K, qs))
    };
    for s in 0..8 {
        let su = &sup[sub * s..][..sub];
        let lane = |at: usize| u32::from_le_bytes(su[at + 4 * r..][..4].try_into().unwrap());
        let low = u64::from(lane(0)) | (u64::from(lane(64)) << 32);
        let high = if three { lane(128) } else { 0 };
        let (half, j) = (s / 4, s % 4);
        for e in 0..32 {
            let q = ((low >> q6_bit(e)) & 3) as u8;
            blk[qs + 32 * half + e] |= q << (2 * j);
            if three {
                let h = ((high >> q5_bit(e)) & 1) as u8;
                blk[offset_of!(BlockQ3K, hmask) + e] |= h << s;
            }
        }
    }
    if three {
        blk[offset_of!(BlockQ3K, d)..][..2].copy_from_slice(&sup[Q3K_D + 2 * r..][..2]);
        let sc = offset_of!(BlockQ3K, scales);
        for k in 0..3 {
            blk[sc + 4 * k..][..4].copy_from_slice(&sup[Q3K_SCALES + 64 * k + 4 * r..][..4]);
        }
    } else {
        blk[offset_of!(BlockQ2K, d)..][..2].copy_from_slice(&sup[Q2K_D + 2 * r..][..2]);
        blk[offset_of!(BlockQ2K, dmin)..][..2].copy_from_slice(&sup[Q2K_DMIN + 2 * r..][..2]);
        let sc = offset_of!(BlockQ2K, scales);
        for v in 0..4 {
            blk[sc + 4 * v..][..4].copy_from_slice(&sup[Q2K_SCALES + 64 * v + 4 * r..][..4]);
        }
    }
}

/// The packed layouts that only move bytes (Q4_0, Q4_1, IQ4_NL, IQ4_XS): `f(file, packed, len)`
/// for each run of `len` bytes of row `r`'s file block (super-block) at offset `file` that sits
/// at offset `packed` of the packed unit. One description for both directions ([`pack_group`],
/// [`unpack`]).
/// - Q4_0, Q4_1, IQ4_NL (laid out as Q4_0: d, then 16 bytes of indices): the 16 nibble bytes in
///   4 dword lanes of 4 vectors, then the 16 rows' `d` (at 256) and Q4_1's `m` (at 288).
/// - IQ4_XS: sub-block `s`'s indices (`qs` bytes `16s..16s + 16`, nibble order as Q4_0's) as a
///   packed Q4_0 block's at `256 s`, then `d` ([`IQ4XS_D`]), `scales_l` ([`IQ4XS_SL`]) and
///   `scales_h` ([`IQ4XS_SH`]).
fn byte_moves(fmt: Fmt, r: usize, mut f: impl FnMut(usize, usize, usize)) {
    use std::mem::offset_of;
    use weight_cache::quant::BlockIQ4XS;
    let indices = |f: &mut dyn FnMut(usize, usize, usize), file: usize, packed: usize| {
        for c in 0..4 {
            f(file + 4 * c, packed + 64 * c + 4 * r, 4);
        }
    };
    if fmt == Fmt::IQ4XS {
        for s in 0..8 {
            indices(&mut f, offset_of!(BlockIQ4XS, qs) + 16 * s, 256 * s);
        }
        f(offset_of!(BlockIQ4XS, d), IQ4XS_D + 2 * r, 2);
        f(offset_of!(BlockIQ4XS, scales_l), IQ4XS_SL + 4 * r, 4);
        f(offset_of!(BlockIQ4XS, scales_h), IQ4XS_SH + 2 * r, 2);
        return;
    }
    let hdr = if fmt == Fmt::Q4_1 { 4 } else { 2 };
    indices(&mut f, hdr, 0);
    f(0, 256 + 2 * r, 2);
    if fmt == Fmt::Q4_1 {
        f(2, 288 + 2 * r, 2);
    }
}

/// Packs group `g` (rows `16g..16g + 16`, missing rows as zero blocks) of `w` into `out`
/// (`nb` packed blocks).
fn pack_group(fmt: Fmt, w: WeightMatrix<'_>, g: usize, out: &mut [u8]) {
    let Some(bb) = block_bytes(fmt) else { return };
    let rb = fmt.row_bytes(w.cols);
    let bs = fmt.block_bytes();
    for (b, pb) in out.chunks_exact_mut(unit_bytes(fmt, bb)).enumerate() {
        for r in 0..GROUP_ROWS {
            let row = g * GROUP_ROWS + r;
            if row >= w.rows {
                break; // zero rows: all quants, scales and minimums 0
            }
            let blk = &w.data[row * rb + b * bs..][..bs];
            match fmt {
                Fmt::Q4K | Fmt::Q5K => k45_pack(fmt == Fmt::Q5K, blk, r, pb),
                Fmt::Q6K => q6k_pack(blk, r, pb),
                Fmt::Q2K | Fmt::Q3K => k23_pack(fmt == Fmt::Q3K, blk, r, pb),
                Fmt::Q4_0 | Fmt::Q4_1 | Fmt::IQ4NL | Fmt::IQ4XS => {
                    byte_moves(fmt, r, |file, packed, len| {
                        pb[packed..packed + len].copy_from_slice(&blk[file..file + len]);
                    });
                }
                Fmt::Q5_0 | Fmt::Q5_1 => {
                    let mut q = [0u8; 32];
                    super::format::decode_sub(fmt, blk, 0, &mut q);
                    for c in 0..4 {
                        for i in 0..4 {
                            let e = 4 * c + i;
                            pb[64 * c + 4 * r + i] = (q[e] & 0xF) | ((q[16 + e] & 0xF) << 4);
                        }
                    }
                    let qh = (0..32).fold(0u32, |h, e| h | (u32::from(q[e] >> 4) << q5_bit(e)));
                    pb[256 + 4 * r..][..4].copy_from_slice(&qh.to_le_bytes());
                    pb[320 + 2 * r..][..2].copy_from_slice(&blk[0..2]);
                    if fmt == Fmt::Q5_1 {
                        pb[352 + 2 * r..][..2].copy_from_slice(&blk[2..4]);
                    }
                }
                Fmt::Q8_0 => {
                    let qs = &blk[2..34];
                    for j in 0..8 {
                        // Four quants at once, each offset by 128 (i8 -> u8).
                        let q = u32::from_le_bytes([
                            qs[4 * j],
                            qs[4 * j + 1],
                            qs[4 * j + 2],
                            qs[4 * j + 3],
                        ]);
                        pb[64 * j + 4 * r..][..4].copy_from_slice(&(q ^ 0x8080_8080).to_le_bytes());
                    }
                    pb[512 + 2 * r..][..2].copy_from_slice(&blk[0..2]);
                }
                _ => unreachable!("block_bytes checked the format"),
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use avx512::{block16, locate, quant_rows};

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::super::act::ActBlock;
    use super::super::avx512::{
        F_IQ4NL, F_IQ4XS, F_Q2K, F_Q3K, F_Q4_1, F_Q4K, F_Q5_0, F_Q5_1, F_Q5K, F_Q6K, F_Q8_0,
        IQ4_TABLE, NIBBLE_F32, has_min, is_split, offset_shift,
    };
    use super::super::format::Fmt;
    use super::super::{RowsOut, WeightMatrix};
    use super::{
        GROUP_ROWS, IQ4XS_D, IQ4XS_SH, IQ4XS_SL, Q2K_D, Q2K_DMIN, Q2K_SCALES, Q2K_SUB, Q3K_D,
        Q3K_SCALES, Q3K_SUB, Q6K_D, Q6K_SCALES, Q6K_SUB, block_bytes, k45_fields,
    };

    /// How far ahead (bytes) decode prefetches the weights it streams, into L2
    /// (`_MM_HINT_T2`). Measured on Zen 4 (default model, 2 threads, `zerolayer bench
    /// --gen-tokens 128`, three alternated rounds): 2048 bytes into L1 gave 181-202 tok/s, no
    /// software prefetch 183-214, 8192 bytes into L2 212-236: prefetches into L1 a short way
    /// ahead hold L1's few miss buffers and stall the loads, while L2 takes many more
    /// outstanding misses.
    const PF_AHEAD: usize = 8192;

    /// Rows `rows` (whole groups, except at the matrix end) x all `n` tokens of a packed matrix.
    ///
    /// # Safety
    /// The CPU supports the features enabled here; `w` is a packed matrix (checked length) of
    /// format `fmt`, one of [`block_bytes`]'s; `acts` holds `n` tokens of `w.cols / 32` blocks
    /// (`offs` their offset starts for the panel kernel, as its `quant_rows` takes them);
    /// `rows.start` is a multiple of [`GROUP_ROWS`].
    #[target_feature(
        enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
    )]
    pub(crate) unsafe fn quant_rows(
        fmt: Fmt,
        w: WeightMatrix<'_>,
        acts: &[ActBlock],
        offs: &[[i32; 2]],
        n: usize,
        rows: Range<usize>,
        out: &mut RowsOut<'_>,
    ) {
        super::super::avx512::by_quant_format!(fmt, rows_impl(fmt, w, acts, offs, n, rows, out))
    }

    #[target_feature(
        enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
    )]
    fn rows_impl<const F: u8>(
        fmt: Fmt,
        w: WeightMatrix<'_>,
        acts: &[ActBlock],
        offs: &[[i32; 2]],
        n: usize,
        rows: Range<usize>,
        out: &mut RowsOut<'_>,
    ) {
        if super::super::panel::runs(w.layout, n) {
            // Many tokens: unpack each group once into the panel kernel's buffer and reuse it
            // for the whole token chunk.
            // SAFETY: forwarded (same contract).
            return unsafe { super::super::panel::quant_rows(fmt, w, acts, offs, n, rows, out) };
        }
        let bb = block_bytes(fmt).unwrap_or(0);
        let nb = w.cols / 32;
        let gb = nb * bb;
        assert!(
            acts.len() >= n * nb && rows.end <= w.rows && rows.start.is_multiple_of(GROUP_ROWS)
        );
        assert!(w.data.len() >= w.rows.div_ceil(GROUP_ROWS) * gb && !rows.is_empty());
        // The task's bytes: prefetches stay inside them.
        let task = &w.data[rows.start / GROUP_ROWS * gb..rows.end.div_ceil(GROUP_ROWS) * gb];
        // The streaming prefetch runs `PF_AHEAD` ahead: the task's first bytes up to there are
        // requested at once.
        for off in (0..PF_AHEAD.min(task.len())).step_by(64) {
            // A hint inside `task` (no side effects).
            _mm_prefetch::<_MM_HINT_T2>(task[off..].as_ptr().cast());
        }
        for g in rows.clone().step_by(GROUP_ROWS) {
            let at = (g - rows.start) / GROUP_ROWS * gb;
            let group = &task[at..at + gb];
            let live = (rows.end - g).min(GROUP_ROWS);
            let mut emit = |t: usize, v: __m512| {
                let mut o = [0.0f32; 16];
                // SAFETY: `o` has room for 16 floats.
                unsafe { _mm512_storeu_ps(o.as_mut_ptr(), v) };
                out.set_run(t, g, &o[..live]);
            };
            let mut t0 = 0;
            while t0 < n {
                // Decode streams the weights once: the first tile prefetches ahead in the task.
                let pf = (t0 == 0).then_some(&task[(at + PF_AHEAD).min(task.len())..]);
                let ap = &acts[t0 * nb..];
                let mut tile = [_mm512_setzero_ps(); 9];
                // SAFETY: `ap` holds at least the tile's tokens; `group` is `nb` packed blocks.
                let len = unsafe {
                    match n - t0 {
                        9.. => put(&mut tile, by_chain::<F, 9>(group, bb, ap, nb, pf)),
                        8 => put(&mut tile, by_chain::<F, 8>(group, bb, ap, nb, pf)),
                        7 => put(&mut tile, by_chain::<F, 7>(group, bb, ap, nb, pf)),
                        6 => put(&mut tile, by_chain::<F, 6>(group, bb, ap, nb, pf)),
                        5 => put(&mut tile, by_chain::<F, 5>(group, bb, ap, nb, pf)),
                        4.. => put(&mut tile, interleaved::<F, 4>(group, bb, ap, nb, pf)),
                        3 => put(&mut tile, interleaved::<F, 3>(group, bb, ap, nb, pf)),
                        2 => put(&mut tile, interleaved::<F, 2>(group, bb, ap, nb, pf)),
                        _ => put(&mut tile, interleaved::<F, 1>(group, bb, ap, nb, pf)),
                    }
                };
                for (t, v) in tile[..len].iter().enumerate() {
                    emit(t0 + t, *v);
                }
                t0 += len;
            }
        }
    }

    /// [`interleaved`] for `T` tokens, one chain (block index modulo 4) at a time: each block
    /// is still decoded once, but only the chain's `T` accumulators are live, so up to 9 tokens
    /// (a verification of 8 drafts) fit the registers (the group's blocks, a few KiB, stay in
    /// L1 between the chains). Same bits.
    ///
    /// # Safety
    /// As for [`interleaved`].
    #[inline]
    #[target_feature(
        enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
    )]
    unsafe fn by_chain<const F: u8, const T: usize>(
        group: &[u8],
        bb: usize,
        acts: &[ActBlock],
        nb: usize,
        pf: Option<&[u8]>,
    ) -> [__m512; T] {
        let chain = |l: usize| {
            let mut acc = [_mm512_setzero_ps(); T];
            let mut b = l;
            while b < nb {
                if l == 0 {
                    prefetch_quad(pf, b, bb);
                }
                // SAFETY: `group` holds the group's `nb` whole blocks (K-quants: super-blocks).
                let blk = unsafe { block16::<F>(group.as_ptr(), b, bb) };
                step::<F, T>(&blk, std::array::from_fn(|t| &acts[t * nb + b]), &mut acc);
                b += 4;
            }
            acc
        };
        let (c0, c1, c2, c3) = (chain(0), chain(1), chain(2), chain(3));
        std::array::from_fn(|t| {
            let s02 = _mm512_add_ps(c0[t], c2[t]);
            _mm512_add_ps(s02, _mm512_add_ps(c1[t], c3[t]))
        })
    }

    /// Prefetches (into L2) the 4 blocks of `bb` bytes from block `b` of `pf`, the bytes
    /// [`PF_AHEAD`] past the group being decoded (none without `pf`, or past its end).
    #[inline(always)]
    fn prefetch_quad(pf: Option<&[u8]>, b: usize, bb: usize) {
        if let Some(pf) = pf {
            let (from, to) = (b * bb, (b * bb + 4 * bb).min(pf.len()));
            for off in (from..to).step_by(64) {
                // SAFETY: a hint inside `pf` (no side effects); SSE is baseline on x86_64.
                unsafe { _mm_prefetch::<_MM_HINT_T2>(pf[off..].as_ptr().cast()) };
            }
        }
    }

    /// Copies a tile's `T` outputs to the front of `buf`; returns `T`.
    #[inline(always)]
    fn put<const T: usize>(buf: &mut [__m512; 9], v: [__m512; T]) -> usize {
        buf[..T].copy_from_slice(&v);
        T
    }

    /// Block `b` of a packed 16-row group, decoded for the VNNI kernels: `w[j]` lane `r` = the
    /// u8 quants of elements `4j..4j + 4` of row `r` (offset as the file's, Q8_0's by 128; Q5's
    /// fifth bits and Q6_K's high bits OR-ed in from their packed lanes, [`q5_bit`],
    /// [`q6_bit`]), then the 16 rows' scales `d` and `m`: the minimums (Q4_1, Q5_1; Q4_K: the
    /// sub-block's `d * sc` and `-(dmin * m)`) or Q6_K's second-half scale (`d * sc` of elements
    /// 0..16 in `d`, 16..32 in `m`), computed as weight-cache computes them. The AVX2 kernel's
    /// `half_block` decodes the same fields 8 rows at a time.
    pub(crate) struct Block16 {
        pub(crate) w: [__m512i; 8],
        pub(crate) d: __m512,
        pub(crate) m: __m512,
        /// Q2_K: `-(dmin * m)` of elements 0..16 and 16..32 (zero for the other formats).
        pub(crate) mins: [__m512; 2],
    }

    /// Where block `b` of a packed group (`bb` bytes per block) lies: the unit holding it (a
    /// 32-element format's block, a K-quant's super-block), the K-quant sub-block index `s`
    /// (0 otherwise), and the offset of that sub-block's quants in the unit. Shared by the
    /// AVX-512 and AVX2 block decoders.
    ///
    /// # Safety
    /// `group` has the group's blocks up to `b`.
    #[inline(always)]
    pub(crate) unsafe fn locate<const F: u8>(
        group: *const u8,
        b: usize,
        bb: usize,
    ) -> (*const u8, usize, usize) {
        let sub_bytes = match F {
            F_Q4K | F_Q5K => k45_fields(F == F_Q5K).0,
            F_Q6K => Q6K_SUB,
            F_Q2K => Q2K_SUB,
            F_Q3K => Q3K_SUB,
            F_IQ4XS => 256,
            // SAFETY: block `b` is inside the group (forwarded).
            _ => return (unsafe { group.add(b * bb) }, 0, 0),
        };
        let s = b % 8;
        // SAFETY: the super-block of 8 blocks holding `b` is inside the group (forwarded).
        (unsafe { group.add(b / 8 * 8 * bb) }, s, s * sub_bytes)
    }

    /// Decodes block `b` of the packed group at `group` (see [`Block16`]).
    ///
    /// # Safety
    /// `group` has whole packed blocks of the format (`bb` bytes each, [`block_bytes`]; K-quants:
    /// whole super-blocks) up to block `b`.
    #[inline]
    #[target_feature(
        enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
    )]
    pub(crate) unsafe fn block16<const F: u8>(group: *const u8, b: usize, bb: usize) -> Block16 {
        // SAFETY (whole body): every load is inside the block (K-quants: inside its
        // super-block, whose fields are laid out in `super`).
        unsafe {
            let (p, s, sub) = locate::<F>(group, b, bb);
            let ld = |off: usize| _mm512_loadu_si512(p.add(off).cast());
            let f16s = |off: usize| _mm512_cvtph_ps(_mm256_loadu_si256(p.add(off).cast()));
            let shl = |v: __m512i, n: i32| {
                if n >= 0 {
                    _mm512_sll_epi32(v, _mm_cvtsi32_si128(n))
                } else {
                    _mm512_srl_epi32(v, _mm_cvtsi32_si128(-n))
                }
            };
            if F == F_Q8_0 {
                return Block16 {
                    w: std::array::from_fn(|j| ld(64 * j)),
                    d: f16s(512),
                    m: _mm512_setzero_ps(),
                    mins: [_mm512_setzero_ps(); 2],
                };
            }
            if matches!(F, F_Q2K | F_Q3K) {
                return k23_block::<F>(p, s, sub);
            }
            let lo4 = _mm512_set1_epi8(0x0F);
            let v: [__m512i; 4] = std::array::from_fn(|c| ld(sub + 64 * c));
            if matches!(F, F_IQ4NL | F_IQ4XS) {
                // Code-book values + 128 by index with one `vpermb` each, which reads the low 6
                // index bits of a table repeating every 16 bytes: no nibble mask needed.
                let table = _mm512_loadu_si512(IQ4_TABLE.as_ptr().cast());
                let w = std::array::from_fn(|j| {
                    if j < 4 {
                        _mm512_permutexvar_epi8(v[j], table)
                    } else {
                        _mm512_permutexvar_epi8(_mm512_srli_epi16(v[j - 4], 4), table)
                    }
                });
                let d = if F == F_IQ4XS {
                    // `d * scale_iq4xs(s)`: the low 4 bits from nibble `s % 2` of `scales_l`
                    // byte `s / 2`, the high 2 from bits `2s` of `scales_h`, minus 32.
                    let sl = ld(IQ4XS_SL);
                    let sh = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.add(IQ4XS_SH).cast()));
                    let bits = |v: __m512i, n: usize, mask: i32| {
                        _mm512_and_si512(shl(v, -(n as i32)), _mm512_set1_epi32(mask))
                    };
                    let (lo_at, hi_at) = super::iq4xs_scale_at(s);
                    let low = bits(sl, lo_at, 0xF);
                    let ls = _mm512_or_si512(low, _mm512_slli_epi32::<4>(bits(sh, hi_at, 3)));
                    let ls = _mm512_sub_epi32(ls, _mm512_set1_epi32(32));
                    _mm512_mul_ps(f16s(IQ4XS_D), _mm512_cvtepi32_ps(ls))
                } else {
                    f16s(256)
                };
                return Block16 {
                    w,
                    d,
                    m: _mm512_setzero_ps(),
                    mins: [_mm512_setzero_ps(); 2],
                };
            }
            let mut w: [__m512i; 8] = std::array::from_fn(|j| {
                if j < 4 {
                    _mm512_and_si512(v[j], lo4)
                } else {
                    _mm512_and_si512(_mm512_srli_epi16(v[j - 4], 4), lo4)
                }
            });
            if matches!(F, F_Q5_0 | F_Q5_1 | F_Q5K) {
                // Vector `j`'s fifth bits sit at bits `8k + j` of the lane (`q5_bit`).
                let (qh, bit4) = (ld(sub + 256), _mm512_set1_epi8(0x10));
                for (j, wj) in w.iter_mut().enumerate() {
                    let at = shl(qh, 4 - j as i32);
                    *wj = _mm512_or_si512(*wj, _mm512_and_si512(at, bit4));
                }
            }
            if F == F_Q6K {
                // Vector `j`'s high bits sit at bits `8k + 2(j % 4)` of lane vector `j / 4`
                // (`q6_bit`).
                let (hi, bits45) = ([ld(sub + 256), ld(sub + 320)], _mm512_set1_epi8(0x30));
                for (j, wj) in w.iter_mut().enumerate() {
                    let at = shl(hi[j / 4], 4 - 2 * (j % 4) as i32);
                    *wj = _mm512_or_si512(*wj, _mm512_and_si512(at, bits45));
                }
            }
            let (d, m) = match F {
                F_Q6K => {
                    // The scales of elements 0..16 and 16..32: signed bytes `2s`, `2s + 1`.
                    let v = ld(Q6K_SCALES + 64 * (s / 2));
                    let byte = |i: usize| {
                        let up = shl(v, 24 - 8 * i as i32);
                        _mm512_cvtepi32_ps(_mm512_srai_epi32::<24>(up))
                    };
                    let (d, i) = (f16s(Q6K_D), 2 * (s % 2));
                    (_mm512_mul_ps(d, byte(i)), _mm512_mul_ps(d, byte(i + 1)))
                }
                F_Q4K | F_Q5K => {
                    // ggml's `get_scale_min_k4`, 16 rows at once (lane = bytes `4k..4k + 4` of
                    // the row's scales in vector `k`).
                    let (_, d_at, dmin_at, sc_at) = k45_fields(F == F_Q5K);
                    let and = |x: __m512i, m: i32| _mm512_and_si512(x, _mm512_set1_epi32(m));
                    let k = |i: usize| ld(sc_at + 64 * i);
                    let (sc, mn) = if s < 4 {
                        let at = -8 * s as i32;
                        (and(shl(k(0), at), 63), and(shl(k(1), at), 63))
                    } else {
                        // Low 4 bits from bytes 8..12, high 2 bits from the top of bytes 0..4
                        // (scale) and 4..8 (minimum).
                        let (i, v2) = (s as i32 - 4, k(2));
                        let top = |x: __m512i| and(shl(x, -(8 * i + 2)), 0x30);
                        (
                            _mm512_or_si512(and(shl(v2, -8 * i), 15), top(k(0))),
                            _mm512_or_si512(and(shl(v2, -(8 * i + 4)), 15), top(k(1))),
                        )
                    };
                    let sign = _mm512_set1_ps(-0.0);
                    let dm = _mm512_mul_ps(f16s(dmin_at), _mm512_cvtepi32_ps(mn));
                    (
                        _mm512_mul_ps(f16s(d_at), _mm512_cvtepi32_ps(sc)),
                        _mm512_xor_ps(dm, sign),
                    )
                }
                F_Q4_1 => (f16s(256), f16s(288)),
                F_Q5_0 => (f16s(320), _mm512_setzero_ps()),
                F_Q5_1 => (f16s(320), f16s(352)),
                _ => (f16s(256), _mm512_setzero_ps()),
            };
            Block16 {
                w,
                d,
                m,
                mins: [_mm512_setzero_ps(); 2],
            }
        }
    }

    /// [`block16`] of Q2_K and Q3_K: sub-block `s` (its quants at `sub`) of the packed
    /// super-block at `p`. Weight vector `j`'s 2-bit quants sit at bits `8k + 2(j % 4)` of lane
    /// vector `j / 4` ([`super::q6_bit`]), Q3_K's third bits at bits `8k + j` of the third
    /// vector ([`super::q5_bit`]); the halves' scales (Q2_K: and minimums) as weight-cache
    /// computes them.
    ///
    /// # Safety
    /// `p` is a whole packed super-block of the format, `s < 8`, `sub` sub-block `s`'s offset.
    #[inline]
    #[target_feature(
        enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
    )]
    unsafe fn k23_block<const F: u8>(p: *const u8, s: usize, sub: usize) -> Block16 {
        // SAFETY (whole body): every load is inside the super-block (fields laid out in `super`).
        unsafe {
            let ld = |off: usize| _mm512_loadu_si512(p.add(off).cast());
            let f16s = |off: usize| _mm512_cvtph_ps(_mm256_loadu_si256(p.add(off).cast()));
            let srl = |v: __m512i, n: usize| _mm512_srl_epi32(v, _mm_cvtsi32_si128(n as i32));
            let lanes = |v: __m512i, n: usize, mask: i32| {
                _mm512_and_si512(srl(v, n), _mm512_set1_epi32(mask))
            };
            // Bits `2l, 2l + 1` of each byte to bits 0, 1 (`l` = 0: a mask), and bit `j` to bit
            // 2, with one `vgf2p8affineqb` each (result bit `i` is the parity of matrix byte
            // `7 - i` and the source byte).
            let bits = |pairs: &[(u32, u32)]| {
                let m = pairs
                    .iter()
                    .fold(0u64, |m, &(from, to)| m | (1u64 << (from + 8 * (7 - to))));
                _mm512_set1_epi64(m as i64)
            };
            let low = [ld(sub), ld(sub + 64)];
            let mut w: [__m512i; 8] = std::array::from_fn(|j| {
                let (v, l) = (low[j / 4], (j % 4) as u32);
                if l == 0 {
                    _mm512_and_si512(v, _mm512_set1_epi8(3))
                } else {
                    _mm512_gf2p8affine_epi64_epi8::<0>(v, bits(&[(2 * l, 0), (2 * l + 1, 1)]))
                }
            });
            if F == F_Q3K {
                let hi = ld(sub + 128);
                for (j, wj) in w.iter_mut().enumerate() {
                    let third = _mm512_gf2p8affine_epi64_epi8::<0>(hi, bits(&[(j as u32, 2)]));
                    *wj = _mm512_or_si512(*wj, third);
                }
                // `scale_k3(i)` of halves `i = 2s, 2s + 1`: the low 4 bits from byte `i % 8`
                // (its high nibble for `i >= 8`), the high 2 bits from byte `8 + i % 4`.
                let d = f16s(Q3K_D);
                let scale = |i: usize| {
                    let (k, lo_at, hi_at) = super::q3k_scale_at(i);
                    let lo = lanes(ld(Q3K_SCALES + 64 * k), lo_at, 0xF);
                    let hi = lanes(ld(Q3K_SCALES + 128), hi_at, 3);
                    let v = _mm512_or_si512(lo, _mm512_slli_epi32::<4>(hi));
                    let v = _mm512_sub_epi32(v, _mm512_set1_epi32(32));
                    _mm512_mul_ps(d, _mm512_cvtepi32_ps(v))
                };
                return Block16 {
                    w,
                    d: scale(2 * s),
                    m: scale(2 * s + 1),
                    mins: [_mm512_setzero_ps(); 2],
                };
            }
            // Q2_K: scale bytes `2s` (elements 0..16) and `2s + 1`: the scale in the low
            // nibble, the minimum in the high one; a nibble to f32 with one `vpermps`, which
            // reads the low 4 index bits only (`cvtdq2ps`'s value).
            let v = ld(Q2K_SCALES + 64 * (s / 2));
            let at = 16 * (s % 2);
            let (d, dmin) = (f16s(Q2K_D), f16s(Q2K_DMIN));
            let table = _mm512_loadu_ps(NIBBLE_F32.as_ptr());
            let nib = |n: usize| _mm512_permutexvar_ps(srl(v, at + n), table);
            let min = |n: usize| _mm512_xor_ps(_mm512_mul_ps(dmin, nib(n)), _mm512_set1_ps(-0.0));
            Block16 {
                w,
                d: _mm512_mul_ps(d, nib(0)),
                m: _mm512_mul_ps(d, nib(8)),
                mins: [min(4), min(12)],
            }
        }
    }

    /// The 4 activation bytes of elements `4j..4j + 4` of block `a`, broadcast.
    #[inline(always)]
    fn act4(a: &ActBlock, j: usize) -> __m512i {
        let v = i32::from_le_bytes([
            a.q[4 * j] as u8,
            a.q[4 * j + 1] as u8,
            a.q[4 * j + 2] as u8,
            a.q[4 * j + 3] as u8,
        ]);
        // SAFETY: AVX-512F is enabled in every caller.
        unsafe { _mm512_set1_epi32(v) }
    }

    /// One block's contribution to a chain, for each of `T` tokens: `c += cvt(isum) * (d * d_x)`,
    /// then (Q4_1, Q5_1, Q4_K) `c += m * (d_x * sum(q_x))`; Q2_K, Q3_K, Q6_K (split): per
    /// 16-element half, its own offset sum and `c += cvt(isum_h) * (scale_h * d_x)`, then
    /// (Q2_K) per half `c += sum(q_x half) * (min_h * d_x)`; exactly as the other AVX-512
    /// kernels compute it. The integer sums run over the 8 weight vectors in the outer loop (each
    /// weight vector serves every token), in two partial sums per token for few tokens (shorter
    /// chains; split formats: one per half).
    #[inline]
    #[target_feature(
        enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
    )]
    fn step<const F: u8, const T: usize>(blk: &Block16, a: [&ActBlock; T], c: &mut [__m512; T]) {
        let split = is_split(F);
        // The formats with an offset start the integer sums from `-(offset * sum(q_x))` (of
        // each half for the split formats, else of the block in the first sum): one broadcast
        // instead of a broadcast, shift and subtraction after the sums; the same integers.
        let start = |a: &ActBlock, part: usize| {
            if offset_shift(F) != 0 {
                _mm512_set1_epi32(a.offset_start(part, offset_shift(F)))
            } else {
                _mm512_setzero_si512()
            }
        };
        let mut even: [__m512i; T] =
            std::array::from_fn(|t| start(a[t], if split { 0 } else { 2 }));
        let mut odd: [__m512i; T] = std::array::from_fn(|t| {
            if split {
                start(a[t], 1)
            } else {
                _mm512_setzero_si512()
            }
        });
        for (j, wj) in blk.w.iter().enumerate() {
            for t in 0..T {
                let second = if split { j >= 4 } else { T <= 3 && j % 2 == 1 };
                if second {
                    odd[t] = _mm512_dpbusd_epi32(odd[t], *wj, act4(a[t], j));
                } else {
                    even[t] = _mm512_dpbusd_epi32(even[t], *wj, act4(a[t], j));
                }
            }
        }
        for t in 0..T {
            let dx = _mm512_set1_ps(a[t].d);
            if split {
                let (i0, i1) = (even[t], odd[t]);
                c[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(blk.d, dx), c[t]);
                c[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(blk.m, dx), c[t]);
                if has_min(F) {
                    // Q2_K: per half, `sum(q_x half) * (min_w half * d_x)`.
                    for (h, min) in blk.mins.iter().enumerate() {
                        let sum = _mm512_set1_ps(a[t].sum(h) as f32);
                        c[t] = _mm512_fmadd_ps(sum, _mm512_mul_ps(*min, dx), c[t]);
                    }
                }
                continue;
            }
            let isum = if T <= 3 {
                _mm512_add_epi32(even[t], odd[t])
            } else {
                even[t]
            };
            let s = _mm512_mul_ps(blk.d, dx);
            c[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, c[t]);
            if has_min(F) {
                c[t] = _mm512_fmadd_ps(blk.m, _mm512_set1_ps(a[t].sx), c[t]);
            }
        }
    }

    /// Few tokens (decode): blocks in order, each into chain `b % 4` of its token, so the four
    /// chains' FMAs overlap; the group's bytes `PF_AHEAD` on are prefetched as it streams.
    ///
    /// # Safety
    /// `group` holds `nb` packed blocks of `bb` bytes; `acts` at least `T * nb` blocks.
    #[inline]
    #[target_feature(
        enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
    )]
    unsafe fn interleaved<const F: u8, const T: usize>(
        group: &[u8],
        bb: usize,
        acts: &[ActBlock],
        nb: usize,
        pf: Option<&[u8]>,
    ) -> [__m512; T] {
        let mut acc = [[_mm512_setzero_ps(); T]; 4];
        // One block into chain `l` (a constant in the unrolled loop below, so the chains stay in
        // registers).
        let block = |acc: &mut [[__m512; T]; 4], b: usize, l: usize| {
            // SAFETY: `group` holds the group's `nb` whole blocks (K-quants: super-blocks).
            let blk = unsafe { block16::<F>(group.as_ptr(), b, bb) };
            step::<F, T>(
                &blk,
                std::array::from_fn(|t| &acts[t * nb + b]),
                &mut acc[l],
            );
        };
        let quads = nb / 4;
        for q in 0..quads {
            prefetch_quad(pf, 4 * q, bb);
            // Written out: a loop over `l` is not unrolled for the larger block decoders (Q2_K,
            // Q3_K), and the chains then live on the stack.
            block(&mut acc, 4 * q, 0);
            block(&mut acc, 4 * q + 1, 1);
            block(&mut acc, 4 * q + 2, 2);
            block(&mut acc, 4 * q + 3, 3);
        }
        for b in 4 * quads..nb {
            block(&mut acc, b, b % 4);
        }
        std::array::from_fn(|t| {
            let s02 = _mm512_add_ps(acc[0][t], acc[2][t]);
            _mm512_add_ps(s02, _mm512_add_ps(acc[1][t], acc[3][t]))
        })
    }
}
