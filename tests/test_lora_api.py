"""LoRA adapters over HTTP: load and unload at run time (behind the API key), /v1/models
with parents, 404s in OpenAI's shape, exact outputs under LRU eviction (--max-loras 1),
per-adapter metrics, and the adapter in the prefix-aware routing key.

uvicorn on 127.0.0.1 in a thread over an in-process engine (tests/test_api.py's set-up).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from oracle import hf_greedy, hf_prompt_logprobs
from test_engine import prompts_of

from actors.config import EngineConfig
from actors.request import EngineRequest
from actors.sampling_params import SamplingParams
from app.api.app import attach, build_api
from app.api.embedded import serve_in_thread
from app.api.engine_client import LocalEngineClient
from app.api.settings import ServerSettings
from app.serving.replica import RoutedRequest

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(adapters):
    base, paths = adapters("llama")
    client = LocalEngineClient(EngineConfig(model_path=str(base), num_kv_blocks=256, max_loras=1,
                                            max_lora_rank=8, lora_modules=[f"a={paths['a']}"]))
    settings = ServerSettings(model_path=str(base), api_key=KEY)
    try:
        with serve_in_thread(attach(build_api(settings), client, client.tokenizer, settings)) as url:
            yield url, base, paths
    finally:
        client.shutdown()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=120)


def completion_text(url: str, model: str, ids: list[int]) -> str:
    """The text of 8 greedy tokens after prompt ids `ids` on `model`."""
    r = post(url, "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 8,
                                      "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_load_use_unload_over_http(server):
    url, base, paths = server
    from actors.worker.checkpoint_files import load_tokenizer
    tok = load_tokenizer(base)
    models = lambda: {m["id"]: m for m in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]}  # noqa: E731
    assert set(models()) == {base.name, "a"} and models()["a"]["parent"] == base.name

    body = {"lora_name": "b", "lora_path": str(paths["b"])}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == 401  # the key guards it
    r = post(url, "/v1/load_lora_adapter", body)
    assert r.status_code == 200 and "added successfully" in r.text
    assert post(url, "/v1/load_lora_adapter", body).status_code == 400  # already loaded
    card = models()["b"]  # one listing: `created` is the listing's time, as in vLLM
    assert card == {**card, "parent": base.name, "root": str(paths["b"])}
    assert httpx.get(f"{url}/v1/models/b", headers=AUTH).json()["id"] == "b"

    # a, b and the base model at once; one adapter slot, so a and b take turns (LRU).
    prompts = prompts_of([6, 19, 11, 8])
    names = ["a", "b", base.name, "b"]
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda job: completion_text(url, *job), zip(names, prompts)))
    for name, ids, text in zip(names, prompts, texts):
        adapter = paths.get(name)
        assert text == tok.decode(hf_greedy(base, ids, 8, adapter=adapter), skip_special_tokens=True), name
    assert texts[0] != tok.decode(hf_greedy(base, prompts[0], 8), skip_special_tokens=True)  # it matters
    stats = httpx.get(f"{url}/stats", headers=AUTH).json()["replicas"][0]
    assert stats["lora_slots_loads"] >= 2  # one slot, two adapters: the second evicted the first

    r = post(url, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert r.status_code == 200 and "removed successfully" in r.text
    r = post(url, "/v1/completions", {"model": "b", "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 404
    assert r.json()["error"] == {**r.json()["error"], "code": "model_not_found", "param": "model",
                                 "type": "not_found_error"}
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 404
    assert "b" not in models()
    assert httpx.get(f"{url}/v1/models/b", headers=AUTH).status_code == 404


def test_streaming_and_scoring_on_an_adapter(server):
    url, base, paths = server
    from actors.worker.checkpoint_files import load_tokenizer
    tok = load_tokenizer(base)
    prompt, cont = "The quick brown", " fox jumps"
    r = post(url, "/loglikelihood", {"model": "a", "prompts": [prompt], "continuations": [cont]})
    assert r.status_code == 200, r.text
    context = tok.encode(prompt, add_special_tokens=True)
    ids = context + tok.encode(cont, add_special_tokens=False)
    want = sum(hf_prompt_logprobs(base, ids, adapter=paths["a"])[len(context) - 1:])
    assert r.json()["ll"][0] == pytest.approx(want, abs=1e-4)
    r = post(url, "/v1/chat/completions", {"model": "nope", "stream": True, "max_tokens": 2,
                                          "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_bad_adapter_is_400_and_metrics_name_adapters(server, tmp_path):
    url, _, _ = server
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "not a PEFT adapter" in r.json()["error"]["message"]
    post(url, "/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 1})
    text = httpx.get(f"{url}/metrics").text
    line = next(line for line in text.splitlines() if line.startswith("shoal_lora_requests_total")
                and 'lora_name="a"' in line)
    assert float(line.rsplit(" ", 1)[1]) >= 1


def test_prefix_routing_key_starts_with_the_adapter_and_salt():
    params = SamplingParams()
    plain = RoutedRequest(EngineRequest("r1", [1, 2, 3], params))
    on_a = RoutedRequest(EngineRequest("r2", [1, 2, 3], params, lora="a"))
    on_b = RoutedRequest(EngineRequest("r3", [1, 2, 3], params, lora="b"))
    assert on_a.prompt.startswith("a\x00") and on_a.prompt.endswith(plain.prompt)
    assert not on_b.prompt.startswith(on_a.prompt[:2]) and not plain.prompt.startswith("a")
    salted = RoutedRequest(EngineRequest("r4", [1, 2, 3], SamplingParams(cache_salt="s"), lora="a"))
    other_salt = RoutedRequest(EngineRequest("r5", [1, 2, 3], SamplingParams(cache_salt="t"), lora="a"))
    assert salted.prompt.startswith("a\x00s\x01") and salted.prompt.endswith(plain.prompt)
    assert salted.prompt != other_salt.prompt != on_a.prompt  # salted KV lives apart: so does routing
