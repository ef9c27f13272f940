"""serve_configs/dev.yaml through `shoal serve --config` (the `serve run` path with a drain):
SIGTERM with a stream in flight stops admitting (503 shutting_down, probes 503), the stream gets
all its tokens, the process exits 0 and leaves no Ray process behind. Plain `serve run` cannot
do this (docs/operations.md); the fast tests check the command's one-line refusals."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from serving import alive, descendants, free_port, loopback_env

REPO = Path(__file__).resolve().parent.parent
STREAM_TOKENS = 500  # ~5-8 s of decoding for the bundled model on this machine


def shoal_serve(*args: str) -> list[str]:
    return [sys.executable, "-m", "app.cli", "serve", *args]


def checkout_env(**extra) -> dict:
    """Loopback Ray, and this checkout's code in the command and in every Ray worker."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return loopback_env(PYTHONPATH=path, **extra)


def test_a_serve_config_takes_no_other_options():
    done = subprocess.run(shoal_serve("--config", "serve_configs/dev.yaml", "--port", "9"), cwd=REPO,
                          env=checkout_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "is a Ray Serve config: set options under its applications' args" in done.stderr
    assert "--port" in done.stderr


def test_bad_application_args_fail_in_one_line_before_ray_starts(tmp_path):
    config = yaml.safe_load((REPO / "serve_configs/dev.yaml").read_text())
    config["applications"][0]["args"]["shutdown_timeout"] = -1
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(shoal_serve("--config", str(path)), cwd=REPO, env=checkout_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"shoal serve: error: {path}: application 'shoal': --shutdown-timeout must be >= 0, got -1.0"]


@pytest.mark.slow
def test_dev_yaml_drains_on_sigterm_then_exits_0(tmp_path):
    config = yaml.safe_load((REPO / "serve_configs/dev.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    timeout_s = config["applications"][0]["args"]["shutdown_timeout"]
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(shoal_serve("--config", str(path)), cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=checkout_env(RAY_ADDRESS="local", SHOAL_NUM_KV_BLOCKS="64"))
    url = f"http://127.0.0.1:{port}"
    family: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        family = descendants(proc.pid)

        body = {"model": "", "prompt": "The quick brown fox", "max_tokens": STREAM_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        events, started, ended = [], threading.Event(), {}

        def stream():
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            events.append(json.loads(line[6:]))
                            started.set()
                ended["how"] = "complete"
            except httpx.HTTPError as exc:  # a cut stream: what plain `serve run` does
                ended["how"] = f"{type(exc).__name__}: {exc}"

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()

        deadline = time.monotonic() + 20  # the drain begins: probes say not ready
        while httpx.get(f"{url}/readyz", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        refused = httpx.post(f"{url}/v1/completions", timeout=30,
                             json={"model": "", "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        assert reader.is_alive()  # the stream was in flight all along

        reader.join(timeout=timeout_s + 30)
        streamed = time.monotonic() - signalled
        code = proc.wait(timeout=timeout_s + 60)
        exited = time.monotonic() - signalled
        assert ended.get("how") == "complete", ended
        assert not any("error" in e for e in events), events[-3:]
        finishes = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
        assert finishes[-1] == "length"
        assert events[-1]["usage"]["completion_tokens"] == STREAM_TOKENS  # all of them
        assert code == 0, log.read_text()[-3000:]
        assert "drained in" in log.read_text()
        deadline = time.monotonic() + 30
        while any(alive(p) for p in family) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [p for p in family if alive(p)], "shoal serve --config left processes behind"
        print(f"drain: stream complete {streamed:.1f} s, exited 0 {exited:.1f} s after SIGTERM")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in family | descendants(proc.pid):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
