"""Tensor and pipeline parallel shards (Ray actors, gloo) give transformers' outputs exactly."""
import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
from oracle import hf_greedy, hf_hidden_states, hf_prompt_logprobs  # noqa: E402
from test_engine import assert_pool_free, prompts_of  # noqa: E402

from actors.engine.llm import LLM  # noqa: E402
from actors.pooling_params import PoolingParams  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False)
    yield
    ray.shutdown()


def check_layout(path, prompts, **layout):
    llm = LLM(str(path), num_kv_blocks=64, block_size=4, max_num_batched_tokens=24, shard_cpus=0.5, **layout)
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
    finally:
        llm.shutdown()


LAYOUTS = {"tp2": dict(tp_size=2), "pp2": dict(pp_size=2), "tp2xpp2": dict(tp_size=2, pp_size=2)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_llama_layouts_match_transformers(checkpoint_factory, layout):
    path = checkpoint_factory("llama", num_hidden_layers=3)
    check_layout(path, prompts_of([5, 30, 13, 2]), **LAYOUTS[layout])


def test_qwen3_tp2_and_tied_qwen2_pp2(checkpoint_factory):
    check_layout(checkpoint_factory("qwen3"), prompts_of([9, 21]), tp_size=2)
    check_layout(checkpoint_factory("qwen2", tie_word_embeddings=True), prompts_of([9, 21]), pp_size=2)


def test_kv_heads_replicated_when_fewer_than_ranks_and_uneven_split(checkpoint_factory):
    path = checkpoint_factory("llama", num_hidden_layers=3, num_key_value_heads=1)
    check_layout(path, prompts_of([11, 4]), tp_size=2, pp_size=2, pp_layer_split="2,1")


def test_bad_layouts_fail_before_start(checkpoint_factory):
    with pytest.raises(ValueError, match="divide"):
        LLM(str(checkpoint_factory("llama")), tp_size=3)
    with pytest.raises(ValueError, match="pp-layer-split"):
        LLM(str(checkpoint_factory("llama")), pp_size=2, pp_layer_split="1,2")
