#!/usr/bin/env python3
"""Issue 47's attacks against a running `zerolayer serve`, measured as an attacker sees them.

Start the server with two keys and small connection limits, e.g.

    zerolayer serve --api-key sk-a --api-key sk-b --max-connections 40 \
        --max-connections-per-ip 10 --http-listen 127.0.0.1:18080

then run `scripts/attack_check.py --addr 127.0.0.1:18080 --key-a sk-a --key-b sk-b`. It prints:

1. prefix guessing across keys: key B sends a long prompt with a secret; key A sends the exact
   prompt (a right guess: with a shared cache it would be a hit); key B repeats its own. Time
   to first token of each (SSE `content_block_delta`): A's right guess must cost what B's cold
   request did (any guess of A's is then as slow as a miss), B's repeat is a hit. Each run
   needs a fresh server (or other keys): the cache remembers the earlier runs.
2. idle connections: keyless HTTP/2 connections (preface + SETTINGS, no stream, every PING
   answered) from four loopback addresses; how many the server accepts, when it closes them
   (evicted by a newer keyless connection, or at the auth timeout), and the latency of
   `/health` from another address meanwhile (median and max of 50).

Standard library only (raw HTTP/1.1 and HTTP/2 frames), loopback addresses only.
"""

import argparse
import json
import socket
import statistics
import struct
import threading
import time

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(kind, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def served_model(host, port, key):
    s = socket.create_connection((host, port))
    s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\nx-api-key: {key}\r\n"
              f"anthropic-version: 2023-06-01\r\nconnection: close\r\n\r\n".encode())
    got = b""
    while True:
        c = s.recv(65536)
        if not c:
            break
        got += c
    return json.loads(got.split(b"\r\n\r\n", 1)[1])["data"][0]["id"]


def first_token_ms(host, port, key, prompt, model, max_tokens=2):
    body = json.dumps({
        "model": model, "max_tokens": max_tokens, "stream": True,
        "messages": [{"role": "user", "content": prompt}],
    }).encode()
    head = (
        f"POST /v1/messages HTTP/1.1\r\nHost: {host}:{port}\r\nx-api-key: {key}\r\n"
        f"anthropic-version: 2023-06-01\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    s = socket.create_connection((host, port))
    t0 = time.monotonic()
    s.sendall(head + body)
    got = b""
    while b"content_block_delta" not in got:
        chunk = s.recv(65536)
        if not chunk:
            raise RuntimeError(f"no token: {got[:300]!r}")
        got += chunk
    ms = (time.monotonic() - t0) * 1000
    s.close()
    return ms


def health_ms(host, port, source):
    s = socket.socket()
    s.bind((source, 0))
    t0 = time.monotonic()
    s.connect((host, port))
    s.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\nconnection: close\r\n\r\n".encode())
    got = b""
    while b"\r\n\r\n" not in got:
        c = s.recv(4096)
        if not c:
            break
        got += c
    ms = (time.monotonic() - t0) * 1000
    s.close()
    return ms, got.split(b"\r\n", 1)[0].decode(errors="replace")


def idle_h2(host, port, source, results, i):
    """Holds a keyless HTTP/2 connection that answers PINGs; records (accepted, seconds open)."""
    s = socket.socket()
    s.bind((source, 0))
    s.connect((host, port))
    t0 = time.monotonic()
    s.sendall(H2_PREFACE + frame(4, 0, 0))  # SETTINGS
    s.settimeout(120)
    buf = b""
    accepted = None
    try:
        while True:
            c = s.recv(65536)
            if not c:
                break
            if accepted is None:
                accepted = not c.startswith(b"HTTP/1.1 503")
            buf += c
            while len(buf) >= 9:
                n = int.from_bytes(buf[:3], "big")
                if len(buf) < 9 + n:
                    break
                kind, flags, payload = buf[3], buf[4], buf[9:9 + n]
                buf = buf[9 + n:]
                if kind == 4 and not flags & 1:
                    s.sendall(frame(4, 1, 0))  # SETTINGS ack
                elif kind == 6 and not flags & 1:
                    s.sendall(frame(6, 1, 0, payload))  # PING ack
    except (OSError, socket.timeout):
        pass
    results[i] = (bool(accepted), time.monotonic() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", default="127.0.0.1:18080")
    ap.add_argument("--key-a", required=True)
    ap.add_argument("--key-b", required=True)
    ap.add_argument("--prompt-words", type=int, default=600)
    a = ap.parse_args()
    host, port = a.addr.rsplit(":", 1)
    port = int(port)

    filler = " ".join(f"item{i}" for i in range(a.prompt_words))
    secret = f"Account notes: {filler}. The recovery code is 48213."
    print("== prefix guessing across keys (time to first token, ms)")
    rows = [
        ("key B, its own prompt (cold)", a.key_b, secret),
        ("key A, exact guess of B's prompt", a.key_a, secret),
        ("key B, its own prompt again (warm)", a.key_b, secret),
    ]
    model = served_model(host, port, a.key_a)
    for name, key, prompt in rows:
        print(f"{name:40s} {first_token_ms(host, port, key, prompt, model):8.1f}")

    print("== keyless idle HTTP/2 connections from 127.0.0.2-5, 10 each")
    results = {}
    threads = []
    for src in range(2, 6):
        for j in range(10):
            i = (src, j)
            t = threading.Thread(target=idle_h2, args=(host, port, f"127.0.0.{src}", results, i))
            t.start()
            threads.append(t)
    time.sleep(0.5)
    lat = []
    statuses = set()
    for _ in range(50):
        ms, status = health_ms(host, port, "127.0.0.9")
        lat.append(ms)
        statuses.add(status)
        time.sleep(0.1)
    for t in threads:
        t.join()
    accepted = sorted(d for ok, d in results.values() if ok)
    early = [d for d in accepted if d < 1.0]
    late = [d for d in accepted if d >= 1.0]
    print(f"accepted {len(accepted)} of {len(results)}: {len(early)} closed within 1 s (a newer "
          f"keyless connection took their place), {len(late)} closed after "
          f"{min(late, default=0):.1f}-{max(late, default=0):.1f} s (the auth timeout)")
    print(f"/health from 127.0.0.9 meanwhile: median {statistics.median(lat):.1f} ms, "
          f"max {max(lat):.1f} ms, statuses {sorted(statuses)}")


if __name__ == "__main__":
    main()
