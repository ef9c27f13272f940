"""The HTTP API as one FastAPI app, independent of how it is hosted.

Every host builds it the same way, `ApiHost`: the app at once (until an engine answers ready
every route but the probes answers 503, app/api/readiness.py), then `attach` with the host's
EngineClient (app/api/engine_client.py). The hosts differ only in where they listen: a Serve
replica of the merged layout (app/serving/model_server.py, also on `shoal serve`'s own socket),
the split layout's ingress (app/serving/ingress.py), or uvicorn in a thread for commands that
bring their own model and for tests (app/api/embedded.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from actors.logs import setup_logging
from actors.worker.checkpoint_files import load_tokenizer, resolve_model_path, resolve_tokenizer_path
from app.api import (
    embedding_routes, lora_routes, metrics, openai_routes, ops_routes, responses_routes, scoring_routes,
    tokenize_routes, web,
)
from app.api.engine_client import EngineClient
from app.api.errors import install_error_handlers
from app.api.middleware import REQUEST_ID_HEADER, ApiKeyAuth, BodySizeLimit, RequestTracking
from app.api.readiness import ReadinessGate
from app.api.settings import ServerSettings
from app.protocol.generation_defaults import model_sampling_defaults
from app.protocol.model_parsers import with_model_parsers


def build_api(settings: ServerSettings) -> FastAPI:
    # strict_content_type=False: a JSON body without a Content-Type header is still parsed
    # (curl and quick scripts often leave it out).
    app = FastAPI(title="shoal", version=ops_routes.shoal_version(), strict_content_type=False,
                  description="An LLM inference server on Ray with an OpenAI-compatible API.")
    app.state.settings = settings
    app.state.http_metrics = metrics.HttpMetrics()  # counted by RequestTracking
    install_error_handlers(app)
    for module in (openai_routes, embedding_routes, responses_routes, lora_routes, scoring_routes,
                   tokenize_routes, ops_routes, metrics, web):  # web: GET /
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


class ApiHost:
    """The API app of one host, before and after it has an engine."""

    def __init__(self, settings: ServerSettings, log_level: str = "INFO"):
        setup_logging(log_level)
        self.settings = settings
        self.api = build_api(settings)

    def attach(self, client: EngineClient, tokenizer=None, settings: ServerSettings | None = None) -> FastAPI:
        """Serve a model with `client`; with `tokenizer`, else the client's, else the
        checkpoint's (the same files). settings: that model's (default: the host's); an app of
        several models is attached once per model, the first being the default."""
        tokenizer = tokenizer or getattr(client, "tokenizer", None) or self.load_tokenizer()
        return attach(self.api, client, tokenizer, settings or self.settings)

    def load_tokenizer(self):
        return load_tokenizer(resolve_tokenizer_path(self.settings.tokenizer, self.settings.model_path),
                              trust_remote_code=self.settings.trust_remote_code)

    def __serve_build_asgi_app__(self):  # Ray Serve's hook for `@serve.ingress()` hosts
        return self.api


@dataclass
class ServedModel:
    """One model the app serves: its engine client, tokenizer, settings (served name, parsers,
    limits) and generation_config.json sampling values."""
    client: EngineClient
    tokenizer: object
    settings: ServerSettings
    sampling_defaults: dict


def attach(app: FastAPI, client: EngineClient, tokenizer, settings: ServerSettings) -> FastAPI:
    """Give the app a model to serve (`app.state.models`): its engine client, tokenizer and
    settings. The first model attached is the default one: it serves requests that name no
    model, and its settings are the app's own (`app.state.settings`: keys, limits)."""
    if settings.max_model_len is None:
        settings = dataclasses.replace(settings, max_model_len=client.max_model_len)
    checkpoint = model_dir(settings.model_path)
    if settings.chat_template is not None:  # --chat-template, in place of the tokenizer's
        tokenizer.chat_template = settings.chat_template
    settings = with_model_parsers(settings, checkpoint)
    model = ServedModel(client, tokenizer, settings, model_sampling_defaults(checkpoint, settings.generation_config))
    app.state.models = getattr(app.state, "models", []) + [model]
    if len(app.state.models) == 1:
        app.state.settings = settings
    app.state.ready_seen = False
    return app
