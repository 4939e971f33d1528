#!/usr/bin/env python3
"""Write the quantized test models of gpu-pipeline's `tests/quant_models.rs`.

1. Random-weight Llama-architecture models (deterministic seed), written as F32 GGUF with the
   `gguf` package (llama.cpp's tensor names and metadata; the default model's tokenizer), all
   matrix dimensions multiples of 256 so the K-quants apply: `tiny-tied` (output head tied to
   the embedding) and `tiny-untied`.
2. Each is quantized by llama.cpp's own quantizer (`llama_cpp.llama_model_quantize`) into every
   format of FORMATS_TINY, including the Q*_K_S/M/L mixes.
3. The default model (SmolLM2-135M-Instruct Q4_1, n_embd 576: llama.cpp's K-quant mixes fall
   back to Q5_0/Q5_1/Q8_0 for its rows) is requantized (`allow_requantize`) into FORMATS_DEFAULT.

Output: $ZEROLAYER_TEST_MODELS or ~/.cache/zerolayer/test-models/<name>.gguf, and a manifest
(`manifest.json`: file name -> sha256) there. Same llama.cpp release, same files: the fixtures
(`scripts/fixtures/gpu-pipeline-quant-fixtures.py`) record each file's sha256 and the test checks
it, so a different quantizer build is reported as such.

usage: make_test_models.py [--only NAME...]
"""
import hashlib
import json
import os
import pathlib
import sys

import numpy as np
import gguf
import llama_cpp.llama_cpp as llama_c

OUT = pathlib.Path(os.environ.get("ZEROLAYER_TEST_MODELS",
                                  os.path.expanduser("~/.cache/zerolayer/test-models")))
SEED = 20261203
FORMATS_TINY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L",
                "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS"]
FORMATS_DEFAULT = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q3_K_M", "Q2_K", "IQ4_NL", "IQ4_XS"]
TINY = dict(n_embd=256, n_ff=768, n_layer=2, n_head=4, n_head_kv=2, n_ctx=512)


def default_model():
    if os.environ.get("ZEROLAYER_MODEL"):
        return os.environ["ZEROLAYER_MODEL"]
    home = os.environ.get("ZEROLAYER_HOME", os.path.expanduser("~/.cache/zerolayer/models"))
    return os.path.join(home, "SmolLM2-135M-Instruct.Q4_1.gguf")


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def field(reader, key):
    f = reader.fields[key]
    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    return f.parts[f.data[0]].tolist()[0]


def write_tiny(path, tied):
    """A random-weight Llama model with the default model's tokenizer."""
    src = gguf.GGUFReader(default_model())
    tokens = field(src, "tokenizer.ggml.tokens")
    vocab = len(tokens)
    rng = np.random.default_rng(SEED + (0 if tied else 1))
    d, ff, hd = TINY["n_embd"], TINY["n_ff"], TINY["n_embd"] // TINY["n_head"]
    kv = hd * TINY["n_head_kv"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("zerolayer-tiny-" + ("tied" if tied else "untied"))
    w.add_context_length(TINY["n_ctx"])
    w.add_embedding_length(d)
    w.add_block_count(TINY["n_layer"])
    w.add_feed_forward_length(ff)
    w.add_head_count(TINY["n_head"])
    w.add_head_count_kv(TINY["n_head_kv"])
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model(field(src, "tokenizer.ggml.model"))
    w.add_tokenizer_pre(field(src, "tokenizer.ggml.pre"))
    w.add_token_list(tokens)
    w.add_token_types(field(src, "tokenizer.ggml.token_type"))
    w.add_token_merges(field(src, "tokenizer.ggml.merges"))
    w.add_bos_token_id(field(src, "tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(field(src, "tokenizer.ggml.eos_token_id"))

    def mat(rows, cols, scale=1.0):
        return (rng.standard_normal((rows, cols), dtype=np.float32)
                * np.float32(scale / np.sqrt(cols)))

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    # Embedding rows of norm ~ sqrt(d)*0.5; a tied head then gives logits of std ~2-3, so top-2
    # gaps above 0.5 are common (the test's decisive positions).
    w.add_tensor("token_embd.weight", mat(vocab, d, np.sqrt(d) * 0.15))
    for i in range(TINY["n_layer"]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(d))
        w.add_tensor(p + "attn_q.weight", mat(d, d))
        w.add_tensor(p + "attn_k.weight", mat(kv, d))
        w.add_tensor(p + "attn_v.weight", mat(kv, d))
        w.add_tensor(p + "attn_output.weight", mat(d, d, 0.5))
        w.add_tensor(p + "ffn_norm.weight", norm(d))
        w.add_tensor(p + "ffn_gate.weight", mat(ff, d))
        w.add_tensor(p + "ffn_up.weight", mat(ff, d))
        w.add_tensor(p + "ffn_down.weight", mat(d, ff, 0.5))
    w.add_tensor("output_norm.weight", norm(d))
    if not tied:
        w.add_tensor("output.weight", mat(vocab, d, 3.0))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(src, dst, ftype_name, requantize):
    params = llama_c.llama_model_quantize_default_params()
    params.nthread = 2
    params.ftype = getattr(llama_c, "LLAMA_FTYPE_MOSTLY_" + ftype_name)
    params.allow_requantize = requantize
    rc = llama_c.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        sys.exit(f"llama_model_quantize {src} -> {ftype_name} failed: {rc}")


def main():
    only = set(sys.argv[sys.argv.index("--only") + 1:]) if "--only" in sys.argv else None
    OUT.mkdir(parents=True, exist_ok=True)
    manifest_path = OUT / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}

    def want(name):
        return only is None or name in only

    jobs = []
    for tied in (True, False):
        base = "tiny-" + ("tied" if tied else "untied")
        f32 = OUT / f"{base}.F32.gguf"
        if any(want(f"{base}.{q}") for q in FORMATS_TINY) or want(f"{base}.F32"):
            write_tiny(f32, tied)
            manifest[f32.name] = sha256(f32)
        for q in FORMATS_TINY:
            jobs.append((f"{base}.{q}", f32, q, False))
    for q in FORMATS_DEFAULT:
        jobs.append((f"smollm2.{q}", pathlib.Path(default_model()), q, True))
    for name, src, q, requant in jobs:
        if not want(name):
            continue
        dst = OUT / f"{name}.gguf"
        quantize(src, dst, q, requant)
        manifest[dst.name] = sha256(dst)
        print(f"make-test-models: {dst} ({dst.stat().st_size >> 10} KiB)", file=sys.stderr)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(OUT)


if __name__ == "__main__":
    main()
