"""Engine metrics into Ray's metrics API (Prometheus export on each node, the Ray dashboard).

The engine loop only touches plain numbers (actors/engine/metrics.py). A thread here wakes every
`interval` seconds and pushes what grew since the last push: counter increments, gauge
values, and histogram bucket counts. Ray's record call costs ~2-4 us, so doing it here keeps
it off the engine step however many tokens a step makes. Ray names them ray_shoal_...
(counters with _total), tagged model and replica. Use only inside a Ray worker.

Histograms: Ray keeps only bucket counts and exports each observation as its bucket's
midpoint (`_sum` is approximate; GET /metrics has the exact sums), so replaying a bucket's
new count with one value inside that bucket exports exactly what the raw values would.
"""
from __future__ import annotations

import logging
import threading

from actors.engine.metrics import (
    COUNTERS, EXPERT_RANK_TOKENS, FINISHED, GAUGES, HISTOGRAMS, LORA_REQUESTS, PREFIX, SPEC_PER_POSITION,
)

log = logging.getLogger("shoal.metrics")

TAGS = ("model", "replica")


class RayExporter:
    def __init__(self, engine, interval: float = 1.0):
        from ray.util import metrics as rm

        self.engine = engine
        self.counters = {n: rm.Counter(PREFIX + n, text, TAGS) for n, text in COUNTERS.items()}
        self.finished = rm.Counter(PREFIX + FINISHED[0], FINISHED[1], TAGS + ("finish_reason",))
        self.lora_requests = rm.Counter(PREFIX + LORA_REQUESTS[0], LORA_REQUESTS[1], TAGS + ("lora_name",))
        self.spec_per_position = rm.Counter(PREFIX + SPEC_PER_POSITION[0], SPEC_PER_POSITION[1],
                                            TAGS + ("position",))
        self.gauges = {n: rm.Gauge(PREFIX + n, text, TAGS) for n, text in GAUGES.items()}
        self.expert_rank_tokens = rm.Gauge(PREFIX + EXPERT_RANK_TOKENS[0], EXPERT_RANK_TOKENS[1], TAGS + ("ep_rank",))
        local = engine.metrics.hist
        self.histograms = {n: rm.Histogram(PREFIX + n, HISTOGRAMS[n][0], local[n].bounds, TAGS)
                           for n in HISTOGRAMS}
        self._sent: dict = {}  # counter key -> value pushed; histogram name -> bucket counts
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), name="shoal-metrics",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.push()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.push()
            except Exception:  # metrics must never take the engine down: log and go on
                log.warning("pushing metrics to Ray failed", exc_info=True)

    def push(self) -> None:
        snap = self.engine.metrics.snapshot(self.engine)
        tags = snap["labels"]
        for name, value in snap["counters"].items():
            self._inc(self.counters[name], name, value, tags)
        for reason, value in snap["finished"].items():
            self._inc(self.finished, ("finished", reason), value, {**tags, "finish_reason": reason})
        for name, value in snap["lora_requests"].items():
            self._inc(self.lora_requests, ("lora", name), value, {**tags, "lora_name": name})
        for position, value in snap["spec_accepted_per_pos"].items():
            self._inc(self.spec_per_position, ("spec_pos", position), value, {**tags, "position": position})
        self._set_gauges(snap, tags)
        for name, h in snap["histograms"].items():
            self._push_buckets(name, h, tags)

    def _inc(self, counter, key, value: float, tags: dict) -> None:
        delta = value - self._sent.get(key, 0)
        if delta > 0:  # Ray refuses inc(0): a counter appears with its first increment
            counter.inc(delta, tags)
            self._sent[key] = value

    def _set_gauges(self, snap: dict, tags: dict) -> None:
        g, c = snap["gauges"], snap["counters"]
        self.gauges["num_requests_running"].set(g["num_requests_running"], tags)
        self.gauges["num_requests_waiting"].set(g["num_requests_waiting"], tags)
        self.gauges["kv_cache_usage"].set(g["kv_blocks_used"] / max(g["kv_blocks_total"], 1), tags)
        if "expert_balancedness" in g:
            self.gauges["expert_balancedness"].set(g["expert_balancedness"], tags)
        for rank, tokens in snap["expert_rank_tokens"].items():
            self.expert_rank_tokens.set(tokens, {**tags, "ep_rank": rank})
        queries = c["prefix_cache_queries"]
        self.gauges["prefix_cache_hit_rate"].set(c["prefix_cache_hits"] / queries if queries else 0.0,
                                                 tags)

    def _push_buckets(self, name: str, h: dict, tags: dict) -> None:
        sent = self._sent.get(name) or [0] * len(h["counts"])
        histogram = self.histograms[name]
        for value, new, old in zip(bucket_values(h["bounds"]), h["counts"], sent):
            for _ in range(new - old):  # Ray takes one observation per call
                histogram.observe(value, tags)
        self._sent[name] = h["counts"]


def bucket_values(bounds: list[float]) -> list[float]:
    """A value inside each bucket: its upper bound (buckets are (lower, upper]), then one
    above the last bound for the overflow bucket."""
    return list(bounds) + [bounds[-1] * 2]


def start_ray_export(engine, interval: float = 1.0) -> RayExporter | None:
    """The exporter when this process is a Ray worker, else None (in-process use)."""
    try:
        import ray
        if not ray.is_initialized():
            return None
        return RayExporter(engine, interval)
    except Exception:  # an old or partial Ray: serve on without the Ray export
        log.warning("Ray metrics export is off", exc_info=True)
        return None
