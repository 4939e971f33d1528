//! Portable kernels. Same quantities as the SIMD backends (integer block dot products against the
//! q8 activations, scales applied in f32), in plain Rust.

use std::ops::Range;

use super::act::{ActQuad, quads_per_token};
use super::format::{self, Fmt, decode_sub, subs_per_block};
use super::{RowsOut, WeightMatrix};

/// Tokens handled per pass over a row (accumulators on the stack).
const TILE: usize = 8;

/// Products of rows `rows` with the `n` quantized tokens, with exactly the arithmetic of the
/// AVX-512 kernels (so that every backend gives the same bits): per 32-element block, the exact
/// integer dot product (two, of 16 elements each, for the split formats), offset by
/// `offset * sum(q_x)`, converted to f32 and added with one fused multiply-add by
/// `scale_w * d_x`; the formats with mins then add `min_w * (d_x * sum(q_x))` (split: one fused
/// multiply-add `sum(q_x half) * (min_w half * d_x)` per half). Blocks go into four chains by
/// block index modulo 4, in increasing order, and the chains are summed as
/// `(c0 + c2) + (c1 + c3)`.
#[inline(always)]
pub(crate) fn quant_rows(
    fmt: Fmt,
    w: WeightMatrix<'_>,
    acts: &[ActQuad],
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
) {
    let rb = fmt.row_bytes(w.cols);
    let bb = fmt.block_bytes();
    let spb = subs_per_block(fmt);
    let nq = quads_per_token(w.cols);
    let split = fmt.is_split();
    let mut quants = [0u8; 32];
    for r in rows {
        let row = &w.data[r * rb..(r + 1) * rb];
        for t0 in (0..n).step_by(TILE) {
            let tn = TILE.min(n - t0);
            let mut chains = [[0.0f32; 4]; TILE];
            for (bi, blk) in row.chunks_exact(bb).enumerate() {
                for sb in 0..spb {
                    let sub = decode_sub(fmt, blk, sb, &mut quants);
                    let b = bi * spb + sb; // global 32-block index
                    let l = b % 4;
                    for (ti, chain) in chains.iter_mut().enumerate().take(tn) {
                        let aq = &acts[(t0 + ti) * nq + b / 4];
                        let (mut dot0, mut dot1) = (0i32, 0i32);
                        for e in 0..16 {
                            dot0 += i32::from(quants[e]) * i32::from(aq.q(l, e));
                            dot1 += i32::from(quants[e + 16]) * i32::from(aq.q(l, e + 16));
                        }
                        let dx = aq.dx[4 * l];
                        let acc = &mut chain[l];
                        if split {
                            let (sq0, sq1) = (aq.sq0[4 * l], aq.sq1[4 * l]);
                            let i0 = dot0 - sub.offset * sq0;
                            let i1 = dot1 - sub.offset * sq1;
                            *acc = (i0 as f32).mul_add(sub.scale[0] * dx, *acc);
                            *acc = (i1 as f32).mul_add(sub.scale[1] * dx, *acc);
                            if let Some(min) = sub.min {
                                *acc = (sq0 as f32).mul_add(min[0] * dx, *acc);
                                *acc = (sq1 as f32).mul_add(min[1] * dx, *acc);
                            }
                        } else {
                            let i = dot0 + dot1 - sub.offset * aq.sq[4 * l];
                            *acc = (i as f32).mul_add(sub.scale[0] * dx, *acc);
                            if let Some(min) = sub.min {
                                *acc = min[0].mul_add(aq.sx[4 * l], *acc);
                            }
                        }
                    }
                }
            }
            for (ti, c) in chains.iter().enumerate().take(tn) {
                out.set(t0 + ti, r, (c[0] + c[2]) + (c[1] + c[3]));
            }
        }
    }
}

pub(crate) fn float_rows(
    fmt: Fmt,
    w: WeightMatrix<'_>,
    x: &[f32],
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
) {
    let rb = fmt.row_bytes(w.cols);
    let mut wrow = vec![0.0f32; w.cols];
    for r in rows {
        format::dequantize_row(fmt, &w.data[r * rb..(r + 1) * rb], &mut wrow);
        for t in 0..n {
            let xt = &x[t * w.cols..(t + 1) * w.cols];
            // 8 partial sums, combined pairwise at the end: a fixed order for every n.
            let mut acc = [0.0f32; 8];
            let mut wc = wrow.chunks_exact(8);
            let mut xc = xt.chunks_exact(8);
            for (wv, xv) in (&mut wc).zip(&mut xc) {
                for k in 0..8 {
                    acc[k] += wv[k] * xv[k];
                }
            }
            for (k, (wv, xv)) in wc.remainder().iter().zip(xc.remainder()).enumerate() {
                acc[k] += wv * xv;
            }
            let s =
                ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
            out.set(t, r, s);
        }
    }
}
