"""The client CLIs end to end: `shoal chat`, `complete`, `bench serve`, `bench throughput`,
`collect-env`, against a real API server (uvicorn on 127.0.0.1 over a LocalEngineClient on a
tiny checkpoint) or the in-process engine.

Most commands run in this process through `app.cli.main` (no second torch import on a
2-core machine); the interactive chat runs as a real subprocess fed through stdin. The
server records each prompt it renders, so history and `clear` are checked where they
matter: in what the model was asked.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from actors.config import EngineConfig
from app.api.app import attach, build_api
from app.api.embedded import serve_in_thread
from app.api.engine_client import LocalEngineClient
from app.api.settings import ServerSettings
from app.cli import main
from app.cli.bench.cli import check_bounded
from app.cli.bench.report import percentile
from app.cli.main import build_parser
from kernels import native
from kernels.quantization import w8a8_cpu_kernel

ROOT = Path(__file__).resolve().parents[1]


class RecordingClient:
    """The real engine client, remembering each prompt (as text) and its sampling params."""

    def __init__(self, inner):
        self.inner, self.tokenizer = inner, inner.tokenizer
        self.max_model_len = inner.max_model_len
        self.prompts, self.params = [], []

    def generate(self, request):
        self.prompts.append(self.tokenizer.decode(request.prompt_token_ids))
        self.params.append(request.params)
        return self.inner.generate(request)

    def __getattr__(self, name):  # abort, stats, ready, shutdown
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def engine(llama_ckpt):
    client = RecordingClient(LocalEngineClient(EngineConfig(model_path=str(llama_ckpt),
                                                            num_kv_blocks=256)))
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def url(engine, llama_ckpt):
    settings = ServerSettings(model_path=str(llama_ckpt))
    with serve_in_thread(attach(build_api(settings), engine, engine.tokenizer, settings)) as base:
        yield base + "/v1"


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


def greedy_chat(oai, messages, max_tokens):
    model = oai.models.list().data[0].id
    return oai.chat.completions.create(model=model, messages=messages, temperature=0,
                                       max_tokens=max_tokens).choices[0].message.content


# --------------------------------------------------------------------------- chat

def test_chat_prompt_streams_the_answer(url, oai, engine, capsys):
    assert main(["chat", "--url", url, "--prompt", "Tell me about the fox", "--system",
                 "Be brief.", "-t", "0", "-k", "3", "--max-tokens", "8"]) == 0
    expected = greedy_chat(oai, [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Tell me about the fox"}], 8)
    assert capsys.readouterr().out == expected + "\n"
    asked = engine.params[-2]  # the CLI's request, before the reference one
    assert (asked.top_k, asked.max_tokens, asked.temperature) == (3, 8, 0)
    assert "Be brief." in engine.prompts[-2]


def test_chat_interactive_keeps_history_and_clears(url, engine):
    before = len(engine.prompts)
    lines = "first question\nsecond question\nclear\nthird question\nquit\n"
    done = subprocess.run([sys.executable, "-m", "app.cli", "chat", "--url", url, "-t", "0",
                           "--max-tokens", "4"], input=lines, capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("Assistant: ") == 3
    assert "(conversation cleared)" in done.stdout
    first, second, third = engine.prompts[before:]
    assert "first question" in first
    assert "first question" in second and "second question" in second  # history kept
    assert "third question" in third and "question" not in third.replace("third question", "")


def test_chat_with_embedded_engine(llama_ckpt, oai, capsys):
    assert main(["chat", "--model-path", str(llama_ckpt), "--num-kv-blocks", "64", "-p", "hi",
                 "-t", "0", "--max-tokens", "6"]) == 0
    expected = greedy_chat(oai, [{"role": "user", "content": "hi"}], 6)
    assert capsys.readouterr().out == expected + "\n"


def test_chat_without_server_fails_in_one_line(capsys):
    assert main(["chat", "--url", "http://127.0.0.1:9/v1", "-p", "hi"]) == 1
    assert "cannot reach the server" in capsys.readouterr().err


def test_complete_streams_text(url, oai, capsys):
    assert main(["complete", "--url", url.removesuffix("/v1"), "-q", "The quick brown", "-t", "0",
                 "--max-tokens", "6"]) == 0
    model = oai.models.list().data[0].id
    expected = oai.completions.create(model=model, prompt="The quick brown", temperature=0,
                                      max_tokens=6).choices[0].text
    assert capsys.readouterr().out == expected + "\n"


# --------------------------------------------------------------------------- bench

def test_bench_serve_json_and_plot(url, tmp_path, capsys):
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    assert main(["bench", "serve", "--url", url, "--num-prompts", "8", "--max-concurrency", "4",
                 "--input-len", "16", "--output-len", "8", "--json", str(out), "--plot", str(png),
                 "--disable-tqdm"]) == 0
    table = capsys.readouterr().out
    assert "Request throughput (req/s)" in table and "Time to first token" in table
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (8, 0)
    assert result["total_output_tokens"] == 64  # ignore_eos: exactly --output-len each
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    for name in ("ttft", "itl", "e2e", "tpot"):
        p50, p90, p99 = (result[f"p{q}_{name}_ms"] for q in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99
    assert len(result["requests"]) == 8 and result["config"]["max_concurrency"] == 4
    assert max_in_flight(result["requests"]) <= 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def max_in_flight(rows) -> int:
    # At equal times an end sorts first (-1 < +1): the freed slot is what let the next start.
    events = sorted([(r["start"], 1) for r in rows] + [(r["end"], -1) for r in rows])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def test_bench_serve_poisson_chat_dataset(url, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n" + json.dumps(
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}) + "\n")
    out = tmp_path / "out.json"
    assert main(["bench", "serve", "--url", url, "--endpoint", "chat", "--dataset", str(data),
                 "--num-prompts", "4", "--request-rate", "20", "--output-len", "5",
                 "--json", str(out), "--disable-tqdm"]) == 0
    result = json.loads(out.read_text())
    assert (result["completed"], result["total_output_tokens"]) == (4, 5 + 3 + 5 + 3)
    starts = sorted(r["start"] for r in result["requests"])
    assert starts[-1] > starts[0]  # Poisson: spread out, not all at t=0


def test_bench_serve_records_failed_requests(url):
    """A refused request and a dead server are counted as failures with their reason, not raised."""
    import asyncio
    import socket

    from app.cli.bench.load import LoadPlan, run_load
    from app.cli.bench.prompts import BenchPrompt

    prompts = [BenchPrompt(prompt="Hello", max_tokens=2)] * 2
    results, _ = asyncio.run(run_load(LoadPlan(url=url, model="no-such-model", num_prompts=2), prompts))
    assert [r.error[:8] for r in results] == ["HTTP 404"] * 2
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    results, _ = asyncio.run(run_load(LoadPlan(url=dead, model="m", num_prompts=1), prompts))
    assert "ClientConnectorError" in results[0].error


def test_sse_lines_joins_lines_split_across_reads():
    import asyncio
    import types

    from app.cli.bench.load import sse_lines

    async def reads():
        for data in (b'data: {"a"', b': 1}\r\n\nda', b"ta: [DONE]\n", b"tail"):
            yield data

    async def lines():
        response = types.SimpleNamespace(content=types.SimpleNamespace(iter_any=reads))
        return [line async for line in sse_lines(response)]

    assert asyncio.run(lines()) == ['data: {"a": 1}', "", "data: [DONE]", "tail"]


def test_bench_helpers():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0 and math.isnan(percentile([], 50))
    args = build_parser().parse_args(["bench", "serve", "--duration", "5"])
    with pytest.raises(SystemExit, match="--request-rate or --max-concurrency"):
        check_bounded(args)  # a duration alone would start requests without end


def test_bench_throughput(llama_ckpt, tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model-path", str(llama_ckpt), "--num-kv-blocks", "64",
                 "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
                 "--json", str(out), "--disable-tqdm"]) == 0
    assert "requests/s" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert (result["num_requests"], result["total_input_tokens"],
            result["total_output_tokens"]) == (4, 32, 16)
    assert result["output_tokens_per_second"] > 0


# --------------------------------------------------------------------------- collect-env

def test_collect_env(monkeypatch, capsys):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")  # nothing there: a quick, certain answer
    assert main(["collect-env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    versions = report["versions"]
    assert versions["python"] == sys.version.split()[0]
    assert versions["torch"] and versions["transformers"] and versions["ray"]
    assert report["system"]["logical_cores"] >= 1 and report["system"]["cpu"]
    assert isinstance(report["torch"]["cuda_available"], bool)
    assert ("panel kernel" in report["cpu_linear"]["float32"]) == (native.panel_linear_op() is not None)
    assert ("pairs kernel" in report["cpu_linear"]["bfloat16"]) == (native.bf16_linear_op() is not None)
    assert report["quantization"]["int8"].startswith("CPU, the ")
    w8a8 = report["quantization"]["w8a8_int8"]
    assert w8a8.startswith("int8 x int8")
    assert ("shoal's AVX2 kernel" in w8a8) == (w8a8_cpu_kernel() == "avx2")
    assert ("shoal's AVX512-VNNI kernel" in w8a8) == (w8a8_cpu_kernel() == "vnni")
    assert ("packed at start" in w8a8) == (w8a8_cpu_kernel() == "onednn-packed")
    assert "dequantised as they load" in report["quantization"]["gptq / awq / compressed-tensors int4 checkpoints"]
    assert "no FP4 matmuls" in report["quantization"]["nvfp4 checkpoints"]
    assert all(arch in report["quantization"]["gguf files"] for arch in ("gpt-oss", "deepseek2", "glm4moe", "qwen35"))
    assert report["quantization"]["fp8 KV cache"].startswith("--kv-cache-dtype fp8")
    assert report["ray_cluster"] == {"status": "unreachable", "address": "127.0.0.1:9"}
    assert main(["collect-env", "--ray-address", "none"]) == 0
    text = capsys.readouterr().out
    assert "== versions" in text and "transformers" in text and "skipped" in text
    for key in report["quantization"]:  # long names keep a space before their text
        assert f"\n{key} " in text, key


STOP_WAITER = """
import sys, threading, time
from app.cli.stop_signal import StopSignal
stop = StopSignal()
busy = [threading.Thread(target=lambda: [time.sleep(0.0005) for _ in iter(int, 1)], daemon=True) for _ in range(4)]
for t in busy:
    t.start()
print("waiting", flush=True)
got = stop.wait()
print("stopped" if got else "timed out", flush=True)
"""


def test_shoal_serve_stops_on_a_burst_of_signals():
    """`shoal serve` waits on StopSignal (app/cli/stop_signal.py) with Ray's threads busy beside
    it; Ctrl-C pressed again and again, or a supervisor's SIGTERM on top of it, must still end
    the wait (a threading.Event set from the handler deadlocked inside its own wait)."""
    import signal

    proc = subprocess.Popen([sys.executable, "-c", STOP_WAITER], cwd=Path(__file__).resolve().parents[1],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "waiting"
        for i in range(10000):  # back to back: handlers nest
            proc.send_signal(signal.SIGINT if i % 2 else signal.SIGTERM)
        rest, _ = proc.communicate(timeout=10)  # (its exit status: a late SIGTERM may end it)
        assert rest.split() == ["stopped"]
    finally:
        proc.kill()
