//! Portable kernels. Same quantities as the SIMD backends (integer block dot products against the
//! q8 activations, scales applied in f32), in plain Rust.

use std::ops::Range;

use super::act::{ActQuad, quads_per_token};
use super::format::{self, Fmt, decode_sub, subs_per_block};
use super::{RowsOut, WeightMatrix};

/// Tokens handled per pass over a row (accumulators on the stack).
const TILE: usize = 8;

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
    let mut q = [0u8; 32];
    for r in rows {
        let row = &w.data[r * rb..(r + 1) * rb];
        for t0 in (0..n).step_by(TILE) {
            let tn = TILE.min(n - t0);
            let mut acc = [0.0f32; TILE];
            for (bi, blk) in row.chunks_exact(bb).enumerate() {
                for sb in 0..spb {
                    let sub = decode_sub(fmt, blk, sb, &mut q);
                    let b = bi * spb + sb; // global 32-block index
                    let l = b % 4;
                    for (ti, a) in acc.iter_mut().enumerate().take(tn) {
                        let aq = &acts[(t0 + ti) * nq + b / 4];
                        let (mut i0, mut i1) = (0i32, 0i32);
                        for e in 0..16 {
                            i0 += i32::from(q[e]) * i32::from(aq.q(l, e));
                            i1 += i32::from(q[e + 16]) * i32::from(aq.q(l, e + 16));
                        }
                        i0 -= sub.c * aq.sq0[4 * l];
                        i1 -= sub.c * aq.sq1[4 * l];
                        let dx = aq.dx[4 * l];
                        if fmt == Fmt::Q6K {
                            *a += (sub.s[0] * dx) * i0 as f32;
                            *a += (sub.s[1] * dx) * i1 as f32;
                        } else {
                            *a += (sub.s[0] * dx) * (i0 + i1) as f32;
                            *a += sub.m * aq.sx[4 * l];
                        }
                    }
                }
            }
            for (ti, a) in acc.iter().enumerate().take(tn) {
                out.set(t0 + ti, r, *a);
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
