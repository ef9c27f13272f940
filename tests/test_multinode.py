"""A real two-node Ray cluster on this machine: the Serve app (ingress, LLMServer replica,
scheduler actor, shard actor) with TP=2 and one rank per node, and a clear, immediate error
when a layout cannot be placed; last, a node removed mid-stream and one joining again."""
import json
import os
import time

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import httpx  # noqa: E402
import ray  # noqa: E402
from oracle import hf_greedy  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from serving import free_port, wait_ready  # noqa: E402
from test_engine import prompts_of  # noqa: E402

from actors.engine.llm import LLM  # noqa: E402
from actors.executor.placement import PlacementError  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def serve_tp2_across_nodes(llama_ckpt) -> str:
    """Serve (started here) with the app at tp=2, bundles [replica 0.1, rank 0: 1.5, rank 1: 1.5]:
    on two 2-CPU nodes PACK must put the two ranks on different nodes. Its URL, once ready."""
    from ray import serve

    from app.serving.builder import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model_path": str(llama_ckpt), "tp_size": 2, "shard_cpus": 1.5,
                         "num_kv_blocks": 32, "dist_timeout": 60}), name="shoal", route_prefix="/")
    return wait_ready(f"http://127.0.0.1:{port}", timeout=120)


def test_llm_server_tp2_across_two_nodes(two_nodes, llama_ckpt):
    from ray import serve

    try:
        url = serve_tp2_across_nodes(llama_ckpt)
        for ids in prompts_of([7, 19]):
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "", "prompt": ids, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.json()["choices"][0]["token_ids"] == hf_greedy(llama_ckpt, ids, 10)
        (replica,) = httpx.get(f"{url}/stats", timeout=10).json()["replicas"]
        nodes = [r["node_id"] for r in replica["ranks"]]
        assert len(nodes) == 2 and nodes[0] != nodes[1]  # one rank per node
    finally:
        serve.shutdown()


def test_replica_and_its_engine_on_two_nodes_talk_through_ray(two_nodes, llama_ckpt):
    """STRICT_SPREAD puts the ModelServer replica and its scheduler actor on different nodes:
    no shared Unix socket, so requests and outputs go through Ray (RayLink) and must come back
    the same, streamed or not, with the engine's refusals as 400s."""
    from ray import serve

    from app.serving.builder import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app({"model_path": str(llama_ckpt), "shard_cpus": 1, "num_kv_blocks": 32,
                             "placement_strategy": "STRICT_SPREAD"}), name="shoal", route_prefix="/")
        url = wait_ready(f"http://127.0.0.1:{port}", timeout=120)
        (ids,) = prompts_of([11])
        body = {"model": "", "prompt": ids, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        r = httpx.post(f"{url}/v1/completions", timeout=60, json=body)
        whole = r.json()["choices"][0]
        assert whole["token_ids"] == hf_greedy(llama_ckpt, ids, 10)
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={**body, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
        # the stream across the two nodes carries the same text, piece by piece, to the same end
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["text"]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={**body, "prompt": [10**6]})
        assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
    finally:
        serve.shutdown()


def test_unplaceable_layout_fails_at_once(two_nodes, llama_ckpt):
    from app.serving.builder import build_app

    start = time.monotonic()
    with pytest.raises(PlacementError, match=r"cannot place 1 replica\(s\).*STRICT_SPREAD.*node 1: "):
        LLM(str(llama_ckpt), tp_size=4, placement_strategy="STRICT_SPREAD", shard_cpus=1, dist_timeout=60)
    with pytest.raises(PlacementError, match=r"cannot place 2 replica\(s\).*\{CPU: 2\}"):
        build_app({"model_path": str(llama_ckpt), "tp_size": 2, "world_size": 4, "shard_cpus": 1})
    assert time.monotonic() - start < 10


def test_a_node_lost_mid_stream_fails_the_stream_and_serving_resumes_when_a_node_joins(two_nodes, llama_ckpt):
    """tp=2 with one rank per node; the worker node is removed (its raylet and every process on
    it stop) while a stream is in flight. The stream ends within seconds: an engine_dead error
    event, or the connection cut when the lost node held the replica itself. The head alone
    cannot hold the layout again: Serve marks the deployment UNHEALTHY (its controller logs that
    the new replica's resources are missing; requests wait in its proxy meanwhile). Once a node
    joins again, Serve places the replica and it answers like transformers. (Runs last: it
    changes the module's cluster.)"""
    from ray import serve

    try:
        url = serve_tp2_across_nodes(llama_ckpt)
        (worker,) = two_nodes.worker_nodes
        (replica,) = httpx.get(f"{url}/stats", timeout=10).json()["replicas"]
        assert worker.node_id in [r["node_id"] for r in replica["ranks"]]
        body = {"model": "", "prompt": prompts_of([5])[0], "max_tokens": 480, "temperature": 0,
                "ignore_eos": True, "stream": True}
        rest, cut = [], False
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # tokens are flowing
            removed = time.monotonic()
            two_nodes.remove_node(worker)
            try:
                rest = [line for line in lines if line.startswith("data: ")]
            except httpx.HTTPError:
                cut = True
        ended = time.monotonic() - removed
        errors = [json.loads(line[6:])["error"] for line in rest if line != "data: [DONE]" and '"error"' in line]
        assert cut or (errors and errors[0]["code"] == "engine_dead"), rest[-3:]
        assert ended < 30, f"the stream ran on for {ended:.1f} s after its node was lost"
        deadline = time.monotonic() + 60
        while deployment_status("shoal") != "UNHEALTHY":
            assert time.monotonic() < deadline, f"Serve still says {deployment_status('shoal')}"
            time.sleep(1)
        two_nodes.add_node(num_cpus=2)
        ids = prompts_of([13])[0]
        deadline = time.monotonic() + 180
        while True:
            try:
                r = httpx.post(f"{url}/v1/completions", timeout=30, json={
                    "model": "", "prompt": ids, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True})
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "not serving again after a node joined"
            time.sleep(1)
        assert r.json()["choices"][0]["token_ids"] == hf_greedy(llama_ckpt, ids, 10)
        print(f"node lost: stream ended after {ended:.1f} s ({'cut' if cut else 'engine_dead'}), "
              f"answered again {time.monotonic() - removed:.0f} s after the loss")
    finally:
        serve.shutdown()


def deployment_status(app: str) -> str:
    """Serve's status of an application's (one) deployment, e.g. HEALTHY, UNHEALTHY."""
    from ray import serve
    (deployment,) = serve.status().applications[app].deployments.values()
    return deployment.status.value
