"""Metrics and request logs: a real scrape parses with prometheus_client's parser and its
counters match the requests made.

In process (fast): the FastAPI app over a LocalEngineClient, as tests/test_api.py runs it.
Through Ray Serve (slow): two replicas behind the Serve HTTP port, and Ray's own metrics
export port, where the engine's figures arrive per replica as ray_shoal_... .
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import time
from bisect import bisect_left
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import api_in_thread, free_port, wait_ready
from test_api import running

from actors.config import EngineConfig
from actors.engine.llm import LLM
from actors.engine.metrics import (
    COUNTERS, FINISHED, GAUGES, HISTOGRAMS, DecodeProgress, Replica, progress_line,
)
from actors.host.ray_metrics import bucket_values
from actors.request import EngineRequest
from actors.sampling_params import SamplingParams
from actors.worker.loader import count_tensors, weight_files
from actors.worker.progress import progress_bar
from app.api.app import build_api
from app.api.metrics import HTTP_REQUESTS, ShoalCollector, combine
from app.api.settings import ServerSettings

PROMPTS = ["The quick brown fox", "A boat on the river"]
CHAT = [{"role": "user", "content": "Tell me about the quick brown fox."}]


def scrape(url: str) -> dict[str, list]:
    """Metric family name -> its samples, parsed by prometheus_client."""
    text = httpx.get(url, timeout=30).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def total(families: dict, sample: str, **labels) -> float:
    """Sum of one sample name's values over the series matching `labels`."""
    return sum(s.value for samples in families.values() for s in samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def make_requests(base: str) -> dict:
    """Two completions (one with two prompts), one streamed chat, one 400 and one 404."""
    usage = {"prompt": 0, "completion": 0, "choices": 0}
    with httpx.Client(base_url=base, timeout=60) as http:
        for prompt in (PROMPTS, PROMPTS[0]):
            body = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6,
                                                      "temperature": 0, "ignore_eos": True}).json()
            _add_usage(usage, body["usage"], len(body["choices"]))
        with http.stream("POST", "/v1/chat/completions", json={
                "messages": CHAT, "max_tokens": 5, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        chunk = httpx.Response(200, content=lines[-1][6:]).json()
        _add_usage(usage, chunk["usage"], 1)
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400
        assert http.get("/no/such/route").status_code == 404
    return usage


def _add_usage(usage: dict, u: dict, choices: int) -> None:
    usage["prompt"] += u["prompt_tokens"]
    usage["completion"] += u["completion_tokens"]
    usage["choices"] += choices


def check_engine_counters(m: dict, usage: dict, prefix: str = "", **labels) -> None:
    p = prefix + "shoal_"
    assert total(m, p + "prompt_tokens_total", **labels) == usage["prompt"]
    assert total(m, p + "generation_tokens_total", **labels) == usage["completion"]
    assert total(m, p + "requests_finished_total", **labels) == usage["choices"]
    # One TTFT and one end-to-end latency per engine request (one per prompt here).
    assert total(m, p + "time_to_first_token_seconds_count", **labels) == usage["choices"]
    assert total(m, p + "e2e_request_latency_seconds_count", **labels) == usage["choices"]
    assert total(m, p + "request_queue_time_seconds_count", **labels) == usage["choices"]
    # Every token after a sequence's first has one inter-token latency.
    assert total(m, p + "inter_token_latency_seconds_count", **labels) == \
        usage["completion"] - usage["choices"]
    inf = total(m, p + "e2e_request_latency_seconds_bucket", le="+Inf", **labels)
    assert inf == usage["choices"]


def check_http_counters(m: dict, prefix: str = "", **labels) -> None:
    name = prefix + "shoal_http_requests_total"
    assert total(m, name, path="/v1/completions", status="200", **labels) == 2
    assert total(m, name, path="/v1/chat/completions", status="200", **labels) == 1
    assert total(m, name, path="/v1/completions", status="400", **labels) == 1
    assert total(m, name, path="unmatched", status="404", **labels) == 1


# --------------------------------------------------------------------------- in process

@pytest.fixture(scope="module")
def local_url(llama_ckpt):
    with api_in_thread(llama_ckpt, "tiny", num_kv_blocks=256, metrics_ttft_buckets="0.05,0.5,5") as url:
        yield url


def test_in_process_metrics_match_requests(local_url, caplog):
    caplog.set_level(logging.INFO, logger="shoal.api")
    before = scrape(f"{local_url}/metrics")  # parses before any request, too
    assert total(before, "shoal_requests_finished_total") == 0
    usage = make_requests(local_url)
    m = scrape(f"{local_url}/metrics")
    check_engine_counters(m, usage, model="tiny")
    check_http_counters(m, model="tiny")
    assert total(m, "shoal_num_requests_running") == 0 and total(m, "shoal_num_requests_waiting") == 0
    assert 0 <= total(m, "shoal_kv_cache_usage") <= 1
    assert total(m, "shoal_engine_step_seconds_count") > 0
    # --metrics-ttft-buckets reached the engine's histogram.
    les = {s.labels["le"] for s in m["shoal_time_to_first_token_seconds"] if "le" in s.labels}
    assert les == {"0.05", "0.5", "5.0", "+Inf"}
    time.sleep(0.1)  # the access line is written once the response has gone
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")]
    chat = next(line for line in lines if "path=/v1/chat/completions" in line)
    for key in ("request_id=req-", "status=200", "total_ms=", "prompt_tokens=", "generation_tokens=5",
                "ttft_ms=", "finish_reason=length", "replica=local"):
        assert key in chat, (key, chat)


def test_metrics_open_without_api_key(llama_ckpt):
    settings = ServerSettings(model_path=str(llama_ckpt), api_key="k")
    with running(build_api(settings)) as url:  # not attached: HTTP counters only, still 200
        r = httpx.get(f"{url}/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert "shoal_http_requests_total" in r.text
        assert httpx.get(f"{url}/v1/models").status_code == 401


# --------------------------------------------------------------------------- units

def _snapshot(used: int, blocks: int, finished: dict, counts: list[int]) -> dict:
    return {"labels": {"model": "m", "replica": "r"},
            "counters": {"prompt_tokens": 10, "generation_tokens": 20, "preemptions": 1,
                         "prefix_cache_queries": 100, "prefix_cache_hits": 25},
            "finished": finished,
            "gauges": {"num_requests_running": 2, "num_requests_waiting": 1,
                       "kv_blocks_used": used, "kv_blocks_total": blocks},
            "histograms": {"e2e_request_latency_seconds": {"bounds": [1.0, 2.0], "counts": counts,
                                                           "sum": 3.0}}}


def test_combine_sums_replicas_and_each_model_has_its_label():
    both = combine([_snapshot(10, 100, {"stop": 1}, [1, 0, 0]),
                    _snapshot(30, 100, {"stop": 2, "length": 1}, [0, 1, 2])])
    other = combine([_snapshot(5, 50, {"length": 7}, [0, 0, 1])])  # a second model of the app
    families = {f.name: f for f in ShoalCollector([("m", both), ("e", other)], {("/x", "200"): 3}, "m").collect()}
    value = {s.name + str(sorted(s.labels.items())): s.value
             for f in families.values() for s in f.samples}
    assert value["shoal_prompt_tokens_total[('model', 'm')]"] == 20
    assert value["shoal_requests_finished_total[('finish_reason', 'stop'), ('model', 'm')]"] == 3
    assert value["shoal_kv_cache_usage[('model', 'm')]"] == 0.2  # 40 of 200 blocks
    assert value["shoal_prefix_cache_hit_rate[('model', 'm')]"] == 0.25
    assert value["shoal_num_requests_running[('model', 'm')]"] == 4
    assert value["shoal_e2e_request_latency_seconds_bucket[('le', '2.0'), ('model', 'm')]"] == 2
    assert value["shoal_e2e_request_latency_seconds_count[('model', 'm')]"] == 4
    assert value["shoal_http_requests_total[('model', 'm'), ('path', '/x'), ('status', '200')]"] == 3
    assert value["shoal_prompt_tokens_total[('model', 'e')]"] == 10
    assert value["shoal_requests_finished_total[('finish_reason', 'length'), ('model', 'e')]"] == 7
    assert value["shoal_kv_cache_usage[('model', 'e')]"] == 0.1  # 5 of 50 blocks
    assert value["shoal_e2e_request_latency_seconds_count[('model', 'e')]"] == 1


def test_bucket_option_is_checked():
    config = EngineConfig(metrics_itl_buckets="0.01, 0.1")
    config.validate()
    assert config.metrics_itl_buckets == [0.01, 0.1]
    for bad in ("0.1,0.01", "a,b", "0,1"):
        with pytest.raises(ValueError, match="metrics-itl-buckets"):
            EngineConfig(metrics_itl_buckets=bad).validate()


def test_decode_progress_line(llama_ckpt):
    assert progress_line(0, 2, 32, False, 2810.66) == \
        "decode progress: dp=0/2 active=32 graph=False tokens_per_second=2810.7"
    llm = LLM(str(llama_ckpt), num_kv_blocks=64)
    progress = DecodeProgress(llm.engine, Replica("r1", rank=1, world_size=2))
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    line = progress.line()
    match = re.fullmatch(r"decode progress: dp=1/2 active=0 graph=False tokens_per_second=(\d+\.\d)", line)
    assert match and float(match.group(1)) > 0, line
    # Decode-only: 2 prompts x 7 decode steps (each prompt's first token comes from prefill).
    assert llm.engine.stats.decode_tokens == 14
    assert progress.line().endswith("tokens_per_second=0.0")  # nothing decoded since


def test_engine_counts_finish_reasons_and_aborts(llama_ckpt):
    llm = LLM(str(llama_ckpt), num_kv_blocks=64)
    engine = llm.engine
    engine.add_request(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True)))
    engine.add_request(EngineRequest("b", [4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True, n=2)))
    engine.step()
    engine.abort_request("a")
    last = None
    while engine.has_unfinished():
        last = next((o for o in engine.step() if o.finished), last)
    snap = engine.metrics.snapshot(engine)
    assert snap["finished"] == {"abort": 1, "length": 2}
    assert snap["counters"]["prompt_tokens"] == 6 and snap["counters"]["generation_tokens"] == 1 + 6
    m = last.metrics  # the finished output carries the engine's timings
    assert last.request_id == "b" and 0 <= m.queue_time <= m.ttft <= m.e2e and m.replica == "local"


def test_weight_loading_shows_progress(llama_ckpt, monkeypatch, capsys):
    from actors.worker import loader
    monkeypatch.setattr(loader, "progress_bar", functools.partial(progress_bar, delay=0))
    LLM(str(llama_ckpt), num_kv_blocks=16)
    err, tensors = capsys.readouterr().err, count_tensors(weight_files(llama_ckpt))
    assert "loading weights: 100%" in err and f"{tensors}/{tensors}" in err, err


def test_ray_bucket_values_fall_in_their_buckets():
    bounds = HISTOGRAMS["batch_size"][1]
    assert [bisect_left(bounds, v) for v in bucket_values(bounds)] == list(range(len(bounds) + 1))


def test_dashboard_uses_only_exported_names():
    dash = json.loads((Path(__file__).parent.parent / "cluster" / "grafana-shoal.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"shoal_([a-z0-9_]+)", e)}
    suffixes = ("_total", "_bucket", "_sum", "_count")
    known = {*COUNTERS, FINISHED[0], *GAUGES, *HISTOGRAMS, HTTP_REQUESTS[0]}
    for name in used:
        base = next((name[:-len(s)] for s in suffixes if name.endswith(s)), name)
        assert base in known, name
    assert {"time_to_first_token_seconds", "inter_token_latency_seconds",
            "e2e_request_latency_seconds"} <= {n.rsplit("_bucket", 1)[0] for n in used}


# --------------------------------------------------------------------------- Ray Serve

@pytest.fixture(scope="module")
def serve_ports():
    """(Serve HTTP port, Ray metrics export port) on a loopback Ray without the dashboard."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["RAY_metrics_report_interval_ms"] = "1000"  # export within seconds, not 10 s
    import ray
    from ray import serve
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    metrics_port, http_port = free_port(), free_port()
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False,
             logging_level="WARNING", _metrics_export_port=metrics_port)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        yield http_port, metrics_port
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.pop("RAY_metrics_report_interval_ms", None)


@pytest.mark.slow
def test_serve_metrics_match_requests(serve_ports, llama_ckpt):
    from ray import serve

    from app.serving.builder import build_app

    http_port, metrics_port = serve_ports
    app = build_app({"model_path": str(llama_ckpt), "world_size": 2, "shard_cpus": 0.5,
                     "num_kv_blocks": 128, "num_threads": 1, "served_model_name": "tiny",
                     "attn_backend": "native"})
    serve.run(app, name="metrics", route_prefix="/")
    base = wait_ready(f"http://127.0.0.1:{http_port}")
    usage = make_requests(base)
    m = scrape(f"{base}/metrics")  # summed over both replicas by the answering one
    check_engine_counters(m, usage, model="tiny")
    assert total(m, "shoal_kv_cache_usage") == 0  # finished requests hold no blocks
    deadline = time.monotonic() + 10  # each replica pushes its HTTP counts once a second
    while True:
        try:
            check_http_counters(scrape(f"{base}/metrics"), model="tiny")
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    ray_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    deadline = time.monotonic() + 30  # exporter thread 1 s, Ray's report interval 1 s
    while True:
        r = scrape(ray_metrics)
        try:
            check_engine_counters(r, usage, prefix="ray_", model="tiny")
            check_http_counters(r, prefix="ray_", model="tiny")
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    replicas = {s.labels["replica"] for s in r["ray_shoal_engine_step_seconds"]}
    gauges = {s.labels["replica"] for s in r["ray_shoal_num_requests_running"]}
    assert len(gauges) == 2 and replicas <= gauges  # both replicas export, tagged apart
