"""`shoal serve` from this checkout against `shoal serve` from another (a commit before a
change), on the same checkpoint and requests, in one run: did the change move serving speed?

    git worktree add /tmp/shoal-before <commit>
    .venv/bin/python tests/bench/bench_checkouts.py --before /tmp/shoal-before [--rounds 3]

The workload and client are bench_llama_cpp.py's (the ~25M Llama, 64 prompts at concurrency
32, 64 output tokens, /v1/completions): both servers stay up and the rounds alternate, so
each round of one has a neighbour of the other under the same machine load; the ratio is
the median of the per-round ratios. Each server runs its own checkout's code (PYTHONPATH),
in its Ray workers too.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from bench_llama_cpp import (
    ROOT, add_workload_args, alternate, checkpoint, free_port, ratio_table, stop, wait_ready, workload,
)


def start(checkout: Path, hf: Path, args, name: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": str(checkout)}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "app.cli", "serve", "--model-path", str(hf), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", args.dtype, "--max-num-seqs", str(args.concurrency),
           "--kv-cache-memory", "1", *args.shoal_args.split()]
    proc = subprocess.Popen(cmd, env=env, cwd=checkout, stdout=subprocess.DEVNULL,
                            stderr=open(args.logs / f"shoal-{name}.log", "w"))
    return proc, f"http://127.0.0.1:{port}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, required=True, help="the other checkout (a worktree)")
    add_workload_args(ap)
    args = ap.parse_args()
    args.logs = args.root / "logs"
    args.logs.mkdir(parents=True, exist_ok=True)
    hf = checkpoint(args.root)
    prompts = workload(args.requests, args.min_prompt, args.max_prompt, seed=7)
    servers = {}
    try:
        # One at a time: two engines compiling at once would share the 2 cores.
        for name, checkout in (("before", args.before.resolve()), ("after", ROOT)):
            servers[name] = start(checkout, hf, args, name)
            wait_ready(servers[name][1], servers[name][0], timeout=600)
        runs = alternate(servers, prompts, args)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    print()
    print(f"\nmedian after / before: {ratio_table(runs, 'before', 'after'):.3f}")


if __name__ == "__main__":
    main()
