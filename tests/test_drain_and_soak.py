"""The real `shoal serve` process under a short soak, then SIGTERM with a stream in flight:
it drains (the stream gets all its tokens, new requests get 503, the probes say not ready),
exits 0 within --shutdown-timeout, and leaves no process behind."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from serving import check_sigterm_drain, free_port, loopback_env, wait_process_ready

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


def test_sigterm_drains_the_stream_in_flight_then_exits_0(server):
    url, proc, log = server
    _, exited = check_sigterm_drain(url, proc, log, tokens=300, timeout_s=SHUTDOWN_TIMEOUT_S)
    print(f"drain: exited 0 {exited:.1f} s after SIGTERM")
