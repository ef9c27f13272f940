"""The engine loop on its own thread, with an asyncio face: `async for out in generate(...)`.

Only the loop thread touches engine state. Callers post adds and aborts to an inbox; outputs
go back to each request's sink (its asyncio queue, or a sink that gathers many requests' for
one stream: actors/host/engine_actor.py) on the caller's event loop, once per step.

The engine is dead, and every request in flight fails with EngineDeadError, when anything
ends the loop thread, when one step runs longer than --watchdog-timeout, or (multi-rank
layouts) when a rank died, left its loop, or stopped answering: a watcher thread notices
within about WATCH_INTERVAL_S of a rank's death, at most RANK_ANSWER_TIMEOUT_S for a rank that
hangs. `alive` then says False, so the replica's health check fails and Serve replaces it.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

import torch

from actors.config import EngineConfig
from actors.engine.llm_engine import LLMEngine
from actors.errors import EngineDeadError, QueueFullError, ShuttingDownError
from actors.request import EngineRequest
from actors.worker.process_tuning import build_on_own_thread, use_threads

log = logging.getLogger("shoal.engine")

WATCH_INTERVAL_S = 1.0
RANK_ANSWER_TIMEOUT_S = 10.0


class AsyncEngine:
    def __init__(self, config: EngineConfig, placement: tuple | None = None):
        # Built on a thread that then ends, so the loop thread is the one that keeps OpenMP workers.
        self.engine = build_on_own_thread(lambda: LLMEngine(config, placement), torch.get_num_threads())
        self.max_model_len = self.engine.max_model_len
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self.draining = False  # set by drain(): no new requests, the ones in flight go on
        self.error: BaseException | None = None
        self._rate = TokenRate()
        self._dying = threading.Lock()
        self._step_started: float | None = None  # while a step runs (the watchdog reads it)
        self._thread = threading.Thread(target=self._run, args=(torch.get_num_threads(),), name="shoal-engine",
                                        daemon=True)
        self._thread.start()
        self._watcher = threading.Thread(target=self._watch, name="shoal-watch", daemon=True)
        self._watcher.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    # ---- caller side (any thread with an event loop) --------------------------------------
    @property
    def lora_enabled(self) -> bool:
        return self.engine.loras is not None

    async def generate(self, request: EngineRequest):
        """Yield the request's outputs until it finishes. Closing the generator aborts it."""
        stream = RequestQueue()
        await self.submit(request, stream)
        finished = False
        try:
            while not finished:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self.release(request.request_id, aborted=not finished)

    async def submit(self, request: EngineRequest, sink) -> None:
        """Start a request whose outputs (and a final error, if it fails) go to
        `sink.deliver(request_id, item)` on the caller's event loop: every request with news in
        a step in one call there. Raises the engine's refusal. The caller `release`s the
        request once it has its finished output or error, or to abort it. A `whole` request
        gets one output, finished: the engine thread keeps the rest, so the caller's loop is
        not woken every step (on 2 cores that wake-up takes a core from the step's OpenMP
        threads)."""
        if not self.alive:
            raise EngineDeadError(f"the engine failed: {self.error or 'its loop ended'}")
        if self.draining:
            raise ShuttingDownError("the server is shutting down; retry on another replica")
        self.engine.check(request)
        limit = self.engine.config.max_queued_requests
        if limit is not None and self.num_waiting() >= limit:
            raise QueueFullError(f"{self.num_waiting()} requests are waiting (limit {limit})")
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        grammar = None
        if request.params.structured is not None:  # compiling can take seconds: not on the loop thread
            grammar = await asyncio.to_thread(self.engine.grammars.compile, request.params.structured)
        self._streams[request.request_id] = (asyncio.get_running_loop(), sink)
        self._post(("add", request, grammar))

    def release(self, request_id: str, aborted: bool) -> None:
        """Nothing more goes to the request's sink; `aborted`: it had not finished, so the
        engine drops it and frees its KV blocks."""
        self._streams.pop(request_id, None)
        if aborted:
            self._post(("abort", request_id))

    def num_waiting(self) -> int:
        """Requests none of whose samples runs yet: queued in the scheduler or in the inbox."""
        running = {seq.request_id for seq in list(self.engine.scheduler.running)}
        return len(self._streams) - len(running)

    def drain(self) -> None:
        """Take no new requests; those in flight run to their end (see abort_all)."""
        self.draining = True

    def abort_all(self, message: str) -> int:
        """End every request in flight with ShuttingDownError(message); how many there were."""
        streams = list(self._streams)
        self._send_all([(rid, ShuttingDownError(message)) for rid in streams])
        return len(streams)

    def stats(self) -> dict:
        e = self.engine
        stats = {
            "running": len(e.scheduler.running),
            "waiting": len(e.scheduler.waiting),
            "kv_cache_usage": round(e.blocks.usage(), 4),
            "kv_blocks_total": e.blocks.num_blocks,
            "kv_blocks_free": e.blocks.num_free_blocks,
            "prefix_cache_hit_rate": round(e.scheduler.hit_rate(), 4),
            "prefix_cache_hits": e.scheduler.hit_tokens,  # prompt tokens served from the cache
            "prefix_cache_queries": e.scheduler.query_tokens,  # prompt tokens looked up
            "preemptions": e.scheduler.num_preemptions,
            "generated_tokens": e.stats.generated_tokens,
            "prompt_tokens": e.stats.prompt_tokens,
            "steps": e.stats.steps,
            "tokens_per_second": round(self._rate.value(), 1),
            "engine_alive": self.alive,
            "draining": self.draining,
            "in_flight": len(self._streams),  # requests whose stream is open, queued ones included
            "ranks": e.rank_infos,
        }
        if e.loras is not None:  # adapters registered, and the ones in slots now
            stats["lora_adapters"] = [r.name for r in e.list_loras()]
            stats["lora_slots_loads"] = e.scheduler.loras.loads
        if e.scheduler.speculator is not None:  # drafts, accepted tokens, acceptance rate
            stats["speculative"] = e.scheduler.speculator.stats()
        experts = e.executor.expert_stats()  # MoE models: routed tokens per expert, balancedness
        if experts is not None:
            stats["experts"] = experts
        return stats

    def metrics(self) -> dict:
        """Counters, gauges and histogram buckets (actors/engine/metrics.py) for GET /metrics."""
        return self.engine.metrics.snapshot(self.engine)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        self._watcher.join(timeout=RANK_ANSWER_TIMEOUT_S + WATCH_INTERVAL_S)
        self.engine.shutdown()

    def _post(self, message: tuple) -> None:
        self._inbox.put(message)
        self._wake.set()

    # ---- loop thread ----------------------------------------------------------------------
    def _run(self, threads: int) -> None:
        use_threads(threads)
        try:
            self._loop()
        except BaseException as exc:  # the engine is unusable now: fail every stream
            log.exception("the engine loop failed")
            self._die(exc)

    def _loop(self) -> None:
        while not self._stopped and self.error is None:
            self._drain_inbox()
            if not self.engine.has_unfinished():
                if not self._wake.wait(timeout=1.0):  # a second with nothing to do
                    self.engine.executor.idle()
                self._wake.clear()
                continue
            self._step_started = time.monotonic()
            outputs = self.engine.step()
            self._step_started = None
            failures = self.engine.take_failures()
            self._rate.add(sum(len(o.token_ids) for out in outputs for o in out.outputs))
            self._send_all([*failures, *((out.request_id, out) for out in outputs)])

    def _watch(self) -> None:
        """The watchdog on the running step and, for multi-rank layouts, every rank's health."""
        executor = self.engine.executor
        while not self._stopped and self.error is None:
            problem = self._stuck_step() or executor.check(RANK_ANSWER_TIMEOUT_S)
            if problem is not None and not self._stopped:
                log.error("the engine is dead: %s", problem)
                self._die(EngineDeadError(problem))
                return
            time.sleep(WATCH_INTERVAL_S)

    def _stuck_step(self) -> str | None:
        limit, started = self.engine.config.watchdog_timeout, self._step_started
        if not limit or started is None or time.monotonic() - started <= limit:
            return None
        return (f"watchdog: engine step {self.engine.stats.steps + 1} ({len(self.engine.scheduler.running)} "
                f"sequences running) has taken {time.monotonic() - started:.0f} s, over "
                f"--watchdog-timeout {limit:g} s")

    def _die(self, exc: BaseException) -> None:
        with self._dying:
            if self.error is not None:
                return
            self.error = exc
        self._fail_all(EngineDeadError(f"the engine failed: {exc}"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if message[0] == "abort":
                self.engine.abort_request(message[1])
                continue
            _, request, grammar = message
            if request.request_id not in self._streams:
                continue  # the caller went away before the engine saw the request
            try:  # (an adapter unloaded since `check` is refused here)
                self.engine.add_request(request, grammar)
            except ValueError as exc:
                self._send(request.request_id, exc)

    def _send(self, request_id: str, item) -> None:
        self._send_all([(request_id, item)])

    def _send_all(self, items: list[tuple[str, object]]) -> None:
        """Hand each (request id, output or error) to its sink: one wake-up per event loop,
        not one per request (each costs the loop a self-pipe write and a callback)."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is None:
                self.engine.abort_request(request_id)  # nobody is listening any more
                continue
            loop, sink = target
            batches.setdefault(loop, []).append((sink, request_id, item))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_deliver, batch)

    def _fail_all(self, exc: BaseException) -> None:
        self._send_all([(rid, exc) for rid in list(self._streams)])


def _deliver(batch: list) -> None:
    for sink, request_id, item in batch:
        sink.deliver(request_id, item)


class RequestQueue(asyncio.Queue):
    """One request's outputs, for `AsyncEngine.generate`."""

    def deliver(self, request_id: str, item) -> None:
        self.put_nowait(item)


class TokenRate:
    """Generated tokens per second over the last few seconds."""

    def __init__(self, window: float = 5.0):
        self.window = window
        self.events: list[tuple[float, int]] = []

    def add(self, n: int) -> None:
        now = time.monotonic()
        self.events.append((now, n))
        while self.events and self.events[0][0] < now - self.window:
            self.events.pop(0)

    def value(self) -> float:
        if not self.events:
            return 0.0
        span = max(time.monotonic() - self.events[0][0], 1e-3)
        return sum(n for _, n in self.events) / span
