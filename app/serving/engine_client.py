"""What the HTTP layer needs from an engine, and the in-process implementation of it.

The ingress talks to an `EngineClient`: in production the Ray Serve replica pool (see
app/serving/llm_server.py), in `shoal chat --model-path` and in tests of the HTTP layer an
in-process AsyncEngine. Both stream delta `RequestOutput`s.
"""
from __future__ import annotations

from typing import AsyncIterator, Protocol

from actors.config import EngineConfig
from actors.outputs import RequestOutput
from actors.sampling_params import SamplingParams


class EngineClient(Protocol):
    max_model_len: int

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 priority: int = 0, lora: str | None = None, whole: bool = False) -> AsyncIterator[RequestOutput]:
        """Delta outputs until finished. Raises ValueError for a request that can't be served
        (UnknownAdapterError for an adapter `lora` the engine lacks). whole: the caller needs
        only the finished output, so deltas may arrive merged. Closing the iterator (or
        cancelling the task awaiting it) aborts the request and frees its KV blocks: there is
        no separate abort call (app/api/streams.py)."""

    # LoRA adapters (optional: a client without `lora_enabled` serves the base model only)
    lora_enabled: bool

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


class LocalEngineClient:
    """An AsyncEngine in this process."""

    def __init__(self, config: EngineConfig):
        from actors.engine.async_engine import AsyncEngine  # torch: only where the engine runs
        self.engine = AsyncEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.lora_enabled = self.engine.lora_enabled

    def generate(self, prompt_token_ids, params, request_id, priority=0, lora=None, whole=False):
        return self.engine.generate(prompt_token_ids, params, request_id, priority, lora=lora)  # no hops to save

    async def load_lora(self, name: str, path: str) -> None:
        await self.engine.load_lora(name, path)

    async def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    async def list_loras(self) -> list[dict]:
        return self.engine.list_loras()

    async def stats(self) -> dict:
        return {"replicas": [self.engine.stats()]}

    async def metrics(self) -> list[dict]:
        return [self.engine.metrics()]

    async def ready(self) -> bool:
        return self.engine.error is None

    def shutdown(self) -> None:
        self.engine.shutdown()
