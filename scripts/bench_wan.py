"""WAN mode of scripts/bench-serving (`--wan RTT_MS,LOSS_PCT`, repeatable): the transports over
an emulated lossy link (tools/wan: two network namespaces joined by TUN devices through a
userspace forwarder; the kernel here has no netem).

Per link: zerolayer-wan up; the server (HTTPS on TCP and QUIC, one self-signed certificate) in
namespace A; examples/loadgen in namespace B against it over claudelink (1 connection), HTTP/3
(1 connection), HTTP/2 over TLS (1 connection) and HTTP/1.1 over TLS (one connection per client),
100 concurrent streams of the ~42-token Q&A prompt, 32 output tokens. Reported: p50/p99 time to
first token, p99 inter-token gap (stalls), output tokens/s, errors, and the CPU time other
processes used during the run. Then, on the first link, reconnect cost: connect to first
response byte for claudelink with and without 0-RTT, HTTPS (HTTP/1.1 over TLS 1.3) fresh and
resumed. Writes DIR/wan.md, DIR/wan.json, DIR/wan.png (if matplotlib imports), DIR/records/.
Needs root (namespaces, TUN), iproute2 and openssl.
"""

import argparse
import json
import pathlib
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_serving as bs  # noqa: E402  (process helpers, CPU accounting, machine description)

PREFIX = "zlwan"
ADDR_A = "10.213.0.1"
TCP_PORT, UDP_PORT = 8080, 8443
TRANSPORTS = [  # (loadgen transport, port, --connections)
    ("claudelink", UDP_PORT, 1),
    ("h3", UDP_PORT, 1),
    ("h2", TCP_PORT, 1),
    ("https1", TCP_PORT, None),
]
PROBES = [  # (label, transport, port, extra loadgen flags)
    ("claudelink, 0-RTT resumption", "claudelink", UDP_PORT, ["--zero-rtt", "true"]),
    ("claudelink, full handshake", "claudelink", UDP_PORT, ["--zero-rtt", "false"]),
    ("HTTPS (HTTP/1.1, TLS 1.3), resumed session", "https1", TCP_PORT, ["--tls-resume", "true"]),
    ("HTTPS (HTTP/1.1, TLS 1.3), fresh session", "https1", TCP_PORT, ["--tls-resume", "false"]),
]


def log(msg):
    print(f"bench-serving --wan: {msg}", file=sys.stderr, flush=True)


def netns(ns, cmd):
    return ["ip", "netns", "exec", f"{PREFIX}-{ns}", *cmd]


def certificate(out):
    cert, key = out / "cert.pem", out / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True)
    der = subprocess.run(["openssl", "x509", "-in", str(cert), "-outform", "der"], check=True,
                         capture_output=True).stdout
    import hashlib
    return cert, key, hashlib.sha256(der).hexdigest()


def wait_line(path, needle, proc, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited early; log: {bs.tail(path)}")
        if needle in path.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise RuntimeError(f"no '{needle}' within {timeout} s; log: {bs.tail(path)}")


def https_get(path):
    """GET https://ADDR_A:TCP_PORT/path from namespace B (certificate not checked); the body or None."""
    code = ("import ssl,urllib.request,sys;c=ssl.create_default_context();c.check_hostname=False;"
            "c.verify_mode=ssl.CERT_NONE;"
            f"sys.stdout.write(urllib.request.urlopen('https://{ADDR_A}:{TCP_PORT}{path}',context=c,"
            "timeout=2).read().decode())")
    r = subprocess.run(netns("b", [sys.executable, "-c", code]), capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else None


def loadgen(a, transport, port, fp, model, extra, tag, timeout):
    cmd = netns("b", [a.loadgen_bin, "--transport", transport, "--addr", f"{ADDR_A}:{port}",
                      "--fingerprint", fp, "--model", model, "--prompt-file", str(a.prompt_file), *extra])
    out, err = a.out / "records" / f"{tag}.out", a.out / "records" / f"{tag}.err"
    cpu0 = bs.cpu_total()
    server0 = bs.proc_cpu(a.server_pid) or 0.0
    rc, own, timed_out, wall = bs.run_child(cmd, out, err, timeout)
    others = bs.cpu_total() - cpu0 - ((bs.proc_cpu(a.server_pid) or 0.0) - server0) - own
    line = bs.parse_json_line(out)
    if rc != 0 or line is None:
        raise RuntimeError(f"loadgen {tag} failed (rc {rc}); stderr: {bs.tail(err)}")
    line["others_cpu_s"] = round(max(others, 0.0), 2)
    line["wall_s"] = round(wall, 1)
    return line


def run_link(a, rtt, loss, cert, key, fp, probes):
    tag = f"rtt{rtt:g}-loss{loss:g}"
    wan_log = a.out / "logs" / f"wan-{tag}.log"
    with open(wan_log, "wb") as f:
        wan = bs.spawn([a.wan_bin, "up", "--rtt-ms", str(rtt), "--loss-pct", str(loss), "--prefix", PREFIX],
                       f, subprocess.STDOUT)
    server = None
    try:
        wait_line(wan_log, "ready", wan, 20)
        srv_log = a.out / "logs" / f"server-{tag}.log"
        with open(srv_log, "wb") as f:
            server = bs.spawn(netns("a", [a.server_bin, "serve", "--model", a.model, "--http-listen", f"{ADDR_A}:{TCP_PORT}",
                                          "--quic-listen", f"{ADDR_A}:{UDP_PORT}", "--tls-cert", str(cert),
                                          "--tls-key", str(key), "--quic-congestion", a.quic_congestion]),
                              f, subprocess.STDOUT)
        a.server_pid = server.pid
        deadline = time.monotonic() + 120
        while https_get("/health") is None:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"server not healthy; log: {bs.tail(srv_log)}")
            time.sleep(0.5)
        model = json.loads(https_get("/v1/models"))["data"][0]["id"]
        loadgen(a, "claudelink", UDP_PORT, fp, model, ["--concurrency", "8", "--duration", "3", "--max-tokens", "8"],
                f"{tag}-warmup", 60)
        runs = {}
        for transport, port, conns in TRANSPORTS:
            extra = ["--concurrency", str(a.concurrency), "--duration", str(a.duration), "--max-tokens",
                     str(a.max_tokens), "--request-timeout", str(a.request_timeout),
                     "--records", str(a.out / "records" / f"{tag}-{transport}.jsonl")]
            if conns:
                extra += ["--connections", str(conns)]
            log(f"{tag}: {transport}")
            runs[transport] = loadgen(a, transport, port, fp, model, extra, f"{tag}-{transport}",
                                      a.duration + a.request_timeout + 60)
            log(f"  {json.dumps(runs[transport])}")
        reconnects = {}
        if probes:
            for label, transport, port, flags in PROBES:
                log(f"{tag}: reconnect probe: {label}")
                reconnects[label] = loadgen(a, transport, port, fp, model,
                                            ["--concurrency", "1", "--duration", "1", "--max-tokens", "1",
                                             "--connect-probe", str(a.probes), *flags],
                                            f"{tag}-probe-{transport}-{flags[-1]}", 300)
        return {"rtt_ms": rtt, "loss_pct": loss, "runs": runs, "reconnects": reconnects}
    finally:
        bs.stop(server)
        bs.stop(wan, grace=10)


def fmt(v, digits=0):
    return "-" if v is None else f"{v:.{digits}f}"


def report(a, links, started, elapsed):
    lines = [
        "# Serving over an emulated WAN",
        "",
        f"Command: `{a.cmdline}`; {started}, {elapsed / 60:.1f} min; git {bs.git_rev()}; {bs.machine()}.",
        f"Link: tools/wan (`zerolayer-wan up --rtt-ms RTT --loss-pct LOSS`: two network namespaces, TUN "
        f"devices, userspace forwarder; LOSS applies to each direction independently). Model: "
        f"`{pathlib.Path(a.model).name}`. QUIC congestion control (server): {a.quic_congestion}. Load: "
        f"{a.concurrency} concurrent streams, ~42-token Q&A prompt, {a.max_tokens} output tokens, "
        f"{a.duration} s per transport; claudelink, HTTP/3 and HTTP/2 each on one connection, HTTP/1.1 "
        f"over TLS on one connection per client. Times in ms. 'others CPU' = CPU seconds used by "
        f"other processes during the run (the machine is shared).",
        "",
        "| RTT | loss | transport | ok | errors | TTFT p50 | TTFT p99 | inter-token p50 | inter-token p99 | "
        "max gap | output tok/s | others CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for link in links:
        for t, r in link["runs"].items():
            errors = ", ".join(f"{k} {v}" for k, v in (r.get("errors") or {}).items()) or "0"
            g = r.get("inter_token_ms") or {}
            lines.append(
                f"| {link['rtt_ms']:g} | {link['loss_pct']:g}% | {t} | {r['ok']} | {errors} | "
                f"{fmt(r['ttft_ms']['p50'])} | {fmt(r['ttft_ms']['p99'])} | {fmt(g.get('p50'))} | "
                f"{fmt(g.get('p99'))} | {fmt(g.get('max'))} | {fmt(r['output_tok_per_s'], 1)} | "
                f"{r['others_cpu_s']} |")
    lines += ["", "Ratios (HTTP/2 over TLS / claudelink; above 1 means claudelink is better):", "",
              "| RTT | loss | TTFT p99 | inter-token p99 |", "|---|---|---|---|"]
    for link in links:
        c, h = link["runs"].get("claudelink"), link["runs"].get("h2")
        if c and h:
            def ratio(key):
                x, y = (h.get(key) or {}).get("p99"), (c.get(key) or {}).get("p99")
                return f"{x / y:.2f}x" if x and y else "-"
            lines.append(f"| {link['rtt_ms']:g} | {link['loss_pct']:g}% | {ratio('ttft_ms')} | "
                         f"{ratio('inter_token_ms')} |")
    for link in links:
        if link["reconnects"]:
            rtt = link["rtt_ms"]
            lines += ["", f"Reconnect cost at RTT {rtt:g} ms, loss {link['loss_pct']:g}% ({a.probes} "
                      f"reconnects each, one request of 1 output token): connect to first response byte",
                      "", "| client | p50 ms | p50 in RTTs | min ms | p90 ms |", "|---|---|---|---|---|"]
            for label, r in link["reconnects"].items():
                fb = r["first_byte_ms"]
                lines.append(f"| {label} | {fmt(fb['p50'], 1)} | {fb['p50'] / rtt:.2f} | {fmt(fb['min'], 1)} | "
                             f"{fmt(fb['p90'], 1)} |")
    (a.out / "wan.md").write_text("\n".join(lines) + "\n")
    (a.out / "wan.json").write_text(json.dumps({"links": links, "command": a.cmdline}, indent=1))
    print("\n".join(lines))


def chart(a, links):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not importable: no chart")
        return
    fig, axes = plt.subplots(1, len(links), figsize=(5 * len(links), 4), sharey=True, squeeze=False)
    for ax, link in zip(axes[0], links):
        tag = f"rtt{link['rtt_ms']:g}-loss{link['loss_pct']:g}"
        for transport, _, _ in TRANSPORTS:
            path = a.out / "records" / f"{tag}-{transport}.jsonl"
            if not path.exists():
                continue
            ttft = sorted(r["ttft_ms"] for r in bs.read_records(path) if r.get("ttft_ms") is not None)
            if ttft:
                ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=transport)
        ax.set_xscale("log")
        ax.set_title(f"RTT {link['rtt_ms']:g} ms, loss {link['loss_pct']:g}%")
        ax.set_xlabel("time to first token (ms)")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(a.out / "wan.png", dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--model", required=True)
    ap.add_argument("--server-bin", required=True)
    ap.add_argument("--loadgen-bin", required=True)
    ap.add_argument("--wan-bin", required=True)
    ap.add_argument("--wan", action="append", required=True, help="RTT_MS,LOSS_PCT (repeatable)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--quic-congestion", default="cubic", help="the server's --quic-congestion")
    ap.add_argument("--pidfile")
    ap.add_argument("--cmdline", default="scripts/bench-serving --wan ...")
    a = ap.parse_args()
    a.concurrency, a.max_tokens = 100, 32
    a.duration, a.request_timeout, a.probes = (5, 60, 5) if a.quick else (20, 90, 20)
    bs.CHILDREN.pidfile = a.pidfile
    for d in ("records", "logs"):
        (a.out / d).mkdir(parents=True, exist_ok=True)
    a.prompt_file = a.out / "prompt.txt"
    a.prompt_file.write_text(bs.QA_CANDIDATES[-1])
    cert, key, fp = certificate(a.out)
    links = []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    t0 = time.monotonic()
    for i, spec in enumerate(a.wan):
        rtt, loss = (float(x) for x in spec.split(","))
        links.append(run_link(a, rtt, loss, cert, key, fp, probes=(i == 0)))
        report(a, links, started, time.monotonic() - t0)
    chart(a, links)


if __name__ == "__main__":
    main()
