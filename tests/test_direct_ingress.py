"""Direct ingress (app/serving/direct_http.py): `shoal serve` binds the port and lends the
listening socket to its replica, which answers HTTP without Serve's proxy. Here the pieces
in one process and the command's refusals; tests/test_drain_and_soak.py runs the real
`shoal serve` with it (no proxy process, a killed replica's requests wait and are served).
"""
from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from serving import free_port, loopback_env

from app.serving.direct_http import DirectHTTP, ListeningSocket

REPO = Path(__file__).resolve().parent.parent


def hello_app() -> FastAPI:
    app = FastAPI()

    @app.get("/hello")
    def hello():
        return {"hello": "world"}

    return app


def test_a_borrowed_socket_serves_and_the_lender_keeps_listening():
    port = free_port()
    listener = ListeningSocket("127.0.0.1", port)
    url = f"http://127.0.0.1:{port}/hello"

    async def serve_once() -> dict:
        http = DirectHTTP(hello_app(), listener.path)
        await http.start()
        try:
            async with httpx.AsyncClient() as client:
                return (await client.get(url, timeout=10)).json()
        finally:
            await http.stop()

    try:
        assert asyncio.run(serve_once()) == {"hello": "world"}
        # The replica stopped: the lender's copy still accepts (into the backlog), so a
        # connection made while a replica is replaced waits for the next one.
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        assert asyncio.run(serve_once()) == {"hello": "world"}  # a second replica borrows it
    finally:
        listener.close()
    assert not Path(listener.dir).exists()  # the lending socket's folder goes too
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        raise AssertionError("the port still listens after close()")
    except ConnectionRefusedError:
        pass


def test_a_port_in_use_is_refused_in_one_line_before_ray_starts(llama_ckpt):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        start = time.monotonic()
        done = subprocess.run(
            [str(Path(sys.executable).parent / "shoal"), "serve", "--model-path", str(llama_ckpt),
             "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO, env=loopback_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"shoal serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"]
    assert time.monotonic() - start < 30  # no Ray started


def test_direct_ingress_needs_one_merged_replica(llama_ckpt):
    done = subprocess.run(
        [str(Path(sys.executable).parent / "shoal"), "serve", "--model-path", str(llama_ckpt),
         "--direct-ingress", "--num-replicas", "2", "--port", str(free_port())],
        cwd=REPO, env=loopback_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].endswith(
        "--direct-ingress needs one model replica in the merged layout "
        "(no autoscaling, no --serve-layout split)")


def test_serve_run_refuses_direct_ingress(llama_ckpt):
    from app.config import ConfigError
    from app.serving.builder import build_app

    with pytest.raises(ConfigError, match="^direct_ingress is a `shoal serve` option"):
        build_app({"model_path": str(llama_ckpt), "direct_ingress": True})


def test_direct_ingress_needs_the_local_ray(llama_ckpt):
    done = subprocess.run(
        [str(Path(sys.executable).parent / "shoal"), "serve", "--model-path", str(llama_ckpt),
         "--direct-ingress", "--address", "127.0.0.1:1", "--port", str(free_port())],
        cwd=REPO, env=loopback_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "shoal serve: error: --direct-ingress lends this process's socket to the replica: it "
        "needs the local Ray that shoal serve starts, not --address"]
