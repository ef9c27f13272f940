"""One model replica's engine, seen from the Serve replica process that owns it.

A replica owns a placement group: bundle 0 holds the Serve replica itself (the LLMServer of
the split layout, or the ModelServer that also hosts the HTTP API), bundle 1 the scheduler
actor it starts (with rank 0's shard), bundles 2.. the shard actors of ranks 1.. that the
engine starts (actors/shard_actor.py). `ReplicaEngine` starts that scheduler and streams
requests from it.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import ray
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.config import EngineConfig
from actors.errors import EngineDeadError, QueueFullError, RequestFailedError, ShuttingDownError
from actors.metrics import Replica
from actors.placement import rank_bundle
from actors.sampling_params import SamplingParams
from actors.scheduler_actor import scheduler_actor_class
from app.serving.schedulers import SCHEDULER_NAMESPACE, scheduler_name_prefix

# The engine's refusals and failures of one request (400, 429, 503, 500 at the HTTP layer).
REFUSALS = (ValueError, QueueFullError, EngineDeadError, RequestFailedError, ShuttingDownError)

SCHEDULER_BUNDLE, FIRST_SHARD_BUNDLE = 1, 2


@dataclass
class EngineRequest:
    """One generate call to a replica."""
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    priority: int = 0
    lora: str | None = None  # a LoRA adapter's name; None: the base model
    whole: bool = False  # only the finished output is wanted (not streamed to the client)

    @property
    def prompt(self) -> str:
        """What prefix-aware routing matches on: one character per token id (past the control
        characters), so a shared token prefix is a shared string prefix. What else the KV
        depends on comes first, each ended by a control character no token maps to: the
        adapter's name, then the cache salt. Requests sharing an adapter (and salt) share a
        prefix, so they go where that adapter is loaded and its KV cached, and never match a
        prefix cached for another adapter, salt or the base model."""
        tokens = "".join(chr(0x20 + t) for t in self.prompt_token_ids)
        adapter = "" if self.lora is None else f"{self.lora}\x00"
        salt = "" if self.params.cache_salt is None else f"{self.params.cache_salt}\x01"
        return adapter + salt + tokens


def placement_bundles(config: EngineConfig, replica_cpus: float) -> list[dict]:
    """Bundle 0 for the replica, one per shard rank (bundle 1 also hosts the scheduler)."""
    rank = rank_bundle(config)
    return [{"CPU": replica_cpus}] + [dict(rank) for _ in range(config.tp_size * config.pp_size)]


class ReplicaEngine:
    """The scheduler actor of the Serve replica this runs in (started in its placement group,
    named so /stats, LoRA calls and `shoal drain` find it from any process)."""

    def __init__(self, engine_config: EngineConfig, log_level: str, progress_interval_s: float,
                 stream_chunks_per_s: float, model_name: str | None):
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.unique_id
        pg = ray.util.get_current_placement_group()  # None only outside Serve's placement
        strategy = PlacementGroupSchedulingStrategy(pg, SCHEDULER_BUNDLE) if pg else None
        actor = scheduler_actor_class(rank_bundle(engine_config)).options(
            name=scheduler_name_prefix(ctx.app_name) + self.replica,
            namespace=SCHEDULER_NAMESPACE, scheduling_strategy=strategy)
        placement = (pg, FIRST_SHARD_BUNDLE) if pg else None
        self.scheduler = actor.remote(engine_config, log_level, progress_interval_s, placement,
                                      stream_chunks_per_s, replica_info(ctx, model_name))

    async def stream(self, request: EngineRequest):
        """Lists of delta RequestOutputs, as the scheduler paced them. Raises the engine's
        refusal of the request, or EngineDeadError when the scheduler died. Closing the
        iterator before the end (a client gone) aborts the request and frees its KV blocks."""
        stream = self.scheduler.generate.options(num_returns="streaming").remote(
            request.prompt_token_ids, request.params, request.request_id, request.priority,
            request.lora, request.whole)
        finished = False
        try:
            async for ref in stream:
                outputs = await ref
                finished = outputs[-1].finished
                yield outputs
        except (RayTaskError, RayActorError) as exc:
            error = refusal(exc)
            raise (unwrap(exc) if error is None else error) from None
        finally:
            if not finished:  # cancelled by the caller, or failed: free the request's blocks
                ray.cancel(stream)
                self.scheduler.abort.remote(request.request_id)

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
