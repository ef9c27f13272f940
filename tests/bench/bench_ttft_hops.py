"""Where the time-to-first-token tax goes: one request at a time (a 32-token prompt, one output
token), entered at each hop of the serving path in turn, in one run:

    .venv/bin/python tests/bench/bench_ttft_hops.py [--n 20]

- in-process: an AsyncEngine in this process (no hop);
- scheduler actor, called directly: over its Unix socket (`add` and the output stream, as a
  replica on its node talks to it: actors/host/link.py), and through Ray (an actor call,
  then a new streaming generator each time, as a replica on another node does);
- HTTP, direct ingress (`shoal serve`'s default for one replica): a streamed /v1/completions
  answered by the ModelServer replica itself, which streams from its scheduler actor;
- HTTP, merged layout behind Serve's proxy (`serve run`): the same through the proxy;
- split layout: the LLMServer replica through a Serve DeploymentHandle (Serve's router, the
  replica, then the actor), and HTTP through the proxy and the Ingress replica in front of that.
The three run side by side, one app each. Also the no-op round trip of each hop (an actor
method, a handle method, GET /v1/models), and the CPU each process of the local cluster spends
per HTTP request (from /proc), which on 2 cores comes out of the engine's. The same engine settings as tests/bench/bench_serve.py.
Prints markdown tables.
"""
import argparse
import asyncio
import os
import statistics
import time
import uuid

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
from actors.worker.process_tuning import openmp_env  # noqa: E402

os.environ.update(openmp_env())  # as `shoal` sets it (actors/executor/placement.py), before torch loads

import httpx  # noqa: E402
import torch  # noqa: E402
from bench_serve import start_serve, stop_serve  # noqa: E402
from common import bench_checkpoint  # noqa: E402

from actors.config import EngineConfig  # noqa: E402
from actors.engine.async_engine import AsyncEngine  # noqa: E402
from actors.request import EngineRequest  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402

PROMPT = list(range(100, 132))


def timed(make_call):
    """An async function timing one call of `make_call()` (an awaitable or async iterator:
    the time to its first item)."""
    async def once() -> float:
        start = time.perf_counter()
        call = make_call()
        if hasattr(call, "__aiter__"):
            async for _ in call:
                break
        else:
            await call
        return time.perf_counter() - start
    return once


async def measure(options: dict, url: str, split_url: str, direct_url: str,
                  n: int) -> list[tuple[str, float]]:
    from ray import serve

    from actors.host.engine_actor import engine_actor_class
    from actors.host.link import SocketLink
    from app.serving.replica import RoutedRequest

    engine = AsyncEngine(EngineConfig(**options))
    params = SamplingParams(max_tokens=1, temperature=0)
    # Two scheduler actors of the benchmark's own, one per way in: a new output stream takes
    # the actor's outputs from the last (a replica's would lose its own).
    scheduler, linked = (engine_actor_class({"CPU": 0}).remote(EngineConfig(**options))
                         for _ in range(2))
    _, address = await linked.link_address.remote()
    link = await SocketLink.open(address)
    firsts: dict[str, asyncio.Future] = {}

    async def read_link():
        async for batch in link.batches():
            for request_id, _, _ in batch:
                if request_id in firsts and not firsts[request_id].done():
                    firsts[request_id].set_result(None)
    reader = asyncio.create_task(read_link())
    handle = serve.get_deployment_handle("LLMServer", "split")
    http = httpx.AsyncClient(timeout=60)

    async def first_ref():
        request_id = uuid.uuid4().hex
        outputs = scheduler.outputs.options(num_returns="streaming").remote()
        await scheduler.add.remote(EngineRequest(request_id, PROMPT, params))
        async for ref in outputs:
            if any(item[0] == request_id for item in await ref):
                yield request_id
                return

    async def first_on_link():
        request_id = uuid.uuid4().hex
        firsts[request_id] = asyncio.get_running_loop().create_future()
        await link.add(EngineRequest(request_id, PROMPT, params))
        await firsts[request_id]
        del firsts[request_id]

    def first_sse(base: str):
        async def first():
            body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True}
            async with http.stream("POST", f"{base}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        yield line
        return first

    cases = [
        ("in-process engine", timed(lambda: engine.generate(EngineRequest(uuid.uuid4().hex, PROMPT, params)))),
        ("scheduler actor over its Unix socket (add, its output stream)", timed(first_on_link)),
        ("scheduler actor through Ray (add + a new output stream)", timed(first_ref)),
        ("direct ingress: HTTP stream (ModelServer, actor)", timed(first_sse(direct_url))),
        ("merged: HTTP stream (proxy, ModelServer, actor)", timed(first_sse(url))),
        ("split: LLMServer via Serve handle", timed(lambda: handle.options(stream=True).generate.remote(
            RoutedRequest(EngineRequest(uuid.uuid4().hex, PROMPT, params))))),
        ("split: HTTP stream (proxy, Ingress, handle, LLMServer, actor)", timed(first_sse(split_url))),
        ("no-op: actor method", timed(lambda: scheduler.ready.remote())),
        ("no-op: Serve handle method", timed(lambda: handle.ready.remote())),
        ("no-op: direct ingress HTTP GET /v1/models", timed(lambda: http.get(f"{direct_url}/v1/models"))),
        ("no-op: merged HTTP GET /v1/models", timed(lambda: http.get(f"{url}/v1/models"))),
        ("no-op: split HTTP GET /v1/models", timed(lambda: http.get(f"{split_url}/v1/models"))),
    ]
    for name, once in cases:
        for _ in range(3):  # warm-up
            await once()
    times = {name: [] for name, _ in cases}
    for _ in range(n):  # the cases in turn, so a slow moment of the machine hits them all alike
        for name, once in cases:
            times[name].append(await once())
    rows = [(name, statistics.median(t) * 1000) for name, t in times.items()]
    engine.shutdown()
    cpu = {}
    for name, once in [("direct ingress: streamed, 1 token", timed(first_sse(direct_url))),
                       ("direct ingress: GET /v1/models", timed(lambda: http.get(f"{direct_url}/v1/models"))),
                       ("merged: streamed, 1 token", timed(first_sse(url))),
                       ("merged: GET /v1/models", timed(lambda: http.get(f"{url}/v1/models"))),
                       ("split: streamed, 1 token", timed(first_sse(split_url))),
                       ("split: GET /v1/models", timed(lambda: http.get(f"{split_url}/v1/models")))]:
        before = cluster_cpu()
        for _ in range(n):
            await once()
        after = cluster_cpu()
        cpu[name] = {k: (after[k] - before.get(k, after[k])) / n * 1000 for k in after}
    await http.aclose()
    reader.cancel()
    return rows, cpu


PROCESSES = ("ProxyActor", "ModelServer", "Ingress", "LLMServer", "Scheduler", "ServeController",
             "raylet", "gcs_server")


def cluster_cpu() -> dict[str, float]:
    """CPU seconds so far of each of the local cluster's processes, by role."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        role = next((r for r in PROCESSES if r in cmd), None)
        if role:
            out[role] = out.get(role, 0.0) + (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20, help="timed requests per row")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    options = dict(model_path=str(bench_checkpoint()), num_threads=args.threads, max_num_seqs=64,
                   kv_cache_memory=1.0, attn_backend="native")
    served = {**options, "shard_cpus": args.threads, "stream_chunks_per_s": 100}
    url = start_serve({**served, "serve_layout": "merged"})
    direct = None
    try:
        from ray import serve

        from app.config import load_config
        from app.serving.builder import application, build_app
        from app.serving.direct_http import ListeningSocket
        # Logical CPUs only (both engines run num_threads torch threads): 4 in all fit both apps.
        serve.run(build_app({**served, "serve_layout": "split", "shard_cpus": 1.5}), name="split",
                  route_prefix="/split")
        # A third app answering on its own socket (what `shoal serve` runs for one replica).
        direct = ListeningSocket("127.0.0.1", 0)  # a free port
        serve.run(application(load_config({**served, "shard_cpus": 0.1}), direct.path),
                  name="direct", route_prefix="/direct")
        direct_url = "http://%s:%d" % direct.sock.getsockname()[:2]
        rows, cpu = asyncio.run(measure(options, url, f"{url}/split", direct_url, args.n))
    finally:
        stop_serve()
        if direct is not None:
            direct.close()
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| entered at | first token p50 (ms) |\n| --- | --- |")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} |")
    print("\n| CPU ms per request | " + " | ".join(PROCESSES) + " |")
    print("| --- |" + " --- |" * len(PROCESSES))
    for name, per in cpu.items():
        print(f"| {name} | " + " | ".join(f"{per.get(p, 0.0):.1f}" for p in PROCESSES) + " |")


if __name__ == "__main__":
    main()
