"""LoRA adapters through Ray Serve: two replicas with prefix-aware routing; an adapter loaded
over HTTP reaches every replica, outputs equal transformers + peft, unloading makes it 404."""
from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import httpx  # noqa: E402
import pytest  # noqa: E402
from oracle import hf_greedy  # noqa: E402
from serving import free_port, wait_ready  # noqa: E402
from test_engine import prompts_of  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(adapters):
    import ray
    from ray import serve
    from ray._private import ray_constants

    from app.serving.builder import build_app

    base, paths = adapters("llama")
    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False,
             logging_level="WARNING")
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app({"model_path": str(base), "num_replicas": 2, "routing": "prefix-aware",
                         "shard_cpus": 0.5, "num_kv_blocks": 128, "num_threads": 1,
                         "lora_modules": [f"a={paths['a']}"], "max_loras": 1, "max_lora_rank": 8})
        serve.run(app, name="lora", route_prefix="/")
        yield wait_ready(f"http://127.0.0.1:{port}", timeout=120), base, paths
    finally:
        serve.shutdown()
        ray.shutdown()


def complete(url: str, model: str, ids: list[int]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})


def test_adapters_on_every_replica(served):
    url, base, paths = served
    from actors.worker.checkpoint_files import load_tokenizer
    tok = load_tokenizer(base)
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(paths["b"])})
    assert r.status_code == 200, r.text
    replicas = httpx.get(f"{url}/stats").json()["replicas"]
    assert len(replicas) == 2 and all(s["lora_adapters"] == ["a", "b"] for s in replicas)
    cards = {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}
    assert cards["b"]["parent"] == base.name
    for name, ids in zip(["a", "b", base.name, "a"], prompts_of([7, 12, 9, 15], seed=3)):
        r = complete(url, name, ids)
        assert r.status_code == 200, r.text
        want = hf_greedy(base, ids, 6, adapter=paths.get(name))
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == want, name  # the ids: two token sequences can decode alike
        assert choice["text"] == tok.decode(want, skip_special_tokens=True), name
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
    r = complete(url, "b", [1, 2, 3])
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert 'lora_name="a"' in httpx.get(f"{url}/metrics").text
