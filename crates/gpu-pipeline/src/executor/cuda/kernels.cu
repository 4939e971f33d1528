// zerolayer's CUDA kernels, compiled at run time with NVRTC (no headers: nothing is #included, so
// the NVRTC wheel alone compiles them). Each kernel mirrors a CPU function named in its comment;
// the arithmetic is the same formula, not the same bits (summation orders differ).
//
// Layouts: activations are row-major f32 `[token][width]`; weights are the GGUF rows as they are
// in the file (`row_bytes` apart); `u32` sizes throughout (the host checks they fit).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float f16_bits_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// GGUF blocks are packed (a Q4_1 block is 20 bytes): read 16-bit fields byte by byte.
__device__ __forceinline__ u16 load_u16(const u8* p) {
    return (u16)((u32)p[0] | ((u32)p[1] << 8));
}

__device__ __forceinline__ float load_f16(const u8* p) { return f16_bits_to_f32(load_u16(p)); }

__device__ __forceinline__ float load_bf16(const u8* p) {
    return __int_as_float((int)((u32)load_u16(p) << 16));
}

__device__ __forceinline__ float load_f32(const u8* p) {
    return __int_as_float((int)((u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24)));
}

// ---- Weight decoding (weight_cache::dequantize) --------------------------------------------
//
// Plain C from here to the end marker: `tests/cuda_decoders.rs` compiles this part with the host's
// C compiler (with host versions of the loads above) and checks every format against
// weight-cache's dequantization bit for bit. NVRTC may fuse a multiply and an add into one FMA:
// on the device the same formula, not always the same bits.
// BEGIN HOST-TESTABLE DECODERS

// The weight formats; the suffixes of the `matmul_*` / `embed_*` kernels (kernels.rs).
#define FMT_F32 0
#define FMT_F16 1
#define FMT_BF16 2
#define FMT_Q4_0 3
#define FMT_Q4_1 4
#define FMT_Q8_0 5
#define FMT_Q5_0 6
#define FMT_Q5_1 7
#define FMT_Q2_K 8
#define FMT_Q3_K 9
#define FMT_Q4_K 10
#define FMT_Q5_K 11
#define FMT_Q6_K 12
#define FMT_IQ4_NL 13
#define FMT_IQ4_XS 14

// weight_cache::quant::KVALUES_IQ4NL.
__constant__ const signed char KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                    1,    13,   25,  38,  53,  69,  89,  113};

// out[e] = scale[e / 16] * v[e] (+ min[e / 16]): weight-cache's `SubBlock::weight`, unfused on
// the host. `v` are the quants minus the format's offset (exact integers).
__device__ __forceinline__ void dq_affine(const int* v, const float* scale, const float* min,
                                          float* out) {
    for (int e = 0; e < 32; e++) {
        const float y = scale[e / 16] * (float)v[e];
        out[e] = min ? y + min[e / 16] : y;
    }
}

// Elements [32 b, 32 b + 32) of one weight row of format `fmt` (`cols` elements) into `out`,
// dequantized as weight_cache::dequantize does. A 256-element format's `b` is sub-block `b % 8`
// of super-block `b / 8`. Float formats give 0 past `cols` (quantized rows are whole blocks).
__device__ __forceinline__ void dequant32(int fmt, const u8* row, u32 b, u32 cols, float* out) {
    int v[32];
    float scale[2], min[2];
    int has_min = 0;
    if (fmt == FMT_F32 || fmt == FMT_F16 || fmt == FMT_BF16) {
        for (u32 i = 0; i < 32; i++) {
            const u32 c = b * 32 + i;
            float x = 0.0f;
            if (c < cols) {
                if (fmt == FMT_F32) {
                    x = load_f32(row + (u64)c * 4);
                } else if (fmt == FMT_F16) {
                    x = load_f16(row + (u64)c * 2);
                } else {
                    x = load_bf16(row + (u64)c * 2);
                }
            }
            out[i] = x;
        }
        return;
    }
    if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1 || fmt == FMT_IQ4_NL) {
        // d (f16), [Q4_1: m (f16)], 16 bytes: element j in the low nibble of byte j, j + 16 in
        // its high nibble.
        const u32 bs = fmt == FMT_Q4_1 ? 20 : 18;
        const u8* blk = row + (u64)b * bs;
        const u8* qs = blk + bs - 16;
        for (int j = 0; j < 16; j++) {
            const int lo = qs[j] & 15, hi = qs[j] >> 4;
            if (fmt == FMT_IQ4_NL) {
                v[j] = KVALUES_IQ4NL[lo];
                v[j + 16] = KVALUES_IQ4NL[hi];
            } else {
                const int off = fmt == FMT_Q4_0 ? 8 : 0;
                v[j] = lo - off;
                v[j + 16] = hi - off;
            }
        }
        scale[0] = scale[1] = load_f16(blk);
        if (fmt == FMT_Q4_1) {
            min[0] = min[1] = load_f16(blk + 2);
            has_min = 1;
        }
    } else if (fmt == FMT_Q5_0 || fmt == FMT_Q5_1) {
        // d, [m], qh (u32: bit e is element e's fifth bit), 16 nibble bytes as Q4_0.
        const u32 bs = fmt == FMT_Q5_1 ? 24 : 22;
        const u8* blk = row + (u64)b * bs;
        const u8* qh = blk + bs - 20;
        const u32 h = (u32)qh[0] | ((u32)qh[1] << 8) | ((u32)qh[2] << 16) | ((u32)qh[3] << 24);
        const u8* qs = blk + bs - 16;
        const int off = fmt == FMT_Q5_0 ? 16 : 0;
        for (int j = 0; j < 16; j++) {
            v[j] = (int)((qs[j] & 15) | (((h >> j) & 1) << 4)) - off;
            v[j + 16] = (int)((qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4)) - off;
        }
        scale[0] = scale[1] = load_f16(blk);
        if (fmt == FMT_Q5_1) {
            min[0] = min[1] = load_f16(blk + 2);
            has_min = 1;
        }
    } else if (fmt == FMT_Q8_0) {
        const u8* blk = row + (u64)b * 34;
        for (int e = 0; e < 32; e++) v[e] = (signed char)blk[2 + e];
        scale[0] = scale[1] = load_f16(blk);
    } else if (fmt == FMT_Q4_K || fmt == FMT_Q5_K) {
        // d, dmin (f16), 12 bytes of 6-bit scales and minimums (ggml's get_scale_min_k4),
        // [Q5_K: qh, 32 bytes: bit s of byte l is element l of sub-block s's fifth bit], qs
        // (128 bytes: sub-block s is the low (s even) or high nibbles of bytes 32 (s / 2) + l).
        const u32 bs = fmt == FMT_Q4_K ? 144 : 176;
        const u32 s = b % 8;
        const u8* blk = row + (u64)(b / 8) * bs;
        const u8* sc = blk + 4;
        const u8* qh = blk + 16;
        const u8* qs = blk + (fmt == FMT_Q4_K ? 16 : 48) + 32 * (s / 2);
        const u32 shift = 4 * (s % 2);
        for (int l = 0; l < 32; l++) {
            int q = (qs[l] >> shift) & 15;
            if (fmt == FMT_Q5_K) q |= ((qh[l] >> s) & 1) << 4;
            v[l] = q;
        }
        int scv, mv;
        if (s < 4) {
            scv = sc[s] & 63;
            mv = sc[s + 4] & 63;
        } else {
            scv = (sc[s + 4] & 15) | ((sc[s - 4] >> 6) << 4);
            mv = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
        }
        scale[0] = scale[1] = load_f16(blk) * (float)scv;
        min[0] = min[1] = -(load_f16(blk + 2) * (float)mv);
        has_min = 1;
    } else if (fmt == FMT_Q6_K) {
        // ql (128), qh (64), 16 signed 8-bit scales (one per 16 elements), d.
        const u32 s = b % 8, half = s / 4, j = s % 4;
        const u8* blk = row + (u64)(b / 8) * 210;
        const u8* ql = blk + 64 * half;
        const u8* qh = blk + 128 + 32 * half;
        const signed char* scs = (const signed char*)(blk + 192);
        for (int l = 0; l < 32; l++) {
            const int lo8 = ql[l + 32 * (j % 2)];
            const int lo = j < 2 ? (lo8 & 15) : (lo8 >> 4);
            v[l] = (lo | (((qh[l] >> (2 * j)) & 3) << 4)) - 32;
        }
        const float d = load_f16(blk + 208);
        scale[0] = d * (float)scs[8 * half + 2 * j];
        scale[1] = d * (float)scs[8 * half + 2 * j + 1];
    } else if (fmt == FMT_Q2_K) {
        // 16 scale bytes (per 16 elements: scale in the low nibble, minimum in the high), qs
        // (64: sub-block s is bits 2 (s % 4) of bytes 32 (s / 4) + l), d, dmin.
        const u32 s = b % 8;
        const u8* blk = row + (u64)(b / 8) * 84;
        const u8* qs = blk + 16 + 32 * (s / 4);
        const u32 shift = 2 * (s % 4);
        for (int l = 0; l < 32; l++) v[l] = (qs[l] >> shift) & 3;
        const float d = load_f16(blk + 80), dmin = load_f16(blk + 82);
        for (int h = 0; h < 2; h++) {
            const int sc = blk[2 * s + h];
            scale[h] = d * (float)(sc & 15);
            min[h] = -(dmin * (float)(sc >> 4));
        }
        has_min = 1;
    } else if (fmt == FMT_Q3_K) {
        // hmask (32: bit s of byte l is element l of sub-block s's third bit), qs (64, as
        // Q2_K's), 12 bytes of 6-bit scales (weight_cache::quant::scale_k3), d.
        const u32 s = b % 8;
        const u8* blk = row + (u64)(b / 8) * 110;
        const u8* qs = blk + 32 + 32 * (s / 4);
        const u8* sc = blk + 96;
        const u32 shift = 2 * (s % 4);
        for (int l = 0; l < 32; l++) {
            v[l] = (int)(((qs[l] >> shift) & 3) | (((blk[l] >> s) & 1) << 2)) - 4;
        }
        const float d = load_f16(blk + 108);
        for (int h = 0; h < 2; h++) {
            const u32 i = 2 * s + h;
            const int low = i < 8 ? (sc[i] & 15) : (sc[i - 8] >> 4);
            const int high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
            scale[h] = d * (float)((low | (high << 4)) - 32);
        }
    } else {
        // FMT_IQ4_XS: d, scales_h (u16: bits 2s), scales_l (4 bytes: nibble s % 2 of byte
        // s / 2), qs (128: sub-block s is bytes 16 s.., nibbles as IQ4_NL).
        const u32 s = b % 8;
        const u8* blk = row + (u64)(b / 8) * 136;
        const u32 sh = load_u16(blk + 2);
        const int low = (blk[4 + s / 2] >> (4 * (s % 2))) & 15;
        const int high = (sh >> (2 * s)) & 3;
        const u8* qs = blk + 8 + 16 * s;
        for (int j = 0; j < 16; j++) {
            v[j] = KVALUES_IQ4NL[qs[j] & 15];
            v[j + 16] = KVALUES_IQ4NL[qs[j] >> 4];
        }
        scale[0] = scale[1] = load_f16(blk) * (float)((low | (high << 4)) - 32);
    }
    dq_affine(v, scale, has_min ? min : 0, out);
}

// END HOST-TESTABLE DECODERS

template <int FMT>
__device__ __forceinline__ void load32(const u8* row, u32 b, u32 cols, float* out) {
    dequant32(FMT, row, b, cols, out);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    return v;
}

// Block-wide sum and max (blockDim.x a multiple of 32, at most 1024); every thread gets the
// result. `red` is 32 floats of shared memory; the calls synchronize the block.
__device__ float block_sum(float v, float* red) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.0f;
    for (u32 w = 0; w < warps; w++) s += red[w];
    return s;
}

__device__ float block_max(float v, float* red) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float m = -__int_as_float(0x7f800000);
    for (u32 w = 0; w < warps; w++) m = fmaxf(m, red[w]);
    return m;
}

// ---- Matrix products (kernels::matmul): y[t][r] = sum_c w[r][c] x[t][c] ----------------------
//
// The decode matvec and the batched matmul are one kernel: block (r, tile) computes row r for
// tokens [8 tile, 8 tile + 8); its threads take 32-element weight blocks in turn, dequantize
// each once and dot it with up to 8 tokens. Grid (rows, ceil(n / 8)), MM_THREADS threads.

#define MM_TOKENS 8
#define MM_THREADS 128

template <int FMT>
__device__ void matmul(const u8* w, u32 row_bytes, u32 rows, u32 cols, const float* x, u32 n,
                       float* y) {
    __shared__ float red[MM_TOKENS][MM_THREADS / 32];
    const u32 r = blockIdx.x;
    const u32 t0 = blockIdx.y * MM_TOKENS;
    const u32 tn = min((u32)MM_TOKENS, n - t0);
    const u8* row = w + (u64)r * row_bytes;
    const u32 nb = (cols + 31) / 32;
    float acc[MM_TOKENS];
#pragma unroll
    for (int t = 0; t < MM_TOKENS; t++) acc[t] = 0.0f;
    float wb[32];
    for (u32 b = threadIdx.x; b < nb; b += blockDim.x) {
        load32<FMT>(row, b, cols, wb);
        const u32 lim = min(32u, cols - b * 32);
#pragma unroll
        for (int t = 0; t < MM_TOKENS; t++) {
            if ((u32)t < tn) {
                const float* xt = x + (u64)(t0 + t) * cols + b * 32;
                float s = 0.0f;
                for (u32 i = 0; i < lim; i++) s = fmaf(wb[i], xt[i], s);
                acc[t] += s;
            }
        }
    }
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int t = 0; t < MM_TOKENS; t++) {
        const float v = warp_sum(acc[t]);
        if (lane == 0) red[t][warp] = v;
    }
    __syncthreads();
    if (threadIdx.x < tn) {
        float s = 0.0f;
        for (u32 k = 0; k < MM_THREADS / 32; k++) s += red[threadIdx.x][k];
        y[(u64)(t0 + threadIdx.x) * rows + r] = s;
    }
}

#define MATMUL(name, FMT)                                                                        \
    extern "C" __global__ void __launch_bounds__(MM_THREADS)                                     \
        name(const u8* w, u32 row_bytes, u32 rows, u32 cols, const float* x, u32 n, float* y) {  \
        matmul<FMT>(w, row_bytes, rows, cols, x, n, y);                                          \
    }

MATMUL(matmul_f32, FMT_F32)
MATMUL(matmul_f16, FMT_F16)
MATMUL(matmul_bf16, FMT_BF16)
MATMUL(matmul_q4_0, FMT_Q4_0)
MATMUL(matmul_q4_1, FMT_Q4_1)
MATMUL(matmul_q8_0, FMT_Q8_0)
MATMUL(matmul_q5_0, FMT_Q5_0)
MATMUL(matmul_q5_1, FMT_Q5_1)
MATMUL(matmul_q2_k, FMT_Q2_K)
MATMUL(matmul_q3_k, FMT_Q3_K)
MATMUL(matmul_q4_k, FMT_Q4_K)
MATMUL(matmul_q5_k, FMT_Q5_K)
MATMUL(matmul_q6_k, FMT_Q6_K)
MATMUL(matmul_iq4_nl, FMT_IQ4_NL)
MATMUL(matmul_iq4_xs, FMT_IQ4_XS)

// ---- Embedding lookup (Model::embed): x[t] = dequantize(token_embd[tokens[t]]) * scale --------
// Grid n tokens, any block size.

template <int FMT>
__device__ void embed(const u8* w, u32 row_bytes, u32 cols, const u32* tokens, float scale,
                      float* x) {
    const u32 t = blockIdx.x;
    const u8* row = w + (u64)tokens[t] * row_bytes;
    const u32 nb = (cols + 31) / 32;
    float wb[32];
    for (u32 b = threadIdx.x; b < nb; b += blockDim.x) {
        load32<FMT>(row, b, cols, wb);
        for (u32 i = 0; i < 32; i++) {
            const u32 c = b * 32 + i;
            if (c < cols) x[(u64)t * cols + c] = wb[i] * scale;
        }
    }
}

#define EMBED(name, FMT)                                                                       \
    extern "C" __global__ void name(const u8* w, u32 row_bytes, u32 cols, const u32* tokens,   \
                                    float scale, float* x) {                                   \
        embed<FMT>(w, row_bytes, cols, tokens, scale, x);                                      \
    }

EMBED(embed_f32, FMT_F32)
EMBED(embed_f16, FMT_F16)
EMBED(embed_bf16, FMT_BF16)
EMBED(embed_q4_0, FMT_Q4_0)
EMBED(embed_q4_1, FMT_Q4_1)
EMBED(embed_q8_0, FMT_Q8_0)
EMBED(embed_q5_0, FMT_Q5_0)
EMBED(embed_q5_1, FMT_Q5_1)
EMBED(embed_q2_k, FMT_Q2_K)
EMBED(embed_q3_k, FMT_Q3_K)
EMBED(embed_q4_k, FMT_Q4_K)
EMBED(embed_q5_k, FMT_Q5_K)
EMBED(embed_q6_k, FMT_Q6_K)
EMBED(embed_iq4_nl, FMT_IQ4_NL)
EMBED(embed_iq4_xs, FMT_IQ4_XS)

// ---- Element-wise ---------------------------------------------------------------------------

// RMSNorm (kernels::rmsnorm_rows): out = x / sqrt(mean(x^2) + eps) * w, the sum in double.
// Grid rows, block NORM_THREADS.
#define NORM_THREADS 256
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    rmsnorm(const float* x, const float* w, u32 d, float eps, float* out) {
    __shared__ double red[NORM_THREADS];
    const float* xr = x + (u64)blockIdx.x * d;
    float* outr = out + (u64)blockIdx.x * d;
    double s = 0.0;
    for (u32 i = threadIdx.x; i < d; i += blockDim.x) s += (double)xr[i] * (double)xr[i];
    red[threadIdx.x] = s;
    __syncthreads();
    for (u32 h = NORM_THREADS / 2; h > 0; h >>= 1) {
        if (threadIdx.x < h) red[threadIdx.x] += red[threadIdx.x + h];
        __syncthreads();
    }
    const float inv = (float)(1.0 / sqrt(red[0] / (double)d + (double)eps));
    for (u32 i = threadIdx.x; i < d; i += blockDim.x) outr[i] = xr[i] * inv * w[i];
}

// x += y (kernels::add_rows over whole buffers), n elements.
extern "C" __global__ void add_inplace(float* x, const float* y, u32 n) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// x[r] += b for every row of `width` (the projections' biases), rows * width elements.
extern "C" __global__ void add_bias(float* x, const float* b, u32 width, u32 n) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += b[i % width];
}

// gate = silu(gate) * up (kernels::silu_mul_rows): the sigmoid from e = exp(-|g|).
extern "C" __global__ void silu_mul(float* gate, const float* up, u32 n) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float g = gate[i];
        const float e = expf(-fabsf(g));
        const float sig = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
        gate[i] = g * sig * up[i];
    }
}

// gate = gelu_tanh(gate) * up (kernels::gelu_tanh_mul_rows).
extern "C" __global__ void gelu_tanh_mul(float* gate, const float* up, u32 n) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float x = gate[i];
        const float c = 0.7978845608028654f;  // sqrt(2 / pi)
        gate[i] = 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x))) * up[i];
    }
}

// x = cap * tanh(x / cap) (kernels::softcap_rows).
extern "C" __global__ void softcap(float* x, float cap, u32 n) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = cap * tanhf(x[i] / cap);
}

// RoPE (model::ops::rope_apply) of every head of `rows` rows of `heads * hd` floats, with the
// host's cos/sin table `cs[row][n_rot]` (interleaved cos, sin per frequency, attention factor
// included). Normal pairs (2i, 2i + 1); NeoX pairs (i, i + n_rot / 2). Grid rows * heads,
// threads over the n_rot / 2 pairs.
extern "C" __global__ void rope(float* x, u32 heads, u32 hd, u32 n_rot, const float* cs,
                                u32 neox) {
    const u32 row = blockIdx.x / heads, head = blockIdx.x % heads;
    float* h = x + ((u64)row * heads + head) * hd;
    const float* c = cs + (u64)row * n_rot;
    const u32 half = n_rot / 2;
    for (u32 i = threadIdx.x; i < half; i += blockDim.x) {
        const float cv = c[2 * i], sv = c[2 * i + 1];
        const u32 a = neox ? i : 2 * i;
        const u32 b = neox ? i + half : 2 * i + 1;
        const float x0 = h[a], x1 = h[b];
        h[a] = x0 * cv - x1 * sv;
        h[b] = x0 * sv + x1 * cv;
    }
}

// A mixture of experts' weighted sum (model::moe, step 4): out[t] = sum over ranks r of
// w[t k + r] * y[rows[t k + r]], in rank order (the first term assigned, as the CPU sums). `y`
// holds the experts' output rows, `rows` each slot's row. Grid tokens, threads over d.
extern "C" __global__ void moe_combine(const float* y, const u32* rows, const float* w, u32 k,
                                       u32 d, float* out) {
    const u32 t = blockIdx.x;
    for (u32 c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.0f;
        for (u32 r = 0; r < k; r++) {
            const u32 s = t * k + r;
            const float v = w[s] * y[(u64)rows[s] * d + c];
            acc = r == 0 ? v : acc + v;
        }
        out[(u64)t * d + c] = acc;
    }
}

// Qwen2-MoE's shared expert (model::moe::shared_expert): out[t] += y[t] * g with
// x = h[t] . gate and g = silu(x) / x (ggml's form). Grid tokens, 128 threads.
extern "C" __global__ void __launch_bounds__(128)
    shared_expert_add(const float* h, const float* gate, const float* y, u32 d, float* out) {
    __shared__ float red[32];
    const u32 t = blockIdx.x;
    float s = 0.0f;
    for (u32 c = threadIdx.x; c < d; c += blockDim.x) s += h[(u64)t * d + c] * gate[c];
    const float x = block_sum(s, red);
    const float g = x / (1.0f + expf(-x)) / x;
    for (u32 c = threadIdx.x; c < d; c += blockDim.x) out[(u64)t * d + c] += y[(u64)t * d + c] * g;
}

// dst[i] = src[idx[i]] for rows of `width` (the rows whose logits are wanted). Grid n_out.
extern "C" __global__ void gather_rows(const float* src, const u32* idx, u32 width, float* dst) {
    const float* s = src + (u64)idx[blockIdx.x] * width;
    float* d = dst + (u64)blockIdx.x * width;
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) d[i] = s[i];
}

// ---- Device KV rings (kv_ring::KvRing in a DeviceKv, read and written in place) -------------
//
// A ring keeps, per (layer, kv head, K or V), a block of `rows` slots of `hd` elements (f32, or
// f16 bits when the step's `f16` flag is set); view index i (position order) is in slot
// (start + i) % rows (kv_ring::LayerSlots). Per layer the host passes, for step s:
//   blocks[(s * kv_heads + g) * 2 + 0 / 1]  device addresses of kv head g's K / V block,
//   geom[s * 3 + 0 / 1 / 2]                 start, rows, f16,
// and for token t (of step tok_step[t]): toks[t * 2 + 0 / 1] = first, keys: the token attends
// to view indices [first, keys) (causal bound and sliding window), and is itself view index
// keys - 1. start < rows and keys <= rows, so start + j < 2 rows for every j < keys.

__device__ __forceinline__ u16 f32_to_f16_bits(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Element i of a KV block (as f32).
__device__ __forceinline__ float kv_load(u64 block, u64 i, u32 f16) {
    return f16 ? f16_bits_to_f32(((const u16*)block)[i]) : ((const float*)block)[i];
}

// Stores x at element i of a KV block, rounded to nearest even for f16 (the host ring's
// `convert_from_f32_slice`).
__device__ __forceinline__ void kv_store(u64 block, u64 i, u32 f16, float x) {
    if (f16) {
        ((u16*)block)[i] = f32_to_f16_bits(x);
    } else {
        ((float*)block)[i] = x;
    }
}

// Slot of view index j of a ring with `start`, `rows`.
__device__ __forceinline__ u64 ring_slot(u32 start, u32 rows, u32 j) {
    const u64 s = (u64)start + j;
    return s >= rows ? s - rows : s;
}

// Writes one layer's new K and V rows into the rings (kv_ring::KvRing::write_layer): `k` and
// `v` are `[token][kv_heads][hd]` f32; token t goes to view index keys - 1 of its ring.
// Grid tokens * kv_heads, threads over hd.
extern "C" __global__ void kv_scatter(const float* k, const float* v, u32 kv_heads, u32 hd,
                                      const u64* blocks, const u32* geom, const u32* tok_step,
                                      const u32* toks) {
    const u32 t = blockIdx.x / kv_heads, g = blockIdx.x % kv_heads;
    const u32 s = tok_step[t];
    const u32 f16 = geom[s * 3 + 2];
    const u64 row = ring_slot(geom[s * 3], geom[s * 3 + 1], toks[t * 2 + 1] - 1) * hd;
    const u64 kb = blocks[((u64)s * kv_heads + g) * 2], vb = blocks[((u64)s * kv_heads + g) * 2 + 1];
    const float* ks = k + ((u64)t * kv_heads + g) * hd;
    const float* vs = v + ((u64)t * kv_heads + g) * hd;
    for (u32 e = threadIdx.x; e < hd; e += blockDim.x) {
        kv_store(kb, row + e, f16, ks[e]);
        kv_store(vb, row + e, f16, vs[e]);
    }
}

// Attention (model::attention::attend_rows_ext) of query token t, head h against its ring:
// score = q.k * scale, then cap * tanh(s / cap) when cap > 0, softmax over view indices
// [first, keys), weighted sum of values. q and out `[token][heads][hd]`; `scores` is
// `[token * heads][max_keys]` scratch. Grid tokens * heads (GQA: head h reads kv head
// h / (heads / kv_heads)), ATT_THREADS threads.
#define ATT_THREADS 128
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention_ring(const float* q, const u64* blocks, const u32* geom, const u32* tok_step,
                   const u32* toks, u32 heads, u32 kv_heads, u32 hd, float scale, float cap,
                   float* scores, u32 max_keys, float* out) {
    __shared__ float red[32];
    const u32 t = blockIdx.x / heads, h = blockIdx.x % heads;
    const u32 g = h / (heads / kv_heads);
    const u32 s = tok_step[t];
    const u64 kb = blocks[((u64)s * kv_heads + g) * 2], vb = blocks[((u64)s * kv_heads + g) * 2 + 1];
    const u32 start = geom[s * 3], rows = geom[s * 3 + 1], f16 = geom[s * 3 + 2];
    const u32 first = toks[t * 2], n = toks[t * 2 + 1];
    const float* qr = q + ((u64)t * heads + h) * hd;
    float* sc = scores + ((u64)t * heads + h) * max_keys;

    float mx = -__int_as_float(0x7f800000);
    for (u32 j = first + threadIdx.x; j < n; j += blockDim.x) {
        const u64 kr = ring_slot(start, rows, j) * hd;
        float dot = 0.0f;
        for (u32 d = 0; d < hd; d++) dot = fmaf(qr[d], kv_load(kb, kr + d, f16), dot);
        float sv = dot * scale;
        if (cap > 0.0f) sv = cap * tanhf(sv / cap);
        sc[j] = sv;
        mx = fmaxf(mx, sv);
    }
    mx = block_max(mx, red);
    float sum = 0.0f;
    for (u32 j = first + threadIdx.x; j < n; j += blockDim.x) {
        const float p = expf(sc[j] - mx);
        sc[j] = p;
        sum += p;
    }
    // block_sum synchronizes: every thread's probabilities are visible after it.
    sum = block_sum(sum, red);
    const float inv = 1.0f / sum;
    float* o = out + ((u64)t * heads + h) * hd;
    for (u32 d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (u32 j = first; j < n; j++) {
            acc = fmaf(sc[j], kv_load(vb, ring_slot(start, rows, j) * hd + d, f16), acc);
        }
        o[d] = acc * inv;
    }
}
