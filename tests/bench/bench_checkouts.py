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
import asyncio
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench_llama_cpp import ROOT, checkpoint, drive, free_port, stop, wait_ready, workload


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
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--shoal-args", default="", help="more `shoal serve` options for both")
    ap.add_argument("--root", type=Path, default=Path("/tmp/shoal-bench"))
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
        for _, url in servers.values():  # warm-up at full width
            asyncio.run(drive(url, prompts[:args.concurrency], args))
        runs = {name: [] for name in servers}
        for i in range(args.rounds):
            for name, (_, url) in servers.items():
                run = asyncio.run(drive(url, prompts, args))
                runs[name].append(run)
                print(f"round {i + 1} {name}: {run['rate']:.0f} tok/s, TTFT p50 {run['ttft_p50'] * 1e3:.0f} ms, "
                      f"load average {run['load']}", flush=True)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    ratios = [a["rate"] / b["rate"] for a, b in zip(runs["after"], runs["before"])]
    print("\n| round | before tok/s | after tok/s | after / before |")
    print("| --- | --- | --- | --- |")
    for i, (b, a, r) in enumerate(zip(runs["before"], runs["after"], ratios)):
        print(f"| {i + 1} | {b['rate']:.0f} | {a['rate']:.0f} | {r:.3f} |")
    print(f"\nmedian after / before: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
