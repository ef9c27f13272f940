"""serve_configs/dev.yaml through `shoal serve --config` (the `serve run` path with a drain):
SIGTERM with a stream in flight stops admitting (503 shutting_down, probes 503), the stream gets
all its tokens, the process exits 0 and leaves no Ray process behind. Plain `serve run` cannot
do this (docs/operations.md); the fast tests check the command's one-line refusals."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from serving import alive, check_sigterm_drain, descendants, free_port, loopback_env, wait_process_ready

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
        wait_process_ready(url, proc, log, timeout=180)
        family = descendants(proc.pid)
        streamed, exited = check_sigterm_drain(url, proc, log, STREAM_TOKENS, timeout_s)
        assert "drained in" in log.read_text()
        print(f"drain: stream complete {streamed:.1f} s, exited 0 {exited:.1f} s after SIGTERM")
    finally:
        if proc.poll() is None:  # its own session: kill Ray and all with it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in family:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
