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
//! **Same arithmetic.** The kernel accumulates each output exactly as the other AVX-512 kernels
//! do (exact integer block dot product, one FMA by `d_w * d_x`, then `m_w * d_x * sum(q_x)` for
//! Q4_1, four f32 chains by block index modulo 4, summed as `(c0 + c2) + (c1 + c3)`), so a
//! packed matrix gives bit-identical results to its file layout, and batch invariance holds.

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

/// Bytes of one packed block (16 rows x 32 elements) of `fmt`, if the layout exists for it.
pub(crate) fn block_bytes(fmt: Fmt) -> Option<usize> {
    match fmt {
        Fmt::Q4_0 => Some(256 + 32),
        Fmt::Q4_1 => Some(256 + 64),
        Fmt::Q8_0 => Some(512 + 32),
        _ => None,
    }
}

/// Bytes of a `rows x cols` matrix of `fmt` in the packed layout (rows rounded up to whole groups).
pub(crate) fn packed_len(fmt: Fmt, rows: usize, cols: usize) -> Option<usize> {
    let bb = block_bytes(fmt)?;
    rows.div_ceil(GROUP_ROWS)
        .checked_mul(cols / 32)?
        .checked_mul(bb)
}

impl PackedWeights {
    /// Whether matrices of `dtype` can be packed, and the kernels that read the layout run on
    /// this CPU (the AVX-512 or AVX2 backend, selected by [`super::CpuIsa::detect`]).
    pub fn supported(dtype: GgmlType) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            Fmt::of(dtype).and_then(block_bytes).is_some()
                && matches!(
                    super::CpuIsa::detect(),
                    super::CpuIsa::Avx512 | super::CpuIsa::Avx2
                )
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
        let mut blk = [0u8; 34];
        for (b, y) in out.chunks_exact_mut(32).enumerate() {
            let pb = &group[b * bb..(b + 1) * bb];
            let len = match fmt {
                Fmt::Q4_0 | Fmt::Q4_1 => {
                    let hdr = if fmt == Fmt::Q4_1 { 4 } else { 2 };
                    blk[0..2].copy_from_slice(&pb[256 + 2 * r..][..2]);
                    if fmt == Fmt::Q4_1 {
                        blk[2..4].copy_from_slice(&pb[288 + 2 * r..][..2]);
                    }
                    for c in 0..4 {
                        blk[hdr + 4 * c..][..4].copy_from_slice(&pb[64 * c + 4 * r..][..4]);
                    }
                    hdr + 16
                }
                _ => {
                    blk[0..2].copy_from_slice(&pb[512 + 2 * r..][..2]);
                    for j in 0..8 {
                        for i in 0..4 {
                            blk[2 + 4 * j + i] = pb[64 * j + 4 * r + i] ^ 0x80;
                        }
                    }
                    34
                }
            };
            weight_cache::dequantize(self.dtype, &blk[..len], y)
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

/// Packs group `g` (rows `16g..16g + 16`, missing rows as zero blocks) of `w` into `out`
/// (`nb` packed blocks).
fn pack_group(fmt: Fmt, w: WeightMatrix<'_>, g: usize, out: &mut [u8]) {
    let Some(bb) = block_bytes(fmt) else { return };
    let rb = fmt.row_bytes(w.cols);
    let bs = fmt.block_bytes();
    for (b, pb) in out.chunks_exact_mut(bb).enumerate() {
        for r in 0..GROUP_ROWS {
            let row = g * GROUP_ROWS + r;
            if row >= w.rows {
                break; // zero rows: all quants, scales and minimums 0
            }
            let blk = &w.data[row * rb + b * bs..][..bs];
            match fmt {
                Fmt::Q4_0 | Fmt::Q4_1 => {
                    let hdr = if fmt == Fmt::Q4_1 { 4 } else { 2 };
                    let qs = &blk[hdr..hdr + 16];
                    for c in 0..4 {
                        pb[64 * c + 4 * r..][..4].copy_from_slice(&qs[4 * c..4 * c + 4]);
                    }
                    pb[256 + 2 * r..][..2].copy_from_slice(&blk[0..2]);
                    if fmt == Fmt::Q4_1 {
                        pb[288 + 2 * r..][..2].copy_from_slice(&blk[2..4]);
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
pub(crate) use avx512::quant_rows;

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::super::act::ActBlock;
    use super::super::avx512::{F_Q4_0, F_Q4_1, F_Q8_0, has_min, offset_shift};
    use super::super::format::Fmt;
    use super::super::{RowsOut, WeightMatrix};
    use super::{GROUP_ROWS, block_bytes};

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
    /// format `fmt`, one of [`block_bytes`]'s; `acts` holds `n` tokens of `w.cols / 32` blocks;
    /// `rows.start` is a multiple of [`GROUP_ROWS`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn quant_rows(
        fmt: Fmt,
        w: WeightMatrix<'_>,
        acts: &[ActBlock],
        n: usize,
        rows: Range<usize>,
        out: &mut RowsOut<'_>,
    ) {
        match fmt {
            Fmt::Q4_0 => rows_impl::<F_Q4_0>(fmt, w, acts, n, rows, out),
            Fmt::Q4_1 => rows_impl::<F_Q4_1>(fmt, w, acts, n, rows, out),
            Fmt::Q8_0 => rows_impl::<F_Q8_0>(fmt, w, acts, n, rows, out),
            _ => unreachable!("packed formats are checked by the caller"),
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    fn rows_impl<const F: u8>(
        fmt: Fmt,
        w: WeightMatrix<'_>,
        acts: &[ActBlock],
        n: usize,
        rows: Range<usize>,
        out: &mut RowsOut<'_>,
    ) {
        if n >= super::super::panel::PANEL_MIN_TOKENS {
            // Many tokens: unpack each group once into the panel kernel's buffer and reuse it
            // for the whole token chunk.
            // SAFETY: forwarded (same contract).
            return unsafe { super::super::panel::quant_rows(fmt, w, acts, n, rows, out) };
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
                let mut tile = [_mm512_setzero_ps(); 4];
                // SAFETY: `ap` holds at least the tile's tokens; `group` is `nb` packed blocks.
                let len = unsafe {
                    match n - t0 {
                        4.. => put(&mut tile, interleaved::<F, 4>(group, bb, ap, nb, pf)),
                        2..=3 => put(&mut tile, interleaved::<F, 2>(group, bb, ap, nb, pf)),
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

    /// Copies a tile's `T` outputs to the front of `buf`; returns `T`.
    #[inline(always)]
    fn put<const T: usize>(buf: &mut [__m512; 4], v: [__m512; T]) -> usize {
        buf[..T].copy_from_slice(&v);
        T
    }

    /// The 8 weight vectors of packed block `p`: vector `j` lane `r` = elements `4j..4j + 4` of
    /// row `r` as u8.
    ///
    /// # Safety
    /// `p` has the packed block's bytes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    unsafe fn weights<const F: u8>(p: *const u8) -> [__m512i; 8] {
        // SAFETY: forwarded; every load is inside the block.
        unsafe {
            if F == F_Q8_0 {
                std::array::from_fn(|j| _mm512_loadu_si512(p.add(64 * j).cast()))
            } else {
                let lo4 = _mm512_set1_epi8(0x0F);
                let v: [__m512i; 4] =
                    std::array::from_fn(|c| _mm512_loadu_si512(p.add(64 * c).cast()));
                std::array::from_fn(|j| {
                    if j < 4 {
                        _mm512_and_si512(v[j], lo4)
                    } else {
                        _mm512_and_si512(_mm512_srli_epi16(v[j - 4], 4), lo4)
                    }
                })
            }
        }
    }

    /// The 16 rows' scales (and Q4_1 minimums) of packed block `p` as f32.
    ///
    /// # Safety
    /// `p` has the packed block's bytes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    unsafe fn scales<const F: u8>(p: *const u8) -> (__m512, __m512) {
        let at = if F == F_Q8_0 { 512 } else { 256 };
        // SAFETY: forwarded; the scales (and minimums) end the block.
        unsafe {
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(at).cast()));
            let m = if has_min(F) {
                _mm512_cvtph_ps(_mm256_loadu_si256(p.add(at + 32).cast()))
            } else {
                _mm512_setzero_ps()
            };
            (d, m)
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
    /// then (Q4_1) `c += m * (d_x * sum(q_x))`, exactly as the other AVX-512 kernels compute it.
    /// The integer sums run over the 8 weight vectors in the outer loop (each weight vector
    /// serves every token), in two partial sums per token for few tokens (shorter chains).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    fn step<const F: u8, const T: usize>(
        w: &[__m512i; 8],
        d: __m512,
        m: __m512,
        a: [&ActBlock; T],
        c: &mut [__m512; T],
    ) {
        let z = _mm512_setzero_si512();
        let (mut even, mut odd) = ([z; T], [z; T]);
        for (j, wj) in w.iter().enumerate() {
            for t in 0..T {
                if T <= 2 && j % 2 == 1 {
                    odd[t] = _mm512_dpbusd_epi32(odd[t], *wj, act4(a[t], j));
                } else {
                    even[t] = _mm512_dpbusd_epi32(even[t], *wj, act4(a[t], j));
                }
            }
        }
        for t in 0..T {
            let mut isum = if T <= 2 {
                _mm512_add_epi32(even[t], odd[t])
            } else {
                even[t]
            };
            if offset_shift(F) != 0 {
                let shift = _mm_cvtsi32_si128(offset_shift(F));
                let sq = _mm512_sll_epi32(_mm512_set1_epi32(a[t].sq), shift);
                isum = _mm512_sub_epi32(isum, sq);
            }
            let s = _mm512_mul_ps(d, _mm512_set1_ps(a[t].d));
            c[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, c[t]);
            if has_min(F) {
                c[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(a[t].sx), c[t]);
            }
        }
    }

    /// Few tokens (decode): blocks in order, each into chain `b % 4` of its token, so the four
    /// chains' FMAs overlap; the group's bytes `PF_AHEAD` on are prefetched as it streams.
    ///
    /// # Safety
    /// `group` holds `nb` packed blocks of `bb` bytes; `acts` at least `T * nb` blocks.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
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
            let p = group[b * bb..(b + 1) * bb].as_ptr();
            // SAFETY: `p` has the block's `bb` bytes.
            let (wv, (d, m)) = unsafe { (weights::<F>(p), scales::<F>(p)) };
            step::<F, T>(
                &wv,
                d,
                m,
                std::array::from_fn(|t| &acts[t * nb + b]),
                &mut acc[l],
            );
        };
        let quads = nb / 4;
        for q in 0..quads {
            if let Some(pf) = pf {
                let (from, to) = (4 * q * bb, (4 * q * bb + 4 * bb).min(pf.len()));
                for off in (from..to).step_by(64) {
                    // A hint inside `pf` (no side effects).
                    _mm_prefetch::<_MM_HINT_T2>(pf[off..].as_ptr().cast());
                }
            }
            for l in 0..4 {
                block(&mut acc, 4 * q + l, l);
            }
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
