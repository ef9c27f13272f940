"""What the HTTP API needs from an engine (`EngineClient`), and the in-process one.

Every host of the API implements it: the merged layout's replica (its own engine actor,
app/serving/model_server.py), the split layout's ingress (the LLMServer pool through a Serve
handle, app/serving/llm_server.py), and `LocalEngineClient` (an AsyncEngine in this process:
`shoal chat --model-path`, the demo-model evaluation, tests of the HTTP layer).
"""
from __future__ import annotations

from typing import AsyncIterator, Protocol

from actors.config import EngineConfig
from actors.engine.lora_calls import AdapterCalls
from actors.outputs import RequestOutput
from actors.request import EngineRequest


class EngineClient(Protocol):
    max_model_len: int
    lora_enabled: bool  # False: the base model only

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The request's outputs until finished (deltas, or one finished output for a `whole`
        request). An embedding request (`request.pooling` set) takes the same path, its last
        output carrying the `embedding`, so every host serves /v1/embeddings as it is. Raises
        ValueError for a request that can't be served (UnknownAdapterError for an adapter it
        lacks). Closing the iterator (or cancelling the task awaiting it) aborts the request
        and frees its KV blocks: there is no separate abort call (app/api/streams.py)."""

    async def load_lora(self, name: str, path: str) -> None:
        """Register an adapter on every replica; ValueError if it can't be served."""

    async def unload_lora(self, name: str) -> None:
        """Unregister an adapter everywhere; UnknownAdapterError if no replica has it."""

    async def list_loras(self) -> list[dict]:
        """{"name", "path"} of every registered adapter."""

    async def stats(self) -> dict: ...

    async def metrics(self) -> list[dict]:
        """One engine metrics snapshot per replica (actors/engine/metrics.py), for GET /metrics."""

    async def ready(self) -> bool: ...


class LocalEngineClient(AdapterCalls):
    """An AsyncEngine in this process."""

    def __init__(self, config: EngineConfig):
        from actors.engine.async_engine import AsyncEngine  # torch: only where the engine runs
        self.engine = AsyncEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.lora_enabled = self.engine.lora_enabled

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(request)

    async def stats(self) -> dict:
        return {"replicas": [self.engine.stats()]}

    async def metrics(self) -> list[dict]:
        return [self.engine.metrics()]

    async def ready(self) -> bool:
        return self.engine.error is None

    def shutdown(self) -> None:
        self.engine.shutdown()
