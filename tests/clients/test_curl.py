"""curl (the system binary) over HTTP/1.1: streamed SSE, headers, errors. Needs curl on PATH."""
import json
import subprocess

from common import API_KEY, BASE_URL, check_anthropic_sse, model_id, run_tests

MODEL = model_id()


def curl(path, body, *extra):
    cmd = ["curl", "-sS", "-N", "--http1.1", "-D", "-", BASE_URL + path,
           "-H", "content-type: application/json", "-H", "anthropic-version: 2023-06-01", *extra,
           "--data-binary", json.dumps(body)]
    out = subprocess.run(cmd, check=True, capture_output=True, timeout=300).stdout.decode()
    head, _, payload = out.partition("\r\n\r\n")
    lines = head.split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, payload


def test_streamed_sse():
    status, h, body = curl("/v1/messages", {"model": MODEL, "max_tokens": 24, "stream": True,
                                            "messages": [{"role": "user", "content": "Tell me a joke."}]},
                           "-H", f"x-api-key: {API_KEY}")
    assert status == 200, body
    assert h["content-type"].startswith("text/event-stream"), h
    assert h["transfer-encoding"] == "chunked", h
    assert h["x-claude-layer"] == "v2.1.0-alpha", h
    assert h["request-id"].startswith("req_"), h
    assert h["alt-svc"].startswith('h3=":'), h
    check_anthropic_sse(body, 24)


def test_debug_header():
    status, h, body = curl("/v1/messages", {"model": MODEL, "max_tokens": 4,
                                            "messages": [{"role": "user", "content": "Hi"}]},
                           "-H", f"authorization: Bearer {API_KEY}", "-H", "x-anthropic-debug: true")
    assert status == 200, body
    d = json.loads(h["x-claude-layer-debug"])
    assert d["layer"] == "v2.1.0-alpha" and d["ttft_ms"] > 0 and d["queue_ms"] >= 0, d
    assert 0 <= d["cache_hit_rate"] <= 1, d


def test_missing_key_is_401():
    status, h, body = curl("/v1/messages", {"model": MODEL, "max_tokens": 4,
                                            "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 401, body
    err = json.loads(body)
    assert err["type"] == "error" and err["error"]["type"] == "authentication_error", err
    assert err["request_id"] == h["request-id"]


def test_metrics_and_health():
    health = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", BASE_URL + "/health"],
                            check=True, capture_output=True).stdout.decode()
    assert health == "200", health
    text = subprocess.run(["curl", "-sS", BASE_URL + "/metrics"], check=True, capture_output=True).stdout.decode()
    for name in ["zerolayer_http_requests_total", "zerolayer_time_to_first_token_seconds_bucket",
                 "zerolayer_request_duration_seconds_bucket", "zerolayer_output_tokens_per_second",
                 "zerolayer_queue_depth", "zerolayer_kv_bytes_used", "zerolayer_weight_cache_hit_rate",
                 "zerolayer_connection_reuse_ratio"]:
        assert name in text, name


run_tests([test_streamed_sse, test_debug_header, test_missing_key_is_401, test_metrics_and_health])
