"""Routes for operators and orchestrators: /health, /healthz, /readyz, /stats, /version.

/healthz and /readyz are the probes (no API key, never touch the engine more than needed);
/health and /stats report the replica pool from `client.stats()`.
"""
from __future__ import annotations

import asyncio
import sys
from importlib import metadata

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from app.api.readiness import is_ready

router = APIRouter(tags=["Operations"])


def shoal_version() -> str:
    try:
        return metadata.version("shoal")
    except metadata.PackageNotFoundError:  # running from a checkout that was never installed
        return "unknown"


@router.get("/healthz")
async def healthz():
    """The process is up (liveness): always 200."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request):
    """200 once the model is loaded and the engine can take requests, else 503."""
    if await is_ready(request.app.state, cached=False):
        return {"status": "ready"}
    return JSONResponse({"status": "not ready"}, status_code=503)


@router.get("/health")
async def health(request: Request):
    """The replica pool: 200 while every replica's engine is alive and the pool is ready."""
    stats = await pool_stats(request.app.state)
    if stats is None:
        return JSONResponse({"status": "loading", "replicas": 0, "alive": 0}, status_code=503)
    replicas = stats.get("replicas", [])
    alive = sum(r.get("engine_alive", True) is not False for r in replicas)  # None: starting
    ready = await is_ready(request.app.state, cached=False)
    status = "ok" if ready and alive == len(replicas) else "degraded" if ready and alive else \
        "unavailable"
    return JSONResponse({"status": status, "replicas": len(replicas), "alive": alive},
                        status_code=200 if status != "unavailable" else 503)


@router.get("/stats")
async def stats(request: Request):
    """`client.stats()`: per replica running/waiting requests, KV usage, tokens/s."""
    stats = await pool_stats(request.app.state)
    if stats is None:
        return JSONResponse({"replicas": []}, status_code=503)
    return JSONResponse(stats)


async def pool_stats(state) -> dict | None:
    """The replicas' stats (None: no engine attached yet); with several models each replica
    says which it serves."""
    models = getattr(state, "models", [])
    if not models:
        return None
    stats = await asyncio.gather(*(m.client.stats() for m in models))
    if len(models) == 1:
        return stats[0]
    return {"replicas": [{**r, "model": m.settings.served_model_name}
                         for m, st in zip(models, stats) for r in st.get("replicas", [])]}


@router.get("/version")
async def version():
    return {"version": shoal_version(), "python": sys.version.split()[0]}
