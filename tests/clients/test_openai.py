"""The official `openai` SDK against zerolayer's /v1/chat/completions. pip: openai."""
import openai

from common import API_KEY, BASE_URL, model_id, run_tests

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


run_tests([test_create, test_stream_with_usage, test_length_cap, test_auth_failure])
