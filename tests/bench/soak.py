"""Soak: many mixed requests at bounded concurrency against a running server, then check that
nothing leaked: no 5xx, every replica back to 0 KV blocks in use and nothing running, and the
engine processes' resident memory within 10% of what it was after a warm-up.

    .venv/bin/shoal serve --model-path DIR --host 127.0.0.1 --port 8000 &
    .venv/bin/python tests/bench/soak.py --url http://127.0.0.1:8000 --requests 2000 --concurrency 16

The mix: streamed chat, plain completions, streams cancelled after two chunks, n=3, long
prompts, JSON-schema-constrained output, forced tool calls. tests/test_drain_and_soak.py runs
a short version against a real `shoal serve`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
KINDS = ["stream_chat", "completion", "cancelled", "n3", "long_prompt", "json_schema", "tool_call"]
WEIGHTS = [3, 2, 1, 1, 1, 1, 1]


def request_for(kind: str, rng: random.Random) -> tuple[str, dict]:
    words = " ".join(rng.choice(["fox", "boat", "shoal", "river", "server", "token"]) for _ in range(6))
    chat = {"model": "", "messages": [{"role": "user", "content": f"Tell me about {words}."}],
            "max_tokens": rng.randint(4, 24), "temperature": rng.choice([0, 0.7])}
    if kind == "stream_chat":
        return "/v1/chat/completions", {**chat, "stream": True}
    if kind == "completion":
        return "/v1/completions", {"model": "", "prompt": words, "max_tokens": rng.randint(4, 24)}
    if kind == "cancelled":
        return "/v1/chat/completions", {**chat, "stream": True, "max_tokens": 200, "ignore_eos": True}
    if kind == "n3":
        return "/v1/completions", {"model": "", "prompt": words, "max_tokens": 8, "n": 3, "temperature": 0.8}
    if kind == "long_prompt":
        return "/v1/completions", {"model": "", "prompt": (words + " ") * 20, "max_tokens": 8}
    if kind == "json_schema":
        return "/v1/chat/completions", {**chat, "max_tokens": 40, "response_format": {
            "type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}}
    return "/v1/chat/completions", {**chat, "max_tokens": 40, "tools": TOOLS, "tool_choice": "required"}


async def one(http: httpx.AsyncClient, kind: str, rng: random.Random, statuses: Counter) -> None:
    path, body = request_for(kind, rng)
    if not body.get("stream"):
        r = await http.post(path, json=body)
        statuses[r.status_code] += 1
        return
    async with http.stream("POST", path, json=body) as r:
        statuses[r.status_code] += 1
        chunks = 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if '"error"' in line:
                    statuses["stream_error"] += 1
            if kind == "cancelled" and chunks >= 2:
                break  # leaving the block closes the connection mid-stream


async def run_requests(url: str, n: int, concurrency: int, seed: int = 0) -> Counter:
    rng, statuses = random.Random(seed), Counter()
    kinds = rng.choices(KINDS, WEIGHTS, k=n)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        async def bounded(kind):
            async with gate:
                await one(http, kind, rng, statuses)
        await asyncio.gather(*(bounded(k) for k in kinds))
    return statuses


def replicas(url: str) -> list[dict]:
    return httpx.get(f"{url}/stats", timeout=10).json()["replicas"]


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def engine_pids(url: str) -> list[int]:
    return [rank["pid"] for r in replicas(url) for rank in r.get("ranks", [])]


def settled(url: str, timeout: float = 30) -> list[dict]:
    """Replica stats once nothing runs or waits (cancelled streams take a moment to abort)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = replicas(url)
        if all(r["running"] == 0 and r["waiting"] == 0 for r in stats) or time.monotonic() > deadline:
            return stats


def soak(url: str, n: int, concurrency: int, warmup: int = 100) -> dict:
    asyncio.run(run_requests(url, warmup, concurrency, seed=1))
    settled(url)
    pids = engine_pids(url)
    warm = rss_mib(pids)
    start = time.monotonic()
    statuses = asyncio.run(run_requests(url, n, concurrency))
    seconds = time.monotonic() - start
    stats = settled(url)
    return {
        "requests": n, "concurrency": concurrency, "seconds": round(seconds, 1),
        "requests_per_s": round(n / seconds, 1),
        "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
        "server_errors": sum(v for k, v in statuses.items() if isinstance(k, int) and k >= 500),
        "kv_blocks_in_use": sum(r["kv_blocks_total"] - r["kv_blocks_free"] for r in stats),
        "running_after": sum(r["running"] + r["waiting"] for r in stats),
        "rss_warm_mib": round(warm, 1), "rss_after_mib": round(rss_mib(pids), 1),
        "rss_growth": round(rss_mib(pids) / warm - 1, 4),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    report = soak(args.url, args.requests, args.concurrency)
    print(json.dumps(report, indent=2))
    ok = report["server_errors"] == 0 and report["kv_blocks_in_use"] == 0 and report["rss_growth"] < 0.10
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
