//! Kernel correctness: every backend against an f64 reference built on weight-cache's scalar
//! dequantization, batch invariance, and input validation.
//!
//! Tolerance. For float weights the only error is f32 accumulation: `|y - ref| <= 2e-5 * sum|w x|
//! + 1e-6`. For the integer-quantized formats the activations are rounded to q8 per 32-element
//! block (`|x - d q| <= d / 2`, `d = max|x_block| / 127`), so the stated bound is
//! `sum_blocks(sum|w| * d / 2) * 1.001 + 2e-5 * sum|w x| + 1e-6` (rigorous up to f32 rounding).

use gpu_pipeline::ThreadPool;
use gpu_pipeline::kernels::{
    CpuIsa, GgmlType, KernelError, Layout, PackedWeights, Product, WeightMatrix, dequantize_row,
    matmul, matmul_batch, matmul_many, matmul_split_parts, matmul_with, matvec,
};
use half::f16;
use proptest::prelude::*;

const DTYPES: [GgmlType; 15] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q5_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
];

/// The integer-quantized formats.
const QUANT_DTYPES: [GgmlType; 12] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q5_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
];

/// Byte offsets of a block's f16 scale fields (ggml-common.h layouts).
fn scale_offsets(dtype: GgmlType) -> &'static [usize] {
    match dtype {
        GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::Q5_0 | GgmlType::IQ4_NL => &[0],
        GgmlType::IQ4_XS => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        _ => unreachable!(),
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

fn put_f16(b: &mut [u8], off: usize, v: f32) {
    b[off..off + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// Random weights: random quant bytes with sane (finite, small) f16 scales.
fn random_weights(dtype: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let rb = dtype.row_bytes(cols).unwrap();
    match dtype {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            let v: Vec<f32> = (0..rows * cols).map(|_| rng.unit()).collect();
            weight_cache::quantize(dtype, &v).unwrap()
        }
        _ => {
            let mut data: Vec<u8> = (0..rows * rb).map(|_| rng.next() as u8).collect();
            let bs = dtype.type_size();
            for blk in data.chunks_exact_mut(bs) {
                for (i, &off) in scale_offsets(dtype).iter().enumerate() {
                    // Scale, then minimum (or the k-quants' dmin).
                    let range = match (dtype, i) {
                        (GgmlType::Q6_K | GgmlType::Q3_K | GgmlType::IQ4_XS, _) => 0.01,
                        (_, 0) => 0.05,
                        _ => 0.1,
                    };
                    put_f16(blk, off, rng.unit() * range);
                }
            }
            data
        }
    }
}

fn random_acts(n: usize, cols: usize, rng: &mut Rng) -> Vec<f32> {
    // Mixed magnitudes per block, some exact zeros, to exercise the q8 scales.
    (0..n * cols)
        .map(|i| {
            let scale = [1.0, 0.01, 5.0, 0.0][(i / 32 + i / 97) % 4];
            rng.unit() * scale
        })
        .collect()
}

fn is_quant(dtype: GgmlType) -> bool {
    !matches!(dtype, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// Checks `y` (n x rows) against the f64 reference with the module's stated tolerance.
fn check_against_reference(
    dtype: GgmlType,
    rows: usize,
    cols: usize,
    data: &[u8],
    x: &[f32],
    y: &[f32],
    what: &str,
) {
    let mut wf = vec![0.0f32; rows * cols];
    weight_cache::dequantize(dtype, data, &mut wf).unwrap();
    let n = x.len() / cols;
    for t in 0..n {
        let xt = &x[t * cols..(t + 1) * cols];
        for r in 0..rows {
            let wr = &wf[r * cols..(r + 1) * cols];
            let exact: f64 = wr
                .iter()
                .zip(xt)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum();
            let mag: f64 = wr
                .iter()
                .zip(xt)
                .map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs())
                .sum();
            let mut tol = 2e-5 * mag + 1e-6;
            if is_quant(dtype) {
                for (wb, xb) in wr.chunks(32).zip(xt.chunks(32)) {
                    let amax = xb.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs())));
                    let sw: f64 = wb.iter().map(|v| f64::from(v.abs())).sum();
                    tol += 1.001 * sw * amax / 127.0 / 2.0;
                }
            }
            let got = f64::from(y[t * rows + r]);
            assert!(
                (got - exact).abs() <= tol,
                "{what} {}: {rows}x{cols} token {t} row {r}: got {got}, reference {exact}, tolerance {tol}",
                dtype.name()
            );
        }
    }
}

/// A random `rows x cols` matrix of `dtype` and `n` tokens of activations, from `seed`.
fn random_case(
    dtype: GgmlType,
    rows: usize,
    cols: usize,
    n: usize,
    seed: u64,
) -> (Vec<u8>, Vec<f32>) {
    let mut rng = Rng(seed | 1);
    let data = random_weights(dtype, rows, cols, &mut rng);
    (data, random_acts(n, cols, &mut rng))
}

fn cols_for(dtype: GgmlType, units: usize) -> usize {
    match dtype {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => units * 7 + 1,
        GgmlType::Q4_K
        | GgmlType::Q6_K
        | GgmlType::Q2_K
        | GgmlType::Q3_K
        | GgmlType::Q5_K
        | GgmlType::IQ4_XS => 256 * (1 + units % 3),
        _ => 32 * units,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Every backend, every dtype, odd sizes: matches the f64 reference within the bound.
    #[test]
    fn matmul_matches_f64_reference(
        dt in 0usize..15, rows in 1usize..40, units in 1usize..11, n in 1usize..40, seed in any::<u64>(),
    ) {
        let dtype = DTYPES[dt];
        let cols = cols_for(dtype, units);
        let mut rng = Rng(seed | 1);
        let data = random_weights(dtype, rows, cols, &mut rng);
        let x = random_acts(n, cols, &mut rng);
        let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
        let pool = ThreadPool::new(2);
        for backend in CpuIsa::available() {
            let mut y = vec![f32::NAN; n * rows];
            matmul_with(backend, w, &x, n, &mut y, &pool).unwrap();
            check_against_reference(dtype, rows, cols, &data, &x, &y, &format!("{backend:?}"));
        }
    }

    /// Row i of matmul equals matvec of token i bit for bit, for any n and thread count.
    #[test]
    fn matmul_is_batch_invariant(
        dt in 0usize..15, rows in 1usize..70, units in 1usize..8, n in 1usize..40, seed in any::<u64>(),
    ) {
        let dtype = DTYPES[dt];
        let cols = cols_for(dtype, units);
        let mut rng = Rng(seed | 1);
        let data = random_weights(dtype, rows, cols, &mut rng);
        let x = random_acts(n, cols, &mut rng);
        let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
        let pools = [ThreadPool::new(1), ThreadPool::new(3)];
        for backend in CpuIsa::available() {
            let mut ys = Vec::new();
            for pool in &pools {
                let mut y = vec![0.0f32; n * rows];
                matmul_with(backend, w, &x, n, &mut y, pool).unwrap();
                ys.push(y);
                // Also a prefix batch: the first tokens must not depend on the batch size.
                let m = n.div_ceil(2);
                let mut yp = vec![0.0f32; m * rows];
                matmul_with(backend, w, &x[..m * cols], m, &mut yp, pool).unwrap();
                ys.push(yp.iter().copied().chain(ys[ys.len() - 1][m * rows..].iter().copied()).collect());
            }
            for t in 0..n {
                let mut yv = vec![0.0f32; rows];
                matmul_with(backend, w, &x[t * cols..(t + 1) * cols], 1, &mut yv, &pools[1]).unwrap();
                for y in &ys {
                    for r in 0..rows {
                        prop_assert_eq!(y[t * rows + r].to_bits(), yv[r].to_bits(),
                            "{:?} {} token {} row {}", backend, dtype.name(), t, r);
                    }
                }
            }
        }
    }

    /// `dequantize_row` equals weight-cache's reference dequantization bit for bit.
    #[test]
    fn dequantize_row_matches_reference(dt in 0usize..15, rows in 1usize..5, units in 1usize..6, seed in any::<u64>()) {
        let dtype = DTYPES[dt];
        let cols = cols_for(dtype, units);
        let mut rng = Rng(seed | 1);
        let data = random_weights(dtype, rows, cols, &mut rng);
        let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
        let mut want = vec![0.0f32; rows * cols];
        weight_cache::dequantize(dtype, &data, &mut want).unwrap();
        let mut got = vec![0.0f32; cols];
        for r in 0..rows {
            dequantize_row(w, r, &mut got).unwrap();
            for c in 0..cols {
                prop_assert_eq!(got[c].to_bits(), want[r * cols + c].to_bits(), "{} row {} col {}", dtype.name(), r, c);
            }
        }
    }
}

#[test]
fn default_model_shapes_all_backends() {
    let pool = ThreadPool::new(2);
    let mut rng = Rng(42);
    for dtype in [
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::F16,
    ] {
        for (rows, cols) in [(576, 576), (1536, 576), (576, 1536)] {
            if dtype.row_bytes(cols).is_none() {
                continue; // k-quants need 256-column rows
            }
            let data = random_weights(dtype, rows, cols, &mut rng);
            let x = random_acts(3, cols, &mut rng);
            let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
            for backend in CpuIsa::available() {
                let mut y = vec![0.0f32; 3 * rows];
                matmul_with(backend, w, &x, 3, &mut y, &pool).unwrap();
                check_against_reference(dtype, rows, cols, &data, &x, &y, &format!("{backend:?}"));
            }
        }
    }
}

#[test]
fn real_model_tensors() {
    let path =
        weight_cache::locate_default_model().expect("default model (run scripts/fetch-model)");
    // SAFETY: the model file is not modified while the test runs.
    let gguf = unsafe { weight_cache::Gguf::open(&path) }.unwrap();
    let pool = ThreadPool::global();
    let mut rng = Rng(7);
    for name in [
        "blk.0.attn_q.weight",
        "blk.3.ffn_down.weight",
        "token_embd.weight",
    ] {
        let t = gguf.tensor(name).unwrap();
        let full = WeightMatrix::from_tensor(&t).unwrap();
        // At most 256 rows, to keep the f64 reference quick.
        let rows = full.rows.min(256);
        let w = WeightMatrix::new(
            full.dtype,
            rows,
            full.cols,
            &full.data[..rows * full.row_bytes()],
        )
        .unwrap();
        let x = random_acts(2, w.cols, &mut rng);
        let mut y = vec![0.0f32; 2 * rows];
        matmul(w, &x, 2, &mut y, pool).unwrap();
        check_against_reference(w.dtype, rows, w.cols, w.data, &x, &y, name);
    }
}

/// Batches past one token chunk of the many-token kernel (and with ragged last chunks and tiles)
/// give each token the bits it gets alone.
#[test]
fn large_batches_are_batch_invariant() {
    let mut rng = Rng(0x5EED);
    let pool = ThreadPool::new(2);
    for dtype in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::IQ4_NL,
    ] {
        let (rows, cols) = (37, 96);
        let data = random_weights(dtype, rows, cols, &mut rng);
        let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
        for n in [129usize, 263, 300] {
            let x = random_acts(n, cols, &mut rng);
            let mut y = vec![0.0f32; n * rows];
            matmul(w, &x, n, &mut y, &pool).unwrap();
            for t in 0..n {
                let mut yv = vec![0.0f32; rows];
                matvec(w, &x[t * cols..(t + 1) * cols], &mut yv, &pool).unwrap();
                let got: Vec<u32> = y[t * rows..(t + 1) * rows]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                let want: Vec<u32> = yv.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, want, "{} n {n} token {t}", dtype.name());
            }
        }
    }
}

/// Many-token products of the 256-element formats over long rows (several token chunks of the
/// 4-row kernel's decoded path, ragged last chunk) give each token the bits it gets alone, on
/// every backend.
#[test]
fn long_rows_many_tokens_are_batch_invariant() {
    let mut rng = Rng(0x10C);
    let pool = ThreadPool::new(2);
    for dtype in [GgmlType::Q4_K, GgmlType::Q2_K, GgmlType::IQ4_XS] {
        let (rows, cols, n) = (7, 8192, 21);
        let data = random_weights(dtype, rows, cols, &mut rng);
        let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
        let x = random_acts(n, cols, &mut rng);
        for backend in CpuIsa::available() {
            let mut y = vec![0.0f32; n * rows];
            matmul_with(backend, w, &x, n, &mut y, &pool).unwrap();
            for t in 0..n {
                let mut yv = vec![0.0f32; rows];
                matmul_with(backend, w, &x[t * cols..(t + 1) * cols], 1, &mut yv, &pool).unwrap();
                let same = yv
                    .iter()
                    .zip(&y[t * rows..(t + 1) * rows])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{backend:?} {} token {t}", dtype.name());
            }
            if backend == CpuIsa::Scalar {
                check_against_reference(dtype, rows, cols, &data, &x, &y, "Scalar");
            }
        }
    }
}

#[test]
fn rejects_bad_shapes() {
    let pool = ThreadPool::new(1);
    let data = vec![0u8; 2 * 20 * 2];
    assert!(matches!(
        WeightMatrix::new(GgmlType::Q4_1, 2, 48, &data),
        Err(KernelError::ColsNotBlockAligned {
            cols: 48,
            block: 32,
            ..
        })
    ));
    assert!(matches!(
        WeightMatrix::new(GgmlType::Q4_1, 3, 64, &data),
        Err(KernelError::DataLength {
            expected: 120,
            actual: 80,
            ..
        })
    ));
    assert!(matches!(
        WeightMatrix::new(GgmlType::IQ2_XXS, 1, 256, &[0u8; 66]),
        Err(KernelError::UnsupportedDtype {
            dtype: GgmlType::IQ2_XXS
        })
    ));
    let w = WeightMatrix::new(GgmlType::Q4_1, 2, 64, &data).unwrap();
    let mut y = [0.0f32; 2];
    assert_eq!(
        matvec(w, &[0.0; 63], &mut y, &pool),
        Err(KernelError::InputLength {
            expected: 64,
            actual: 63
        })
    );
    assert_eq!(
        matvec(w, &[0.0; 64], &mut y[..1], &pool),
        Err(KernelError::OutputLength {
            expected: 2,
            actual: 1
        })
    );
    assert_eq!(
        matmul(w, &[0.0; 128], 2, &mut y, &pool),
        Err(KernelError::OutputLength {
            expected: 4,
            actual: 2
        })
    );
    let mut row = [0.0f32; 64];
    assert_eq!(
        dequantize_row(w, 2, &mut row),
        Err(KernelError::RowOutOfRange { row: 2, rows: 2 })
    );
    // Zero tokens and zero rows are no-ops.
    matmul(w, &[], 0, &mut [], &pool).unwrap();
    let empty = WeightMatrix::new(GgmlType::Q4_1, 0, 64, &[]).unwrap();
    matvec(empty, &[0.0; 64], &mut [], &pool).unwrap();
}

/// `matmul_many` equals one `matmul` per matrix bit for bit, at batch sizes on both sides of the
/// panel kernel's threshold, and rejects mismatched outputs.
#[test]
fn matmul_many_equals_separate_products() {
    let mut rng = Rng(0x5eed);
    let pool = ThreadPool::new(2);
    for dtype in [
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q6_K,
        GgmlType::F16,
    ] {
        let cols = cols_for(dtype, 3);
        let shapes = [37usize, 16, 5];
        let datas: Vec<Vec<u8>> = shapes
            .iter()
            .map(|&r| random_weights(dtype, r, cols, &mut rng))
            .collect();
        let ws: Vec<WeightMatrix<'_>> = shapes
            .iter()
            .zip(&datas)
            .map(|(&r, d)| WeightMatrix::new(dtype, r, cols, d).unwrap())
            .collect();
        for n in [1usize, 3, 16, 41] {
            let x = random_acts(n, cols, &mut rng);
            let mut many: Vec<Vec<f32>> = shapes.iter().map(|&r| vec![f32::NAN; n * r]).collect();
            let mut outs: Vec<&mut [f32]> = many.iter_mut().map(|v| &mut v[..]).collect();
            matmul_many(&ws, &x, n, &mut outs, &pool).unwrap();
            for (w, got) in ws.iter().zip(&many) {
                let mut want = vec![0.0f32; n * w.rows];
                matmul(*w, &x, n, &mut want, &pool).unwrap();
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{} n {n} rows {}", dtype.name(), w.rows);
            }
        }
    }
    let d = random_weights(GgmlType::Q4_1, 4, 32, &mut rng);
    let w = WeightMatrix::new(GgmlType::Q4_1, 4, 32, &d).unwrap();
    let err = matmul_many(&[w, w], &[0.0; 32], 1, &mut [&mut [0.0f32; 4][..]], &pool);
    assert!(matches!(
        err,
        Err(KernelError::OutputCount {
            matrices: 2,
            outputs: 1
        })
    ));
}

/// `matmul_batch` (a mixture of experts' layer: products over their own runs of one input, in
/// one pool call) gives each product exactly `matmul`'s bits over its tokens: mixed formats,
/// packed and file layouts, token runs on both sides of the panel kernel's threshold, empty runs,
/// more products than fit on the stack; and overlapping outputs are refused.
#[test]
fn matmul_batch_equals_separate_products() {
    let mut rng = Rng(0xba7c4);
    let pool = ThreadPool::new(2);
    let cols = 256;
    let dtypes = [
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        GgmlType::Q6_K,
        GgmlType::F16,
    ];
    let rows = [40usize, 16, 33, 96, 8, 12];
    let datas: Vec<Vec<u8>> = dtypes
        .iter()
        .zip(rows)
        .map(|(&d, r)| random_weights(d, r, cols, &mut rng))
        .collect();
    let files: Vec<WeightMatrix<'_>> = dtypes
        .iter()
        .zip(rows)
        .zip(&datas)
        .map(|((&d, r), data)| WeightMatrix::new(d, r, cols, data).unwrap())
        .collect();
    let packed: Vec<PackedWeights> = files
        .iter()
        .filter_map(|w| PackedWeights::pack(*w, &pool).unwrap())
        .collect();
    let tokens = 60;
    let x = random_acts(tokens, cols, &mut rng);
    // (matrix, first token, tokens): runs of 1, 2, 0, 17 and 40 tokens, overlapping inputs.
    let runs = [
        (0usize, 0usize, 1usize),
        (1, 1, 2),
        (2, 3, 0),
        (3, 3, 17),
        (4, 20, 40),
    ];
    for quant_only in [true, false] {
        for with_packed in [false, true] {
            let mats: Vec<WeightMatrix<'_>> = files
                .iter()
                .copied()
                .chain(packed.iter().filter(|_| with_packed).map(|p| p.matrix()))
                .filter(|w| !quant_only || w.dtype != GgmlType::F16)
                .collect();
            // Every run on every matrix, repeated past the 32 products described on the stack.
            let mut products = Vec::new();
            let mut out = 0;
            for rep in 0..if quant_only { 3 } else { 1 } {
                for (i, w) in mats.iter().enumerate() {
                    let (_, first, n) = runs[(i + rep) % runs.len()];
                    products.push(Product {
                        w: *w,
                        first,
                        n,
                        out,
                    });
                    out += n * w.rows;
                }
            }
            let mut y = vec![f32::NAN; out + 5];
            matmul_batch(&products, &x, cols, &mut y, &pool).unwrap();
            for p in &products {
                let mut want = vec![0.0f32; p.n * p.w.rows];
                let xs = &x[p.first * cols..(p.first + p.n) * cols];
                matmul(p.w, xs, p.n, &mut want, &pool).unwrap();
                let got = &y[p.out..p.out + want.len()];
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{} {:?} n {}", p.w.dtype.name(), p.w.layout, p.n);
            }
            // Nothing past the products' outputs is written.
            assert!(y[out..].iter().all(|v| v.is_nan()));
        }
    }
    let w = files[0];
    let p = |out| Product {
        w,
        first: 0,
        n: 1,
        out,
    };
    let mut y = vec![0.0f32; 2 * w.rows];
    let err = matmul_batch(&[p(0), p(w.rows - 1)], &x, cols, &mut y, &pool);
    assert!(matches!(err, Err(KernelError::OverlappingOutputs { .. })));
    let err = matmul_batch(&[p(w.rows + 1)], &x, cols, &mut y, &pool);
    assert!(matches!(err, Err(KernelError::OutputLength { .. })));
    let far = Product {
        w,
        first: tokens,
        n: 1,
        out: 0,
    };
    let err = matmul_batch(&[far], &x, cols, &mut y, &pool);
    assert!(matches!(err, Err(KernelError::InputLength { .. })));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Every SIMD backend gives the scalar reference's bits, for every integer-quantized format,
    /// odd row counts, several column counts and batch sizes on both sides of the panel kernel's
    /// threshold.
    #[test]
    fn simd_backends_equal_scalar_bit_for_bit(
        dt in 0usize..12, rows in 1usize..40, units in 1usize..11, n in 1usize..24, seed in any::<u64>(),
    ) {
        let dtype = QUANT_DTYPES[dt];
        let cols = cols_for(dtype, units);
        let mut rng = Rng(seed | 1);
        let data = random_weights(dtype, rows, cols, &mut rng);
        let x = random_acts(n, cols, &mut rng);
        let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
        let pool = ThreadPool::new(2);
        let mut want = vec![0.0f32; n * rows];
        matmul_with(CpuIsa::Scalar, w, &x, n, &mut want, &pool).unwrap();
        for backend in CpuIsa::available() {
            let mut y = vec![f32::NAN; n * rows];
            matmul_with(backend, w, &x, n, &mut y, &pool).unwrap();
            for (i, (g, r)) in y.iter().zip(&want).enumerate() {
                prop_assert_eq!(g.to_bits(), r.to_bits(), "{:?} {} {}x{} n {} output {}: {} vs scalar {}",
                    backend, dtype.name(), rows, cols, n, i, g, r);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Float weights: every SIMD backend gives the same bits (the AVX-512 many-token tiles and
    /// the AVX2 kernels run the same per-output sequence), for row counts off the 4-row tiles,
    /// token counts off the 4-token tiles, and column counts with and without a 16-column tail.
    #[test]
    fn float_simd_backends_equal_each_other(
        dt in 0usize..3, rows in 1usize..70, chunks in 1usize..40, tail in prop_oneof![Just(0usize), 1usize..16],
        n in 1usize..40, seed in any::<u64>(),
    ) {
        let dtype = DTYPES[dt];
        let cols = 16 * chunks + tail;
        let mut rng = Rng(seed | 1);
        let data = random_weights(dtype, rows, cols, &mut rng);
        let x = random_acts(n, cols, &mut rng);
        let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
        let pool = ThreadPool::new(2);
        let simd: Vec<CpuIsa> = CpuIsa::available().into_iter().filter(|b| *b != CpuIsa::Scalar).collect();
        let mut want = None;
        for backend in simd {
            let mut y = vec![f32::NAN; n * rows];
            matmul_with(backend, w, &x, n, &mut y, &pool).unwrap();
            let bits: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
            match &want {
                None => want = Some((backend, bits)),
                Some((first, wb)) => {
                    for (i, (g, r)) in bits.iter().zip(wb).enumerate() {
                        prop_assert_eq!(g, r, "{:?} vs {:?} {} {}x{} n {} output {}", backend, first,
                            dtype.name(), rows, cols, n, i);
                    }
                }
            }
        }
    }
}

/// The K-quants, whose panel kernel (many tokens) unpacks 256-element super-blocks.
const K_DTYPES: [GgmlType; 6] = [
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::Q5_K,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::IQ4_XS,
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The many-token (panel) kernel of the K-quants gives the scalar reference's bits, and each
    /// token the bits the single-token (4-row) kernel gives it alone: row counts that leave a
    /// partial 16-row panel, 1 to 4 super-blocks per row, token counts around the panel
    /// threshold (16), one token chunk (128) and two, 1 and 2 threads.
    #[test]
    fn k_quant_panel_equals_scalar_and_single_token(
        dt in 0usize..6, rows in 1usize..70, supers in 1usize..5,
        n in prop_oneof![14usize..20, 124usize..136, 250usize..262],
        threads in 1usize..3, seed in any::<u64>(),
    ) {
        let dtype = K_DTYPES[dt];
        let cols = 256 * supers;
        let pool = ThreadPool::new(threads);
        let mut rng = Rng(seed | 1);
        let data = random_weights(dtype, rows, cols, &mut rng);
        let x = random_acts(n, cols, &mut rng);
        let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let mut want = vec![0.0f32; n * rows];
        matmul_with(CpuIsa::Scalar, w, &x, n, &mut want, &pool).unwrap();
        let mut y = vec![f32::NAN; n * rows];
        matmul(w, &x, n, &mut y, &pool).unwrap();
        prop_assert_eq!(bits(&y), bits(&want), "{} {}x{} n {}", dtype.name(), rows, cols, n);
        for t in [0, n / 2, n - 1] {
            let mut yt = vec![f32::NAN; rows];
            matvec(w, &x[t * cols..(t + 1) * cols], &mut yt, &pool).unwrap();
            prop_assert_eq!(bits(&yt), bits(&y[t * rows..(t + 1) * rows]), "{} token {}", dtype.name(), t);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Packed weights (the row-interleaved layout) give the scalar reference's bits for every
    /// packable format: ragged row groups, column counts that leave a partial quad of blocks,
    /// token counts on every tile size and across the token chunk, 1 and 2 threads, alone and
    /// grouped with another packed matrix; and their rows dequantize to the file's values.
    #[test]
    fn packed_weights_equal_scalar_bit_for_bit(
        dt in 0usize..12, rows in 1usize..70, units in 1usize..24, n in prop_oneof![1usize..20, 60usize..70, 120usize..140],
        threads in 1usize..3, seed in any::<u64>(),
    ) {
        let dtype = QUANT_DTYPES[dt];
        let k_quant = dtype.block_size() == 256;
        // K-quants: 1 to 3 super-blocks per row.
        let cols = if k_quant { 256 * (1 + units % 3) } else { 32 * units };
        let pool = ThreadPool::new(threads);
        let mut rng = Rng(seed | 1);
        let data = random_weights(dtype, rows, cols, &mut rng);
        let data2 = random_weights(dtype, 7, cols, &mut rng);
        let x = random_acts(n, cols, &mut rng);
        let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
        let w2 = WeightMatrix::new(dtype, 7, cols, &data2).unwrap();
        let Some(p) = PackedWeights::pack(w, &pool).unwrap() else {
            // Every packable format has an AVX-512 and an AVX2 kernel.
            prop_assert_eq!(CpuIsa::detect(), CpuIsa::Scalar);
            return Ok(());
        };
        let p2 = PackedWeights::pack(w2, &pool).unwrap().unwrap();
        prop_assert_eq!(p.matrix().layout, Layout::Rows16);
        let (mut got, mut file) = (vec![f32::NAN; cols], vec![f32::NAN; cols]);
        for row in [0, rows / 2, rows - 1] {
            p.dequantize_row(row, &mut got).unwrap();
            dequantize_row(w, row, &mut file).unwrap();
            prop_assert_eq!(got.iter().map(|f| f.to_bits()).collect::<Vec<_>>(),
                file.iter().map(|f| f.to_bits()).collect::<Vec<_>>(), "row {}", row);
        }
        let mut want = vec![0.0f32; n * rows];
        matmul_with(CpuIsa::Scalar, w, &x, n, &mut want, &pool).unwrap();
        let mut want2 = vec![0.0f32; n * 7];
        matmul_with(CpuIsa::Scalar, w2, &x, n, &mut want2, &pool).unwrap();
        let mut y = vec![f32::NAN; n * rows];
        matmul(p.matrix(), &x, n, &mut y, &pool).unwrap();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(&y), bits(&want), "{} {}x{} n {}", dtype.name(), rows, cols, n);
        let (mut ya, mut yb) = (vec![f32::NAN; n * rows], vec![f32::NAN; n * 7]);
        matmul_many(&[p.matrix(), p2.matrix()], &x, n, &mut [&mut ya[..], &mut yb[..]], &pool).unwrap();
        prop_assert_eq!(bits(&ya), bits(&want));
        prop_assert_eq!(bits(&yb), bits(&want2));
        // Every SIMD backend here reads the layout (AVX2 as well as AVX-512 on a Zen 4).
        for backend in CpuIsa::available().into_iter().filter(|&b| b != CpuIsa::Scalar) {
            let mut yk = vec![f32::NAN; n * rows];
            matmul_with(backend, p.matrix(), &x, n, &mut yk, &pool).unwrap();
            prop_assert_eq!(bits(&yk), bits(&want), "{:?} {} {}x{} n {}", backend, dtype.name(), rows, cols, n);
        }
    }
}

/// A random `rows x cols` matrix of `dtype` times `n` random tokens on every SIMD backend, file
/// layout and packed, against the scalar reference's bits; with `matvec_last`, also the last
/// token's row against its matvec.
fn check_against_scalar(
    dtype: GgmlType,
    (rows, cols, n): (usize, usize, usize),
    threads: usize,
    seed: u64,
    matvec_last: bool,
) -> Result<(), TestCaseError> {
    let pool = ThreadPool::new(threads);
    let (data, x) = random_case(dtype, rows, cols, n, seed);
    let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
    let mut want = vec![0.0f32; n * rows];
    matmul_with(CpuIsa::Scalar, w, &x, n, &mut want, &pool).unwrap();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let packed = PackedWeights::pack(w, &pool).unwrap();
    for m in std::iter::once(w).chain(packed.as_ref().map(|p| p.matrix())) {
        for backend in CpuIsa::available()
            .into_iter()
            .filter(|&b| b != CpuIsa::Scalar)
        {
            let mut y = vec![f32::NAN; n * rows];
            matmul_with(backend, m, &x, n, &mut y, &pool).unwrap();
            prop_assert_eq!(
                bits(&y),
                bits(&want),
                "{:?} {} {:?} {}x{} n {}",
                backend,
                dtype.name(),
                m.layout,
                rows,
                cols,
                n
            );
        }
        if matvec_last {
            let mut one = vec![0.0f32; rows];
            matvec(m, &x[(n - 1) * cols..], &mut one, &pool).unwrap();
            prop_assert_eq!(
                bits(&one),
                bits(&want[(n - 1) * rows..]),
                "{} {:?} matvec",
                dtype.name(),
                m.layout
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Tasks of 32 rows and more, where the AVX-512 panel kernel multiplies two 16-row panels
    /// at a time (smaller matrices get 16-row tasks: one panel): every integer-quantized format,
    /// file layout and packed, ragged row counts (an odd last panel, a partial one), token counts
    /// on every tile size of both kernels, 1 and 2 threads: the scalar reference's bits.
    #[test]
    fn panel_pairs_equal_scalar_bit_for_bit(
        dt in 0usize..12, rows in 257usize..340, units in 1usize..4, n in 16usize..40,
        threads in 1usize..3, seed in any::<u64>(),
    ) {
        let dtype = QUANT_DTYPES[dt];
        check_against_scalar(dtype, (rows, cols_for(dtype, units), n), threads, seed, false)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Rows of 8448-10496 columns (an 8B model's down projection is 14336; the panel kernel's
    /// panels are then a large share of L2, and a future column slicing must keep these bits):
    /// every integer-quantized format, file layout and packed, one and two panels per task,
    /// token counts on several tile sizes, 1 and 2 threads: the scalar reference's bits, and
    /// the last token's row of the product equals its matvec.
    #[test]
    fn wide_rows_equal_scalar_bit_for_bit(
        dt in 0usize..12, rows in 17usize..40, supers in 33usize..42, n in 16usize..23,
        threads in 1usize..3, seed in any::<u64>(),
    ) {
        check_against_scalar(QUANT_DTYPES[dt], (rows, 256 * supers, n), threads, seed, true)?;
    }
}

/// The residual of 8-bit activation quantization computed here, independently of the kernels:
/// per 32-element block `x - round(x / d) * d` with `d = max|x| / 127`.
fn residual(x: &[f32]) -> Vec<f32> {
    let mut lo = Vec::new();
    for b in x.chunks(32) {
        let d = b.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        lo.extend(b.iter().map(|&v| v - (v * id).round_ties_even() * d));
    }
    lo
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// `matmul_split_parts` (each token quantized once and its residual computed from those
    /// quants, on the fly) gives `matmul(w, x)` and `matmul(w, residual(x))`, bit for bit
    /// (floats: the product and zeros): every format, file layout and packed, token counts on
    /// both sides of the parallel quantization and the panel kernel, 1 and 2 threads; and the
    /// parts' sum is closer to the f64 product than the plain 8-bit product.
    #[test]
    fn matmul_split_parts_equals_the_product_and_the_residual_product(
        dt in 0usize..15, rows in 1usize..40, units in 1usize..6, n in prop_oneof![1usize..12, 16usize..40],
        threads in 1usize..3, seed in any::<u64>(),
    ) {
        let dtype = DTYPES[dt];
        let cols = cols_for(dtype, units);
        let pool = ThreadPool::new(threads);
        let (data, x) = random_case(dtype, rows, cols, n, seed);
        let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
        let lo = residual(&x);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let packed = PackedWeights::pack(w, &pool).unwrap();
        for m in std::iter::once(w).chain(packed.as_ref().map(|p| p.matrix())) {
            let mut want = vec![0.0f32; 2 * n * rows];
            matmul(m, &x, n, &mut want[..n * rows], &pool).unwrap();
            if is_quant(dtype) {
                matmul(m, &lo, n, &mut want[n * rows..], &pool).unwrap();
            }
            let mut got = vec![f32::NAN; 2 * n * rows];
            matmul_split_parts(m, &x, n, &mut got, &pool).unwrap();
            prop_assert_eq!(bits(&got), bits(&want), "{} {:?} {}x{} n {}", dtype.name(), m.layout, rows, cols, n);
        }
        if is_quant(dtype) {
            let mut y = vec![0.0f32; 2 * n * rows];
            matmul_split_parts(w, &x, n, &mut y, &pool).unwrap();
            let mut plain = vec![0.0f32; n * rows];
            matmul(w, &x, n, &mut plain, &pool).unwrap();
            let (mut wrow, mut e_split, mut e_plain) = (vec![0.0f32; cols], 0.0f64, 0.0f64);
            for r in 0..rows {
                dequantize_row(w, r, &mut wrow).unwrap();
                for t in 0..n {
                    let exact: f64 = wrow.iter().zip(&x[t * cols..(t + 1) * cols])
                        .map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
                    let split = f64::from(y[t * rows + r]) + f64::from(y[(n + t) * rows + r]);
                    e_split += (split - exact).abs();
                    e_plain += (f64::from(plain[t * rows + r]) - exact).abs();
                }
            }
            prop_assert!(e_split <= e_plain * 0.1 + 1e-3, "{}: split {} plain {}", dtype.name(), e_split, e_plain);
        }
    }
}

/// Packing a large matrix reports the source bytes it has read in consecutive ranges of a few
/// MiB that cover the whole matrix, each reported once the groups reading it are packed (the
/// caller drops the file's pages as packing goes), and gives the same bytes as `pack`.
#[test]
fn packing_reports_the_source_it_has_read_in_order() {
    let mut rng = Rng(0xBEEF);
    let pool = ThreadPool::new(2);
    let (rows, cols) = (16 * 1000 + 5, 576);
    let data = random_weights(GgmlType::Q8_0, rows, cols, &mut rng);
    let w = WeightMatrix::new(GgmlType::Q8_0, rows, cols, &data).unwrap();
    let mut ranges = Vec::new();
    let Some(p) = PackedWeights::pack_releasing(w, &pool, &mut |r| ranges.push(r)).unwrap() else {
        assert_eq!(CpuIsa::detect(), CpuIsa::Scalar);
        assert!(ranges.is_empty());
        return;
    };
    assert!(ranges.len() >= 3, "{ranges:?}");
    assert_eq!(ranges[0].start, 0);
    assert_eq!(ranges.last().unwrap().end, data.len());
    for pair in ranges.windows(2) {
        assert_eq!(pair[0].end, pair[1].start);
    }
    assert!(ranges.iter().all(|r| r.len() <= 3 << 20), "{ranges:?}");
    let whole = PackedWeights::pack(w, &pool).unwrap().unwrap();
    assert_eq!(p.matrix().data, whole.matrix().data);
}

/// Packed weights are refused, with a typed error, by backends without their kernel and by row
/// dequantization; formats without a packed layout are not packed.
#[test]
fn packed_weights_layout_errors() {
    let mut rng = Rng(0xFACE);
    let pool = ThreadPool::new(1);
    let data = random_weights(GgmlType::Q4_1, 16, 64, &mut rng);
    let w = WeightMatrix::new(GgmlType::Q4_1, 16, 64, &data).unwrap();
    let k = random_weights(GgmlType::F16, 16, 256, &mut rng);
    let wk = WeightMatrix::new(GgmlType::F16, 16, 256, &k).unwrap();
    assert!(PackedWeights::pack(wk, &pool).unwrap().is_none());
    let Some(p) = PackedWeights::pack(w, &pool).unwrap() else {
        assert_eq!(
            CpuIsa::detect(),
            CpuIsa::Scalar,
            "a SIMD backend here, yet nothing packed"
        );
        return;
    };
    let mut y = [0.0f32; 16];
    let err = matmul_with(CpuIsa::Scalar, p.matrix(), &[0.5; 64], 1, &mut y, &pool).unwrap_err();
    assert!(matches!(
        err,
        KernelError::LayoutUnsupported {
            backend: CpuIsa::Scalar,
            layout: Layout::Rows16,
            ..
        }
    ));
    assert!(dequantize_row(p.matrix(), 0, &mut [0.0; 64]).is_err());
    let mut short = p.matrix();
    short.data = &short.data[..short.data.len() - 1];
    assert!(matches!(
        matvec(short, &[0.5; 64], &mut y, &pool),
        Err(KernelError::DataLength { .. })
    ));
}

/// A block with a NaN or infinite scale (or minimum) neither panics nor hangs, on any backend, in
/// products, batched products and row dequantization (the outputs may be NaN).
#[test]
fn non_finite_scales_do_not_panic() {
    let pool = ThreadPool::new(2);
    let mut rng = Rng(0xBAD);
    for dtype in QUANT_DTYPES {
        let (rows, cols) = (9, cols_for(dtype, 4));
        for bits in [0x7E00u16, 0x7C00, 0xFC00] {
            let mut data = random_weights(dtype, rows, cols, &mut rng);
            for (b, blk) in data.chunks_exact_mut(dtype.type_size()).enumerate() {
                let offs = scale_offsets(dtype);
                let off = offs[b % offs.len()];
                if b % 3 == 0 {
                    blk[off..off + 2].copy_from_slice(&bits.to_le_bytes());
                }
            }
            let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
            for n in [1usize, 20] {
                let x = random_acts(n, cols, &mut rng);
                for backend in CpuIsa::available() {
                    let mut y = vec![0.0f32; n * rows];
                    matmul_with(backend, w, &x, n, &mut y, &pool).unwrap();
                }
            }
            let mut row = vec![0.0f32; cols];
            dequantize_row(w, 0, &mut row).unwrap();
        }
    }
}

/// Deterministic sweep behind the property test: every integer format, odd row counts, 1-3
/// blocks (or super-blocks) per row and token counts on both sides of the panel threshold; every
/// backend gives the scalar bits, and each token of a batch the bits it gets alone.
#[test]
fn every_format_sweep_bit_identical() {
    let pool = ThreadPool::new(2);
    let mut rng = Rng(0xC0FFEE);
    for dtype in QUANT_DTYPES {
        for units in [1usize, 2, 5, 9] {
            let cols = cols_for(dtype, units);
            for rows in [1usize, 7, 33] {
                let data = random_weights(dtype, rows, cols, &mut rng);
                let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
                for n in [1usize, 3, 17] {
                    let x = random_acts(n, cols, &mut rng);
                    let mut want = vec![0.0f32; n * rows];
                    matmul_with(CpuIsa::Scalar, w, &x, n, &mut want, &pool).unwrap();
                    check_against_reference(dtype, rows, cols, &data, &x, &want, "Scalar");
                    for backend in CpuIsa::available() {
                        let mut y = vec![f32::NAN; n * rows];
                        matmul_with(backend, w, &x, n, &mut y, &pool).unwrap();
                        let same = y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{backend:?} {} {rows}x{cols} n {n}", dtype.name());
                        for t in 0..n {
                            let mut yv = vec![0.0f32; rows];
                            let xt = &x[t * cols..(t + 1) * cols];
                            matmul_with(backend, w, xt, 1, &mut yv, &pool).unwrap();
                            let same = yv
                                .iter()
                                .zip(&y[t * rows..(t + 1) * rows])
                                .all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(same, "{backend:?} {} n {n} token {t}", dtype.name());
                        }
                    }
                }
            }
        }
    }
}
