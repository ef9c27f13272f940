"""GET /metrics: Prometheus text for the whole replica pool, HTTP counters included.

Each replica's scheduler hands back a snapshot of its engine metrics (actors/engine/metrics.py:
counters, gauges, histogram buckets); this module sums them over replicas and renders them
with a prometheus_client custom collector. Names match the Ray export: `shoal_...` here,
summed, with a `model` label; `ray_shoal_...` from Ray's per-node exporter, per replica.

`HttpMetrics` counts responses by route and status in the API's middleware, and mirrors
them into Ray's metrics API when the API runs in a Serve replica. Where every model replica
hosts the API (the merged layout) each pushes its counts to its scheduler about once a
second (app/serving/model_server.py), and a scrape answered by any replica sums what they
pushed.
"""
from __future__ import annotations

import asyncio
import logging
import sys
from collections import defaultdict

from fastapi import APIRouter, Request, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from actors.engine.metrics import (
    COUNTERS, EXPERT_RANK_TOKENS, FINISHED, GAUGES, HISTOGRAMS, LORA_REQUESTS, PREFIX, SPEC_PER_POSITION,
)

log = logging.getLogger("shoal.api")

router = APIRouter(tags=["Operations"])

HTTP_REQUESTS = ("http_requests", "HTTP responses by route and status code.")


# --------------------------------------------------------------------------- HTTP counters

class HttpMetrics:
    def __init__(self):
        self.counts: dict[tuple[str, str], int] = defaultdict(int)  # (path, status) -> responses
        self.replica, self._ray = ray_counter()
        self.pushed = False  # True where the counts are pushed to this replica's scheduler

    def record(self, model: str, path: str, status: int) -> None:
        key = (path, str(status))
        self.counts[key] += 1
        if self._ray is not None:
            self._ray.inc(1, {"model": model, "replica": self.replica, "path": key[0], "status": key[1]})


def ray_counter():
    """(this Serve replica's id, a Ray counter) inside a Ray worker, else ("local", None).
    Ray is only looked at if something imported it already: no import cost in-process."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return "local", None
    try:
        from ray import serve
        from ray.util.metrics import Counter
        replica = serve.get_replica_context().replica_id.unique_id
    except Exception:  # a driver, not a Serve replica
        return "local", None
    counter = Counter(PREFIX + HTTP_REQUESTS[0], HTTP_REQUESTS[1], ("model", "replica", "path", "status"))
    return replica, counter


def route_label(scope) -> str:
    """The matched route's template (bounded: never a raw path), or "unmatched"."""
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"


# --------------------------------------------------------------------------- /metrics

@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request):
    """Prometheus text format: engine metrics summed over replicas, and HTTP counters."""
    state = request.app.state
    models = getattr(state, "models", [])
    pools = await asyncio.gather(*(pool_snapshots(m.client) for m in models))
    engines = [(m.settings.served_model_name, combine(snaps)) for m, snaps in zip(models, pools)]
    registry = CollectorRegistry()
    registry.register(ShoalCollector([(name, e) for name, e in engines if e is not None],
                                     http_counts(state.http_metrics, [s for snaps in pools for s in snaps]),
                                     state.settings.served_model_name))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def pool_snapshots(client) -> list[dict]:
    if client is None or not hasattr(client, "metrics"):  # not attached yet, or a test stub
        return []
    try:
        return await client.metrics()
    except Exception:  # a scrape must still answer: show what we have (HTTP counters)
        log.warning("could not gather engine metrics", exc_info=True)
        return []


def http_counts(own: HttpMetrics, snapshots: list[dict]) -> dict:
    """Every replica's counts as last pushed to its scheduler, where the replicas push them
    (the same figures whichever replica answers, so the counters never go back); else this
    API's own."""
    if not own.pushed:
        return own.counts
    total = defaultdict(int)
    for snap in snapshots:
        for key, n in snap.get("http", {}).items():
            total[key] += n
    return total


def combine(snapshots: list[dict]) -> dict | None:
    """Sum replica snapshots: counters, gauges (blocks, not fractions) and bucket counts."""
    if not snapshots:
        return None
    parts = ("counters", "finished", "gauges", "lora_requests", "spec_accepted_per_pos", "expert_rank_tokens")
    total = {**{part: defaultdict(float) for part in parts}, "histograms": {}}
    for snap in snapshots:
        for part in parts:
            for name, value in snap.get(part, {}).items():
                total[part][name] += value
        for name, h in snap["histograms"].items():
            _add_histogram(total["histograms"], name, h)
    return total


def _add_histogram(into: dict, name: str, h: dict) -> None:
    acc = into.get(name)
    if acc is None:
        into[name] = {"bounds": list(h["bounds"]), "counts": list(h["counts"]), "sum": h["sum"]}
    elif acc["bounds"] == list(h["bounds"]):
        acc["counts"] = [a + b for a, b in zip(acc["counts"], h["counts"])]
        acc["sum"] += h["sum"]
    else:  # replicas started with different bucket options: keep the first's
        log.warning("replicas disagree on the buckets of %s; some are left out", name)


class ShoalCollector:
    """A prometheus_client custom collector over each model's combined snapshot (label
    `model`); the HTTP counts carry the app's default model."""

    def __init__(self, engines: list[tuple[str, dict]], http_counts: dict, model: str):
        self.engines, self.http, self.model = engines, dict(http_counts), model

    def collect(self):
        yield self._http()
        if not self.engines:
            return
        engines = self.engines
        for name, text in COUNTERS.items():
            yield _counter(name, text, ["model"], [([m], e["counters"].get(name, 0)) for m, e in engines])
        yield _counter(FINISHED[0], FINISHED[1], ["model", "finish_reason"],
                       [([m, r], v) for m, e in engines for r, v in sorted(e["finished"].items())])
        yield _counter(LORA_REQUESTS[0], LORA_REQUESTS[1], ["model", "lora_name"],
                       [([m, name], v) for m, e in engines for name, v in sorted(e["lora_requests"].items())])
        yield _counter(SPEC_PER_POSITION[0], SPEC_PER_POSITION[1], ["model", "position"],
                       [([m, pos], v) for m, e in engines
                        for pos, v in sorted(e["spec_accepted_per_pos"].items(), key=lambda kv: int(kv[0]))])
        yield from self._gauges()
        rank_tokens = [([m, r], v) for m, e in engines for r, v in sorted(e["expert_rank_tokens"].items())]
        if rank_tokens:  # replicas of one model add up, rank by rank (combine)
            name, text = EXPERT_RANK_TOKENS
            family = GaugeMetricFamily(PREFIX + name, text, labels=["model", "ep_rank"])
            for labels, value in rank_tokens:
                family.add_metric(labels, value)
            yield family
        for name in engines[0][1]["histograms"]:
            yield _histogram(name, HISTOGRAMS[name][0], [(m, e["histograms"][name]) for m, e in engines])

    def _http(self):
        rows = [([self.model, path, status], n) for (path, status), n in sorted(self.http.items())]
        return _counter(HTTP_REQUESTS[0], HTTP_REQUESTS[1], ["model", "path", "status"], rows)

    def _gauges(self):
        values = {m: _gauge_values(e) for m, e in self.engines}
        for name, text in GAUGES.items():
            rows = [(m, v[name]) for m, v in values.items() if name in v]
            if not rows:
                continue
            family = GaugeMetricFamily(PREFIX + name, text, labels=["model"])
            for m, value in rows:
                family.add_metric([m], value)
            yield family


def _gauge_values(e: dict) -> dict:
    g, c = e["gauges"], e["counters"]
    values = {
        "num_requests_running": g["num_requests_running"],
        "num_requests_waiting": g["num_requests_waiting"],
        "kv_cache_usage": g["kv_blocks_used"] / g["kv_blocks_total"] if g["kv_blocks_total"] else 0.0,
        "prefix_cache_hit_rate": (c["prefix_cache_hits"] / c["prefix_cache_queries"]
                                  if c["prefix_cache_queries"] else 0.0),
    }
    if g.get("moe_replicas"):  # the mean over the replicas serving a MoE model
        values["expert_balancedness"] = g["expert_balancedness"] / g["moe_replicas"]
    return values


def _counter(name: str, text: str, labels: list[str], rows) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, text, labels=labels)
    for values, n in rows:
        family.add_metric(values, n)
    return family


def _histogram(name: str, text: str, per_model: list[tuple[str, dict]]) -> HistogramMetricFamily:
    """Cumulative `le` buckets, as Prometheus wants them, from per-bucket counts."""
    family = HistogramMetricFamily(PREFIX + name, text, labels=["model"])
    for model, h in per_model:
        buckets, running = [], 0
        for bound, count in zip(h["bounds"] + [float("inf")], h["counts"]):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        family.add_metric([model], buckets, h["sum"])
    return family
