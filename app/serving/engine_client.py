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
                 priority: int = 0, whole: bool = False) -> AsyncIterator[RequestOutput]:
        """Delta outputs until finished. Raises ValueError for a request that can't be served.
        whole: the caller needs only the finished output, so deltas may arrive merged.
        Closing the iterator (or cancelling the task awaiting it) aborts the request and frees
        its KV blocks: there is no separate abort call (app/api/streams.py)."""

    async def stats(self) -> dict: ...

    async def metrics(self) -> list[dict]:
        """One engine metrics snapshot per replica (actors/metrics.py), for GET /metrics."""

    async def ready(self) -> bool: ...


class LocalEngineClient:
    """An AsyncEngine in this process."""

    def __init__(self, config: EngineConfig):
        from actors.async_engine import AsyncEngine  # torch: only where the engine runs
        self.engine = AsyncEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len

    def generate(self, prompt_token_ids, params, request_id, priority=0, whole=False):
        return self.engine.generate(prompt_token_ids, params, request_id, priority)  # no hops to save

    async def stats(self) -> dict:
        return {"replicas": [self.engine.stats()]}

    async def metrics(self) -> list[dict]:
        return [self.engine.metrics()]

    async def ready(self) -> bool:
        return self.engine.error is None

    def shutdown(self) -> None:
        self.engine.shutdown()
