"""The LoRA calls of a host of an AsyncEngine: the engine actor and the in-process client
answer them alike (light to import: the API imports it without the engine)."""
from __future__ import annotations

import asyncio


class AdapterCalls:
    """load / unload / list for the AsyncEngine at `self.engine`. The registry is thread-safe;
    reading an adapter's files runs off the event loop."""

    engine: object  # an AsyncEngine

    async def load_lora(self, name: str, path: str) -> None:
        await asyncio.to_thread(self.engine.engine.add_lora, name, path)

    async def unload_lora(self, name: str) -> None:
        self.engine.engine.remove_lora(name)

    async def list_loras(self) -> list[dict]:
        return [{"name": r.name, "path": r.path} for r in self.engine.engine.list_loras()]
