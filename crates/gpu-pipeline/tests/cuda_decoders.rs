//! The CUDA kernels' weight decoders, checked without a GPU: the plain-C part of
//! `src/executor/cuda/kernels.cu` (between its `BEGIN/END HOST-TESTABLE DECODERS` markers, the
//! `dequant32` that every `matmul_*` and `embed_*` kernel reads its weights with) is compiled by
//! the host's C compiler (`$CC`, else `cc`, the linker Rust itself uses) with host versions of the
//! byte and f16 loads and no contraction of multiply-adds, run on random blocks of every format the
//! CPU kernels take, and its output compared bit for bit with weight-cache's dequantization. On
//! the device NVRTC may fuse `scale * q + min` into one FMA, so there it is the same formula, not
//! always the same bits; `tests/cuda.rs` compares whole forward passes on a GPU.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use half::{bf16, f16};
use weight_cache::GgmlType;

#[path = "../benches/support/synthetic.rs"]
mod synthetic;
use synthetic::Rng;

const KERNELS: &str = include_str!("../src/executor/cuda/kernels.cu");

/// What the kernels' part needs from outside it, for the host: the integer types, the CUDA
/// qualifiers as nothing, and the loads (the device's `f16_bits_to_f32` is a `cvt` instruction;
/// here an exact conversion of the bits).
const HOST_PRELUDE: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
#define __device__
#define __constant__
#define __forceinline__ static inline
static inline float bits_f32(u32 b) { float f; memcpy(&f, &b, 4); return f; }
static inline u16 load_u16(const u8* p) { return (u16)((u32)p[0] | ((u32)p[1] << 8)); }
static inline float load_f16(const u8* p) {
    u32 h = load_u16(p), sign = (h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023, bits;
    if (e == 0 && m == 0) {
        bits = sign;
    } else if (e == 0) {
        u32 shifts = 0;
        while (!(m & 1024)) { m <<= 1; shifts++; }
        bits = sign | ((113 - shifts) << 23) | ((m & 1023) << 13);
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13);
    } else {
        bits = sign | ((e + 112) << 23) | (m << 13);
    }
    return bits_f32(bits);
}
static inline float load_bf16(const u8* p) { return bits_f32((u32)load_u16(p) << 16); }
static inline float load_f32(const u8* p) {
    return bits_f32((u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24));
}
"#;

/// Reads `rows` rows of format `fmt` (`cols` elements, `row_bytes` bytes each) from stdin and
/// writes their elements, decoded 32 at a time by `dequant32`, to stdout as f32.
const HOST_MAIN: &str = r#"
int main(int argc, char** argv) {
    if (argc != 5) return 2;
    int fmt = atoi(argv[1]);
    u32 cols = (u32)atoi(argv[2]), rows = (u32)atoi(argv[3]), row_bytes = (u32)atoi(argv[4]);
    u8* data = malloc((size_t)rows * row_bytes + 1);
    if (fread(data, 1, (size_t)rows * row_bytes, stdin) != (size_t)rows * row_bytes) return 3;
    float out[32];
    for (u32 r = 0; r < rows; r++) {
        for (u32 b = 0; b * 32 < cols; b++) {
            dequant32(fmt, data + (size_t)r * row_bytes, b, cols, out);
            u32 n = cols - b * 32 < 32 ? cols - b * 32 : 32;
            fwrite(out, 4, n, stdout);
        }
    }
    return 0;
}
"#;

/// The formats, with the kernels' `FMT_*` number of each, and the byte offsets of each block's
/// f16 scale fields (set to finite values in the test data: random bytes there would make some
/// whole blocks infinite or NaN, which checks nothing).
const FORMATS: [(GgmlType, u32, &[usize]); 15] = [
    (GgmlType::F32, 0, &[]),
    (GgmlType::F16, 1, &[]),
    (GgmlType::BF16, 2, &[]),
    (GgmlType::Q4_0, 3, &[0]),
    (GgmlType::Q4_1, 4, &[0, 2]),
    (GgmlType::Q8_0, 5, &[0]),
    (GgmlType::Q5_0, 6, &[0]),
    (GgmlType::Q5_1, 7, &[0, 2]),
    (GgmlType::Q2_K, 8, &[80, 82]),
    (GgmlType::Q3_K, 9, &[108]),
    (GgmlType::Q4_K, 10, &[0, 2]),
    (GgmlType::Q5_K, 11, &[0, 2]),
    (GgmlType::Q6_K, 12, &[208]),
    (GgmlType::IQ4_NL, 13, &[0]),
    (GgmlType::IQ4_XS, 14, &[0]),
];

/// A finite value of magnitude about 2^-12..2^3 (zero one time in 16), either sign.
fn scale(rng: &mut Rng) -> f32 {
    let r = rng.next();
    if r.is_multiple_of(16) {
        return 0.0;
    }
    let mag = ((r >> 8) % 1000) as f32 / 1000.0 + 0.5;
    let exp = ((r >> 20) % 16) as i32 - 12;
    let v = mag * 2f32.powi(exp);
    if r >> 40 & 1 == 1 { -v } else { v }
}

/// `rows` random rows of `cols` elements of `dtype`.
fn random_rows(
    rng: &mut Rng,
    dtype: GgmlType,
    scales: &[usize],
    rows: usize,
    cols: usize,
) -> Vec<u8> {
    let n = rows * cols;
    match dtype {
        GgmlType::F32 => (0..n).flat_map(|_| scale(rng).to_le_bytes()).collect(),
        GgmlType::F16 => (0..n)
            .flat_map(|_| f16::from_f32(scale(rng)).to_le_bytes())
            .collect(),
        GgmlType::BF16 => (0..n)
            .flat_map(|_| bf16::from_f32(scale(rng)).to_le_bytes())
            .collect(),
        _ => {
            let bytes = dtype.row_bytes(cols).unwrap() * rows;
            let mut data: Vec<u8> = (0..bytes).map(|_| rng.next() as u8).collect();
            for blk in data.chunks_exact_mut(dtype.type_size()) {
                for &at in scales {
                    blk[at..at + 2].copy_from_slice(&f16::from_f32(scale(rng)).to_le_bytes());
                }
            }
            data
        }
    }
}

/// Compiles the kernels' decoders for the host (once per test process).
fn host_decoder() -> PathBuf {
    static BIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        let begin = KERNELS
            .find("// BEGIN HOST-TESTABLE DECODERS")
            .expect("kernels.cu has the begin marker");
        let end = KERNELS
            .find("// END HOST-TESTABLE DECODERS")
            .expect("kernels.cu has the end marker");
        let dir =
            std::env::temp_dir().join(format!("zerolayer-cuda-decoders-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("decoders.c");
        let bin = dir.join("decoders");
        std::fs::write(
            &src,
            format!("{HOST_PRELUDE}{}{HOST_MAIN}", &KERNELS[begin..end]),
        )
        .unwrap();
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let out = Command::new(&cc)
            .args([
                "-std=c99",
                "-O2",
                "-ffp-contract=off",
                "-Wall",
                "-Werror",
                "-o",
            ])
            .arg(&bin)
            .arg(&src)
            .output()
            .unwrap_or_else(|e| panic!("the C compiler `{cc}` does not run: {e}"));
        assert!(
            out.status.success(),
            "the kernels' decoders do not compile as C:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        bin
    })
    .clone()
}

/// The host-compiled `dequant32` over `rows` rows of `data`.
fn decode_on_host(code: u32, data: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let row_bytes = data.len() / rows;
    let mut child = Command::new(host_decoder())
        .args([code, cols as u32, rows as u32, row_bytes as u32].map(|v| v.to_string()))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(data).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "decoder exited with {}", out.status);
    out.stdout
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn every_format_decodes_as_weight_cache_dequantizes_bit_for_bit() {
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    for (dtype, code, scales) in FORMATS {
        // Float rows also of a length that ends inside a 32-element block.
        let lengths: &[usize] = if dtype.block_size() == 1 {
            &[512, 70]
        } else {
            &[512]
        };
        for &cols in lengths {
            let rows = 16;
            let data = random_rows(&mut rng, dtype, scales, rows, cols);
            let mut want = vec![0f32; rows * cols];
            let rb = data.len() / rows;
            for (r, w) in want.chunks_exact_mut(cols).enumerate() {
                weight_cache::dequantize(dtype, &data[r * rb..(r + 1) * rb], w).unwrap();
            }
            let got = decode_on_host(code, &data, rows, cols);
            assert_eq!(got.len(), want.len(), "{dtype:?}");
            assert!(want.iter().all(|v| v.is_finite()), "{dtype:?}: test data");
            assert!(want.iter().any(|&v| v != 0.0), "{dtype:?}: test data");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{dtype:?}, {cols} columns: element {} of row {}: {g} against weight-cache's {w}",
                    i % cols,
                    i / cols
                );
            }
        }
    }
}

/// The decoders are checked against something that can fail: a Q4_K row whose sub-block scale
/// bits are changed decodes differently.
#[test]
fn a_changed_scale_byte_changes_the_decoded_row() {
    let mut rng = Rng(7);
    let (dtype, code, scales) = FORMATS[10];
    assert_eq!(dtype, GgmlType::Q4_K);
    let mut data = random_rows(&mut rng, dtype, scales, 1, 256);
    data[4] = 0x3F;
    let before = decode_on_host(code, &data, 1, 256);
    data[4] = 0x01;
    let after = decode_on_host(code, &data, 1, 256);
    assert_ne!(before[..32], after[..32]);
    assert_eq!(before[32..], after[32..]);
}
