"""Bad input by class, over real HTTP (uvicorn in a thread, a real engine): every string a
request can carry, in every route, replaced by text that is not valid Unicode (a lone UTF-16
surrogate, as JSON's "\\ud800" spells it), and every field that holds token ids given one
outside the vocabulary, gets a 400 in OpenAI's error shape: never a 500, never a silent accept."""
from __future__ import annotations

import copy
import json

import httpx
import pytest
from serving import api_in_thread

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
# One body per route with a string in every place that route reads one.
BODIES = {
    "/v1/chat/completions": {
        "model": "llama", "max_tokens": 2, "stop": ["zz"], "user": "u", "cache_salt": "s",
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "name": "ann", "content": [{"type": "text", "text": "hi"}]},
                     {"role": "assistant", "content": "ok", "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    },
    "/v1/completions": {"model": "llama", "prompt": ["a", "b"], "max_tokens": 2, "stop": "zz",
                        "guided_choice": ["x", "y"]},
    "/v1/embeddings": {"model": "llama", "input": ["a", "b"]},
    "/v1/responses": {"model": "llama", "input": [{"role": "user", "content": "hi"}], "instructions": "be brief",
                      "max_output_tokens": 2},
    "/tokenize": {"model": "llama", "prompt": "hi"},
    "/generate": {"prompts": ["a"], "stop": ["zz"], "max_tokens": 2},
    "/loglikelihood": {"prompts": ["a"], "continuations": ["b"]},
}
# Fields holding token ids: (route, the body with token id t in the field).
TOKEN_ID_FIELDS = {
    "prompt ids": ("/v1/completions", lambda t: {"prompt": [1, t], "max_tokens": 2}),
    "prompt id lists": ("/v1/completions", lambda t: {"prompt": [[1, 2], [t]], "max_tokens": 2}),
    "logit_bias": ("/v1/completions", lambda t: {"prompt": "a", "logit_bias": {str(t): 5}, "max_tokens": 2}),
    "stop_token_ids": ("/v1/completions", lambda t: {"prompt": "a", "stop_token_ids": [t], "max_tokens": 2}),
    "chat stop_token_ids": ("/v1/chat/completions", lambda t: {"messages": [{"role": "user", "content": "hi"}],
                                                               "stop_token_ids": [t], "max_tokens": 2}),
    "allowed_token_ids": ("/v1/completions", lambda t: {"prompt": "a", "allowed_token_ids": [t], "max_tokens": 2}),
    "embedding ids": ("/v1/embeddings", lambda t: {"input": [1, t]}),
    "detokenize": ("/detokenize", lambda t: {"tokens": [t]}),
    "generate ids": ("/generate", lambda t: {"prompts": [[1, t]], "max_tokens": 2}),
}


@pytest.fixture(scope="module")
def url(checkpoint_factory):
    path = checkpoint_factory("llama", max_position_embeddings=2048)  # room for the tool definitions
    with api_in_thread(path, "llama", num_kv_blocks=256) as url:
        yield url


def post(url: str, route: str, body) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \ud800, which is what a client's JSON carries
    return httpx.post(url + route, content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=60)


def string_paths(value, path=()):
    """Every string leaf of a JSON value, as a path of keys and indexes."""
    if isinstance(value, str):
        yield path
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from string_paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from string_paths(v, path + (i,))


def replaced(body, path, make):
    body = copy.deepcopy(body)
    *parents, last = path
    node = body
    for key in parents:
        node = node[key]
    node[last] = make(node[last])
    return body


def assert_openai_400(response: httpx.Response, what: str) -> str:
    assert response.status_code == 400, (what, response.status_code, response.text[:300])
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], (what, error)
    return error["message"]


@pytest.mark.parametrize("route", list(BODIES))
def test_every_string_with_a_lone_surrogate_is_refused(url, route):
    body = BODIES[route]
    assert post(url, route, body).status_code == 200, "the unaltered body must be served"
    paths = list(string_paths(body))
    assert paths
    for path in paths:
        for where in (lambda s: s + "\ud800", lambda s: "\udfff" + s):  # a lone high, a lone low surrogate
            message = assert_openai_400(post(url, route, replaced(body, path, where)), (route, path))
            assert "not valid Unicode" in message and str(path[-1]) in message, (route, path, message)


def test_a_valid_surrogate_pair_is_text(url):
    """"\\ud83d\\ude00" is one character (an emoji): served, not refused."""
    body = {"prompt": "smile \ud83d\ude00", "max_tokens": 2}
    raw = json.dumps(body)
    assert "\\ud83d\\ude00" in raw
    assert post(url, "/v1/completions", body).status_code == 200


@pytest.mark.parametrize("name", list(TOKEN_ID_FIELDS))
@pytest.mark.parametrize("bad", [10**6, -1])
def test_every_token_id_outside_the_vocabulary_is_refused(url, name, bad):
    route, body = TOKEN_ID_FIELDS[name]
    if name != "allowed_token_ids":  # refused whatever the ids: not built here
        assert post(url, route, body(3)).status_code == 200, (name, "the in-vocabulary body must be served")
    assert_openai_400(post(url, route, body(bad)), (name, bad))


def test_min_tokens_above_max_tokens_is_refused(url):
    """(vLLM refuses it too; it used to be served, stopping at max_tokens.)"""
    message = assert_openai_400(post(url, "/v1/completions", {"prompt": "a", "min_tokens": 5, "max_tokens": 2}),
                                "min_tokens")
    assert "min_tokens must be at most max_tokens (2)" in message
    assert post(url, "/v1/completions", {"prompt": "a", "min_tokens": 2, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "http://127.0.0.1/a.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}])
def test_a_content_part_that_is_not_text_is_refused_by_name(url, part):
    """shoal serves text (an image-text checkpoint's language model only): an image or audio part
    is a 400 that says so, not a request answered without it."""
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this"}, part]}],
            "max_tokens": 2}
    message = assert_openai_400(post(url, "/v1/chat/completions", body), part["type"])
    assert f"content parts of type {part['type']!r} are not supported" in message
