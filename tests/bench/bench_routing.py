"""Prefix-cache hit rate over two replicas, routed by load vs prefix-aware, same workload.

    .venv/bin/python tests/bench/bench_routing.py

8 groups of requests; each group shares a long system prompt (~200 tokens) and differs in a
short question. Requests go 4 at a time in shuffled order, so groups interleave.
"""
import asyncio
import os
import random
import socket
import sys
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from checkpoints import make_checkpoint  # noqa: E402

from app.serving.builder import build_app  # noqa: E402

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


def workload(groups=8, per_group=6, seed=0) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for g in range(groups):
        system = " ".join(rng.choice(WORDS) for _ in range(60)) + f" group {g}."
        prompts += [f"{system} Question {q}: {rng.choice(WORDS)}?" for q in range(per_group)]
    rng.shuffle(prompts)
    return prompts


async def drive(url: str, prompts: list[str]) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        for i in range(0, len(prompts), 4):
            responses = await asyncio.gather(*(http.post(f"{url}/v1/completions",
                                                         json={"prompt": p, "max_tokens": 4})
                                               for p in prompts[i:i + 4]))
            for r in responses:
                r.raise_for_status()


def hit_rate(url: str) -> float:
    replicas = httpx.get(f"{url}/stats", timeout=10).json()["replicas"]
    hits = sum(r["prefix_cache_hit_rate"] * r["prompt_tokens"] / max(1e-9, 1 - r["prefix_cache_hit_rate"])
               for r in replicas)  # hit tokens, from rate = hits / (hits + computed prompt tokens)
    total = hits + sum(r["prompt_tokens"] for r in replicas)
    return hits / total


def main():
    ckpt = make_checkpoint("/tmp/shoal-bench/routing-llama", "llama")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    prompts = workload()
    rates = {}
    for routing in ("load", "prefix-aware"):
        app = build_app({"model_path": str(ckpt), "world_size": 2, "shard_cpus": 0.5, "routing": routing,
                         "num_kv_blocks": 256, "block_size": 8, "num_threads": 1})
        serve.run(app, name=routing, route_prefix=f"/{routing}")
        url = f"http://127.0.0.1:{port}/{routing}"
        asyncio.run(drive(url, prompts))
        rates[routing] = hit_rate(url)
        serve.delete(routing)
    print("| routing | prefix-cache hit rate (2 replicas, 8 groups x 6 requests) |")
    print("| --- | --- |")
    for routing, rate in rates.items():
        print(f"| {routing} | {rate:.1%} |")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
