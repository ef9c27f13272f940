"""The LLM server deployment (the replica pool) and the EngineClient the ingress uses on it.

One replica = one model instance = one data-parallel rank. The replica process is light
(bundle 0 of its placement group); the engine runs in the scheduler actor it starts in
bundle 1 (with rank 0's shard). Bundles 2.. are for the shard actors of larger tp x pp
layouts (the distributed issue).

Cancellation: a client that goes away makes Serve cancel the ingress's handle call, which
cancels `LLMServer.generate`; its `finally` cancels the actor stream and aborts the
request in the scheduler, which frees the request's KV blocks.
"""
from __future__ import annotations

import asyncio
import logging

import ray
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.async_engine import EngineDeadError
from actors.config import EngineConfig
from actors.sampling_params import SamplingParams
from actors.scheduler_actor import coalesce, scheduler_actor_class

log = logging.getLogger("shoal.server")

SCHEDULER_NAMESPACE = "shoal"


def scheduler_name_prefix(app_name: str) -> str:
    return f"scheduler:{app_name}:"


def placement_bundles(tp_size: int, pp_size: int, replica_cpus: float, shard_cpus: float,
                      shard_gpus: float = 0) -> list[dict]:
    """Bundle 0 for the replica, one per shard (bundle 1 also hosts the scheduler)."""
    shard = {"CPU": shard_cpus, **({"GPU": shard_gpus} if shard_gpus else {})}
    return [{"CPU": replica_cpus}] + [dict(shard) for _ in range(tp_size * pp_size)]


@serve.deployment(name="LLMServer")
class LLMServer:
    async def __init__(self, engine_config: EngineConfig, shard_cpus: float = 1.0,
                       log_level: str = "INFO", progress_interval_s: float = 0.0):
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.unique_id
        actor = scheduler_actor_class(shard_cpus).options(
            name=scheduler_name_prefix(ctx.app_name) + self.replica,
            namespace=SCHEDULER_NAMESPACE,
            scheduling_strategy=_bundle(1),
        )
        self.scheduler = actor.remote(engine_config, log_level, progress_interval_s)
        self.max_model_len = await self.scheduler.get_max_model_len.remote()  # waits for the model
        log.info("replica %s ready", self.replica)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, priority: int = 0):
        """Lists of delta RequestOutputs, coalesced again at this hop (each chunk costs ~1 ms)."""
        stream = self.scheduler.generate.options(num_returns="streaming").remote(
            prompt_token_ids, params, request_id, priority)
        finished = False
        try:
            async for batches in coalesce(_items(stream)):
                outputs = [out for batch in batches for out in batch]
                finished = outputs[-1].finished
                yield outputs
        except RayTaskError as exc:
            raise unwrap(exc) from None  # the engine's own error, not Ray's wrapper
        finally:
            if not finished:  # cancelled by the caller, or failed: free the request's blocks
                ray.cancel(stream)
                self.scheduler.abort.remote(request_id)

    async def abort(self, request_id: str) -> None:
        await self.scheduler.abort.remote(request_id)

    async def stats(self) -> dict:
        return {"replica": self.replica, **await self.scheduler.stats.remote()}

    async def ready(self) -> bool:
        return await self.scheduler.ready.remote()

    async def get_max_model_len(self) -> int:
        return self.max_model_len

    async def check_health(self) -> None:
        """Serve restarts a replica whose scheduler died or whose engine failed."""
        if not await self.scheduler.ready.remote():
            raise RuntimeError("the engine failed")


def _bundle(index: int):
    """Schedule into bundle `index` of this replica's placement group (none outside Serve)."""
    pg = ray.util.get_current_placement_group()
    if pg is None:
        return None
    return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)


async def _items(stream):
    async for ref in stream:
        yield await ref


def unwrap(exc: BaseException) -> BaseException:
    """The original exception inside Ray's RayTaskError wrappers."""
    while isinstance(exc, RayTaskError) and exc.cause is not None:
        exc = exc.cause
    return exc


class ServeEngineClient:
    """EngineClient over the LLMServer pool's deployment handle (used by the ingress)."""

    def __init__(self, handle, max_model_len: int, app_name: str):
        self.handle = handle
        self.max_model_len = max_model_len
        self.app_name = app_name
        self._live: dict[str, object] = {}  # request id -> its streaming response

    @classmethod
    async def create(cls, handle, app_name: str) -> "ServeEngineClient":
        return cls(handle, await handle.get_max_model_len.remote(), app_name)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, priority: int = 0):
        response = self.handle.options(stream=True).generate.remote(
            prompt_token_ids, params, request_id, priority)
        self._live[request_id] = response
        try:
            async for outputs in response:
                for out in outputs:
                    yield out
        except RayTaskError as exc:
            raise unwrap(exc) from None
        except RayActorError as exc:
            raise EngineDeadError(f"the model replica died: {exc}") from None
        finally:
            self._live.pop(request_id, None)
            response.cancel()  # a no-op once finished; else it reaches LLMServer.generate

    async def abort(self, request_id: str) -> None:
        response = self._live.get(request_id)
        if response is not None:
            response.cancel()

    async def ready(self) -> bool:
        try:
            return await asyncio.wait_for(_await(self.handle.ready.remote()), timeout=5)
        except Exception:  # no replica, or a dead one: not ready
            return False

    async def stats(self) -> dict:
        """Every replica's scheduler stats (named actors), not just the one a call lands on."""
        actors = await asyncio.to_thread(scheduler_actors, self.app_name)
        results = await asyncio.gather(*(a.stats.remote() for a in actors.values()),
                                       return_exceptions=True)
        return {"replicas": [{"replica": replica, **_stats_or_error(r)}
                             for replica, r in zip(actors, results)]}


def scheduler_actors(app_name: str) -> dict:
    """Replica id -> scheduler actor handle, for every live replica of the app."""
    prefix = scheduler_name_prefix(app_name)
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == SCHEDULER_NAMESPACE and a["name"].startswith(prefix)]
    return {n[len(prefix):]: ray.get_actor(n, namespace=SCHEDULER_NAMESPACE) for n in sorted(names)}


def _stats_or_error(result) -> dict:
    if isinstance(result, Exception):
        return {"engine_alive": False, "error": str(unwrap(result)).splitlines()[0]}
    return result


async def _await(response):
    return await response

