"""Compiled decode on CPU (actors/worker/compiled_decode.py): decode-only steps through torch.compile.

The suite runs eagerly (conftest sets SHOAL_EAGER_DECODE=1: compiling costs seconds per engine
start); these tests turn compilation on and hold it to the oracle: greedy tokens equal
transformers' token for token, log-probs equal an eager engine's, on mixed batches whose
contexts cross blocks (a batch of one decodes eagerly, by design). The slow test starts `shoal serve` the way a user
does (compiled is the default) and reads the progress line it logs.
"""
from __future__ import annotations

import logging
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from oracle import assert_equals_eager_and_hf, hf_greedy
from serving import free_port, loopback_env, stop_process, wait_process_ready
from test_engine import prompts_of
from test_model_families import GEMMA_EVERYTHING, check_served, served_checkpoint

from actors.engine.llm import LLM
from actors.engine.metrics import DecodeProgress
from actors.sampling_params import SamplingParams
from actors.worker.model_spec import cpu_has_matmul

OPTIONS = dict(block_size=4, num_kv_blocks=128, max_num_seqs=8)
REPO = Path(__file__).resolve().parent.parent


def compiled_llm(path) -> LLM:
    """An engine that compiles its decode step (the suite's SHOAL_EAGER_DECODE=1 lifted)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SHOAL_EAGER_DECODE", raising=False)
        return LLM(str(path), **OPTIONS)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def compiled(request, checkpoint_factory):
    # Gemma 3 with a final soft-cap: windows, local rotary, per-head (1 + w) norms, capped
    # logits and a head size that is not hidden / heads, all inside the traced step
    path = checkpoint_factory(request.param, **(GEMMA_EVERYTHING if request.param == "gemma3" else {}))
    llm = compiled_llm(path)
    assert type(llm.engine.executor.runner.graphs).__name__ == "CompiledDecode", llm.engine.executor.runner.graphs_off
    return path, llm


def test_eager_decode_by_option_or_environment(checkpoint_factory, monkeypatch):
    path = checkpoint_factory("llama")
    assert LLM(str(path), **OPTIONS).engine.executor.runner.graphs_off == "--eager-decode"  # the suite's variable
    monkeypatch.delenv("SHOAL_EAGER_DECODE")
    assert LLM(str(path), eager_decode=True, **OPTIONS).engine.executor.runner.graphs_off == "--eager-decode"


def test_compiled_decode_equals_transformers_and_eager(compiled):
    path, llm = compiled
    eager = LLM(str(path), **OPTIONS)  # SHOAL_EAGER_DECODE=1
    prompts = prompts_of([3, 9, 30, 1, 5, 14])  # 6 rows; contexts cross blocks of 4 as they grow
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    progress = DecodeProgress(llm.engine)
    before = llm.engine.executor.runner.graph_replays
    got, want = llm.generate(prompts, params), eager.generate(prompts, params)
    assert llm.engine.executor.runner.graph_replays > before and "graph=True" in progress.line()
    assert_equals_eager_and_hf(path, prompts, got, want, 16)
    assert "graph=False" in progress.line()  # nothing decoded since


@pytest.mark.skipif(not cpu_has_matmul(torch.bfloat16), reason="no bf16 matmuls on this CPU: bf16 computes in float32")
def test_compiled_bfloat16_decode_follows_eager_bfloat16(checkpoint_factory):
    """bf16 compiled decode multiplies in oneDNN's packed bf16 kernels (AMX where there is one);
    eager bf16 is held to transformers bf16 in tests/test_bf16.py. Until the two first choose
    differently (close calls at this precision), each chosen token's log-prob agrees within
    bf16's error. (float32 compiled decode equals transformers token for token, above.)"""
    path = checkpoint_factory("qwen3")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SHOAL_EAGER_DECODE", raising=False)
        llm = LLM(str(path), dtype="bfloat16", **OPTIONS)
    assert type(llm.engine.executor.runner.graphs).__name__ == "CompiledDecode"
    eager = LLM(str(path), dtype="bfloat16", **OPTIONS)
    prompts = prompts_of([3, 9, 30, 1, 5, 14], seed=8)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    compared = 0
    for got, want in zip(llm.generate(prompts, params), eager.generate(prompts, params)):
        got, want = got.outputs[0], want.outputs[0]
        for tok, wtok, lp, wlp in zip(got.token_ids, want.token_ids, got.logprobs, want.logprobs):
            if tok != wtok:
                break
            # bf16 itself moves these log-probs by 0.09-0.12 against float32 (tests/test_bf16.py);
            # compiled against eager: 0.058 at most when written.
            assert abs(lp[tok] - wlp[tok]) <= 0.1, (lp[tok], wlp[tok])
            compared += 1
    assert compared >= 36  # half of the 72 tokens at least


def test_two_requests_compile_one_runs_eagerly_and_blocks_come_back(compiled):
    path, llm = compiled
    prompts = prompts_of([6, 2], seed=3)  # the 2-token prompt's table pads to 2 blocks at first
    replays = llm.engine.executor.runner.graph_replays
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 6)]
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [hf_greedy(path, p, n) for p, n in zip(prompts, (12, 6))]
    # 5 decode steps with both rows ran compiled; the first request's last 6 alone ran eagerly.
    assert llm.engine.executor.runner.graph_replays - replays == 5
    assert llm.engine.blocks.num_free_blocks == OPTIONS["num_kv_blocks"]  # the spare one is outside the pool


def test_rows_pad_to_a_few_bucket_sizes(compiled):
    """oneDNN keeps a kernel per row count it meets (kernels/linear.py), so the compiled step
    pads its rows to the capture sizes plus --max-num-seqs (8 here): 2, 4, 8."""
    _, llm = compiled
    graphs = llm.engine.executor.runner.graphs
    assert graphs.sizes == [2, 4, 8]
    from actors.worker.compiled_decode import CompiledDecode
    assert CompiledDecode(torch.nn.Identity(), sizes=[1, 2, 4, 8, 10], block_size=4).sizes \
        == [2, 4, 8, 10]


def test_a_failed_compile_falls_back_to_eager(checkpoint_factory, caplog):
    """No working C++ compiler: the engine says why once and decodes eagerly."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()  # nothing compiled earlier may be reused
    path = checkpoint_factory("llama")
    # The configs' own patch(): monkeypatch's undo left enable_autograd_cache deleted, and
    # every later compile in the process failed on it.
    try:
        with inductor_config.patch({"fx_graph_cache": False, "cpp.cxx": ("/nonexistent/c++",)}), \
                functorch_config.patch(enable_autograd_cache=False), caplog.at_level(logging.INFO):
            llm = compiled_llm(path)
    finally:
        torch._dynamo.reset()
    assert llm.engine.executor.runner.graphs is None
    (warning,) = [r.getMessage() for r in caplog.records
                  if r.levelno >= logging.WARNING and r.name.startswith("shoal")]
    assert warning.startswith("compiled decode off: compiling failed")
    ids = prompts_of([5])[0]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(path, ids, 8)


@pytest.mark.slow
def test_shoal_serve_compiles_decode_by_default(checkpoint_factory, tmp_path):
    """`shoal serve` as a user starts it, on Gemma 2 (its family's one run through the whole
    path): compiled decode by default, then a chat answer as tests/test_model_families.py's
    check_served expects (chat template, generation_config.json's sampling defaults and EOS)."""
    path, chat_ids, answer = served_checkpoint(checkpoint_factory, tmp_path, "gemma2")
    port, log = free_port(), tmp_path / "serve.log"
    env = {k: v for k, v in loopback_env().items() if k != "SHOAL_EAGER_DECODE"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "shoal"), "serve", "--model-path", str(path),
             "--host", "127.0.0.1", "--port", str(port), "--decode-progress-interval-s", "0.5"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_process_ready(url, proc, log)
        prompts = prompts_of([7, 19])

        def complete(ids):
            return httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "", "prompt": ids, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})

        with ThreadPoolExecutor(2) as pool:  # together, so decode steps have 2 rows (compiled)
            responses = list(pool.map(complete, prompts))
        for r, ids in zip(responses, prompts):
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == hf_greedy(path, ids, 40)
        check_served(url, "gemma2", path, chat_ids, answer)
    finally:
        code, outliving = stop_process(proc)
    assert code == 0 and not outliving
    text = log.read_text()
    assert "compiled decode ready in" in text and "graph=True" in text, text[-3000:]
    assert "sampling defaults from the model's generation_config.json: temperature=0.0, top_p=0.5" in text
