"""`shoal serve` against llama.cpp's `llama-server` on the same checkpoint, in one run.

    .venv/bin/python tests/bench/bench_llama_cpp.py --llama-server BUILD/bin/llama-server \\
        --llama-cpp SRC/vendor/llama.cpp [--dtype float32|bfloat16] [--rounds 3] [--stream]

Not a test: it needs a llama.cpp build (see docs/benchmarks.md for how to make one). The
script builds a ~25M-parameter Llama-style checkpoint that no test uses (GQA, its own seed),
converts it to GGUF with llama.cpp's own `convert_hf_to_gguf.py` (f32 or bf16, to match
--dtype), starts both servers on 127.0.0.1 and drives each with the same requests:
64 prompts of random token ids at concurrency 32, 64 output tokens each (`ignore_eos`),
through the same OpenAI `/v1/completions` route. The two servers stay up and the rounds
alternate (llama-server, shoal, llama-server, ...), so each shoal round has a llama-server
neighbour under the same machine load; the ratio is the median of the per-round ratios.
The load average is printed with every round: figures taken while other work runs say so.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from common import workload  # noqa: F401,I001  (first: sets HF offline, puts tests/ on sys.path)

from checkpoints import make_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# ~25M parameters: 8 layers of 2.4M (GQA 8/4 heads, MLP 1024) + 8.2M embedding and LM head.
MODEL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1152, vocab_size=8000, max_position_embeddings=2048)
SEED = 20261123  # weights no test ever saw
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}


def checkpoint(root: Path) -> Path:
    path = root / "llama-25m"
    if not (path / "config.json").exists():
        make_checkpoint(path, "llama", seed=SEED, init_std=0.05, **MODEL)
    return path


def convert(hf: Path, llama_cpp: Path, outtype: str) -> Path:
    """GGUF of the checkpoint, by llama.cpp's converter, in a child process.

    The test tokenizer is a byte-level BPE (GPT-2 style, tokenizer.json only): the converter
    is sent straight to its GPT-2 vocab path (it would try SentencePiece first), and since it
    does not know this tokenizer by hash, the pre-tokenizer (GPT-2's regex) is named by hand."""
    out = hf / f"model-{outtype}.gguf"
    if not out.exists():
        code = ("import sys, runpy; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/gguf-py']\n"
                "import conversion.base as b\n"
                "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
                "def no_file(self, *a, **k): raise FileNotFoundError('tokenizer.json only')\n"
                "b.TextModel._set_vocab_sentencepiece = b.TextModel._set_vocab_llama_hf = no_file\n"
                "script = sys.argv[1] + '/convert_hf_to_gguf.py'\n"
                "sys.argv = [script] + sys.argv[2:]\n"
                "runpy.run_path(script, run_name='__main__')\n")
        subprocess.run([sys.executable, "-c", code, str(llama_cpp), str(hf), "--outtype", outtype,
                        "--outfile", str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def start_llama_server(binary: str, gguf: Path, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    kv = GGUF_TYPES[args.dtype]
    ctx = args.concurrency * (args.max_prompt + args.output_len + 16)
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.llama_threads), "-tb", str(args.llama_threads), "-np", str(args.concurrency),
           "-c", str(ctx), "-ctk", kv, "-ctv", kv, "-fa", "off", "-cb", "--no-warmup"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(args.logs / "llama-server.log", "w"))
    return proc, f"http://127.0.0.1:{port}"


def start_shoal(hf: Path, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": str(ROOT)}  # this checkout's code, in the server and its Ray workers
    env.pop("RAY_ADDRESS", None)  # always a local Ray of its own
    cmd = [sys.executable, "-m", "app.cli", "serve", "--model-path", str(hf),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
           "--max-num-seqs", str(args.concurrency), "--kv-cache-memory", "1",
           *args.shoal_args.split()]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(args.logs / "shoal-serve.log", "w"))
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode} (see the logs)")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} not ready in {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (shoal serve drains and stops its own Ray), SIGKILL after a minute."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def one_request(http: httpx.AsyncClient, url: str, prompt: list[int], args) -> tuple[int, float]:
    """(output tokens, time to first token) of one /v1/completions request. A kept-alive
    connection that the server closed just as it was reused is retried once."""
    try:
        return await _one_request(http, url, prompt, args)
    except httpx.RemoteProtocolError:
        return await _one_request(http, url, prompt, args)


async def _one_request(http: httpx.AsyncClient, url: str, prompt: list[int], args) -> tuple[int, float]:
    body = {"prompt": prompt, "max_tokens": args.output_len, "temperature": 0,
            "ignore_eos": True, "stream": args.stream}
    start = time.perf_counter()
    if not args.stream:
        r = await http.post(f"{url}/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"], time.perf_counter() - start
    body["stream_options"] = {"include_usage": True}
    tokens, first, chunks = None, None, 0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                chunks += 1
                first = first or time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return (tokens if tokens is not None else chunks), first


async def drive(url: str, prompts: list, args) -> dict:
    gate = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency + 8)

    async def limited(http, prompt):
        async with gate:
            return await one_request(http, url, prompt, args)

    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        load = load_average()
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(http, p) for p in prompts))
        wall = time.perf_counter() - start
    tokens = sum(n for n, _ in results)
    if tokens != len(prompts) * args.output_len:
        raise RuntimeError(f"{url}: {tokens} output tokens, expected {len(prompts) * args.output_len}")
    ttft = sorted(t for _, t in results)
    return {"rate": tokens / wall, "wall": wall, "ttft_p50": ttft[len(ttft) // 2], "load": load}


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The requests, the rounds and the shoal options (shared with bench_checkouts.py)."""
    ap.add_argument("--dtype", choices=sorted(GGUF_TYPES), default="float32")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stream", action="store_true", help="stream both sides (SSE) instead of one body")
    ap.add_argument("--shoal-args", default="", help="more `shoal serve` options, e.g. '--num-threads 2'")
    ap.add_argument("--root", type=Path, default=Path("/tmp/shoal-bench"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-server", required=True, help="the llama-server binary")
    ap.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp's source (convert_hf_to_gguf.py)")
    ap.add_argument("--llama-threads", type=int, default=2, help="llama-server -t / -tb")
    add_workload_args(ap)
    args = ap.parse_args()
    args.logs = args.root / "logs"
    args.logs.mkdir(parents=True, exist_ok=True)
    hf = checkpoint(args.root)
    gguf = convert(hf, args.llama_cpp, GGUF_TYPES[args.dtype])
    prompts = workload(args.requests, args.min_prompt, args.max_prompt, seed=7)
    servers = {}
    try:
        servers["llama-server"] = start_llama_server(args.llama_server, gguf, args)
        servers["shoal serve"] = start_shoal(hf, args)
        for proc, url in servers.values():
            wait_ready(url, proc)
        runs = alternate(servers, prompts, args)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    report(args, runs)


def alternate(servers: dict, prompts: list, args) -> dict[str, list[dict]]:
    """A warm-up round at full width on each server (llama-server's first batch of 32 was ~30%
    slower than later ones), then `args.rounds` rounds, the servers taking turns."""
    for _, url in servers.values():
        asyncio.run(drive(url, prompts[:args.concurrency], args))
    runs = {name: [] for name in servers}
    for i in range(args.rounds):
        for name, (_, url) in servers.items():
            run = asyncio.run(drive(url, prompts, args))
            runs[name].append(run)
            print(f"round {i + 1} {name}: {run['rate']:.0f} tok/s, TTFT p50 {run['ttft_p50'] * 1e3:.0f} ms, "
                  f"load average {run['load']}", flush=True)
    return runs


def report(args, runs: dict) -> None:
    print(f"\n{args.requests} requests at concurrency {args.concurrency}, prompts of {args.min_prompt}-"
          f"{args.max_prompt} tokens, {args.output_len} output tokens (ignore_eos), {args.dtype}, "
          f"{'streamed' if args.stream else 'one body per request'}, {args.rounds} alternating rounds; "
          f"llama-server -t {args.llama_threads}; shoal serve {args.shoal_args or '(defaults)'}\n")
    median = ratio_table(runs, "llama-server", "shoal serve")
    print(f"\nmedian shoal / llama-server: {median:.2f}x (target >= 1.3x)")


def ratio_table(runs: dict, baseline: str, measured: str) -> float:
    """The rounds as a markdown table, `measured` against `baseline`; the median ratio."""
    ratios = [m["rate"] / b["rate"] for m, b in zip(runs[measured], runs[baseline])]
    print(f"| round | {baseline} tok/s | {measured} tok/s | {measured} / {baseline} | load average (1/5/15 min) |")
    print("| --- | --- | --- | --- | --- |")
    for i, (b, m, r) in enumerate(zip(runs[baseline], runs[measured], ratios)):
        print(f"| {i + 1} | {b['rate']:.0f} | {m['rate']:.0f} | {r:.3f} | {b['load']} / {m['load']} |")
    return statistics.median(ratios)


if __name__ == "__main__":
    main()
