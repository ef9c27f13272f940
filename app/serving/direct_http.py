"""Direct ingress: the ModelServer replica answers HTTP on the user's port itself (uvicorn in
the replica's event loop), instead of behind Ray Serve's HTTP proxy.

Through the proxy every request crosses one more process, about 10 ms of CPU on each side of
the hop (the proxy, and the replica's half of Serve's ASGI relay), and every stream chunk too:
on cores that also run the engine, that is most of the time-to-first-token tax and of the
throughput lost to serving (docs/benchmarks.md, "Serving"). Ray Serve 2.60's own direct
ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS) gives each replica a port from 30000-31000 for an
external load balancer; `shoal serve` users call the --port they gave.

So `shoal serve` (the driver) binds host:port and hands the listening socket to its replica
over a Unix socket (SCM_RIGHTS). The driver keeps its copy: while Serve replaces a dead
replica, connections wait in the listen backlog instead of being refused, and the new replica
takes them. Serve still owns the replica (placement, health checks, restarts, the dashboard);
it no longer sees the HTTP traffic, so this is for one replica on the driver's machine.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import tempfile
import threading

import uvicorn

log = logging.getLogger("shoal.server")

BACKLOG = 2048


class ListeningSocket:
    """The driver's side: host:port bound and listening, lent to any local process that
    connects to `path` (a Unix socket in a directory only this user can enter)."""

    def __init__(self, host: str, port: int):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
        self.sock.listen(BACKLOG)
        self.dir = tempfile.mkdtemp(prefix="shoal-http-")  # mode 0700
        self.path = os.path.join(self.dir, "listener")
        self.lender = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.lender.bind(self.path)
        self.lender.listen(8)
        threading.Thread(target=self._lend, name="shoal-http-lender", daemon=True).start()

    def _lend(self) -> None:
        while True:
            try:
                conn, _ = self.lender.accept()
            except OSError:  # closed
                return
            with conn:
                socket.send_fds(conn, [b"1"], [self.sock.fileno()])

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes the lending thread's accept (close alone does not)
            self.lender.shutdown(socket.SHUT_RDWR)
        for sock in (self.lender, self.sock):
            sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self.dir)


def borrow(path: str) -> socket.socket:
    """The replica's side: a copy of the driver's listening socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        _, (fd,), _, _ = socket.recv_fds(conn, 1, 1)
    os.set_inheritable(fd, False)  # not into processes the replica starts
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    return sock


class DirectHTTP:
    """uvicorn serving `app` on a borrowed listening socket, in the running event loop."""

    def __init__(self, app, listener_path: str):
        self.listener_path = listener_path
        self.server = uvicorn.Server(uvicorn.Config(
            app, lifespan="off", access_log=False, log_config=None, log_level="warning",
            timeout_keep_alive=75))  # longer than common client pools' idle timeouts
        # The replica's thread is not the main thread, and Ray owns the process's signals.
        self.server.capture_signals = contextlib.nullcontext
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        sock = borrow(self.listener_path)
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self.task.done():  # serve() failed before it accepted anything
                self.task.result()
            await asyncio.sleep(0.01)
        log.info("answering HTTP at %s (direct ingress)", "%s:%d" % sock.getsockname()[:2])

    async def stop(self) -> None:
        """Stop accepting (the driver's copy of the socket stays open) and let open
        connections finish (the drain has ended their requests)."""
        if self.task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.task, timeout=10)
        self.task = None
