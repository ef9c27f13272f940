"""What an EngineClient does on every replica of a Serve application at once (LoRA adapters,
/stats, /metrics), through the replicas' named scheduler actors (app/serving/schedulers.py)
rather than the one replica a routed call would land on."""
from __future__ import annotations

import asyncio
import logging

from app.serving.replica import unwrap
from app.serving.schedulers import scheduler_actors

log = logging.getLogger("shoal.server")


class AppReplicas:
    """Base of the Serve EngineClients; `app_name` is the application's, `deployment` the
    model pool's where the application serves several models (None: every replica)."""

    app_name: str
    deployment: str | None = None

    # A replica started later (autoscaling, a restart) has only the --lora-modules adapters.
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

    async def stats(self) -> dict:
        """Every replica's scheduler stats, not just the one a call lands on."""
        actors = await asyncio.to_thread(scheduler_actors, self.app_name, self.deployment)
        results = await asyncio.gather(*(_answer(a.stats) for a in actors.values()),
                                       return_exceptions=True)
        return {"replicas": [{"replica": replica, **_stats_or_error(r)}
                             for replica, r in zip(actors, results)]}

    async def metrics(self) -> list[dict]:
        """Every replica's engine metrics snapshot (actors/engine/metrics.py), for GET /metrics."""
        actors = await asyncio.to_thread(scheduler_actors, self.app_name, self.deployment)
        results = await asyncio.gather(*(_answer(a.metrics) for a in actors.values()),
                                       return_exceptions=True)
        for replica, r in zip(actors, results):
            if isinstance(r, Exception):  # a replica starting or gone: the others still count
                log.warning("no metrics from replica %s: %s", replica, str(unwrap(r)).splitlines()[0])
        return [r for r in results if not isinstance(r, Exception)]

    async def _on_every_replica(self, method: str, *args) -> list:
        """Each live replica's result of scheduler.method(*args), or its (unwrapped) exception."""
        actors = await asyncio.to_thread(scheduler_actors, self.app_name, self.deployment)
        results = await asyncio.gather(*(getattr(a, method).remote(*args) for a in actors.values()),
                                       return_exceptions=True)
        return [unwrap(r) if isinstance(r, Exception) else r for r in results]


# A replica that is still loading its model answers nothing until it is loaded: /stats and
# /metrics show it as not answering rather than wait for it.
QUICK_ANSWER_S = 2.0


async def _answer(method):
    try:
        return await asyncio.wait_for(method.remote(), QUICK_ANSWER_S)
    except asyncio.TimeoutError:
        raise TimeoutError(f"no answer within {QUICK_ANSWER_S:g} s (starting, or busy)") from None


def _stats_or_error(result) -> dict:
    """A replica's stats; one that did not answer in time is not known dead (engine_alive None)."""
    if isinstance(result, TimeoutError):
        return {"engine_alive": None, "error": str(result)}
    if isinstance(result, Exception):
        return {"engine_alive": False, "error": str(unwrap(result)).splitlines()[0]}
    return result
