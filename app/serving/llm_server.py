"""The LLM server deployment (the replica pool) and the EngineClient the ingress uses on it.

One replica = one model instance = one data-parallel rank. The replica process is light
(bundle 0 of its placement group); the engine runs in the scheduler actor it starts in
bundle 1 (with rank 0's shard); for tp x pp > 1 the engine starts the shard actors of
ranks 1.. in bundles 2.. (actors/shard_actor.py).

Cancellation: a client that goes away makes Serve cancel the ingress's handle call, which
cancels `LLMServer.generate`; its `finally` cancels the actor stream and aborts the
request in the scheduler, which frees the request's KV blocks.
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
from actors.errors import EngineDeadError, QueueFullError, RequestFailedError, ShuttingDownError
from actors.metrics import Replica
from actors.placement import rank_bundle
from actors.sampling_params import SamplingParams
from actors.scheduler_actor import scheduler_actor_class
from app.serving.schedulers import SCHEDULER_NAMESPACE, scheduler_actors, scheduler_name_prefix

log = logging.getLogger("shoal.server")

# The engine's refusals and failures of one request (400, 429, 503, 500 at the HTTP layer).
REFUSALS = (ValueError, QueueFullError, EngineDeadError, RequestFailedError, ShuttingDownError)


@dataclass
class EngineRequest:
    """One generate call to the replica pool."""
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


# A replica's placement group: bundle 0 the replica, bundle 1 the scheduler with rank 0's
# shard, bundles 2.. the shard actors of ranks 1.. (started by the engine).
SCHEDULER_BUNDLE, FIRST_SHARD_BUNDLE = 1, 2


def placement_bundles(config: EngineConfig, replica_cpus: float) -> list[dict]:
    """Bundle 0 for the replica, one per shard rank (bundle 1 also hosts the scheduler)."""
    rank = rank_bundle(config)
    return [{"CPU": replica_cpus}] + [dict(rank) for _ in range(config.tp_size * config.pp_size)]


@serve.deployment(name="LLMServer")
class LLMServer:
    async def __init__(self, engine_config: EngineConfig, log_level: str = "INFO",
                       progress_interval_s: float = 0.0, stream_chunks_per_s: float = 0.0,
                       model_name: str | None = None):
        """model_name: the served name, the `model` label of the engine's metrics."""
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.unique_id
        pg = ray.util.get_current_placement_group()  # None only outside Serve's placement
        strategy = PlacementGroupSchedulingStrategy(pg, SCHEDULER_BUNDLE) if pg else None
        actor = scheduler_actor_class(rank_bundle(engine_config)).options(
            name=scheduler_name_prefix(ctx.app_name) + self.replica,  # found by /stats
            namespace=SCHEDULER_NAMESPACE, scheduling_strategy=strategy)
        placement = (pg, FIRST_SHARD_BUNDLE) if pg else None
        self.scheduler = actor.remote(engine_config, log_level, progress_interval_s, placement,
                                      stream_chunks_per_s, replica_info(ctx, model_name))
        self.max_model_len = await self.scheduler.get_max_model_len.remote()  # waits for the model
        log.info("replica %s ready", self.replica)

    async def generate(self, request: "EngineRequest"):
        """Lists of delta RequestOutputs, relayed as the scheduler paced them."""
        request_id = request.request_id
        stream = self.scheduler.generate.options(num_returns="streaming").remote(
            request.prompt_token_ids, request.params, request_id, request.priority, request.lora,
            request.whole)
        finished = False
        try:
            async for ref in stream:
                outputs = await ref
                finished = outputs[-1].finished
                yield outputs
        except (RayTaskError, RayActorError) as exc:
            error = refusal(exc)
            if error is None:
                raise unwrap(exc) from None
            yield error  # a refusal travels as data: no traceback in the log per refused request
        finally:
            if not finished:  # cancelled by the caller, or failed: free the request's blocks
                ray.cancel(stream)
                self.scheduler.abort.remote(request_id)

    async def stats(self) -> dict:
        return {"replica": self.replica, **await self.scheduler.stats.remote()}

    async def ready(self) -> bool:
        return await self.scheduler.ready.remote()

    async def get_max_model_len(self) -> int:
        return self.max_model_len

    async def lora_enabled(self) -> bool:
        return await self.scheduler.lora_enabled.remote()

    async def check_health(self) -> None:
        """Serve restarts a replica whose scheduler died or whose engine failed."""
        if not await self.scheduler.healthy.remote():
            raise RuntimeError("the engine failed")

    async def __del__(self):
        """Serve stops the replica (after graceful_shutdown_timeout_s for its requests in
        flight): whatever still runs ends with a final error instead of being cut."""
        try:
            await self.scheduler.abort_all.remote("the server shut down before this request finished")
            await asyncio.sleep(0.5)  # let the final error events leave
        except Exception:  # the scheduler is gone already
            pass


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


class ServeEngineClient:
    """EngineClient over the LLMServer pool's deployment handle (used by the ingress)."""

    def __init__(self, handle, max_model_len: int, app_name: str, lora_enabled: bool = False):
        self.handle = handle
        self._streaming = handle.options(stream=True)
        self.max_model_len = max_model_len
        self.app_name = app_name
        self.lora_enabled = lora_enabled

    @classmethod
    async def create(cls, handle, app_name: str) -> "ServeEngineClient":
        return cls(handle, await handle.get_max_model_len.remote(), app_name,
                   await handle.lora_enabled.remote())

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, priority: int = 0, lora: str | None = None,
                       whole: bool = False):
        response = self._streaming.generate.remote(
            EngineRequest(prompt_token_ids, params, request_id, priority, lora, whole))
        try:
            async for outputs in response:
                if isinstance(outputs, BaseException):
                    raise outputs
                for out in outputs:
                    yield out
        except (RayTaskError, RayActorError) as exc:
            error = unwrap(exc)
            if isinstance(error, RayActorError):  # the replica process itself went away
                raise EngineDeadError("a model replica died mid-request; retry") from None
            raise error from None
        finally:
            response.cancel()  # a no-op once finished; else it reaches LLMServer.generate

    # ---- LoRA adapters: registered on every replica's scheduler (named actors, as /stats) --
    # A replica started later (autoscaling, a restart) has only the --lora-modules ones.
    async def load_lora(self, name: str, path: str) -> None:
        errors = [r for r in await self._on_every_replica("load_lora", name, path) if isinstance(r, Exception)]
        if errors:
            raise errors[0]

    async def unload_lora(self, name: str) -> None:
        """Succeeds where any replica had it (one started since may not)."""
        results = await self._on_every_replica("unload_lora", name)
        if results and all(isinstance(r, Exception) for r in results):
            raise results[0]

    async def list_loras(self) -> list[dict]:
        results = [r for r in await self._on_every_replica("list_loras") if not isinstance(r, Exception)]
        return sorted({a["name"]: a for r in results for a in r}.values(), key=lambda a: a["name"])

    async def _on_every_replica(self, method: str, *args) -> list:
        """Each live replica's result of scheduler.method(*args), or its (unwrapped) exception."""
        actors = await asyncio.to_thread(scheduler_actors, self.app_name)
        results = await asyncio.gather(*(getattr(a, method).remote(*args) for a in actors.values()),
                                       return_exceptions=True)
        return [unwrap(r) if isinstance(r, Exception) else r for r in results]

    async def ready(self) -> bool:
        try:
            return await asyncio.wait_for(self.handle.ready.remote(), timeout=5)
        except Exception:  # no replica, or a dead one: not ready
            return False

    async def stats(self) -> dict:
        """Every replica's scheduler stats (named actors), not just the one a call lands on."""
        actors = await asyncio.to_thread(scheduler_actors, self.app_name)
        results = await asyncio.gather(*(a.stats.remote() for a in actors.values()),
                                       return_exceptions=True)
        return {"replicas": [{"replica": replica, **_stats_or_error(r)}
                             for replica, r in zip(actors, results)]}

    async def metrics(self) -> list[dict]:
        """Every replica's engine metrics snapshot (actors/metrics.py), for GET /metrics."""
        actors = await asyncio.to_thread(scheduler_actors, self.app_name)
        results = await asyncio.gather(*(a.metrics.remote() for a in actors.values()),
                                       return_exceptions=True)
        for replica, r in zip(actors, results):
            if isinstance(r, Exception):  # a replica starting or gone: the others still count
                log.warning("no metrics from replica %s: %s", replica, str(unwrap(r)).splitlines()[0])
        return [r for r in results if not isinstance(r, Exception)]


def replica_info(ctx, model_name: str | None) -> Replica:
    """This replica's id and data-parallel rank among the deployment's replicas."""
    rank = getattr(ctx, "rank", None)  # newer Serve numbers replicas; older ones don't
    rank = rank if isinstance(rank, int) else getattr(rank, "rank", 0)
    return Replica(ctx.replica_id.unique_id, model_name, rank or 0, getattr(ctx, "world_size", 1) or 1)


def _stats_or_error(result) -> dict:
    if isinstance(result, Exception):
        return {"engine_alive": False, "error": str(unwrap(result)).splitlines()[0]}
    return result


