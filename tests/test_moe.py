"""Mixture-of-experts: kernels against a per-token reference, placement planning, every MoE
architecture against transformers, and expert parallelism (EP=2 on Ray, gloo) with
re-planning under a skewed workload."""
import os
import random

import pytest
import torch

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from oracle import hf_greedy, hf_prompt_logprobs  # noqa: E402
from test_distributed import check_features_match_one_rank  # noqa: E402
from test_engine import assert_pool_free, prompts_of  # noqa: E402

from actors.config import EngineConfig  # noqa: E402
from actors.engine.async_engine import AsyncEngine  # noqa: E402
from actors.engine.llm import LLM  # noqa: E402
from actors.models.eplb import balancedness, initial_placement, plan_placement, rank_loads  # noqa: E402
from actors.request import EngineRequest  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402
from kernels.moe import grouped_experts, route, spread_over_replicas  # noqa: E402

MOE_CASES = {
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),  # shared expert + sigmoid gate, top-k not renormalised
    "qwen3_moe": ("qwen3_moe", {}),  # q/k norm, top-k renormalised
    "qwen2_moe-dense-layer": ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
    "olmoe": ("olmoe", {}),  # all-heads q/k norms, clamped q/k/v, top-k not renormalised
    "glm4_moe": ("glm4_moe", {}),  # DeepSeek-V3's grouped sigmoid routing, a dense first layer, partial rotary
    "minimax_m2": ("minimax_m2", {}),  # sigmoid routing with a bias, all-heads q/k norms, partial rotary
    "glm4_moe_lite": ("glm4_moe_lite", {}),  # DeepSeek-V3's latent attention, a dense layer after the MoE one
    "ernie4_5_moe": ("ernie4_5_moe", {}),  # softmax routing steered by a bias, shared experts, interleaved rotary
    # the router's sigmoid weight on the expert's input, a shared expert, MoE every other layer, NoPE
    # and weightless q/k norms
    "llama4": ("llama4", {}),
    "granitemoe": ("granitemoe", {}),  # experts stacked, softmax over the top-k logits, Granite's multipliers
    "granitemoeshared": ("granitemoeshared", {}),  # and an ungated shared MLP beside the block
    "hunyuan_v1_moe": ("hunyuan_v1_moe", {}),  # a float32 router, a shared MLP, q/k norms after the rotary
    "phimoe": ("phimoe", {}),  # the sparsemixer's two experts, biased LayerNorms and LM head, longrope's mscales
    "ernie4_5_moe-interval": ("ernie4_5_moe", dict(num_hidden_layers=4, moe_layer_interval=2, moe_layer_end_index=2)),
}
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)


def assert_matches_hf(path, prompts, outs, max_tokens=12):
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, ids, max_tokens)
        ours = [next(iter(d.values())) for d in out.prompt_logprobs[1:]]
        assert ours == pytest.approx(hf_prompt_logprobs(path, ids), abs=1e-4)


# --------------------------------------------------------------------------- kernels

def naive_moe(x, logits, top_k, renormalize, gate_up, down):
    """One token at a time, one expert at a time: the plainest reading of a MoE layer."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].float(), -1)
        w, ids = probs.topk(top_k)
        w = w / w.sum() if renormalize else w
        for weight, e in zip(w, ids):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += weight * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_experts_equal_a_per_token_loop(renormalize):
    g = torch.Generator().manual_seed(0)
    T, H, I, E, k = 37, 16, 8, 6, 2
    x, logits = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    weights, ids = route(logits, k, renormalize)
    got = grouped_experts(x, weights, ids, gate_up, down)
    torch.testing.assert_close(got, naive_moe(x, logits, k, renormalize, gate_up, down), rtol=1e-5, atol=1e-5)
    # Split the experts over two "ranks" (-1: held elsewhere): the partial sums add up.
    halves = [torch.where(ids % 2 == r, ids // 2, -1) for r in (0, 1)]
    parts = [grouped_experts(x, weights, h, gate_up[r::2], down[r::2]) for r, h in enumerate(halves)]
    torch.testing.assert_close(parts[0] + parts[1], got, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("jitter_eps", [0.01, 0.3, 2.0])
def test_sparsemixer_routes_as_transformers_in_eval_mode(jitter_eps):
    """PhiMoE's two experts and weights equal transformers' sparsemixer (eval) bit for bit, for
    thresholds that leave one, some or all logits in each softmax, negative top logits included."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    from kernels.moe import route_sparsemixer

    logits = torch.randn(200, 16, generator=torch.Generator().manual_seed(0)) - 0.5
    weights, ids = route_sparsemixer(logits, jitter_eps)
    want_weights, want_ids = sparsemixer(logits, jitter_eps, training=False)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    if jitter_eps > 0.1:  # thresholds that leave other logits in the first expert's softmax
        assert (weights[:, 0] < 1).any()


def test_replicas_split_an_experts_tokens_evenly_and_deterministically():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [2, 0], [0, 1]])
    slots = torch.tensor([[0, 3], [1, 1], [2, 4]])  # expert 0 in slots 0 and 3, expert 2 in 2 and 4
    counts = torch.tensor([2, 1, 2])
    phys = spread_over_replicas(ids, slots, counts)
    assert phys.tolist() == [[0, 1], [3, 2], [0, 1], [4, 3], [0, 1]]
    assert torch.equal(phys, spread_over_replicas(ids, slots, counts))


# --------------------------------------------------------------------------- placement

def test_plan_puts_copies_on_distinct_ranks_and_evens_out_a_skewed_load():
    load = [500, 10, 10, 400, 10, 10, 10, 50]
    before = initial_placement(8, 2, 5)
    after = plan_placement(load, 2, 5, before)
    assert sorted(set(after)) == list(range(8)) and len(after) == 10
    for rank in (after[:5], after[5:]):
        assert len(set(rank)) == 5  # at most one copy of an expert per rank
    assert balancedness(rank_loads(load, after, 2)) > 0.95 > balancedness(rank_loads(load, before, 2))
    assert plan_placement(load, 2, 5, after) == after  # nothing better: nothing moves


def test_plan_never_worse_than_the_previous_placement():
    rng = random.Random(0)
    for _ in range(50):
        load = [rng.choice([0, 1, 5, 50, 300]) for _ in range(8)]
        previous = initial_placement(8, 2, 5)
        new = plan_placement(load, 2, 5, previous)
        assert max(rank_loads(load, new, 2)) <= max(rank_loads(load, previous, 2))


# --------------------------------------------------------------------------- models (EP=1)

@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_models_match_transformers(checkpoint_factory, case):
    arch, overrides = MOE_CASES[case]
    path = checkpoint_factory(arch, **overrides)
    llm = LLM(str(path), block_size=8, num_kv_blocks=64, max_num_batched_tokens=32)
    prompts = prompts_of([3, 17, 40, 1])
    assert_matches_hf(path, prompts, llm.generate(prompts, PARAMS))
    assert_pool_free(llm)


def test_moe_configs_as_released_are_read_as_transformers_reads_them():
    """Fields the releases spell their own way or leave out: GLM-4.5-Air's (top-level partial
    rotary, no groups), a GLM config without its routing fields (transformers' defaults: half the
    head rotated, a dense first layer, renormalised), MiniMax-M2's `rotary_dim`, ERNIE 4.5 MoE's own
    field names (moe_num_experts, moe_k, its MoE layer range)."""
    from actors.models.args import ModelArgs

    shape = dict(hidden_size=4096, intermediate_size=10944, num_attention_heads=96, num_key_value_heads=8,
                 head_dim=128, num_hidden_layers=46, vocab_size=151552)
    air = ModelArgs.from_hf(dict(shape, architectures=["Glm4MoeForCausalLM"], attention_bias=True,
                                 first_k_dense_replace=1, moe_intermediate_size=1408, n_group=1, n_routed_experts=128,
                                 n_shared_experts=1, norm_topk_prob=True, num_experts_per_tok=8,
                                 partial_rotary_factor=0.5, rope_theta=1000000, routed_scaling_factor=1.0,
                                 topk_group=1, use_qk_norm=False, num_nextn_predict_layers=1))
    assert (air.rope.dim, air.rope.theta, air.rope.interleaved, air.qk_norm) == (64, 1e6, False, None)
    assert air.qkv_bias and not air.o_bias and air.norms == "pre"
    m = air.moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.shared_intermediate_size) == (128, 8, 1408, 1408)
    assert m.dense_layers == (0,) and m.renormalize and m.routing.scoring == "sigmoid" and m.routing.score_bias
    sparse = ModelArgs.from_hf(dict(shape, architectures=["Glm4MoeForCausalLM"], moe_intermediate_size=1408,
                                    n_routed_experts=128, num_experts_per_tok=8))
    assert sparse.rope.dim == 64 and sparse.moe.dense_layers == (0,) and sparse.moe.renormalize
    assert (sparse.moe.shared_intermediate_size, sparse.moe.routing.scale) == (1408, 1.0)
    m2 = ModelArgs.from_hf(dict(architectures=["MiniMaxM2ForCausalLM"], hidden_size=3072, intermediate_size=1536,
                                num_attention_heads=48, num_key_value_heads=8, head_dim=128, num_hidden_layers=62,
                                vocab_size=200064, num_local_experts=256, num_experts_per_tok=8, rotary_dim=64,
                                rope_theta=5000000, use_qk_norm=True, qk_norm_type="per_layer"))
    assert (m2.rope.dim, m2.rope.theta, m2.qk_norm) == (64, 5e6, "all")
    assert (m2.moe.num_experts, m2.moe.intermediate_size, m2.moe.renormalize) == (256, 1536, True)
    assert m2.moe.dense_layers == ()
    assert m2.moe.routing.score_bias and m2.moe.routing.group_score is None
    ernie = ModelArgs.from_hf(dict(
        architectures=["Ernie4_5_MoeForCausalLM"], hidden_size=2560, intermediate_size=12288, num_attention_heads=20,
        num_key_value_heads=4, num_hidden_layers=28, vocab_size=103424, rope_theta=500000, tie_word_embeddings=True,
        use_bias=False, moe_num_experts=64, moe_num_shared_experts=2, moe_layer_start_index=1,
        moe_intermediate_size=1536, moe_k=6, moe_layer_interval=1))
    assert (ernie.head_dim, ernie.rope.interleaved, ernie.tie_word_embeddings) == (128, True, True)
    e = ernie.moe
    assert (e.num_experts, e.top_k, e.shared_intermediate_size, e.dense_layers) == (64, 6, 3072, (0,))
    assert e.renormalize and e.routing.scoring == "softmax" and e.routing.score_bias and not e.shared_gate


def test_multi_token_prediction_modules_beside_the_model_are_skipped(checkpoint_factory, tmp_path):
    """ERNIE 4.5's releases carry MTP modules under their own names (mtp_block, mtp_emb_norm, ...):
    loaded as nothing, not refused as unexpected weights."""
    import json

    from checkpoints import _write_copy
    from safetensors.torch import load_file

    src = checkpoint_factory("ernie4_5_moe")
    tensors = load_file(src / "model.safetensors")
    tensors |= {"model.mtp_block.0.self_attn.q_proj.weight": torch.ones(64, 64),
                "model.mtp_emb_norm.0.weight": torch.ones(64), "model.mtp_linear_proj.0.weight": torch.ones(64, 128)}
    (tmp_path / "mtp").mkdir()
    path = _write_copy(src, tmp_path / "mtp", tensors, json.loads((src / "config.json").read_text()))
    llm = LLM(str(path), block_size=8, num_kv_blocks=32)
    prompts = prompts_of([9])
    assert_matches_hf(src, prompts, llm.generate(prompts, PARAMS))


@pytest.mark.parametrize("arch", ["qwen3_vl_moe", "granitemoe"])
def test_stacked_experts_fill_their_slots_and_reload_after_a_replan(checkpoint_factory, arch):
    """Experts stacked in one tensor per projection (Qwen3-VL-MoE's [E, H, 2I] / [E, I, H],
    Granite's [E, 2I, H] / [E, H, I]): rank 1 of ep=2 with 2 redundant slots (built in process,
    weights only) holds each slot's expert as transformers' model holds it; after a re-plan that
    swaps the ranks' experts, only the stacked tensors are read again."""
    from oracle import hf_model

    from actors.distributed.parallel import Parallel
    from actors.worker.checkpoint_files import read_config
    from actors.worker.loader import build_model, load_selected

    path = checkpoint_factory(arch)
    p = Parallel(tp_size=2, rank=1, expert_parallel=True, redundant_experts=2)
    model = build_model(path, read_config(path), torch.float32, torch.device("cpu"), 64, p)
    hf = hf_model(path).model
    experts = ([x.block_sparse_moe.experts for x in hf.layers] if arch == "granitemoe"
               else [x.mlp.experts for x in hf.language_model.layers])
    theirs = [(e.gate_up_proj, e.down_proj) for e in experts]  # (transformers' layout is ours)
    blocks = [layer.mlp for layer in model.model.layers]

    def check():
        for block, (gate_up, down) in zip(blocks, theirs):
            for slot, e in enumerate(block.local_slots()):
                assert torch.equal(block.experts.gate_up_proj[slot], gate_up[e])
                assert torch.equal(block.experts.down_proj[slot], down[e])

    check()
    assert blocks[0].slots_per_rank == 5
    plans = {i: b.placement[5:] + b.placement[:5] for i, b in enumerate(blocks)}
    assert set(blocks[0].local_slots(plans[0])) != set(blocks[0].local_slots())
    read = load_selected(model, path, model.expert_reload_rule(plans, {i: set(range(5)) for i in plans}))
    assert read == 2 * len(blocks)  # per layer: the stacked gate/up and down
    for i, block in enumerate(blocks):
        block.set_placement(plans[i])
    check()


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_models_are_served_up_to_index_topk(checkpoint_factory, arch):
    """DeepSeek-V3.2's and GLM-5's indexer picks index_topk keys per query (2,048 in their
    releases, 64 here): every key below that length, so their context stops there, exact (the
    family test in test_model_families.py), and a longer --max-model-len is refused in one line."""
    path = checkpoint_factory(arch)
    llm = LLM(str(path), num_kv_blocks=16)
    try:
        assert llm.engine.spec.max_model_len == 64
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="index_topk keys per query is not implemented") as e:
        LLM(str(path), max_model_len=100)
    assert "\n" not in str(e.value)


def test_llama4_is_served_up_to_its_attention_chunk(checkpoint_factory):
    """Llama 4's rotary layers attend within chunks of attention_chunk_size tokens: not
    implemented, so its context stops there (here 256 tokens; Scout's 8,192), and a longer
    --max-model-len is refused in one line. Its NoPE layers' query scaling by position is
    implemented (the family test above crosses floor_scale, 8)."""
    from actors.models.args import ModelArgs

    path = checkpoint_factory("llama4")
    llm = LLM(str(path), num_kv_blocks=16)
    try:
        assert llm.engine.spec.max_model_len == 256
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="chunked attention") as e:
        LLM(str(path), max_model_len=400)
    assert "\n" not in str(e.value)
    scout = ModelArgs.from_hf(dict(
        architectures=["Llama4ForCausalLM"], hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
        num_attention_heads=40, num_key_value_heads=8, head_dim=128, num_hidden_layers=48, vocab_size=202048,
        num_local_experts=16, interleave_moe_layer_step=1, rope_theta=500000.0, use_qk_norm=True,
        attention_chunk_size=8192, attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1))
    assert scout.max_context == 8192 and scout.q_position_scale == (0.1, 8192, 1)
    assert scout.nope_layers[:4] == (False, False, False, True) and scout.qk_norm == "l2" and scout.rope.interleaved
    assert scout.moe.dense_layers == () and scout.moe.weight_input and scout.moe.shared_intermediate_size == 8192
    assert scout.intermediate_size == 16384  # (the dense MLP's; Scout has none)


def test_phimoe_as_released(checkpoint_factory, tmp_path):
    """Phi-3.5-MoE's config.json names its remote code's class (PhiMoEForCausalLM) and a 4.x
    longrope spelling (`type`, mscales beside the factors): served as transformers' PhimoeForCausalLM
    serves it. Top-k other than 2 and a non-SiLU expert are refused in one line."""
    import json
    import shutil

    from actors.models.args import ModelArgs

    src = checkpoint_factory("phimoe")
    path = shutil.copytree(src, tmp_path / "phimoe")
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg |= {"architectures": ["PhiMoEForCausalLM"], "rope_theta": rope.pop("rope_theta"),
            "rope_scaling": {**rope, "type": rope.pop("rope_type")}}
    (path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(path), block_size=8, num_kv_blocks=32)
    prompts = prompts_of([9])
    assert_matches_hf(src, prompts, llm.generate(prompts, PARAMS))
    for fields, refusal in ((dict(num_experts_per_tok=4), "num_experts_per_tok=4"), (dict(hidden_act="gelu"), "gelu")):
        with pytest.raises(ValueError, match=refusal):
            ModelArgs.from_hf(cfg | {"architectures": ["PhimoeForCausalLM"]} | fields)


def test_hunyuan_a13b_config_as_released():
    """Hunyuan-A13B's config.json names per-layer lists (all alike) and fields transformers' class
    leaves out; what that class would not run (cross-layer attention, layers that differ, experts of
    another width, no shared MLP) is refused in one line."""
    from actors.models.args import ModelArgs

    n = 32
    a13b = dict(architectures=["HunYuanMoEV1ForCausalLM"], hidden_size=4096, intermediate_size=3072,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_hidden_layers=n, vocab_size=128167,
                num_experts=64, moe_topk=[8] * n, moe_intermediate_size=[3072] * n, num_shared_expert=[1] * n,
                use_mixed_mlp_moe=True, use_cla=False, use_qk_norm=True, rope_theta=10000.0,
                rope_scaling={"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0,
                              "mscale_all_dim": 1.0, "type": "dynamic"})
    args = ModelArgs.from_hf(a13b)
    m = args.moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.shared_intermediate_size) == (64, 8, 3072, 3072)
    assert m.renormalize and not m.shared_gate and m.routing.float32_logits and m.dense_layers == ()
    assert args.qk_norm == "head" and args.qk_norm_after_rope and args.rope.scaling is None
    assert args.rope.theta == 10000.0 * 1000.0 ** (128 / 126)
    for fields in (dict(use_cla=True), dict(moe_topk=[8] * (n - 1) + [4]), dict(moe_intermediate_size=[1536] * n),
                   dict(num_shared_expert=[2] * n), dict(use_mixed_mlp_moe=False)):
        with pytest.raises(ValueError, match="HunYuan MoE with"):
            ModelArgs.from_hf(a13b | fields)


def test_expert_load_is_in_the_engine_stats(checkpoint_factory):
    engine = AsyncEngine(EngineConfig(model_path=str(checkpoint_factory("qwen3_moe")), num_kv_blocks=32,
                                      eplb_window_size=4))
    try:
        engine.engine.add_request(EngineRequest("r", [7] * 9, SamplingParams(max_tokens=3, ignore_eos=True)))
        while engine.engine.has_unfinished():
            engine.engine.step()
        experts = engine.stats()["experts"]
        assert experts["ep_size"] == 1 and experts["window_steps"] == 4 and len(experts["layers"]) == 2
        layer = experts["layers"][0]
        assert sum(layer["tokens"]) == (9 + 2) * 2  # prompt + 2 decode steps, top-2
        assert layer["balancedness"] == 1.0 and 0 < layer["expert_balancedness"] < 1
        assert layer["rank_tokens"] == [22] and experts["rank_tokens"] == [44]  # one rank: all of it
    finally:
        engine.shutdown()


def test_expert_balancedness_is_a_prometheus_metric(checkpoint_factory):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from actors.engine.llm import LLM
    from actors.sampling_params import SamplingParams
    from app.api.metrics import ShoalCollector, combine
    llm = LLM(str(checkpoint_factory("mixtral")), num_kv_blocks=32)
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))
    registry = CollectorRegistry()
    registry.register(ShoalCollector([("m", combine([llm.engine.metrics.snapshot(llm.engine)]))], {}, "m"))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    value = families["shoal_expert_balancedness"].samples[0].value
    stats = llm.engine.executor.runner.expert_stats()
    assert value == stats["balancedness"] and 0 < value <= 1
    [rank] = families["shoal_expert_rank_tokens"].samples
    assert rank.labels == {"model": "m", "ep_rank": "0"} and rank.value == stats["rank_tokens"][0] > 0


def test_expert_options_are_validated_in_one_line():
    with pytest.raises(ValueError, match="--ep-size 2 must equal --tp-size 4"):
        EngineConfig(tp_size=4, ep_size=2).validate()
    with pytest.raises(ValueError, match="need expert parallelism"):
        EngineConfig(tp_size=2, num_redundant_experts=2).validate()
    assert EngineConfig(tp_size=2, ep_size=2).expert_parallel
    assert not EngineConfig(tp_size=1, enable_expert_parallel=True).expert_parallel


# --------------------------------------------------------------------------- expert parallel (Ray)

@pytest.fixture(scope="module")
def local_ray():
    import ray
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False)
    yield
    ray.shutdown()


def expert_params(llm) -> int:
    return sum(p.numel() for n, p in llm.engine.executor.runner.model.named_parameters() if ".experts." in n)


def all_expert_params(a) -> int:
    """The routed experts' weights in the whole model: gate, up and down of each, in each sparse layer."""
    sparse = sum(a.moe.is_sparse(i) for i in range(a.num_layers))
    return sparse * a.moe.num_experts * 3 * a.moe.intermediate_size * a.hidden_size


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "qwen3_vl_moe",
                                  "llama4"])
def test_expert_parallel_matches_transformers(local_ray, checkpoint_factory, arch):
    """EP=2 == transformers (== EP=1, above); each rank holds half the experts (DeepSeek: its
    shared expert split by width, its grouped routing on both ranks)."""
    path = checkpoint_factory(arch)
    llm = LLM(str(path), tp_size=2, enable_expert_parallel=True, num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=24, shard_cpus=0.5)
    try:
        prompts = prompts_of([5, 30, 13, 2])
        assert_matches_hf(path, prompts, llm.generate(prompts, PARAMS))
        assert expert_params(llm) * 2 == all_expert_params(llm.engine.executor.runner.args)
        stats = llm.engine.executor.expert_stats()  # each rank's share of the routed tokens
        routed = sum(sum(layer["tokens"]) for layer in stats["layers"])
        assert len(stats["rank_tokens"]) == 2 and min(stats["rank_tokens"]) > 0
        assert sum(stats["rank_tokens"]) == pytest.approx(routed)
        rank0 = sum(p.numel() for p in llm.engine.executor.runner.model.parameters())
        assert [info["parameters"] for info in llm.engine.executor.shards.infos] == [rank0]
        assert_pool_free(llm)
        if arch in ("qwen3_moe", "deepseek_v3"):  # the feature mix (tests/test_distributed.py): preemption,
            # a prefix-cache hit, n=2, seeded and structured sampling give one rank's tokens
            check_features_match_one_rank(llm, path)
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v2", "minimax_m2", "qwen3_vl_moe", "granitemoeshared",
                                  "phimoe", "hunyuan_v1_moe"])
def test_tensor_parallel_without_ep_splits_each_expert(local_ray, checkpoint_factory, arch):
    """tp=2: each rank holds half of every expert's width (DeepSeek: and half the heads, the
    latent cache whole; MiniMax-M2: its all-heads q/k norms over both ranks; Qwen3-VL-MoE: each
    rank's slice of the experts stacked in one tensor; GraniteMoeShared: its stacked experts and fused
    shared MLP; PhiMoE: its biased LM head split by vocabulary; HunYuan MoE: its shared MLP); DeepSeek
    also through the feature mix."""
    path = checkpoint_factory(arch)
    llm = LLM(str(path), tp_size=2, num_kv_blocks=64, block_size=4, max_num_batched_tokens=24, shard_cpus=0.5)
    try:
        prompts = prompts_of([9, 21])
        assert_matches_hf(path, prompts, llm.generate(prompts, PARAMS))
        assert expert_params(llm) * 2 == all_expert_params(llm.engine.executor.runner.args)
        if arch == "deepseek_v2":
            check_features_match_one_rank(llm, path)
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_replanning_a_skewed_load_improves_balance_and_keeps_outputs(local_ray, checkpoint_factory, arch):
    """Prompts of one repeated token send every prefill token to the same two experts per layer.
    Run the same workload three times; the re-plan falls inside the second run (step 14), so
    the third runs entirely under the new placement: same load, better balance, same tokens."""
    path = checkpoint_factory(arch)
    llm = LLM(str(path), tp_size=2, enable_expert_parallel=True, num_redundant_experts=2,
              eplb_window_size=8, eplb_step_interval=14, enable_prefix_caching=False,
              num_kv_blocks=64, block_size=4, shard_cpus=0.5)
    try:
        prompts = [[7] * 12] * 4  # 1 prefill step + 7 decode steps = one 8-step window
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        runs, stats = [], []
        for _ in range(3):
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
            stats.append(llm.engine.executor.runner.expert_stats())
        assert [s["rebalances"] for s in stats] == [0, 1, 1]
        assert stats[0]["layers"][0]["tokens"] == stats[2]["layers"][0]["tokens"]  # the same load ...
        assert stats[2]["balancedness"] > stats[0]["balancedness"] + 0.1  # ... spread more evenly
        assert stats[2]["layers"][0]["placement"] != stats[0]["layers"][0]["placement"]
        assert runs[0] == runs[1] == runs[2] == [hf_greedy(path, prompts[0], 8)] * 4
        # 8 experts + 2 copies = 10 slots per sparse layer, 5 on each rank
        assert expert_params(llm) == all_expert_params(llm.engine.executor.runner.args) * 5 // 8
        assert_pool_free(llm)
    finally:
        llm.shutdown()


def test_expert_load_counts_and_clears():
    """The ring counts each forward's choices per layer; clear() (after start-up's profiling
    and capture forwards) forgets them."""
    from actors.models.eplb import ExpertLoad

    load = ExpertLoad(num_layers=2, num_experts=4, window=2)
    load.record(0, torch.tensor([[0, 1], [1, 3]]))
    load.record(1, torch.tensor([[2, 2]]))
    assert load.totals() == [[1, 2, 0, 1], [0, 0, 2, 0]]
    load.record(0, torch.tensor([[3]]))  # the window's second forward
    load.record(0, torch.tensor([[0]]))  # the third replaces the first
    assert load.totals()[0] == [1, 0, 0, 1]
    load.clear()
    assert load.totals() == [[0] * 4, [0] * 4]
