"""What vLLM users expect besides the OpenAI routes, end to end over HTTP (uvicorn on
127.0.0.1, a real engine on a tiny random checkpoint, the `openai` client where it has the
call): exact final text, /tokenize and /detokenize, cache_salt, continuous usage stats,
parallel_tool_calls false, the max_completion_tokens spelling.
"""
from __future__ import annotations

import httpx
import openai
import pytest
from test_api import running, sse_events
from test_detokenizer import cut_character_ids

from actors.config import EngineConfig
from app.api.app import attach, build_api
from app.api.engine_client import LocalEngineClient
from app.api.settings import ServerSettings
from app.protocol.chat_template import render_chat_prompt

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
TWO_CALLS = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n'
             r'</tool_call>\n<tool_call>\n\{"name": "add", "arguments": \{"a": 1\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def ckpt(checkpoint_factory):
    return checkpoint_factory("llama", max_position_embeddings=2048)  # prompts with tools are long


@pytest.fixture(scope="module")
def engine(ckpt):
    client = LocalEngineClient(EngineConfig(model_path=str(ckpt), num_kv_blocks=800, block_size=4))
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def url(engine, ckpt):
    settings = ServerSettings(model_path=str(ckpt))
    with running(attach(build_api(settings), engine, engine.tokenizer, settings)) as base:
        yield base


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(ckpt):
    return ckpt.name


# --------------------------------------------------------------------------- exact final text

def test_a_cut_last_character_ends_the_text_as_decode_does(oai, model, engine):
    """The last token ends inside a multi-byte character: every finished text, streamed or
    not, equals tokenizer.decode(token_ids), which ends in U+FFFD."""
    tok = engine.tokenizer
    *prompt, cut = cut_character_ids(tok)
    force = dict(model=model, max_tokens=1, temperature=0, logit_bias={str(cut): 100})
    expected = tok.decode([cut])
    assert expected.endswith("\ufffd")

    r = oai.completions.create(prompt=prompt, extra_body={"return_token_ids": True}, **force)
    assert r.choices[0].token_ids == [cut] and r.choices[0].text == expected
    chunks = oai.completions.create(prompt=prompt, stream=True, **force)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected

    chat = oai.chat.completions.create(messages=USER, **force)
    assert chat.choices[0].message.content == expected
    chunks = oai.chat.completions.create(messages=USER, stream=True, **force)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


# --------------------------------------------------------------------------- tokenize

def test_tokenize_and_detokenize(url, model, engine, oai):
    tok = engine.tokenizer
    r = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": "The quick brown fox"})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tok.encode("The quick brown fox")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 2048
    plain = httpx.post(f"{url}/tokenize", json={"prompt": "The quick brown fox",
                                                 "add_special_tokens": False,
                                                 "return_token_strs": True}).json()
    assert plain["tokens"] == tok.encode("The quick brown fox", add_special_tokens=False)
    assert plain["token_strs"] == tok.convert_ids_to_tokens(plain["tokens"])

    chat = httpx.post(f"{url}/tokenize", json={"messages": USER}).json()
    assert chat["tokens"] == render_chat_prompt(tok, USER)[1]
    usage = oai.chat.completions.create(model=model, messages=USER, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens

    back = httpx.post(f"{url}/detokenize", json={"model": model, "tokens": plain["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "The quick brown fox"}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": "a", "messages": USER}, None),
    ("/tokenize", {"prompt": "a", "model": "gpt-9"}, "model"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_tokenize_errors_are_4xx(url, path, body, param):
    r = httpx.post(f"{url}{path}", json=body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and "Traceback" not in r.text
    if path == "/tokenize" and param is None:
        assert "exactly one of `prompt` and `messages`" in error["message"]


# --------------------------------------------------------------------------- cache_salt

def test_cache_salt_shares_blocks_only_within_a_salt(url, model):
    prompt = "alpha beta gamma delta epsilon zeta eta theta iota kappa " * 4

    def hits_after(**extra) -> int:
        before = httpx.get(f"{url}/stats").json()["replicas"][0]["prefix_cache_hits"]
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": model, "prompt": prompt, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return httpx.get(f"{url}/stats").json()["replicas"][0]["prefix_cache_hits"] - before

    assert hits_after(cache_salt="tenant-a") == 0  # first time: nothing cached
    assert hits_after(cache_salt="tenant-a") > 0  # same salt: shares the blocks
    assert hits_after(cache_salt="tenant-b") == 0  # another salt: never
    assert hits_after() == 0  # no salt does not share with a salt
    assert hits_after() > 0  # ... but with no salt
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


# --------------------------------------------------------------------------- vLLM's spellings

def test_continuous_usage_stats_on_every_chunk(oai, model):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(oai.chat.completions.create(model=model, messages=USER, max_tokens=6,
                                              stream=True, stream_options=options,
                                              extra_body={"ignore_eos": True}))
    assert all(c.usage is not None for c in chunks)
    done = [c.usage.completion_tokens for c in chunks]
    assert done == sorted(done) and done[-1] == 6
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}
    text = list(oai.completions.create(model=model, prompt="Hello", max_tokens=4, stream=True,
                                       stream_options=options, extra_body={"ignore_eos": True}))
    assert all(c.usage is not None for c in text) and text[-1].usage.completion_tokens == 4
    plain = list(oai.completions.create(model=model, prompt="Hello", max_tokens=4, stream=True,
                                        stream_options={"include_usage": True}))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_parallel_tool_calls_false_keeps_one_call(oai, model, url):
    kwargs = dict(model=model, messages=USER, tools=TOOLS, max_tokens=160,
                  extra_body={"guided_regex": TWO_CALLS})
    both = oai.chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert [c.function.name for c in both] == ["get_weather", "add"]
    one = oai.chat.completions.create(parallel_tool_calls=False, **kwargs).choices[0]
    assert [c.function.name for c in one.message.tool_calls] == ["get_weather"]
    assert one.finish_reason == "tool_calls"
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": USER, "tools": TOOLS, "max_tokens": 160, "parallel_tool_calls": False,
        "guided_regex": TWO_CALLS, "stream": True})
    with_calls = [e for e in sse_events(r)[:-1] if e["choices"] and e["choices"][0]["delta"].get("tool_calls")]
    assert {d["index"] for e in with_calls for d in e["choices"][0]["delta"]["tool_calls"]} == {0}


def test_max_completion_tokens_spelling(oai, model):
    r = oai.chat.completions.create(model=model, messages=USER, max_completion_tokens=3,
                                    extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
