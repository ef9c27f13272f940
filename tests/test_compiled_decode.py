"""Compiled decode on CPU (actors/worker/compiled_decode.py): decode-only steps through torch.compile.

The suite runs eagerly (conftest sets SHOAL_EAGER_DECODE=1: compiling costs seconds per engine
start); these tests turn compilation on and hold it to the oracle: greedy tokens equal
transformers' token for token, log-probs equal an eager engine's, on mixed batches whose
contexts cross blocks (a batch of one decodes eagerly, by design). They follow the compiled
step's life: an engine decodes eagerly while its job compiles, swaps the artifact in, a later
engine loads it from disk (when idle, or mid-run once eager steps have cost enough), a job dies
with its engine, and a failed compile or a broken artifact leaves eager decoding. Other options
decode compiled like their eager engines: 8-bit weights (w8a8_int8 up to its flips), an fp8 KV
cache, bfloat16 (bit for bit); speculative verify steps run through the graph, one row per draft
position. The slow test
starts `shoal serve` the way a user does (compiled is the default) and reads the progress line
it logs.
"""
from __future__ import annotations

import gc
import importlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
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
from actors.worker import model_runner
from actors.core.step import SchedulerOutput, StepRow
from actors.worker.compiled_decode import MAX_CHUNK_CONTEXT, CompiledDecode, compilable, logit_index
from actors.worker.model_spec import cpu_has_matmul

OPTIONS = dict(block_size=4, num_kv_blocks=128, max_num_seqs=8)
REPO = Path(__file__).resolve().parent.parent


def compiled_llm(path, wait: bool = True, compile_at_start: bool = True, **options) -> LLM:
    """An engine that compiles its decode step (the suite's SHOAL_EAGER_DECODE=1 lifted);
    compile_at_start: its job starts as it loads (SHOAL_COMPILE_AFTER_S=0; by default an engine
    waits for an idle moment or 10 s of eager decode); wait: until its compiled step is in use."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SHOAL_EAGER_DECODE", raising=False)
        if compile_at_start:
            mp.setenv("SHOAL_COMPILE_AFTER_S", "0")
        llm = LLM(str(path), **{**OPTIONS, **options})
    if wait:
        llm.engine.executor.runner.finish_compiling(timeout=600)
    return llm


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.fixture(scope="module")
def failing_start(checkpoint_factory, tmp_path_factory):
    """An engine whose compile job has no working C++ compiler (inductor's, from CXX), in a
    compile cache of its own; started with `first_starts`' so the jobs share the wait."""
    importlib.import_module("torch._inductor.config")  # reads CXX now: the bogus one below is the job's alone

    cache = tmp_path_factory.mktemp("failing-compile")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHOAL_COMPILE_CACHE", str(cache))
        mp.setenv("CXX", "/nonexistent/c++")
        mp.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")  # nothing compiled earlier may be reused
        mp.setenv("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
        path = checkpoint_factory("llama")
        return path, compiled_llm(path, wait=False), cache


# The compiled checks of other options, their engines started beside first_starts' so that
# every compile job of this module's fixtures shares one wait (each job alone leaves a core
# idle): 8-bit weights (tests/test_quantization.py's quantized engines), an fp8 KV cache with
# checkpoint scales (tests/test_fp8_kv_cache.py's), bfloat16. case -> engine options.
VARIANTS = {
    "int8": dict(quantization="int8", dtype="float32"),
    "fp8": dict(quantization="fp8", dtype="float32"),
    "fp8-kv": dict(kv_cache_dtype="fp8", block_size=4, num_kv_blocks=64, max_num_seqs=4),
    "bf16": dict(dtype="bfloat16"),  # a tied head (its lookups read the bf16 pairs, where the CPU has them)
    "int8-bf16": dict(dtype="bfloat16", quantization="int8"),  # bf16 activations into the 8-bit kernel
    "w8a8-llama": dict(quantization="w8a8_int8", dtype="float32"),
    "w8a8-qwen3": dict(quantization="w8a8_int8", dtype="float32"),  # a tied head
}
BF16_MATMULS = pytest.mark.skipif(not cpu_has_matmul(torch.bfloat16),
                                  reason="no bf16 matmuls on this CPU: bf16 computes in float32")


@pytest.fixture(scope="module")
def variant_starts(checkpoint_factory, tmp_path_factory) -> dict:
    """VARIANTS' engines, compiling in the background: case -> (checkpoint, engine; for fp8-kv
    also its KV scales). The fp8 KV one compiles into a cache of its own (its artifact is
    named by the scales)."""
    from test_fp8_kv_cache import KV_SCALES, with_kv_scales

    starts = {}
    for case, options in VARIANTS.items():
        if case in ("bf16", "int8-bf16") and not cpu_has_matmul(torch.bfloat16):
            continue
        with pytest.MonkeyPatch.context() as mp:
            if case == "fp8-kv":
                path = with_kv_scales(checkpoint_factory("llama"), tmp_path_factory.mktemp("fp8kv") / "llama", KV_SCALES)
                mp.setenv("SHOAL_COMPILE_CACHE", str(tmp_path_factory.mktemp("fp8kv-compiled")))
            elif case in ("w8a8-qwen3", "bf16"):
                path = checkpoint_factory("qwen3", tie_word_embeddings=True)
            else:
                path = checkpoint_factory("llama")
            starts[case] = path, compiled_llm(path, wait=False, **options)
    return starts


@pytest.fixture(scope="module")
def variant(variant_starts):
    """`variant(case) -> (checkpoint, engine decoding compiled)`."""
    def get(case):
        path, llm = variant_starts[case]
        runner = llm.engine.executor.runner
        runner.finish_compiling(timeout=600)
        assert isinstance(runner.graphs, CompiledDecode), (case, runner.graphs_off)
        return path, llm
    return get


@pytest.fixture(scope="module")
def first_starts(checkpoint_factory, failing_start, variant_starts) -> dict:
    """Both families' engines started at once (beside failing_start's and variant_starts'), so
    their compile jobs share the wait: family -> (checkpoint, engine, what its first start did
    while its job ran)."""
    # Gemma 3 with a final soft-cap: windows, local rotary, per-head (1 + w) norms, capped
    # logits and a head size that is not hidden / heads, all inside the traced step
    starts = {}
    for family in ("llama", "gemma3"):
        path = checkpoint_factory(family, **(GEMMA_EVERYTHING if family == "gemma3" else {}))
        starts[family] = path, compiled_llm(path, wait=False)  # this run's own compile cache: no artifact yet
    for family, (path, llm) in starts.items():
        runner = llm.engine.executor.runner
        job = runner.pending_compile.job
        prompts = prompts_of([4, 11, 2], seed=5)
        meanwhile = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        starts[family] = path, llm, dict(
            graphs=runner.graphs, job_running=job is not None and not job.done(), prompts=prompts,
            tokens=[o.outputs[0].token_ids for o in meanwhile], replays=runner.graph_replays)
    return starts


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def compiled(request, first_starts):
    """(checkpoint, engine decoding compiled, what its first start did while its job ran)."""
    path, llm, start = first_starts[request.param]
    runner = llm.engine.executor.runner
    runner.finish_compiling(timeout=600)
    assert type(runner.graphs).__name__ == "CompiledDecode", runner.graphs_off
    return path, llm, start


def test_a_first_start_decodes_eagerly_while_its_job_compiles(compiled):
    path, llm, start = compiled
    assert start["graphs"] is None and start["job_running"] and start["replays"] == 0
    assert start["tokens"] == [hf_greedy(path, p, 6) for p in start["prompts"]]
    assert llm.engine.executor.runner.pending_compile is None


def test_a_later_start_loads_the_artifact_when_idle(compiled):
    path, _, _ = compiled
    llm = compiled_llm(path, wait=False)
    runner = llm.engine.executor.runner
    assert runner.graphs is None and runner.pending_compile.job is None  # on disk: no job
    runner.idle()
    assert isinstance(runner.graphs, CompiledDecode)
    prompts = prompts_of([3, 8], seed=6)
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert runner.graph_replays > 0
    assert [o.outputs[0].token_ids for o in out] == [hf_greedy(path, p, 8) for p in prompts]


def test_a_busy_first_start_starts_its_job_once_eager_steps_have_cost_enough(checkpoint_factory, tmp_path,
                                                                             monkeypatch):
    """The default: a run shorter than SHOAL_COMPILE_AFTER_S (10 s) of eager decode starts no
    compile job (it would not live to use it: an offline batch, say); past it the job starts
    mid-run; an idle engine starts it at once."""
    monkeypatch.setenv("SHOAL_COMPILE_CACHE", str(tmp_path))
    path = checkpoint_factory("llama")
    prompts = prompts_of([5, 9], seed=8)
    llm = compiled_llm(path, wait=False, compile_at_start=False)
    runner = llm.engine.executor.runner
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in out] == [hf_greedy(path, p, 8) for p in prompts]
    assert runner.pending_compile.job is None and runner.pending_compile.spec is not None
    monkeypatch.setenv("SHOAL_COMPILE_AFTER_S", "1e-4")  # below any real eager step (read as an engine starts)
    busy = compiled_llm(path, wait=False, compile_at_start=False)
    runner = busy.engine.executor.runner
    assert runner.pending_compile.job is None
    busy.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert runner.pending_compile.job is not None and runner.pending_compile.spec is None
    monkeypatch.delenv("SHOAL_COMPILE_AFTER_S")
    idle = compiled_llm(path, wait=False, compile_at_start=False).engine.executor.runner
    assert idle.pending_compile.job is None
    idle.idle()
    assert idle.pending_compile.job is not None


def test_a_busy_engine_swaps_it_in_once_eager_steps_have_cost_enough(compiled, monkeypatch):
    path, _, _ = compiled
    # below any real eager step: the first one costs enough (at 0.02 s, a fast CPU decoded the
    # whole run in fewer eager seconds and never swapped)
    monkeypatch.setattr(model_runner, "SWAP_AFTER_S", 1e-4)
    llm = compiled_llm(path, wait=False)
    runner = llm.engine.executor.runner
    prompts = prompts_of([5, 9, 2, 13], seed=7)
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert isinstance(runner.graphs, CompiledDecode) and 0 < runner.graph_replays < 23  # swapped mid-run
    assert [o.outputs[0].token_ids for o in out] == [hf_greedy(path, p, 24) for p in prompts]


def test_eager_decode_by_option_or_environment(checkpoint_factory, monkeypatch):
    path = checkpoint_factory("llama")
    assert LLM(str(path), **OPTIONS).engine.executor.runner.graphs_off == "--eager-decode"  # the suite's variable
    monkeypatch.delenv("SHOAL_EAGER_DECODE")
    assert LLM(str(path), eager_decode=True, **OPTIONS).engine.executor.runner.graphs_off == "--eager-decode"


def test_compiled_decode_equals_transformers_and_eager(compiled):
    path, llm, _ = compiled
    eager = LLM(str(path), **OPTIONS)  # SHOAL_EAGER_DECODE=1
    prompts = prompts_of([3, 9, 30, 1, 5, 14])  # 6 rows; contexts cross blocks of 4 as they grow
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    progress = DecodeProgress(llm.engine)
    before = llm.engine.executor.runner.graph_replays
    got, want = llm.generate(prompts, params), eager.generate(prompts, params)
    assert llm.engine.executor.runner.graph_replays > before and "graph=True" in progress.line()
    assert_equals_eager_and_hf(path, prompts, got, want, 16)
    assert "graph=False" in progress.line()  # nothing decoded since


@BF16_MATMULS
@pytest.mark.parametrize("case", ["bf16", "int8-bf16"])
def test_compiled_bfloat16_decode_equals_eager_bfloat16(variant, case):
    """bf16 compiled decode rounds to bfloat16 after every op as eager does (inductor's
    emulate_precision_casts; eager bf16 is held to transformers bf16 in tests/test_bf16.py), and
    both multiply in the same packed bf16 kernel (shoal's pairs kernel on AVX512-BF16 CPUs
    without AMX, whose tied head's lookups read the pairs, else oneDNN's): the same tokens and
    log-probs. Without the rounding a real model's outliers set the two apart (SmolLM2: 8 of 28
    in a logit) and close calls chose differently. With int8 weights (int8-bf16) the product is
    the opaque 8-bit op on bf16 activations in both.

    A step with prompt chunks (here a 1-token prompt's row beside the others' chunks) runs
    through the graph too, its chunks' attention as decode rows where eager takes SDPA: in
    bfloat16 that rounds differently, so there the tokens are equal and the log-probs within
    tests/test_bf16.py's floor for two bf16 implementations, 0.05 (float32 holds them to 1e-4:
    test_steps_with_prompt_chunks_run_compiled_like_eager)."""
    path, llm = variant(case)
    eager = LLM(str(path), **{**OPTIONS, **VARIANTS[case]})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    for lengths, tolerance in (([3, 9, 30, 2, 5, 14], 1e-5), ([3, 9, 30, 1, 5, 14], 0.05)):
        prompts = prompts_of(lengths, seed=8)
        before = llm.engine.executor.runner.graph_replays
        for got, want in zip(llm.generate(prompts, params), eager.generate(prompts, params)):
            got, want = got.outputs[0], want.outputs[0]
            assert got.token_ids == want.token_ids
            for tok, lp, wlp in zip(got.token_ids, got.logprobs, want.logprobs):
                assert abs(lp[tok] - wlp[tok]) <= tolerance, (lengths, lp[tok], wlp[tok])
        assert llm.engine.executor.runner.graph_replays > before


@BF16_MATMULS
def test_prompt_logprobs_do_not_change_when_the_compiled_step_is_loaded(variant):
    """/loglikelihood and echo: a prompt's log-probs from a bf16 engine decoding compiled are the
    eager engine's, bit for bit, alone and beside decoding rows; the generated tokens too."""
    path, llm = variant("bf16")
    eager = LLM(str(path), **{**OPTIONS, **VARIANTS["bf16"]})
    try:
        prompts = prompts_of([3, 9, 30, 2, 5, 14], seed=9)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=1)
        before = llm.engine.executor.runner.graph_replays
        for got, want in zip(llm.generate(prompts, params), eager.generate(prompts, params)):
            assert got.prompt_logprobs == want.prompt_logprobs
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert llm.engine.executor.runner.graph_replays > before  # the decodes after the prompts: compiled
    finally:
        eager.shutdown()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_compiled_decode_runs_8_bit_weights_like_eager(kind, variant, tmp_path):
    """(From tests/test_quantization.py.) Compiled decode (the default) calls the 8-bit kernel
    as the opaque op shoal::quantized_linear: tokens equal transformers' on the dequantised
    weights and the eager quantized engine's, log-probs within 1e-4 of eager's."""
    from checkpoints import quantized_reference_copy

    path, compiled = variant(kind)
    reference = quantized_reference_copy(path, tmp_path / f"{kind}-reference", kind)
    eager = LLM(str(path), **{**OPTIONS, **VARIANTS[kind]})
    try:
        prompts = prompts_of([3, 9, 30, 1, 5, 14])
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
        before = compiled.engine.executor.runner.graph_replays
        got, want = compiled.generate(prompts, params), eager.generate(prompts, params)
        assert compiled.engine.executor.runner.graph_replays > before
        assert_equals_eager_and_hf(reference, prompts, got, want, 16)
    finally:
        eager.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_decode_runs_w8a8_like_eager(arch, variant, tmp_path):
    """(From tests/test_w8a8.py.) Compiled decode calls the product as the opaque op
    shoal::w8a8_linear. Both follow transformers up to flips (test_w8a8's assert_greedy_up_to_flips).
    Against each other: inductor fuses the float ops around the op (norms, residuals) in its own
    order, so an activation can differ from eager's by a rounding (int8's weight-only path: < 3e-6
    in log p), and a flip now and then moves it by a step: while their tokens agree, log-probs
    within FLIP and most within 1e-4."""
    from checkpoints import quantized_reference_copy
    from test_w8a8 import FLIP, assert_greedy_up_to_flips

    from kernels.quantization import w8a8_cpu_kernel

    path, compiled = variant(f"w8a8-{arch}")
    reference = quantized_reference_copy(path, tmp_path / "w8a8-reference", "w8a8_int8")
    eager = LLM(str(path), **{**OPTIONS, **VARIANTS[f"w8a8-{arch}"]})
    try:
        assert compiled.engine.executor.runner.kernels.linear == f"w8a8_int8-{w8a8_cpu_kernel()}"
        prompts = prompts_of([3, 9, 30, 1, 5, 14])
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
        before = compiled.engine.executor.runner.graph_replays
        got, want = compiled.generate(prompts, params), eager.generate(prompts, params)
        assert compiled.engine.executor.runner.graph_replays > before
        for outs in (got, want):
            assert_greedy_up_to_flips(reference, prompts, outs)
        deltas = []
        for g, w in zip(got, want, strict=True):
            for tg, tw, lg, lw in zip(g.outputs[0].token_ids, w.outputs[0].token_ids, g.outputs[0].logprobs,
                                      w.outputs[0].logprobs, strict=True):
                deltas.append(abs(lg[tw] - lw[tw]) if tw in lg else FLIP)
                if tg != tw:
                    break
        assert max(deltas) < FLIP
        assert sum(d < 1e-4 for d in deltas) >= 0.75 * len(deltas), sorted(deltas)
    finally:
        eager.shutdown()


def test_compiled_cpu_decode_over_fp8_blocks(variant):
    """(From tests/test_fp8_kv_cache.py.) CPU's compiled decode step (traced by a job that reads
    no weights but does read the KV scales, which the step holds as constants; the artifact is
    named by them): its tokens and log-probs are the eager fp8 engine's, which are the
    round-tripped oracle's."""
    from test_fp8_kv_cache import KV_SCALES, check_against_round_tripped_hf

    path, compiled = variant("fp8-kv")
    runner = compiled.engine.executor.runner
    assert runner.kernels.decode == "compiled" and runner.graphs is not None
    prompts = prompts_of([5, 12, 9], seed=11)
    got = check_against_round_tripped_hf(path, compiled, prompts, scales=KV_SCALES, logprobs=False)
    assert runner.graphs.replays > 0
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    eager = LLM(str(path), **VARIANTS["fp8-kv"]).generate(prompts, params)
    for g, w in zip(compiled.generate(prompts, params), eager):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert max(abs(lg[t] - lw[t]) for t in lw) < 1e-4
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in eager]


def test_two_requests_compile_one_runs_eagerly_and_blocks_come_back(compiled):
    path, llm, _ = compiled
    prompts = prompts_of([6, 2], seed=3)  # the 2-token prompt's table pads to 2 blocks at first
    replays = llm.engine.executor.runner.graph_replays
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 6)]
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [hf_greedy(path, p, n) for p, n in zip(prompts, (12, 6))]
    # 5 decode steps with both rows ran compiled; the first request's last 6 alone ran eagerly.
    assert llm.engine.executor.runner.graph_replays - replays == 5
    assert llm.engine.blocks.num_free_blocks == OPTIONS["num_kv_blocks"]  # the spare one is outside the pool


def test_speculative_verify_steps_run_compiled_like_plain_decode(compiled):
    """A verify step (each row's last token and its drafts) runs through the compiled graph,
    each draft's position a decode row of its own (input_batch.padded_decode): greedy output
    stays transformers' token for token and the log-probs the plain compiled engine's."""
    path, plain, _ = compiled
    spec = compiled_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    spec.engine.scheduler.speculator.compared_steps = 10**9  # drafts whether or not they pay here
    graphs = spec.engine.executor.runner.graphs
    drafts_run, run = [], graphs.run

    def counted(output, *args, **kwargs):  # the drafted tokens each compiled step took
        drafts_run.append(sum(len(r.token_ids) - 1 for r in output.rows))
        return run(output, *args, **kwargs)

    graphs.run = counted
    prompts = prompts_of([5, 7, 4], seed=0) + prompts_of([5], seed=2)  # outputs that repeat a few n-grams
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    try:
        got, want = spec.generate(prompts, params), plain.generate(prompts, params)
        assert sum(drafts_run) > 0 and spec.engine.scheduler.speculator.num_accepted_tokens > 0
        for prompt, g, w in zip(prompts, got, want, strict=True):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids == hf_greedy(path, prompt, 48)
            for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
                assert all(lg[t] == pytest.approx(lw[t], rel=1e-5, abs=1e-5) for t in lw)
    finally:
        spec.shutdown()


def test_steps_with_prompt_chunks_run_compiled_like_eager(compiled):
    """A step with prompt chunks beside decodes runs through the graph, each prompt token a decode
    row reading the context up to its own position, and the LM head only on the rows sampled
    from: tokens equal transformers' and the eager engine's, log-probs the eager engine's. A step
    of prompts alone runs eagerly, and so does one whose chunks give prompt log-probs: those
    are the eager engine's exactly."""
    path, _, _ = compiled
    # Prompts in chunks of at most 12 tokens, beside the streams that already decode.
    llm = compiled_llm(path, max_num_batched_tokens=12)
    eager = LLM(str(path), **{**OPTIONS, "max_num_batched_tokens": 12})
    graphs = llm.engine.executor.runner.graphs
    kinds, run = [], graphs.run

    def counted(output, *args, **kwargs):
        kinds.append(("mixed" if output.num_decodes else "prompts") if output.num_decodes < len(output.rows)
                     else "decode")
        return run(output, *args, **kwargs)

    graphs.run = counted
    prompts = prompts_of([3, 9, 30, 1, 5, 14, 23], seed=12)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    try:
        got, want = llm.generate(prompts, params), eager.generate(prompts, params)
        assert "mixed" in kinds and "decode" in kinds and "prompts" not in kinds, kinds
        assert_equals_eager_and_hf(path, prompts, got, want, 10)
        kinds.clear()
        with_prompts = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2, prompt_logprobs=1)
        got, want = llm.generate(prompts, with_prompts), eager.generate(prompts, with_prompts)
        assert "mixed" not in kinds and "decode" in kinds, kinds
        assert_equals_eager_and_hf(path, prompts, got, want, 10)
        for g, w in zip(got, want, strict=True):
            assert g.prompt_logprobs[0] is None and g.prompt_logprobs == w.prompt_logprobs
        assert llm.engine.blocks.num_free_blocks == OPTIONS["num_kv_blocks"]
    finally:
        llm.shutdown()
        eager.shutdown()


def test_which_steps_the_compiled_graph_takes():
    decode = lambda seq: StepRow(seq, [5], 3)  # noqa: E731
    assert compilable(SchedulerOutput([decode(1), decode(2)], 2, [0, 1]), 8)
    assert not compilable(SchedulerOutput([decode(1)], 1, [0]), 8)  # one row: MKL's matrix-vector path
    verify = SchedulerOutput([decode(1), StepRow(2, [4, 5, 6], 2)], 1, [0, 1, 2, 3])  # every token sampled from
    assert compilable(verify, 8) and compilable(SchedulerOutput(verify.rows[1:], 0, [0, 1, 2]), 8)
    assert not compilable(verify, 3)  # 4 token rows
    prompt_chunk = SchedulerOutput([decode(1), StepRow(2, [4, 5, 6], 0)], 1, [0, 3])  # only its last token's logits
    assert compilable(prompt_chunk, 8)
    assert not compilable(SchedulerOutput(prompt_chunk.rows[1:], 0, [2]), 8)  # prompts alone: nobody waits
    # A chunk ending past MAX_CHUNK_CONTEXT: its tokens would each read the whole context.
    late = SchedulerOutput([decode(1), StepRow(2, [4, 5, 6], MAX_CHUNK_CONTEXT - 2)], 1, [0, 3])
    assert not compilable(late, 8)
    assert compilable(SchedulerOutput([decode(1), StepRow(2, [4, 5, 6], MAX_CHUNK_CONTEXT - 3)], 1, [0, 3]), 8)
    # A prompt's log-probs (every token's logits, as a verify chunk's) come from prefill attention.
    logprobs = SchedulerOutput([decode(1), StepRow(2, [4, 5, 6], 0)], 1, [0, 1, 2, 3], prompt_logprobs=True)
    assert not compilable(logprobs, 8) and not any(part.prompt_logprobs is False for part in logprobs.split(2))


def test_rows_pad_to_a_few_bucket_sizes(compiled):
    """oneDNN keeps a kernel per row count it meets (kernels/linear.py), so the compiled step
    pads its rows to the capture sizes plus --max-num-seqs (8 here): 2, 4, 8; then, for steps
    with prompt chunks, multiples of 32 up to 512 rows past it. The logits' rows pad likewise."""
    _, llm, _ = compiled
    graphs = llm.engine.executor.runner.graphs
    assert graphs.sizes == [2, 4, 8, *range(32, 520 + 1, 32)]
    assert CompiledDecode(None, sizes=[1, 2, 4, 8, 10], block_size=4).sizes == [2, 4, 8, 10, *range(32, 522 + 1, 32)]
    assert logit_index([0, 1, 2], 3, graphs.sizes).tolist() == [0, 1, 2, 3]  # a decode step's rows, padded
    assert logit_index([3, 9, 10], 11, graphs.sizes).tolist() == [3, 9, 10, 0]
    # What the pacer fills with prompt tokens (actors/core/step_times.py); an eager step pads nothing.
    executor = llm.engine.executor
    assert [executor.padded_rows(n) for n in (3, 8, 9, 40, 520, 521)] == [4, 8, 32, 64, 520, 521]
    assert llm.engine.scheduler.pacer.padded_rows == executor.padded_rows
    graphs_now, executor.runner.graphs = executor.runner.graphs, None
    try:
        assert executor.padded_rows(9) == 9
    finally:
        executor.runner.graphs = graphs_now


def test_a_failed_compile_falls_back_to_eager(failing_start, first_starts, caplog):
    """No working C++ compiler for the job: the engine says why once and decodes eagerly."""
    path, llm, cache = failing_start
    with caplog.at_level(logging.INFO):
        llm.engine.executor.runner.finish_compiling(timeout=600)
    assert llm.engine.executor.runner.graphs is None and not list(cache.glob("*.bin"))
    (warning,) = [r.getMessage() for r in caplog.records
                  if r.levelno >= logging.WARNING and r.name.startswith("shoal")]
    assert warning.startswith("compiled decode off: compiling failed (exit 1: "), warning
    ids = prompts_of([5])[0]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(path, ids, 8)


def test_a_broken_artifact_is_dropped_and_decoding_stays_eager(checkpoint_factory, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SHOAL_COMPILE_CACHE", str(tmp_path))
    path = checkpoint_factory("llama")
    first = compiled_llm(path, wait=False)  # finds nothing: its job starts (and dies with it)
    runner = first.engine.executor.runner
    artifact = runner.pending_compile.path
    del first, runner
    gc.collect()
    artifact.write_bytes(b"not a compiled step")
    with caplog.at_level(logging.INFO):
        llm = compiled_llm(path, wait=False)
        assert llm.engine.executor.runner.pending_compile.job is None  # it trusts the file until loading
        llm.engine.executor.runner.idle()
    assert llm.engine.executor.runner.graphs is None and not artifact.exists()
    assert any(r.getMessage().startswith("compiled decode off: compiling failed (its artifact did not load")
               for r in caplog.records)
    ids = prompts_of([5, 3])
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in out] == [hf_greedy(path, i, 6) for i in ids]


def test_the_job_dies_with_its_engine(checkpoint_factory, tmp_path, monkeypatch):
    """The job runs under SCHED_IDLE (and nice 19). Freed engine: its job is killed at once.
    Killed process (SIGKILL, no clean-up): the job notices its parent is gone within a few
    seconds."""
    monkeypatch.setenv("SHOAL_COMPILE_CACHE", str(tmp_path))
    path = checkpoint_factory("llama")
    llm = compiled_llm(path, wait=False)
    runner = llm.engine.executor.runner
    pid = runner.pending_compile.job.proc.pid
    assert alive(pid)
    deadline = time.monotonic() + 30  # it lowers its priority as it starts: below every engine thread
    while os.sched_getscheduler(pid) != os.SCHED_IDLE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.sched_getscheduler(pid) == os.SCHED_IDLE and os.getpriority(os.PRIO_PROCESS, pid) == 19
    job = tmp_path / "job.pkl"  # the same job, for a parent that is then SIGKILLed
    job.write_bytes(pickle.dumps((runner.config, llm.engine.spec, runner.block_size, tmp_path / "decode-x.bin")))
    del llm, runner
    gc.collect()
    assert not alive(pid)

    script = ("import os, subprocess, sys, time; "
              f"job = subprocess.Popen([sys.executable, '-m', 'actors.worker.compile_job', {str(job)!r}, str(os.getpid())]); "
              "print(job.pid, flush=True); time.sleep(600)")
    engine = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(engine.stdout.readline())
        assert alive(pid)
        engine.send_signal(signal.SIGKILL)
        engine.wait()
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(pid)
    finally:
        engine.kill()
        engine.wait()


@pytest.mark.slow
def test_shoal_serve_compiles_decode_by_default(checkpoint_factory, tmp_path):
    """`shoal serve` as a user starts it, on Gemma 2 (its family's one run through the whole
    path): a chat answer as tests/test_model_families.py's check_served expects (chat template,
    generation_config.json's sampling defaults and EOS) while the decode step compiles in the
    background; then, the server idle, the compiled step swapped in, and decoding through it."""
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
        check_served(url, "gemma2", path, chat_ids, answer)
        deadline = time.monotonic() + 600
        while "compiled decode ready: loaded" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
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
    finally:
        code, outliving = stop_process(proc)
    assert code == 0 and not outliving
    text = log.read_text()
    assert "compiling the decode step in the background" in text and "graph=True" in text, text[-3000:]
    assert "sampling defaults from the model's generation_config.json: temperature=0.0, top_p=0.5" in text


def test_the_cache_folder_keeps_the_newest_artifacts(tmp_path):
    """Beyond the newest `keep`, old artifacts go; none written in the last hour does (more
    engines than `keep` compiling at once each find their own: the every-family test below
    starts 22)."""
    import time

    from actors.worker.compile_job import prune

    for i in range(5):
        (tmp_path / f"decode-{i}.bin").write_bytes(b"x")
        os.utime(tmp_path / f"decode-{i}.bin", (1000 + i, 1000 + i))
    for i in range(3):
        (tmp_path / f"decode-fresh-{i}.bin").write_bytes(b"x")
        os.utime(tmp_path / f"decode-fresh-{i}.bin", (time.time() - 60,) * 2)
    (tmp_path / "other.txt").write_text("kept")
    prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "decode-fresh-0.bin", "decode-fresh-1.bin", "decode-fresh-2.bin", "other.txt"]


# The dense families not covered above (llama and the Gemma 3 with every twist): each family's
# own twists (sliding windows, soft-caps, q/k norms, post-norms, fused projections, partial
# rotary, scaled residuals) inside the traced step.
OTHER_DENSE = ("mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2", "olmo3", "granite", "glm4",
               "smollm3", "ernie4_5", "exaone4", "cohere", "starcoder2", "gpt2", "nemotron", "ministral3", "glm",
               "helium", "apertus", "falcon", "gemma4")
# (their one layer: without rotary; sliding, with its own rotary; global, without rotary; Gemma 4's
# global one: wide heads whose values are their keys, the proportional rotary)
ONE_LAYER = {"smollm3": dict(no_rope_layers=[0]), "olmo3": dict(layer_types=["sliding_attention"]),
             "exaone4": dict(layer_types=["full_attention"]), "gemma4": dict(layer_types=["full_attention"])}


@pytest.mark.slow
def test_every_dense_family_decodes_compiled_like_transformers(checkpoint_factory):
    """Compiled decode, the CPU default, for every dense family once: greedy tokens equal
    transformers' and an eager engine's, log-probs within 1e-4 of eager's. The engines start
    together so their compile jobs overlap. MoE families decode eagerly on CPU by design: the
    default says so as its reason."""
    engines = {family: compiled_llm(checkpoint_factory(family, num_hidden_layers=1, **ONE_LAYER.get(family, {})),
                                    wait=False)
               for family in OTHER_DENSE}
    try:
        prompts = prompts_of([3, 9, 30, 1, 5])
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
        for family, llm in engines.items():
            runner = llm.engine.executor.runner
            runner.finish_compiling(timeout=600)
            assert isinstance(runner.graphs, CompiledDecode), (family, runner.graphs_off)
            eager = LLM(str(llm.engine.model_path), **OPTIONS)
            before = runner.graph_replays
            got, want = llm.generate(prompts, params), eager.generate(prompts, params)
            assert runner.graph_replays > before, family
            assert_equals_eager_and_hf(llm.engine.model_path, prompts, got, want, 10)
            eager.shutdown()
    finally:
        for llm in engines.values():
            llm.shutdown()
    moe = compiled_llm(checkpoint_factory("qwen3_moe"), wait=False)
    try:
        assert moe.engine.executor.runner.graphs_off.startswith("mixture-of-experts layers")
    finally:
        moe.shutdown()
