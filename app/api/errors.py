"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Routes raise `ApiError`; engine refusals map to a status by `engine_error`; pydantic and
routing errors get the same body from the handlers `install_error_handlers` registers.
Nothing here ever puts a traceback in a body.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.errors import (
    EngineDeadError, QueueFullError, RequestFailedError, ShuttingDownError, UnknownAdapterError,
)
from app.protocol.models import error_body, validation_error_body

RETRY_AFTER_S = "1"  # queue-full clients retry soon: the queue drains at the engine's pace

STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 429: "rate_limit_error", 499: "client_closed_request",
                500: "internal_error", 503: "service_unavailable"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = STATUS_TYPES.get(self.status, "invalid_request_error")
        return error_body(self.message, self.param, self.code, type=kind)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(exc: ValueError, param: str | None = None) -> ApiError:
    """A 400 from a refusal (RequestError names its field; template errors name none)."""
    return ApiError(400, clean_message(exc), getattr(exc, "param", None) or param,
                    getattr(exc, "code", None))


def unknown_model(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


def not_ready() -> ApiError:
    return ApiError(503, "The model is still loading; retry shortly.", code="not_ready",
                    headers={"Retry-After": RETRY_AFTER_S})


def unauthorized() -> ApiError:
    return ApiError(401, "Invalid or missing API key: send `Authorization: Bearer <key>`.",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def internal_error(request_id: str) -> ApiError:
    return ApiError(500, f"Internal server error (request id {request_id}); see the server log.",
                    code="internal_error")


def engine_error(exc: BaseException) -> ApiError | None:
    """The HTTP error for an engine refusal, or None for an unexpected failure (a bug)."""
    if isinstance(exc, QueueFullError):
        return ApiError(429, f"The server is busy: {clean_message(exc)}", code="queue_full",
                        headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(exc, EngineDeadError):
        return ApiError(503, clean_message(exc), code="engine_dead")
    if isinstance(exc, ShuttingDownError):
        return ApiError(503, clean_message(exc), code="shutting_down",
                        headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(exc, RequestFailedError):  # the engine logged it; the others go on
        return ApiError(500, clean_message(exc), code="internal_error")
    if isinstance(exc, UnknownAdapterError):  # `model` named an adapter the engine lacks
        return ApiError(404, clean_message(exc), "model", "model_not_found")
    if isinstance(exc, ValueError):  # a request the engine can never serve (numbers inside)
        return bad_request(exc)
    return None


def clean_message(exc: BaseException) -> str:
    # Ray wraps a remote exception with the remote traceback in its text; `cause` is the
    # original exception, whose message is all a client should see.
    cause = getattr(exc, "cause", None)
    return str(cause if isinstance(cause, BaseException) else exc)


# --------------------------------------------------------------------------- handlers

class _BodyErrors:
    """FastAPI's validation errors with the leading "body"/"query"/"path" dropped from locations,
    so `validation_error_body` names the field exactly as the client spelled it."""

    def __init__(self, errors: list[dict]):
        self._errors = [{**e, "loc": tuple(e.get("loc", ()))[1:]} for e in errors]

    def errors(self) -> list[dict]:
        return self._errors


def validation_response(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors()) or [{"loc": ("body",), "msg": "invalid request"}]
    bad_json = [e for e in errors if e.get("type") == "json_invalid"]
    if bad_json:
        reason = bad_json[0].get("ctx", {}).get("error", "could not parse")
        return ApiError(400, f"Invalid JSON body: {reason}", code="invalid_json").response()
    body = validation_error_body(_BodyErrors(errors))
    whole_body_refused = any(e.get("type") == "value_error" for e in errors)  # a model validator
    if body["error"]["param"] is None and not whole_body_refused:  # missing, or not an object
        body["error"]["message"] = ("Invalid request body (send a JSON object): "
                                    f"{body['error']['message']}")
    return JSONResponse(body, status_code=400)


def http_exception_response(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Routing errors (404 unknown path, 405 wrong method) in the OpenAI shape."""
    error = ApiError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
    return error.response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, lambda request, exc: exc.response())
    app.add_exception_handler(RequestValidationError, validation_response)
    app.add_exception_handler(StarletteHTTPException, http_exception_response)
