"""One model replica's engine, seen from the Serve replica process that owns it.

A replica owns a placement group: bundle 0 holds the Serve replica itself (the LLMServer of
the split layout, or the ModelServer that also hosts the HTTP API), bundle 1 the scheduler
actor it starts (with rank 0's shard), bundles 2.. the shard actors of ranks 1.. that the
engine starts (actors/executor/shards.py). `ReplicaEngine` starts that scheduler and streams
requests from it: over a Unix socket when both share a node (actors/host/link.py), else
through Ray (`RayLink`).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import ray
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.config import EngineConfig
from actors.engine.metrics import Replica
from actors.errors import EngineDeadError, QueueFullError, RequestFailedError, ShuttingDownError
from actors.executor.placement import rank_bundle
from actors.host.engine_actor import engine_actor_class
from actors.host.link import SocketLink
from actors.outputs import Pending
from actors.request import EngineRequest
from app.serving.schedulers import SCHEDULER_NAMESPACE, scheduler_name

# The engine's refusals and failures of one request (400, 429, 503, 500 at the HTTP layer).
REFUSALS = (ValueError, QueueFullError, EngineDeadError, RequestFailedError, ShuttingDownError)

SCHEDULER_BUNDLE, FIRST_SHARD_BUNDLE = 1, 2

log = logging.getLogger("shoal.server")


@dataclass
class RoutedRequest:
    """An EngineRequest as the split layout's handle call carries it to the LLMServer pool."""
    request: EngineRequest

    @property
    def prompt(self) -> str:
        """What prefix-aware routing matches on (Ray Serve LLM's router reads `prompt`): one
        character per token id (past the control characters), so a shared token prefix is a
        shared string prefix. What else the KV depends on comes first, each ended by a control
        character no token maps to: the adapter's name, then the cache salt. Requests sharing
        an adapter (and salt) share a prefix, so they go where that adapter is loaded and its
        KV cached, and never match a prefix cached for another adapter, salt or the base model."""
        r = self.request
        tokens = "".join(chr(0x20 + t) for t in r.prompt_token_ids)
        adapter = "" if r.lora is None else f"{r.lora}\x00"
        salt = "" if r.params.cache_salt is None else f"{r.params.cache_salt}\x01"
        return adapter + salt + tokens


def placement_bundles(config: EngineConfig, replica_cpus: float) -> list[dict]:
    """Bundle 0 for the replica, one per shard rank (bundle 1 also hosts the scheduler)."""
    rank = rank_bundle(config)
    return [{"CPU": replica_cpus}] + [dict(rank) for _ in range(config.tp_size * config.pp_size)]


@dataclass(frozen=True)
class StreamPacing:
    """How a replica gathers a stream's tokens into chunks. The first leaves at once; then
    every `interval` tokens (vLLM's and SGLang's --stream-interval), and under load a stream
    holds what it has a little: just enough that the replica sends about `chunks_per_s` chunks
    in all (each costs CPU in every process it crosses), never more than `flush_ms`, so a
    reader sees text at least that often while tokens come. The last chunk leaves at once."""
    interval: int = 1
    flush_ms: float = 50.0
    chunks_per_s: float = 100.0

    @classmethod
    def of(cls, deploy) -> "StreamPacing":
        return cls(deploy.stream_interval, deploy.stream_flush_ms, deploy.stream_chunks_per_s)

    def hold(self, streams: int) -> float:
        """Seconds a stream gathers before its next chunk, with `streams` in flight."""
        share = streams / self.chunks_per_s if self.chunks_per_s else 0.0
        return min(share, self.flush_ms / 1000)


class ReplicaEngine:
    """The scheduler actor of the Serve replica this runs in (started in its placement group,
    named so /stats, LoRA calls and `shoal drain` find it from any process)."""

    def __init__(self, engine_config: EngineConfig, log_level: str, progress_interval_s: float,
                 pacing: StreamPacing, model_name: str | None):
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.unique_id
        pg = ray.util.get_current_placement_group()  # None only outside Serve's placement
        strategy = PlacementGroupSchedulingStrategy(pg, SCHEDULER_BUNDLE) if pg else None
        actor = engine_actor_class(rank_bundle(engine_config)).options(
            name=scheduler_name(ctx.app_name, ctx.deployment, self.replica),
            namespace=SCHEDULER_NAMESPACE, scheduling_strategy=strategy)
        placement = (pg, FIRST_SHARD_BUNDLE) if pg else None
        self.scheduler = actor.remote(engine_config, log_level, progress_interval_s, placement,
                                      replica_info(ctx, model_name))
        self.pacing = pacing
        self.inboxes: dict[str, Inbox] = {}  # requests in flight, by id
        self.link: SocketLink | RayLink | None = None
        self.reader: asyncio.Task | None = None  # reads self.link while it works
        self.linking = asyncio.Lock()

    async def stream(self, request: EngineRequest):
        """The request's outputs, gathered into chunks as `self.pacing` says (the first at
        once, the last as soon as it exists). Raises the engine's refusal of the request, or
        EngineDeadError when the scheduler died. Closing the iterator before the end (a client
        gone) aborts the request and frees its KV blocks."""
        inbox = self.inboxes[request.request_id] = Inbox()
        finished = False
        link = None
        try:
            link = await self._link()
            try:
                await link.add(request)
            except Exception:
                finished = True  # refused: nothing to abort
                raise
            hold, tokens = 0.0, 1
            while not finished:
                output, error = await inbox.take(hold, tokens)
                if output is not None:
                    finished = output.finished
                    yield output
                if error is not None:
                    finished = True  # the engine has dropped it
                    raise error
                hold, tokens = self.pacing.hold(len(self.inboxes)), self.pacing.interval
        finally:
            self.inboxes.pop(request.request_id, None)
            if not finished and link is not None:  # cancelled by the caller, or failed: free its blocks
                link.abort(request.request_id)

    async def _link(self) -> "SocketLink | RayLink":
        """The link to the scheduler, with its reader running: the Unix socket when the
        scheduler shares this node, else Ray's actor calls and streaming generator."""
        async with self.linking:
            if self.reader is None or self.reader.done():
                self.link = await self._open_link()
                self.reader = asyncio.create_task(self._read(self.link))
            return self.link

    async def _open_link(self) -> "SocketLink | RayLink":
        try:
            node, address = await self.scheduler.link_address.remote()
            if address is not None and node == ray.get_runtime_context().get_node_id():
                link = await SocketLink.open(address)
                log.info("replica %s: its engine is on this node; talking over a Unix socket", self.replica)
                return link
        except OSError as exc:  # e.g. a network namespace between them
            log.warning("replica %s: its engine's Unix socket is out of reach (%s); talking through Ray",
                        self.replica, exc)
            return RayLink(self.scheduler)
        except (RayTaskError, RayActorError) as exc:
            raise refusal(exc) or unwrap(exc) from None
        log.info("replica %s: its engine is on another node; talking through Ray", self.replica)
        return RayLink(self.scheduler)

    async def _read(self, link: "SocketLink | RayLink") -> None:
        """The scheduler's one stream, each request's news to its inbox. Ends (with every
        request in flight failed) when the scheduler dies; the next request starts another."""
        try:
            async for batch in link.batches():
                for request_id, output, error in batch:
                    inbox = self.inboxes.get(request_id)
                    if inbox is not None:
                        inbox.put(output, error)
        except Exception as exc:  # noqa: BLE001 - every request learns why
            error = refusal(exc) or EngineDeadError(f"the engine's output stream failed: {unwrap(exc)}")
            for inbox in list(self.inboxes.values()):
                inbox.put(None, error)

    async def healthy(self) -> bool:
        return await self.scheduler.healthy.remote()

    async def shut_down(self) -> None:
        """Serve stops the replica (after graceful_shutdown_timeout_s for its requests in
        flight): whatever still runs ends with a final error instead of being cut."""
        try:
            await self.scheduler.abort_all.remote("the server shut down before this request finished")
            await asyncio.sleep(0.5)  # let the final error events leave
        except Exception:  # the scheduler is gone already
            pass


class RayLink:
    """The scheduler through Ray (another node): `add` is an actor call, the outputs its
    `outputs` streaming generator."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    async def add(self, request: EngineRequest) -> None:
        try:
            await self.scheduler.add.remote(request)
        except (RayTaskError, RayActorError) as exc:
            raise refusal(exc) or unwrap(exc) from None

    def abort(self, request_id: str) -> None:
        self.scheduler.abort.remote(request_id)

    async def batches(self):
        async for ref in self.scheduler.outputs.options(num_returns="streaming").remote():
            yield await ref


class ReplicaLifecycle:
    """Serve's health check and shutdown hook for a deployment whose replicas each own a
    ReplicaEngine (`self.engine`)."""

    engine: ReplicaEngine

    async def check_health(self) -> None:
        """Serve restarts a replica whose scheduler died or whose engine failed."""
        if not await self.engine.healthy():
            raise RuntimeError("the engine failed")

    async def __del__(self):
        await self.engine.shut_down()


class Inbox:
    """One request's news from the scheduler, waiting for its stream to take it."""

    __slots__ = ("news", "wake", "holding")

    def __init__(self):
        self.news = Pending()
        self.wake: asyncio.Future | None = None
        self.holding = False  # gathering: only the request's end wakes the taker early

    def put(self, output, error) -> None:
        for item in (output, error):
            if item is not None:
                self.news.add(item)
        if self.wake is not None and not self.wake.done() and (self.news.ended or not self.holding):
            self.wake.set_result(None)

    async def take(self, hold: float, tokens: int = 1) -> tuple:
        """(merged output or None, error or None): after `hold` seconds, whatever has come once
        it holds `tokens` new tokens; sooner if the request ends."""
        loop = asyncio.get_running_loop()
        if hold > 0 and not self.news.ended:
            await self._wait(loop, holding=True, timeout=hold)
        while self.news.empty or (self.news.tokens < tokens and not self.news.ended):
            await self._wait(loop, holding=False)
        return self.news.take()

    async def _wait(self, loop, holding: bool, timeout: float | None = None) -> None:
        self.wake, self.holding = loop.create_future(), holding
        timer = None if timeout is None else loop.call_later(timeout, _settle, self.wake)
        try:
            await self.wake
        finally:
            if timer is not None:
                timer.cancel()
            self.wake = None


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def refusal(exc: BaseException) -> BaseException | None:
    """The engine's refusal of one request inside Ray's wrappers (a dead scheduler counts as
    a dead engine), or None for anything else."""
    error = unwrap(exc)
    if isinstance(error, RayActorError):
        return EngineDeadError(f"the engine of replica {serve.get_replica_context().replica_id.unique_id} "
                               "died; Serve restarts it")
    return error if isinstance(error, REFUSALS) else None


def unwrap(exc: BaseException) -> BaseException:
    """The original exception inside Ray's RayTaskError wrappers."""
    while isinstance(exc, RayTaskError) and exc.cause is not None:
        exc = exc.cause
    return exc


def replica_info(ctx, model_name: str | None) -> Replica:
    """This replica's id and data-parallel rank among the deployment's replicas."""
    rank = getattr(ctx, "rank", None)  # newer Serve numbers replicas; older ones don't
    rank = rank if isinstance(rank, int) else getattr(rank, "rank", 0)
    return Replica(ctx.replica_id.unique_id, model_name, rank or 0, getattr(ctx, "world_size", 1) or 1)
