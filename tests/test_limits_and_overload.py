"""Request limits (all configurable, all 4xx with an OpenAI body, checked before templating and
tokenizing) and overload (3x the queue limit at once: every answer is 200 or 429 with
Retry-After, every admitted request completes, and no KV block stays in use)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from actors.config import EngineConfig
from app.api.app import attach, build_api
from app.api.embedded import serve_in_thread
from app.api.engine_client import LocalEngineClient
from app.api.settings import ServerSettings

LIMITS = dict(max_request_bytes=4000, max_n=2, max_prompts=2, max_messages=3, max_input_chars=600,
              max_logit_bias=2, max_top_logprobs=3, max_tokens_cap=20, max_stop=2, max_stop_chars=8,
              max_tools=2, max_tool_schema_bytes=300)
QUEUE_LIMIT, SLOTS = 4, 2


@pytest.fixture(scope="module")
def url(llama_ckpt):
    client = LocalEngineClient(EngineConfig(model_path=str(llama_ckpt), num_kv_blocks=128,
                                            max_num_seqs=SLOTS, max_queued_requests=QUEUE_LIMIT))
    settings = ServerSettings(model_path=str(llama_ckpt), **LIMITS)
    try:
        with serve_in_thread(attach(build_api(settings), client, client.tokenizer, settings)) as base:
            yield base
    finally:
        client.shutdown()


def chat(**extra) -> dict:
    return {"model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


def tool(name: str, props: int = 1) -> dict:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(props)}}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


CASES = {
    "n": ("/v1/chat/completions", chat(n=3), "n"),
    "best_of": ("/v1/completions", {"model": "", "prompt": "hi", "best_of": 3, "n": 3}, "best_of"),
    "prompts": ("/v1/completions", {"model": "", "prompt": ["a", "b", "c"]}, "prompt"),
    "generate_prompts": ("/generate", {"prompts": ["a", "b", "c"]}, "prompts"),
    "loglikelihood_prompts": ("/loglikelihood", {"prompts": ["a", "b", "c"], "continuations": ["x"] * 3},
                              "prompts"),
    "messages": ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "a"},
                                                         {"role": "assistant", "content": "b"}] * 2),
                 "messages"),
    "input_chars": ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x" * 700}]),
                    "messages"),
    "prompt_chars": ("/v1/completions", {"model": "", "prompt": "y" * 700}, "prompt"),
    "logit_bias": ("/v1/chat/completions", chat(logit_bias={"1": 1, "2": 1, "3": 1}), "logit_bias"),
    "top_logprobs": ("/v1/chat/completions", chat(logprobs=True, top_logprobs=4), "top_logprobs"),
    "max_tokens": ("/v1/chat/completions", chat(max_tokens=21), "max_tokens"),
    "stop_count": ("/v1/chat/completions", chat(stop=["a", "b", "c"]), "stop"),
    "stop_chars": ("/v1/chat/completions", chat(stop=["123456789"]), "stop"),
    "tools": ("/v1/chat/completions", chat(tools=[tool("a"), tool("b"), tool("c")]), "tools"),
    "tool_schema": ("/v1/chat/completions", chat(tools=[tool("a", props=20)]), "tools"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_limit_is_a_400_naming_the_field(url, case):
    path, body, param = CASES[case]
    r = httpx.post(f"{url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_within_the_limits_is_served(url):
    r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json=chat(
        n=2, max_tokens=20, stop=["12345678"], logit_bias={"1": 1}, tools=[tool("a")]))
    assert r.status_code == 200, r.text


def test_a_body_over_the_size_limit_is_413(url):
    r = httpx.post(f"{url}/v1/chat/completions", json=chat(user="u" * 5000), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    chunked = httpx.post(f"{url}/v1/chat/completions", timeout=30,  # no Content-Length: counted
                         content=iter([b'{"model": "", "user": "', b"u" * 5000, b'"}']),
                         headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413


def test_three_times_the_queue_limit_at_once(url):
    async def burst():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(http.post(f"{url}/v1/completions", json={
                "model": "", "prompt": f"fox {i}", "max_tokens": 16, "ignore_eos": True})
                for i in range(3 * (QUEUE_LIMIT + SLOTS))))

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses
    for r in responses:
        if r.status_code == 429:
            assert r.headers["Retry-After"] and r.json()["error"]["code"] == "queue_full"
        else:
            assert r.json()["usage"]["completion_tokens"] == 16
    (replica,) = httpx.get(f"{url}/stats", timeout=10).json()["replicas"]
    assert replica["kv_blocks_free"] == replica["kv_blocks_total"] and replica["running"] == 0
    assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
