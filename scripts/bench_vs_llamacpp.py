"""Driver of scripts/bench-vs-llamacpp (needs: llama-cpp-python, numpy).

Each side runs in its own subprocess (so peak RSS is its own): prompt processing of a 512-token
prompt, generation of 128 tokens, time to first token of a 42-token chat prompt. Around each
phase the CPU time of all processes (/proc/stat) minus the measured process's own (getrusage
of the child) gives the CPU time others used, and /proc/stat's steal column the time the
hypervisor gave this VM's CPUs to other guests; a phase where either exceeds 1 s is flagged
"CONTAMINATED".

`--rounds N` runs both sides N times, alternated (zerolayer, llama.cpp, zerolayer, ...), and
reports each figure's median with the per-round values, each ratio as the ratio of the medians
(and, per figure, the median of the same-round ratios: a round's two sides ran back to back);
with `--probe BIN` (examples/bandwidth) the read bandwidth is measured before every round and its
median used for the shares of the ceiling.
"""

import argparse
import json
import os
import statistics
import pathlib
import subprocess
import tempfile
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
HZ = os.sysconf("SC_CLK_TCK")

LLAMA_SIDE = r"""
import json, sys, time, resource
import llama_cpp, llama_cpp.llama_cpp as C
a = json.loads(sys.argv[1])
orig = C.llama_model_default_params
def p2():
    x = orig(); x.use_extra_bufts = False; return x
C.llama_model_default_params = p2 if a["no_extra"] else orig
llm = llama_cpp.Llama(a["model"], n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=a["threads"],
                      n_threads_batch=a["threads"], flash_attn=True, verbose=False)
out = {}
ids = a["pp_ids"]
llm.reset(); t = time.perf_counter(); llm.eval(ids); out["pp_s"] = time.perf_counter() - t
llm.reset(); t = time.perf_counter(); llm.eval(a["chat_ids"]); tok = int(llm.scores[llm.n_tokens - 1].argmax())
out["ttft_s"] = time.perf_counter() - t
t = time.perf_counter()
for _ in range(a["gen"]):
    llm.eval([tok]); tok = int(llm.scores[llm.n_tokens - 1].argmax())
out["gen_s"] = time.perf_counter() - t
print(json.dumps(out))
"""


def cpu_total():
    """(CPU seconds busy in all processes, CPU seconds stolen by the hypervisor) so far."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    # user nice system irq softirq; steal
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / HZ, v[7] / HZ


class Others:
    """CPU time other processes used and the hypervisor stole while one phase ran."""

    def __init__(self, busy, steal):
        self.busy, self.steal = busy, steal

    def worst(self, other):
        return Others(max(self.busy, other.busy), max(self.steal, other.steal))


def run_measured(cmd):
    """Runs `cmd`; returns (result with stdout/stderr, `Others` meanwhile, this child's own peak
    RSS in MiB, from wait4: not the maximum over all children so far)."""
    before, steal_before = cpu_total()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        after, steal_after = cpu_total()
        out.seek(0)
        err.seek(0)
        res = subprocess.CompletedProcess(cmd, p.returncode, out.read(), err.read())
    if res.returncode != 0:
        sys.exit(f"{cmd[0]} failed: {res.stderr[-2000:]}")
    own = ru.ru_utime + ru.ru_stime
    others = Others(max(0.0, after - before - own), steal_after - steal_before)
    return res, others, ru.ru_maxrss / 1024


def ours(a, pp_ids, chat_ids):
    env = dict(os.environ, ZEROLAYER_THREADS=str(a.threads))
    res = {}
    others = {}
    base = [a.bin, "generate", "--model", a.model, "--threads", str(a.threads), "--timings", "--json", "--ignore-eos"]
    # prompt processing: 512 ids, 1 generated token
    p, o, rss1 = run_measured(base + ["--prompt-ids", ",".join(map(str, pp_ids)), "--max-tokens", "1"])
    res["pp_tok_s"] = float(p.stderr.split("(")[1].split(" tok/s")[0])
    others["pp"] = o
    p, o, rss2 = run_measured(base + ["--prompt-ids", ",".join(map(str, chat_ids)), "--max-tokens", str(a.gen)])
    line = [l for l in p.stderr.splitlines() if "time to first token" in l][-1]
    res["ttft_ms"] = float(line.split("time to first token ")[1].split(" ms")[0])
    res["gen_tok_s"] = float(line.split("generated, ")[1].split(" tok/s")[0])
    others["gen"] = o
    res["rss_mib"] = max(rss1, rss2)
    return res, others


def llama(a, pp_ids, chat_ids):
    arg = json.dumps({"model": a.model, "threads": a.threads, "pp_ids": pp_ids, "chat_ids": chat_ids,
                      "gen": a.gen, "no_extra": 1})
    # use_extra_bufts=False: llama.cpp's AMX buffer type crashed (SIGSEGV) on the Sapphire Rapids
    # machine this was written on; Q4_1 has no repacked path otherwise.
    p, o, rss = run_measured([sys.executable, "-c", LLAMA_SIDE, arg])
    r = json.loads(p.stdout.strip().splitlines()[-1])
    return {"pp_tok_s": len(pp_ids) / r["pp_s"], "gen_tok_s": a.gen / r["gen_s"], "ttft_ms": r["ttft_s"] * 1e3,
            "rss_mib": rss}, {"all": o}


def model_facts(model):
    """(vocabulary size, total tensor bytes, weight bytes a decode step reads, weight
    multiply-adds per token): every tensor, except the embedding table when the model has a
    separate output head (only one row of it is read per token), and of a mixture of experts'
    stacked `*_exps` tensors the used fraction (expert_used_count / expert_count): the active
    parameters' bytes; the multiply-adds are those tensors' elements that are matrices (2-D or
    more: the products of a prompt token; attention's own products not counted)."""
    import gguf
    r = gguf.GGUFReader(model)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def meta(key):
        f = r.fields.get(f"{arch}.{key}")
        return int(f.parts[-1][0]) if f is not None else 0
    experts, used = meta("expert_count"), meta("expert_used_count")
    names = {t.name for t in r.tensors}
    active = macs = 0
    for t in r.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        share = (used, experts) if "_exps" in t.name and experts else (1, 1)
        active += int(t.n_bytes) * share[0] // share[1]
        if sum(int(x) > 1 for x in t.shape) >= 2:
            macs += int(t.n_elements) * share[0] // share[1]
    vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    return vocab, sum(int(t.n_bytes) for t in r.tensors), active, macs


def budgeted(a, chat_ids, unbudgeted, total_bytes):
    """Generation with the file's residency kept within a.budget of its size (a weight cache
    enforcing it every 100 ms): one run to record the access profile, then one measured run
    warmed from it. Prints its tok/s against the unbudgeted run's."""
    prof = pathlib.Path(a.model).with_suffix(".bench-profile")
    prof.unlink(missing_ok=True)
    base = [a.bin, "generate", "--model", a.model, "--threads", str(a.threads), "--timings", "--json",
            "--ignore-eos", "--weight-budget", str(a.budget), "--weight-profile", str(prof),
            "--prompt-ids", ",".join(map(str, chat_ids)), "--max-tokens", str(a.gen)]
    run_measured(base)
    p, other, _ = run_measured(base)
    line = [l for l in p.stderr.splitlines() if "time to first token" in l][-1]
    gen = float(line.split("generated, ")[1].split(" tok/s")[0])
    cache = [l for l in p.stderr.splitlines() if l.startswith("weight cache:")][-1]
    print(f"generation with residency <= {100 * a.budget:.0f}% of {total_bytes / 1e6:.0f} MB: "
          f"{gen:.1f} tok/s vs {unbudgeted['gen_tok_s']:.1f} unbudgeted (ratio "
          f"{gen / unbudgeted['gen_tok_s']:.2f}); other processes' CPU "
          f"{other.busy:.2f} s, steal {other.steal:.2f} s\n  {cache}")
    prof.unlink(missing_ok=True)


def peer_isa(generic_ok):
    """Prints the peer's build (llama.cpp's system info) and refuses a peer compiled without the
    AVX-512 this CPU has: pip reuses a cached wheel whatever CMAKE_ARGS say, e.g. the
    GGML_NATIVE=OFF build scripts/make-test-models makes for its quantizer (AVX2 only), and
    every ratio measured against it would flatter zerolayer. --generic-peer measures against
    it anyway (labelled)."""
    info = subprocess.run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    flags = pathlib.Path("/proc/cpuinfo").read_text().split("\nflags", 1)[-1].split("\n", 1)[0].split()
    host = "AVX-512" if "avx512f" in flags else "no AVX-512"
    print(f"llama.cpp peer ({sys.executable}): {info}")
    if "avx512f" in flags and "AVX512 = 1" not in info:
        msg = ("the llama.cpp peer was built without AVX-512, which this CPU has: rebuild it natively "
               "(CMAKE_ARGS=-DGGML_NATIVE=ON pip install --no-cache-dir --no-binary llama-cpp-python "
               "llama-cpp-python==0.3.36) or pass --generic-peer")
        if not generic_ok:
            sys.exit(f"bench_vs_llamacpp: {msg}")
        print(f"WARNING: {msg}; measuring against it anyway (--generic-peer)")
    else:
        print(f"host CPU: {host}; the peer's build matches it")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--busy-pid", type=int, default=0)
    ap.add_argument("--bandwidth", default="", help="examples/bandwidth's JSON line")
    ap.add_argument("--budget", type=float, default=0.0,
                    help="also generate with the model file's residency within this fraction")
    ap.add_argument("--rounds", type=int, default=1, help="alternated runs per side; medians reported")
    ap.add_argument("--probe", default="", help="examples/bandwidth: measure the read bandwidth each round")
    ap.add_argument("--facts", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--generic-peer", action="store_true",
                    help="accept a llama.cpp built without this CPU's AVX-512 (see peer_isa)")
    a = ap.parse_args()
    if a.facts:
        print(json.dumps(model_facts(a.model)))
        return
    peer_isa(a.generic_peer)
    # In a child: reading the GGUF grows this process, and a child's peak RSS (ru_maxrss)
    # starts from its parent's at fork, which would then inflate every figure measured below.
    facts = subprocess.run([sys.executable, __file__, "--facts", "--model", a.model, "--bin", a.bin],
                           capture_output=True, text=True, check=True).stdout
    vocab, total_bytes, per_token, macs = json.loads(facts)
    fx = json.loads((ROOT / "crates/gpu-pipeline/tests/fixtures/model-ppl.json").read_text())
    pp_ids = fx["ci_ids"][:512]
    teach = json.loads((ROOT / "crates/gpu-pipeline/tests/fixtures/model-teacher.json").read_text())
    chat = next(s["prompt_ids"] for s in teach["sequences"] if len(s["prompt_ids"]) >= 35)
    chat_ids = (chat + fx["ci_ids"])[:42] if len(chat) < 42 else chat[:42]
    # The fixtures are the default model's ids: folded into a smaller vocabulary.
    pp_ids, chat_ids = [i % vocab for i in pp_ids], [i % vocab for i in chat_ids]
    rounds_o, rounds_l, bws, peaks = [], [], [], []
    o_oth, l_oth = {}, {}
    for _ in range(max(1, a.rounds)):
        if a.probe:
            probe = json.loads(subprocess.run([a.probe, str(a.threads)], capture_output=True, text=True,
                                              check=True).stdout.strip().splitlines()[-1])
            bws.append(probe["best_gbs"])
            if probe.get("int8_gops") is not None:
                peaks.append((probe["int8_gops"], probe["int8_block_gops"]))
        r, oth = ours(a, pp_ids, chat_ids)
        rounds_o.append(r)
        o_oth = {k: v.worst(o_oth[k]) if k in o_oth else v for k, v in oth.items()}
        r, oth = llama(a, pp_ids, chat_ids)
        rounds_l.append(r)
        l_oth = {k: v.worst(l_oth[k]) if k in l_oth else v for k, v in oth.items()}
    o = {k: statistics.median(r[k] for r in rounds_o) for k in rounds_o[0]}
    l = {k: statistics.median(r[k] for r in rounds_l) for k in rounds_l[0]}
    n = len(rounds_o)
    print(f"threads {a.threads}; model {os.path.basename(a.model)}; busy competitor: {bool(a.busy_pid)}"
          + (f"; medians of {n} alternated rounds" if n > 1 else ""))
    print(f"{'metric':<28}{'zerolayer':>12}{'llama.cpp':>12}{'ratio':>8}")
    for k, name, better in [("pp_tok_s", "prompt 512 tok/s", "hi"), ("gen_tok_s", f"generation {a.gen} tok/s", "hi"),
                            ("ttft_ms", "time to first token (ms)", "lo"), ("rss_mib", "peak RSS (MiB)", "lo")]:
        print(f"{name:<28}{o[k]:>12.1f}{l[k]:>12.1f}{o[k] / l[k]:>8.2f}")
    if n > 1:
        for k in ["pp_tok_s", "gen_tok_s", "ttft_ms"]:
            paired = statistics.median(o_r[k] / l_r[k] for o_r, l_r in zip(rounds_o, rounds_l))
            print(f"  rounds {k}: zerolayer {' '.join(f'{r[k]:.1f}' for r in rounds_o)}; "
                  f"llama.cpp {' '.join(f'{r[k]:.1f}' for r in rounds_l)}; "
                  f"median of the same-round ratios {paired:.2f}")
    if bws:
        print(f"read bandwidth per round (GB/s): {' '.join(f'{b:.1f}' for b in bws)}")
    if bws or a.bandwidth:
        bw = statistics.median(bws) if bws else json.loads(a.bandwidth)["best_gbs"]
        print(f"decode reads {per_token / 1e6:.1f} MB of weights per token (active parameters; "
              f"{100 * per_token / total_bytes:.1f}% of the {total_bytes / 1e6:.0f} MB of tensors); "
              f"machine read bandwidth "
              f"{bw:.1f} GB/s -> ceiling {bw * 1e9 / per_token:.0f} tok/s")
        for side, r in [("zerolayer", o), ("llama.cpp", l)]:
            gbs = r["gen_tok_s"] * per_token / 1e9
            print(f"{side} generation: {gbs:.1f} GB/s of weights = {100 * gbs / bw:.0f}% of the read bandwidth")
    if peaks:
        # The prompt's products against the machine's int8 ceiling, measured by the probe in
        # each round (examples/bandwidth: vpdpbusd on registers; with the kernels' exact
        # per-block scaling).
        peak = statistics.median(p for p, _ in peaks)
        block = statistics.median(b for _, b in peaks)
        kernels = os.environ.get("ZEROLAYER_KERNELS", "").strip().lower()
        note = (f" (the CPU's AVX-512 VNNI peak; ZEROLAYER_KERNELS={kernels} runs kernels without it)"
                if kernels and kernels != "avx512" else "")
        print(f"prompt products: {2 * macs / 1e9:.2f} G int8 operations per token (weight multiply-adds "
              f"x 2; attention not counted); int8 peak per round (GOP/s): "
              f"{' '.join(f'{p:.0f}' for p, _ in peaks)}, with the exact per-block scaling "
              f"{' '.join(f'{b:.0f}' for _, b in peaks)}{note}")
        for side, r in [("zerolayer", o), ("llama.cpp", l)]:
            gops = r["pp_tok_s"] * 2 * macs / 1e9
            print(f"{side} prompt: {gops:.0f} GOP/s of products = {100 * gops / peak:.0f}% of the int8 peak "
                  f"({100 * gops / block:.0f}% of the per-block ceiling)")
    if a.budget > 0:
        budgeted(a, chat_ids, o, total_bytes)
    for side, oth in [("zerolayer", o_oth), ("llama.cpp", l_oth)]:
        for phase, x in oth.items():
            flag = "" if a.busy_pid else (" CONTAMINATED" if x.busy > 1.0 else "")
            flag += " CONTAMINATED (steal)" if x.steal > 1.0 else ""
            worst = " (worst round)" if n > 1 else ""
            print(f"other processes' CPU during {side} {phase}{worst}: {x.busy:.2f} s, "
                  f"hypervisor steal {x.steal:.2f} s{flag}")


if __name__ == "__main__":
    main()
