"""GPU placement on CPU, with Ray's logical GPUs (`ray.init(num_gpus=8)`): every rank's actor
claims a GPU from its bundle, so each rank of a tp=2 replica and of a pp=2 replica beside it
gets its own GPU id. A layout needing more GPUs than exist fails at once."""
import os
import time

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import httpx  # noqa: E402
import ray  # noqa: E402
from oracle import hf_greedy  # noqa: E402
from serving import free_port, wait_ready  # noqa: E402
from test_engine import prompts_of  # noqa: E402

from actors.executor.placement import PlacementError  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def serve_url():
    from ray import serve

    ray.init(address="local", include_dashboard=False, num_cpus=8, num_gpus=8, log_to_driver=False,
             logging_level="WARNING")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def ranks_of(url: str) -> list[list[dict]]:
    return [r["ranks"] for r in httpx.get(f"{url}/stats", timeout=10).json()["replicas"]]


def test_every_rank_of_every_replica_gets_its_own_gpu(serve_url, checkpoint_factory):
    from ray import serve

    from app.serving.builder import build_app

    path = checkpoint_factory("llama", num_hidden_layers=3)
    gpu = {"model_path": str(path), "device": "cpu", "shard_gpus": 1, "shard_cpus": 0.5,
           "num_kv_blocks": 32, "log_level": "WARNING"}
    # A tensor-parallel replica and a pipeline-parallel one, two ranks each: no GPU shared
    # within a replica's placement group or across two.
    serve.run(build_app({**gpu, "tp_size": 2}), name="tp", route_prefix="/tp")
    serve.run(build_app({**gpu, "pp_size": 2}), name="pp", route_prefix="/pp")
    tp, pp = wait_ready(f"{serve_url}/tp", 180), wait_ready(f"{serve_url}/pp", 180)

    (tp_ranks,), (pp_ranks,) = ranks_of(tp), ranks_of(pp)
    assert len(tp_ranks) == 2 and len(pp_ranks) == 2
    ids = [r["gpu_ids"] for r in tp_ranks + pp_ranks]
    assert all(len(i) == 1 for i in ids)
    assert len({i[0] for i in ids}) == 4  # no two ranks share a GPU

    prompt = prompts_of([12])[0]  # the pipeline's stages answer as transformers does
    r = httpx.post(f"{pp}/v1/completions", timeout=60, json={
        "model": "", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == hf_greedy(path, prompt, 8)


def test_more_gpus_than_the_cluster_has_fails_at_once(serve_url, llama_ckpt):
    from app.serving.builder import build_app

    start = time.monotonic()
    with pytest.raises(PlacementError, match=r"cannot place 1 replica\(s\): each needs .*GPU: 1.*"
                                             r"the cluster has node 0: \{CPU: 8, GPU: 8"):
        build_app({"model_path": str(llama_ckpt), "tp_size": 16, "shard_gpus": 1, "shard_cpus": 0.1})
    assert time.monotonic() - start < 10
