"""HTTP/3 with curl-cffi (libcurl + ngtcp2 + nghttp3) on the QUIC port, JSON and streaming.
pip: curl-cffi."""
import json

from curl_cffi import requests
from curl_cffi.const import CurlHttpVersion

from common import API_KEY, H3_URL, check_anthropic_sse, model_id, run_tests

MODEL = model_id()
HEADERS = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01", "content-type": "application/json"}
H3 = {"http_version": CurlHttpVersion.V3ONLY, "verify": False, "timeout": 300}


def test_h3_json():
    r = requests.post(H3_URL + "/v1/messages", headers=HEADERS, **H3,
                      data=json.dumps({"model": MODEL, "max_tokens": 16,
                                       "messages": [{"role": "user", "content": "Hello over QUIC"}]}))
    assert r.http_version == 30, r.http_version  # CURL_HTTP_VERSION_3
    assert r.status_code == 200, r.text
    assert r.headers["x-claude-layer"] == "v2.1.0-alpha"
    m = r.json()
    assert m["type"] == "message" and m["content"][0]["text"].strip(), m
    assert m["stop_reason"] in ("end_turn", "max_tokens"), m


def test_h3_stream():
    r = requests.post(H3_URL + "/v1/messages", headers=HEADERS, stream=True, **H3,
                      data=json.dumps({"model": MODEL, "max_tokens": 24, "stream": True,
                                       "messages": [{"role": "user", "content": "Stream over HTTP/3"}]}))
    assert r.http_version == 30, r.http_version
    assert r.status_code == 200
    chunks = [c for c in r.iter_content() if c]
    r.close()
    assert len(chunks) > 1, "the body did not stream"
    check_anthropic_sse(b"".join(chunks).decode(), 24)


def test_h3_auth_and_health():
    r = requests.get(H3_URL + "/health", **H3)
    assert r.http_version == 30 and r.status_code == 200, r.status_code
    r = requests.post(H3_URL + "/v1/messages", headers={**HEADERS, "x-api-key": "wrong"}, **H3,
                      data=json.dumps({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}))
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text


run_tests([test_h3_json, test_h3_stream, test_h3_auth_and_health])
