"""An in-process API server for commands that bring their own model (`shoal chat --model-path`,
the demo-model evaluation) and for tests.

The HTTP API runs on uvicorn in a thread, on a free 127.0.0.1 port (over a LocalEngineClient,
app/api/engine_client.py, in those commands): they then talk to it with the same OpenAI
client they use for a remote server, so there is one code path for both, and nothing listens
beyond loopback.
"""
from __future__ import annotations

import contextlib
import socket
import threading
import time


@contextlib.contextmanager
def serve_in_thread(app, startup_timeout: float = 60.0):
    """Serve an ASGI `app` on a free loopback port in a daemon thread; yields the base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # port 0: the OS picks a free one, no race with other servers
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name="shoal-embedded-http")
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError("the embedded HTTP server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
