"""The background process that compiles a runner's decode step (actors/worker/compiled_decode.py).

`BackgroundCompile` starts `python -m actors.worker.compile_job JOB PID`, where JOB is a pickle of
the engine config, the model spec, the block size and the artifact's path. The job builds the
model without reading its weights (tracing needs only their shapes; the untouched pages cost
no memory), a KV pool of three blocks, traces, compiles and saves the artifact, at the lowest
CPU priority (SCHED_IDLE) and on one thread, so the engine's steps keep the cores. It exits when its parent
(PID) does; the parent kills it when it goes away first. It keeps the folder to the KEEP newest
artifacts.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

log = logging.getLogger("shoal.runner")
KEEP = 16  # compiled steps kept in the cache folder
FRESH_S = 3600.0  # ... and any younger than this: an engine may not have loaded it yet


class BackgroundCompile:
    """One compile job of this process: `done()` polls it (a syscall), `wait()` blocks."""

    def __init__(self, config, spec, block_size: int, path: Path):
        self.path, self.started = path, time.perf_counter()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, self.job = tempfile.mkstemp(prefix="decode-job-", suffix=".pkl", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            pickle.dump((config, spec, block_size, path), f)
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "actors.worker.compile_job", self.job, str(os.getpid())],
                                     stdin=subprocess.DEVNULL, stdout=self.stderr, stderr=subprocess.STDOUT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        weakref.finalize(self, _stop, self.proc, self.job)  # also at interpreter exit
        log.info("compiling the decode step in the background (pid %d); decoding eagerly until it is ready",
                 self.proc.pid)

    def done(self) -> bool:
        return self.proc.poll() is not None

    def wait(self, timeout: float | None = None) -> None:
        self.proc.wait(timeout)

    def failure(self) -> str | None:
        """None when the artifact is there, else why not (the job's last output)."""
        if self.proc.returncode == 0 and self.path.exists():
            return None
        if self.proc.returncode < 0:  # killed: the worker's shutdown, or a user
            return f"the job was stopped by signal {-self.proc.returncode}"
        self.stderr.seek(0)
        lines = [line for line in self.stderr.read().decode(errors="replace").splitlines() if line.strip()]
        return f"exit {self.proc.returncode}: " + " | ".join(lines[-3:])[-300:]

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started


def _stop(proc: subprocess.Popen, job: str) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    Path(job).unlink(missing_ok=True)


def _exit_with_parent(parent: int) -> None:
    """Exit once `parent` (the engine's pid, passed in: it may be gone before this runs) is no
    longer this process's parent."""
    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def main(job: str, parent: int) -> None:
    # The engine's steps first. At nice 19 alone the job still took a core's timeslices from
    # the engine's threads, whose ~70 parallel regions a step each wait for the slowest thread:
    # steps of 180-280 ms among ~80 ms ones, a chunk gap p99 of 175-219 ms at concurrency 64
    # (114-131 ms under SCHED_IDLE, which runs only on a core nothing else wants;
    # docs/benchmarks.md). Under full load it then waits for idle moments.
    os.nice(19)
    if hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    _exit_with_parent(parent)
    import torch

    from actors.distributed.parallel import layout
    from actors.worker.compiled_decode import MIN_BLOCKS, compile_to
    from actors.worker.input_batch import InputBatch
    from actors.worker.kernel_choice import choose
    from actors.worker.loader import build_model, load_kv_scales
    from actors.worker.kv_pool import bind_kv_cache

    torch.set_num_threads(1)
    with open(job, "rb") as f:
        config, spec, block_size, path = pickle.load(f)
    Path(job).unlink(missing_ok=True)  # read: gone even if the engine dies without cleaning up
    device = torch.device("cpu")
    parallel = layout(config, spec.layer_split, 0)  # one rank: compiled decode runs only there
    parallel.device = device
    model = build_model(spec.path, spec.hf_config, spec.dtype, device, spec.max_model_len, parallel,
                        spec.weight_dtype, read_weights=False, quantization=spec.quantization,
                        checkpoint_layers_only=spec.checkpoint_layers_only)
    load_kv_scales(model, spec.path)  # an fp8 KV cache's scales are constants of the traced step
    choose(config, spec, device, 1, lora=False)  # builds or loads the native kernels the model calls
    bind_kv_cache(model, MIN_BLOCKS + 1, block_size, spec.kv_dtype, device)
    batch = InputBatch(MIN_BLOCKS, MIN_BLOCKS, block_size, pad_block=MIN_BLOCKS)
    start = time.perf_counter()
    compile_to(model, batch, block_size, path)
    print(f"compiled in {time.perf_counter() - start:.1f} s -> {path}", flush=True)
    prune(path.parent)


def prune(folder: Path, keep: int = KEEP) -> None:
    """Delete all but the `keep` most recently written artifacts (each model, source tree and
    torch version leaves its own, ~1-5 MB), sparing those written in the last hour: more engines
    than `keep` compiling at once must each still find its own."""
    now = time.time()
    artifacts = sorted(folder.glob("decode-*.bin"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in artifacts[keep:]:
        if now - old.stat().st_mtime > FRESH_S:
            old.unlink(missing_ok=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main(sys.argv[1], int(sys.argv[2]))
