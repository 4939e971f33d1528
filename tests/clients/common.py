"""Shared helpers for the real-client tests run by scripts/test-clients.

Environment: ZL_BASE_URL (http://127.0.0.1:PORT), ZL_H3_URL (https://127.0.0.1:UDPPORT),
ZL_API_KEY. Assertions are about API behaviour (shapes, event order, stop reasons, usage
consistency, non-empty text), never about specific model text.
"""
import json
import os
import sys
import traceback
import urllib.request

BASE_URL = os.environ["ZL_BASE_URL"]
H3_URL = os.environ.get("ZL_H3_URL", "")
API_KEY = os.environ["ZL_API_KEY"]

ANTHROPIC_EVENTS = [
    "message_start", "content_block_start", "ping", "content_block_delta",
    "content_block_stop", "message_delta", "message_stop",
]


def model_id():
    req = urllib.request.Request(BASE_URL + "/v1/models", headers={"x-api-key": API_KEY})
    with urllib.request.urlopen(req, timeout=30) as r:
        data = json.load(r)
    assert data["data"], data
    return data["data"][0]["id"]


def parse_sse(text):
    """[(event name or None, data string)] of an SSE body."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[len("event:"):].strip()
            elif line.startswith("data:"):
                data.append(line[len("data:"):].strip())
            elif line.startswith(":"):
                continue
            else:
                raise AssertionError(f"unexpected SSE line {line!r}")
        events.append((name, "\n".join(data)))
    return events


def check_anthropic_sse(text, max_tokens):
    """Checks the exact Anthropic event sequence; returns (text, stop_reason, usage)."""
    events = parse_sse(text)
    names = []
    for name, data in events:
        assert name is not None, f"event without an event: line: {data!r}"
        payload = json.loads(data)
        assert payload["type"] == name, (name, payload)
        names.append(name)
    assert names[:3] == ANTHROPIC_EVENTS[:3], names
    assert names[-3:] == ANTHROPIC_EVENTS[-3:], names
    assert all(n == "content_block_delta" for n in names[3:-3]), names
    assert len(names) > 6, "no text delta"
    start = json.loads(events[0][1])["message"]
    assert start["role"] == "assistant" and start["content"] == [], start
    assert start["usage"]["input_tokens"] > 0, start
    out = "".join(json.loads(d)["delta"]["text"] for n, d in events if n == "content_block_delta")
    delta = json.loads(events[-2][1])
    stop = delta["delta"]["stop_reason"]
    assert stop in ("end_turn", "max_tokens", "stop_sequence"), delta
    assert 0 < delta["usage"]["output_tokens"] <= max_tokens, delta
    assert out.strip(), "empty text"
    return out, stop, delta["usage"]


# Twenty prompts for the structured-output tests (what is asked varies; the schema does not).
PROMPTS = [
    "Describe a city.", "Tell me about Paris.", "Name a large city in Asia.", "Hello!",
    "What is your favourite place?", "Pick a town at random.", "Where is Rome?",
    "Give me a place to visit.", "Write a poem.", "What is 2 + 2?", "Describe Tokyo.",
    "Which city has the most people?", "Tell me a joke.", "Name a small village.",
    "Where do penguins live?", "Suggest a holiday destination.", "What is the capital of Peru?",
    "Say something about London.", "Recommend a city for students.", "Answer in JSON please.",
]

# The schema the structured-output tests ask for.
CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 24},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "size": {"enum": ["small", "medium", "large"]},
        "sights": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["city", "population", "size"],
    "additionalProperties": False,
}


# The tool the tool-use tests offer (and, in one test, force).
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_DESCRIPTION = "The weather forecast for a city."
TIME_SCHEMA = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
               "required": ["timezone"], "additionalProperties": False}

# Twenty prompts for the forced-tool tests.
TOOL_PROMPTS = [
    "What is the weather in Paris?", "Will it rain in London tomorrow?", "How hot is Cairo?",
    "Forecast for Tokyo this week, please.", "Is it snowing in Oslo?", "Hello!",
    "Should I bring an umbrella in Seattle?", "Weather in Lima in fahrenheit.", "Tell me a joke.",
    "What is 2 + 2?", "How cold is it in Moscow?", "Plan a picnic in Rome.",
    "Is it windy in Chicago?", "Describe the climate of Sydney.", "Weather?",
    "What should I wear in Berlin today?", "Temperature in Mumbai for 3 days.",
    "Can I go skiing in Zermatt?", "Is it sunny in Madrid?", "Write a poem about rain.",
]


def validate(value, schema, path="$"):
    """Raises AssertionError unless `value` validates against `schema` (the JSON Schema
    keywords these tests use: type, properties, required, additionalProperties, enum,
    minimum, maximum, minLength, maxLength, items, minItems, maxItems)."""
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    t = schema.get("type")
    if t == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), (path, value)
    elif t == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (path, value)
    elif t is not None:
        assert isinstance(value, types[t]), (path, t, value)
    if "enum" in schema:
        assert value in schema["enum"], (path, value)
    if "minimum" in schema:
        assert value >= schema["minimum"], (path, value)
    if "maximum" in schema:
        assert value <= schema["maximum"], (path, value)
    if isinstance(value, str):
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1 << 30), (path, value)
    if isinstance(value, list):
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30), (path, value)
        for i, item in enumerate(value):
            validate(item, schema.get("items", {}), f"{path}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for k in schema.get("required", []):
            assert k in value, (path, "missing", k, value)
        for k, v in value.items():
            if k in props:
                validate(v, props[k], f"{path}.{k}")
            else:
                assert schema.get("additionalProperties", True) is not False, (path, "extra", k)


def run_tests(tests):
    failed = 0
    for t in tests:
        try:
            t()
            print(f"  ok    {t.__name__}", flush=True)
        except Exception:  # noqa: BLE001 - report every failure
            failed += 1
            print(f"  FAIL  {t.__name__}", flush=True)
            traceback.print_exc()
    print(f"  {len(tests) - failed}/{len(tests)} passed", flush=True)
    sys.exit(1 if failed else 0)
