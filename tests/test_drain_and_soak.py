"""The real `shoal serve` process under a short soak, then SIGTERM with a stream in flight:
it drains (the stream gets all its tokens, new requests get 503, the probes say not ready),
exits 0 within --shutdown-timeout, and leaves no process behind."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serving import alive, descendants, free_port, loopback_env

from bench.soak import soak

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
            cwd=REPO, env=loopback_env(), stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(1)
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


def test_sigterm_drains_the_stream_in_flight_then_exits_0(server):
    url, proc, log = server
    family = descendants(proc.pid)
    body = {"model": "", "prompt": "The quick brown fox", "max_tokens": 300, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events, started = [], threading.Event()

    def stream():
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    events.append(event)
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()

    deadline = time.monotonic() + 20  # the drain begins: probes say not ready
    while httpx.get(f"{url}/readyz", timeout=5).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    refused = httpx.post(f"{url}/v1/completions", json={"model": "", "prompt": "hi", "max_tokens": 2},
                         timeout=30)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert httpx.get(f"{url}/health", timeout=5).status_code == 503

    reader.join(timeout=SHUTDOWN_TIMEOUT_S + 30)
    code = proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 60)
    drained = time.monotonic() - signalled
    assert not any("error" in e for e in events), events[-3:]
    finishes = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
    assert finishes[-1] == "length" and events[-1]["usage"]["completion_tokens"] == 300  # all of them
    assert code == 0, log.read_text()[-3000:]
    assert drained < SHUTDOWN_TIMEOUT_S + 30
    deadline = time.monotonic() + 30
    while any(alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in family if alive(p)], "shoal serve left processes behind"
    print(f"drain: exited 0 {drained:.1f} s after SIGTERM")
