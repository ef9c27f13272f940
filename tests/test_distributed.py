"""Tensor and pipeline parallel shards (Ray actors, gloo) give transformers' outputs exactly,
and every layout serves what users combine (prefix-cache hits, preemption, n > 1, seeded
sampling, structured output) with the same tokens as one rank."""
import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
from oracle import hf_greedy, hf_hidden_states, hf_prompt_logprobs  # noqa: E402
from test_engine import assert_pool_free, prompts_of  # noqa: E402

from actors.engine.llm import LLM  # noqa: E402
from actors.pooling_params import PoolingParams  # noqa: E402
from actors.sampling_params import SamplingParams, StructuredOutput  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False)
    yield
    ray.shutdown()


POOL = dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=24)  # chunked prefill, preemption


def feature_requests() -> list[tuple[list[int], SamplingParams]]:
    """Seeded n=2 and top-k/top-p sampling, a regex-constrained sample, and greedy rows long
    enough that together they outgrow POOL's 256 tokens (preemption)."""
    greedy = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    params = [SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=30,
                             structured=StructuredOutput("regex", "[a-z]{2,6}( [a-z]{2,6}){2}")),
              greedy, greedy, greedy]
    return list(zip(prompts_of([30, 28, 26, 24, 22, 20], seed=17), params))


def run_features(llm) -> tuple[list, int, int]:
    """(each request's samples as (token ids, text, finish reason), the preemptions they
    caused, prompt tokens a later request found in the prefix cache)."""
    requests, before = feature_requests(), llm.engine.scheduler.num_preemptions
    outs = llm.generate([ids for ids, _ in requests], [p for _, p in requests])
    again = llm.generate([requests[-1][0] + [3, 1, 4]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    samples = [[(o.token_ids, o.text, o.finish_reason) for o in out.outputs] for out in outs + again]
    return samples, llm.engine.scheduler.num_preemptions - before, again[0].num_cached_tokens


_one_rank: dict = {}


def check_features_match_one_rank(llm, path) -> None:
    """The layout engine `llm` (built with POOL) gives one rank's tokens for feature_requests,
    through preemption and a prefix-cache hit."""
    if path not in _one_rank:
        reference = LLM(str(path), **POOL)
        _one_rank[path] = run_features(reference)
    got, preemptions, cached = run_features(llm)
    want, want_preemptions, want_cached = _one_rank[path]
    assert got == want
    assert preemptions == want_preemptions > 0 and cached == want_cached >= 16
    assert_pool_free(llm)


def check_layout(path, prompts, features: bool = False, **layout):
    llm = LLM(str(path), **POOL, shard_cpus=0.5, **layout)
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
        outs = llm.generate(prompts, params)
        for ids, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy(path, ids, 12)
            ours = [next(iter(d.values())) for d in out.prompt_logprobs[1:]]
            assert ours == pytest.approx(hf_prompt_logprobs(path, ids), abs=1e-4)
        # Embeddings: pooled on the last stage, after the final norm, and sent back to rank 0.
        for ids, out in zip(prompts, llm.embed(prompts, PoolingParams(method="mean", normalize=False))):
            assert out.embedding == pytest.approx(hf_hidden_states(path, ids).mean(0).tolist(), abs=1e-5)
        assert_pool_free(llm)
        if features:
            check_features_match_one_rank(llm, path)
    finally:
        llm.shutdown()


LAYOUTS = {"tp2": dict(tp_size=2), "pp2": dict(pp_size=2), "tp2xpp2": dict(tp_size=2, pp_size=2)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_llama_layouts_match_transformers(checkpoint_factory, layout):
    path = checkpoint_factory("llama", num_hidden_layers=3)
    check_layout(path, prompts_of([5, 30, 13, 2]), features=True, **LAYOUTS[layout])


def test_qwen3_tp2_and_tied_qwen2_pp2(checkpoint_factory):
    check_layout(checkpoint_factory("qwen3"), prompts_of([9, 21]), tp_size=2)
    check_layout(checkpoint_factory("qwen2", tie_word_embeddings=True), prompts_of([9, 21]), pp_size=2)


def test_kv_heads_replicated_when_fewer_than_ranks_and_uneven_split(checkpoint_factory):
    path = checkpoint_factory("llama", num_hidden_layers=3, num_key_value_heads=1)
    check_layout(path, prompts_of([11, 4]), tp_size=2, pp_size=2, pp_layer_split="2,1")


def test_tp2_verifies_drafts_with_one_ranks_tokens(tmp_path):
    """Speculative decoding at tp=2 with a draft model (it runs unsharded beside rank 0) and
    at pp=2 with n-gram drafts: drafts verified as chunks across the shards, transformers'
    greedy tokens, and the rows that speculated emitted several tokens a step."""
    from test_speculative import COPY_TEXTS, DEMO, NGRAM, demo_draft
    for layout, speculative in (({"tp_size": 2}, demo_draft(tmp_path)), ({"pp_size": 2}, NGRAM)):
        llm = LLM(DEMO, dtype="float32", speculative_config=speculative, shard_cpus=0.5, **layout)
        try:
            prompts = [llm.encode(t) for t in COPY_TEXTS[:3]]
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
            for ids, out in zip(prompts, outs):
                assert out.outputs[0].token_ids == hf_greedy(DEMO, ids, 24)
            assert llm.engine.scheduler.speculator.num_accepted_tokens > 10
            assert_pool_free(llm)
        finally:
            llm.shutdown()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_tp2_quantizes_each_ranks_shard(checkpoint_factory, tmp_path, kind):
    """--quantization at tp=2: each rank quantizes its own shard, so a row-parallel layer's scales
    cover the rank's half of the input columns. transformers on the checkpoint dequantised that
    way gives the same greedy tokens and prompt log-probs (1e-4); the one-rank quantization
    would not (its log-probs differ), so the test tells the two apart."""
    from checkpoints import quantized_reference_copy
    path = checkpoint_factory("llama", num_hidden_layers=3)
    reference = quantized_reference_copy(path, tmp_path / "tp2", kind, tp=2)
    one_rank = quantized_reference_copy(path, tmp_path / "tp1", kind)
    llm = LLM(str(path), **POOL, shard_cpus=0.5, tp_size=2, quantization=kind, dtype="float32")
    try:
        prompts = prompts_of([5, 30, 13])
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
        apart = 0.0
        for ids, out in zip(prompts, llm.generate(prompts, params)):
            assert out.outputs[0].token_ids == hf_greedy(reference, ids, 12)
            ours = [next(iter(d.values())) for d in out.prompt_logprobs[1:]]
            assert ours == pytest.approx(hf_prompt_logprobs(reference, ids), abs=1e-4)
            apart = max(apart, max(abs(a - b) for a, b in zip(ours, hf_prompt_logprobs(one_rank, ids))))
        assert apart > 1e-3
        assert_pool_free(llm)
    finally:
        llm.shutdown()


def test_tp2_w8a8_int8_quantizes_each_ranks_share(checkpoint_factory, tmp_path):
    """w8a8_int8 at tp=2: each rank quantizes its weight shard and, in a row-parallel layer, its
    share of each activation row over its own scale. transformers on the checkpoint dequantised
    shard by shard, its row-parallel inputs quantized in halves, gives the same greedy tokens up
    to quantization flips (tests/test_w8a8.py)."""
    import statistics

    from checkpoints import quantized_reference_copy
    from test_w8a8 import assert_greedy_up_to_flips, int8_activations

    path = checkpoint_factory("llama", num_hidden_layers=3)
    reference = quantized_reference_copy(path, tmp_path / "tp2", "w8a8_int8", tp=2)
    llm = LLM(str(path), **POOL, shard_cpus=0.5, tp_size=2, quantization="w8a8_int8", dtype="float32")
    try:
        prompts = prompts_of([5, 30, 13])
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                    prompt_logprobs=0))
        assert_greedy_up_to_flips(reference, prompts, outs, tp=2)
        # Prompt log-probs (no path to diverge): near the per-rank reference, apart from the
        # reference that quantizes whole rows, so the test tells the two apart.
        deltas = {1: [], 2: []}
        for ids, out in zip(prompts, outs):
            ours = [next(iter(d.values())) for d in out.prompt_logprobs[1:]]
            for tp in deltas:
                with int8_activations(reference, tp):
                    deltas[tp] += [abs(a - b) for a, b in zip(ours, hf_prompt_logprobs(reference, ids))]
        # Measured: median 0 and largest 2e-6 against the per-rank reference, median 0.027 against
        # whole rows (a rounding can flip an activation by a step, so the median, not the largest).
        assert statistics.median(deltas[2]) < 1e-5, deltas[2]
        assert statistics.median(deltas[1]) > 1e-3, deltas[1]
        assert_pool_free(llm)
    finally:
        llm.shutdown()


def test_bad_layouts_fail_before_start(checkpoint_factory):
    with pytest.raises(ValueError, match="divide"):
        LLM(str(checkpoint_factory("llama")), tp_size=3)
    with pytest.raises(ValueError, match="pp-layer-split"):
        LLM(str(checkpoint_factory("llama")), pp_size=2, pp_layer_split="1,2")


@pytest.mark.parametrize("layout", [dict(tp_size=2), dict(pp_size=2)])
def test_a_step_that_breaks_on_rank_0_still_shuts_down(checkpoint_factory, layout):
    """A step that raises on rank 0 after it was broadcast leaves the shard ranks inside it
    (waiting on a collective, or for the first stage's activations), not listening for STOP:
    shutdown kills them instead of waiting for them forever (it once hung a test run)."""
    import time

    llm = LLM(str(checkpoint_factory("llama")), **POOL, shard_cpus=0.5, **layout)
    runner = llm.engine.executor.runner
    pids = [info["pid"] for info in llm.engine.executor.rank_infos()[1:]]

    def broken(*args, **kwargs):
        raise RuntimeError("a bug on rank 0, mid-step")
    runner.execute = broken
    with pytest.raises(RuntimeError, match="mid-step"):
        llm.generate(prompts_of([5]), SamplingParams(temperature=0, max_tokens=4))
    start = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - start < 30
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pids and not any(alive(pid) for pid in pids)


def alive(pid: int) -> bool:
    import os
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
