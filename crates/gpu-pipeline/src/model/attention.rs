//! Attention for a block of query rows that share one KV head: `softmax(q·Kᵀ·scale)·V` per row,
//! each row `r` against the first `n_keys[r]` keys of the view (causal prefill passes growing
//! counts).
//!
//! Every row goes through the same float operations in the same order whatever block it is in,
//! which kernel serves the block, or which machine path runs (AVX-512 or portable), so results
//! are bit-identical across batch shapes, chunkings and CPUs with FMA:
//! - score: 16 lane sums `a[l] = fma(q[16c+l], k[16c+l], a[l])` over `c` ascending (from 0), then
//!   the tree `a[l] += a[l+8]` (l < 8), `a[l] += a[l+4]` (l < 4), `a[l] += a[l+2]` (l < 2),
//!   `a[0] + a[1]`; times `scale`. With `q8_0` keys instead: the query quantized per 32-element
//!   block ([`quantize_query`]), per block the exact integer dot product `S_b`, then
//!   `s = fma(S_b, kd_b * qd_b, s)` over blocks from `s = 0`, times `scale` (llama.cpp's
//!   arithmetic for its q8_0 cache: int8 products, VNNI on AVX-512);
//! - softmax: the exact maximum; [`exp_f`] of `s - max`; the sum as 16 partial sums over keys
//!   `j ≡ l (mod 16)` ascending, reduced by the same tree;
//! - output: `o = fma(p[j], v[j], o)` over keys ascending, then `o * (1 / sum)`;
//! - a row over more than [`KEY_CHUNK`] keys: the above per chunk of `KEY_CHUNK` keys from its
//!   first ([`key_chunk`]), the chunks' results merged in order ([`merge_chunk`]: the
//!   flash-decoding merge of two softmaxes by their maxima and sums). The model runs the chunks
//!   of a decode step's rows as separate pool tasks when there are fewer tasks than threads
//!   would need (one sequence has one task per KV head), and merges them the same way.
//!
//! The AVX-512 path runs that arithmetic vectorized across 16 keys: each block of 16 key rows is
//! converted once for up to 16 query rows, a row's 16 lane sums per key stay in registers, and a
//! transposing reduction tree builds the 16 keys' scores at once. (A kernel vectorized across 16
//! query rows, broadcasting each key element, served prefill blocks until it measured 1.36x
//! slower per key than this one: two loads per FMA.)

use half::f16;
use kv_ring::{KvSlices, KvView, Q4Rows, Q8_0_BLOCK, Q8Rows};

// Keys with `s - max` below EXP_MIN get probability 0.
use crate::kernels::exp_f;

/// The tree sum of 16 lanes described in the module docs.
#[inline(always)]
fn tree16(mut a: [f32; 16]) -> f32 {
    for step in [8, 4, 2] {
        for l in 0..step {
            a[l] += a[l + step];
        }
    }
    a[0] + a[1]
}

/// Elements per block of a `q8_0` key row and of a query quantized for it.
const QB: usize = Q8_0_BLOCK;

/// A query row quantized for the products with `q8_0` keys (llama.cpp's way with its `q8_0`
/// cache: the query in the keys' format, integer dot products per block): per 32-element block
/// `b`, `d[b] = amax / 127`, quants `x * (127 / amax)` rounded to nearest, ties to even (0 for
/// an all-zero block or a NaN element), and `sum[b]` their sum. Every path quantizes with this
/// function.
fn quantize_query(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) {
    // Adding and subtracting 1.5 * 2^23 rounds |x| < 2^22 to an integer (nearest, ties to
    // even) in two plain additions; `f32::round` is a libm call per element on x86-64's base
    // instruction set (192 calls cost a 64-key decode call 0.8 us).
    const MAGIC: f32 = 12_582_912.0;
    for (b, (xb, qb)) in x.chunks_exact(QB).zip(q.chunks_exact_mut(QB)).enumerate() {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut s = 0i32;
        for (o, &v) in qb.iter_mut().zip(xb) {
            // |v * id| <= 127 up to rounding; the clamp keeps every quant in -127..=127 (the
            // AVX2 products rely on it) whatever the rounding.
            *o = ((v * id + MAGIC) - MAGIC).clamp(-127.0, 127.0) as i8;
            s += i32::from(*o);
        }
        d[b] = amax / 127.0;
        sum[b] = s;
    }
}

/// A quantized query ([`quantize_query`]: quants `q`, scales `qd`) against a `q8_0` key row,
/// before `scale`: per block the exact integer dot product `S_b`, then
/// `s = fma(S_b, kd_b * qd_b, s)` over the blocks ascending from `s = 0`.
#[inline(always)]
fn q8_dot(q: &[i8], qd: &[f32], k: Q8Rows<'_>) -> f32 {
    let mut s = 0.0f32;
    for (b, (qb, kb)) in q.chunks_exact(QB).zip(k.q.chunks_exact(QB)).enumerate() {
        let dot: i32 = qb
            .iter()
            .zip(kb)
            .map(|(&a, &c)| i32::from(a) * i32::from(c))
            .sum();
        s = (dot as f32).mul_add(k.d[b].to_f32() * qd[b], s);
    }
    s
}

/// The K or V rows of a view as raw parts (row `j` is `hd` elements).
#[derive(Clone, Copy)]
enum Rows<'a> {
    F32([&'a [f32]; 2]),
    F16([&'a [f16]; 2]),
    /// `q8_0`: every path reads element `d * q`, exact in f32 (an 11-bit scale times an 8-bit
    /// quant), so the kernels attend to exactly the dequantized rows.
    Q8([Q8Rows<'a>; 2]),
    /// `q4_0`: every path reads element `d * (q - 8)`, exact in f32 (an 11-bit scale times a
    /// 4-bit integer), as for `q8_0`.
    Q4([Q4Rows<'a>; 2]),
}

impl<'a> Rows<'a> {
    fn new(s: &KvSlices<'a>) -> Self {
        match *s {
            KvSlices::F32(p) => Rows::F32(p),
            KvSlices::F16(p) => Rows::F16(p),
            KvSlices::Q8_0(p) => Rows::Q8(p),
            KvSlices::Q4_0(p) => Rows::Q4(p),
            #[allow(unreachable_patterns)]
            _ => unreachable!("kv-ring has only F32, F16, Q8_0 and Q4_0 storage"),
        }
    }

    /// Element `i` of row `j`, as f32 (the tests' references).
    #[cfg(test)]
    fn get(&self, j: usize, hd: usize, i: usize) -> f32 {
        match self {
            Rows::F32(p) => row_of(p, j, hd)[i],
            Rows::F16(p) => row_of(p, j, hd)[i].to_f32(),
            Rows::Q8(p) => q8_row_of(p, j, hd).get(i).expect("inside the row"),
            Rows::Q4(p) => q4_row_of(p, j, hd).get(i).expect("inside the row"),
        }
    }

    /// Row `j` as f32: the stored row itself, or (f16 storage) `buf[..hd]` converted into.
    #[inline(always)]
    fn row<'b>(&self, j: usize, hd: usize, buf: &'b mut [f32]) -> &'b [f32]
    where
        'a: 'b,
    {
        match self {
            Rows::F32(p) => row_of(p, j, hd),
            Rows::F16(p) => {
                let buf = &mut buf[..hd];
                f16_row(row_of(p, j, hd), buf);
                buf
            }
            Rows::Q8(p) => {
                let buf = &mut buf[..hd];
                let r = q8_row_of(p, j, hd);
                for (i, (o, &q)) in buf.iter_mut().zip(r.q).enumerate() {
                    *o = r.d[i / Q8_0_BLOCK].to_f32() * f32::from(q);
                }
                buf
            }
            Rows::Q4(p) => {
                let buf = &mut buf[..hd];
                let r = q4_row_of(p, j, hd);
                for (o, block) in buf.chunks_exact_mut(32).zip(r.blocks) {
                    let d = block.d.to_f32();
                    let (lo, hi) = o.split_at_mut(16);
                    for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&block.qs) {
                        *l = d * q4_value(q & 0xF);
                        *h = d * q4_value(q >> 4);
                    }
                }
                buf
            }
        }
    }
}

/// A `q4_0` nibble as the signed integer it stands for (`q - 8`, exact), as f32.
#[inline(always)]
fn q4_value(nibble: u8) -> f32 {
    f32::from(nibble) - 8.0
}

/// Row `j` of `q4_0` runs (`hd` a multiple of 32).
#[inline(always)]
fn q4_row_of<'a>(parts: &[Q4Rows<'a>; 2], j: usize, hd: usize) -> Q4Rows<'a> {
    let na = parts[0].len() / hd;
    let (part, j) = if j < na {
        (parts[0], j)
    } else {
        (parts[1], j - na)
    };
    part.slice(j * hd..(j + 1) * hd)
}

/// Row `j` of `q8_0` runs (`hd` a multiple of 32).
#[inline(always)]
fn q8_row_of<'a>(parts: &[Q8Rows<'a>; 2], j: usize, hd: usize) -> Q8Rows<'a> {
    let na = parts[0].q.len() / hd;
    let (part, j) = if j < na {
        (parts[0], j)
    } else {
        (parts[1], j - na)
    };
    part.slice(j * hd..(j + 1) * hd)
}

/// `src` as f32 into `dst` (same length): F16C where the CPU has it (one call per row, 8
/// elements per instruction; `half`'s slice conversion costs a call per 8), else `half`'s.
fn f16_row(src: &[f16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::has_avx2() {
        // SAFETY: F16C was detected at run time (part of the AVX2 backend's check).
        return unsafe { f16c_row(src, dst) };
    }
    use half::slice::HalfFloatSliceExt as _;
    src.convert_to_f32_slice(dst);
}

/// # Safety
/// The CPU supports F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn f16c_row(src: &[f16], dst: &mut [f32]) {
    use std::arch::x86_64::{_mm_loadu_si128, _mm256_cvtph_ps, _mm256_storeu_ps};
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: elements `i..i + 8` lie inside both slices.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    for (d, s) in dst[i..n].iter_mut().zip(&src[i..n]) {
        *d = s.to_f32();
    }
}

#[inline(always)]
fn row_of<'a, T>(parts: &[&'a [T]; 2], j: usize, hd: usize) -> &'a [T] {
    let na = parts[0].len() / hd;
    if j < na {
        &parts[0][j * hd..][..hd]
    } else {
        &parts[1][(j - na) * hd..][..hd]
    }
}

/// Softmax attention of `n_keys.len()` query rows (`q`, row-major, `hd` wide) against the keys
/// and values of a kv-ring `view` (one KV head), written to `out` (same shape): row `r` attends
/// to the first `n_keys[r]` rows of the view (causal masking and GQA groups are the caller's
/// choice of rows and counts), with scores scaled by `scale`. `scratch` is reused between calls.
///
/// Each row's result depends only on its own query and key count, bit for bit (not on the other
/// rows of the call, their number or order), on every CPU path. On AVX-512 the kernels are
/// vectorized across 16 query rows (each converted key row serves all of them) or, for fewer
/// than 6 rows (decode), across keys with the key row loaded once per GQA group.
///
/// # Panics
/// When `q` or `out` is not `n_keys.len() * hd` long, a count is outside `1..=view.len`, or the
/// view's rows are not `hd` wide.
///
/// ```
/// use gpu_pipeline::attend_rows;
/// use kv_ring::{KvDtype, KvPool, KvShape, RingMode};
///
/// let shape = KvShape { n_layers: 1, n_kv_heads: 1, head_dim: 16, dtype: KvDtype::F32 };
/// let pool = KvPool::new(shape, 1 << 20)?;
/// let mut kv = pool.alloc(8, RingMode::Strict)?;
/// // Two positions: keys e0 and e1, values all 1s and all 3s.
/// let (mut k, mut v) = (vec![0.0f32; 32], vec![1.0f32; 32]);
/// k[0] = 1.0;
/// k[16 + 1] = 1.0;
/// v[16..].fill(3.0);
/// kv.begin(2)?;
/// kv.write_layer(0, &k, &v)?;
/// kv.commit()?;
/// let view = kv.view(0, 0)?;
/// // One query that sees only position 0, one that sees both with equal scores.
/// let q = vec![0.0f32; 32];
/// let mut out = vec![0.0f32; 32];
/// attend_rows(&q, &[1, 2], 16, &view, 0.25, &mut Vec::new(), &mut out);
/// assert_eq!(out[0], 1.0);
/// assert_eq!(out[16], 2.0);
/// # Ok::<(), kv_ring::KvError>(())
/// ```
pub fn attend_rows(
    q: &[f32],
    n_keys: &[usize],
    hd: usize,
    view: &KvView<'_>,
    scale: f32,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_rows_ext(q, n_keys, None, hd, view, scale, None, scratch, out, None);
}

/// [`attend_rows`] with two more features: row `r` sees only keys `first[r]..n_keys[r]` (a
/// sliding window), and scores pass through `cap * tanh(s / cap)` before the softmax
/// (Gemma 2's attention soft-capping). [`attend_rows`] is this without either. With `stats`
/// (two per row), row `r`'s softmax maximum and sum go to `stats[2r]` and `stats[2r + 1]`
/// (what [`merge_chunk`] takes).
///
/// # Panics
/// As [`attend_rows`], and when `first[r] >= n_keys[r]` or `first` is not one per row, or
/// `stats` is shorter than two per row.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_rows_ext(
    q: &[f32],
    n_keys: &[usize],
    first: Option<&[usize]>,
    hd: usize,
    view: &KvView<'_>,
    scale: f32,
    softcap: Option<f32>,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
    stats: Option<&mut [f32]>,
) {
    let rows = n_keys.len();
    assert!(
        q.len() == rows * hd && out.len() == rows * hd,
        "q and out need {rows} rows of {hd}"
    );
    assert!(
        n_keys.iter().all(|&n| n >= 1 && n <= view.len),
        "key counts must be in 1..={}",
        view.len
    );
    if let Some(f) = first {
        assert!(
            f.len() == rows && f.iter().zip(n_keys).all(|(f, n)| f < n),
            "first keys must be below the key counts"
        );
    }
    if let Some(s) = &stats {
        assert!(s.len() >= 2 * rows, "stats need two per row");
    }
    for s in [&view.keys, &view.values] {
        let parts = match s {
            KvSlices::F32([a, b]) => [a.len(), b.len()],
            KvSlices::F16([a, b]) => [a.len(), b.len()],
            KvSlices::Q8_0([a, b]) => {
                assert!(hd.is_multiple_of(Q8_0_BLOCK), "q8_0 rows are whole blocks");
                [a.q.len(), b.q.len()]
            }
            KvSlices::Q4_0([a, b]) => {
                assert!(hd.is_multiple_of(32), "q4_0 rows are whole blocks");
                [a.len(), b.len()]
            }
            #[allow(unreachable_patterns)]
            _ => unreachable!("kv-ring has only F32, F16, Q8_0 and Q4_0 storage"),
        };
        assert!(
            hd > 0 && parts.iter().all(|p| p % hd == 0) && parts[0] + parts[1] == view.len * hd,
            "the view's rows are not {hd} wide"
        );
    }
    let c = Call {
        q,
        n_keys,
        first,
        hd,
        view,
        scale,
        softcap,
    };
    chunked(kernel, c, scratch, out, stats);
}

/// One kernel call's query rows and what each sees: the arguments of [`attend_rows_ext`]
/// that every path shares (shapes checked there).
#[derive(Clone, Copy)]
struct Call<'a> {
    q: &'a [f32],
    n_keys: &'a [usize],
    first: Option<&'a [usize]>,
    hd: usize,
    view: &'a KvView<'a>,
    scale: f32,
    softcap: Option<f32>,
}

/// A kernel: every row's whole key range in one pass, into `out`, with the rows' softmax
/// statistics when asked (as [`attend_rows_ext`]); `scratch` is its own.
type Kernel = fn(Call<'_>, &mut Vec<f32>, &mut [f32], Option<&mut [f32]>);

/// [`attend_rows_ext`] on `kernel` (the tests run it on every path).
fn chunked(
    kernel: Kernel,
    c: Call<'_>,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
    stats: Option<&mut [f32]>,
) {
    let Call {
        q,
        n_keys,
        first,
        hd,
        ..
    } = c;
    let rows = n_keys.len();
    let first_of = |r: usize| first.map_or(0, |f| f[r]);
    let chunks = (0..rows)
        .map(|r| (n_keys[r] - first_of(r)).div_ceil(KEY_CHUNK))
        .max()
        .unwrap_or(0);
    if chunks <= 1 {
        return kernel(c, scratch, out, stats);
    }
    // Rows over more than KEY_CHUNK keys: chunk by chunk, each chunk's rows in one call, merged
    // into `out` in chunk order (from the empty state, [0, 0]).
    let mut state = vec![0.0f32; 2 * rows];
    let (mut qk, mut nk, mut fk, mut ok, mut sk, mut at) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for k in 0..chunks {
        qk.clear();
        nk.clear();
        fk.clear();
        at.clear();
        for r in 0..rows {
            if let Some((f, n)) = key_chunk(first_of(r), n_keys[r], k) {
                qk.extend_from_slice(&q[r * hd..][..hd]);
                fk.push(f);
                nk.push(n);
                at.push(r);
            }
        }
        ok.resize(at.len() * hd, 0.0);
        sk.resize(2 * at.len(), 0.0);
        let chunk = Call {
            q: &qk,
            n_keys: &nk,
            first: Some(&fk),
            ..c
        };
        kernel(chunk, scratch, &mut ok, Some(&mut sk));
        for (i, &r) in at.iter().enumerate() {
            let (o, st) = (&mut out[r * hd..][..hd], &mut state[2 * r..2 * r + 2]);
            let (oc, sc) = (&ok[i * hd..][..hd], &sk[2 * i..2 * i + 2]);
            merge_chunk(o, st, oc, sc);
        }
    }
    if let Some(s) = stats {
        s[..2 * rows].copy_from_slice(&state);
    }
}

/// Keys per chunk of a row's softmax: a row that sees more keys is computed chunk by chunk
/// ([`key_chunk`]) and the chunks merged in order ([`merge_chunk`]), so that the chunks of one
/// long row can also run on different threads (the model does this for decode steps) with the
/// same result bit for bit. A multiple of 16 (the key lanes of the softmax sums).
pub(crate) const KEY_CHUNK: usize = 2048;

/// Chunk `k` of a row that sees keys `first..n`: keys `first + k * KEY_CHUNK` up to
/// `KEY_CHUNK` further (not past `n`), or `None` past the row's last chunk.
pub(crate) fn key_chunk(first: usize, n: usize, k: usize) -> Option<(usize, usize)> {
    let f = first + k * KEY_CHUNK;
    (f < n).then(|| (f, n.min(f + KEY_CHUNK)))
}

/// Merges the next chunk's result into a row's: `o` and `state` (the softmax's maximum and
/// sum, `[m, w]`) hold the result over the chunks so far, `oc` and `sc = [m_c, s_c]` the next
/// chunk's (as [`attend_rows_ext`] writes them). From the empty state `[0, 0]` (a chunk's sum
/// is at least 1: its maximum's term) the chunk is copied; else, with `M = max(m, m_c)`,
/// `a = w * exp(m - M)`, `b = s_c * exp(m_c - M)`: `o = fma(oc, b, o * a) * (1 / (a + b))` per
/// element, state `[M, a + b]`.
pub(crate) fn merge_chunk(o: &mut [f32], state: &mut [f32], oc: &[f32], sc: &[f32]) {
    if state[1] == 0.0 {
        o.copy_from_slice(oc);
        state.copy_from_slice(sc);
        return;
    }
    let mx = state[0].max(sc[0]);
    let a = state[1] * exp_f(state[0] - mx);
    let b = sc[1] * exp_f(sc[0] - mx);
    let w = a + b;
    let inv = 1.0 / w;
    for (ov, &c) in o.iter_mut().zip(oc) {
        *ov = c.mul_add(b, *ov * a) * inv;
    }
    state[0] = mx;
    state[1] = w;
}

/// One call of the kernel for this machine: every row's whole key range at once.
fn kernel(c: Call<'_>, scratch: &mut Vec<f32>, out: &mut [f32], stats: Option<&mut [f32]>) {
    let hd = c.hd;
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(16) && hd <= avx512::MAX_HD && crate::kernels::has_avx512() {
        // SAFETY: the features were detected at run time; shapes are checked by the caller.
        return unsafe { avx512::attend(c, scratch, out, stats) };
    }
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(16) && hd <= avx2::MAX_HD && crate::kernels::has_avx2() {
        // SAFETY: the features were detected at run time; shapes are checked by the caller.
        return unsafe { avx2::attend(c, scratch, out, stats) };
    }
    portable(c, scratch, out, stats);
}

/// The portable path (FMA instructions where the CPU has them; the same results either way).
fn portable(c: Call<'_>, scratch: &mut Vec<f32>, out: &mut [f32], stats: Option<&mut [f32]>) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::has_avx2() {
        // SAFETY: AVX2 + FMA were detected at run time.
        return unsafe { portable_fma(c, scratch, out, stats) };
    }
    portable_body(c, scratch, out, stats);
}

/// # Safety
/// The CPU supports AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn portable_fma(
    c: Call<'_>,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
    stats: Option<&mut [f32]>,
) {
    portable_body(c, scratch, out, stats);
}

#[inline(always)]
fn portable_body(
    c: Call<'_>,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
    mut stats: Option<&mut [f32]>,
) {
    let Call {
        q,
        n_keys,
        first,
        hd,
        view,
        scale,
        softcap,
    } = c;
    let (keys, values) = (Rows::new(&view.keys), Rows::new(&view.values));
    let nmax = n_keys.iter().copied().max().unwrap_or(0);
    // Rows go in blocks of up to BLOCK that share each converted key and value row (prefill);
    // every row still gets its own operations in its own order. Scratch: the block's scores
    // (`nmax` per row), then one converted row (f16 storage).
    const BLOCK: usize = 16;
    let rows = n_keys.len();
    let need = BLOCK.min(rows) * nmax + hd;
    if scratch.len() < need {
        scratch.resize(need, 0.0);
    }
    let (scores, buf) = scratch.split_at_mut(need - hd);
    let whole = hd / 16 * 16;
    let first_of = |r: usize| first.map_or(0, |f| f[r]);
    // A row's score from its dot product: times `scale`, then the soft-cap.
    let finish = |dot: f32| {
        let sj = dot * scale;
        softcap.map_or(sj, |cap| cap * crate::kernels::tanh_f(sj / cap))
    };
    // q8_0 keys: the block's queries quantized ([`quantize_query`]).
    let q8 = matches!(keys, Rows::Q8(_));
    let qn = if q8 { BLOCK.min(rows) * hd } else { 0 };
    let (mut qq, mut qd, mut qsum) = (vec![0i8; qn], vec![0.0f32; qn / QB], vec![0i32; hd / QB]);
    for r0 in (0..rows).step_by(BLOCK) {
        let r1 = (r0 + BLOCK).min(rows);
        let lo = (r0..r1).map(first_of).min().unwrap_or(0);
        let hi = n_keys[r0..r1].iter().copied().max().unwrap_or(0);
        // Where row `r`'s score for key `j` lives, if the row sees that key.
        let slot = |r: usize, j: usize| {
            let f = first_of(r);
            (f..n_keys[r]).contains(&j).then(|| (r - r0) * nmax + j - f)
        };
        if q8 {
            for r in r0..r1 {
                let (i, nb) = (r - r0, hd / QB);
                quantize_query(
                    &q[r * hd..][..hd],
                    &mut qq[i * hd..][..hd],
                    &mut qd[i * nb..][..nb],
                    &mut qsum[..nb],
                );
            }
        }
        for j in lo..hi {
            if let Rows::Q8(kp) = keys {
                let kr = q8_row_of(&kp, j, hd);
                for r in r0..r1 {
                    let Some(at) = slot(r, j) else { continue };
                    let (i, nb) = (r - r0, hd / QB);
                    scores[at] = finish(q8_dot(&qq[i * hd..][..hd], &qd[i * nb..][..nb], kr));
                }
                continue;
            }
            let kr = keys.row(j, hd, buf);
            for r in r0..r1 {
                let Some(at) = slot(r, j) else { continue };
                let qr = &q[r * hd..][..hd];
                // Lane l holds elements i ≡ l (mod 16) in ascending order: whole chunks of 16
                // (vectorized), then the tail's lanes.
                let mut a = [0.0f32; 16];
                for (qc, kc) in qr.chunks_exact(16).zip(kr.chunks_exact(16)) {
                    for l in 0..16 {
                        a[l] = qc[l].mul_add(kc[l], a[l]);
                    }
                }
                for i in whole..hd {
                    a[i - whole] = qr[i].mul_add(kr[i], a[i - whole]);
                }
                scores[at] = finish(tree16(a));
            }
        }
        let mut inv = [0.0f32; BLOCK];
        for r in r0..r1 {
            let f = first_of(r);
            let s = &mut scores[(r - r0) * nmax..][..n_keys[r] - f];
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut part = [0.0f32; 16];
            for (jj, sj) in s.iter_mut().enumerate() {
                *sj = exp_f(*sj - max);
                // Keys j ≡ l (mod 16) in partial sum l, whatever the first key: the result does
                // not depend on how rows with different windows are blocked together.
                part[(f + jj) % 16] += *sj;
            }
            let sum = tree16(part);
            inv[r - r0] = 1.0 / sum;
            if let Some(st) = stats.as_deref_mut() {
                st[2 * r..2 * r + 2].copy_from_slice(&[max, sum]);
            }
            out[r * hd..][..hd].fill(0.0);
        }
        for j in lo..hi {
            let vr = values.row(j, hd, buf);
            for r in r0..r1 {
                let Some(at) = slot(r, j) else { continue };
                let p = scores[at];
                for (ov, &v) in out[r * hd..][..hd].iter_mut().zip(vr) {
                    *ov = p.mul_add(v, *ov);
                }
            }
        }
        for r in r0..r1 {
            let i = inv[r - r0];
            out[r * hd..][..hd].iter_mut().for_each(|v| *v *= i);
        }
    }
}

/// Calls `$f::<NC>(args)` with `NC = $hd / 16` as a constant (`$hd` a multiple of 16 up to
/// the calling module's `MAX_HD`), so per-row vectors can live in registers;
/// `by_width!(hd, f, C, (args))` calls `f::<NC, C>(args)`.
#[cfg(target_arch = "x86_64")]
macro_rules! by_width {
    ($hd:expr, $f:ident $args:tt) => {
        by_width!(@ $hd, $f $args, 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
    };
    ($hd:expr, $f:ident, $c:tt, $args:tt) => {
        by_width!(@@ $hd, $f, $c, $args, 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
    };
    (@ $hd:expr, $f:ident $args:tt, $($nc:literal)+) => {
        match $hd / 16 {
            $($nc => $f::<$nc> $args,)+
            _ => unreachable!("head dim {} is not a multiple of 16 up to {MAX_HD}", $hd),
        }
    };
    // `$f::<NC, $c>`: a second constant parameter.
    (@@ $hd:expr, $f:ident, $c:tt, $args:tt, $($nc:literal)+) => {
        match $hd / 16 {
            $($nc => $f::<$nc, $c> $args,)+
            _ => unreachable!("head dim {} is not a multiple of 16 up to {MAX_HD}", $hd),
        }
    };
}

/// `scratch` grown to at least `n` floats, as a pointer to its start (the x86 kernels' scores and
/// converted key rows).
#[cfg(target_arch = "x86_64")]
fn reserve(scratch: &mut Vec<f32>, n: usize) -> *mut f32 {
    if scratch.len() < n {
        scratch.resize(n, 0.0);
    }
    scratch.as_mut_ptr()
}

/// Pointer to row `j` (f32, f16, q8_0 or q4_0 elements, as raw bytes), for the x86 kernels.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct RowPtrs {
    p: [*const u8; 2],
    na: usize,
    /// Bytes per row (of quants, for q8_0; of `block_q4_0`s for q4_0).
    rb: usize,
    kind: Kind,
    /// q8_0: the runs' scales (`hd / 32` per row).
    scales: [*const f16; 2],
}

/// A view's storage type (as `u8`, the kernels' const parameter where one loop is compiled per
/// type).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, PartialEq)]
#[repr(u8)]
enum Kind {
    F32,
    F16,
    Q8,
    Q4,
}

#[cfg(target_arch = "x86_64")]
impl RowPtrs {
    fn new(r: Rows<'_>, hd: usize) -> Self {
        match r {
            Rows::F32(p) => Self {
                p: [p[0].as_ptr().cast(), p[1].as_ptr().cast()],
                na: p[0].len() / hd,
                rb: 4 * hd,
                kind: Kind::F32,
                scales: [std::ptr::null(); 2],
            },
            Rows::F16(p) => Self {
                p: [p[0].as_ptr().cast(), p[1].as_ptr().cast()],
                na: p[0].len() / hd,
                rb: 2 * hd,
                kind: Kind::F16,
                scales: [std::ptr::null(); 2],
            },
            Rows::Q8(p) => Self {
                p: [p[0].q.as_ptr().cast(), p[1].q.as_ptr().cast()],
                na: p[0].q.len() / hd,
                rb: hd,
                kind: Kind::Q8,
                scales: [p[0].d.as_ptr(), p[1].d.as_ptr()],
            },
            Rows::Q4(p) => Self {
                p: [p[0].blocks.as_ptr().cast(), p[1].blocks.as_ptr().cast()],
                na: p[0].len() / hd,
                rb: hd / 32 * size_of::<kv_ring::BlockQ4_0>(),
                kind: Kind::Q4,
                scales: [std::ptr::null(); 2],
            },
        }
    }

    /// q8_0 rows `kb..kb + nk` (`nk <= lanes`) copied `stride >= hd` bytes apart to `dst`
    /// (zero-padded; zero rows up to `lanes`) and their scales' bits block-major into `d`
    /// (`d[lanes * b + key]`, 0 for the zero rows): the x86 kernels' key blocks.
    ///
    /// # Safety
    /// The rows exist in this q8_0 view (`rb = hd`); `dst` has `lanes * stride` writable bytes,
    /// `d` at least `lanes * hd / 32` entries.
    #[allow(clippy::too_many_arguments)]
    unsafe fn copy_q8(
        &self,
        kb: usize,
        nk: usize,
        hd: usize,
        lanes: usize,
        stride: usize,
        dst: *mut u8,
        d: &mut [u16],
    ) {
        let nb = hd / QB;
        for jj in 0..lanes {
            // SAFETY: forwarded: row `jj` of `dst` is writable, row `kb + jj` (when `jj < nk`)
            // has `hd` quants and `nb` scales from `off / 32`.
            unsafe {
                let row = dst.add(jj * stride);
                std::ptr::write_bytes(row, 0, stride);
                if jj >= nk {
                    (0..nb).for_each(|b| d[lanes * b + jj] = 0);
                    continue;
                }
                let (part, off) = self.at(kb + jj);
                std::ptr::copy_nonoverlapping(self.p[part].add(off), row, hd);
                let sc = self.scales[part].add(off / QB);
                (0..nb).for_each(|b| d[lanes * b + jj] = (*sc.add(b)).to_bits());
            }
        }
    }

    /// Row `j`'s part (0 or 1) and its byte offset there.
    #[inline(always)]
    fn at(&self, j: usize) -> (usize, usize) {
        if j < self.na {
            (0, j * self.rb)
        } else {
            (1, (j - self.na) * self.rb)
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    // The AVX-512 intrinsics are stable since Rust 1.89; the workspace toolchain is newer.
    #![allow(clippy::incompatible_msrv)]

    use std::arch::x86_64::*;

    use super::{Call, Kind, RowPtrs, Rows};
    use crate::kernels::{EXP_C, EXP_MIN, LN2_HI, LN2_LO, LOG2E};
    use kv_ring::BlockQ4_0;

    /// Largest head dimension of the fast path.
    pub(super) const MAX_HD: usize = 256;
    /// Rows per block of the row-vectorized kernel.
    const LANES: usize = 16;

    const F32: u8 = Kind::F32 as u8;
    const F16: u8 = Kind::F16 as u8;
    const Q8: u8 = Kind::Q8 as u8;
    const Q4: u8 = Kind::Q4 as u8;

    impl RowPtrs {
        /// Row `j`'s first byte and, q8_0, its first scale (else null).
        ///
        /// # Safety
        /// `j` is a row of the view.
        #[inline(always)]
        unsafe fn row(&self, j: usize) -> (*const u8, *const half::f16) {
            let (part, off) = self.at(j);
            // SAFETY: row `j` starts at `off` in its part; q8_0 rows (rb = hd) have their
            // `hd / 32` scales from `off / 32`.
            unsafe {
                let sc = if self.kind == Kind::Q8 {
                    self.scales[part].add(off / super::QB)
                } else {
                    std::ptr::null()
                };
                (self.p[part].add(off), sc)
            }
        }

        /// Hints rows `j..j + n` toward the caches: their bytes and, q8_0, their scales. Only
        /// addresses are computed (rows past the view's part hint at whatever lies there, and a
        /// hint never faults).
        #[inline(always)]
        fn prefetch(&self, j: usize, n: usize) {
            let (part, off) = self.at(j);
            let base = self.p[part].wrapping_add(off);
            for l in (0..n * self.rb).step_by(64) {
                // SAFETY: a prefetch reads nothing and never faults, whatever the address.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(l).cast()) };
            }
            if self.kind == Kind::Q8 {
                let sc = self.scales[part].wrapping_add(off / super::QB).cast::<u8>();
                let bytes = 2 * n * self.rb / super::QB;
                for l in (0..bytes).step_by(64) {
                    // SAFETY: as above.
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(sc.wrapping_add(l).cast()) };
                }
            }
        }

        /// Elements `16c..16c+16` of row `j` as f32 ([`chunk`]).
        ///
        /// # Safety
        /// `j` is a row of the view and `16c + 16 <= hd`.
        #[inline(always)]
        unsafe fn load(&self, j: usize, c: usize) -> __m512 {
            // SAFETY: forwarded.
            unsafe {
                let (base, sc) = self.row(j);
                match self.kind {
                    Kind::F32 => chunk::<F32>(base, sc, c),
                    Kind::F16 => chunk::<F16>(base, sc, c),
                    Kind::Q8 => chunk::<Q8>(base, sc, c),
                    Kind::Q4 => chunk::<Q4>(base, sc, c),
                }
            }
        }
    }

    /// Elements `16c..16c+16` of a row stored as `K` (`base`, and q8_0 scales `sc`, from
    /// [`RowPtrs::row`]) as f32 (q8_0: `d * q`; q4_0: `d * (q - 8)`; exact, as the portable
    /// path's).
    ///
    /// # Safety
    /// The row has `16c + 16` elements (and, q8_0, its scales at `sc`; q4_0, whole blocks of 18
    /// bytes, so block `c / 2`'s scale and 16 nibble bytes are inside it).
    #[inline(always)]
    unsafe fn chunk<const K: u8>(base: *const u8, sc: *const half::f16, c: usize) -> __m512 {
        // SAFETY: forwarded from the caller.
        unsafe {
            if K == F16 {
                _mm512_cvtph_ps(_mm256_loadu_si256(base.add(32 * c).cast()))
            } else if K == F32 {
                _mm512_loadu_ps(base.add(64 * c).cast())
            } else if K == Q8 {
                q8_chunk(base, c, q8_scale(sc, c / 2))
            } else {
                let block = base.add((c / 2) * size_of::<BlockQ4_0>());
                let d = block.cast::<u16>().read_unaligned();
                let qs = _mm_loadu_si128(block.add(2).cast());
                // Even chunks are the block's elements 0..16 (low nibbles), odd ones 16..32
                // (high nibbles).
                let qs = if c.is_multiple_of(2) {
                    qs
                } else {
                    _mm_srli_epi16::<4>(qs)
                };
                let q = _mm512_cvtepu8_epi32(_mm_and_si128(qs, _mm_set1_epi8(0xF)));
                let q = _mm512_sub_epi32(q, _mm512_set1_epi32(8));
                let d = _mm512_cvtph_ps(_mm256_set1_epi16(d as i16));
                _mm512_mul_ps(_mm512_cvtepi32_ps(q), d)
            }
        }
    }

    /// Vector [`exp_f`](crate::kernels::exp_f): the same operations lane by lane.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,fma")]
    fn exp_v(x: __m512) -> __m512 {
        let ok = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(EXP_MIN));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
        );
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
        let mut p = _mm512_set1_ps(EXP_C[0]);
        for c in &EXP_C[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
        }
        let one = _mm512_set1_ps(1.0);
        p = _mm512_fmadd_ps(p, r, one);
        p = _mm512_fmadd_ps(p, r, one);
        _mm512_maskz_mov_ps(ok, _mm512_scalef_ps(p, n))
    }

    /// `cap * tanh(s / cap)` lane by lane with the operations of the scalar
    /// [`tanh_f`](crate::kernels::tanh_f) path; `s` unchanged when `cap` is 0.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,fma")]
    fn softcap_v(s: __m512, cap: f32) -> __m512 {
        if cap == 0.0 {
            return s;
        }
        let x = _mm512_div_ps(s, _mm512_set1_ps(cap));
        let sign = _mm512_set1_ps(-0.0);
        let t = exp_v(_mm512_mul_ps(
            _mm512_set1_ps(-2.0),
            _mm512_andnot_ps(sign, x),
        ));
        let one = _mm512_set1_ps(1.0);
        let r = _mm512_div_ps(_mm512_sub_ps(one, t), _mm512_add_ps(one, t));
        // r >= 0: copysign is an OR of x's sign bit.
        _mm512_mul_ps(_mm512_set1_ps(cap), _mm512_or_ps(r, _mm512_and_ps(x, sign)))
    }

    /// Tree sums of 16 vectors: lane `j` of the result is [`super::tree16`] of vector `j`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    fn tree16_t(a: &[__m512; 16]) -> __m512 {
        // a[l] + a[l+8]: 256-bit halves of two vectors side by side.
        let b: [__m512; 8] = std::array::from_fn(|i| {
            let (x, y) = (a[2 * i], a[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
            )
        });
        // b[l] + b[l+4]: 128-bit lanes; vector i now holds keys 4i..4i+4, one per 128-bit lane.
        let c: [__m512; 4] = std::array::from_fn(|i| {
            let (x, y) = (b[2 * i], b[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
            )
        });
        // c[l] + c[l+2]: 64-bit pairs.
        let d: [__m512; 2] = std::array::from_fn(|i| {
            let (x, y) = (_mm512_castps_pd(c[2 * i]), _mm512_castps_pd(c[2 * i + 1]));
            _mm512_add_ps(
                _mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)),
            )
        });
        // d[0] + d[1]: lane 4L + m now holds vector 4m + L.
        let e = _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(d[0], d[1]),
            _mm512_shuffle_ps::<0b11_01_11_01>(d[0], d[1]),
        );
        let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(idx, e)
    }

    /// Lane tree sum of one vector into a scalar, [`super::tree16`] order.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn tree16_h(v: __m512) -> f32 {
        let mut a = [0.0f32; 16];
        // SAFETY: `a` has room for 16 floats.
        unsafe { _mm512_storeu_ps(a.as_mut_ptr(), v) };
        super::tree16(a)
    }

    /// # Safety
    /// The CPU supports AVX-512F/DQ and FMA; `hd % 16 == 0`, `hd <= MAX_HD`; shapes as checked by
    /// [`super::attend_rows`].
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    pub(super) unsafe fn attend(
        c: Call<'_>,
        scratch: &mut Vec<f32>,
        out: &mut [f32],
        mut stats: Option<&mut [f32]>,
    ) {
        let Call {
            q,
            n_keys,
            first,
            hd,
            view,
            scale,
            softcap,
        } = c;
        let keys = RowPtrs::new(Rows::new(&view.keys), hd);
        let values = RowPtrs::new(Rows::new(&view.values), hd);
        let mut r0 = 0;
        while r0 < n_keys.len() {
            let nr = (n_keys.len() - r0).min(LANES);
            let (qb, nb, ob) = (
                &q[r0 * hd..(r0 + nr) * hd],
                &n_keys[r0..r0 + nr],
                &mut out[r0 * hd..(r0 + nr) * hd],
            );
            let mut fb = [0usize; LANES];
            if let Some(f) = first {
                fb[..nr].copy_from_slice(&f[r0..r0 + nr]);
            }
            let fb = &fb[..nr];
            let cap = softcap.unwrap_or(0.0);
            let st = stats.as_deref_mut().map(|s| &mut s[2 * r0..2 * (r0 + nr)]);
            // SAFETY: forwarded; the block's rows are inside the checked shapes.
            unsafe {
                // The q8_0 keys' loop is compiled apart from the other types' (inlined into one
                // loop for all types, the q8_0 products cost f16's 64-key rows from DRAM 19 ->
                // 26 ns per key).
                if keys.kind == Kind::Q8 {
                    by_width!(
                        hd,
                        keys_block,
                        true,
                        (qb, nb, fb, keys, values, scale, cap, scratch, ob, st)
                    );
                } else {
                    by_width!(
                        hd,
                        keys_block,
                        false,
                        (qb, nb, fb, keys, values, scale, cap, scratch, ob, st)
                    );
                }
            }
            r0 += nr;
        }
    }

    /// The q8_0 key rows of a 16-key block, prepared once for every query row: the quants
    /// transposed so that a vector holds one 4-byte group of every key (read from the ring's
    /// rows in place, with a zero row for each key past the block's last), and the scales as
    /// f32, block-major (`d[16 * b + key]`). A query row's 16 dot products are then 8
    /// `vpdpbusd` per block on a broadcast query group, with no reduction across lanes (the
    /// transpose, once per block, is shared by every row). Aligned to a cache line, so that
    /// each of `kt`'s 64-byte vectors is one line to load.
    #[repr(C, align(64))]
    struct Q8Keys {
        /// The 16 rows transposed, offset by 128 (`vpdpbusd`'s unsigned operand): per block `b`
        /// and 4-byte group `g` (elements `32b + 4g..32b + 4g + 4`), one vector at `8b + g`
        /// whose 32-bit lanes are the 16 keys' groups, the keys' 128-bit lanes in the order
        /// 0-3, 8-11, 4-7, 12-15 (restored after the sums). Written by `prepare`.
        kt: [std::mem::MaybeUninit<u8>; 16 * MAX_HD],
        d: [f32; 16 * (MAX_HD / super::QB)],
    }

    /// A row of zero quants: the q8_0 key blocks' rows past their last key.
    static ZERO_ROW: [u8; MAX_HD] = [0; MAX_HD];

    /// How many keys ahead the q8_0 key and value rows are prefetched.
    const PREFETCH_KEYS: usize = 64;

    impl Q8Keys {
        fn new() -> Self {
            Self {
                kt: [const { std::mem::MaybeUninit::uninit() }; 16 * MAX_HD],
                d: [0.0; 16 * (MAX_HD / super::QB)],
            }
        }

        /// Keys `kb..kb + nk` (`nk <= 16`) of `keys` (q8_0 rows of `hd`).
        ///
        /// # Safety
        /// The rows exist in `keys`, a q8_0 view of rows `hd <= MAX_HD` wide; `self` is not
        /// moved while [`dot`](Self::dot) reads what this prepared.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
        unsafe fn prepare(&mut self, keys: &RowPtrs, kb: usize, nk: usize, hd: usize) {
            let nb = hd / super::QB;
            let mut d = [0u16; 16 * (MAX_HD / super::QB)];
            // SAFETY (whole body): the rows `kb..kb + nk` have `hd` quants and `nb` scales
            // (forwarded), 16 rows of one part are contiguous (`rb = hd`, scales `hd / 32` per
            // row), `ZERO_ROW` has `MAX_HD >= hd` bytes; `self.kt` has `hd / 4` vectors.
            unsafe {
                let (part, off) = keys.at(kb);
                // Where each of the 16 rows is read: the ring's rows, or zeros past the last.
                let mut rows = [ZERO_ROW.as_ptr(); 16];
                if nk == 16 && keys.at(kb + 15).0 == part {
                    // 16 rows of one part: contiguous, their scales too.
                    let src = keys.p[part].add(off);
                    (0..16).for_each(|jj| rows[jj] = src.add(jj * hd));
                    keys.prefetch(kb + PREFETCH_KEYS, 16);
                    let sc = keys.scales[part].add(off / super::QB).cast::<u16>();
                    if nb == 2 || nb == 4 {
                        // Key-major scales to block-major, two blocks per permute.
                        let v0 = _mm512_loadu_si512(sc.cast());
                        let v1 = if nb == 4 {
                            _mm512_loadu_si512(sc.add(32).cast())
                        } else {
                            v0
                        };
                        for b0 in (0..nb).step_by(2) {
                            let idx: [u16; 32] =
                                std::array::from_fn(|i| ((i % 16) * nb + b0 + i / 16) as u16);
                            let t = _mm512_permutex2var_epi16(
                                v0,
                                _mm512_loadu_si512(idx.as_ptr().cast()),
                                v1,
                            );
                            _mm512_storeu_si512(d.as_mut_ptr().add(16 * b0).cast(), t);
                        }
                    } else {
                        for jj in 0..16 {
                            for b in 0..nb {
                                d[16 * b + jj] = *sc.add(jj * nb + b);
                            }
                        }
                    }
                } else {
                    // A block across the ring's two parts, or a last block: row by row (the
                    // zero rows' scales 0).
                    for jj in 0..nk {
                        let (row, sc) = keys.row(kb + jj);
                        rows[jj] = row;
                        (0..nb).for_each(|b| d[16 * b + jj] = (*sc.add(b)).to_bits());
                    }
                }
                for b in 0..nb {
                    let h = _mm256_loadu_si256(d.as_ptr().add(16 * b).cast());
                    _mm512_storeu_ps(self.d.as_mut_ptr().add(16 * b), _mm512_cvtph_ps(h));
                }
                let x80 = _mm512_set1_epi8(0x80u8 as i8);
                let kt = self.kt.as_mut_ptr().cast::<__m512i>();
                for b in 0..nb {
                    // Row jj's block in the low half, row jj + 8's in the high half.
                    let z: [__m512i; 8] = std::array::from_fn(|jj| {
                        let lo = _mm256_loadu_si256(rows[jj].add(32 * b).cast());
                        let hi = _mm256_loadu_si256(rows[jj + 8].add(32 * b).cast());
                        _mm512_xor_si512(
                            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi),
                            x80,
                        )
                    });
                    // An 8x8 transpose of 32-bit groups in each 128-bit lane pair: u[i] holds
                    // group 4L + i of rows 0-3 (or 4-7, u[4 + i]) in 128-bit lane L (low rows)
                    // and L + 2 (rows + 8).
                    let t: [__m512i; 8] = std::array::from_fn(|i| {
                        let (x, y) = (z[2 * (i / 2)], z[2 * (i / 2) + 1]);
                        if i % 2 == 0 {
                            _mm512_unpacklo_epi32(x, y)
                        } else {
                            _mm512_unpackhi_epi32(x, y)
                        }
                    });
                    let u: [__m512i; 8] = std::array::from_fn(|i| {
                        let h = 4 * (i / 4);
                        let (x, y) = (t[h + (i % 4) / 2], t[h + 2 + (i % 4) / 2]);
                        if i % 2 == 0 {
                            _mm512_unpacklo_epi64(x, y)
                        } else {
                            _mm512_unpackhi_epi64(x, y)
                        }
                    });
                    for i in 0..4 {
                        _mm512_storeu_si512(
                            kt.add(8 * b + i),
                            _mm512_shuffle_i32x4::<0b10_00_10_00>(u[i], u[4 + i]),
                        );
                        _mm512_storeu_si512(
                            kt.add(8 * b + 4 + i),
                            _mm512_shuffle_i32x4::<0b11_01_11_01>(u[i], u[4 + i]),
                        );
                    }
                }
            }
        }

        /// One quantized query row against the 16 prepared keys, before `scale`: lane `key` is
        /// [`super::q8_dot`] of that key. `q`: the row's quants, `qd` its scales, `corr` its
        /// quant sums times 128 (per block): the keys are offset by 128 (`vpdpbusd`'s unsigned
        /// operand) and that is taken off after.
        ///
        /// # Safety
        /// `q` has `hd` quants, `qd` and `corr` `hd / 32` entries; [`prepare`](Self::prepare)
        /// ran for `hd`.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,fma")]
        unsafe fn dot(&self, hd: usize, q: &[i8], qd: &[f32], corr: &[i32]) -> __m512 {
            let nb = hd / super::QB;
            let zero = _mm512_setzero_si512();
            let mut s = _mm512_setzero_ps();
            // SAFETY (whole body): block `b`'s 8 vectors are inside the prepared `kt`, its 32
            // quants inside `q`, its 16 scales inside `self.d`.
            unsafe {
                let kt = self.kt.as_ptr().cast::<__m512i>();
                let qp = q.as_ptr().cast::<i32>();
                for b in 0..nb {
                    // Four chains (the groups g mod 4), summed: integers, exact in any order.
                    let mut a = [zero; 4];
                    for g in 0..8 {
                        let qv = _mm512_set1_epi32(qp.add(8 * b + g).read_unaligned());
                        a[g % 4] = _mm512_dpbusd_epi32(
                            a[g % 4],
                            _mm512_loadu_si512(kt.add(8 * b + g)),
                            qv,
                        );
                    }
                    let sum = _mm512_add_epi32(
                        _mm512_add_epi32(a[0], a[1]),
                        _mm512_add_epi32(a[2], a[3]),
                    );
                    // Keys back in order (128-bit lanes 0, 2, 1, 3).
                    let sum = _mm512_shuffle_i32x4::<0b11_01_10_00>(sum, sum);
                    let dot = _mm512_sub_epi32(sum, _mm512_set1_epi32(corr[b]));
                    let w = _mm512_mul_ps(
                        _mm512_loadu_ps(self.d.as_ptr().add(16 * b)),
                        _mm512_set1_ps(qd[b]),
                    );
                    s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), w, s);
                }
            }
            s
        }
    }

    /// Up to 16 query rows quantized for the q8_0 keys (`hd` quants per row; the quant sums
    /// times 128), and the current 16-key block.
    struct Q8State {
        q: [i8; 16 * MAX_HD],
        d: [f32; 16 * (MAX_HD / super::QB)],
        corr: [i32; 16 * (MAX_HD / super::QB)],
        keys: Q8Keys,
    }

    impl Q8State {
        #[inline(always)]
        fn new() -> Self {
            Self {
                q: [0; 16 * MAX_HD],
                d: [0.0; 16 * (MAX_HD / super::QB)],
                corr: [0; 16 * (MAX_HD / super::QB)],
                keys: Q8Keys::new(),
            }
        }

        /// Rows `0..nr` of `q` (`hd` wide, `hd <= MAX_HD`, a multiple of 32) quantized, in
        /// place (the state is 13 KiB: built where it stays, not moved).
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
        fn quantize(&mut self, q: &[f32], nr: usize, hd: usize) {
            let nb = hd / super::QB;
            for r in 0..nr {
                let (qr, dr, cr) = (
                    &mut self.q[r * hd..][..hd],
                    &mut self.d[r * nb..][..nb],
                    &mut self.corr[r * nb..][..nb],
                );
                quantize_query(&q[r * hd..][..hd], qr, dr, cr);
                cr.iter_mut().for_each(|c| *c *= 128);
            }
        }

        /// Row `r` against the prepared keys ([`Q8Keys::dot`]).
        ///
        /// # Safety
        /// The CPU has AVX-512 F/BW/VL/DQ and VNNI; `r < 16`.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,fma")]
        unsafe fn dot(&self, r: usize, hd: usize) -> __m512 {
            let nb = hd / super::QB;
            // SAFETY: row `r`'s quants (`hd`), scales and sums (`nb`) are inside the arrays.
            unsafe {
                self.keys.dot(
                    hd,
                    &self.q[r * hd..][..hd],
                    &self.d[r * nb..][..nb],
                    &self.corr[r * nb..][..nb],
                )
            }
        }
    }

    /// [`super::quantize_query`] vectorized, with the same results bit for bit: the block's
    /// maximum magnitude (exact in any order; `vmaxps` with the running maximum second skips a
    /// NaN element, as `f32::max` does), `x * id` rounded to nearest even (`vrndscaleps`, as
    /// the scalar magic-number addition), NaN to 0, clamped to ±127, summed as integers.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
    pub(super) fn quantize_query(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) {
        let abs = _mm512_set1_ps(f32::from_bits(0x7fff_ffff));
        let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
        for (b, (xb, qb)) in x
            .chunks_exact(super::QB)
            .zip(q.chunks_exact_mut(super::QB))
            .enumerate()
        {
            // SAFETY: a block is 32 elements: two vectors of 16.
            let v = unsafe {
                [
                    _mm512_loadu_ps(xb.as_ptr()),
                    _mm512_loadu_ps(xb.as_ptr().add(16)),
                ]
            };
            let m = v.iter().fold(_mm512_setzero_ps(), |m, &v| {
                _mm512_max_ps(_mm512_and_ps(v, abs), m)
            });
            let amax = _mm512_reduce_max_ps(m);
            let id = _mm512_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
            let mut s = _mm512_setzero_si512();
            for (h, &v) in v.iter().enumerate() {
                let x = _mm512_mul_ps(v, id);
                let x =
                    _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
                let x = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(x, x), x);
                let i = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(x, hi), lo));
                s = _mm512_add_epi32(s, i);
                // SAFETY: elements `16h..16h + 16` of the block.
                unsafe {
                    _mm_storeu_si128(qb.as_mut_ptr().add(16 * h).cast(), _mm512_cvtepi32_epi8(i))
                };
            }
            d[b] = amax / 127.0;
            sum[b] = _mm512_reduce_add_epi32(s);
        }
    }

    /// Up to 16 rows, vectorized across keys: each 16-key block is converted once for all the
    /// rows, each value row once per group of up to 4 rows; head dim `16 * NC`.
    ///
    /// # Safety
    /// As for [`attend`]; `1 <= nb.len() <= 16`; `keys` are q8_0 exactly when `Q8`.
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn keys_block<const NC: usize, const Q8: bool>(
        q: &[f32],
        nb: &[usize],
        fb: &[usize],
        keys: RowPtrs,
        values: RowPtrs,
        scale: f32,
        cap: f32,
        scratch: &mut Vec<f32>,
        out: &mut [f32],
        mut stats: Option<&mut [f32]>,
    ) {
        let hd = 16 * NC;
        let nr = nb.len();
        let nmax = nb.iter().copied().max().unwrap_or(0);
        let npad = nmax.next_multiple_of(16);
        // scratch: scores [nr][npad] | kbuf [16][hd] (a 16-key block's key rows as f32)
        let sp = super::reserve(scratch, nr * npad + 16 * hd);
        // SAFETY: inside the reservation.
        let kbuf = unsafe { sp.add(nr * npad) };
        let scv = _mm512_set1_ps(scale);
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        let lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let mut sums = [0.0f32; 16];
        // SAFETY (whole body): pointers stay inside `scratch` (nr * npad + 16 * hd floats),
        // `q`/`out` (nr rows of hd) and the view's rows `0..nmax`.
        unsafe {
            // Scores of every row against the keys any row sees, one 16-key block at a time:
            // the block's key rows are converted once for all rows, then each row's 16 lane
            // sums run over constant bounds in registers. From the 16-key block holding the
            // first visible key: keys j ≡ l (mod 16) land in lane l.
            let kb_all = fb.iter().copied().min().unwrap_or(0) / 16 * 16;
            let mut mx = [ninf; 16];
            let mut kb = kb_all;
            // q8_0 keys: the rows' queries quantized, each 16-key block prepared once for all
            // rows (only then is the state on the stack initialized).
            let mut q8 = None;
            if Q8 {
                q8.insert(Q8State::new()).quantize(q, nr, hd);
            }
            while kb < nmax {
                let nk = 16.min(nmax - kb);
                if let Some(st) = &mut q8 {
                    st.keys.prepare(&keys, kb, nk, hd);
                } else {
                    // Keys past the last are zero rows: their sums are 0 (and masked out below).
                    // (No prefetch here: for f16 rows from DRAM it measured slower, 18.8 -> 24-28
                    // ns per key at 2048 keys, with the one in the value loop.)
                    for jj in 0..16 {
                        for c in 0..NC {
                            let k = if jj < nk {
                                keys.load(kb + jj, c)
                            } else {
                                _mm512_setzero_ps()
                            };
                            _mm512_storeu_ps(kbuf.add(jj * hd + 16 * c), k);
                        }
                    }
                }
                for r in 0..nr {
                    let dot = if let Some(st) = &q8 {
                        st.dot(r, hd)
                    } else {
                        let qr: [__m512; NC] = std::array::from_fn(|c| {
                            _mm512_loadu_ps(q.as_ptr().add(r * hd + 16 * c))
                        });
                        let mut acc = [_mm512_setzero_ps(); 16];
                        // Per key, its lane sums over `c` ascending (16 independent chains).
                        for (c, qc) in qr.iter().enumerate() {
                            for (jj, a) in acc.iter_mut().enumerate() {
                                let k = _mm512_loadu_ps(kbuf.add(jj * hd + 16 * c));
                                *a = _mm512_fmadd_ps(*qc, k, *a);
                            }
                        }
                        tree16_t(&acc)
                    };
                    let s = softcap_v(_mm512_mul_ps(dot, scv), cap);
                    let live =
                        _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(nb[r] as i32 - kb as i32), lane)
                            & _mm512_cmpge_epi32_mask(
                                lane,
                                _mm512_set1_epi32(fb[r] as i32 - kb as i32),
                            );
                    let s = _mm512_mask_mov_ps(ninf, live, s);
                    mx[r] = _mm512_max_ps(mx[r], s);
                    _mm512_storeu_ps(sp.add(r * npad + kb), s);
                }
                kb += 16;
            }
            // Per group of up to 4 rows (whose probabilities share each value row's load):
            // the softmax over the group's key range (keys a row does not see are -inf: 0),
            // then the weighted value sum.
            for g in (0..nr).step_by(4) {
                let gn = (nr - g).min(4);
                let gmax = nb[g..g + gn].iter().copied().max().unwrap_or(0);
                let kb0 = fb[g..g + gn].iter().copied().min().unwrap_or(0) / 16 * 16;
                for r in 0..gn {
                    let max = _mm512_reduce_max_ps(mx[g + r]);
                    let m = _mm512_set1_ps(max);
                    let row = sp.add((g + r) * npad);
                    let mut part = _mm512_setzero_ps();
                    for kb in (kb0..gmax).step_by(16) {
                        let p = exp_v(_mm512_sub_ps(_mm512_loadu_ps(row.add(kb)), m));
                        part = _mm512_add_ps(part, p);
                        _mm512_storeu_ps(row.add(kb), p);
                    }
                    sums[r] = tree16_h(part);
                    if let Some(st) = stats.as_deref_mut() {
                        st[2 * (g + r)..2 * (g + r) + 2].copy_from_slice(&[max, sums[r]]);
                    }
                }
                pv(
                    values,
                    hd,
                    kb0,
                    gmax,
                    sp.add(g * npad),
                    npad,
                    gn,
                    &sums[..gn],
                    out.as_mut_ptr().add(g * hd),
                );
            }
        }
    }

    /// Scale `b` of a q8_0 row (scales at `sc`) in every lane (vcvtph2ps: exact).
    ///
    /// # Safety
    /// The row has a block `b`.
    #[inline(always)]
    unsafe fn q8_scale(sc: *const half::f16, b: usize) -> __m512 {
        // SAFETY: forwarded; the caller runs with AVX-512 F (and F16C).
        unsafe {
            let d = *sc.add(b);
            _mm512_cvtph_ps(_mm256_set1_epi16(d.to_bits() as i16))
        }
    }

    /// Elements `16c..16c+16` of a q8_0 row at `base` as f32, `d * q` with `d` its block's
    /// scale ([`q8_scale`]).
    ///
    /// # Safety
    /// The row has `16c + 16` elements.
    #[inline(always)]
    unsafe fn q8_chunk(base: *const u8, c: usize, d: __m512) -> __m512 {
        // SAFETY: forwarded; the caller runs with AVX-512 F.
        unsafe {
            let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(base.add(16 * c).cast()));
            _mm512_mul_ps(_mm512_cvtepi32_ps(q), d)
        }
    }

    /// `out[r] = (Σ_j p(r, j) · v[j]) · (1 / sums[r])` for `nr <= 4` rows, keys `j0..nk` in order,
    /// `p(r, j) = *p.add(r * rs + j)` (0 where row `r` does not see key `j`; keys below `j0`
    /// have p = 0 for every row, and skipping a `fma(0, v, o)` leaves `o` unchanged). One loop
    /// per storage type and row count ([`pv_rows`]).
    ///
    /// # Safety
    /// `p` covers all `(r, j)` used; `out` has `nr` rows of `hd`; rows `0..nk` exist in `values`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
    unsafe fn pv(
        values: RowPtrs,
        hd: usize,
        j0: usize,
        nk: usize,
        p: *const f32,
        rs: usize,
        nr: usize,
        sums: &[f32],
        out: *mut f32,
    ) {
        // SAFETY: forwarded from the caller.
        unsafe {
            if values.kind == Kind::Q8 {
                return match nr {
                    1 => pv_q8::<1>(values, hd, j0, nk, p, rs, sums, out),
                    2 => pv_q8::<2>(values, hd, j0, nk, p, rs, sums, out),
                    3 => pv_q8::<3>(values, hd, j0, nk, p, rs, sums, out),
                    _ => pv_q8::<4>(values, hd, j0, nk, p, rs, sums, out),
                };
            }
            // The other types: one loop for all (a copy per type and row count, as for q8_0,
            // measured 1.3x slower per key on f16 rows read from DRAM: 21.7-23.5 ns against
            // 17.7-17.8 at 2048 keys, though faster from cache).
            for c0 in (0..hd / 16).step_by(4) {
                let cn = (hd / 16 - c0).min(4);
                let mut acc = [[_mm512_setzero_ps(); 4]; 4];
                for j in j0..nk {
                    let mut v = [_mm512_setzero_ps(); 4];
                    for (c, vc) in v.iter_mut().enumerate().take(cn) {
                        *vc = values.load(j, c0 + c);
                    }
                    for (r, ar) in acc.iter_mut().enumerate().take(nr) {
                        let pj = _mm512_set1_ps(*p.add(r * rs + j));
                        for c in 0..cn {
                            ar[c] = _mm512_fmadd_ps(pj, v[c], ar[c]);
                        }
                    }
                }
                for (r, ar) in acc.iter().enumerate().take(nr) {
                    let inv = _mm512_set1_ps(1.0 / sums[r]);
                    for (c, a) in ar.iter().enumerate().take(cn) {
                        _mm512_storeu_ps(out.add(r * hd + 16 * (c0 + c)), _mm512_mul_ps(*a, inv));
                    }
                }
            }
        }
    }

    /// [`pv`] for `NR` rows of q8_0 values: per group of up to 4 chunks, the rows' sums in
    /// registers over the keys, each block's scale widened once per key.
    ///
    /// # Safety
    /// As for [`pv`], with `nr = NR` and q8_0 `values`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
    unsafe fn pv_q8<const NR: usize>(
        values: RowPtrs,
        hd: usize,
        j0: usize,
        nk: usize,
        p: *const f32,
        rs: usize,
        sums: &[f32],
        out: *mut f32,
    ) {
        // SAFETY (whole body): forwarded from the caller.
        unsafe {
            for c0 in (0..hd / 16).step_by(4) {
                let cn = (hd / 16 - c0).min(4);
                let mut acc = [[_mm512_setzero_ps(); 4]; NR];
                for j in j0..nk {
                    let (base, sc) = values.row(j);
                    if c0 == 0 && j % 16 == 0 {
                        values.prefetch(j + PREFETCH_KEYS, 16);
                    }
                    let pj: [__m512; NR] =
                        std::array::from_fn(|r| _mm512_set1_ps(*p.add(r * rs + j)));
                    // The scales of the group's two blocks, each widened once.
                    let dq: [__m512; 2] = std::array::from_fn(|h| {
                        if 2 * h < cn {
                            q8_scale(sc, c0 / 2 + h)
                        } else {
                            _mm512_setzero_ps()
                        }
                    });
                    for c in 0..4 {
                        if c < cn {
                            let v = q8_chunk(base, c0 + c, dq[c / 2]);
                            for (a, pr) in acc.iter_mut().zip(&pj) {
                                a[c] = _mm512_fmadd_ps(*pr, v, a[c]);
                            }
                        }
                    }
                }
                for (r, ar) in acc.iter().enumerate() {
                    let inv = _mm512_set1_ps(1.0 / sums[r]);
                    for (c, a) in ar.iter().enumerate().take(cn) {
                        _mm512_storeu_ps(out.add(r * hd + 16 * (c0 + c)), _mm512_mul_ps(*a, inv));
                    }
                }
            }
        }
    }
}

/// The AVX2 path: the AVX-512 kernel's design at 8 lanes. Each block of 8 key rows is converted
/// once for up to 16 query rows; a row's 16 lane sums per key are two 8-lane vectors (elements
/// `16c..16c+8` and `16c+8..16c+16`), and a transposing tree whose first step is their sum
/// builds 8 keys' scores at once; the softmax's 16 partial sums are two vectors (8-key blocks
/// alternate between them, from a 16-aligned first block); values go 64 keys at a time (their
/// rows stay in L1 while every 16-element chunk of every row of a group is accumulated).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Call, Kind, RowPtrs, Rows};
    use crate::kernels::{EXP_C, EXP_MIN, LN2_HI, LN2_LO, LOG2E};

    /// Largest head dimension of the fast path.
    pub(super) const MAX_HD: usize = 256;
    /// Query rows per call of the kernel.
    const ROWS: usize = 16;
    /// Keys per block of the value sums.
    const VBLOCK: usize = 64;

    impl RowPtrs {
        /// Elements `8c..8c+8` of row `j` as f32 (q8_0: `d * q`; q4_0: `d * (q - 8)`; exact,
        /// as the portable path's).
        ///
        /// # Safety
        /// `j` is a row of the view and `8c + 8 <= hd`.
        #[inline(always)]
        unsafe fn load8(&self, j: usize, c: usize) -> __m256 {
            // SAFETY: forwarded from the caller: row `j` exists and has `hd` elements (and,
            // q8_0, `hd / 32` scales; q4_0, `hd / 32` blocks of 18 bytes, so block `c / 4`'s
            // scale and its 16 nibble bytes are inside it).
            unsafe {
                let (part, off) = self.at(j);
                let base = self.p[part].add(off);
                match self.kind {
                    Kind::F16 => _mm256_cvtph_ps(_mm_loadu_si128(base.add(16 * c).cast())),
                    Kind::F32 => _mm256_loadu_ps(base.add(32 * c).cast()),
                    Kind::Q8 => {
                        let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(base.add(8 * c).cast()));
                        // Row `off / hd` has its `hd / 32` scales from `off / 32` (rb = hd).
                        let d = (*self.scales[part].add(off / 32 + c / 4)).to_f32();
                        _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(d))
                    }
                    Kind::Q4 => {
                        let block = base.add((c / 4) * size_of::<kv_ring::BlockQ4_0>());
                        let d = half::f16::from_bits(block.cast::<u16>().read_unaligned());
                        // Chunks 0 and 1 of a block are its elements 0..16 (low nibbles of bytes
                        // 0..8 and 8..16), chunks 2 and 3 the elements 16..32 (high nibbles).
                        let qs = _mm_loadl_epi64(block.add(2 + 8 * (c % 2)).cast());
                        let qs = if c % 4 >= 2 {
                            _mm_srli_epi16::<4>(qs)
                        } else {
                            qs
                        };
                        let q = _mm256_cvtepu8_epi32(_mm_and_si128(qs, _mm_set1_epi8(0xF)));
                        let q = _mm256_sub_epi32(q, _mm256_set1_epi32(8));
                        _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(d.to_f32()))
                    }
                }
            }
        }
    }

    /// Vector [`exp_f`](crate::kernels::exp_f): the same operations lane by lane.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp_v(x: __m256) -> __m256 {
        let ok = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(EXP_MIN));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
        );
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
        let mut p = _mm256_set1_ps(EXP_C[0]);
        for c in &EXP_C[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        let one = _mm256_set1_ps(1.0);
        p = _mm256_fmadd_ps(p, r, one);
        p = _mm256_fmadd_ps(p, r, one);
        let n = _mm256_min_ps(
            _mm256_max_ps(n, _mm256_set1_ps(-127.0)),
            _mm256_set1_ps(127.0),
        );
        let e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
        let two_n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e));
        _mm256_and_ps(ok, _mm256_mul_ps(p, two_n))
    }

    /// `cap * tanh(s / cap)` lane by lane with the operations of the scalar
    /// [`tanh_f`](crate::kernels::tanh_f) path; `s` unchanged when `cap` is 0.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn softcap_v(s: __m256, cap: f32) -> __m256 {
        if cap == 0.0 {
            return s;
        }
        let x = _mm256_div_ps(s, _mm256_set1_ps(cap));
        let sign = _mm256_set1_ps(-0.0);
        let t = exp_v(_mm256_mul_ps(
            _mm256_set1_ps(-2.0),
            _mm256_andnot_ps(sign, x),
        ));
        let one = _mm256_set1_ps(1.0);
        let r = _mm256_div_ps(_mm256_sub_ps(one, t), _mm256_add_ps(one, t));
        // r >= 0: copysign is an OR of x's sign bit.
        _mm256_mul_ps(_mm256_set1_ps(cap), _mm256_or_ps(r, _mm256_and_ps(x, sign)))
    }

    /// The first three steps of [`super::tree16`] for 4 keys (`acc[k]` = key `k`'s lanes 0..8
    /// and 8..16): `[a0, a1, c0, c1 | b0, b1, d0, d1]`, the two partial sums left of keys a..d.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn tree_4(acc: &[[__m256; 2]; 4]) -> __m256 {
        // a[l] + a[l+8].
        let v: [__m256; 4] = std::array::from_fn(|k| _mm256_add_ps(acc[k][0], acc[k][1]));
        // a[l] + a[l+4]: 128-bit halves of two keys side by side.
        let ab = _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(v[0], v[1]),
            _mm256_permute2f128_ps::<0x31>(v[0], v[1]),
        );
        let cd = _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(v[2], v[3]),
            _mm256_permute2f128_ps::<0x31>(v[2], v[3]),
        );
        // a[l] + a[l+2].
        _mm256_add_ps(
            _mm256_shuffle_ps::<0b01_00_01_00>(ab, cd),
            _mm256_shuffle_ps::<0b11_10_11_10>(ab, cd),
        )
    }

    /// The last step of [`super::tree16`] for keys 0..4 (`w0`) and 4..8 (`w1`) from
    /// [`tree_4`]: lane `k` of the result is key `k`'s sum.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn tree_8(w0: __m256, w1: __m256) -> __m256 {
        // [k0, k2, k4, k6 | k1, k3, k5, k7]
        let e = _mm256_add_ps(
            _mm256_shuffle_ps::<0b10_00_10_00>(w0, w1),
            _mm256_shuffle_ps::<0b11_01_11_01>(w0, w1),
        );
        _mm256_permutevar8x32_ps(e, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }

    /// Maximum of a vector's lanes.
    #[inline]
    #[target_feature(enable = "avx")]
    fn hmax(v: __m256) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)))
    }

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C; `hd % 16 == 0`, `hd <= MAX_HD`; shapes as checked by
    /// [`super::attend_rows`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn attend(
        c: Call<'_>,
        scratch: &mut Vec<f32>,
        out: &mut [f32],
        mut stats: Option<&mut [f32]>,
    ) {
        let Call {
            q,
            n_keys,
            first,
            hd,
            view,
            scale,
            softcap,
        } = c;
        let keys = RowPtrs::new(Rows::new(&view.keys), hd);
        let values = RowPtrs::new(Rows::new(&view.values), hd);
        let cap = softcap.unwrap_or(0.0);
        for r0 in (0..n_keys.len()).step_by(ROWS) {
            let nr = (n_keys.len() - r0).min(ROWS);
            let mut fb = [0usize; ROWS];
            if let Some(f) = first {
                fb[..nr].copy_from_slice(&f[r0..r0 + nr]);
            }
            let (qb, nb, fb, ob) = (
                &q[r0 * hd..(r0 + nr) * hd],
                &n_keys[r0..r0 + nr],
                &fb[..nr],
                &mut out[r0 * hd..(r0 + nr) * hd],
            );
            let st = stats.as_deref_mut().map(|s| &mut s[2 * r0..2 * (r0 + nr)]);
            // SAFETY: forwarded; the block's rows are inside the checked shapes.
            unsafe {
                by_width!(
                    hd,
                    keys_block(qb, nb, fb, keys, values, scale, cap, scratch, ob, st)
                );
            }
        }
    }

    /// The q8_0 key rows of an 8-key block, prepared once for every query row: the quants
    /// (zero rows past the block's last key) and the scales as f32, block-major
    /// (`d[8 * b + key]`).
    struct Q8Keys {
        k: [i8; 8 * MAX_HD],
        d: [f32; 8 * (MAX_HD / super::QB)],
    }

    impl Q8Keys {
        /// Keys `kb..kb + nk` (`nk <= 8`) of `keys` (q8_0 rows of `hd`).
        ///
        /// # Safety
        /// The rows exist in `keys`, a q8_0 view of rows `hd <= MAX_HD` wide.
        #[inline]
        #[target_feature(enable = "avx2,f16c")]
        unsafe fn prepare(&mut self, keys: &RowPtrs, kb: usize, nk: usize, hd: usize) {
            let nb = hd / super::QB;
            let mut d = [0u16; 8 * (MAX_HD / super::QB)];
            // SAFETY (whole body): the rows `kb..kb + nk` have `hd` quants and `nb` scales
            // (forwarded); `self.k` has 8 rows of `hd <= MAX_HD`.
            unsafe {
                keys.copy_q8(kb, nk, hd, 8, hd, self.k.as_mut_ptr().cast(), &mut d);
                for b in 0..nb {
                    let h = _mm_loadu_si128(d.as_ptr().add(8 * b).cast());
                    _mm256_storeu_ps(self.d.as_mut_ptr().add(8 * b), _mm256_cvtph_ps(h));
                }
            }
        }

        /// One quantized query row (`q`: `hd` quants in -127..=127, `qd`: its scales) against
        /// the 8 prepared keys, before `scale`: lane `key` is [`super::q8_dot`] of that key.
        /// Per block and key, `maddubs(|k|, q · sign(k))` (no pair exceeds 2 · 128 · 127, so
        /// nothing saturates) summed to i32.
        ///
        /// # Safety
        /// `q` has `hd` quants, `qd` `hd / 32` scales.
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn dot(&self, hd: usize, q: &[i8], qd: &[f32]) -> __m256 {
            let ones = _mm256_set1_epi16(1);
            let mut s = _mm256_setzero_ps();
            // SAFETY (whole body): block `b` of row `jj` lies inside `self.k` and `q`; scales
            // `8 * b..8 * b + 8` inside `self.d`.
            unsafe {
                for (b, &qdb) in qd.iter().enumerate().take(hd / super::QB) {
                    let qv = _mm256_loadu_si256(q.as_ptr().add(32 * b).cast());
                    let p: [__m256i; 8] = std::array::from_fn(|jj| {
                        let k = _mm256_loadu_si256(self.k.as_ptr().add(jj * hd + 32 * b).cast());
                        let m = _mm256_maddubs_epi16(_mm256_abs_epi8(k), _mm256_sign_epi8(qv, k));
                        _mm256_madd_epi16(m, ones)
                    });
                    // Per 128-bit half: keys 0..4 (then 4..8) with their half's sums.
                    let h0 = _mm256_hadd_epi32(
                        _mm256_hadd_epi32(p[0], p[1]),
                        _mm256_hadd_epi32(p[2], p[3]),
                    );
                    let h1 = _mm256_hadd_epi32(
                        _mm256_hadd_epi32(p[4], p[5]),
                        _mm256_hadd_epi32(p[6], p[7]),
                    );
                    let dot = _mm256_add_epi32(
                        _mm256_permute2x128_si256::<0x20>(h0, h1),
                        _mm256_permute2x128_si256::<0x31>(h0, h1),
                    );
                    let w = _mm256_mul_ps(
                        _mm256_loadu_ps(self.d.as_ptr().add(8 * b)),
                        _mm256_set1_ps(qdb),
                    );
                    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), w, s);
                }
            }
            s
        }
    }

    /// Up to 16 query rows quantized for the q8_0 keys, and the current 8-key block.
    struct Q8State {
        q: [i8; ROWS * MAX_HD],
        d: [f32; ROWS * (MAX_HD / super::QB)],
        keys: Q8Keys,
    }

    impl Q8State {
        /// Rows `0..nr` of `q` (`hd` wide, `hd <= MAX_HD`, a multiple of 32) quantized.
        fn new(q: &[f32], nr: usize, hd: usize) -> Self {
            let nb = hd / super::QB;
            let mut st = Self {
                q: [0; ROWS * MAX_HD],
                d: [0.0; ROWS * (MAX_HD / super::QB)],
                keys: Q8Keys {
                    k: [0; 8 * MAX_HD],
                    d: [0.0; 8 * (MAX_HD / super::QB)],
                },
            };
            let mut sums = [0i32; MAX_HD / super::QB];
            for r in 0..nr {
                super::quantize_query(
                    &q[r * hd..][..hd],
                    &mut st.q[r * hd..][..hd],
                    &mut st.d[r * nb..][..nb],
                    &mut sums[..nb],
                );
            }
            st
        }

        /// Row `r` against the prepared keys ([`Q8Keys::dot`]).
        ///
        /// # Safety
        /// The CPU has AVX2 and FMA; `r < ROWS`.
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn dot(&self, r: usize, hd: usize) -> __m256 {
            let nb = hd / super::QB;
            // SAFETY: row `r`'s quants and scales are inside the arrays.
            unsafe {
                self.keys
                    .dot(hd, &self.q[r * hd..][..hd], &self.d[r * nb..][..nb])
            }
        }
    }

    /// Up to 16 rows of head dim `16 * NC`.
    ///
    /// # Safety
    /// As for [`attend`]; `1 <= nb.len() <= 16`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn keys_block<const NC: usize>(
        q: &[f32],
        nb: &[usize],
        fb: &[usize],
        keys: RowPtrs,
        values: RowPtrs,
        scale: f32,
        cap: f32,
        scratch: &mut Vec<f32>,
        out: &mut [f32],
        mut stats: Option<&mut [f32]>,
    ) {
        let hd = 16 * NC;
        let nr = nb.len();
        let nmax = nb.iter().copied().max().unwrap_or(0);
        let npad = nmax.next_multiple_of(16);
        // scratch: scores [nr][npad] | kbuf [8][hd] (an 8-key block's key rows as f32)
        let sp = super::reserve(scratch, nr * npad + 8 * hd);
        let scv = _mm256_set1_ps(scale);
        let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let zero = _mm256_setzero_ps();
        // SAFETY (whole body): pointers stay inside `scratch` (nr * npad + 8 * hd floats),
        // `q`/`out` (nr rows of hd) and the view's rows `0..nmax`.
        unsafe {
            let kbuf = sp.add(nr * npad);
            // Scores of every row against the keys any row sees, 8 keys at a time, from the
            // 16-key block holding the first visible key (keys j ≡ l (mod 16) in lane l % 8 of
            // the blocks of parity l / 8).
            let kb_all = fb.iter().copied().min().unwrap_or(0) / 16 * 16;
            let mut mx = [ninf; ROWS];
            let mut kb = kb_all;
            // q8_0 keys: the rows' queries quantized, each 8-key block prepared once for all
            // rows (only then is the state on the stack initialized).
            let mut q8 = (keys.kind == Kind::Q8).then(|| Q8State::new(q, nr, hd));
            while kb < nmax {
                let nk = 8.min(nmax - kb);
                if let Some(st) = &mut q8 {
                    st.keys.prepare(&keys, kb, nk, hd);
                } else {
                    // Keys past the last are zero rows: their sums are 0 (and masked out below).
                    for jj in 0..8 {
                        for c in 0..2 * NC {
                            let k = if jj < nk {
                                keys.load8(kb + jj, c)
                            } else {
                                zero
                            };
                            _mm256_storeu_ps(kbuf.add(jj * hd + 8 * c), k);
                        }
                    }
                }
                for r in 0..nr {
                    let dot = if let Some(st) = &q8 {
                        st.dot(r, hd)
                    } else {
                        let qp = q.as_ptr().add(r * hd);
                        let mut w = [zero; 2];
                        for (half, wh) in w.iter_mut().enumerate() {
                            // Keys 4 * half.. of the block: per key its 16 lane sums over `c`
                            // ascending, as two vectors (8 independent chains).
                            let mut acc = [[zero; 2]; 4];
                            for c in 0..NC {
                                let ql = _mm256_loadu_ps(qp.add(16 * c));
                                let qh = _mm256_loadu_ps(qp.add(16 * c + 8));
                                for (k, a) in acc.iter_mut().enumerate() {
                                    let kp = kbuf.add((4 * half + k) * hd + 16 * c);
                                    a[0] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(kp), a[0]);
                                    a[1] = _mm256_fmadd_ps(qh, _mm256_loadu_ps(kp.add(8)), a[1]);
                                }
                            }
                            *wh = tree_4(&acc);
                        }
                        tree_8(w[0], w[1])
                    };
                    let s = softcap_v(_mm256_mul_ps(dot, scv), cap);
                    // Lane k is key kb + k: live when fb[r] <= kb + k < nb[r].
                    let below =
                        _mm256_cmpgt_epi32(_mm256_set1_epi32(nb[r] as i32 - kb as i32), lane);
                    let before =
                        _mm256_cmpgt_epi32(_mm256_set1_epi32(fb[r] as i32 - kb as i32), lane);
                    let live = _mm256_castsi256_ps(_mm256_andnot_si256(before, below));
                    let s = _mm256_blendv_ps(ninf, s, live);
                    mx[r] = _mm256_max_ps(mx[r], s);
                    _mm256_storeu_ps(sp.add(r * npad + kb), s);
                }
                kb += 8;
            }
            // Per group of up to 4 rows (whose probabilities share each value row's load):
            // the softmax over the group's key range (keys a row does not see are -inf: 0),
            // then the weighted value sum.
            let mut sums = [0.0f32; 4];
            for g in (0..nr).step_by(4) {
                let gn = (nr - g).min(4);
                let gmax = nb[g..g + gn].iter().copied().max().unwrap_or(0);
                let kb0 = fb[g..g + gn].iter().copied().min().unwrap_or(0) / 16 * 16;
                for r in 0..gn {
                    let max = hmax(mx[g + r]);
                    let m = _mm256_set1_ps(max);
                    let row = sp.add((g + r) * npad);
                    let mut part = [zero; 2];
                    for kb in (kb0..gmax).step_by(8) {
                        let p = exp_v(_mm256_sub_ps(_mm256_loadu_ps(row.add(kb)), m));
                        let h = (kb / 8) % 2;
                        part[h] = _mm256_add_ps(part[h], p);
                        _mm256_storeu_ps(row.add(kb), p);
                    }
                    let mut lanes = [0.0f32; 16];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), part[0]);
                    _mm256_storeu_ps(lanes.as_mut_ptr().add(8), part[1]);
                    sums[r] = super::tree16(lanes);
                    if let Some(st) = stats.as_deref_mut() {
                        st[2 * (g + r)..2 * (g + r) + 2].copy_from_slice(&[max, sums[r]]);
                    }
                }
                pv::<NC>(
                    values,
                    kb0,
                    gmax,
                    sp.add(g * npad),
                    npad,
                    gn,
                    &sums[..gn],
                    out.as_mut_ptr().add(g * hd),
                );
            }
        }
    }

    /// `out[r] = (Σ_j p(r, j) · v[j]) · (1 / sums[r])` for `nr <= 4` rows of head dim `16 * NC`,
    /// keys `j0..nk` in order, `p(r, j) = *p.add(r * rs + j)` (0 where row `r` does not see key
    /// `j`; skipping a `fma(0, v, o)` would leave `o` unchanged). `VBLOCK` keys at a time (their
    /// value rows stay in L1 across the passes), each 16-element chunk of every row accumulated
    /// in `out` across the blocks.
    ///
    /// # Safety
    /// `p` covers all `(r, j)` used; `out` has `nr` rows of `16 * NC`; rows `0..nk` exist in
    /// `values`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pv<const NC: usize>(
        values: RowPtrs,
        j0: usize,
        nk: usize,
        p: *const f32,
        rs: usize,
        nr: usize,
        sums: &[f32],
        out: *mut f32,
    ) {
        let hd = 16 * NC;
        // SAFETY (whole body): forwarded from the caller.
        unsafe {
            std::ptr::write_bytes(out, 0, nr * hd);
            for jb in (j0..nk).step_by(VBLOCK) {
                let je = (jb + VBLOCK).min(nk);
                for c in 0..NC {
                    match nr {
                        1 => pv_pass::<1>(values, jb, je, c, p, rs, hd, out),
                        2 => pv_pass::<2>(values, jb, je, c, p, rs, hd, out),
                        3 => pv_pass::<3>(values, jb, je, c, p, rs, hd, out),
                        _ => pv_pass::<4>(values, jb, je, c, p, rs, hd, out),
                    }
                }
            }
            for (r, &sum) in sums.iter().enumerate().take(nr) {
                let inv = _mm256_set1_ps(1.0 / sum);
                for i in 0..2 * NC {
                    let o = out.add(r * hd + 8 * i);
                    _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_loadu_ps(o), inv));
                }
            }
        }
    }

    /// Keys `jb..je` of [`pv`] for chunk `c` (elements `16c..16c+16`) of `NR` rows: the sums in
    /// registers (constant bounds), loaded from and stored back to `out`.
    ///
    /// # Safety
    /// As for [`pv`].
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pv_pass<const NR: usize>(
        values: RowPtrs,
        jb: usize,
        je: usize,
        c: usize,
        p: *const f32,
        rs: usize,
        hd: usize,
        out: *mut f32,
    ) {
        // SAFETY (whole body): forwarded from the caller.
        unsafe {
            let at = |r: usize, i: usize| out.add(r * hd + 16 * c + 8 * i);
            let mut acc: [[__m256; 2]; NR] =
                std::array::from_fn(|r| [_mm256_loadu_ps(at(r, 0)), _mm256_loadu_ps(at(r, 1))]);
            for j in jb..je {
                let v = [values.load8(j, 2 * c), values.load8(j, 2 * c + 1)];
                for (r, ar) in acc.iter_mut().enumerate() {
                    let pj = _mm256_set1_ps(*p.add(r * rs + j));
                    ar[0] = _mm256_fmadd_ps(pj, v[0], ar[0]);
                    ar[1] = _mm256_fmadd_ps(pj, v[1], ar[1]);
                }
            }
            for (r, ar) in acc.iter().enumerate() {
                _mm256_storeu_ps(at(r, 0), ar[0]);
                _mm256_storeu_ps(at(r, 1), ar[1]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_ring::{KvDtype, KvPool, KvShape, RingMode};

    /// A ring of `n` random K/V rows (sliding, so it wraps and the view has two parts).
    fn ring(hd: usize, n: usize, dtype: KvDtype) -> (std::sync::Arc<KvPool>, kv_ring::KvRing) {
        let pool = KvPool::new(KvShape::new(1, 1, hd, dtype), 1 << 24).unwrap();
        let mut kv = pool.alloc(n - 3, RingMode::Sliding { sinks: 2 }).unwrap();
        for t in 0..n + 5 {
            let k: Vec<f32> = (0..hd)
                .map(|i| ((t * hd + i) as f32 * 0.013).sin() * 2.0)
                .collect();
            let v: Vec<f32> = (0..hd)
                .map(|i| ((t * 7 + i) as f32 * 0.029).cos())
                .collect();
            kv.begin(1).unwrap();
            kv.write_layer(0, &k, &v).unwrap();
            kv.commit().unwrap();
        }
        (pool, kv)
    }

    fn queries(rows: usize, hd: usize, seed: usize) -> Vec<f32> {
        (0..rows * hd)
            .map(|i| ((i * 31 + seed) as f32 * 0.0173).sin() * 1.5)
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// The AVX2 kernel, where this CPU and shape run it (an AVX-512 machine's `attend_rows`
    /// takes its own path, so the tests call this one directly).
    fn avx2_kernel(
        c: Call<'_>,
        scratch: &mut Vec<f32>,
        out: &mut [f32],
        stats: Option<&mut [f32]>,
    ) {
        assert!(avx2_runs(c.hd));
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2, FMA and F16C detected (avx2_runs); shapes as attend_rows checks them
        // (the tests' calls of attend_rows with the same arguments pass those checks).
        unsafe {
            avx2::attend(c, scratch, out, stats);
        }
    }

    fn avx2_runs(hd: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        if hd.is_multiple_of(16) && hd <= avx2::MAX_HD && crate::kernels::has_avx2() {
            return true;
        }
        let _ = hd;
        false
    }

    /// `path` (portable, or the AVX2 kernel where it runs) chunked as `attend_rows_ext`
    /// chunks, over rows `q` seeing keys `first..n_keys` (scale, soft-cap), into a new buffer.
    #[allow(clippy::too_many_arguments)]
    fn on_path(
        path: Kernel,
        q: &[f32],
        n_keys: &[usize],
        first: Option<&[usize]>,
        hd: usize,
        view: &KvView<'_>,
        scale: f32,
        softcap: Option<f32>,
    ) -> Vec<f32> {
        let mut out = vec![0.0; q.len()];
        let c = Call {
            q,
            n_keys,
            first,
            hd,
            view,
            scale,
            softcap,
        };
        chunked(path, c, &mut Vec::new(), &mut out, None);
        out
    }

    /// The AVX2 kernel's output where this CPU and shape run it.
    fn avx2_path(
        q: &[f32],
        nk: &[usize],
        first: Option<&[usize]>,
        hd: usize,
        view: &KvView<'_>,
        scale: f32,
        cap: Option<f32>,
    ) -> Option<Vec<f32>> {
        avx2_runs(hd).then(|| on_path(avx2_kernel, q, nk, first, hd, view, scale, cap))
    }

    #[test]
    fn exp_matches_std() {
        for i in 0..20000 {
            let x = -(i as f32) * 0.0043;
            let (a, b) = (exp_f(x), x.exp());
            assert!((a - b).abs() <= 2e-7 * b + 1e-38, "{x}: {a} vs {b}");
        }
        assert_eq!(exp_f(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f(f32::NAN), 0.0);
        assert_eq!(exp_f(0.0), 1.0);
    }

    /// Every path gives the same bits, and each row's result does not depend on the block it is
    /// computed in (alone, in small groups, in full 16-row blocks).
    /// The KV dtypes a view of rows `hd` wide can have (q8_0, q4_0: whole 32-element blocks).
    fn dtypes(hd: usize) -> Vec<KvDtype> {
        let mut d = vec![KvDtype::F16, KvDtype::F32];
        if hd.is_multiple_of(32) {
            d.extend([KvDtype::Q8_0, KvDtype::Q4_0]);
        }
        d
    }

    /// The AVX-512 query quantizer gives the scalar one's quants, scales and sums bit for bit:
    /// random blocks, an all-zero block, ties (`x * 127 / amax` exactly half-integers), NaN and
    /// infinite elements.
    #[test]
    fn query_quantizers_agree_on_every_input() {
        #[cfg(target_arch = "x86_64")]
        if crate::kernels::has_avx512() {
            let mut x = queries(8, 32, 11);
            x[32..64].fill(0.0);
            for (i, v) in x[64..96].iter_mut().enumerate() {
                *v = if i == 0 { 127.0 } else { i as f32 - 15.5 };
            }
            x[96 + 3] = f32::NAN;
            x[128 + 7] = f32::INFINITY;
            x[160 + 1] = f32::NEG_INFINITY;
            x[160 + 2] = f32::NAN;
            type Quantizer = fn(&[f32], &mut [i8], &mut [f32], &mut [i32]);
            let run = |f: Quantizer| {
                let (mut q, mut d, mut s) = (vec![0i8; 256], vec![0.0f32; 8], vec![0i32; 8]);
                f(&x, &mut q, &mut d, &mut s);
                (q, bits(&d), s)
            };
            // SAFETY: AVX-512 was detected.
            let vector = run(|x, q, d, s| unsafe { avx512::quantize_query(x, q, d, s) });
            let scalar = run(quantize_query);
            assert_eq!(vector, scalar);
            // Ties round to even: 127 / 127 = 1, so x itself is rounded.
            assert_eq!(&scalar.0[65..69], &[-14, -14, -12, -12]);
        }
    }

    #[test]
    fn rows_are_bit_identical_across_paths_and_blockings() {
        for (hd, n) in [(64usize, 53usize), (128, 21), (48, 40), (80, 19), (96, 37)] {
            for dtype in dtypes(hd) {
                let (_pool, kv) = ring(hd, n, dtype);
                let view = kv.view(0, 0).unwrap();
                let len = view.len;
                let rows = 37;
                let q = queries(rows, hd, hd + n);
                let nk: Vec<usize> = (0..rows).map(|r| 1 + (r * 7 + r / 3) % len).collect();
                let mut s = Vec::new();
                let mut all = vec![0.0; rows * hd];
                attend_rows(&q, &nk, hd, &view, 0.125, &mut s, &mut all);
                let port = on_path(portable, &q, &nk, None, hd, &view, 0.125, None);
                assert_eq!(
                    bits(&all),
                    bits(&port),
                    "hd {hd} {dtype:?}: fast vs portable"
                );
                if let Some(a2) = avx2_path(&q, &nk, None, hd, &view, 0.125, None) {
                    assert_eq!(
                        bits(&a2),
                        bits(&port),
                        "hd {hd} {dtype:?}: AVX2 vs portable"
                    );
                }
                for chunk in [1usize, 3, 5, 6, 16] {
                    let mut got = vec![0.0; rows * hd];
                    for r0 in (0..rows).step_by(chunk) {
                        let r1 = (r0 + chunk).min(rows);
                        attend_rows(
                            &q[r0 * hd..r1 * hd],
                            &nk[r0..r1],
                            hd,
                            &view,
                            0.125,
                            &mut s,
                            &mut got[r0 * hd..r1 * hd],
                        );
                    }
                    assert_eq!(bits(&all), bits(&got), "hd {hd} {dtype:?} chunk {chunk}");
                }
            }
        }
    }

    /// Against softmax attention in f64 on the same (f16-rounded) K/V.
    #[test]
    fn matches_f64_reference() {
        let (hd, n) = (64, 300);
        for dtype in dtypes(hd) {
            let (_pool, kv) = ring(hd, n, dtype);
            let view = kv.view(0, 0).unwrap();
            let (keys, values) = (Rows::new(&view.keys), Rows::new(&view.values));
            let rows = 20;
            let q = queries(rows, hd, 5);
            let nk: Vec<usize> = (0..rows).map(|r| view.len - r * 13).collect();
            let mut out = vec![0.0; rows * hd];
            attend_rows(&q, &nk, hd, &view, 0.125, &mut Vec::new(), &mut out);
            for (r, &n) in nk.iter().enumerate() {
                let qr = ref_query(&q[r * hd..][..hd], &keys);
                let s: Vec<f64> = (0..n)
                    .map(|j| {
                        (0..hd)
                            .map(|i| qr[i] * f64::from(keys.get(j, hd, i)))
                            .sum::<f64>()
                            * 0.125
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for i in 0..hd {
                    let want: f64 = (0..n)
                        .map(|j| e[j] * f64::from(values.get(j, hd, i)))
                        .sum::<f64>()
                        / z;
                    let got = f64::from(out[r * hd + i]);
                    assert!((got - want).abs() < 2e-5, "row {r} i {i}: {got} vs {want}");
                }
            }
        }
    }

    /// Windows and soft-capping: every path gives the same bits, each row's result does not
    /// depend on its block, and the result is softmax attention over the row's window of
    /// capped scores (f64 reference).
    #[test]
    fn windows_and_softcap_are_exact_and_batch_invariant() {
        for (hd, n) in [(64usize, 70usize), (256, 45), (48, 40), (96, 50)] {
            for dtype in dtypes(hd) {
                let (_pool, kv) = ring(hd, n, dtype);
                let view = kv.view(0, 0).unwrap();
                let len = view.len;
                let rows = 37;
                let q = queries(rows, hd, 3 * hd + n);
                let nk: Vec<usize> = (0..rows).map(|r| 1 + (r * 7 + r / 3) % len).collect();
                for (window, cap) in [
                    (Some(5usize), None),
                    (None, Some(2.5f32)),
                    (Some(17), Some(4.0)),
                ] {
                    let first: Vec<usize> = nk
                        .iter()
                        .map(|&k| window.map_or(0, |w| k.saturating_sub(w)))
                        .collect();
                    let fo = window.is_some().then_some(&first[..]);
                    let mut s = Vec::new();
                    let mut all = vec![0.0; rows * hd];
                    attend_rows_ext(&q, &nk, fo, hd, &view, 0.3, cap, &mut s, &mut all, None);
                    let port = on_path(portable, &q, &nk, fo, hd, &view, 0.3, cap);
                    let what = format!("hd {hd} {dtype:?} window {window:?} cap {cap:?}");
                    assert_eq!(bits(&all), bits(&port), "{what}: fast vs portable");
                    if let Some(a2) = avx2_path(&q, &nk, fo, hd, &view, 0.3, cap) {
                        assert_eq!(bits(&a2), bits(&port), "{what}: AVX2 vs portable");
                    }
                    for chunk in [1usize, 4, 16] {
                        let mut got = vec![0.0; rows * hd];
                        for r0 in (0..rows).step_by(chunk) {
                            let r1 = (r0 + chunk).min(rows);
                            attend_rows_ext(
                                &q[r0 * hd..r1 * hd],
                                &nk[r0..r1],
                                fo.map(|f| &f[r0..r1]),
                                hd,
                                &view,
                                0.3,
                                cap,
                                &mut s,
                                &mut got[r0 * hd..r1 * hd],
                                None,
                            );
                        }
                        assert_eq!(bits(&all), bits(&got), "{what}: chunk {chunk}");
                    }
                    for r in 0..rows {
                        let (want, _, _) =
                            reference(&q[r * hd..][..hd], &view, first[r], nk[r], 0.3, cap);
                        for (i, (&got, want)) in all[r * hd..][..hd].iter().zip(want).enumerate() {
                            let got = f64::from(got);
                            assert!(
                                (got - want).abs() < 3e-5,
                                "{what} row {r} i {i}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Softmax attention in f64 of one query row over keys `first..n` of the view (scores
    /// `scale`d, then soft-capped): the output, the maximum score and the sum of `exp(s - max)`.
    /// The query a reference multiplies with `keys`: `q` itself, or for q8_0 keys the query as
    /// the kernels use it (quantized per block, [`quantize_query`]), dequantized exactly.
    fn ref_query(q: &[f32], keys: &Rows<'_>) -> Vec<f64> {
        if !matches!(keys, Rows::Q8(_)) {
            return q.iter().map(|&x| f64::from(x)).collect();
        }
        let hd = q.len();
        let (mut qi, mut qd, mut sum) = (vec![0i8; hd], vec![0.0f32; hd / QB], vec![0; hd / QB]);
        quantize_query(q, &mut qi, &mut qd, &mut sum);
        (0..hd)
            .map(|i| f64::from(qi[i]) * f64::from(qd[i / QB]))
            .collect()
    }

    fn reference(
        q: &[f32],
        view: &KvView<'_>,
        first: usize,
        n: usize,
        scale: f32,
        cap: Option<f32>,
    ) -> (Vec<f64>, f64, f64) {
        let hd = q.len();
        let (keys, values) = (Rows::new(&view.keys), Rows::new(&view.values));
        let q = ref_query(q, &keys);
        let sc: Vec<f64> = (first..n)
            .map(|j| {
                let x = (0..hd)
                    .map(|i| q[i] * f64::from(keys.get(j, hd, i)))
                    .sum::<f64>()
                    * f64::from(scale);
                cap.map_or(x, |c| f64::from(c) * (x / f64::from(c)).tanh())
            })
            .collect();
        let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = e.iter().sum();
        let out = (0..hd)
            .map(|i| {
                (first..n)
                    .map(|j| e[j - first] * f64::from(values.get(j, hd, i)))
                    .sum::<f64>()
                    / z
            })
            .collect();
        (out, m, z)
    }

    /// Rows over more than KEY_CHUNK keys (counts on both sides of chunk boundaries, windows
    /// longer and shorter than a chunk, soft-capping): every path gives the same bits, a row's
    /// result does not depend on the rows beside it, the chunks of each row computed one call
    /// at a time (with their softmax statistics) and merged in order by `merge_chunk` (what the
    /// model's split decode tasks do) give the same bits and statistics, and the result is
    /// softmax attention (f64 reference, statistics included).
    #[test]
    fn long_rows_are_chunked_exactly_on_every_path() {
        for (hd, n) in [(64usize, 1400usize), (128, 1100)] {
            for dtype in dtypes(hd) {
                let (_pool, kv) = ring(hd, n, dtype);
                let view = kv.view(0, 0).unwrap();
                let len = view.len;
                let nk = [
                    1,
                    300,
                    511,
                    512,
                    513,
                    700,
                    1024,
                    1025,
                    len - 1,
                    len,
                    len - 200,
                    1030,
                ];
                let rows = nk.len();
                let q = queries(rows, hd, 11 + hd);
                for (window, cap) in [(None, None), (Some(600), Some(3.0f32)), (Some(1030), None)] {
                    let what = format!("hd {hd} {dtype:?} window {window:?} cap {cap:?}");
                    let first: Vec<usize> = nk
                        .iter()
                        .map(|&k| window.map_or(0, |w| k.saturating_sub(w)))
                        .collect();
                    let fo = window.is_some().then_some(&first[..]);
                    let mut s = Vec::new();
                    let (mut all, mut stats) = (vec![0.0; rows * hd], vec![0.0; 2 * rows]);
                    #[rustfmt::skip]
                    attend_rows_ext(&q, &nk, fo, hd, &view, 0.3, cap, &mut s, &mut all, Some(&mut stats));
                    let port = on_path(portable, &q, &nk, fo, hd, &view, 0.3, cap);
                    assert_eq!(bits(&all), bits(&port), "{what}: fast vs portable");
                    if let Some(a2) = avx2_path(&q, &nk, fo, hd, &view, 0.3, cap) {
                        assert_eq!(bits(&a2), bits(&port), "{what}: AVX2 vs portable");
                    }
                    for r in 0..rows {
                        let qr = &q[r * hd..][..hd];
                        let (f, n) = (first[r], nk[r]);
                        // Alone.
                        let mut alone = vec![0.0; hd];
                        #[rustfmt::skip]
                        attend_rows_ext(qr, &[n], Some(&[f]), hd, &view, 0.3, cap, &mut s, &mut alone, None);
                        assert_eq!(bits(&alone), bits(&all[r * hd..][..hd]), "{what} row {r}");
                        // Split: one call per chunk, merged in order.
                        let (mut o, mut st) = (vec![0.0; hd], [0.0f32; 2]);
                        for k in 0.. {
                            let Some((cf, cn)) = key_chunk(f, n, k) else {
                                break;
                            };
                            assert!(cn - cf <= KEY_CHUNK);
                            let (mut oc, mut sc) = (vec![0.0; hd], [0.0f32; 2]);
                            #[rustfmt::skip]
                            attend_rows_ext(qr, &[cn], Some(&[cf]), hd, &view, 0.3, cap, &mut s, &mut oc, Some(&mut sc));
                            merge_chunk(&mut o, &mut st, &oc, &sc);
                        }
                        assert_eq!(bits(&o), bits(&all[r * hd..][..hd]), "{what} row {r} split");
                        assert_eq!(bits(&st), bits(&stats[2 * r..2 * r + 2]), "{what} row {r}");
                        let (want, m, z) = reference(qr, &view, f, n, 0.3, cap);
                        for (i, (&got, want)) in all[r * hd..][..hd].iter().zip(want).enumerate() {
                            let got = f64::from(got);
                            assert!(
                                (got - want).abs() < 3e-5,
                                "{what} row {r} i {i}: {got} vs {want}"
                            );
                        }
                        // The merged statistics describe the whole row's softmax.
                        assert!((f64::from(st[0]) - m).abs() < 1e-5, "{what} row {r} max");
                        assert!(
                            (f64::from(st[1]) - z).abs() < 1e-5 * z,
                            "{what} row {r} sum"
                        );
                    }
                }
            }
        }
    }
}
