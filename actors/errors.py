"""Errors the engine reports to its callers (torch-free, so the ingress can import them)."""


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can be served any more."""


class QueueFullError(RuntimeError):
    """More requests are waiting than --max-queued-requests allows; retry later."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (a bug); the engine and other requests go on."""


class ShuttingDownError(RuntimeError):
    """The server is draining: it takes no new requests (and, past the drain, ends the rest)."""


class UnknownAdapterError(ValueError):
    """A request or an unload names a LoRA adapter the engine does not have (HTTP 404).

    A ValueError, so every path that refuses a request refuses this one too."""
