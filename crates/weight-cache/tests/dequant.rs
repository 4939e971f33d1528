//! Reference dequantization against hand-built blocks with known values, an element-wise
//! restatement of each k-quant layout, and quantize/dequantize round trips.

use half::{bf16, f16};
use weight_cache::quant::{
    BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K, BlockQ8_0, QK_K,
    scale_min_k4,
};
use weight_cache::{DequantError, GgmlType, QuantizeError, dequantize, quantize};

fn deq(t: GgmlType, src: &[u8], n: usize) -> Vec<f32> {
    let mut y = vec![f32::NAN; n];
    dequantize(t, src, &mut y).unwrap();
    y
}

/// xorshift64*, deterministic test data without a rand dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn bytes<const N: usize>(&mut self) -> [u8; N] {
        std::array::from_fn(|_| self.next() as u8)
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

#[test]
fn plain_types() {
    let x = [1.5f32, -2.25, 0.0, 65504.0];
    let f32b: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(deq(GgmlType::F32, &f32b, 4), x);
    let f16b: Vec<u8> = x
        .iter()
        .flat_map(|v| f16::from_f32(*v).to_le_bytes())
        .collect();
    assert_eq!(deq(GgmlType::F16, &f16b, 4), x);
    // bf16 0x3FC0 = 1.5, 0xC010 = -2.25.
    let bf = [0xC0u8, 0x3F, 0x10, 0xC0];
    assert_eq!(deq(GgmlType::BF16, &bf, 2), [1.5, -2.25]);
    assert_eq!(bf16::from_f32(1.5).to_bits(), 0x3FC0);
}

#[test]
fn q4_0_known_values() {
    let b = BlockQ4_0 {
        d: f16::from_f32(0.5),
        qs: std::array::from_fn(|j| j as u8 | ((15 - j as u8) << 4)),
    };
    let y = deq(GgmlType::Q4_0, bytemuck::bytes_of(&b), 32);
    for j in 0..16 {
        assert_eq!(y[j], (j as f32 - 8.0) * 0.5);
        assert_eq!(y[j + 16], (7.0 - j as f32) * 0.5);
    }
}

#[test]
fn q4_1_known_values() {
    let b = BlockQ4_1 {
        d: f16::from_f32(0.25),
        m: f16::from_f32(-1.0),
        qs: std::array::from_fn(|j| j as u8 | ((15 - j as u8) << 4)),
    };
    let y = deq(GgmlType::Q4_1, bytemuck::bytes_of(&b), 32);
    for j in 0..16 {
        assert_eq!(y[j], j as f32 * 0.25 - 1.0);
        assert_eq!(y[j + 16], (15 - j) as f32 * 0.25 - 1.0);
    }
}

#[test]
fn q5_0_known_values() {
    // High bits set only for the second half: y[j] = j - 16, y[j + 16] = (j | 16) - 16 = j.
    let b = BlockQ5_0 {
        d: f16::from_f32(1.0),
        qh: 0xFFFF_0000u32.to_le_bytes(),
        qs: std::array::from_fn(|j| j as u8 | ((j as u8) << 4)),
    };
    let y = deq(GgmlType::Q5_0, bytemuck::bytes_of(&b), 32);
    for j in 0..16 {
        assert_eq!(y[j], j as f32 - 16.0);
        assert_eq!(y[j + 16], j as f32);
    }
}

#[test]
fn q5_1_known_values() {
    let b = BlockQ5_1 {
        d: f16::from_f32(2.0),
        m: f16::from_f32(1.0),
        qh: 0x0000_FFFFu32.to_le_bytes(),
        qs: std::array::from_fn(|j| j as u8 | ((j as u8) << 4)),
    };
    let y = deq(GgmlType::Q5_1, bytemuck::bytes_of(&b), 32);
    for j in 0..16 {
        assert_eq!(y[j], (j | 16) as f32 * 2.0 + 1.0);
        assert_eq!(y[j + 16], j as f32 * 2.0 + 1.0);
    }
}

#[test]
fn q8_0_known_values() {
    let b = BlockQ8_0 {
        d: f16::from_f32(0.5),
        qs: std::array::from_fn(|j| j as i8 - 16),
    };
    let y = deq(GgmlType::Q8_0, bytemuck::bytes_of(&b), 32);
    for (j, v) in y.iter().enumerate() {
        assert_eq!(*v, (j as f32 - 16.0) * 0.5);
    }
}

/// ggml's packing of 6-bit scales and mins (from `quantize_row_q4_K_ref`).
fn pack_scales(sc: [u8; 8], m: [u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            s[j] = sc[j];
            s[j + 4] = m[j];
        } else {
            s[j + 4] = (sc[j] & 0xF) | ((m[j] & 0xF) << 4);
            s[j - 4] |= (sc[j] >> 4) << 6;
            s[j] |= (m[j] >> 4) << 6;
        }
    }
    s
}

#[test]
fn k4_scales_round_trip() {
    let mut rng = Rng(7);
    for _ in 0..200 {
        let sc: [u8; 8] = std::array::from_fn(|_| rng.next() as u8 & 63);
        let m: [u8; 8] = std::array::from_fn(|_| rng.next() as u8 & 63);
        let packed = pack_scales(sc, m);
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &packed), (sc[j], m[j]));
        }
    }
}

#[test]
fn q4_k_matches_elementwise_layout() {
    let mut rng = Rng(11);
    for _ in 0..20 {
        let sc: [u8; 8] = std::array::from_fn(|_| rng.next() as u8 & 63);
        let m: [u8; 8] = std::array::from_fn(|_| rng.next() as u8 & 63);
        let b = BlockQ4K {
            d: f16::from_f32(rng.f32() * 0.1),
            dmin: f16::from_f32(rng.f32() * 0.1),
            scales: pack_scales(sc, m),
            qs: rng.bytes(),
        };
        let y = deq(GgmlType::Q4_K, bytemuck::bytes_of(&b), QK_K);
        for (i, v) in y.iter().enumerate() {
            let s = i / 32;
            let byte = b.qs[(s / 2) * 32 + i % 32];
            let q = if s % 2 == 0 { byte & 0xF } else { byte >> 4 };
            let want =
                b.d.to_f32() * f32::from(sc[s]) * f32::from(q) - b.dmin.to_f32() * f32::from(m[s]);
            assert_eq!(*v, want, "weight {i}");
        }
    }
}

#[test]
fn q5_k_matches_elementwise_layout() {
    let mut rng = Rng(13);
    for _ in 0..20 {
        let sc: [u8; 8] = std::array::from_fn(|_| rng.next() as u8 & 63);
        let m: [u8; 8] = std::array::from_fn(|_| rng.next() as u8 & 63);
        let b = BlockQ5K {
            d: f16::from_f32(rng.f32() * 0.1),
            dmin: f16::from_f32(rng.f32() * 0.1),
            scales: pack_scales(sc, m),
            qh: rng.bytes(),
            qs: rng.bytes(),
        };
        let y = deq(GgmlType::Q5_K, bytemuck::bytes_of(&b), QK_K);
        for (i, v) in y.iter().enumerate() {
            let s = i / 32;
            let byte = b.qs[(s / 2) * 32 + i % 32];
            let lo = if s % 2 == 0 { byte & 0xF } else { byte >> 4 };
            let hi = (b.qh[i % 32] >> s) & 1;
            let q = lo | (hi << 4);
            let want =
                b.d.to_f32() * f32::from(sc[s]) * f32::from(q) - b.dmin.to_f32() * f32::from(m[s]);
            assert_eq!(*v, want, "weight {i}");
        }
    }
}

#[test]
fn q6_k_matches_elementwise_layout() {
    let mut rng = Rng(17);
    for _ in 0..20 {
        let b = BlockQ6K {
            ql: rng.bytes(),
            qh: rng.bytes(),
            scales: rng.bytes::<16>().map(|v| v as i8),
            d: f16::from_f32(rng.f32() * 0.01),
        };
        let y = deq(GgmlType::Q6_K, bytemuck::bytes_of(&b), QK_K);
        for (i, v) in y.iter().enumerate() {
            let (n, r) = (i / 128, i % 128);
            let (k, l) = (r / 32, r % 32);
            let qlb = b.ql[n * 64 + l + (k & 1) * 32];
            let lo = if k < 2 { qlb & 0xF } else { qlb >> 4 };
            let hi = (b.qh[n * 32 + l] >> (2 * k)) & 3;
            let q = i32::from(lo | (hi << 4)) - 32;
            let sc = b.scales[n * 8 + l / 16 + 2 * k];
            let want = b.d.to_f32() * f32::from(sc) * q as f32;
            assert_eq!(*v, want, "weight {i}");
        }
    }
}

#[test]
fn round_trips_stay_within_half_a_step() {
    let mut rng = Rng(3);
    let x: Vec<f32> = (0..32 * 64).map(|_| rng.f32() * 3.0).collect();
    for (t, levels) in [
        (GgmlType::Q8_0, 254.0),
        (GgmlType::Q4_0, 15.0),
        (GgmlType::Q4_1, 15.0),
        (GgmlType::Q5_0, 31.0),
        (GgmlType::Q5_1, 31.0),
    ] {
        let q = quantize(t, &x).unwrap();
        assert_eq!(q.len(), t.row_bytes(x.len()).unwrap());
        let y = deq(t, &q, x.len());
        for (xb, yb) in x.chunks(32).zip(y.chunks(32)) {
            let (lo, hi) = xb
                .iter()
                .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
            let range = if matches!(t, GgmlType::Q4_1 | GgmlType::Q5_1) {
                hi - lo
            } else {
                2.0 * lo.abs().max(hi.abs())
            };
            // Half a quantization step, plus slack for the f16 scale/min and the asymmetric
            // signed range of Q4_0/Q5_0 (one extra step at the clamped end).
            let tol = range / levels * 1.01 + 1e-3;
            for (a, b) in xb.iter().zip(yb) {
                assert!((a - b).abs() <= tol, "{t}: {a} vs {b} (tol {tol})");
            }
        }
        // Re-quantizing the dequantized values is stable for the symmetric 8-bit type.
        if t == GgmlType::Q8_0 {
            assert_eq!(quantize(t, &y).unwrap(), q);
        }
    }
    for t in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        let y = deq(t, &quantize(t, &x).unwrap(), x.len());
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= a.abs() / 128.0 + 1e-6);
        }
    }
}

#[test]
fn zero_block_quantizes_to_zeros() {
    let x = [0.0f32; 32];
    for t in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1] {
        assert_eq!(deq(t, &quantize(t, &x).unwrap(), 32), x);
    }
}

#[test]
fn errors() {
    let mut y = [0.0f32; 31];
    assert!(matches!(
        dequantize(GgmlType::Q4_0, &[0; 18], &mut y),
        Err(DequantError::NotBlockMultiple {
            n: 31,
            block_size: 32,
            ..
        })
    ));
    let mut y = [0.0f32; 32];
    assert!(matches!(
        dequantize(GgmlType::Q4_0, &[0; 17], &mut y),
        Err(DequantError::LengthMismatch {
            expected: 18,
            got: 17,
            ..
        })
    ));
    assert!(matches!(
        dequantize(GgmlType::IQ2_XXS, &[], &mut []),
        Err(DequantError::Unsupported { .. })
    ));
    assert!(matches!(
        quantize(GgmlType::Q4_K, &[0.0; 256]),
        Err(QuantizeError::Unsupported { .. })
    ));
    assert!(matches!(
        quantize(GgmlType::Q8_0, &[0.0; 33]),
        Err(QuantizeError::NotBlockMultiple { .. })
    ));
}

/// Hex string to bytes.
fn unhex(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

/// Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, IQ4_NL and IQ4_XS blocks decode to exactly the f32 bits of the
/// `gguf` PyPI package's numpy dequantizers (fixture: `scripts/fixtures/weight-cache-quant-reference.py`).
#[test]
fn new_formats_match_gguf_package_bit_for_bit() {
    let fx: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/quant-reference.json")).unwrap();
    let mut seen = Vec::new();
    for b in fx["blocks"].as_array().unwrap() {
        let name = b["dtype"].as_str().unwrap();
        let t = *GgmlType::ALL
            .iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
            .unwrap();
        let bytes = unhex(b["hex"].as_str().unwrap());
        let want: Vec<u32> = unhex(b["f32_bits_hex"].as_str().unwrap())
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(want.len() * t.type_size(), bytes.len() * t.block_size());
        let mut got = vec![f32::NAN; want.len()];
        dequantize(t, &bytes, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                *w,
                "{t} value {i}: {g} vs gguf {}",
                f32::from_bits(*w)
            );
        }
        // Unaligned source bytes decode the same.
        let mut shifted = vec![0u8; bytes.len() + 1];
        shifted[1..].copy_from_slice(&bytes);
        let mut again = vec![f32::NAN; want.len()];
        dequantize(t, &shifted[1..], &mut again).unwrap();
        assert!(
            got.iter()
                .zip(&again)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
        seen.push(t);
    }
    for t in [
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q5_K,
        GgmlType::IQ4_NL,
        GgmlType::IQ4_XS,
    ] {
        assert!(seen.contains(&t), "fixture lacks {t}");
    }
}

/// A block whose f16 scale is NaN or infinite decodes (to NaN/Inf values) without panicking.
#[test]
fn non_finite_scales_do_not_panic() {
    for t in GgmlType::ALL.iter().copied().filter(|t| t.can_dequantize()) {
        for bits in [0x7E00u16, 0x7C00, 0xFC00] {
            let mut block = vec![0x5Au8; t.type_size()];
            // Every even offset as a scale: the f16 fields of any layout get the value.
            for c in block.chunks_exact_mut(2) {
                c.copy_from_slice(&bits.to_le_bytes());
            }
            let mut out = vec![0.0f32; t.block_size()];
            dequantize(t, &block, &mut out).unwrap();
        }
    }
}
