"""The official `openai` SDK against zerolayer's /v1/chat/completions. pip: openai."""
import json

import openai

from common import (API_KEY, BASE_URL, CITY_SCHEMA, PROMPTS, TIME_SCHEMA, TOOL_PROMPTS,
                    WEATHER_DESCRIPTION, WEATHER_SCHEMA, model_id, run_tests, validate)

MODEL = model_id()
client = openai.OpenAI(base_url=BASE_URL + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
MSGS = [{"role": "system", "content": "You are concise."},
        {"role": "user", "content": "Name a fruit."}]


def test_create():
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=16)
    assert r.object == "chat.completion", r
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content.strip(), c
    assert c.finish_reason in ("stop", "length"), c.finish_reason
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 16, u
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens, u


def test_stream_with_usage():
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip(), "empty text"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0] in ("stop", "length"), finishes
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None, last
    assert 0 < last.usage.completion_tokens <= 16
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


def test_length_cap():
    r = client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": "Write a long poem."}])
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2, r


def test_auth_failure():
    bad = openai.OpenAI(base_url=BASE_URL + "/v1", api_key="sk-wrong", max_retries=0)
    try:
        bad.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4)
    except openai.AuthenticationError as e:
        assert e.status_code == 401
    else:
        raise AssertionError("a wrong key was accepted")


def test_logprobs_match_the_sampled_tokens():
    for stream in (False, True):
        kw = dict(model=MODEL, messages=MSGS, max_tokens=8, logprobs=True, top_logprobs=3)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            content = [t for c in chunks if c.choices and c.choices[0].logprobs
                       for t in c.choices[0].logprobs.content]
        else:
            r = client.chat.completions.create(**kw)
            text, content = r.choices[0].message.content, r.choices[0].logprobs.content
        assert content, "no logprobs"
        # greedy: each sampled token is the most likely one, its logprob the top one
        for t in content:
            assert len(t.top_logprobs) == 3, t
            assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob, t
            assert t.logprob <= 0 and t.bytes is not None
        # the tokens' bytes spell the text (held-back stop-sequence tokens aside: none here)
        assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace") == text, (text, content)


def test_seeded_sampling_repeats_and_unseeded_varies():
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
              max_tokens=16, temperature=1.0)
    a = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    assert a == b, (a, b)
    seen = {client.chat.completions.create(**kw).choices[0].message.content for _ in range(3)}
    assert len(seen) > 1, seen
    # penalties and min_p reach the server (extra_body for the non-OpenAI names)
    r = client.chat.completions.create(frequency_penalty=1.5, presence_penalty=0.5,
                                       extra_body={"min_p": 0.1, "repeat_penalty": 1.2, "top_k": 40}, **kw)
    assert r.choices[0].message.content, r


def test_n_choices():
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, n=3, temperature=1.0, seed=9)
    assert [c.index for c in r.choices] == [0, 1, 2], r
    assert all(c.message.content for c in r.choices), r
    assert 3 <= r.usage.completion_tokens <= 24, r.usage
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, n=2, stream=True))
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1], finished


def test_legacy_completions_with_logprobs():
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, logprobs=2)
    c = r.choices[0]
    assert r.object == "text_completion" and c.text, r
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6, lp
    assert "".join(lp.tokens) == c.text, (lp.tokens, c.text)
    for tok, l, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert max(top.values()) == l, (tok, l, top)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_unsupported_fields_are_refused():
    for extra in ({"functions": [{"name": "f", "parameters": {}}]},
                  {"tools": [{"type": "custom", "custom": {"name": "f"}}]},
                  {"logit_bias": {"1": 2}}):
        try:
            client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, **extra)
        except openai.BadRequestError as e:
            assert list(extra)[0] in str(e), e
        else:
            raise AssertionError(f"{extra} was accepted")


def test_response_format_json_schema_validates_on_20_prompts():
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}
    for i, prompt in enumerate(PROMPTS):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=160,
                  response_format=rf, temperature=0.8, seed=i)
        if i % 2:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            c = client.chat.completions.create(**kw).choices[0]
            text, finish = c.message.content, [c.finish_reason]
        assert finish == ["stop"], (prompt, finish, text)
        validate(json.loads(text), CITY_SCHEMA)


def test_response_format_json_object_and_a_bad_schema():
    c = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=64,
                                       response_format={"type": "json_object"}).choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict), c
    else:  # cut at max_tokens: still the start of an object
        assert c.message.content.startswith("{"), c
    for stream in (False, True):
        try:
            client.chat.completions.create(
                model=MODEL, messages=MSGS, max_tokens=8, stream=stream,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
        except openai.BadRequestError as e:
            # The 400 names the request's field (not the service's internal name) and the fault.
            assert "response_format.json_schema.schema" in str(e) and "no-such-type" in str(e), e
        else:
            raise AssertionError("an invalid schema was accepted")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": WEATHER_DESCRIPTION,
                                           "parameters": WEATHER_SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "description": "The current time.",
                                           "parameters": TIME_SCHEMA}}]


def chat_or_stream(stream, **kw):
    """(content, tool calls as [(id, name, arguments)], finish_reason), assembling streamed
    `tool_calls` deltas by index as SDK users do."""
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        calls = [(t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        return c.message.content, calls, c.finish_reason
    text, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        text += ch.delta.content or ""
        for t in ch.delta.tool_calls or []:
            slot = calls.setdefault(t.index, ["", "", ""])
            slot[0] = t.id or slot[0]
            slot[1] += (t.function.name or "") if t.function else ""
            slot[2] += (t.function.arguments or "") if t.function else ""
        finish = ch.finish_reason or finish
    return text or None, [tuple(calls[i]) for i in sorted(calls)], finish


def test_forced_tool_validates_on_20_prompts():
    for i, prompt in enumerate(TOOL_PROMPTS):
        choice = {"type": "function", "function": {"name": "get_weather"}} if i % 4 < 2 else "required"
        content, calls, finish = chat_or_stream(
            i % 2 == 1, model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=96,
            tools=TOOLS, tool_choice=choice, temperature=0.8, seed=i)
        assert finish == "tool_calls", (prompt, finish, content, calls)
        assert len(calls) == 1 and not content, (content, calls)
        call_id, name, args = calls[0]
        assert call_id.startswith("call_"), call_id
        if choice != "required":
            assert name == "get_weather", name
        validate(json.loads(args), {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}[name])


def test_tool_round_trip():
    for stream in (False, True):
        question = {"role": "user", "content": "Will it rain in London tomorrow?"}
        _, calls, finish = chat_or_stream(stream, model=MODEL, messages=[question], max_tokens=96,
                                          tools=TOOLS, tool_choice="required")
        assert finish == "tool_calls", finish
        call_id, name, args = calls[0]
        history = [question,
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]},
                   {"role": "tool", "tool_call_id": call_id, "content": "Light rain, 12 degrees."}]
        content, calls, finish = chat_or_stream(stream, model=MODEL, messages=history, max_tokens=48,
                                                tools=TOOLS, tool_choice="none")
        assert finish in ("stop", "length"), finish
        assert not calls and content and content.strip(), (content, calls)


run_tests([test_forced_tool_validates_on_20_prompts, test_tool_round_trip,
           test_response_format_json_schema_validates_on_20_prompts,
           test_response_format_json_object_and_a_bad_schema,
           test_create, test_stream_with_usage, test_length_cap, test_auth_failure,
           test_logprobs_match_the_sampled_tokens, test_seeded_sampling_repeats_and_unseeded_varies,
           test_n_choices, test_legacy_completions_with_logprobs, test_unsupported_fields_are_refused])
