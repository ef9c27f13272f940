"""The split layout's model replica pool: the LLMServer deployment, and the EngineClient the
separate Ingress deployment uses on it through a Serve handle.

One replica = one model instance = one data-parallel rank; its engine runs in the scheduler
actor it starts (app/serving/replica.py). The split layout costs a process hop per request
and per stream chunk over the merged one (app/serving/model_server.py); it is what
prefix-aware routing needs, since Serve's router reads the prompt from the handle call.

Cancellation: a client that goes away makes Serve cancel the ingress's handle call, which
cancels `LLMServer.generate`, which closes the replica's stream of the request: it tells the
scheduler to abort the request, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

from ray import serve
from ray.exceptions import RayActorError, RayTaskError

from actors.config import EngineConfig
from actors.errors import EngineDeadError
from actors.request import EngineRequest
from app.serving.app_replicas import AppReplicas
from app.serving.replica import REFUSALS, ReplicaEngine, ReplicaLifecycle, RoutedRequest, StreamPacing, unwrap

log = logging.getLogger("shoal.server")


@serve.deployment(name="LLMServer")
class LLMServer(ReplicaLifecycle):
    async def __init__(self, engine_config: EngineConfig, log_level: str = "INFO",
                       progress_interval_s: float = 0.0, pacing: StreamPacing = StreamPacing(),
                       model_name: str | None = None):
        """model_name: the served name, the `model` label of the engine's metrics."""
        self.engine = ReplicaEngine(engine_config, log_level, progress_interval_s,
                                    pacing, model_name)
        self.scheduler = self.engine.scheduler
        self.max_model_len = await self.scheduler.get_max_model_len.remote()  # waits for the model
        log.info("replica %s ready", self.engine.replica)

    async def generate(self, routed: RoutedRequest):
        """The request's outputs, relayed as the replica paced them."""
        try:
            async with aclosing(self.engine.stream(routed.request)) as stream:  # closed: aborted
                async for output in stream:
                    yield output
        except REFUSALS as error:
            yield error  # a refusal travels as data: no traceback in the log per refused request

    async def stats(self) -> dict:
        return {"replica": self.engine.replica, **await self.scheduler.stats.remote()}

    async def ready(self) -> bool:
        return await self.scheduler.ready.remote()

    async def get_max_model_len(self) -> int:
        return self.max_model_len

    async def lora_enabled(self) -> bool:
        return await self.scheduler.lora_enabled.remote()

    async def tokenizer_class(self) -> str:
        return await self.scheduler.tokenizer_class.remote()


class ServeEngineClient(AppReplicas):
    """EngineClient over the LLMServer pool's deployment handle (used by the split layout's
    ingress)."""

    def __init__(self, handle, max_model_len: int, app_name: str, lora_enabled: bool = False,
                 own_pool: bool = False, tokenizer_class: str | None = None):
        """own_pool: the application serves several models; reach only this handle's replicas.
        tokenizer_class: "module:Class", as the pool's engines loaded the tokenizer."""
        self.handle = handle
        self._streaming = handle.options(stream=True)
        self.max_model_len = max_model_len
        self.app_name = app_name
        self.lora_enabled = lora_enabled
        self.deployment = handle.deployment_name if own_pool else None
        self.tokenizer_class = tokenizer_class

    @classmethod
    async def create(cls, handle, app_name: str, own_pool: bool = False) -> "ServeEngineClient":
        return cls(handle, await handle.get_max_model_len.remote(), app_name,
                   await handle.lora_enabled.remote(), own_pool, await handle.tokenizer_class.remote())

    async def generate(self, request: EngineRequest):
        response = self._streaming.generate.remote(RoutedRequest(request))
        try:
            async for output in response:
                if isinstance(output, BaseException):
                    raise output
                yield output
        except (RayTaskError, RayActorError) as exc:
            error = unwrap(exc)
            if isinstance(error, RayActorError):  # the replica process itself went away
                raise EngineDeadError("a model replica died mid-request; retry") from None
            raise error from None
        finally:
            response.cancel()  # a no-op once finished; else it reaches LLMServer.generate

    async def ready(self) -> bool:
        try:
            return await asyncio.wait_for(self.handle.ready.remote(), timeout=5)
        except Exception:  # no replica, or a dead one: not ready
            return False
