"""The merged layout's deployment: each replica is both the HTTP ingress (the FastAPI app of
app/api/app.py) and one model instance, streaming from its own scheduler actor.

Serve's proxy picks the replica (power of two choices on requests in flight) and counts the
HTTP requests for autoscaling and graceful shutdown, as it would for a model deployment.
Against the split layout (Ingress -> handle -> LLMServer -> scheduler) a request crosses one
Serve process and one Serve router fewer, and every stream chunk one process hop fewer; a
replica's template rendering and tokenizing scale with the replicas. Prefix-aware routing
needs the split layout: the proxy routes before the prompt is read.

With `listener` (the path where `shoal serve` lends its listening socket) the replica also
answers HTTP on that socket itself, without the proxy (app/serving/direct_http.py).
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

from ray import serve

from actors.config import EngineConfig
from actors.request import EngineRequest
from actors.worker.checkpoint_files import engine_tokenizer, load_declared_tokenizer, resolve_tokenizer_path
from app.api.app import ApiHost
from app.api.settings import ServerSettings
from app.serving.app_replicas import AppReplicas
from app.serving.direct_http import DirectHTTP
from app.serving.replica import ReplicaEngine, ReplicaLifecycle, StreamPacing

log = logging.getLogger("shoal.server")

HTTP_COUNTS_PUSH_S = 1.0


@serve.deployment(name="ModelServer")
@serve.ingress()
class ModelServer(ApiHost, ReplicaLifecycle):
    async def __init__(self, engine_config: EngineConfig, settings: ServerSettings,
                       log_level: str = "INFO", progress_interval_s: float = 0.0,
                       pacing: StreamPacing = StreamPacing(),
                       listener: str | None = None):
        super().__init__(settings, log_level)
        self.engine = ReplicaEngine(engine_config, log_level, progress_interval_s,
                                    pacing, settings.served_model_name)
        # Wait for the model: until then Serve routes no request here (a replica added by the
        # autoscaler takes traffic only once it can serve it). Meanwhile the tokenizer its files
        # declare loads; it is kept if the engine's AutoTokenizer chose the same class.
        path = resolve_tokenizer_path(settings.tokenizer, settings.model_path)
        declared = asyncio.create_task(asyncio.to_thread(load_declared_tokenizer, path))
        client = await ReplicaEngineClient.create(self.engine, serve.get_replica_context().app_name)
        # (awaited first: transformers imported from two threads at once can fail halfway)
        self.attach(client, await asyncio.to_thread(engine_tokenizer, path, client.tokenizer_class, await declared,
                                                    settings.trust_remote_code))
        self._pushing = asyncio.create_task(self._push_http_counts())
        self.http = None
        if listener is not None:
            self.http = DirectHTTP(self.api, listener)
            await self.http.start()
        log.info("replica %s ready (max_model_len %d)", self.engine.replica, client.max_model_len)

    async def __del__(self):
        if getattr(self, "http", None) is not None:  # None too when __init__ failed early
            await self.http.stop()
        await super().__del__()

    async def _push_http_counts(self) -> None:
        """This replica's HTTP counts to its scheduler, where a /metrics scrape answered by
        another replica finds them (app/api/metrics.py)."""
        metrics = self.api.state.http_metrics
        metrics.pushed = True
        counts, pushed = metrics.counts, {}
        while True:
            await asyncio.sleep(HTTP_COUNTS_PUSH_S)
            if counts != pushed:
                pushed = dict(counts)
                try:
                    await self.engine.scheduler.set_http_counts.remote(pushed)
                except Exception:  # the scheduler died: the health check replaces the replica
                    log.warning("could not push HTTP counts to the scheduler", exc_info=True)


class ReplicaEngineClient(AppReplicas):
    """EngineClient over this replica's own scheduler actor (no Serve handle in between)."""

    def __init__(self, engine: ReplicaEngine, max_model_len: int, app_name: str, lora_enabled: bool,
                 tokenizer_class: str):
        self.engine = engine
        self.max_model_len = max_model_len
        self.app_name = app_name
        self.lora_enabled = lora_enabled
        self.tokenizer_class = tokenizer_class  # "module:Class", as the engine loaded it

    @classmethod
    async def create(cls, engine: ReplicaEngine, app_name: str) -> "ReplicaEngineClient":
        scheduler = engine.scheduler
        return cls(engine, await scheduler.get_max_model_len.remote(), app_name,
                   await scheduler.lora_enabled.remote(), await scheduler.tokenizer_class.remote())

    async def generate(self, request: EngineRequest):
        async with aclosing(self.engine.stream(request)) as stream:  # closed early: aborted
            async for output in stream:
                yield output

    async def ready(self) -> bool:
        try:
            return await self.engine.scheduler.ready.remote()
        except Exception:  # a dead scheduler: not ready
            return False
