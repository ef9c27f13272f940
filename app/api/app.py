"""The HTTP API as one FastAPI app, independent of how it is hosted.

`build_api(settings)` makes the app; the host (uvicorn in tests and `shoal chat`, the Ray
Serve ingress in production) then calls `attach(app, client, tokenizer, settings)` to give
it an engine. Until the engine answers ready every route but the probes answers 503
(app/api/readiness.py).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from actors.worker.loader import resolve_model_path
from app.api import (
    lora_routes,
    metrics,
    openai_routes,
    ops_routes,
    responses_routes,
    scoring_routes,
    tokenize_routes,
    web,
)
from app.api.errors import install_error_handlers
from app.api.middleware import REQUEST_ID_HEADER, ApiKeyAuth, BodySizeLimit, RequestTracking
from app.api.readiness import ReadinessGate
from app.api.settings import ServerSettings
from app.protocol.model_parsers import with_model_parsers


def build_api(settings: ServerSettings) -> FastAPI:
    # strict_content_type=False: a JSON body without a Content-Type header is still parsed
    # (curl and quick scripts often leave it out).
    app = FastAPI(title="shoal", version=ops_routes.shoal_version(), strict_content_type=False,
                  description="An LLM inference server on Ray with an OpenAI-compatible API.")
    app.state.settings = settings
    app.state.http_metrics = metrics.HttpMetrics()  # counted by RequestTracking
    install_error_handlers(app)
    for module in (openai_routes, responses_routes, lora_routes, scoring_routes, tokenize_routes,
                   ops_routes, metrics, web):  # web: GET /
        app.include_router(module.router)
    # Added innermost first: CORS (outermost) answers preflights before auth, and puts its
    # headers on 401s too; RequestTracking wraps auth so refusals carry the id and get logged.
    app.add_middleware(BodySizeLimit)  # innermost: read a body only once it may be served
    app.add_middleware(ReadinessGate)  # a refused key says 401, not "loading"
    app.add_middleware(ApiKeyAuth)
    app.add_middleware(RequestTracking)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                           allow_methods=["*"], allow_headers=["*"],
                           expose_headers=[REQUEST_ID_HEADER])
    return app


def model_dir(model_path: str | None) -> Path | None:
    """The checkpoint directory, for the parsers it declares; None where there is none."""
    try:
        return resolve_model_path(model_path)
    except FileNotFoundError:
        return None


def attach(app: FastAPI, client, tokenizer, settings: ServerSettings) -> FastAPI:
    """Give the app its engine client (an EngineClient), tokenizer and settings."""
    if settings.max_model_len is None:
        settings = dataclasses.replace(settings, max_model_len=client.max_model_len)
    settings = with_model_parsers(settings, model_dir(settings.model_path))
    app.state.settings = settings
    app.state.tokenizer = tokenizer
    app.state.client = client
    app.state.ready_seen = False
    return app
