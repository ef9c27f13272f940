"""The scheduler actor: one model instance's engine loop in its own Ray process.

It holds rank 0's shard (its weights and KV cache) in this process, as SGLang's rank-0
scheduler does, so tp = pp = 1 costs no inter-process hop per step. For larger layouts the
engine starts ranks 1.. as shard actors in the bundles of `placement` (the replica's
placement group) and drives them over torch.distributed (actors/shard_actor.py).

Per request, `generate` is a Ray streaming generator yielding LISTS of delta outputs: the
first as soon as it exists, later ones coalesced. Every chunk costs ~1 ms of CPU in each
process it crosses (actor -> replica -> ingress -> proxy), so under load a stream gathers
its tokens for a while: the replica then sends about `stream_chunks_per_s` chunks per
second in all, however many requests run, and the relay's CPU share stays bounded.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import ray
import torch

from actors.async_engine import AsyncEngine
from actors.config import EngineConfig
from actors.metrics import DecodeProgress, Replica
from actors.ray_metrics import start_ray_export
from actors.outputs import accumulate
from actors.placement import rank_runtime_env
from actors.sampling_params import SamplingParams

log = logging.getLogger("shoal.scheduler")

_END = object()


async def coalesce(source, interval=lambda: 0.0):
    """Re-yield an async iterator's items as lists: the first at once, later ones gathered
    for `interval()` seconds after each yield (0: whatever arrived while we were away).

    A pump task reads `source` into a queue, so reading never waits on the consumer.
    Closing this generator cancels the pump, which closes `source` (for an engine stream
    that aborts the request and frees its KV blocks).
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    pump = asyncio.create_task(_pump(source, queue))
    batch, due = [], 0.0  # due: when held items go out
    try:
        while True:
            wait = max(0.0, due - loop.time()) if batch else None
            try:
                batch.append(await asyncio.wait_for(queue.get(), wait))
            except asyncio.TimeoutError:
                pass
            while not queue.empty():
                batch.append(queue.get_nowait())
            last = batch[-1]
            ended = last is _END or isinstance(last, BaseException)
            if not (ended or _finished(last) or loop.time() >= due):
                continue
            items = batch[:-1] if ended else batch
            if items:
                yield items
            if ended:
                if isinstance(last, BaseException):
                    raise last
                return
            batch, due = [], loop.time() + interval()
    finally:
        pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)


def _finished(item) -> bool:
    return bool(getattr(item, "finished", False))


async def _pump(source, queue: asyncio.Queue) -> None:
    try:
        async for item in source:
            queue.put_nowait(item)
        queue.put_nowait(_END)
    except asyncio.CancelledError:
        await source.aclose()  # runs the source's clean-up (the abort) before we finish
        raise
    except Exception as exc:  # handed to the consumer, which re-raises it
        queue.put_nowait(exc)


def torch_threads(config: EngineConfig) -> int:
    """EngineConfig.num_threads, else the CPUs Ray gave this actor (Ray sets OMP to 1)."""
    if config.num_threads:
        return config.num_threads
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    return max(1, int(round(cpus)))


class SchedulerActor:
    """Hosts the AsyncEngine. Made a Ray actor by `scheduler_actor_class()`."""

    def __init__(self, config: EngineConfig, log_level: str = "INFO",
                 progress_interval_s: float = 0.0, placement: tuple | None = None,
                 stream_chunks_per_s: float = 0.0, replica: Replica | None = None):
        """placement: (placement group, bundle of shard rank 1), or None for the engine's own.
        stream_chunks_per_s: 0 sends every step's tokens at once.
        replica: the Serve replica's id, rank and model name (metric labels, progress line)."""
        logging.basicConfig(level=log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        threads = torch_threads(config)
        torch.set_num_threads(threads)
        self.engine = AsyncEngine(config, placement)
        self.max_model_len = self.engine.max_model_len
        self.chunk_rate = stream_chunks_per_s
        self.http_counts: dict = {}  # see set_http_counts
        self.replica = replica or Replica()
        self.engine.engine.metrics.set_replica(self.replica)
        self.exporter = start_ray_export(self.engine.engine)  # Ray dashboard / Prometheus
        log.info("scheduler ready in pid %d: %d torch threads, max_model_len %d",
                 os.getpid(), threads, self.max_model_len)
        if progress_interval_s > 0:  # a thread: __init__ runs outside the actor's event loop
            threading.Thread(target=self._log_progress, args=(progress_interval_s,),
                             name="shoal-progress", daemon=True).start()

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, priority: int = 0, lora: str | None = None,
                       whole: bool = False):
        """Lists of delta RequestOutputs. Cancelling or closing the stream aborts the request.
        whole: the caller wants only the finished output (a non-streamed HTTP request), so it
        leaves as one item, which every hop relays once instead of once per chunk."""
        stream = self.engine.generate(prompt_token_ids, params, request_id, priority, lora=lora)
        gather = (lambda: float("inf")) if whole else self._gather_seconds
        async for outputs in coalesce(stream, gather):
            # One merged delta per chunk: less for every hop to pickle (each delta repeats
            # the request's prompt ids), and the ingress gets one delta per chunk anyway.
            yield [accumulate(outputs)] if len(outputs) > 1 else outputs

    def _gather_seconds(self) -> float:
        """How long a stream gathers tokens after a chunk: running / rate (0 when idle)."""
        if not self.chunk_rate:
            return 0.0
        return self.engine.stats()["running"] / self.chunk_rate

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def lora_enabled(self) -> bool:
        return self.engine.lora_enabled

    async def load_lora(self, name: str, path: str) -> None:
        await self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    def list_loras(self) -> list[dict]:
        return self.engine.list_loras()

    def stats(self) -> dict:
        return {**self.engine.stats(), "pid": os.getpid()}

    def metrics(self) -> dict:
        """This engine's counters, gauges and histogram buckets; GET /metrics sums replicas."""
        return {**self.engine.metrics(), "http": self.http_counts}

    def set_http_counts(self, counts: dict) -> None:
        """The HTTP response counts of the API that runs in this replica's Serve process (the
        merged layout), kept here so GET /metrics on any replica can sum every replica's."""
        self.http_counts = counts

    def ready(self) -> bool:
        """Can take a request: alive and not draining."""
        return self.engine.alive and not self.engine.draining

    def healthy(self) -> bool:
        """For the replica's health check: a draining engine is healthy (don't replace it)."""
        return self.engine.alive

    def drain(self) -> None:
        self.engine.drain()

    def abort_all(self, message: str) -> int:
        return self.engine.abort_all(message)

    def get_max_model_len(self) -> int:
        return self.max_model_len

    def _log_progress(self, interval: float) -> None:
        """areno's --decode-progress-interval-s: a periodic one-line decode throughput report."""
        progress = DecodeProgress(self.engine.engine, self.replica)
        while self.engine.alive:
            time.sleep(interval)
            log.info(progress.line())


def scheduler_actor_class(bundle: dict):
    """The Ray actor class, claiming rank 0's bundle (its CPUs and its GPU, if any). Async (an
    event loop per actor), so many requests stream at once."""
    return ray.remote(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                      max_concurrency=10_000, runtime_env=rank_runtime_env())(SchedulerActor)
