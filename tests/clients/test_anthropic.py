"""The official `anthropic` SDK against zerolayer: run with 2.x (Authorization: Bearer,
anthropic-version 2026-10-21) and with 0.40.0 (x-api-key, 2023-06-01).
pip: anthropic (2.x or 0.40.0 with httpx<0.28)."""
import json

import anthropic

from common import (API_KEY, BASE_URL, CITY_SCHEMA, PROMPTS, TIME_SCHEMA, TOOL_PROMPTS,
                    WEATHER_DESCRIPTION, WEATHER_SCHEMA, model_id, run_tests, validate)

MAJOR = int(anthropic.__version__.split(".")[0])
MODEL = model_id()
client = anthropic.Anthropic(base_url=BASE_URL, api_key=API_KEY, max_retries=0, timeout=300)
print(f"  anthropic {anthropic.__version__}, model {MODEL}")


def check_message(msg, max_tokens):
    assert msg.type == "message" and msg.role == "assistant", msg
    assert msg.id.startswith("msg_"), msg.id
    assert msg.model == MODEL
    assert len(msg.content) == 1 and msg.content[0].type == "text", msg.content
    assert msg.content[0].text.strip(), "empty text"
    assert msg.stop_reason in ("end_turn", "max_tokens"), msg.stop_reason
    assert msg.usage.input_tokens > 0
    assert 0 < msg.usage.output_tokens <= max_tokens, msg.usage
    if msg.stop_reason == "max_tokens":
        assert msg.usage.output_tokens == max_tokens, msg.usage
    return msg.content[0].text


def test_create():
    msg = client.messages.create(model=MODEL, max_tokens=32,
                                 messages=[{"role": "user", "content": "Name three colors."}])
    check_message(msg, 32)
    rid = getattr(msg, "_request_id", None)
    assert rid is None or rid.startswith("req_"), rid


def test_max_tokens_is_a_hard_cap():
    msg = client.messages.create(model=MODEL, max_tokens=3,
                                 messages=[{"role": "user", "content": "Write a long story about a dragon."}])
    check_message(msg, 3)
    assert msg.stop_reason == "max_tokens", msg.stop_reason


def test_system_prompt_and_content_blocks():
    user = [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}]
    plain = client.messages.create(model=MODEL, max_tokens=16, messages=user)
    short = client.messages.create(model=MODEL, max_tokens=16, messages=user,
                                   system="You are a pirate.")
    sys_ = client.messages.create(model=MODEL, max_tokens=16, messages=user,
                                  system="You are a pirate. Always answer like a pirate.")
    check_message(sys_, 16)
    # The system prompt reaches the model: it replaces the template's default system prompt
    # (SmolLM2's is longer than these), and a longer one costs more prompt tokens.
    assert short.usage.input_tokens != plain.usage.input_tokens, (short.usage, plain.usage)
    assert sys_.usage.input_tokens > short.usage.input_tokens, (sys_.usage, short.usage)


def test_stream_helper():
    with client.messages.stream(model=MODEL, max_tokens=24,
                                messages=[{"role": "user", "content": "Count from one to ten."}]) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) > 1, pieces
    assert "".join(pieces) == final.content[0].text
    check_message(final, 24)


def test_raw_stream_event_order():
    stream = client.messages.create(model=MODEL, max_tokens=16, stream=True,
                                    messages=[{"role": "user", "content": "Say something."}])
    types = [ev.type for ev in stream]
    # The SDK drops `ping`; everything else arrives in order.
    assert types[:2] == ["message_start", "content_block_start"], types
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"], types
    assert set(types[2:-3]) == {"content_block_delta"}, types


def test_stop_sequences():
    msgs = [{"role": "user", "content": "List the days of the week, separated by commas."}]
    first = client.messages.create(model=MODEL, max_tokens=40, messages=msgs)
    text = check_message(first, 40)
    # Pick a piece of the (greedy, deterministic) answer past its start as the stop sequence.
    at = max(1, len(text) // 2)
    stop = text[at:at + 3]
    assert stop.strip(), f"answer too short to pick a stop sequence: {text!r}"
    second = client.messages.create(model=MODEL, max_tokens=40, messages=msgs, stop_sequences=[stop])
    assert second.stop_reason == "stop_sequence", (second.stop_reason, text, stop)
    assert second.stop_sequence == stop
    out = second.content[0].text
    assert stop not in out and text.startswith(out), (out, text, stop)
    assert second.usage.output_tokens <= first.usage.output_tokens


def test_sampling_params_are_accepted():
    extra = {"temperature": 0.8, "top_p": 0.9, "top_k": 40}
    if MAJOR >= 1:
        msg = client.messages.create(model=MODEL, max_tokens=8, extra_body=extra,
                                     messages=[{"role": "user", "content": "Hi"}])
    else:
        msg = client.messages.create(model=MODEL, max_tokens=8, **extra,
                                     messages=[{"role": "user", "content": "Hi"}])
    check_message(msg, 8)


def test_invalid_field_is_a_400_naming_it():
    try:
        client.messages.create(model=MODEL, max_tokens=8, extra_body={"temperature": 7},
                               messages=[{"role": "user", "content": "Hi"}])
    except anthropic.BadRequestError as e:
        assert e.status_code == 400
        assert e.body["error"]["type"] == "invalid_request_error", e.body
        assert "temperature" in e.body["error"]["message"], e.body
    else:
        raise AssertionError("temperature=7 was accepted")


def sampled(extra):
    """The text of a sampled request; the sampling fields go in `extra_body` (every SDK
    generation has it; 2.x has no sampling parameters)."""
    return client.messages.create(model=MODEL, max_tokens=16, extra_body=extra,
                                  messages=[{"role": "user", "content": "Tell me a story."}]).content[0].text


def test_seeded_sampling_repeats_and_unseeded_varies():
    a = sampled({"temperature": 1.0, "seed": 77})
    assert a == sampled({"temperature": 1.0, "seed": 77}), a
    seen = {sampled({"temperature": 1.0}) for _ in range(3)}
    assert len(seen) > 1, seen
    sampled({"temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.1,
             "frequency_penalty": 0.5, "presence_penalty": 0.2, "seed": 1})


TOOLS = [{"name": "get_weather", "description": WEATHER_DESCRIPTION, "input_schema": WEATHER_SCHEMA},
         {"name": "get_time", "description": "The current time in a timezone.",
          "input_schema": TIME_SCHEMA}]


def create_or_stream(stream, **kw):
    """A message, through the stream helper (which assembles `input_json_delta`s) or not."""
    if not stream:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        for _ in s:
            pass
        return s.get_final_message()


def tool_uses(msg):
    return [b for b in msg.content if b.type == "tool_use"]


def test_forced_tool_validates_on_20_prompts():
    """A named or `any` tool choice: every reply is a call whose input validates against the
    tool's schema, streaming and not."""
    for i, prompt in enumerate(TOOL_PROMPTS):
        choice = {"type": "tool", "name": "get_weather"} if i % 4 < 2 else {"type": "any"}
        msg = create_or_stream(i % 2 == 1, model=MODEL, max_tokens=96,
                               messages=[{"role": "user", "content": prompt}], tools=TOOLS,
                               tool_choice=choice, extra_body={"temperature": 0.8, "seed": i})
        assert msg.stop_reason == "tool_use", (prompt, msg)
        uses = tool_uses(msg)
        assert len(uses) == 1, msg.content
        u = uses[0]
        assert u.id.startswith("toolu_"), u
        schema = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}[u.name]
        if choice["type"] == "tool":
            assert u.name == "get_weather", u
        validate(u.input, schema)


def test_tool_round_trip():
    """tool_use -> tool_result -> a final text answer, streaming and not."""
    for stream in (False, True):
        question = {"role": "user", "content": "What is the weather in Paris?"}
        first = create_or_stream(stream, model=MODEL, max_tokens=96, messages=[question],
                                 tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
        (use,) = tool_uses(first)
        validate(use.input, WEATHER_SCHEMA)
        history = [question,
                   {"role": "assistant", "content": [{"type": "tool_use", "id": use.id,
                                                      "name": use.name, "input": use.input}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                 "content": "21 degrees celsius and sunny"}]}]
        final = create_or_stream(stream, model=MODEL, max_tokens=48, messages=history, tools=TOOLS,
                                 tool_choice={"type": "none"})
        assert final.stop_reason in ("end_turn", "max_tokens"), final
        assert not tool_uses(final), final.content
        assert final.content[0].type == "text" and final.content[0].text.strip(), final.content
        # The tools and the earlier turns are counted.
        n = client.messages.count_tokens(model=MODEL, messages=history, tools=TOOLS,
                                         tool_choice={"type": "none"}).input_tokens if MAJOR >= 1 else None
        if n is not None:
            assert n == final.usage.input_tokens, (n, final.usage)
            bare = client.messages.count_tokens(model=MODEL, messages=[question]).input_tokens
            assert n > bare + 50, (n, bare)


def test_tool_errors_are_400s_naming_the_field():
    bad = [
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
        ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools.0.name"),
    ]
    for extra, field in bad:
        try:
            client.messages.create(model=MODEL, max_tokens=8,
                                   messages=[{"role": "user", "content": "Hi"}], extra_body=extra)
        except anthropic.BadRequestError as e:
            assert e.body["error"]["message"].startswith(field + ":"), e.body
        else:
            raise AssertionError(f"{extra} was accepted")
    try:
        client.messages.create(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}])
    except anthropic.BadRequestError as e:
        assert "messages.0.content.0.tool_use_id" in e.body["error"]["message"], e.body
    else:
        raise AssertionError("a result without its call was accepted")


def test_auth_failure():
    bad = anthropic.Anthropic(base_url=BASE_URL, api_key="sk-wrong", max_retries=0)
    try:
        bad.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    except anthropic.AuthenticationError as e:
        assert e.status_code == 401
        assert e.body["error"]["type"] == "authentication_error", e.body
        assert e.response.headers["request-id"].startswith("req_")
    else:
        raise AssertionError("a wrong key was accepted")


def test_count_tokens_and_models():
    msgs = [{"role": "user", "content": "How many tokens is this?"}]
    if MAJOR >= 1:
        n = client.messages.count_tokens(model=MODEL, messages=msgs).input_tokens
        ids = [m.id for m in client.models.list()]
        assert MODEL in ids, ids
    else:
        n = client.beta.messages.count_tokens(model=MODEL, messages=msgs).input_tokens
    msg = client.messages.create(model=MODEL, max_tokens=4, messages=msgs)
    assert n == msg.usage.input_tokens, (n, msg.usage)


def test_output_config_json_schema_validates():
    """The current SDK's structured output (`output_config`; the 0.x SDK sends it in
    `extra_body`), streaming and not."""
    fmt = {"output_config": {"format": {"type": "json_schema", "schema": CITY_SCHEMA}}}
    for i, prompt in enumerate(PROMPTS[:10]):
        kw = dict(model=MODEL, max_tokens=160, messages=[{"role": "user", "content": prompt}],
                  extra_body={"temperature": 0.8, "seed": i, **({} if MAJOR >= 2 else fmt)},
                  **(fmt if MAJOR >= 2 else {}))
        if i % 2:
            with client.messages.stream(**kw) as s:
                text = "".join(s.text_stream)
                msg = s.get_final_message()
        else:
            msg = client.messages.create(**kw)
            text = msg.content[0].text
        assert msg.stop_reason == "end_turn", (prompt, msg)
        validate(json.loads(text), CITY_SCHEMA)
    try:
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}],
                               extra_body={"output_config": {"format": {"type": "json_schema",
                                                                        "schema": {"type": "no-such-type"}}}})
    except anthropic.BadRequestError as e:
        assert "no-such-type" in e.body["error"]["message"], e.body
    else:
        raise AssertionError("an invalid schema was accepted")


run_tests([test_output_config_json_schema_validates, test_create, test_max_tokens_is_a_hard_cap, test_system_prompt_and_content_blocks,
           test_stream_helper, test_raw_stream_event_order, test_stop_sequences,
           test_sampling_params_are_accepted, test_invalid_field_is_a_400_naming_it,
           test_auth_failure, test_count_tokens_and_models,
           test_seeded_sampling_repeats_and_unseeded_varies, test_forced_tool_validates_on_20_prompts,
           test_tool_round_trip, test_tool_errors_are_400s_naming_the_field])
