"""Engine metrics, recorded where they happen and kept as plain numbers in this process.

The engine loop records once per step (a few adds and a bisect per histogram); per token it
only notes the token's time, and inter-token latencies that share a value (every decode of
a step has the same one) go into the histogram together. `snapshot()` hands the totals to
whoever asks: the scheduler actor's `metrics()` (summed over replicas by GET /metrics) and
actors/host/ray_metrics.py, which pushes them into Ray's metrics API from its own thread.
Nothing here imports Ray, so in-process use (LLM, tests) records locally and exports nothing.
"""
from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path

from actors.outputs import RequestMetrics

PREFIX = "shoal_"
# Same rule as app/api/settings.default_model_name (actors may not import app).
DEMO_MODEL_NAME = "shoal-demo"

# Exported names are PREFIX + name (+ "_total" for counters, added by the exporters).
COUNTERS = {
    "prompt_tokens": "Prompt tokens of the requests the engine started.",
    "generation_tokens": "Tokens generated.",
    "preemptions": "Sequences preempted when KV blocks ran out (recomputed later).",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    # Speculative decoding, as vLLM names them (acceptance rate = accepted / draft tokens)
    "spec_decode_num_drafts": "Rows that carried draft tokens to verification.",
    "spec_decode_num_draft_tokens": "Draft tokens proposed and verified.",
    "spec_decode_num_accepted_tokens": "Draft tokens the target model accepted.",
}
FINISHED = ("requests_finished", "Finished sequences (choices) by finish reason.")
LORA_REQUESTS = ("lora_requests", "Requests started on each LoRA adapter (lora_name).")
SPEC_PER_POSITION = ("spec_decode_num_accepted_tokens_per_pos",
                     "Draft tokens accepted at each draft position (position 0: the first), as vLLM's.")
EXPERT_RANK_TOKENS = ("expert_rank_tokens",
                      "MoE models: routed tokens each expert-parallel rank (ep_rank) computed over the "
                      "load window, all MoE layers together.")
GAUGES = {
    "num_requests_running": "Sequences in the running batch.",
    "num_requests_waiting": "Sequences waiting to be scheduled.",
    "kv_cache_usage": "Fraction of KV cache blocks in use (0..1).",
    "prefix_cache_hit_rate": "Prompt tokens served from the prefix cache / tokens looked up.",
    "expert_balancedness": "MoE models: mean over layers of mean / max routed tokens per expert-"
                           "parallel rank over the load window (1 = even).",
}
_LATENCY = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
            10.0, 20.0, 40.0, 80.0]
_LONG = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0,
         960.0, 1920.0]
# name -> (help, default buckets, the EngineConfig field that overrides them)
HISTOGRAMS = {
    "time_to_first_token_seconds": ("Arrival to first generated token.", _LATENCY,
                                    "metrics_ttft_buckets"),
    "inter_token_latency_seconds": ("Time between two tokens of a sequence.", _LATENCY,
                                    "metrics_itl_buckets"),
    "e2e_request_latency_seconds": ("Arrival to finish.", _LONG, "metrics_e2e_buckets"),
    "request_queue_time_seconds": ("Arrival to the first step that computes the request.",
                                   [0.001, 0.01] + _LONG, None),
    "engine_step_seconds": ("Model time of one engine step.",
                            [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5],
                            None),
    # Half-integer bounds: Ray exports a histogram's sum as count x bucket midpoint, which
    # for these is the batch size itself up to 2 and close above (bounds 1, 2, 4 gave 0.5 for 1).
    "batch_size": ("Sequences in one engine step.",
                   [0.5, 1.5, 2.5, 4.5, 8.5, 16.5, 32.5, 64.5, 128.5, 256.5, 512.5], None),
}


def model_label(model_path: str | None) -> str:
    """The default served model name: the checkpoint directory's name."""
    return Path(model_path).name if model_path else DEMO_MODEL_NAME


@dataclass
class Replica:
    """Who this engine is, for metric labels and the progress line (set by the replica)."""
    replica_id: str = "local"
    model: str | None = None  # the served model name; None: from the model path
    rank: int = 0  # data-parallel rank among the replicas
    world_size: int = 1


class Histogram:
    """Prometheus buckets (bucket i counts values <= bounds[i], the last one the rest) and a sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds):
        self.bounds = [float(b) for b in bounds]
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def snapshot(self) -> dict:
        # list() copies under the GIL: the loop thread may be adding meanwhile.
        return {"bounds": self.bounds, "counts": list(self.counts), "sum": self.sum}


class EngineMetrics:
    """Counters and histograms of one engine. Only the engine loop thread writes them;
    readers copy (a reader may see a histogram's sum one step ahead of its counts)."""

    def __init__(self, config):
        self.labels = {"model": model_label(config.model_path), "replica": "local"}
        self.counts = {"prompt_tokens": 0, "generation_tokens": 0}
        self.finished: dict[str, int] = {}  # finish reason -> sequences
        self.lora_requests: dict[str, int] = {}  # adapter name -> requests
        # An option (EngineConfig field) overrides the default buckets where there is one.
        self.hist = {name: Histogram((field and getattr(config, field, None)) or default)
                     for name, (_, default, field) in HISTOGRAMS.items()}
        self._ttft = self.hist["time_to_first_token_seconds"]
        self._itl = self.hist["inter_token_latency_seconds"]
        self._intervals: dict[float, int] = {}  # this step: inter-token interval -> tokens
        self.stats = EngineStats()

    def set_replica(self, replica: Replica) -> None:
        self.labels = {"model": replica.model or self.labels["model"], "replica": replica.replica_id}

    # ---- the engine loop ----------------------------------------------------------------
    def record_step(self, output, tokens: list, requests: dict, start: float, now: float) -> None:
        """One step that ran from `start` to `now`: output (a SchedulerOutput) and the tokens
        sampled for its rows; `requests` maps request ids to the engine's live requests."""
        if not output.seqs:
            return
        self.hist["engine_step_seconds"].observe(now - start)
        self.hist["batch_size"].observe(len(output.seqs))
        self.stats.record_step(output.seqs, tokens, now - start)
        for s, token in zip(output.seqs, tokens):
            req = requests.get(s.seq.request_id)
            if req is None:
                continue
            if req.scheduled_time is None:
                self._scheduled(req, start)
            if isinstance(token, list):  # a verified row's tokens share the step's interval
                self._token(req, s.seq.index, now, len(token))
            elif token is not None and s.seq.params.max_tokens != 0:
                self._token(req, s.seq.index, now)
        for interval, n in self._intervals.items():
            self._itl.observe(interval, n)
        self._intervals.clear()

    def request_added(self, lora: str | None) -> None:
        if lora is not None:
            self.lora_requests[lora] = self.lora_requests.get(lora, 0) + 1

    def _scheduled(self, req, now: float) -> None:
        """A request's first step: its queue time ends and its prompt starts computing."""
        req.scheduled_time = now
        self.hist["request_queue_time_seconds"].observe(now - req.arrival_time)
        self.counts["prompt_tokens"] += len(req.prompt_token_ids)

    def _token(self, req, index: int, now: float, count: int = 1) -> None:
        """Sequence `index` of `req` got `count` tokens at the end of the step that ended at
        `now` (more than one: speculative decoding; they share the interval)."""
        self.counts["generation_tokens"] += count
        last = req.token_times.get(index)
        req.token_times[index] = now
        if last is not None:
            interval = (now - last) / count
            self._intervals[interval] = self._intervals.get(interval, 0) + count
        elif req.first_token_time is None:
            req.first_token_time = now
            self._ttft.observe(now - req.arrival_time)

    def finished_request(self, req, now: float) -> RequestMetrics:
        self.hist["e2e_request_latency_seconds"].observe(now - req.arrival_time)
        for seq in req.seqs:
            self._count_finish(seq.finish_reason or "abort")
        return self.request_metrics(req, now)

    def aborted(self, req) -> None:
        """A request cancelled before it finished: its unfinished sequences count as "abort"."""
        for seq in req.seqs:
            self._count_finish(seq.finish_reason if seq.finished else "abort")

    def request_metrics(self, req, now: float) -> RequestMetrics:
        start = req.arrival_time
        return RequestMetrics(
            queue_time=(req.scheduled_time or now) - start, e2e=now - start,
            ttft=None if req.first_token_time is None else req.first_token_time - start,
            replica=self.labels["replica"])

    def _count_finish(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1

    # ---- readers ------------------------------------------------------------------------
    def snapshot(self, engine) -> dict:
        """Plain data for exporters: labels, counters, gauges and histogram buckets."""
        sched, blocks = engine.scheduler, engine.blocks
        return {
            "labels": dict(self.labels),
            "counters": {**self.counts, "preemptions": sched.num_preemptions,
                         "prefix_cache_queries": sched.query_tokens,
                         "prefix_cache_hits": sched.hit_tokens, **_spec_counters(sched.speculator)},
            "finished": dict(self.finished),
            "lora_requests": dict(self.lora_requests),
            "spec_accepted_per_pos": _spec_per_position(sched.speculator),
            "expert_rank_tokens": _expert_rank_tokens(engine),
            "gauges": {"num_requests_running": len(sched.running),
                       "num_requests_waiting": len(sched.waiting),
                       # Blocks, not a fraction, so GET /metrics can sum them over replicas.
                       "kv_blocks_used": blocks.num_blocks - blocks.num_free_blocks,
                       "kv_blocks_total": blocks.num_blocks, **_expert_gauges(engine)},
            "histograms": {name: h.snapshot() for name, h in self.hist.items()},
        }


class EngineStats:
    """Running counters for /stats, the progress line and the benchmarks."""

    def __init__(self):
        self.steps = 0
        self.step_time = 0.0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.decode_tokens = 0  # sampled by one-token rows (decode), for the progress line

    def record_step(self, seqs, tokens: list, seconds: float) -> None:
        """seqs: the step's ScheduledSeqs; tokens: what each sampled (None: nothing, or a token
        dropped because its sequence had finished)."""
        self.steps += 1
        self.step_time += seconds
        for s, token in zip(seqs, tokens):
            if token is not None:
                count = len(token) if isinstance(token, list) else 1
                self.generated_tokens += count
                self.decode_tokens += count if s.num_tokens - len(s.draft) == 1 else 0
            self.prompt_tokens += max(0, min(s.num_tokens, s.seq.num_prompt_tokens - s.start))


def _spec_counters(speculator) -> dict:
    """Speculative decoding's totals (0 where it is off)."""
    names = {"spec_decode_num_drafts": "num_drafts", "spec_decode_num_draft_tokens": "num_draft_tokens",
             "spec_decode_num_accepted_tokens": "num_accepted_tokens"}
    return {name: getattr(speculator, field, 0) for name, field in names.items()}


def _spec_per_position(speculator) -> dict:
    """Position (as a label: "0", "1", ...) -> draft tokens accepted there ({} where it is off)."""
    return {str(i): n for i, n in enumerate(speculator.accepted_per_pos)} if speculator is not None else {}


def _expert_rank_tokens(engine) -> dict:
    """EP rank (as a label) -> routed tokens it computed over the window ({} for dense models)."""
    experts = engine.executor.expert_stats()
    return {str(r): n for r, n in enumerate(experts["rank_tokens"])} if experts else {}


def _expert_gauges(engine) -> dict:
    """Balancedness of MoE models, with a count so GET /metrics can average over replicas."""
    experts = engine.executor.expert_stats()
    if experts is None:
        return {}
    return {"expert_balancedness": experts["balancedness"], "moe_replicas": 1}


# --------------------------------------------------------------------------- progress line

def progress_line(rank: int, world_size: int, active: int, graph: bool, tokens_per_second: float,
                  spec: tuple[float, float] | None = None) -> str:
    """spec: speculative decoding's (acceptance rate, mean tokens per verified row) since the
    last line, where it is on."""
    line = (f"decode progress: dp={rank}/{world_size} active={active} graph={graph} "
            f"tokens_per_second={tokens_per_second:.1f}")
    if spec is not None:
        line += f" spec_acceptance_rate={spec[0]:.2f} spec_mean_acceptance_length={spec[1]:.2f}"
    return line


class DecodeProgress:
    """The --decode-progress-interval-s line: decode-only tokens per second since the last line
    (tokens sampled by one-token decode rows; prefill chunks are left out)."""

    def __init__(self, engine, replica: Replica | None = None):
        self.engine = engine
        self.replica = replica or Replica()
        self._last = (time.monotonic(), engine.stats.decode_tokens)
        self._replays = self._graph_replays()
        self._spec = self._spec_totals()

    def _spec_totals(self) -> tuple[int, int, int] | None:
        s = self.engine.scheduler.speculator
        return None if s is None else (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)

    def _graph_replays(self) -> int:
        return self.engine.executor.graph_replays

    def line(self) -> str:
        """graph=True when decode steps ran as CUDA graphs since the last line."""
        now, tokens = time.monotonic(), self.engine.stats.decode_tokens
        then, before = self._last
        self._last = (now, tokens)
        rate = (tokens - before) / max(now - then, 1e-9)
        replays, self._replays = self._replays, self._graph_replays()
        graph = self._replays > replays
        spec, before_spec = None, self._spec
        self._spec = self._spec_totals()
        if self._spec is not None:
            drafts, proposed, accepted = (a - b for a, b in zip(self._spec, before_spec))
            spec = (accepted / proposed if proposed else 0.0, 1 + accepted / drafts if drafts else 0.0)
        return progress_line(self.replica.rank, self.replica.world_size,
                             len(self.engine.scheduler.running), graph, rate, spec)
