"""The engine actor: one model instance's engine loop in its own Ray process.

It holds rank 0's shard (its weights and KV cache) in this process, as SGLang's rank-0
scheduler does, so tp = pp = 1 costs no inter-process hop per step. For larger layouts the
engine starts ranks 1.. as shard actors in the bundles of `placement` (the replica's
placement group) and drives them over torch.distributed (actors/executor/shards.py).

Requests come in with `add`; their outputs leave through ONE stream per replica, `outputs`
(a Ray streaming generator) or the Unix socket of actors/host/link.py that a replica on the
same node uses for both: at most one item per engine step, carrying a merged delta (or the error)
of every request that has news, as vLLM's engine core and SGLang's scheduler send one message
per step. A chunk costs ~1 ms of CPU in each process it crosses, whatever it carries, so one
per step for all requests, rather than one per request, keeps the hop's cost flat in the
number of requests; the replica paces what it sends on to clients (app/serving/replica.py).
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

from typing import TYPE_CHECKING

import ray

from actors.config import EngineConfig
from actors.engine.lora_calls import AdapterCalls
from actors.engine.metrics import DecodeProgress, Replica
from actors.executor.placement import rank_runtime_env
from actors.host.link import LinkServer
from actors.host.ray_metrics import start_ray_export
from actors.logs import setup_logging
from actors.outputs import Pending
from actors.request import EngineRequest

if TYPE_CHECKING:
    from actors.engine.async_engine import AsyncEngine

log = logging.getLogger("shoal.scheduler")

class Outbox:
    """Every request's news, gathered on the actor's event loop for the replica's one stream
    (the AsyncEngine's sink): what piles up between two reads leaves merged, one item per
    request."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.pending: dict[str, Pending] = {}  # request id -> news not sent yet
        self.ready = asyncio.Event()
        self.reader = 0  # the stream allowed to take (a newer one replaces an older one)

    def deliver(self, request_id: str, item) -> None:
        pending = self.pending.setdefault(request_id, Pending())
        pending.add(item)
        if pending.ended:
            self.engine.release(request_id, aborted=isinstance(item, BaseException))
        self.ready.set()

    def drop(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def open_reader(self) -> int:
        """A new reader's number: it replaces the last one, and gets what piled up at once."""
        self.reader += 1
        self.ready.set()
        return self.reader

    async def take(self, reader: int) -> list[tuple] | None:
        """[(request id, merged output or None, error or None)] for every request with news,
        once there is some; None when a newer stream took over."""
        while True:
            await self.ready.wait()
            if reader != self.reader:
                return None
            self.ready.clear()
            batch = [(request_id, *pending.take()) for request_id, pending in self.pending.items()]
            self.pending.clear()
            if batch:
                return batch


def torch_threads(config: EngineConfig) -> int:
    """EngineConfig.num_threads, else the CPUs Ray gave this actor (Ray sets OMP to 1)."""
    if config.num_threads:
        return config.num_threads
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    return max(1, int(round(cpus)))


class EngineActor(AdapterCalls):
    """Hosts the AsyncEngine. Made a Ray actor by `engine_actor_class()`."""

    def __init__(self, config: EngineConfig, log_level: str = "INFO",
                 progress_interval_s: float = 0.0, placement: tuple | None = None,
                 replica: Replica | None = None):
        """placement: (placement group, bundle of shard rank 1), or None for the engine's own.
        replica: the Serve replica's id, rank and model name (metric labels, progress line)."""
        # The engine (and torch) are imported here, in the actor's process: the replica that
        # creates this actor never imports them, which would cost it seconds at start.
        import torch

        from actors.engine.async_engine import AsyncEngine
        from actors.executor.shards import use_ray_progress_bars

        setup_logging(log_level)
        use_ray_progress_bars()
        threads = torch_threads(config)
        torch.set_num_threads(threads)
        self.engine = AsyncEngine(config, placement)
        self.max_model_len = self.engine.max_model_len
        self.outbox = Outbox(self.engine)
        self.link = LinkServer(self)
        self.http_counts: dict = {}  # see set_http_counts
        self.replica = replica or Replica()
        self.engine.engine.metrics.set_replica(self.replica)
        self.exporter = start_ray_export(self.engine.engine)  # Ray dashboard / Prometheus
        log.info("scheduler ready in pid %d: %d torch threads, max_model_len %d",
                 os.getpid(), threads, self.max_model_len)
        if progress_interval_s > 0:  # a thread: __init__ runs outside the actor's event loop
            threading.Thread(target=self._log_progress, args=(progress_interval_s,),
                             name="shoal-progress", daemon=True).start()

    async def add(self, request: EngineRequest) -> None:
        """Start a request (its outputs leave through `outputs`); raises the engine's refusal."""
        await self.engine.submit(request, self.outbox)

    async def outputs(self):
        """The replica's one stream of every request's news (see Outbox.take); opening a new
        one ends the last (a replica that lost its stream reads on from where it was)."""
        reader = self.outbox.open_reader()
        while (batch := await self.outbox.take(reader)) is not None:
            yield batch

    async def link_address(self) -> tuple[str, str | None]:
        """(this node's id, the address of the engine's Unix socket or None where there is none):
        a replica on this node talks to the engine there instead of through `add` and `outputs`."""
        return ray.get_runtime_context().get_node_id(), await self.link.start()

    def abort(self, request_id: str) -> None:
        self.outbox.drop(request_id)
        self.engine.release(request_id, aborted=True)

    def lora_enabled(self) -> bool:
        return self.engine.lora_enabled

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

    async def tokenizer_class(self) -> str:
        """The tokenizer's class as "module:Class": the replica loads the same class itself,
        without AutoTokenizer's torch import (actors/worker/checkpoint_files.py)."""
        return await asyncio.to_thread(lambda: self.engine.engine.tokenizer_class)

    def _log_progress(self, interval: float) -> None:
        """areno's --decode-progress-interval-s: a periodic one-line decode throughput report."""
        progress = DecodeProgress(self.engine.engine, self.replica)
        while self.engine.alive:
            time.sleep(interval)
            log.info(progress.line())


def engine_actor_class(bundle: dict):
    """The Ray actor class, claiming rank 0's bundle (its CPUs and its GPU, if any). Async (an
    event loop per actor), so many requests stream at once."""
    return ray.remote(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                      max_concurrency=10_000, runtime_env=rank_runtime_env())(EngineActor)
