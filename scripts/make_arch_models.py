#!/usr/bin/env python3
"""Write the model-family test models of gpu-pipeline's `tests/arch_models.rs`.

One small random-weight model per family the forward pass supports beyond plain Llama, each with
llama.cpp's exact tensor names and metadata keys (as its converter, convert_hf_to_gguf.py, writes
them) and a real tokenizer copied from llama.cpp's tokenizer test vocabularies
(scripts/fetch-vocab-suite), so each file is a complete model a server can run:

  arch-llama3   `llama`: untied output, GQA, rope base 500000, `rope_freqs.weight` from Llama 3.1's
                formula (factor 8, low 1, high 4, original context 64); llama-bpe vocabulary.
  arch-qwen2    `qwen2`: Q/K/V biases, tied output; qwen2 vocabulary.
  arch-qwen3    `qwen3`: Q/K RMSNorm over head_dim 64 != n_embd/n_head (32), tied; qwen2 vocabulary.
  arch-gemma2   `gemma2`: post norms (`post_attention_norm`, `post_ffw_norm`), attention and final logit soft-capping
                that bite, sliding window 16 on even layers (llama.cpp's default pattern 2),
                head_dim 64 != n_embd/n_head, tied; llama-spm vocabulary.
  arch-gemma3   `gemma3`: Q/K norms, post norms, sliding window 16 on layers 0-4 (pattern 6),
                rope base 10000 on the sliding layers and 1000000 on layer 5, head_dim 256, one KV
                head, tied; llama-spm vocabulary.
  arch-phi3     `phi3`: fused `attn_qkv`, `ffn_up` of 2*n_ff (gate then up), long/short rope factors
                (original context 64, context 512, attn_factor as the converter computes it);
                phi-3 vocabulary.
  arch-smollm3  `smollm3`: no RoPE on layers with (il+1)%4==0, tied; llama-bpe vocabulary.

Mixture-of-experts models (llama.cpp's build_moe_ffn), each with a skewed router: embedding column
0 carries a constant (HOT_DIM_MEAN) that every token shares, so the normalized input's entry 0 is
large and positive, and each router row's entry 0 (ROUTER_SKEW: high for the first experts) sets
how often its expert wins; the other entries are random, so routing still varies by token:
  arch-qwen3moe `qwen3moe`: 16 experts, top-2 with renormalised weights, expert_feed_forward_length
                64, per-head Q/K norms, head_dim 64, tied; llama-spm vocabulary with Qwen's
                turn markers and Qwen3's chat template (the server e2e test runs it).
  arch-mixtral  `llama` with expert tensors (Mixtral's layout): 8 experts of feed_forward_length
                128, top-2 renormalised, tied; llama-spm vocabulary.
  arch-olmoe    `olmoe`: 16 experts of 64, top-2 without renormalisation, Q/K norms over the whole
                rows, untied output head; llama-spm vocabulary.
  arch-qwen2moe `qwen2moe`: 8 experts of 64, top-2 without renormalisation, a shared expert of
                96 gated by sigmoid(ffn_gate_inp_shexp . x), Q/K/V biases, untied output head;
                llama-spm vocabulary.

Token embeddings (and llama3/phi3's output head) are Q8_0 for the 128k-152k vocabularies and F16
for the 32k ones (quantized with the `gguf` package's reference Q8_0); norms, biases and rope
factors F32; other matrices F32 (llama.cpp then computes them without rounding the activations).
Then QUANTIZED: variants written by llama.cpp's own quantizer (`llama_cpp.llama_model_quantize`).
The set is ~190 MB, most of it the four 128k/152k-vocabulary models (Q8_0 embedding 17-21 MB,
llama3's Q8_0 head another 17 MB, tokenizer 6-8 MB each); EMBD_LARGE = Q4_0 would save ~44 MB.

Output: $ZEROLAYER_TEST_MODELS or ~/.cache/zerolayer/test-models/arch-<name>.gguf, merged into the
manifest (`manifest.json`: file name -> sha256) that scripts/make_test_models.py writes.
Deterministic: fixed seeds (numpy default_rng), same gguf/llama.cpp release, same bytes.

usage: make_arch_models.py [--only NAME...]   (NAME as in MODELS / QUANTIZED, e.g. arch-qwen3)
       make_arch_models.py --bench-moe FILE    (not a test model: BENCH_MOE below, ~1.4 GB)
       make_arch_models.py --bench-dense FILE [TYPE]  (not a test model: BENCH_DENSE below;
                                               TYPE a llama.cpp file type, default Q4_K_M ~1.1 GB;
                                               Q5_K_M ~1.2 GB, Q8_0 ~1.8 GB)
"""
import json
import math
import os
import pathlib
import sys

import numpy as np
import gguf
# The output directory, file hashing and llama.cpp's quantizer call of the quantization models.
from make_test_models import OUT, quantize, sha256

VOCABS = pathlib.Path(os.environ.get(
    "ZEROLAYER_VOCAB_SUITE",
    os.path.expanduser("~/.cache/zerolayer/llama-vocab-suite-0.3.36")))
SEED = 20261204
Q8 = gguf.GGMLQuantizationType.Q8_0
F16 = gguf.GGMLQuantizationType.F16
# name -> (source, llama.cpp ftype); sources are the files of MODELS.
# Small-vocabulary sources: a 152k-token Q4_K_M file would cost another 27 MB. gemma2's rows of
# 256 (ffn_down, attn_output) take K-quants, its rows of 128 fall back (Q5_0/Q8_0): a mix.
# The MoE models' experts quantized too (llama.cpp keeps the routers, ffn_gate_inp, in F32).
QUANTIZED = {"arch-gemma2.Q4_K_M": ("arch-gemma2", "Q4_K_M"),
             "arch-gemma3.Q8_0": ("arch-gemma3", "Q8_0"),
             "arch-mixtral.Q8_0": ("arch-mixtral", "Q8_0"),
             "arch-olmoe.Q4_K_M": ("arch-olmoe", "Q4_K_M")}


class Builder:
    """A GGUF writer with the random-weight helpers (one rng per model)."""

    def __init__(self, path, arch, name, vocab, seed, template=None, extra=()):
        self.arch = arch
        self.w = gguf.GGUFWriter(str(path), arch)
        self.w.add_name(name)
        self.w.add_file_type(gguf.LlamaFileType.ALL_F32)
        self.rng = np.random.default_rng(seed)
        self.vocab = copy_tokenizer(self.w, vocab, template, extra)

    def mat(self, rows, cols, scale=1.0):
        """rows x cols (ggml ne = [cols, rows]) with entries of std scale/sqrt(cols): an output
        of std ~scale for an RMS-normalized input."""
        return (self.rng.standard_normal((rows, cols), dtype=np.float32)
                * np.float32(scale / np.sqrt(cols)))

    def vec(self, n, mean=1.0, std=0.1):
        return (mean + std * self.rng.standard_normal(n)).astype(np.float32)

    def add(self, name, data, dtype=None):
        if dtype not in (None, F16):
            self.w.add_tensor(name, gguf.quants.quantize(data, dtype), raw_dtype=dtype)
        elif dtype == F16:
            self.w.add_tensor(name, data.astype(np.float16))
        else:
            self.w.add_tensor(name, data)

    def hp(self, key, value):
        """`<arch>.<key>` with the writer's type inference (uint32 for int, float32 for float)."""
        full = f"{self.arch}.{key}"
        if isinstance(value, bool):
            self.w.add_bool(full, value)
        elif isinstance(value, int):
            self.w.add_uint32(full, value)
        else:
            self.w.add_float32(full, float(value))

    def common(self, n_ctx, d, n_ff, n_layer, n_head, n_head_kv, eps, rope_base,
               head_dim=None, n_rot=None):
        self.hp("context_length", n_ctx)
        self.hp("embedding_length", d)
        self.hp("feed_forward_length", n_ff)
        self.hp("block_count", n_layer)
        self.hp("attention.head_count", n_head)
        self.hp("attention.head_count_kv", n_head_kv)
        self.hp("attention.layer_norm_rms_epsilon", eps)
        self.hp("rope.freq_base", rope_base)
        if head_dim is not None:
            self.hp("attention.key_length", head_dim)
            self.hp("attention.value_length", head_dim)
        self.hp("rope.dimension_count", n_rot if n_rot is not None else (head_dim or d // n_head))

    def finish(self):
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()


def copy_tokenizer(w, vocab, template=None, extra=()):
    """Every tokenizer.* key of the vocabulary file (tokens, types, merges or scores, special
    ids, chat template); `extra` tokens are appended as control tokens, and `template` (a file of
    the suite's templates/ directory: the family's real chat template) replaces the file's
    `tokenizer.chat_template`. Returns the vocabulary size."""
    src = gguf.GGUFReader(str(VOCABS / f"ggml-vocab-{vocab}.gguf"))
    n = len(src.fields["tokenizer.ggml.tokens"].contents())
    for key, field in src.fields.items():
        if not key.startswith("tokenizer.") or (template and key == "tokenizer.chat_template"):
            continue
        value = field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            if len(value) == n and key == "tokenizer.ggml.tokens":
                value = list(value) + list(extra)
            elif len(value) == n and key == "tokenizer.ggml.token_type":
                value = list(value) + [3] * len(extra)  # CONTROL
            elif len(value) == n and key == "tokenizer.ggml.scores":
                value = list(value) + [0.0] * len(extra)
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, field.types[0])
    if template:
        text = (VOCABS / "templates" / template).read_text(encoding="utf-8")
        w.add_key_value("tokenizer.chat_template", text, gguf.GGUFValueType.STRING)
    return n + len(extra)


EMBD_LARGE = Q8


def embd_dtype(vocab):
    return EMBD_LARGE if vocab > 65536 else F16


def llama_block(b, i, d, n_ff, q_dim, kv_dim, bias=False, qk_norm=None, out_scale=0.5):
    p = f"blk.{i}."
    b.add(p + "attn_norm.weight", b.vec(d))
    b.add(p + "attn_q.weight", b.mat(q_dim, d))
    b.add(p + "attn_k.weight", b.mat(kv_dim, d))
    b.add(p + "attn_v.weight", b.mat(kv_dim, d))
    if bias:
        # Biases of the size of the projections' outputs, so they move the scores visibly.
        b.add(p + "attn_q.bias", b.vec(q_dim, 0.0, 0.7))
        b.add(p + "attn_k.bias", b.vec(kv_dim, 0.0, 0.7))
        b.add(p + "attn_v.bias", b.vec(kv_dim, 0.0, 0.7))
    if qk_norm is not None:
        b.add(p + "attn_q_norm.weight", b.vec(qk_norm, 1.0, 0.3))
        b.add(p + "attn_k_norm.weight", b.vec(qk_norm, 1.0, 0.3))
    b.add(p + "attn_output.weight", b.mat(d, q_dim, out_scale))
    b.add(p + "ffn_norm.weight", b.vec(d))
    b.add(p + "ffn_gate.weight", b.mat(n_ff, d))
    b.add(p + "ffn_up.weight", b.mat(n_ff, d))
    b.add(p + "ffn_down.weight", b.mat(d, n_ff, out_scale))


# Tied heads: the residual stream carries the input token's embedding, whose logit through the
# same matrix is |e|^2/rms(state) (~16/rms); unless the blocks' outputs outweigh it (rms ~2-4
# against the embedding's 0.35 per entry), the top-1 is the input token itself and says nothing
# about the layers. Hence TIED_OUT_SCALE for the attention output and FFN down projections of
# the tied Llama-like models, and post norms of ~6-7 for Gemma (whose input is also scaled by
# sqrt(n_embd)).
TIED_OUT_SCALE = 2.0

# Embedding entries of std 0.35: a tied head on a normalized state of rms ~1 then gives logits
# of std ~0.35*sqrt(n_embd) ~4 (n_embd 128), so top-2 gaps above 0.5 are common even over 150k
# tokens; untied heads use scale 4 for the same.
EMBD_STD = 0.35


def embedding(b, d):
    b.add("token_embd.weight", b.mat(b.vocab, d, EMBD_STD * np.sqrt(d)), embd_dtype(b.vocab))


def llama3_rope_freqs(base, head_dim, factor=8.0, low=1.0, high=4.0, old_ctx=64):
    """convert_hf_to_gguf.py (conversion/llama.py generate_extra_tensors), rope_type llama3."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_llama3(path):
    d, ff, nl, nh, nkv = 128, 256, 2, 4, 2
    hd = d // nh
    b = Builder(path, "llama", "zerolayer-arch-llama3", "llama-bpe", SEED + 1,
                template="meta-llama-Llama-3.1-8B-Instruct.jinja")
    b.common(512, d, ff, nl, nh, nkv, 1e-5, 500000.0)
    b.hp("vocab_size", b.vocab)
    embedding(b, d)
    b.add("rope_freqs.weight", llama3_rope_freqs(500000.0, hd))
    for i in range(nl):
        llama_block(b, i, d, ff, d, hd * nkv)
    b.add("output_norm.weight", b.vec(d))
    b.add("output.weight", b.mat(b.vocab, d, 4.0), embd_dtype(b.vocab))
    b.finish()


def write_qwen2(path):
    d, ff, nl, nh, nkv = 128, 256, 2, 4, 2
    hd = d // nh
    b = Builder(path, "qwen2", "zerolayer-arch-qwen2", "qwen2", SEED + 2)
    b.common(512, d, ff, nl, nh, nkv, 1e-6, 1000000.0)
    embedding(b, d)
    for i in range(nl):
        llama_block(b, i, d, ff, d, hd * nkv, bias=True, out_scale=TIED_OUT_SCALE)
    b.add("output_norm.weight", b.vec(d))
    b.finish()


def write_qwen3(path):
    d, ff, nl, nh, nkv, hd = 128, 512, 2, 4, 2, 64
    b = Builder(path, "qwen3", "zerolayer-arch-qwen3", "qwen2", SEED + 3)
    b.common(512, d, ff, nl, nh, nkv, 1e-6, 1000000.0, head_dim=hd)
    embedding(b, d)
    for i in range(nl):
        llama_block(b, i, d, ff, nh * hd, nkv * hd, qk_norm=hd, out_scale=TIED_OUT_SCALE)
    b.add("output_norm.weight", b.vec(d))
    b.finish()


def gemma_block(b, i, d, ff, nh, nkv, hd, qk_scale, post_norm, qk_norm):
    p = f"blk.{i}."
    b.add(p + "attn_norm.weight", b.vec(d))
    b.add(p + "attn_q.weight", b.mat(nh * hd, d, qk_scale))
    b.add(p + "attn_k.weight", b.mat(nkv * hd, d, qk_scale))
    b.add(p + "attn_v.weight", b.mat(nkv * hd, d))
    if qk_norm:
        # Q and K are normalized before RoPE; the norm weights set the score scale instead.
        b.add(p + "attn_q_norm.weight", b.vec(hd, 1.5, 0.3))
        b.add(p + "attn_k_norm.weight", b.vec(hd, 1.5, 0.3))
    b.add(p + "attn_output.weight", b.mat(d, nh * hd, 0.5))
    # Gemma's GGUF norms already include the +1 of the checkpoints (the converter adds it).
    b.add(p + "post_attention_norm.weight", b.vec(d, post_norm, 0.1 * post_norm))
    b.add(p + "ffn_norm.weight", b.vec(d))
    b.add(p + "ffn_gate.weight", b.mat(ff, d))
    b.add(p + "ffn_up.weight", b.mat(ff, d))
    b.add(p + "ffn_down.weight", b.mat(d, ff, 0.5))
    b.add(p + "post_ffw_norm.weight", b.vec(d, post_norm, 0.1 * post_norm))


# Gemma's turn markers (control tokens in Gemma's own vocabulary; llama-spm lacks them).
GEMMA_TURNS = ("<start_of_turn>", "<end_of_turn>")


def write_gemma2(path):
    d, ff, nl, nh, nkv, hd = 128, 256, 4, 4, 2, 64
    b = Builder(path, "gemma2", "zerolayer-arch-gemma2", "llama-spm", SEED + 4,
                template="google-gemma-2-2b-it.jinja", extra=GEMMA_TURNS)
    b.common(512, d, ff, nl, nh, nkv, 1e-6, 10000.0, head_dim=hd)
    # Q/K of std 2.5 each: scores q.k/sqrt(64) of std ~6, max ~15-20 before the cap of 10.
    b.hp("attn_logit_softcapping", 10.0)
    # Logits of std ~4 (max ~18-20) against a cap of 20: tanh halves the gaps at the top of the
    # list (a cap of 15 compressed them so much that few positions were decisive).
    b.hp("final_logit_softcapping", 20.0)
    b.hp("attention.sliding_window", 16)
    embedding(b, d)
    for i in range(nl):
        gemma_block(b, i, d, ff, nh, nkv, hd, 2.5, post_norm=7.0, qk_norm=False)
    b.add("output_norm.weight", b.vec(d))
    b.finish()


def write_gemma3(path):
    d, ff, nl, nh, nkv, hd = 128, 256, 6, 4, 1, 256
    b = Builder(path, "gemma3", "zerolayer-arch-gemma3", "llama-spm", SEED + 5,
                template="google-gemma-2-2b-it.jinja", extra=GEMMA_TURNS)
    b.common(512, d, ff, nl, nh, nkv, 1e-6, 1000000.0, head_dim=hd)
    b.hp("rope.freq_base_swa", 10000.0)
    b.hp("attention.sliding_window", 16)
    embedding(b, d)
    for i in range(nl):
        gemma_block(b, i, d, ff, nh, nkv, hd, 1.0, post_norm=6.0, qk_norm=True)
    b.add("output_norm.weight", b.vec(d))
    b.finish()


PHI3_ORIG_CTX, PHI3_CTX = 64, 512


def write_phi3(path):
    d, ff, nl, nh, nkv = 128, 256, 2, 4, 2
    hd = d // nh
    b = Builder(path, "phi3", "zerolayer-arch-phi3", "phi-3", SEED + 6)
    b.common(PHI3_CTX, d, ff, nl, nh, nkv, 1e-5, 10000.0)
    b.hp("rope.scaling.original_context_length", PHI3_ORIG_CTX)
    # conversion/phi.py (LongRoPE, su/longrope): sqrt(1 + ln(scale)/ln(orig)), scale = ctx/orig.
    scale = PHI3_CTX / PHI3_ORIG_CTX
    b.hp("rope.scaling.attn_factor", math.sqrt(1 + math.log(scale) / math.log(PHI3_ORIG_CTX)))
    embedding(b, d)
    # Short factors near 1, long factors rising to ~16 for the slow dimensions (Phi-3's shape).
    b.add("rope_factors_long.weight",
          np.geomspace(1.0, 16.0, hd // 2).astype(np.float32))
    b.add("rope_factors_short.weight",
          (1.0 + 0.1 * np.linspace(0.0, 1.0, hd // 2) ** 2).astype(np.float32))
    kv = hd * nkv
    for i in range(nl):
        p = f"blk.{i}."
        b.add(p + "attn_norm.weight", b.vec(d))
        b.add(p + "attn_qkv.weight", b.mat(d + 2 * kv, d))
        b.add(p + "attn_output.weight", b.mat(d, d, 0.5))
        b.add(p + "ffn_norm.weight", b.vec(d))
        # llama.cpp's LLM_FFN_SWIGLU on one tensor: rows [0, n_ff) are the gate, [n_ff, 2n_ff) up.
        b.add(p + "ffn_up.weight", b.mat(2 * ff, d))
        b.add(p + "ffn_down.weight", b.mat(d, ff, 0.5))
    b.add("output_norm.weight", b.vec(d))
    b.add("output.weight", b.mat(b.vocab, d, 4.0), embd_dtype(b.vocab))
    b.finish()


def write_smollm3(path):
    d, ff, nl, nh, nkv = 128, 256, 4, 4, 2
    hd = d // nh
    b = Builder(path, "smollm3", "zerolayer-arch-smollm3", "llama-bpe", SEED + 7,
                template="HuggingFaceTB-SmolLM3-3B.jinja", extra=("<|im_start|>", "<|im_end|>"))
    b.common(512, d, ff, nl, nh, nkv, 1e-6, 2000000.0)
    embedding(b, d)
    for i in range(nl):
        llama_block(b, i, d, ff, d, hd * nkv, out_scale=TIED_OUT_SCALE)
    b.add("output_norm.weight", b.vec(d))
    b.finish()


# Mixture of experts: the shared hot dimension and the router's preference per expert (see the
# module docstring). Entry 0 of the normalized input is ~4, so a skew of 0.5 adds ~2 to an
# expert's score against the random part's std of ~1.
HOT_DIM_MEAN = 1.5


def router_skew(n_expert):
    """The first quarter of the experts hot (+0.6), then falling to cold (-0.6)."""
    hot = max(1, n_expert // 4)
    return np.concatenate([np.full(hot, 0.6), np.linspace(0.2, -0.6, n_expert - hot)]
                          ).astype(np.float32)


def moe_embedding(b, d):
    e = b.mat(b.vocab, d, EMBD_STD * np.sqrt(d))
    e[:, 0] += HOT_DIM_MEAN
    b.add("token_embd.weight", e, embd_dtype(b.vocab))


def moe_ffn(b, i, d, n_ff_exp, n_expert, out_scale):
    p = f"blk.{i}."
    router = b.mat(n_expert, d)
    router[:, 0] = router_skew(n_expert)
    b.add(p + "ffn_gate_inp.weight", router)
    # ggml ne [d, n_ff_exp, n_expert]: numpy (n_expert, n_ff_exp, d).
    b.add(p + "ffn_gate_exps.weight",
          np.stack([b.mat(n_ff_exp, d) for _ in range(n_expert)]))
    b.add(p + "ffn_up_exps.weight",
          np.stack([b.mat(n_ff_exp, d) for _ in range(n_expert)]))
    b.add(p + "ffn_down_exps.weight",
          np.stack([b.mat(d, n_ff_exp, out_scale) for _ in range(n_expert)]))


def moe_attention(b, i, d, q_dim, kv_dim, bias=False, qk_norm=None, out_scale=0.5):
    p = f"blk.{i}."
    b.add(p + "attn_norm.weight", b.vec(d))
    b.add(p + "attn_q.weight", b.mat(q_dim, d))
    b.add(p + "attn_k.weight", b.mat(kv_dim, d))
    b.add(p + "attn_v.weight", b.mat(kv_dim, d))
    if bias:
        b.add(p + "attn_q.bias", b.vec(q_dim, 0.0, 0.7))
        b.add(p + "attn_k.bias", b.vec(kv_dim, 0.0, 0.7))
        b.add(p + "attn_v.bias", b.vec(kv_dim, 0.0, 0.7))
    if qk_norm is not None:
        q_len, k_len = qk_norm
        b.add(p + "attn_q_norm.weight", b.vec(q_len, 1.0, 0.3))
        b.add(p + "attn_k_norm.weight", b.vec(k_len, 1.0, 0.3))
    b.add(p + "attn_output.weight", b.mat(d, q_dim, out_scale))
    b.add(p + "ffn_norm.weight", b.vec(d))


def moe_hp(b, n_expert, n_used, n_ff_exp=None):
    b.hp("expert_count", n_expert)
    b.hp("expert_used_count", n_used)
    if n_ff_exp is not None:
        b.hp("expert_feed_forward_length", n_ff_exp)


def write_qwen3moe(path):
    d, ff, nl, nh, nkv, hd, ne, ffe = 128, 256, 2, 4, 2, 64, 16, 64
    b = Builder(path, "qwen3moe", "zerolayer-arch-qwen3moe", "llama-spm", SEED + 8,
                template="Qwen-Qwen3-0.6B.jinja", extra=("<|im_start|>", "<|im_end|>"))
    b.common(512, d, ff, nl, nh, nkv, 1e-6, 1000000.0, head_dim=hd)
    moe_hp(b, ne, 2, ffe)
    moe_embedding(b, d)
    for i in range(nl):
        moe_attention(b, i, d, nh * hd, nkv * hd, qk_norm=(hd, hd), out_scale=TIED_OUT_SCALE)
        moe_ffn(b, i, d, ffe, ne, TIED_OUT_SCALE)
    b.add("output_norm.weight", b.vec(d))
    b.finish()


def write_mixtral(path):
    d, ff, nl, nh, nkv, ne = 128, 128, 2, 4, 2, 8
    hd = d // nh
    b = Builder(path, "llama", "zerolayer-arch-mixtral", "llama-spm", SEED + 9)
    b.common(512, d, ff, nl, nh, nkv, 1e-5, 1000000.0)
    b.hp("vocab_size", b.vocab)
    moe_hp(b, ne, 2)
    moe_embedding(b, d)
    for i in range(nl):
        moe_attention(b, i, d, d, hd * nkv, out_scale=TIED_OUT_SCALE)
        moe_ffn(b, i, d, ff, ne, TIED_OUT_SCALE)
    b.add("output_norm.weight", b.vec(d))
    b.finish()


def write_olmoe(path):
    # llama.cpp's olmoe: K norm over n_embd, so as many KV heads as query heads.
    d, ff, nl, nh, ne = 128, 64, 2, 4, 16
    b = Builder(path, "olmoe", "zerolayer-arch-olmoe", "llama-spm", SEED + 10)
    b.common(512, d, ff, nl, nh, nh, 1e-5, 10000.0)
    moe_hp(b, ne, 2)
    moe_embedding(b, d)
    for i in range(nl):
        moe_attention(b, i, d, d, d, qk_norm=(d, d))
        moe_ffn(b, i, d, ff, ne, 0.5)
    b.add("output_norm.weight", b.vec(d))
    b.add("output.weight", b.mat(b.vocab, d, 4.0), embd_dtype(b.vocab))
    b.finish()


def write_qwen2moe(path):
    d, ff, nl, nh, nkv, ne, ffe, ffs = 128, 256, 2, 4, 2, 8, 64, 96
    hd = d // nh
    b = Builder(path, "qwen2moe", "zerolayer-arch-qwen2moe", "llama-spm", SEED + 11)
    b.common(512, d, ff, nl, nh, nkv, 1e-6, 1000000.0)
    moe_hp(b, ne, 2, ffe)
    b.hp("expert_shared_feed_forward_length", ffs)
    moe_embedding(b, d)
    for i in range(nl):
        p = f"blk.{i}."
        moe_attention(b, i, d, d, hd * nkv, bias=True, out_scale=TIED_OUT_SCALE)
        moe_ffn(b, i, d, ffe, ne, TIED_OUT_SCALE)
        b.add(p + "ffn_gate_inp_shexp.weight", b.vec(d, 0.0, 1.0 / np.sqrt(d)))
        b.add(p + "ffn_gate_shexp.weight", b.mat(ffs, d))
        b.add(p + "ffn_up_shexp.weight", b.mat(ffs, d))
        b.add(p + "ffn_down_shexp.weight", b.mat(d, ffs, TIED_OUT_SCALE))
    b.add("output_norm.weight", b.vec(d))
    # llama.cpp's qwen2moe needs its own head.
    b.add("output.weight", b.mat(b.vocab, d, 4.0), embd_dtype(b.vocab))
    b.finish()


# The benchmark mixture of experts (scripts/bench-vs-llamacpp --model FILE; not written by
# scripts/make-test-models): qwen3moe, d 1024, 16 layers, 8 heads of 128 (4 KV heads), 32 experts
# of 768, top-4, Q8_0 matrices (the gguf package's reference quantizer), skewed router as above:
# 1.21e9 expert parameters (1.28 GB), of which a decode step reads 4/32 plus 67M of attention.
BENCH_MOE = dict(d=1024, ff=3072, nl=16, nh=8, nkv=4, hd=128, ne=32, used=4, ffe=768)


def write_bench_moe(path):
    c = BENCH_MOE
    d, nh, nkv, hd, ne, ffe = c["d"], c["nh"], c["nkv"], c["hd"], c["ne"], c["ffe"]
    b = Builder(path, "qwen3moe", "zerolayer-bench-qwen3moe", "llama-spm", SEED + 12)
    b.common(2048, d, c["ff"], c["nl"], nh, nkv, 1e-6, 1000000.0, head_dim=hd)
    moe_hp(b, ne, c["used"], ffe)
    moe_embedding(b, d)
    for i in range(c["nl"]):
        p = f"blk.{i}."
        b.add(p + "attn_norm.weight", b.vec(d))
        b.add(p + "attn_q.weight", b.mat(nh * hd, d), Q8)
        b.add(p + "attn_k.weight", b.mat(nkv * hd, d), Q8)
        b.add(p + "attn_v.weight", b.mat(nkv * hd, d), Q8)
        b.add(p + "attn_q_norm.weight", b.vec(hd, 1.0, 0.3))
        b.add(p + "attn_k_norm.weight", b.vec(hd, 1.0, 0.3))
        b.add(p + "attn_output.weight", b.mat(d, nh * hd, TIED_OUT_SCALE), Q8)
        b.add(p + "ffn_norm.weight", b.vec(d))
        router = b.mat(ne, d)
        router[:, 0] = router_skew(ne)
        b.add(p + "ffn_gate_inp.weight", router)
        for name, rows, cols, scale in (("ffn_gate_exps", ffe, d, 1.0), ("ffn_up_exps", ffe, d, 1.0),
                                        ("ffn_down_exps", d, ffe, TIED_OUT_SCALE)):
            stack = np.stack([b.mat(rows, cols, scale) for _ in range(ne)])
            q = gguf.quants.quantize(stack.reshape(ne * rows, cols), Q8)
            b.w.add_tensor(p + name + ".weight", q.reshape(ne, rows, -1), raw_dtype=Q8)
    b.add("output_norm.weight", b.vec(d))
    b.finish()


# The benchmark dense model (scripts/bench-vs-llamacpp --model FILE): a Llama of 1.71e9
# parameters (d 2048, 26 layers, 32 heads of 64 with 8 KV heads, FFN 8192, the 32k llama-spm
# vocabulary, untied head), written as F16 beside FILE and quantized by llama.cpp's own
# quantizer into Q4_K_M (llama.cpp's mix: Q4_K with Q6_K for half the ffn_down/attn_v and the
# head), ~1.1 GB: 30x this machine's L3, the honest case for decode bandwidth; or another file
# type (Q5_K_M, Q8_0: issue 49's other real-size files).
BENCH_DENSE = dict(d=2048, ff=8192, nl=26, nh=32, nkv=8)


def write_bench_dense(path, ftype="Q4_K_M"):
    c = BENCH_DENSE
    d, ff, nl, nh, nkv = c["d"], c["ff"], c["nl"], c["nh"], c["nkv"]
    hd = d // nh
    f16 = path.with_name(path.stem + ".F16.gguf")
    b = Builder(f16, "llama", "zerolayer-bench-dense", "llama-spm", SEED + 13)
    b.common(2048, d, ff, nl, nh, nkv, 1e-5, 10000.0)
    b.add("token_embd.weight", b.mat(b.vocab, d, EMBD_STD * np.sqrt(d)), F16)
    for i in range(nl):
        p = f"blk.{i}."
        b.add(p + "attn_norm.weight", b.vec(d))
        b.add(p + "attn_q.weight", b.mat(d, d), F16)
        b.add(p + "attn_k.weight", b.mat(hd * nkv, d), F16)
        b.add(p + "attn_v.weight", b.mat(hd * nkv, d), F16)
        b.add(p + "attn_output.weight", b.mat(d, d, TIED_OUT_SCALE), F16)
        b.add(p + "ffn_norm.weight", b.vec(d))
        b.add(p + "ffn_gate.weight", b.mat(ff, d), F16)
        b.add(p + "ffn_up.weight", b.mat(ff, d), F16)
        b.add(p + "ffn_down.weight", b.mat(d, ff, TIED_OUT_SCALE), F16)
    b.add("output_norm.weight", b.vec(d))
    b.add("output.weight", b.mat(b.vocab, d, 4.0), F16)
    b.finish()
    quantize(f16, path, ftype, False)
    f16.unlink()


MODELS = {"arch-llama3": write_llama3, "arch-qwen2": write_qwen2, "arch-qwen3": write_qwen3,
          "arch-gemma2": write_gemma2, "arch-gemma3": write_gemma3, "arch-phi3": write_phi3,
          "arch-smollm3": write_smollm3, "arch-qwen3moe": write_qwen3moe,
          "arch-mixtral": write_mixtral, "arch-olmoe": write_olmoe,
          "arch-qwen2moe": write_qwen2moe}


def main():
    if "--bench-moe" in sys.argv:
        path = pathlib.Path(sys.argv[sys.argv.index("--bench-moe") + 1])
        write_bench_moe(path)
        print(f"make-arch-models: {path} ({path.stat().st_size >> 20} MiB)", file=sys.stderr)
        return
    if "--bench-dense" in sys.argv:
        at = sys.argv.index("--bench-dense")
        path = pathlib.Path(sys.argv[at + 1])
        ftype = sys.argv[at + 2] if len(sys.argv) > at + 2 else "Q4_K_M"
        write_bench_dense(path, ftype)
        print(f"make-arch-models: {path} ({path.stat().st_size >> 20} MiB)", file=sys.stderr)
        return
    only = set(sys.argv[sys.argv.index("--only") + 1:]) if "--only" in sys.argv else None
    OUT.mkdir(parents=True, exist_ok=True)
    manifest_path = OUT / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}

    def want(name):
        return only is None or name in only

    needed = {n for n in MODELS if want(n)}
    needed |= {src for n, (src, _) in QUANTIZED.items() if want(n)}
    for name, write in MODELS.items():
        if name not in needed:
            continue
        path = OUT / f"{name}.gguf"
        write(path)
        manifest[path.name] = sha256(path)
        print(f"make-arch-models: {path} ({path.stat().st_size >> 10} KiB)", file=sys.stderr)
    for name, (src, ftype) in QUANTIZED.items():
        if not want(name):
            continue
        dst = OUT / f"{name}.gguf"
        quantize(OUT / f"{src}.gguf", dst, ftype, False)
        manifest[dst.name] = sha256(dst)
        print(f"make-arch-models: {dst} ({dst.stat().st_size >> 10} KiB)", file=sys.stderr)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(OUT)


if __name__ == "__main__":
    main()
