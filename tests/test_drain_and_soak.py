"""The real `shoal serve` process under a short soak; its replica answering HTTP itself
(direct ingress: no Serve proxy), a killed replica's requests waiting for the next one, and a
killed engine ending its stream at once and its replica replaced; then SIGTERM with a stream in flight: it drains (the stream gets all its tokens, new requests
get 503, the probes say not ready), exits 0 within --shutdown-timeout, and leaves no process
behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from bench.soak import soak
from oracle import hf_greedy
from serving import (
    alive, check_sigterm_drain, descendants, free_port, kill_mid_stream, loopback_env, stream_errors,
    wait_answered, wait_process_ready,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SHUTDOWN_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def server(llama_ckpt, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("drain") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "shoal"), "serve", "--model-path", str(llama_ckpt),
             "--host", "127.0.0.1", "--port", str(port), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
             "--num-kv-blocks", "256"],
            cwd=REPO, env=loopback_env(), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)  # a process group of its own, as a service manager starts it
    url = f"http://127.0.0.1:{port}"
    wait_process_ready(url, proc, log, timeout=180)
    yield url, proc, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_short_soak_leaks_nothing(server):
    url, _, _ = server
    report = soak(url, n=150, concurrency=8, warmup=30)
    print("soak:", json.dumps(report))
    assert report["server_errors"] == 0 and report["statuses"].get("200", 0) == 150
    assert report["kv_blocks_in_use"] == 0 and report["running_after"] == 0
    assert report["rss_growth"] < 0.10


def processes(root: int) -> dict[int, str]:
    """pid -> command line of every process below root."""
    found = {}
    for pid in descendants(root):
        try:
            found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            pass
    return found


def test_the_replica_answers_http_without_serves_proxy(server):
    url, proc, _ = server
    names = processes(proc.pid).values()
    assert any("ModelServer" in name for name in names)
    assert not any("ProxyActor" in name for name in names)
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 200


def test_the_engine_runs_at_the_servers_priority(server):
    """Not at Ray's default nice 15 for workers (app/cli/serve.py: ray_settings_for_serving)."""
    _, proc, _ = server
    (scheduler,) = [pid for pid, name in processes(proc.pid).items() if "EngineActor" in name]
    nice = lambda pid: int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])  # noqa: E731
    assert nice(scheduler) == nice(proc.pid)


def test_the_engine_spins_briefly_at_openmp_barriers(server):
    """OPENMP_ENV reaches the engine's process: inherited from `shoal serve` through its Ray (no
    runtime env of its own, so it may take an idle worker: actors/executor/placement.py)."""
    _, proc, _ = server
    (scheduler,) = [pid for pid, name in processes(proc.pid).items() if "EngineActor" in name]
    environ = Path(f"/proc/{scheduler}/environ").read_bytes().split(b"\0")
    assert b"OMP_WAIT_POLICY=PASSIVE" in environ and b"GOMP_SPINCOUNT=10000" in environ


def test_serves_controller_checks_once_a_second(server):
    """Its loop's wake-ups stall the engine's threads on shared cores (ray_settings_for_serving);
    ten times a second only while the server starts (app/serving/controller_pace.py)."""
    _, proc, _ = server
    (controller,) = [pid for pid, name in processes(proc.pid).items() if "ServeController" in name]
    environ = Path(f"/proc/{controller}/environ").read_bytes().split(b"\0")
    assert b"RAY_SERVE_CONTROL_LOOP_INTERVAL_S=1" in environ
    assert b"RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH=app.serving.controller_pace.start_fast" in environ


def test_serves_controller_runs_fast_while_starting_then_at_its_set_pace(monkeypatch):
    from ray.serve._private import controller

    from app.serving.controller_pace import start_fast

    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "1")
    monkeypatch.setattr(controller, "CONTROL_LOOP_INTERVAL_S", 1.0)
    start_fast(starting_s=0.5)
    assert controller.CONTROL_LOOP_INTERVAL_S == 0.1
    deadline = time.monotonic() + 10
    while controller.CONTROL_LOOP_INTERVAL_S != 1.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert controller.CONTROL_LOOP_INTERVAL_S == 1.0


def test_a_killed_replica_s_requests_wait_for_the_next_one(server, llama_ckpt):
    """The port stays open in `shoal serve` while Serve replaces the replica: a request sent
    right after the kill is served by the new replica, not refused."""
    url, proc, _ = server
    (victim,) = [pid for pid, name in processes(proc.pid).items() if "ModelServer" in name]
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    ids = list(range(5, 25))
    r = httpx.post(f"{url}/v1/completions", timeout=240, json={
        "model": "", "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})  # waits in the backlog until the new replica is ready
    answered = time.monotonic() - killed
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == hf_greedy(llama_ckpt, ids, 8)
    assert not alive(victim)
    schedulers = [n for n in processes(proc.pid).values() if "EngineActor" in n]
    assert len(schedulers) == 1, schedulers  # the dead replica's engine went with it
    print(f"killed replica: first answer {answered:.1f} s after the kill")


def test_a_killed_engine_ends_its_stream_at_once_then_a_new_replica_answers(server, llama_ckpt):
    """SIGKILL the scheduler actor mid-stream: the replica's Unix socket to it closes, so the
    stream ends with an engine_dead error event at once; Serve's health check then replaces
    the replica, and the port answers again without an operator."""
    url, proc, log = server
    (victim,) = [pid for pid, name in processes(proc.pid).items() if "EngineActor" in name]
    rest, killed, detected = kill_mid_stream(url, victim, list(range(5, 15)))
    errors = stream_errors(rest)
    assert errors and errors[0]["code"] == "engine_dead", rest[-3:]
    assert rest[-1] == "data: [DONE]" and detected < 5
    ids = list(range(30, 50))
    assert wait_answered(url, ids, 8, log) == hf_greedy(llama_ckpt, ids, 8)
    assert not alive(victim)
    print(f"killed engine: stream ended {detected:.2f} s after the kill, "
          f"answering again {time.monotonic() - killed:.1f} s after it")


def test_sigterm_to_its_process_group_drains_the_stream_in_flight_then_exits_0(server):
    """SIGTERM to the whole process group (systemd's default KillMode, `kill -- -PGID`): Ray's
    daemons are in a session of their own (app/cli/own_session.py), so the server still drains
    and stops Ray itself, as for a SIGTERM to it alone (tests/test_serve_config_drain.py), instead
    of waiting 30-60 s for daemons the signal had killed and exiting 1."""
    url, proc, log = server
    _, exited = check_sigterm_drain(url, proc, log, tokens=300, timeout_s=SHUTDOWN_TIMEOUT_S, group=True)
    print(f"drain: exited 0 {exited:.1f} s after SIGTERM to the process group")
