"""Helpers for tests that run servers on loopback: Ray Serve apps, `shoal serve` processes,
and the HTTP API over an in-process engine."""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx


# Ray's fixed default ports inside the kernel's ephemeral range: a port the OS hands out here
# may be taken by the Ray that the server under test starts a moment later (the dashboard
# agent's 52365 did, once).
RAY_DEFAULT_PORTS = {52365}  # the dashboard agent's HTTP port (--dashboard-agent-listen-port)


def free_port() -> int:
    """A port free now, between Ray's worker ports (10002-19999) and the kernel's ephemeral
    range: Ray's processes bind dozens of port-0 sockets while a server starts, and one of
    them took a port chosen from that range before Serve's proxy could bind it."""
    low, high = 20000, _ephemeral_start() - 1
    while True:
        port = random.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in RAY_DEFAULT_PORTS:
            return port


def _ephemeral_start() -> int:
    try:
        return max(20001, int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768


@contextlib.contextmanager
def api_in_thread(path, served_model_name: str, **engine_options):
    """The HTTP API (uvicorn on 127.0.0.1, in a thread) over an engine in this process; yields
    its base URL."""
    from actors.config import EngineConfig
    from app.api.app import attach, build_api
    from app.api.embedded import serve_in_thread
    from app.api.engine_client import LocalEngineClient
    from app.api.settings import ServerSettings

    client = LocalEngineClient(EngineConfig(model_path=str(path), **engine_options))
    settings = ServerSettings(model_path=str(path), served_model_name=served_model_name)
    try:
        with serve_in_thread(attach(build_api(settings), client, client.tokenizer, settings)) as url:
            yield url
    finally:
        client.shutdown()


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


def loopback_env(**extra) -> dict:
    return {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
            **extra}


def descendants(pid: int) -> set[int]:
    """Every live process below pid (from /proc), to check nothing outlives a shutdown."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_process_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    """Wait for a server process's `url`/readyz; fail with its log if it exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready in {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def outliving(family: set[int], wait: float = 30) -> set[int]:
    """The processes of `family` still alive after up to `wait` seconds."""
    deadline = time.monotonic() + wait
    while any(alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.1)  # /proc reads only
    return {p for p in family if alive(p)}


def stop_process(proc: subprocess.Popen) -> tuple[int, set[int]]:
    """SIGTERM, wait; the exit code and the processes that outlived it."""
    family = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    return code, outliving(family)


def check_sigterm_drain(url: str, proc: subprocess.Popen, log: Path, tokens: int,
                        timeout_s: float, group: bool = False) -> tuple[float, float]:
    """A stream of `tokens` in flight, then SIGTERM (with `group`, to the process's whole
    process group, as systemd and `kill -- -PGID` stop a service): probes and new requests get
    503, the stream completes with all its tokens, the process exits 0 and leaves no process
    behind. Returns (seconds to the stream's end, seconds to the exit) after the signal."""
    family = descendants(proc.pid)
    stop = (lambda: os.killpg(proc.pid, signal.SIGTERM)) if group else (lambda: proc.send_signal(signal.SIGTERM))
    streamed, signalled = check_drain(url, stop, tokens, timeout_s, log)
    code = proc.wait(timeout=timeout_s + 60)
    exited = time.monotonic() - signalled
    assert code == 0, log.read_text()[-3000:]
    assert exited < timeout_s + 30
    assert not outliving(family), "the server left processes behind"
    return streamed, exited


def check_drain(url: str, start_drain, tokens: int, timeout_s: float, log: Path) -> tuple[float, float]:
    """A stream of `tokens` in flight, then `start_drain()`: probes and new requests get 503
    and the stream completes with all its tokens. Returns (seconds from the drain's start to
    the stream's end, the monotonic time the drain started)."""
    body = {"model": "", "prompt": "The quick brown fox", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events, arrivals, started, ended = [], [], threading.Event(), {}

    def stream():
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        arrivals.append(time.monotonic())
                        started.set()
            ended["how"] = "complete"
        except httpx.HTTPError as exc:  # a cut stream
            ended["how"] = f"{type(exc).__name__}: {exc}"

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    start_drain()
    signalled = time.monotonic()
    deadline = signalled + 20  # the drain begins: probes say not ready
    while httpx.get(f"{url}/readyz", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    refused = httpx.post(f"{url}/v1/completions", json={"model": "", "prompt": "hi", "max_tokens": 2},
                         timeout=30)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert httpx.get(f"{url}/health", timeout=5).status_code == 503

    reader.join(timeout=timeout_s + 30)
    streamed = time.monotonic() - signalled
    # the stream was in flight when the drain began (a fast machine may finish it before the
    # probes above are done: what counts is that tokens kept coming after the signal)
    assert arrivals[-1] > signalled, "the stream ended before the drain began"
    assert ended.get("how") == "complete", ended
    assert not any("error" in e for e in events), events[-3:]
    finishes = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
    assert finishes[-1] == "length" and events[-1]["usage"]["completion_tokens"] == tokens  # all of them
    return streamed, signalled


def kill_mid_stream(url: str, victim: int, prompt: list[int], sig=signal.SIGKILL) -> tuple[list[str], float, float]:
    """Stream a long greedy completion and send `victim` `sig` (SIGSTOP: it hangs) once tokens
    flow: the SSE data lines that came after the signal, its monotonic time, and the seconds
    from it to the stream's end."""
    body = {"model": "", "prompt": prompt, "max_tokens": 480, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # tokens are flowing
        os.kill(victim, sig)
        killed = time.monotonic()
        rest = [line for line in lines if line.startswith("data: ")]
    return rest, killed, time.monotonic() - killed


def stream_errors(lines: list[str]) -> list[dict]:
    """The error objects among SSE data lines."""
    events = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    return [e["error"] for e in events if "error" in e]


def wait_answered(url: str, ids: list[int], max_tokens: int, log: Path, timeout: float = 240) -> list[int]:
    """A greedy completion's token ids, once the server answers 200 again: while Serve replaces
    a replica it may say 503 engine_dead or not_ready, or drop a connection the old one held."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
        except httpx.TransportError:
            r = None
        if r is not None and r.status_code == 200:
            return r.json()["choices"][0]["token_ids"]
        if r is not None:
            assert r.status_code == 503 and r.json()["error"]["code"] in ("engine_dead", "not_ready"), r.text
        assert time.monotonic() < deadline, f"not back after {timeout:.0f} s:\n{log.read_text()[-3000:]}"
        time.sleep(1)


def poll_until_200(url: str, proc, timeout: float = 120) -> list[int]:
    """GET url until it answers 200 (as clients poll /v1/models); the statuses seen before."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200:
                return seen
            seen.append(r.status_code)
            body = r.json() if r.headers.get("content-type") == "application/json" else {}
            if "error" in body:  # ours (the proxy answers in plain text)
                assert body["error"]["code"] == "not_ready"
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} never answered 200 (saw {sorted(set(seen))})")
