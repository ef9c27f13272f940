"""Helpers for tests that run Ray Serve apps on loopback."""
from __future__ import annotations

import socket
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 60.0) -> str:
    """Wait for `url`/readyz to answer 200; returns `url`.

    `serve.run` returns once every replica is constructed, but the ingress attaches to the
    LLMServer pool a moment later (until then the API answers 503, as designed)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} was not ready within {timeout:.0f} s")
        time.sleep(0.2)
