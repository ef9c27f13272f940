"""`shoal bench serve`'s load generator: streaming requests at Poisson arrivals or a fixed
concurrency, timing every streamed chunk.

Raw aiohttp rather than the openai client: we want the arrival time of each SSE line, and
`ignore_eos` (a vLLM extra) so each request produces exactly its output budget. aiohttp rather
than httpx because the client shares the machine with the server it measures: httpx's pool
costs ~7 ms of CPU per request at 64 concurrent streams on reused connections (encode/httpx
#3215; `docs/benchmarks.md`, "2026-11-27, night"), aiohttp's well under 1 ms.
Arrivals follow an absolute schedule (t0 + cumulative exponential gaps): a request that
waits for a concurrency slot does not push the later arrivals back.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import aiohttp

from app.cli.bench.prompts import BenchPrompt


@dataclass
class LoadPlan:
    url: str  # the OpenAI base URL, ending in /v1
    model: str
    endpoint: str = "completions"  # completions | chat
    num_prompts: int | None = 100  # None: until the duration is up
    duration: float | None = None  # seconds; no request starts after it (in-flight ones finish)
    request_rate: float = math.inf  # requests/s (Poisson); inf: all at once
    max_concurrency: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    seed: int = 0
    api_key: str = "EMPTY"


@dataclass
class RequestResult:
    start: float  # seconds after the run started
    end: float = 0.0
    ttft: float | None = None  # seconds from start to the first text
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (seconds after t0, chars)
    error: str | None = None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    def itls(self) -> list[float]:
        """Gaps between text chunks (a server that coalesces tokens sends fewer, longer gaps)."""
        times = [t for t, _ in self.chunks]
        return [b - a for a, b in zip(times, times[1:])]

    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def request_body(plan: LoadPlan, prompt: BenchPrompt) -> dict:
    body = {"model": plan.model, "max_tokens": prompt.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": plan.temperature,
            "ignore_eos": plan.ignore_eos}
    if plan.endpoint == "chat":
        body["messages"] = prompt.as_messages()
    else:
        body["prompt"] = prompt.as_text()
    return body


def record_line(result: RequestResult, line: str, now: float, chat: bool) -> None:
    """Fold one SSE line into `result`: text chunks, the usage chunk, an error event."""
    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
        return
    chunk = json.loads(line[5:])
    if chunk.get("error"):
        result.error = str(chunk["error"].get("message", chunk["error"]))
    if chunk.get("usage"):
        result.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
        result.output_tokens = chunk["usage"].get("completion_tokens", 0)
    for choice in chunk.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        if text:
            if result.ttft is None:
                result.ttft = now - result.start
            result.chunks.append((now, len(text)))


async def sse_lines(resp: aiohttp.ClientResponse):
    """The response's lines as they arrive (aiohttp's own line iterator caps a line at 128 KiB)."""
    pending = b""
    async for data in resp.content.iter_any():
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            yield line.decode().rstrip("\r")
    if pending:
        yield pending.decode()


async def send(http: aiohttp.ClientSession, plan: LoadPlan, prompt: BenchPrompt,
               t0: float) -> RequestResult:
    result = RequestResult(start=time.perf_counter() - t0)
    path = "/chat/completions" if plan.endpoint == "chat" else "/completions"
    try:
        async with http.post(plan.url + path, json=request_body(plan, prompt)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
            else:
                async for line in sse_lines(resp):
                    record_line(result, line, time.perf_counter() - t0, plan.endpoint == "chat")
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end = time.perf_counter() - t0
    if result.error is None and result.ttft is None:
        result.error = "no text in the response"
    return result


def arrival_offsets(rate: float, rng: random.Random):
    """Seconds after t0 at which requests arrive: Poisson at `rate`, or all at 0."""
    offset = 0.0
    while True:
        yield offset
        if math.isfinite(rate):
            offset += rng.expovariate(rate)


async def run_load(plan: LoadPlan, prompts, on_done=lambda result: None):
    """Send the plan's requests; returns (results of the requests sent, wall seconds)."""
    gate = asyncio.Semaphore(plan.max_concurrency or 1_000_000)
    headers = {"Authorization": f"Bearer {plan.api_key}"}
    timeout = aiohttp.ClientTimeout(total=None, connect=10.0)  # a long generation is not a failure
    connector = aiohttp.TCPConnector(limit=0)  # no cap: the gate sets the concurrency
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as http:
        t0 = time.perf_counter()
        deadline = t0 + plan.duration if plan.duration else math.inf

        async def one(prompt: BenchPrompt) -> RequestResult:
            try:
                result = await send(http, plan, prompt, t0)
            finally:
                gate.release()
            on_done(result)
            return result

        tasks = []
        schedule = zip(prompts, arrival_offsets(plan.request_rate, random.Random(plan.seed)))
        for n, (prompt, offset) in enumerate(schedule):
            if plan.num_prompts is not None and n >= plan.num_prompts:
                break
            if not await wait_turn(gate, t0 + offset, deadline):
                break
            tasks.append(asyncio.create_task(one(prompt)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


async def wait_turn(gate: asyncio.Semaphore, due: float, deadline: float) -> bool:
    """Sleep until the arrival time, then take a concurrency slot; False once past the deadline."""
    await asyncio.sleep(max(0.0, min(due, deadline) - time.perf_counter()))
    left = deadline - time.perf_counter()
    if left <= 0:
        return False
    try:
        await asyncio.wait_for(gate.acquire(), timeout=None if math.isinf(left) else left)
    except asyncio.TimeoutError:
        return False
    return True
