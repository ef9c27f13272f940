"""The split layout's ingress deployment: the FastAPI app of app/api/app.py, hosted by Ray
Serve in front of the LLMServer pool (the merged layout's ModelServer hosts it in each model
replica instead: app/serving/model_server.py).

It validates, authenticates, renders chat templates and tokenizes in its own replica (so
that CPU work stays off the engine loop and scales with ingress replicas), then streams
engine outputs from the LLMServer pool through a deployment handle.
"""
from __future__ import annotations

import asyncio
import logging

from ray import serve

from app.api.app import ApiHost
from app.api.settings import ServerSettings
from app.serving.llm_server import ServeEngineClient

log = logging.getLogger("shoal.ingress")


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress(ApiHost):
    async def __init__(self, llm_server, settings: ServerSettings, log_level: str = "INFO"):
        super().__init__(settings, log_level)
        # Attach once the pool answers: until then the API says 503 and /healthz still works.
        self._attaching = asyncio.create_task(self._attach(llm_server, serve.get_replica_context().app_name))

    async def _attach(self, llm_server, app_name: str) -> None:
        tokenizer = asyncio.create_task(asyncio.to_thread(self.load_tokenizer))  # while the pool starts
        while True:
            try:
                client = await ServeEngineClient.create(llm_server, app_name)
                break
            except Exception:  # the pool is not up yet, or a replica restarted: retry
                log.warning("waiting for the LLMServer pool", exc_info=True)
                await asyncio.sleep(1.0)
        self.attach(client, await tokenizer)
        log.info("ingress attached to the LLMServer pool (max_model_len %d)", client.max_model_len)
