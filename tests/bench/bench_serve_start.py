"""`shoal serve` start and stop: from the command to the first 200 from /readyz, then from
SIGINT to the process's exit, as the suite starts its servers (SHOAL_EAGER_DECODE=1, a tiny
checkpoint). Several trees can be timed in one run, alternating, to compare code:

    .venv/bin/python tests/bench/bench_serve_start.py [--runs 3] [--tree DIR ...]

Each --tree is a checkout of shoal (default: this one), run with this venv's Python.
Figures in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from checkpoints import make_checkpoint  # noqa: E402
from serving import free_port, loopback_env, wait_process_ready  # noqa: E402


def one_start(tree: Path, model: Path, log: Path) -> tuple[float, float]:
    """(seconds to ready, seconds from SIGINT to exit)."""
    port = free_port()
    env = loopback_env(SHOAL_EAGER_DECODE="1", PYTHONPATH=str(tree))
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--model-path", str(model),
                                 "--host", "127.0.0.1", "--port", str(port), "--num-kv-blocks", "64"],
                                cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_process_ready(f"http://127.0.0.1:{port}", proc, log)
        ready = time.perf_counter() - start
        stop = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
        return ready, time.perf_counter() - stop
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tree", action="append", type=Path, help="a shoal checkout (repeatable)")
    args = ap.parse_args()
    trees = args.tree or [REPO]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_checkpoint(Path(tmp) / "llama", "llama")
        times: dict[Path, list[tuple[float, float]]] = {t: [] for t in trees}
        for _ in range(args.runs):
            for tree in trees:  # alternating, so load drifts hit every tree alike
                times[tree].append(one_start(tree, model, Path(tmp) / "serve.log"))
    print(f"{os.cpu_count()} CPUs; shoal serve of a tiny checkpoint, SHOAL_EAGER_DECODE=1")
    for tree, runs in times.items():
        print(f"{tree}: ready after " + ", ".join(f"{r:.1f}" for r, _ in runs) + " s; stopped after "
              + ", ".join(f"{s:.1f}" for _, s in runs) + " s")


if __name__ == "__main__":
    main()
