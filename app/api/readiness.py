"""Ready means ready: until the replica pool can take a request, every route but the probes
answers 503 "still loading", /v1/models included, so a client that polls any route for a 200
can send its chat request the moment it gets one.

The probes answer for themselves: /healthz (liveness) is always 200, /readyz and /health say
what they see; /metrics stays open so Prometheus sees a loading server (HTTP counters). Ready once means ready for good at the gate (a dead engine shows as
engine_dead on the request instead), so only requests before the first ready pay for a check.
"""
from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.errors import not_ready
from app.api.middleware import route_path

log = logging.getLogger("shoal.api")

OPEN_WHILE_LOADING = {"/healthz", "/readyz", "/health", "/metrics"}


async def is_ready(state, cached: bool = True) -> bool:
    """Every model's engine client answers ready (cached: or did once). Remembers a ready answer."""
    if cached and getattr(state, "ready_seen", False):
        return True
    models = getattr(state, "models", [])
    try:
        ready = bool(models) and all(await asyncio.gather(*(m.client.ready() for m in models)))
    except Exception:  # a pool that can't answer yet is not ready
        log.warning("readiness check failed", exc_info=True)
        ready = False
    if ready:
        state.ready_seen = True
    return ready


class ReadinessGate:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and route_path(scope) not in OPEN_WHILE_LOADING \
                and not await is_ready(scope["app"].state):
            return await not_ready().response()(scope, receive, send)
        await self.app(scope, receive, send)
