"""Pure ASGI middleware (no BaseHTTPMiddleware, which buffers and hides client disconnects).

`RequestTracking`: every request gets an id (X-Request-Id honoured or generated), echoed in
the response and written in one structured log line (app/api/request_log.py), and its status
is counted for GET /metrics; any unhandled exception becomes a 500 without a traceback.
`ApiKeyAuth`: the bearer token check, before any body is parsed.
Both read the live settings from `app.state` so `attach` may replace them.
"""
from __future__ import annotations

import hmac
import logging
import re
import time
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import ApiError, internal_error, unauthorized
from app.api.metrics import route_label
from app.api.request_log import logfmt

log = logging.getLogger("shoal.api")

REQUEST_ID_HEADER = "X-Request-Id"
# Ids go into headers and log lines: keep them printable, short and free of separators.
VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# Probes and docs stay open: orchestrators and browsers reach them without the key.
# Orchestrators and Prometheus poll these every few seconds: their access lines go to DEBUG.
PROBE_PATHS = {"/healthz", "/readyz", "/health", "/metrics"}
# /metrics too: Prometheus scrapers rarely carry the API key (vLLM leaves it open as well).
OPEN_PATHS = {"/healthz", "/readyz", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json",
              "/metrics"}
OPEN_PATHS.add("/")  # the web chat page (app/api/web): its JS sends the key its user types


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def route_path(scope: Scope) -> str:
    """The path inside the app (behind a Serve route prefix the root path comes first)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


class RequestTracking:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = Headers(scope=scope).get(REQUEST_ID_HEADER, "")
        request_id = given if VALID_REQUEST_ID.fullmatch(given) else new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id  # request.state.request_id
        status, start = [0], time.perf_counter()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("%s %s %s failed", request_id, scope["method"], route_path(scope))
            if not status[0]:  # nothing sent yet: answer without the traceback
                await internal_error(request_id).response()(scope, receive, send_with_id)
        finally:
            self.record(scope, request_id, status[0], time.perf_counter() - start)

    @staticmethod
    def record(scope: Scope, request_id: str, status: int, seconds: float) -> None:
        """The request's log line and its count by route and status."""
        app_state = scope["app"].state
        model = app_state.settings.served_model_name
        app_state.http_metrics.record(model, route_label(scope), status)
        path = route_path(scope)
        summary = scope["state"].get("engine_summary")  # set by routes that ran the engine
        fields = {"request_id": request_id, "method": scope["method"], "path": path,
                  "status": status, "total_ms": 1000 * seconds,
                  **(summary.fields() if summary is not None else {})}
        quiet = path in PROBE_PATHS or app_state.settings.disable_log_requests
        log.log(logging.DEBUG if quiet else logging.INFO, "request %s", logfmt(fields))


class BodySizeLimit:
    """413 for a request body over --max-request-bytes: by its Content-Length before reading;
    a body without one (chunked) is read here, up to the limit, then handed on."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        limit = scope["app"].state.settings.max_request_bytes
        declared = Headers(scope=scope).get("content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > limit:
                return await too_large(limit).response()(scope, receive, send)
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                return await too_large(limit).response()(scope, receive, send)
        await self.app(scope, _replay([{"type": "http.request", "body": body}], receive), send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    async def replayed() -> Message:
        return messages.pop(0) if messages else await receive()
    return replayed


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is over this server's limit of {limit} bytes.",
                    code="request_too_large")


class ApiKeyAuth:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.allowed(scope):
            return await unauthorized().response()(scope, receive, send)
        await self.app(scope, receive, send)

    @staticmethod
    def allowed(scope: Scope) -> bool:
        key = scope["app"].state.settings.api_key
        if not key or route_path(scope) in OPEN_PATHS:
            return True
        given = Headers(scope=scope).get("authorization", "")
        # Constant-time comparison: the key must not leak through response timing.
        return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())
