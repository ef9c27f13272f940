"""End to end through Ray Serve: the official openai client against real deployments.

One Ray instance for the module (loopback only, no dashboard) hosts the apps: `shoal` at /
(one replica), `pair` at /pair (two replicas, an API key and a tiny queue limit, for the
routing, 401 and 429 checks), both in the default merged layout (each replica its own
ingress); `split` at /split (a separate Ingress in front of one LLMServer replica) and
`routed` at /routed (prefix-aware routing, which is split too); `split` also proposes n-gram
drafts (speculative decoding), which must change none of its greedy tokens. Serve runs with
its own direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS): the tests call the proxy on the head
node, which stays, and each replica answers on its own port as well. The `shoal serve` command is
exercised in subprocesses (`serve run` of serve_configs/dev.yaml: tests/test_serve_config_drain.py;
of the Ray Serve LLM config: tests/test_model_families.py).
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# Loopback sockets and no token auth (MACHINE-NOTES); Ray reads these when it is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402
from checkpoints import draft_copy  # noqa: E402
from serving import free_port, loopback_env, wait_ready  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PAIR_KEY = "sekret"
# Ray Serve's direct ingress, read by Serve's processes when they start; draining a replica
# keeps its port 30 s by default (for a load balancer to notice), which only slows the teardown.
DIRECT_INGRESS = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def serve_port():
    import ray
    from ray import serve
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # loopback even if ray was imported before us
    saved = {k: os.environ.get(k) for k in DIRECT_INGRESS}
    os.environ.update(DIRECT_INGRESS)  # Ray's processes inherit it; later modules must not
    try:
        ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False,
                 logging_level="WARNING")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def base_url(serve_port, llama_ckpt):
    from ray import serve

    from app.serving.builder import build_app

    app = build_app({"model_path": str(llama_ckpt), "num_kv_blocks": 256, "num_threads": 1})
    serve.run(app, name="shoal", route_prefix="/")
    return wait_ready(f"http://127.0.0.1:{serve_port}")


@pytest.fixture(scope="module")
def pair_url(serve_port, llama_ckpt, base_url):
    from ray import serve

    from app.serving.builder import build_app

    app = build_app({"model_path": str(llama_ckpt), "world_size": 2, "shard_cpus": 0.5,
                     "api_key": PAIR_KEY, "max_num_seqs": 2, "max_queued_requests": 2,
                     "num_kv_blocks": 64, "num_threads": 1})
    serve.run(app, name="pair", route_prefix="/pair")
    return wait_ready(f"http://127.0.0.1:{serve_port}/pair")


@pytest.fixture(scope="module")
def split_url(serve_port, llama_ckpt, base_url):
    from ray import serve

    from app.serving.builder import build_app

    app = build_app({"model_path": str(llama_ckpt), "serve_layout": "split", "shard_cpus": 0.2,
                     "num_kv_blocks": 256, "num_threads": 1, "speculative_config": SPECULATIVE,
                     "stream_interval": 3})
    serve.run(app, name="split", route_prefix="/split")
    return wait_ready(f"http://127.0.0.1:{serve_port}/split")


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(llama_ckpt):
    from actors.engine.llm import LLM
    return LLM(str(llama_ckpt), num_kv_blocks=64)


def greedy(**extra) -> dict:
    return {"temperature": 0, "max_tokens": 24, **extra}


def replica_stats(url: str, **headers) -> list[dict]:
    return httpx.get(f"{url}/stats", headers=headers, timeout=10).json()["replicas"]


# --------------------------------------------------------------------------- OpenAI API

def test_chat_non_streaming(client):
    r = client.chat.completions.create(model="", messages=MESSAGES, **greedy())
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0


def test_chat_streaming_equals_non_streaming(client):
    whole = client.chat.completions.create(model="", messages=MESSAGES, **greedy())
    chunks = list(client.chat.completions.create(
        model="", messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **greedy()))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("layout", ["merged", "split"])
def test_greedy_http_equals_offline_engine(layout, request, offline):
    from actors.sampling_params import SamplingParams
    from app.protocol.chat_template import render_chat_prompt

    url = request.getfixturevalue("base_url" if layout == "merged" else "split_url")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    params = SamplingParams(temperature=0, max_tokens=24)
    text = client.completions.create(model="", prompt=PROMPT, **greedy()).choices[0].text
    assert text == offline.generate(PROMPT, params)[0].outputs[0].text
    chat = client.chat.completions.create(model="", messages=MESSAGES, **greedy())
    ids = render_chat_prompt(offline.tokenizer, MESSAGES)[1]
    assert chat.choices[0].message.content == offline.generate(ids, params)[0].outputs[0].text


@pytest.mark.parametrize("layout", ["merged", "split"])
def test_embeddings_http_equal_offline_engine(layout, request, offline):
    url = request.getfixturevalue("base_url" if layout == "merged" else "split_url")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    inputs = [PROMPT, "jumps over the lazy dog"]
    got = client.embeddings.create(model="", input=inputs)
    assert [d.index for d in got.data] == [0, 1]
    for d, want in zip(got.data, offline.embed(inputs)):
        assert max(abs(a - b) for a, b in zip(d.embedding, want.embedding, strict=True)) < 1e-5


def test_speculation_shows_in_stats_and_metrics(split_url):
    client = openai.OpenAI(base_url=f"{split_url}/v1", api_key="unused", max_retries=0)
    for prompt in ("a b c a b c a b c a b", PROMPT, "1 2 3 4 1 2 3 4 1 2"):
        client.completions.create(model="", prompt=prompt, **greedy(max_tokens=32))
    spec = replica_stats(split_url)[0]["speculative"]
    assert spec["drafts"] > 0 and 0 <= spec["accepted_tokens"] <= spec["draft_tokens"], spec
    text = httpx.get(f"{split_url}/metrics", timeout=10).text
    for name, key in (("drafts", "drafts"), ("draft_tokens", "draft_tokens"), ("accepted_tokens", "accepted_tokens")):
        line = next(x for x in text.splitlines() if x.startswith(f"shoal_spec_decode_num_{name}_total{{"))
        assert float(line.rsplit(" ", 1)[1]) == spec[key], line
    per_position = [float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                    if x.startswith("shoal_spec_decode_num_accepted_tokens_per_pos_total{")]
    assert per_position == spec["accepted_per_position"] and sum(per_position) == spec["accepted_tokens"], text


@pytest.mark.slow
def test_64_concurrent_streams_complete(base_url):
    aclient = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> tuple[str, int]:
        stream = await aclient.completions.create(
            model="", prompt=f"{PROMPT} {i}", max_tokens=32, temperature=0.8, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        finish, tokens = None, 0
        async for chunk in stream:
            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
            tokens = chunk.usage.completion_tokens if chunk.usage else tokens
        return finish, tokens

    async def run():
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), timeout=120)

    start = time.monotonic()
    results = asyncio.run(run())
    assert results == [("length", 32)] * 64, f"after {time.monotonic() - start:.1f} s"


@pytest.mark.parametrize("layout", ["merged", "split"])
def test_cancelled_stream_frees_its_blocks(layout, request):
    base_url = request.getfixturevalue("base_url" if layout == "merged" else "split_url")
    body = {"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True}
    before = replica_stats(base_url)[0]
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept open: closing it would close the connection
            for line in lines:
                if line.startswith("data: "):
                    break
            during = replica_stats(base_url)[0]
        # Leaving the block closes the connection mid-stream.
    assert during["running"] == 1 and during["kv_blocks_free"] < during["kv_blocks_total"], during
    deadline = time.monotonic() + 10
    while (after := replica_stats(base_url)[0])["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert after["running"] == 0 and after["kv_blocks_free"] == after["kv_blocks_total"]
    assert after["generated_tokens"] - before["generated_tokens"] < 480  # aborted, not finished


def test_models_and_readiness(client, base_url, llama_ckpt):
    assert [m.id for m in client.models.list().data] == [Path(llama_ckpt).name]
    assert httpx.get(f"{base_url}/readyz").status_code == 200
    assert httpx.get(f"{base_url}/health").json()["status"] == "ok"


def test_the_http_replicas_run_without_torch(client, base_url, split_url):
    """The Serve replicas that answer HTTP (a ModelServer; the split layout's Ingress) load
    the tokenizer by the class their engine chose, so they never import torch (~300 MB and ~2 s
    of CPU each at start): after a chat through each, only the engine actors map libtorch."""
    import psutil

    for url in (base_url, split_url):
        assert httpx.post(f"{url}/v1/chat/completions", timeout=60,
                          json={"messages": MESSAGES, "max_tokens": 4}).status_code == 200
    torch_in = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        title = (proc.info["cmdline"] or [""])[0]
        for kind in ("ray::ServeReplica:shoal:ModelServer", "ray::ServeReplica:split:Ingress", "ray::EngineActor"):
            if title.startswith(kind):
                maps = Path(f"/proc/{proc.info['pid']}/maps").read_text()
                torch_in.setdefault(kind, []).append("libtorch_cpu" in maps)
    assert torch_in["ray::ServeReplica:shoal:ModelServer"] == [False]
    assert torch_in["ray::ServeReplica:split:Ingress"] == [False]
    assert torch_in["ray::EngineActor"] and all(torch_in["ray::EngineActor"])


def test_a_replica_gone_between_listing_and_lookup_is_left_out(base_url, monkeypatch):
    """The replicas' scheduler actors are listed, then looked up by name: one the autoscaler
    removes in between is no longer there (/stats answered 500 once while a pool shrank,
    tests/test_serve_config_drain.py). It is left out; the live ones are found."""
    import ray

    from app.serving import schedulers

    live = schedulers.scheduler_actors("shoal")
    listed = ray.util.list_named_actors
    gone = {"namespace": schedulers.SCHEDULER_NAMESPACE, "name": schedulers.scheduler_name("shoal", "ModelServer", "gone")}
    monkeypatch.setattr(schedulers.ray.util, "list_named_actors", lambda all_namespaces=False: [*listed(all_namespaces), gone])
    found = schedulers.scheduler_actors("shoal")
    assert live and found.keys() == live.keys() and "gone" not in found


def test_a_replica_still_loading_does_not_hold_up_stats_or_health(base_url):
    """A replica the autoscaler just added answers nothing until its model is loaded: /stats
    and /health show it as not answering yet, at once, instead of waiting for it."""
    import ray

    from app.serving.schedulers import SCHEDULER_NAMESPACE, scheduler_name_prefix

    @ray.remote(num_cpus=0)
    class Loading:
        async def stats(self):
            await asyncio.sleep(60)

    loading = Loading.options(name=scheduler_name_prefix("shoal") + "loading",
                              namespace=SCHEDULER_NAMESPACE).remote()
    try:
        ray.get(loading.__ray_ready__.remote())
        start = time.monotonic()
        stats = {r["replica"]: r for r in replica_stats(base_url)}
        assert time.monotonic() - start < 5
        assert stats["loading"]["engine_alive"] is None and "no answer" in stats["loading"]["error"]
        assert httpx.get(f"{base_url}/health", timeout=10).json() == {"status": "ok", "replicas": 2, "alive": 2}
    finally:
        ray.kill(loading)


def test_bad_request_is_400_with_openai_body(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="", prompt=PROMPT, max_tokens=100_000)
    error = info.value.body
    assert error["code"] == "context_length_exceeded" and "maximum context length" in error["message"]


# --------------------------------------------------------------------------- two replicas

def test_both_replicas_receive_traffic(pair_url):
    pair = openai.OpenAI(base_url=f"{pair_url}/v1", api_key=PAIR_KEY, max_retries=0)

    async def wave():
        aclient = openai.AsyncOpenAI(base_url=f"{pair_url}/v1", api_key=PAIR_KEY, max_retries=0)
        for _ in range(8):  # two at a time: never over the queue limit of 2
            await asyncio.gather(*(aclient.completions.create(model="", prompt=PROMPT, max_tokens=4)
                                   for _ in range(2)))

    pair.models.list()
    asyncio.run(wave())
    stats = replica_stats(pair_url, Authorization=f"Bearer {PAIR_KEY}")
    assert len(stats) == 2
    assert all(r["generated_tokens"] > 0 for r in stats), stats
    # Each replica hosts the API: a scrape answered by either counts both replicas' responses
    # (each pushes its counts about once a second).
    sample = 'shoal_http_requests_total{model="%s",path="/v1/completions",status="200"} 16.0'
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        scrapes = [httpx.get(f"{pair_url}/metrics", headers={"Authorization": f"Bearer {PAIR_KEY}"}).text
                   for _ in range(4)]
        if all(sample % pair.models.list().data[0].id in text for text in scrapes):
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"/metrics never summed both replicas' responses: {scrapes[-1]}")


def test_each_replica_answers_on_its_own_port_under_direct_ingress(pair_url, llama_ckpt):
    """The Serve controller's target groups (what a load balancer in front, or Serve's HAProxy
    mode, routes to; the dashboard lists them at /api/serve/applications/) name each replica's
    own port; a request there is served by that replica alone, as transformers answers it."""
    import ray
    from oracle import hf_greedy
    from ray.serve.context import _get_global_client
    from test_engine import prompts_of

    groups = ray.get(_get_global_client()._controller.get_target_groups.remote("pair"))
    urls = sorted(f"http://{t.ip}:{t.port}{g.route_prefix}" for g in groups if g.protocol == "HTTP"
                  for t in g.targets)  # the app's route prefix holds on the replica's port too
    assert len(set(urls)) == 2, groups
    headers = {"Authorization": f"Bearer {PAIR_KEY}"}
    ids = prompts_of([11])[0]
    served_by = []
    for url in urls:
        before = {r["replica"]: r["generated_tokens"] for r in replica_stats(pair_url, **headers)}
        r = httpx.post(f"{url}/v1/completions", headers=headers, timeout=60, json={
            "model": "", "prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == hf_greedy(llama_ckpt, ids, 6)
        grew = [s["replica"] for s in replica_stats(pair_url, **headers)
                if s["generated_tokens"] > before.get(s["replica"], 0)]
        served_by += grew
    assert len(served_by) == 2 and len(set(served_by)) == 2, served_by
    assert httpx.get(f"{urls[0]}/v1/models").status_code == 401  # the replica's own API, key and all


def test_missing_api_key_is_401(pair_url):
    wrong = openai.OpenAI(base_url=f"{pair_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.completions.create(model="", prompt=PROMPT, max_tokens=4)
    assert info.value.status_code == 401 and info.value.body["type"] == "authentication_error"
    assert httpx.get(f"{pair_url}/healthz").status_code == 200  # probes stay open


def test_queue_full_is_429_with_retry_after(pair_url):
    headers = {"Authorization": f"Bearer {PAIR_KEY}"}
    body = {"prompt": PROMPT, "max_tokens": 64, "ignore_eos": True}

    async def flood():
        async with httpx.AsyncClient(timeout=120, headers=headers) as http:
            return await asyncio.gather(*(http.post(f"{pair_url}/v1/completions", json=body)
                                          for _ in range(24)))

    responses = asyncio.run(flood())
    refused = [r for r in responses if r.status_code == 429]
    assert refused and {r.status_code for r in responses} <= {200, 429}
    assert refused[0].headers["retry-after"]
    assert refused[0].json()["error"]["type"] == "rate_limit_error"


@pytest.fixture(scope="module")
def routed_url(serve_port, llama_ckpt, pair_url):
    from ray import serve

    from app.serving.builder import build_app

    app = build_app({"model_path": str(llama_ckpt), "world_size": 2, "shard_cpus": 0.5,
                     "routing": "prefix-aware", "num_kv_blocks": 64, "block_size": 4, "num_threads": 1})
    serve.run(app, name="routed", route_prefix="/routed")
    return wait_ready(f"http://127.0.0.1:{serve_port}/routed")


@pytest.mark.slow
def test_prefix_aware_routing_keeps_a_prefix_on_one_replica(routed_url):
    """Five requests sharing a long prefix, one after another: all on the same replica (by load
    alone that happens 1 time in 16) and served from its prefix cache."""
    for group in ("alpha beta gamma delta " * 6, "one two three four five six " * 5):
        before = {r["replica"]: r["generated_tokens"] for r in replica_stats(routed_url)}
        for i in range(5):
            r = httpx.post(f"{routed_url}/v1/completions", timeout=60,
                           json={"prompt": group + f"question {i}", "max_tokens": 2, "ignore_eos": True})
            assert r.status_code == 200
        stats = replica_stats(routed_url)
        grew = [r["replica"] for r in stats if r["generated_tokens"] > before.get(r["replica"], 0)]
        assert len(grew) == 1, stats
        assert next(r for r in stats if r["replica"] == grew[0])["prefix_cache_hit_rate"] > 0.3


def test_dead_engine_is_503(pair_url):
    import ray

    from app.serving.schedulers import scheduler_actors

    headers = {"Authorization": f"Bearer {PAIR_KEY}"}
    victim = next(iter(scheduler_actors("pair").values()))
    ray.kill(victim)

    async def burst():  # at once, before Serve's health check takes the dead replica out
        async with httpx.AsyncClient(timeout=30, headers=headers) as http:
            return await asyncio.gather(*(http.post(f"{pair_url}/v1/completions",
                                                    json={"prompt": PROMPT, "max_tokens": 2})
                                          for _ in range(12)))

    responses = asyncio.run(burst())  # the router picks at random: some land on the dead one
    statuses = [r.status_code for r in responses]
    assert 503 in statuses and set(statuses) <= {200, 429, 503}
    dead = next(r for r in responses if r.status_code == 503)
    assert dead.json()["error"]["code"] in ("engine_dead", "not_ready")  # the pool noticed first


# --------------------------------------------------------------------------- stream pacing

def test_inbox_gives_first_at_once_then_gathers_and_the_end_comes_at_once():
    """The replica's pacing of one request's stream (app/serving/replica.py Inbox)."""
    from actors.outputs import CompletionOutput, RequestOutput
    from app.serving.replica import Inbox

    def delta(i: int, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", [1], [CompletionOutput(0, text=str(i), token_ids=[i])], finished=finished)

    async def run():
        inbox, loop = Inbox(), asyncio.get_running_loop()
        for i in range(30):  # a token every 10 ms, the last one finishing the request
            loop.call_later(0.01 * (i + 1), inbox.put, delta(i, finished=i == 29), None)
        start = loop.time()
        first, _ = await inbox.take(0.0)
        gathered, _ = await inbox.take(0.1)
        took = loop.time()
        last, _ = await inbox.take(10.0)  # the end does not wait out the hold
        ended = loop.time()
        failed = Inbox()
        loop.call_later(0.01, failed.put, delta(0), None)
        loop.call_later(0.02, failed.put, None, RuntimeError("the engine died"))
        _, error = await failed.take(5.0)
        return first, gathered, took - start, last, ended - took, error

    first, gathered, gathered_at, last, last_wait, error = asyncio.run(run())
    assert first.outputs[0].token_ids == [0]  # no waiting for company
    assert gathered.outputs[0].token_ids[0] == 1 and len(gathered.outputs[0].token_ids) >= 4
    assert 0.09 < gathered_at < 0.5
    assert last.finished and last.outputs[0].token_ids[-1] == 29 and last_wait < 1.0
    assert str(error) == "the engine died"


def test_inbox_waits_for_the_stream_interval_unless_the_request_ends():
    from actors.outputs import CompletionOutput, RequestOutput
    from app.serving.replica import Inbox

    def delta(i: int, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", [1], [CompletionOutput(0, text=str(i), token_ids=[i])], finished=finished)

    async def run():
        inbox, loop = Inbox(), asyncio.get_running_loop()
        for i in range(5):  # a token every 10 ms, the fifth finishing the request
            loop.call_later(0.01 * (i + 1), inbox.put, delta(i, finished=i == 4), None)
        return [(await inbox.take(0.0, 3))[0].outputs[0].token_ids for _ in range(2)]

    assert asyncio.run(run()) == [[0, 1, 2], [3, 4]]  # the end does not wait for a third token


def test_stream_pacing_holds_with_load_up_to_the_flush_interval():
    from app.serving.replica import StreamPacing

    pacing = StreamPacing(interval=1, flush_ms=50, chunks_per_s=100)
    assert pacing.hold(1) == pytest.approx(0.01) and pacing.hold(4) == pytest.approx(0.04)
    assert pacing.hold(64) == pytest.approx(0.05)  # 64 streams: each still sends every 50 ms
    assert StreamPacing(chunks_per_s=0).hold(64) == 0.0 and StreamPacing(flush_ms=0).hold(64) == 0.0


def test_a_replica_stream_sends_the_first_token_at_once_then_the_interval():
    """ReplicaEngine.stream's rule, on its own: the first chunk is the first token, not held for
    --stream-interval; then chunks of at least the interval; the last with what is left, as
    soon as the request ends. The scheduler's side here sends the first token, waits (up to 2 s)
    for the stream to take it, then sends a token every 10 ms. (Through HTTP, the next step's
    tokens may join the first chunk before it goes out on a loaded machine.)"""
    from actors.outputs import CompletionOutput, RequestOutput
    from actors.request import EngineRequest
    from actors.sampling_params import SamplingParams
    from app.serving.replica import ReplicaEngine, StreamPacing

    engine = ReplicaEngine.__new__(ReplicaEngine)  # (no Serve replica around it)
    engine.inboxes, engine.pacing = {}, StreamPacing(interval=3, flush_ms=50.0, chunks_per_s=100.0)

    class Link:
        aborted: list = []

        async def add(self, request):
            self.feeding = asyncio.create_task(self.feed(engine.inboxes[request.request_id]))

        async def feed(self, inbox):
            for i in range(11):  # the 11th finishes the request
                inbox.put(RequestOutput("r", [1], [CompletionOutput(0, text="x", token_ids=[i])],
                                        finished=i == 10), None)
                for _ in range(200 if i == 0 else 1):  # the first: until it is taken
                    await asyncio.sleep(0.01)
                    if inbox.news.empty:
                        break

        def abort(self, request_id):
            self.aborted.append(request_id)

    link = Link()

    async def link_ready():
        return link
    engine._link = link_ready

    async def run():
        request = EngineRequest("r", [1, 2], SamplingParams(max_tokens=11))
        return [[t for c in out.outputs for t in c.token_ids] async for out in engine.stream(request)]

    chunks = asyncio.run(run())
    assert chunks[0] == [0] and [t for c in chunks for t in c] == list(range(11)), chunks
    assert all(len(c) >= 3 for c in chunks[1:-1]), chunks
    assert link.aborted == [] and engine.inboxes == {}


def test_stream_interval_sends_that_many_tokens_a_chunk(split_url):
    """The split app streams with --stream-interval 3: after the first chunk (the first token at
    once: the test above; here a step's accepted drafts, or the next step on a loaded machine,
    may join it before it goes out), chunks of at least 3, the last with what is left."""
    body = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stream": True,
            "logprobs": 1}
    sizes = []
    with httpx.stream("POST", f"{split_url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices")
                if choices and choices[0].get("logprobs"):
                    sizes.append(len(choices[0]["logprobs"]["tokens"]))
    assert sum(sizes) == 20 and all(n >= 3 for n in sizes[1:-1]), sizes


# --------------------------------------------------------------------------- shoal serve

def shoal(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", "serve", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_print_config_precedence(llama_ckpt, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("port: 9002\nseed: 3\nblock_size: 32\nmax-num-seqs: 8\n")
    env = loopback_env(SHOAL_SEED="7", SHOAL_MAX_NUM_SEQS="9")
    done = shoal("--model-path", str(llama_ckpt), "--config", str(config), "--port", "9001",
                 "--max-running-prompts", "10", "--enable-auto-tool-choice", "--print-config",
                 "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}', env=env)
    assert done.returncode == 0, done.stderr
    options = yaml.safe_load(done.stdout)
    assert options["port"] == 9001 and options["max_num_seqs"] == 10  # command line
    assert options["enable_auto_tool_choice"] is True  # vLLM's spelling is accepted
    assert options["seed"] == 7  # environment over YAML
    assert options["block_size"] == 32  # YAML over defaults
    assert options["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4}  # vLLM's JSON
    assert options["host"] == "0.0.0.0" and options["default_max_tokens"] == 1024  # areno defaults


def test_bad_combination_fails_with_one_line(llama_ckpt):
    done = shoal("--model-path", str(llama_ckpt), "--tp-size", "2", "--world-size", "3")
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0
    assert "--world-size 3 is not divisible by --tp-size x --pp-size" in done.stderr
    done = shoal("--model-path", str(llama_ckpt), "--speculative-config", '{"method": "medusa"}')
    assert done.returncode != 0 and done.stderr.strip().count("\n") == 0
    assert "--speculative-config: method must be one of ngram, draft_model, got 'medusa'" in done.stderr
    done = shoal("--model-path", str(llama_ckpt), "--speculative-config", '{"model": "/no/draft"}')
    assert done.returncode != 0 and done.stderr.strip().count("\n") == 0
    assert "--speculative-config's draft model: model '/no/draft' is neither" in done.stderr


@pytest.fixture(scope="module")
def dry_runs(llama_ckpt, tmp_path_factory) -> dict:
    """Both `--dry-run` starts at once (each is one Python process importing torch and
    transformers on one core): "plain" and "draft" (a draft model, the checkpoint's first
    layer) -> (the finished process, the draft's path)."""
    draft = draft_copy(llama_ckpt, tmp_path_factory.mktemp("draft") / "draft", [0])
    common = ["--model-path", str(llama_ckpt), "--dry-run", "--num-kv-blocks", "16"]
    speculative = ["--speculative-config", json.dumps({"model": str(draft), "num_speculative_tokens": 2})]
    runs = {name: subprocess.Popen([sys.executable, "-m", "app.cli", "serve", *common, *extra], cwd=REPO,
                                   env=loopback_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name, extra in (("plain", []), ("draft", speculative))}
    done = {}
    for name, proc in runs.items():
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), draft
    return done


def test_dry_run_loads_the_model(dry_runs):
    done, _ = dry_runs["plain"]
    assert done.returncode == 0, done.stderr
    assert "dry run ok" in done.stdout and "max_model_len 512" in done.stdout


def test_dry_run_loads_a_draft_model(dry_runs):
    """(A draft with another tokenizer is refused before anything loads:
    tests/test_speculative.py.)"""
    done, draft = dry_runs["draft"]
    assert done.returncode == 0, done.stderr
    assert "dry run ok" in done.stdout and f"draft model {draft} loaded" in done.stderr
