"""The split layout's ingress deployment: the FastAPI app of app/api/app.py, hosted by Ray
Serve in front of the LLMServer pool (the merged layout's ModelServer hosts it in each model
replica instead: app/serving/model_server.py).

It validates, authenticates, renders chat templates and tokenizes in its own replica (so
that CPU work stays off the engine loop and scales with ingress replicas), then streams
engine outputs from the LLMServer pool through a deployment handle. An application of several
models has one pool per model; a request's `model` picks it (app/api/request_context.py).
"""
from __future__ import annotations

import asyncio
import logging

from ray import serve

from actors.worker.checkpoint_files import engine_tokenizer, load_declared_tokenizer, resolve_tokenizer_path
from app.api.app import ApiHost
from app.api.settings import ServerSettings
from app.serving.llm_server import ServeEngineClient

log = logging.getLogger("shoal.ingress")


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress(ApiHost):
    async def __init__(self, llm_servers: list, settings: list[ServerSettings], log_level: str = "INFO"):
        """llm_servers: one LLMServer pool per model, `settings` the API settings of each (the
        first model's serve requests that name no model, and set what is not per model)."""
        super().__init__(settings[0], log_level)
        # Attach once every pool answers: until then the API says 503 and /healthz still works.
        app_name = serve.get_replica_context().app_name
        self._attaching = asyncio.create_task(self._attach_all(list(zip(llm_servers, settings)), app_name))

    async def _attach_all(self, models: list, app_name: str) -> None:
        # The tokenizers their files declare load while the pools start, in one thread
        # (transformers imported from two threads at once can fail halfway); each is kept if the
        # pool's engines chose the same class (actors/worker/checkpoint_files.py).
        try:
            paths = [resolve_tokenizer_path(s.tokenizer, s.model_path) for _, s in models]
            declared = asyncio.create_task(asyncio.to_thread(lambda: [load_declared_tokenizer(p) for p in paths]))
            clients = await asyncio.gather(*(self._connect(pool, s.served_model_name, app_name, len(models) > 1)
                                             for pool, s in models))
            guesses = await declared
            tokenizers = await asyncio.to_thread(lambda: [
                engine_tokenizer(path, client.tokenizer_class, guess, settings.trust_remote_code)
                for path, client, guess, (_, settings) in zip(paths, clients, guesses, models)])
            for client, tokenizer, (_, settings) in zip(clients, tokenizers, models):
                self.attach(client, tokenizer, settings)
                log.info("ingress attached to the LLMServer pool of %s (max_model_len %d)",
                         settings.served_model_name, client.max_model_len)
        except Exception:  # the API stays "loading" (503): say why
            log.exception("the ingress could not attach to its LLMServer pools")
            raise

    @staticmethod
    async def _connect(llm_server, name: str, app_name: str, own_pool: bool) -> ServeEngineClient:
        """The engine client of one model's pool, once it answers."""
        while True:
            try:
                return await ServeEngineClient.create(llm_server, app_name, own_pool)
            except Exception:  # the pool is not up yet, or a replica restarted: retry
                log.warning("waiting for the LLMServer pool of %s", name, exc_info=True)
                await asyncio.sleep(1.0)
