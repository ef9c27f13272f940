"""gpt-oss (actors/models/gpt_oss.py) against transformers in float32: greedy tokens equal and
prompt log-probs within 1e-4, through chunked prefill, preemption and a prefix-cache hit, at
tp=1 in process and with experts or widths split over two Ray shards; its MXFP4 checkpoints
load dequantised exactly as transformers dequantises them.

The tiny checkpoint (tests/checkpoints.py FAMILY_DEFAULTS["gpt_oss"]) turns each twist up so
that leaving it out changes transformers' own output (checked first): sinks of std 2, a window
of 8 keys on alternate layers, a SwiGLU limit of 2 that the experts reach, YaRN factor 32."""
import copy
import json
import os
import random

import pytest
import torch

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from checkpoints import mxfp4_copy  # noqa: E402
from oracle import hf_greedy, hf_model, hf_prompt_logprobs  # noqa: E402
from test_engine import assert_pool_free, prompts_of  # noqa: E402

from actors.engine.llm import LLM  # noqa: E402
from actors.models.args import ModelArgs  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402

SHARED = [random.Random(5).randrange(500) for _ in range(12)]
PROMPTS = prompts_of([5, 30, 13, 26], seed=2)
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0)


@pytest.fixture(scope="module")
def gpt_oss(checkpoint_factory):
    return checkpoint_factory("gpt_oss")


def assert_matches_hf(path, prompts, outs, logprobs: bool = True):
    for ids, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, ids, MAX_TOKENS), f"prompt of {len(ids)} tokens"
        if logprobs:
            ours = [next(iter(d.values())) for d in out.prompt_logprobs[1:]]
            assert ours == pytest.approx(hf_prompt_logprobs(path, ids), abs=1e-4)


def test_the_config_is_read(gpt_oss):
    a = ModelArgs.from_hf(json.loads((gpt_oss / "config.json").read_text()))
    assert a.attn_sinks and a.qkv_bias and a.o_bias and a.layer_windows == (8, None)
    assert (a.moe.num_experts, a.moe.top_k, a.moe.intermediate_size, a.moe.swiglu) == (8, 2, 32, (1.702, 2.0))
    assert a.rope.theta == 150000.0 and a.rope.scaling["rope_type"] == "yarn" and a.rope.scaling["factor"] == 32.0


@torch.inference_mode()
def test_each_twist_changes_transformers_output(gpt_oss):
    """Leaving out any of the twists changes the oracle's logits, so the parity tests below
    would catch a model that forgot one."""
    model = hf_model(gpt_oss)
    ids = torch.tensor([PROMPTS[1]])
    want = model(input_ids=ids).logits

    def without(change):
        m = copy.deepcopy(model)
        change(m)
        return (m(input_ids=ids).logits - want).abs().max().item()

    def no_sinks(m):
        for layer in m.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))

    def no_window(m):
        m.config.layer_types = ["full_attention"] * len(m.model.layers)

    def no_limit(m):
        for layer in m.model.layers:
            layer.mlp.experts.limit = 1e9

    def no_yarn(m):
        rotary = m.model.rotary_emb
        rotary.inv_freq.copy_(1.0 / 150000.0 ** (torch.arange(0, 16, 2).float() / 16))
        rotary.attention_scaling = 1.0

    for change in (no_sinks, no_window, no_limit, no_yarn):
        assert without(change) > 1e-2, change.__name__


def test_gpt_oss_matches_transformers(gpt_oss):
    """Chunks of 16 tokens, a pool too small for every row (preemption), then a prompt whose
    prefix is cached; decode rows and short continuation chunks through the C++ kernel."""
    llm = LLM(str(gpt_oss), block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)
    try:
        assert_matches_hf(gpt_oss, PROMPTS, llm.generate(PROMPTS, WITH_LOGPROBS))
        assert llm.engine.scheduler.num_preemptions > 0
        first, second = SHARED + [1, 2], SHARED + [7]
        outs = llm.generate([first], GREEDY) + llm.generate([second], GREEDY)
        assert_matches_hf(gpt_oss, [first, second], outs, logprobs=False)
        assert outs[1].num_cached_tokens >= 8
        assert_pool_free(llm)
    finally:
        llm.shutdown()


def test_mxfp4_checkpoint_loads_as_transformers_dequantises_it(gpt_oss, tmp_path_factory):
    """The experts in MXFP4 (`*_blocks` / `*_scales`): our dequantisation equals transformers'
    convert_moe_packed_tensors bit for bit, our experts hold exactly what transformers' loaded
    model holds (de-interleaved and transposed), and the engine's outputs equal transformers'
    on the same MXFP4 checkpoint. The quantization is visible (weights differ from the source)."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from actors.worker.mxfp4_checkpoint import dequantize

    path = mxfp4_copy(gpt_oss, tmp_path_factory.mktemp("mxfp4") / "gpt_oss-mxfp4")
    tensors = load_file(path / "model.safetensors")
    quantized = [n.removesuffix("_blocks") for n in tensors if n.endswith("_blocks")]
    assert len(quantized) == 4
    for name in quantized:
        blocks, scales = tensors[name + "_blocks"], tensors[name + "_scales"]
        assert torch.equal(dequantize(blocks, scales), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
    try:
        ours = llm.engine.executor.runner.model.model.layers[0].mlp.experts
        theirs = hf_model(path).model.layers[0].mlp.experts
        for e in range(8):
            w = theirs.gate_up_proj[e]
            assert torch.equal(ours.gate_up_proj[e], torch.cat((w[:, 0::2], w[:, 1::2]), 1).t())
            assert torch.equal(ours.down_proj[e], theirs.down_proj[e].t())
        assert not torch.equal(theirs.down_proj, hf_model(gpt_oss).model.layers[0].mlp.experts.down_proj)
        assert_matches_hf(path, PROMPTS[:2], llm.generate(PROMPTS[:2], WITH_LOGPROBS))
    finally:
        llm.shutdown()


def test_expert_slots_hold_their_experts_and_reload_after_a_replan(gpt_oss):
    """Rank 1 of ep=2 with 2 redundant slots (built in process, weights only): each slot holds
    its expert's de-interleaved, transposed projections and biases, as transformers' model holds
    them; after a re-plan that swaps the ranks' experts, only the stacked expert tensors are
    read again, into the slots that changed."""
    from actors.distributed.parallel import Parallel
    from actors.worker.loader import build_model, load_selected

    cfg = json.loads((gpt_oss / "config.json").read_text())
    p = Parallel(tp_size=2, rank=1, expert_parallel=True, redundant_experts=2)
    model = build_model(gpt_oss, cfg, torch.float32, torch.device("cpu"), 64, p)
    theirs = [layer.mlp.experts for layer in hf_model(gpt_oss).model.layers]

    def check():
        for layer, block in enumerate(layer.mlp for layer in model.model.layers):
            ours, hf = block.experts, theirs[layer]
            for slot, e in enumerate(block.local_slots()):
                w, b = hf.gate_up_proj[e], hf.gate_up_proj_bias[e]
                assert torch.equal(ours.gate_up_proj[slot], torch.cat((w[:, 0::2], w[:, 1::2]), 1).t())
                assert torch.equal(ours.gate_up_proj_bias[slot], torch.cat((b[0::2], b[1::2])))
                assert torch.equal(ours.down_proj[slot], hf.down_proj[e].t())
                assert torch.equal(ours.down_proj_bias[slot], hf.down_proj_bias[e])

    check()
    blocks = [layer.mlp for layer in model.model.layers]
    assert blocks[0].slots_per_rank == 5 and blocks[0].adds_down_bias
    plans = {i: b.placement[5:] + b.placement[:5] for i, b in enumerate(blocks)}
    assert set(blocks[0].local_slots(plans[0])) != set(blocks[0].local_slots())
    read = load_selected(model, gpt_oss, model.expert_reload_rule(plans, {i: set(range(5)) for i in plans}))
    assert read == 2 * 4  # per layer: gate_up, its bias, down, its bias
    for i, block in enumerate(blocks):
        block.set_placement(plans[i])
    check()


def test_tensor_parallel_rank_holds_its_slices(gpt_oss):
    """Rank 1 of tp=2 without EP (built in process, weights only): the second half of every
    expert's width (gate and up columns, their biases, down's columns), the whole down bias
    but not adding it (rank 0 does), and its heads' sinks."""
    from actors.distributed.parallel import Parallel
    from actors.worker.loader import build_model

    cfg = json.loads((gpt_oss / "config.json").read_text())
    model = build_model(gpt_oss, cfg, torch.float32, torch.device("cpu"), 64, Parallel(tp_size=2, rank=1))
    hf = hf_model(gpt_oss).model.layers[0]
    ours = model.model.layers[0]
    assert torch.equal(ours.self_attn.sinks, hf.self_attn.sinks[2:])
    assert not ours.mlp.adds_down_bias
    for e in range(8):
        w, b = hf.mlp.experts.gate_up_proj[e][:, 32:], hf.mlp.experts.gate_up_proj_bias[e][32:]  # units 16..31
        assert torch.equal(ours.mlp.experts.gate_up_proj[e], torch.cat((w[:, 0::2], w[:, 1::2]), 1).t())
        assert torch.equal(ours.mlp.experts.gate_up_proj_bias[e], torch.cat((b[0::2], b[1::2])))
        assert torch.equal(ours.mlp.experts.down_proj[e], hf.mlp.experts.down_proj[e][16:].t())


def test_lora_adapters_on_attention_match_peft(gpt_oss, tmp_path):
    """LoRA adapters on gpt-oss's attention projections (the biased q/k/v/o beside the sinks; its
    experts are stacked tensors, which PEFT's LoRA does not target): a batch mixing two adapters
    and the base model equals transformers + peft."""
    from lora_adapters import make_adapter
    from test_lora import check_mixed_batch

    paths = {"a": make_adapter(gpt_oss, tmp_path / "a", targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=1),
             "b": make_adapter(gpt_oss, tmp_path / "b", targets=("q_proj", "v_proj"), r=4, alpha=8, seed=2,
                               rslora=True)}
    outs, loads = check_mixed_batch(gpt_oss, paths)
    assert loads == 2
    assert outs[0].outputs[0].token_ids != hf_greedy(gpt_oss, prompts_of([5])[0], 10)  # adapter "a" changes it


# --------------------------------------------------------------------------- two shards (Ray)

@pytest.fixture(scope="module")
def local_ray():
    import ray
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False)
    yield
    ray.shutdown()


def test_expert_parallel_matches_transformers(local_ray, gpt_oss):
    """ep=2: each rank holds half the experts (their biases with them) and half the heads (their
    sinks); the o_proj bias and each assignment's down bias are added once. Then the features
    mix (preemption, a prefix-cache hit, sampling) gives one rank's tokens."""
    from test_distributed import POOL, check_features_match_one_rank

    llm = LLM(str(gpt_oss), tp_size=2, enable_expert_parallel=True, shard_cpus=0.5, **POOL)
    try:
        assert_matches_hf(gpt_oss, PROMPTS[:3], llm.generate(PROMPTS[:3], WITH_LOGPROBS))
        check_features_match_one_rank(llm, gpt_oss)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_tensor_parallel_splits_each_expert(local_ray, gpt_oss):
    """tp=2 without EP: every expert split by width (gate/up columns and their bias by rank),
    the down bias added by rank 0 only; the features mix too."""
    from test_distributed import POOL, check_features_match_one_rank

    llm = LLM(str(gpt_oss), tp_size=2, shard_cpus=0.5, **POOL)
    try:
        assert_matches_hf(gpt_oss, PROMPTS[:3], llm.generate(PROMPTS[:3], WITH_LOGPROBS))
        assert_pool_free(llm)
        check_features_match_one_rank(llm, gpt_oss)
    finally:
        llm.shutdown()
