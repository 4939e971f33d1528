"""Driver of scripts/bench-serving (needs: llama-cpp-python with its server extra, matplotlib).

For each scenario: start `zerolayer serve`, warm it up, run examples/loadgen over
claudelink, HTTP/3 and HTTP/1.1 (and, in scenario 1, wrk over HTTP/1.1), stop it; then start
llama.cpp's server (llama-cpp-python) and run loadgen against it (HTTP/1.1, OpenAI API). Around
each run the CPU time of all processes (/proc/stat) minus the server's (/proc/PID/stat) and the
load generator's own (rusage of the child) gives the CPU time others used; a run where others
used more than 10% of one core is flagged CONTAMINATED. The server's peak RSS per run is its
VmHWM after the run, reset before it (/proc/PID/clear_refs, "5").
"""

import argparse
import ctypes
import datetime
import json
import os
import pathlib
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
HZ = os.sysconf("SC_CLK_TCK")
MODEL_ID = "smollm2"
TRANSPORTS = ["claudelink", "h3", "http1", "llama-server", "llamacpp"]
# The peers, both llama.cpp over its OpenAI API on HTTP/1.1: `llama-server` (llama.cpp's own
# server, built by scripts/build-llama-server: parallel slots, continuous batching) and
# `llamacpp` (llama-cpp-python's server: one sequence at a time).
PEERS = ["llama-server", "llamacpp"]
# Durations: loadgen starts new requests for `duration` seconds, then waits for the requests in
# flight, each cut at `timeout` seconds (counted as errors of kind "timeout"), so a run takes up to
# duration + timeout. At ~100-150 generated tok/s in all, a round of 100 clients x 32 tokens takes
# ~25 s and one of 500 clients ~2 minutes: the timeouts bound the runs so that the whole benchmark
# fits in 10 minutes; in scenario 3 most requests are expected to time out.
SCENARIOS = [
    {"key": "qa", "title": "simple Q&A", "prompt": "qa", "max_tokens": 32, "concurrency": 100,
     "connections": {}, "full": (20, 30), "quick": (3, 5)},
    {"key": "doc", "title": "long-document summary", "prompt": "doc", "max_tokens": 64,
     "concurrency": 8, "connections": {}, "full": (15, 30), "quick": (4, 6),
     "warmup": (1, 1, 60)},  # one request, up to 60 s: a cold 1,200-token prefill is slow
    # 500 clients over few connections: 4 QUIC connections for claudelink and HTTP/3; HTTP/1.1
    # cannot multiplex, so there each client keeps its own keep-alive connection.
    {"key": "chat", "title": "high-concurrency chat", "prompt": "qa", "max_tokens": 32,
     "concurrency": 500, "connections": {"claudelink": 4, "h3": 4}, "full": (5, 30), "quick": (1, 4)},
]
WRK_DURATION = {"full": 30, "quick": 6}
# Single stream: one client, sequential requests for D seconds, each up to 128 tokens (greedy).
SINGLE = {"max_tokens": 128, "full": 12, "quick": 5, "generate_runs": 3}
SINGLE_TEXT = ("Write a long, detailed story about a lighthouse keeper who finds a message in a bottle "
               "and sets out to find who wrote it.")  # wrk drops what is in flight at its end: > one round
PROMPT_TARGETS = {"qa": 42, "doc": 1200}  # total input tokens, chat template included
DEFAULT_CONNECTIONS = {"claudelink": 4, "h3": 4}  # loadgen's defaults; HTTP/1.1: one per client

QA_TEXT = ("What are three simple things I can do every morning to feel more awake and focused at "
           "work, and why does each of them help? Please keep the answer short and practical, with "
           "one sentence for each idea.")
QA_CANDIDATES = [  # whole questions; the one nearest the target wins (else a cut of QA_TEXT)
    "How can I feel more awake in the morning?",
    "What are three simple ways to feel more awake in the morning?",
    "What are three simple things I can do to feel more awake in the morning?",
    "What are three simple things I can do every morning to feel more awake and focused at work?",
    "What are three simple things I can do every morning to feel more awake and focused at work, "
    "and why does each of them help?",
]
DOC_INSTRUCTION = "Summarize the following document in three sentences.\n\n"

LLAMA_WRAPPER = r"""
import runpy, sys
import llama_cpp.llama_cpp as C
_orig = C.llama_model_default_params
def _params():
    p = _orig()
    # As scripts/bench_vs_llamacpp.py: llama.cpp's extra (AMX) buffer types crashed on a Sapphire
    # Rapids machine; Q4_1 has no repacked path otherwise, so this changes nothing elsewhere.
    if hasattr(p, "use_extra_bufts"):
        p.use_extra_bufts = False
    return p
C.llama_model_default_params = _params
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""

WRK_LUA = r"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["anthropic-version"] = "2023-06-01"
wrk.body = [==[@BODY@]==]
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRKJSON {"requests":%.0f,"duration_us":%.0f,"connect":%.0f,"read":%.0f,' ..
    '"write":%.0f,"status":%.0f,"timeout":%.0f,"p50_us":%.0f,"p90_us":%.0f,"p99_us":%.0f,' ..
    '"mean_us":%.0f,"max_us":%.0f}\n', summary.requests, summary.duration, e.connect, e.read,
    e.write, e.status, e.timeout, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.mean, latency.max))
end
"""


def log(msg):
    print(f"bench-serving: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- processes

_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent():
    _libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the child gets SIGTERM when we die


class Children:
    """Live child pids, mirrored in the pid file the bash entry point's trap reads."""

    def __init__(self, pidfile):
        self.pidfile = pidfile
        self.pids = set()
        self.lock = threading.Lock()

    def _write(self):
        if self.pidfile:
            pathlib.Path(self.pidfile).write_text("".join(f"{p}\n" for p in sorted(self.pids)))

    def add(self, pid):
        with self.lock:
            self.pids.add(pid)
            self._write()

    def remove(self, pid):
        with self.lock:
            self.pids.discard(pid)
            self._write()


CHILDREN = Children(None)


def spawn(cmd, stdout, stderr, env=None):
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env,
                         preexec_fn=_die_with_parent)
    CHILDREN.add(p.pid)
    return p


def stop(p, grace=5.0):
    if p is None:
        return
    if p.poll() is None:
        try:
            p.terminate()
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    CHILDREN.remove(p.pid)


def run_child(cmd, stdout_path, stderr_path, timeout):
    """Runs cmd to completion (SIGINT at `timeout`, SIGKILL 5 s later). Returns (exit code,
    the child's own CPU seconds from its rusage, timed out?, wall seconds)."""
    with open(stdout_path, "wb") as so, open(stderr_path, "wb") as se:
        t0 = time.monotonic()
        p = spawn(cmd, so, se)
        fired = threading.Event()

        def on_timeout():
            fired.set()
            try:
                os.kill(p.pid, signal.SIGINT)
            except ProcessLookupError:
                return
            killer = threading.Timer(5.0, lambda: _kill_quiet(p.pid))
            killer.daemon = True
            killer.start()

        timer = threading.Timer(timeout, on_timeout)
        timer.daemon = True
        timer.start()
        try:
            _, status, ru = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
        wall = time.monotonic() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        CHILDREN.remove(p.pid)
    return p.returncode, ru.ru_utime + ru.ru_stime, fired.is_set(), wall


def _kill_quiet(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def cpu_total():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / HZ  # user nice system irq softirq


def proc_cpu(pid):
    try:
        s = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = s[s.rindex(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / HZ  # utime stime


def vm_hwm_mib(pid):
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_hwm(pid):
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def settle(pid, max_s):
    """Waits until the server uses under 5% of a core over a second (leftover work of the last
    run). Returns (seconds waited, settled?)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < max_s:
        c0 = proc_cpu(pid)
        time.sleep(1.0)
        c1 = proc_cpu(pid)
        if c0 is None or c1 is None:
            return time.monotonic() - t0, False
        if c1 - c0 < 0.05:
            return time.monotonic() - t0, True
    return time.monotonic() - t0, False


def free_port(kind):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM if kind == "tcp" else socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def http_ok(url, timeout=2.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def tail(path, n=15):
    try:
        return "\n".join(pathlib.Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ---------------------------------------------------------------- servers

class ServerProc:
    """A server subprocess (`self.p`) with its log file (`self.logf`)."""
    GRACE = 5.0

    @property
    def pid(self):
        return self.p.pid

    def alive(self):
        return self.p.poll() is None

    def stop(self):
        stop(self.p, grace=self.GRACE)
        self.logf.close()


class OurServer(ServerProc):
    def __init__(self, a, tag):
        self.log = a.out / "logs" / f"server-{tag}.log"
        http_port, quic_port = free_port("tcp"), free_port("udp")
        # Served under the same id as llama.cpp's --model_alias, so one request body fits both.
        self.cmd = [a.server_bin, "serve", "--model", a.model, "--model-id", MODEL_ID,
                    "--http-listen", f"127.0.0.1:{http_port}",
                    "--quic-listen", f"127.0.0.1:{quic_port}", "--threads", str(a.threads),
                    "--max-streams", "1024", "--drain-secs", "2"]
        env = dict(os.environ)
        env.pop("ZEROLAYER_API_KEYS", None)  # open server
        self.logf = open(self.log, "wb")
        t0 = time.monotonic()
        self.p = spawn(self.cmd, self.logf, subprocess.STDOUT, env=env)
        self.fingerprint = self.http = self.quic = None
        while True:
            if self.p.poll() is not None:
                raise RuntimeError(f"our server exited ({self.p.returncode}) before it was ready; "
                                   f"log {self.log}:\n{tail(self.log)}")
            if time.monotonic() - t0 > 300:
                raise RuntimeError(f"our server not ready after 300 s; log {self.log}:\n{tail(self.log)}")
            text = self.log.read_text(errors="replace")
            m = re.search(r"fingerprint ([0-9A-Fa-f]{2}(?::[0-9A-Fa-f]{2})+)", text)
            n = re.search(r"listening http=(\S+) quic=(\S+)", text)
            if m and n:
                self.fingerprint, self.http, self.quic = m.group(1), n.group(1), n.group(2)
                if http_ok(f"http://{self.http}/health"):
                    break
            time.sleep(0.25)
        self.ready_s = time.monotonic() - t0
        log(f"our server ready in {self.ready_s:.1f} s (http {self.http}, quic {self.quic})")



class LlamaServer(ServerProc):
    def __init__(self, a, tag):
        self.log = a.out / "logs" / f"llamacpp-{tag}.log"
        port = free_port("tcp")
        self.http = f"127.0.0.1:{port}"
        self.cmd = [a.python, "-c", LLAMA_WRAPPER, "--model", a.model, "--host", "127.0.0.1",
                    "--port", str(port), "--n_threads", str(a.threads), "--n_threads_batch",
                    str(a.threads), "--n_ctx", "2048", "--model_alias", MODEL_ID,
                    "--interrupt_requests", "false"]
        self.logf = open(self.log, "wb")
        t0 = time.monotonic()
        self.p = spawn(self.cmd, self.logf, subprocess.STDOUT)
        while not http_ok(f"http://{self.http}/v1/models"):
            if self.p.poll() is not None:
                raise RuntimeError(f"llama.cpp's server exited ({self.p.returncode}); log {self.log}:\n"
                                   f"{tail(self.log)}")
            if time.monotonic() - t0 > 180:
                raise RuntimeError(f"llama.cpp's server not ready after 180 s; log {self.log}:\n"
                                   f"{tail(self.log)}")
            time.sleep(0.25)
        self.ready_s = time.monotonic() - t0
        log(f"llama.cpp's server ready in {self.ready_s:.1f} s (http {self.http})")

    GRACE = 3.0


class NativeLlamaServer(ServerProc):
    """llama.cpp's own `llama-server`: one slot per concurrent client (up to 100, as a user
    serving many streams would configure it), continuous batching, a context of `slot_ctx` tokens
    per slot (prompt + output of the scenario, rounded up), same threads as ours.

    llama.cpp's weight repacking (its extra CPU buffer types) is on, as a user gets it; where it
    dies at start-up with SIGILL (its AMX buffer type on a VM that does not grant AMX state:
    seen on an Intel Xeon VM, the same crash `scripts/bench_vs_llamacpp.py` avoids with
    use_extra_bufts off), it is restarted with `--no-repack` and the tables say so."""
    GRACE = 3.0

    def __init__(self, a, sc, tag):
        self.log = a.out / "logs" / f"llama-server-{tag}.log"
        slots = min(sc["concurrency"], 100)
        slot_ctx = 1536 if sc["prompt"] == "doc" else 256
        for extra in ([], ["--no-repack"]):
            port = free_port("tcp")
            self.http = f"127.0.0.1:{port}"
            self.cmd = [a.llama_server_bin, "-m", a.model, "--host", "127.0.0.1", "--port", str(port),
                        "-t", str(a.threads), "-tb", str(a.threads), "-np", str(slots), "-cb",
                        "-c", str(slots * slot_ctx), "--alias", MODEL_ID, "--jinja"] + extra
            if self.start(slots) != -signal.SIGILL:
                return
            log("llama-server died of SIGILL with weight repacking on; again with --no-repack")

    def start(self, slots):
        """Starts the server; returns None once it is ready, or the exit status it died with."""
        self.logf = open(self.log, "wb")
        t0 = time.monotonic()
        self.p = spawn(self.cmd, self.logf, subprocess.STDOUT)
        while not http_ok(f"http://{self.http}/health"):
            if self.p.poll() is not None:
                if self.p.returncode == -signal.SIGILL and "--no-repack" not in self.cmd:
                    stop(self.p)
                    self.logf.close()
                    return -signal.SIGILL
                raise RuntimeError(f"llama-server exited ({self.p.returncode}); log {self.log}:\n"
                                   f"{tail(self.log)}")
            if time.monotonic() - t0 > 180:
                raise RuntimeError(f"llama-server not ready after 180 s; log {self.log}:\n{tail(self.log)}")
            time.sleep(0.25)
        self.ready_s = time.monotonic() - t0
        log(f"llama-server ready in {self.ready_s:.1f} s (http {self.http}, {slots} slots)")
        return None


# ---------------------------------------------------------------- prompts

def count_tokens(http, text):
    body = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": text}]}).encode()
    req = urllib.request.Request(f"http://{http}/v1/messages/count_tokens", data=body, method="POST",
                                 headers={"content-type": "application/json",
                                          "anthropic-version": "2023-06-01"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return int(json.load(r)["input_tokens"])


def document_words():
    p = pathlib.Path("/usr/share/common-licenses/GPL-3")
    if p.exists():
        words = p.read_text(errors="replace").split()
        if len(words) > 2000:
            return words, "the GNU GPL v3 text (/usr/share/common-licenses/GPL-3)"
    rng = random.Random(7)
    subj = ["The committee", "Our team", "The city council", "A small group of engineers", "The report",
            "Every new member", "The river authority", "The museum", "Local farmers", "The school board"]
    verb = ["reviewed", "proposed", "rejected", "published", "measured", "described", "questioned",
            "funded", "postponed", "approved"]
    obj = ["a plan to repair the old bridge", "the budget for the coming year", "new rules for parking",
           "the results of the water survey", "a program of evening classes", "the design of the park",
           "a study of traffic on the main road", "the schedule of the summer festival",
           "a proposal to plant more trees", "the cost of the new library"]
    tail_ = ["after a long public debate.", "in a short statement on Monday.", "despite strong objections.",
             "with the support of most residents.", "because of rising costs.", "for the third time this year."]
    words = []
    while len(words) < 4000:
        words += f"{rng.choice(subj)} {rng.choice(verb)} {rng.choice(obj)} {rng.choice(tail_)}".split()
    return words, "generated sentences (GPL-3 text not found)"


def fit_prompt(make, n_max, target, count):
    """Smallest k in 1..n_max with count(make(k)) >= target, or k-1 when that is closer."""
    lo, hi = 1, n_max
    while lo < hi:
        mid = (lo + hi) // 2
        if count(make(mid)) >= target:
            hi = mid
        else:
            lo = mid + 1
    best = lo
    c = count(make(best))
    if best > 1:
        c2 = count(make(best - 1))
        if abs(c2 - target) < abs(c - target):
            best, c = best - 1, c2
    return make(best), c


def make_prompts(a, http):
    qa_words = QA_TEXT.split()
    doc_words, doc_src = document_words()

    def qa(k):
        return " ".join(qa_words[:k]).rstrip(",.?") + "?"

    def doc(k):
        return DOC_INSTRUCTION + " ".join(doc_words[:k])

    prompts = {}
    try:
        best = min(((abs(count_tokens(http, q) - PROMPT_TARGETS["qa"]), q) for q in QA_CANDIDATES))
        if best[0] <= 2:
            prompts["qa"] = {"text": best[1], "input_tokens": count_tokens(http, best[1]),
                             "calibrated": True}
        for key, make, n in [("qa", qa, len(qa_words)), ("doc", doc, min(len(doc_words), 3000))]:
            if key in prompts:
                continue
            text, tokens = fit_prompt(make, n, PROMPT_TARGETS[key], lambda t: count_tokens(http, t))
            prompts[key] = {"text": text, "input_tokens": tokens, "calibrated": True}
    except (urllib.error.URLError, OSError, KeyError, ValueError) as e:
        log(f"count_tokens failed ({e}); estimating 1.3 tokens a word plus 31 for the template")
        for key, make, n in [("qa", qa, len(qa_words)), ("doc", doc, len(doc_words))]:
            k = max(1, min(n, round((PROMPT_TARGETS[key] - 31) / 1.3)))
            prompts[key] = {"text": make(k), "input_tokens": None, "calibrated": False}
    for key, p in prompts.items():
        path = a.out / "prompts" / f"{key}.txt"
        path.write_text(p["text"])
        p["file"] = str(path)
        log(f"prompt {key}: {p['input_tokens']} input tokens, {len(p['text'].split())} words")
    prompts["doc"]["source"] = doc_src
    return prompts


# ---------------------------------------------------------------- runs

def parse_json_line(path, prefix=""):
    obj = None
    try:
        lines = pathlib.Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        line = line.strip()
        if prefix:
            if not line.startswith(prefix):
                continue
            line = line[len(prefix):].strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                pass
    return obj


def read_records(path):
    out = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass
    except OSError:
        pass
    return out


def pct(values, p):
    if not values:
        return None
    v = sorted(values)
    k = max(0, min(len(v) - 1, int(round(p / 100 * len(v) + 0.5)) - 1))  # nearest rank
    return v[k]


def summary_from_records(records, duration):
    ok = [r for r in records if r.get("error") is None]
    errors = {}
    for r in records:
        if r.get("error") is not None:
            errors[str(r["error"])] = errors.get(str(r["error"]), 0) + 1
    ttft = [r["ttft_ms"] for r in ok if isinstance(r.get("ttft_ms"), (int, float))]
    lat = [r["latency_ms"] for r in ok if isinstance(r.get("latency_ms"), (int, float))]
    toks = sum(r.get("output_tokens") or 0 for r in records)
    return {"requests": len(records), "ok": len(ok), "errors": errors,
            "ttft_ms": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
            "latency_ms": {"p50": pct(lat, 50), "p99": pct(lat, 99)},
            "req_per_s": len(ok) / duration if duration else None,
            "output_tok_per_s": toks / duration if duration else None, "duration_s": duration}


def loadgen_cmd(a, transport, addr, fingerprint, api, concurrency, duration, timeout, connections,
                prompt_file, max_tokens, records=None):
    cmd = [a.loadgen_bin, "--transport", transport, "--addr", addr]
    if fingerprint:
        cmd += ["--fingerprint", fingerprint]
    if api:
        cmd += ["--api", api]
    cmd += ["--concurrency", str(concurrency), "--duration", str(duration), "--request-timeout",
            str(timeout)]
    if connections:
        cmd += ["--connections", str(connections)]
    cmd += ["--prompt-file", str(prompt_file), "--max-tokens", str(max_tokens), "--model", MODEL_ID]
    if records:
        cmd += ["--records", str(records)]
    return cmd


def measured(a, cmd, server, tag, timeout):
    """One measured client run against `server`; returns its record (without the parsed output)."""
    so, se = a.out / "logs" / f"{tag}.stdout", a.out / "logs" / f"{tag}.stderr"
    hwm_reset = reset_hwm(server.pid)
    b0, s0 = cpu_total(), proc_cpu(server.pid)
    rc, own, timed_out, wall = run_child(cmd, so, se, timeout)
    b1, s1 = cpu_total(), proc_cpu(server.pid)
    rss = vm_hwm_mib(server.pid)
    r = {"cmd": [str(c) for c in cmd], "rc": rc, "timed_out": timed_out, "wall_s": wall,
         "client_cpu_s": own, "server_cpu_s": None if s0 is None or s1 is None else s1 - s0,
         "others_cpu_s": None, "rss_mib": rss, "rss_since_reset": hwm_reset,
         "server_alive": server.alive(), "stdout": str(so), "stderr": str(se), "notes": []}
    if r["server_cpu_s"] is not None:
        r["others_cpu_s"] = max(0.0, (b1 - b0) - r["server_cpu_s"] - own)
    if not r["server_alive"]:
        r["notes"].append(f"server died (log {server.log}): {tail(server.log, 3)}")
    if timed_out:
        r["notes"].append(f"client killed after {timeout:.0f} s")
    if rc != 0:
        r["notes"].append(f"client exit {rc}: {tail(se, 3)}")
    return r


def run_transport(a, sc, transport, server, prompts):
    prompt = prompts[sc["prompt"]]
    tag = f"{sc['key']}-{transport}"
    records = a.out / "records" / f"{tag}.jsonl"
    records.unlink(missing_ok=True)
    if transport in PEERS:
        addr, fp, api, lg_transport = server.http, None, "openai", "http1"
    elif transport == "http1":
        addr, fp, api, lg_transport = server.http, None, "anthropic", "http1"
    else:
        addr, fp, api, lg_transport = server.quic, server.fingerprint, None, transport
        if transport == "h3":
            api = "anthropic"
    conns = sc["connections"].get(transport)
    cmd = loadgen_cmd(a, lg_transport, addr, fp, api, sc["concurrency"], sc["duration"], sc["timeout"],
                      conns, prompt["file"], sc["max_tokens"], records)
    log(f"{sc['title']}: {transport}, {sc['concurrency']} clients, {sc['duration']} s "
        f"(+ up to {sc['timeout']} s)")
    r = measured(a, cmd, server, tag, sc["duration"] + sc["timeout"] + a.grace)
    r["transport"] = transport
    r["connections"] = conns or DEFAULT_CONNECTIONS.get(transport, sc["concurrency"])
    r["records"] = str(records)
    out = parse_json_line(r["stdout"])
    if out is None:
        out = summary_from_records(read_records(records), r["wall_s"])
        r["notes"].append("no JSON summary from loadgen: figures computed from its records")
    r["result"] = out
    if transport not in PEERS:
        waited, ok = settle(server.pid, a.settle_max)
        r["settle_s"], r["settled"] = waited, ok
        if not ok and server.alive():
            r["notes"].append(f"server still busy {waited:.0f} s after the run")
    return r


def warmup(a, sc, server, prompts, llama):
    """Same warm-up for every server: a few requests with the scenario's prompt (which also fills
    their prompt-prefix caches). `llama`: the peer's name (OpenAI API), or None for ours. Returns a
    short summary for the report."""
    api = "openai" if llama else "anthropic"
    clients, duration, timeout = sc.get("warmup") or (min(4, sc["concurrency"]), a.warmup, 30)
    cmd = loadgen_cmd(a, "http1", server.http, None, api, clients, duration, timeout, None,
                      prompts[sc["prompt"]]["file"], sc["max_tokens"])
    tag = f"{sc['key']}-{llama or 'ours'}-warmup"
    so, se = a.out / "logs" / f"{tag}.stdout", a.out / "logs" / f"{tag}.stderr"
    rc, _, timed_out, wall = run_child(cmd, so, se, duration + timeout + a.grace)
    out = parse_json_line(so) or {}
    if rc != 0 or timed_out or not out.get("ok"):
        log(f"warm-up {tag}: exit {rc}, killed {timed_out}, {out.get('ok')} ok of {out.get('requests')}: "
            f"{tail(se, 3)}")
    w = {"clients": clients, "wall_s": wall, "ok": out.get("ok"), "requests": out.get("requests"),
         "ttft_p50_ms": get(out, "ttft_ms", "p50"), "errors": out.get("errors")}
    if not llama:
        w["settle_s"], w["settled"] = settle(server.pid, a.settle_max)
    return w


def run_wrk(a, sc, server, prompts):
    body = json.dumps({"model": MODEL_ID, "max_tokens": sc["max_tokens"], "stream": False,
                       "messages": [{"role": "user", "content": prompts[sc["prompt"]]["text"]}]})
    lua = a.out / "logs" / "wrk-post.lua"
    lua.write_text(WRK_LUA.replace("@BODY@", body))
    c = sc["concurrency"]
    cmd = [a.wrk, f"-t{min(2, c)}", f"-c{c}", f"-d{a.wrk_duration}s", "--timeout", f"{sc['timeout']}s",
           "--latency",
           "-s", str(lua), f"http://{server.http}/v1/messages"]
    log(f"{sc['title']}: wrk (HTTP/1.1, stream:false), {c} connections, {a.wrk_duration} s")
    r = measured(a, cmd, server, f"{sc['key']}-wrk", a.wrk_duration + a.grace)
    r["result"] = parse_json_line(r["stdout"], prefix="WRKJSON")
    if r["result"] is None:
        r["notes"].append(f"no summary from wrk: {tail(r['stdout'], 3)} {tail(r['stderr'], 3)}")
    waited, ok = settle(server.pid, a.settle_max)
    r["settle_s"], r["settled"] = waited, ok
    return r


# ---------------------------------------------------------------- report

def fmt_ms(v):
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def fmt_num(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def get(d, *keys):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def contaminated(r):
    o, w = r.get("others_cpu_s"), r.get("wall_s")
    return o is not None and w and o > 0.1 * w


def scenario_table(sc, runs):
    lines = ["| transport | conns | TTFT p50 ms | TTFT p99 ms | latency p50 ms | latency p99 ms | req/s "
             "| output tok/s | ok / requests | error rate | error kinds | server peak RSS MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for t in TRANSPORTS:
        r = runs.get(t)
        if r is None:
            lines.append(f"| {t} | | | | | | | | | | not run | |")
            continue
        o = r.get("result") or {}
        req, ok = o.get("requests"), o.get("ok")
        errs = {k: v for k, v in (o.get("errors") or {}).items() if v}
        rate = "-" if not req else f"{100 * (req - (ok or 0)) / req:.1f}%"
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(errs.items())) or "none"
        if r.get("notes"):
            kinds += " (see notes)"
        rss = fmt_num(r.get("rss_mib"), 0) + ("" if r.get("rss_since_reset", True) else "*")
        lines.append(
            f"| {t} | {r.get('connections', '')} | {fmt_ms(get(o, 'ttft_ms', 'p50'))} | "
            f"{fmt_ms(get(o, 'ttft_ms', 'p99'))} | {fmt_ms(get(o, 'latency_ms', 'p50'))} | "
            f"{fmt_ms(get(o, 'latency_ms', 'p99'))} | {fmt_num(o.get('req_per_s'), 2)} | "
            f"{fmt_num(o.get('output_tok_per_s'))} | {ok if ok is not None else '-'} / "
            f"{req if req is not None else '-'} | {rate} | {kinds} | {rss} |")
    return lines


def wrk_table(lg, wrk):
    lines = ["| client | body | req/s | latency p50 ms | latency p90 ms | latency p99 ms | ok / requests "
             "| errors |", "|---|---|---:|---:|---:|---:|---:|---|"]
    if lg is not None:
        o = lg.get("result") or {}
        errs = {k: v for k, v in (o.get("errors") or {}).items() if v}
        lines.append(f"| loadgen http1 | stream:true | {fmt_num(o.get('req_per_s'), 2)} | "
                     f"{fmt_ms(get(o, 'latency_ms', 'p50'))} | - | {fmt_ms(get(o, 'latency_ms', 'p99'))} | "
                     f"{o.get('ok', '-')} / {o.get('requests', '-')} | "
                     f"{', '.join(f'{k} {v}' for k, v in sorted(errs.items())) or 'none'} |")
    w = wrk.get("result")
    if w:
        dur = w["duration_us"] / 1e6 if w.get("duration_us") else None
        ok = w["requests"] - w["status"]
        errs = {k: w[k] for k in ("connect", "read", "write", "status", "timeout") if w.get(k)}
        us = lambda k: None if not w.get("requests") else w[k] / 1000  # noqa: E731
        lines.append(f"| wrk | stream:false | {fmt_num(ok / dur if dur else None, 2)} | {fmt_ms(us('p50_us'))} | "
                     f"{fmt_ms(us('p90_us'))} | {fmt_ms(us('p99_us'))} | {ok} / {int(w['requests'])} | "
                     f"{', '.join(f'{k} {int(v)}' for k, v in errs.items()) or 'none'} |")
    else:
        lines.append("| wrk | stream:false | - | - | - | - | - | no result (see notes) |")
    return lines


def machine():
    name = "unknown CPU"
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(pathlib.Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 1048576:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return f"{len(os.sched_getaffinity(0))} CPUs (nproc), {name}{mem}, Linux {os.uname().release}"


def git_rev():
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return rev + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def llama_version(python):
    try:
        return subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                              capture_output=True, text=True, timeout=60).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def decode_rate(rec):
    """Tokens per second after the first token of one loadgen record (None if unusable)."""
    n, lat, ttft = rec.get("output_tokens") or 0, rec.get("latency_ms"), rec.get("ttft_ms")
    if rec.get("error") or n < 2 or not isinstance(lat, (int, float)) or not isinstance(ttft, (int, float)):
        return None
    return (n - 1) / ((lat - ttft) / 1000.0) if lat > ttft else None


def single_stream(a, prompts):
    """One client per transport against our server, and the in-process decode speed of
    `zerolayer generate` on the same prompt, model and threads. Returns the results dict."""
    res = {"max_tokens": SINGLE["max_tokens"], "duration_s": a.single_duration, "runs": {}}
    pf = a.out / "prompts" / "single.txt"
    pf.write_text(SINGLE_TEXT)
    if a.generate_bin:
        rates, lines = [], []
        for i in range(SINGLE["generate_runs"]):
            cmd = [a.generate_bin, "generate", "--model", a.model, "--chat", SINGLE_TEXT, "--max-tokens",
                   str(SINGLE["max_tokens"]), "--threads", str(a.threads), "--timings"]
            so, se = a.out / "logs" / f"single-generate-{i}.stdout", a.out / "logs" / f"single-generate-{i}.stderr"
            rc, _, timed_out, _ = run_child(cmd, so, se, 120)
            m = re.search(r"(\d+) generated, ([0-9.]+) tok/s decode", se.read_text(errors="replace"))
            if rc == 0 and not timed_out and m:
                rates.append(float(m.group(2)))
                lines.append(int(m.group(1)))
        res["in_process"] = {"cmd": " ".join(os.path.basename(c) if j == 0 else c for j, c in enumerate(cmd)),
                             "decode_tok_s": pct(rates, 50), "runs": rates, "tokens": lines}
    try:
        srv = OurServer(a, "single")
    except RuntimeError as e:
        res["error"] = f"our server: {str(e).splitlines()[0]}"
        return res
    try:
        sc = {"key": "single", "title": "single stream", "prompt": "single", "max_tokens": SINGLE["max_tokens"], "concurrency": 1,
              "duration": a.single_duration, "timeout": 60, "connections": {"claudelink": 1, "h3": 1},
              "warmup": (1, 1, 60)}
        prompts = dict(prompts, single={"file": pf})
        res["warmup"] = warmup(a, sc, srv, prompts, llama=None)
        for t in TRANSPORTS[:3]:
            r = run_transport(a, sc, t, srv, prompts)
            recs = read_records(r["records"])
            rates = [x for x in map(decode_rate, recs) if x is not None]
            r["decode_tok_s"] = pct(rates, 50)
            r["requests_ok"] = len(rates)
            r["tokens"] = sorted({x.get("output_tokens") for x in recs if not x.get("error")})
            res["runs"][t] = r
    finally:
        srv.stop()
    return res


def single_table(res):
    ref = get(res, "in_process", "decode_tok_s")
    md = ["", f"## Single stream: 1 client, sequential requests for {res['duration_s']} s, up to "
          f"{res['max_tokens']} output tokens (greedy), against the in-process decode speed", ""]
    if res.get("in_process"):
        ip = res["in_process"]
        md.append(f"In process: `{ip['cmd']}`, median of {len(ip['runs'])} runs "
                  f"({', '.join(f'{v:.1f}' for v in ip['runs'])} tok/s; {ip['tokens']} tokens).")
        md.append("")
    md += ["| path | requests | output tokens | decode tok/s (median) | of in-process | target | others' CPU s |",
           "|---|---:|---|---:|---:|---|---:|"]
    if ref:
        md.append(f"| in process (zerolayer generate) | {len(res['in_process']['runs'])} | "
                  f"{res['in_process']['tokens']} | {ref:.1f} | 100% | | |")
    for t, r in res["runs"].items():
        v = r.get("decode_tok_s")
        frac = f"{100 * v / ref:.0f}%" if v and ref else "n/a"
        ok = "met" if v and ref and v >= 0.95 * ref else "NOT met"
        md.append(f"| {t} | {r.get('requests_ok')} | {r.get('tokens')} | {fmt_num(v)} | {frac} | >= 95%: {ok} | "
                  f"{fmt_num(r.get('others_cpu_s'), 2)} |")
    if res.get("error"):
        md.append(f"\nerror: {res['error']}")
    md.append("\nDecode tok/s of a request: (output tokens - 1) / (latency - time to first token).")
    return md


def report(a, prompts, results, started, elapsed, server_cmd, llama_cmd):
    md = ["# Serving benchmark: zerolayer vs llama.cpp", ""]
    md.append(f"- date: {started.strftime('%Y-%m-%d %H:%M:%S %Z')}; whole run {elapsed:.0f} s")
    md.append(f"- machine: {machine()}")
    md.append(f"- command: `{a.cmdline}`" + (" (quick mode)" if a.quick else ""))
    md.append("- durations: loadgen starts requests for D s, then waits for those in flight, each cut at "
              "T s (error kind `timeout`): " + ", ".join(f"{sc['key']} D={sc['duration']} T={sc['timeout']}"
                                                          for sc in SCENARIOS) +
              f"; wrk {a.wrk_duration} s; each server restarted per scenario and warmed up by loadgen "
              "over HTTP/1.1 with the scenario's prompt (same warm-up for both servers): " +
              "; ".join(f"{sc['key']} " + ("{} client(s), D={} T={}".format(*sc["warmup"]) if sc.get("warmup")
                                          else f"{min(4, sc['concurrency'])} clients, D={a.warmup} T=30")
                        for sc in SCENARIOS))
    md.append(f"- model: `{os.path.basename(a.model)}` served as `{MODEL_ID}`; zerolayer {git_rev()}")
    md.append(f"- our server: `{' '.join(os.path.basename(c) if i == 0 else c for i, c in enumerate(server_cmd))}`")
    ls_cmd = next((r["llama_server_cmd"] for r in results.values() if "llama_server_cmd" in r), None)
    if ls_cmd:
        md.append(f"- llama-server (llama.cpp's own server, built from the llama-cpp-python "
                  f"{llama_version(a.python)} source by scripts/build-llama-server, GGML_NATIVE=ON): "
                  f"`llama-server {' '.join(ls_cmd[1:])}` (per scenario: slots = min(clients, 100), "
                  "256 tokens of context per slot, 1,536 for the document scenario)")
    md.append(f"- llama.cpp: llama-cpp-python {llama_version(a.python)}, "
              f"`python -m llama_cpp.server {' '.join(llama_cmd[3:])}` (use_extra_bufts off as in "
              "scripts/bench_vs_llamacpp.py; --interrupt_requests false so that a new request queues "
              "instead of cutting the running stream short; it serves one sequence at a time)")
    qa, doc = prompts["qa"], prompts["doc"]
    how = "counted by /v1/messages/count_tokens, chat template included" if qa["calibrated"] else \
        "ESTIMATED (count_tokens failed)"
    md.append(f"- prompts ({how}): Q&A {qa['input_tokens']} input tokens; document {doc['input_tokens']} "
              f"input tokens from {doc['source']}. Every request of a run sends the same prompt, so both "
              "servers may reuse a cached prompt prefix")
    md.append("- loadgen streams (stream:true): Anthropic /v1/messages against ours (claudelink: its own "
              "protocol), OpenAI /v1/chat/completions against llama.cpp; TTFT and latency percentiles over "
              "successful requests; conns = QUIC connections (claudelink, h3) or TCP connections (http1)")
    md.append("- server peak RSS: VmHWM after the run, reset before it (* = could not reset: peak since start)")
    md.append("- CPU time other processes used during each run (all CPU time from /proc/stat minus the "
              "server's and the client's own; CONTAMINATED: over 10% of one core):")
    for sc in SCENARIOS:
        res = results[sc["key"]]
        oth = [(t, r) for t, r in res["runs"].items()] + ([("wrk", res["wrk"])] if res.get("wrk") else [])
        md.append(f"  - {sc['key']}: " + ", ".join(
            f"{t} {fmt_num(r.get('others_cpu_s'), 2)} s" + (" CONTAMINATED" if contaminated(r) else "")
            for t, r in oth))
    notes = []
    for i, sc in enumerate(SCENARIOS, 1):
        res = results[sc["key"]]
        p = prompts[sc["prompt"]]
        md += ["", f"## {i}. {sc['title']}: {p['input_tokens']} input tokens, max {sc['max_tokens']} output "
               f"tokens, {sc['concurrency']} concurrent clients, {sc['duration']} s "
               f"(request timeout {sc['timeout']} s)", ""]
        if res.get("error"):
            md.append(f"**scenario failed:** {res['error']}")
            md.append("")
        md += scenario_table(sc, res["runs"])
        wl = []
        for side, w in (res.get("warmup") or {}).items():
            wl.append(f"{side} {w.get('ok')} ok of {w.get('requests')} in {w['wall_s']:.1f} s "
                      f"(TTFT p50 {fmt_ms(w.get('ttft_p50_ms'))} ms"
                      + (f", errors {w['errors']}" if w.get("errors") else "") + ")")
        if wl:
            md += ["", "warm-up: " + "; ".join(wl)]
        for t, r in res["runs"].items():
            for n in r.get("notes", []):
                notes.append(f"- {sc['key']}/{t}: {n}")
        if sc["key"] == "qa":
            md += ["", f"### cross-check: wrk against our server over HTTP/1.1 (scenario 1, {sc['concurrency']} "
                   "connections)", ""]
            if res.get("wrk"):
                md += wrk_table(res["runs"].get("http1"), res["wrk"])
                md += ["", f"(loadgen: {sc['duration']} s plus the tail, streaming responses; wrk: "
                       f"{a.wrk_duration} s, non-streaming, --timeout {sc['timeout']}s, drops the requests "
                       "in flight at its end; wrk's latency is that of the whole response, non-2xx included)"]
                for n in res["wrk"].get("notes", []):
                    notes.append(f"- {sc['key']}/wrk: {n}")
            else:
                md.append(res.get("wrk_skipped", "wrk not run"))
    if notes:
        md += ["", "## notes", ""] + [n.replace("\n", " | ") for n in notes]
    md.append("")
    md.append(f"Chart: `serving.png` (TTFT distribution per transport); raw results: `serving.json`; "
              f"per-request records: `records/`; logs: `logs/`.")
    return "\n".join(md) + "\n"


def chart(a, results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(SCENARIOS), figsize=(5.5 * len(SCENARIOS), 5), squeeze=False)
    colors = {"claudelink": "tab:blue", "h3": "tab:green", "http1": "tab:orange", "llama-server": "tab:purple", "llamacpp": "tab:red"}
    for ax, (i, sc) in zip(axes[0], enumerate(SCENARIOS, 1)):
        runs = results[sc["key"]]["runs"]
        data, pos, labels, allv = [], [], [], []
        for j, t in enumerate(TRANSPORTS, 1):
            recs = read_records(runs[t]["records"]) if t in runs else []
            v = [r["ttft_ms"] for r in recs
                 if r.get("error") is None and isinstance(r.get("ttft_ms"), (int, float))]
            labels.append(f"{t}\nn={len(v)}")
            if v:
                data.append(v)
                pos.append(j)
                allv += v
            else:
                ax.text(j, 0.5, "no data", transform=ax.get_xaxis_transform(), ha="center", color="gray")
        if data:
            bp = ax.boxplot(data, positions=pos, whis=(1, 99), widths=0.6, patch_artist=True,
                            flierprops={"markersize": 2})
            for patch, j in zip(bp["boxes"], pos):
                patch.set_facecolor(colors[TRANSPORTS[j - 1]])
                patch.set_alpha(0.5)
            if min(allv) > 0 and max(allv) / min(allv) > 20:
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
                ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(range(1, len(TRANSPORTS) + 1))
        ax.set_xticklabels(labels)
        ax.set_xlim(0.4, len(TRANSPORTS) + 0.6)
        p = results[sc["key"]]["prompt_tokens"]
        ax.set_title(f"{i}. {sc['title']}\n{sc['concurrency']} clients, {p} in / {sc['max_tokens']} out, "
                     f"{sc['duration']} s + tail", fontsize=10)
        ax.set_ylabel("time to first token (ms)")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("zerolayer (claudelink, h3, http1) vs llama.cpp server: TTFT of successful requests "
                 "(box: quartiles, whiskers: p1-p99)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main

def run_scenario(a, sc, prompts_box, res):
    res["runs"] = {}
    try:
        srv = OurServer(a, sc["key"])
    except RuntimeError as e:
        log(f"{sc['title']}: {e}")
        res["error"] = f"our server: {str(e).splitlines()[0]}"
        srv = None
    if srv is not None:
        res["server_ready_s"] = srv.ready_s
        res["server_cmd"] = srv.cmd
        try:
            if prompts_box.get("p") is None:
                prompts_box["p"] = make_prompts(a, srv.http)
            prompts = prompts_box["p"]
            res["prompt_tokens"] = prompts[sc["prompt"]]["input_tokens"]
            res["warmup"] = {"ours": warmup(a, sc, srv, prompts, llama=None)}
            for t in TRANSPORTS[:3]:
                if not srv.alive():
                    srv.stop()
                    log("our server died: restarting it")
                    srv = OurServer(a, f"{sc['key']}-{t}")
                    res["warmup"]["ours-restart"] = warmup(a, sc, srv, prompts, llama=None)
                res["runs"][t] = run_transport(a, sc, t, srv, prompts)
            if sc["key"] == "qa":
                if not a.wrk:
                    res["wrk_skipped"] = ("wrk is not installed and could not be installed: the "
                                          "cross-check was skipped")
                elif srv.alive():
                    res["wrk"] = run_wrk(a, sc, srv, prompts)
                else:
                    res["wrk_skipped"] = "wrk not run: our server died"
        except RuntimeError as e:
            log(f"{sc['title']}: {e}")
            res["error"] = f"our server: {str(e).splitlines()[0]}"
        finally:
            srv.stop()
    if prompts_box.get("p") is None:
        raise RuntimeError("no server answered count_tokens: cannot make the prompts")
    prompts = prompts_box["p"]
    res["prompt_tokens"] = prompts[sc["prompt"]]["input_tokens"]
    for peer in PEERS:
        if peer == "llama-server" and not a.llama_server_bin:
            res.setdefault("skipped", {})[peer] = "no llama-server binary (scripts/build-llama-server failed)"
            continue
        try:
            srv = NativeLlamaServer(a, sc, sc["key"]) if peer == "llama-server" else LlamaServer(a, sc["key"])
        except RuntimeError as e:
            log(f"{sc['title']}: {e}")
            res["error"] = (res.get("error", "") + "; " if res.get("error") else "") + \
                f"{peer}: {str(e).splitlines()[0]}"
            continue
        key = "llama" if peer == "llamacpp" else "llama_server"
        res[f"{key}_ready_s"] = srv.ready_s
        res[f"{key}_cmd"] = srv.cmd
        try:
            res.setdefault("warmup", {})[peer] = warmup(a, sc, srv, prompts, llama=peer)
            res["runs"][peer] = run_transport(a, sc, peer, srv, prompts)
        finally:
            srv.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--model", required=True)
    ap.add_argument("--server-bin", required=True)
    ap.add_argument("--loadgen-bin", required=True)
    ap.add_argument("--generate-bin", default="")
    ap.add_argument("--wrk", default="")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--llama-server-bin", default="")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--single-only", action="store_true",
                    help="only the single-stream table (transports vs in-process decode), no peers")
    ap.add_argument("--pidfile", default="")
    ap.add_argument("--cmdline", default="scripts/bench-serving")
    a = ap.parse_args()
    mode = "quick" if a.quick else "full"
    for sc in SCENARIOS:
        sc["duration"], sc["timeout"] = sc[mode]
    a.warmup = 2 if a.quick else 3
    a.wrk_duration = WRK_DURATION[mode]
    a.single_duration = SINGLE[mode]
    a.settle_max = 5 if a.quick else 20
    a.grace = 20  # a client is killed this long after its duration + request timeout
    for d in ("logs", "records", "prompts"):
        (a.out / d).mkdir(parents=True, exist_ok=True)
    global CHILDREN
    CHILDREN = Children(a.pidfile)

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.monotonic()
    if a.single_only:
        single = single_stream(a, {})
        md = ["# Single stream on loopback: zerolayer's transports vs in-process decode", "",
              f"- date: {started.strftime('%Y-%m-%d %H:%M:%S %Z')}; whole run {time.monotonic() - t0:.0f} s; "
              f"command: `{a.cmdline}`", f"- machine: {machine()}",
              f"- model: `{os.path.basename(a.model)}`; zerolayer {git_rev()}; {a.threads} threads"]
        md += single_table(single)
        (a.out / "single.md").write_text("\n".join(md) + "\n")
        (a.out / "single.json").write_text(json.dumps(single, indent=1, default=str))
        print("\n".join(md))
        return
    results = {}
    prompts_box = {}
    for sc in SCENARIOS:
        res = results[sc["key"]] = {"runs": {}, "prompt_tokens": None}
        try:
            run_scenario(a, sc, prompts_box, res)
        except RuntimeError as e:
            sys.exit(f"bench-serving: {e}")
        log(f"{sc['title']} done at {time.monotonic() - t0:.0f} s")
    single = single_stream(a, prompts_box["p"])
    log(f"single stream done at {time.monotonic() - t0:.0f} s")
    elapsed = time.monotonic() - t0
    prompts = prompts_box["p"]
    server_cmd = next((r["server_cmd"] for r in results.values() if "server_cmd" in r), [a.server_bin])
    llama_cmd = next((r["llama_cmd"] for r in results.values() if "llama_cmd" in r), [a.python, "-c", ""])
    md = report(a, prompts, results, started, elapsed, server_cmd, llama_cmd)
    md += "\n".join(single_table(single)) + "\n"
    (a.out / "serving.md").write_text(md)
    (a.out / "serving.json").write_text(json.dumps(
        {"date": started.isoformat(), "quick": a.quick, "scenarios": SCENARIOS, "prompts": prompts,
         "results": results, "single": single}, indent=1, default=str))
    try:
        chart(a, results, a.out / "serving.png")
        chart_msg = f"chart: {a.out / 'serving.png'}"
    except Exception as e:  # noqa: BLE001 - the tables are still worth having
        chart_msg = f"chart FAILED: {type(e).__name__}: {e}"
    print(md)
    print(f"tables: {a.out / 'serving.md'}; {chart_msg}; whole run {elapsed:.0f} s")
    limit = 180 if a.quick else 600
    if elapsed > limit:
        log(f"warning: the run took {elapsed:.0f} s, over its {limit} s target")


if __name__ == "__main__":
    main()
