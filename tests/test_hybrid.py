"""The hybrid decoders (actors/models/hybrid.py), layers with a state per sequence between
attention layers: Qwen3.5's and Qwen3-Next's Gated DeltaNet (dense, MoE, Qwen3-Next's projections
grouped by key head, the image-text releases for their text), LFM2's short convolutions (a state of
the convolution's last inputs), Mamba-2 (kernels/ssd.py) in Granite 4.0-H (MoE, dense, attention
with or without rotary), Bamba and Nemotron-H (one mixer a layer; Nemotron 3's MoE layers); Mamba(-1)
(kernels/selective_scan.py) in Mamba and FalconMamba, which have no attention at all.
Against transformers, float32:
greedy tokens equal and prompt log-probs within 1e-4, through chunked prefill (a state carried from
chunk to chunk), one-token prompts, batch rows reused by later requests, preemption and
recomputation (a state reset), at tp=1, tp=2 and pp=2; configs in their releases' spellings. The
chunked forms (kernels/gated_delta.py, kernels/ssd.py) and the convolution (kernels/causal_conv.py)
against the recurrences written out token by token."""
import os
import pathlib

import pytest
import torch

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
from oracle import hf_greedy, hf_prompt_logprobs  # noqa: E402
from test_engine import assert_pool_free, prompts_of  # noqa: E402

from actors.engine.llm import LLM  # noqa: E402
from actors.request import EngineRequest  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402
from kernels import causal_conv, gated_delta  # noqa: E402

MAX_TOKENS = 14
# a one-token prompt, prompts over several 16-token chunks, and two sharing a prefix
SHARED = prompts_of([12], seed=7)[0]
PROMPTS = prompts_of([5, 30, 1, 13, 47]) + [SHARED + [1, 2], SHARED + [5]]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def check(path, prompts=PROMPTS, logprobs=True, reference=None, **options):
    """Greedy tokens (and prompt log-probs) equal transformers' on `reference` (default: `path`)."""
    options = {"num_kv_blocks": 96, "block_size": 4, "max_num_batched_tokens": 16, **options}
    llm = LLM(str(path), **options)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                prompt_logprobs=0 if logprobs else None)
        outs = llm.generate(prompts, params)
        for ids, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy(reference or path, ids, MAX_TOKENS), f"prompt of {len(ids)}"
            if logprobs and len(ids) > 1:
                ours = [next(iter(d.values())) for d in out.prompt_logprobs[1:]]
                assert ours == pytest.approx(hf_prompt_logprobs(path, ids), abs=1e-4)
        assert_pool_free(llm)
        return llm.engine
    finally:
        llm.shutdown()


GRANITE_DENSE = dict(num_local_experts=0, shared_intermediate_size=96)  # Granite 4.0-H-Micro's layout
# Nemotron 3: MoE layers of squared-ReLU experts routed as DeepSeek-V3 routes (2 groups, a bias)
NEMOTRON_MOE = dict(layers_block_type=["linear_attention", "moe", "full_attention", "moe"], n_routed_experts=8,
                    num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2,
                    topk_group=1, routed_scaling_factor=2.5)


@pytest.mark.parametrize("arch,options", [
    ("qwen3_5", {}), ("qwen3_5_moe", {}), ("qwen3_next", {}), ("lfm2", {}),
    ("granitemoehybrid", {}), ("granitemoehybrid", GRANITE_DENSE),
    ("granitemoehybrid", dict(position_embedding_type="rope")), ("nemotron_h", {}), ("bamba", {}),
    ("nemotron_h", NEMOTRON_MOE), ("nemotron_h", dict(NEMOTRON_MOE, moe_latent_size=32)),
    # its mixer's biases by use_bias, its MLPs' by mlp_bias, its attention's never (attention_bias aside)
    ("nemotron_h", dict(use_bias=True, mlp_bias=True, attention_bias=True)),
    ("mamba", {}), ("falcon_mamba", dict(tie_word_embeddings=True)),
], ids=["qwen3_5", "qwen3_5_moe", "qwen3_next", "lfm2", "granite4-h", "granite4-h-dense", "granite4-h-rope",
        "nemotron-h", "bamba", "nemotron-3", "nemotron-3-latent", "nemotron-h-biases", "mamba", "falcon-mamba"])
def test_hybrid_matches_transformers(checkpoint_factory, arch, options):
    engine = check(checkpoint_factory(arch, **options))
    # no prefix cache: a cached prefix's K/V would skip tokens the linear layers' state must see
    assert not engine.blocks.enable_prefix_caching and engine.scheduler.hit_tokens == 0


def as_released(src, dst, edit, tensors: dict | None = None) -> pathlib.Path:
    """A copy of checkpoint `src` whose config.json `edit` rewrites into a release's spelling (and
    whose weights are `tensors`, where given, e.g. restacked)."""
    import json

    from checkpoints import _write_copy
    from safetensors.torch import load_file

    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    edit(config)
    return _write_copy(src, dst, load_file(src / "model.safetensors") if tensors is None else tensors, config)


def lfm2_release(config):  # LFM2-1.2B's spelling
    config["full_attn_idxs"] = [i for i, t in enumerate(config.pop("layer_types")) if t == "full_attention"]
    config["block_ff_dim"] = config.pop("intermediate_size")
    config["tie_embedding"] = config.pop("tie_word_embeddings")
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]


def nemotron_h_release(config):  # Nemotron Nano 2's spelling
    letters = {"linear_attention": "M", "full_attention": "*", "mlp": "-"}
    config["hybrid_override_pattern"] = "".join(letters[t] for t in config.pop("layers_block_type"))


@pytest.mark.parametrize("arch,edit", [("lfm2", lfm2_release), ("nemotron_h", nemotron_h_release)],
                         ids=["lfm2", "nemotron-h"])
def test_configs_as_released_are_read_as_transformers_reads_them(checkpoint_factory, tmp_path, arch, edit):
    """Their releases' config.json spell the layout their own way (LFM2's full_attn_idxs and
    block_ff_dim, Nemotron-H's hybrid_override_pattern): transformers' class completes it."""
    path = as_released(checkpoint_factory(arch), tmp_path / arch, edit)
    check(path, PROMPTS[:3], logprobs=False)


def test_nemotron_3_experts_stacked_in_one_tensor(checkpoint_factory, tmp_path):
    """Nemotron 3's experts as transformers holds them, one [E, I, H] / [E, H, I] tensor per
    projection, read as its per-expert tensors are."""
    from safetensors.torch import load_file

    src = checkpoint_factory("nemotron_h", **NEMOTRON_MOE)
    tensors = load_file(src / "model.safetensors")
    for layer in (1, 3):
        for part in ("up_proj", "down_proj"):
            name = f"backbone.layers.{layer}.mixer.experts.{{}}.{part}.weight"
            tensors[f"backbone.layers.{layer}.mixer.experts.{part}"] = torch.stack(
                [tensors.pop(name.format(e)) for e in range(8)])
    check(as_released(src, tmp_path / "stacked", lambda config: None, tensors), PROMPTS[:3], logprobs=False,
          reference=src)


@pytest.mark.parametrize("x_at_w", [False, True], ids=["as-held", "x-at-w"])
def test_qwen3_5_moe_experts_stacked_in_either_layout(checkpoint_factory, tmp_path, x_at_w):
    """A release may stack each layer's experts in one tensor per projection, as transformers
    holds them ([E, 2I, H], [E, H, I]) or for x @ W ([E, H, 2I], [E, I, H]): the shape tells which."""
    from safetensors.torch import load_file

    src = checkpoint_factory("qwen3_5_moe", moe_intermediate_size=24)  # (2I != hidden: the layouts differ)
    tensors = load_file(src / "model.safetensors")
    for layer in range(3):
        name = f"model.layers.{layer}.mlp.experts.{{}}.{{}}.weight"
        gate_up = torch.stack([torch.cat([tensors.pop(name.format(e, "gate_proj")),
                                          tensors.pop(name.format(e, "up_proj"))]) for e in range(8)])
        down = torch.stack([tensors.pop(name.format(e, "down_proj")) for e in range(8)])
        if x_at_w:
            gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
        tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = gate_up
        tensors[f"model.layers.{layer}.mlp.experts.down_proj"] = down
    check(as_released(src, tmp_path / "stacked", lambda config: None, tensors), PROMPTS[:3], logprobs=False,
          reference=src)


def test_batch_rows_reused_and_preempted_sequences_start_from_a_fresh_state(checkpoint_factory):
    """Two rows for seven requests: each row's state serves several sequences in turn; a pool of
    12 blocks of 4 tokens cannot hold two of these sequences to their end, so the scheduler
    preempts one and computes it again from position 0."""
    path = checkpoint_factory("qwen3_5")
    llm = LLM(str(path), num_kv_blocks=12, block_size=4, max_num_batched_tokens=16, max_num_seqs=2)
    try:
        prompts = prompts_of([20, 9, 17, 3, 21, 11, 6], seed=3)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, ids, 24) for ids in prompts]
        assert llm.engine.scheduler.num_preemptions > 0
        assert_pool_free(llm)
    finally:
        llm.shutdown()


def test_decode_rows_and_prompt_chunks_in_one_step(checkpoint_factory):
    """Requests arriving while others decode: steps mix one-token rows with prompt chunks."""
    path = checkpoint_factory("qwen3_5")
    llm = LLM(str(path), num_kv_blocks=96, block_size=4, max_num_batched_tokens=8)
    try:
        engine = llm.engine
        prompts = prompts_of([6, 19, 11], seed=5)
        for i, ids in enumerate(prompts):
            engine.add_request(EngineRequest(str(i), ids, GREEDY, whole=True))
            engine.step()  # the next arrives while this one decodes
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        assert [done[str(i)] for i in range(3)] == [hf_greedy(path, ids, MAX_TOKENS) for ids in prompts]
    finally:
        llm.shutdown()


def test_image_text_releases_serve_their_language_model(checkpoint_factory):
    for arch, family in (("qwen3_5_vl", "Qwen3_5ForCausalLM"), ("qwen3_5_moe_vl", "Qwen3_5MoeForCausalLM")):
        engine = check(checkpoint_factory(arch), PROMPTS[:3], logprobs=False)
        assert engine.spec.args.architecture == family


def test_what_a_state_cannot_do_is_refused_in_one_line(checkpoint_factory):
    groups = r"need the tensor parallel size \(2\) to divide their B / C groups \(1\)"
    with pytest.raises(ValueError, match=groups) as e:
        LLM(str(checkpoint_factory("granitemoehybrid", mamba_n_groups=1)), tp_size=2)
    assert "\n" not in str(e.value)
    path = checkpoint_factory("qwen3_5")
    with pytest.raises(ValueError, match="speculative decoding is not supported for Qwen3_5ForCausalLM"):
        LLM(str(path), speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="LoRA adapters are not supported for Qwen3_5ForCausalLM"):
        LLM(str(path), enable_lora=True)


def test_a_model_without_attention_has_no_kv_cache(checkpoint_factory, tmp_path):
    """Mamba's layers are all Mamba mixers: no byte of KV pool (its blocks, which the scheduler
    still counts, cost nothing), a context as long as its default (16,384 tokens: its releases
    name no max_position_embeddings), and a larger tensor parallel size refused in one line."""
    path = as_released(checkpoint_factory("mamba"), tmp_path / "mamba", lambda c: c.pop("max_position_embeddings"))
    llm = LLM(str(path), block_size=4)
    try:
        runner = llm.engine.executor.runner
        assert runner.block_bytes() == 0 and runner.kv_cache.numel() == 0
        assert llm.engine.max_model_len == 16_384 and llm.engine.blocks.num_blocks == 128 * 16_384 // 4
        out = llm.generate([PROMPTS[1]], GREEDY)[0]
        assert out.outputs[0].token_ids == hf_greedy(path, PROMPTS[1], MAX_TOKENS)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="MambaForCausalLM is not supported with tensor parallelism") as e:
        LLM(str(path), tp_size=2)
    assert "\n" not in str(e.value)


def test_state_dtypes_follow_vllms_options(checkpoint_factory):
    """--mamba-ssm-cache-dtype (SGLang's --mamba-ssm-dtype) stores the recurrent states in 16 bits,
    computed in float32 as they are updated; --mamba-cache-dtype the convolutions' too; the
    default keeps float32 states. A bf16 state rounds each step's result: the prompt log-probs stay
    within 0.05 of float32 states' on the tiny model, and the state memory halves."""
    path = checkpoint_factory("qwen3_5")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    got = {}
    for name, options in (("float32", {}), ("bf16", dict(mamba_ssm_dtype="bfloat16", mamba_cache_dtype="bfloat16"))):
        llm = LLM(str(path), num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, **options)
        try:
            layer = llm.engine.executor.runner.model.model.layers[0].self_attn
            got[name] = ([next(iter(d.values())) for d in llm.generate(PROMPTS[1:2], params)[0].prompt_logprobs[1:]],
                         layer.state.dtype, layer.conv_state.dtype, layer.state.nbytes)
        finally:
            llm.shutdown()
    assert got["float32"][1:3] == (torch.float32, torch.float32) and got["bf16"][1:3] == (torch.bfloat16,) * 2
    assert got["bf16"][3] * 2 == got["float32"][3]
    assert got["bf16"][0] == pytest.approx(got["float32"][0], abs=0.05) and got["bf16"][0] != got["float32"][0]
    with pytest.raises(ValueError, match="--mamba-ssm-cache-dtype must be one of auto, float32, bfloat16, float16"):
        LLM(str(path), mamba_ssm_cache_dtype="fp8")
    from test_option_aliases import from_cli
    assert from_cli(["--mamba-ssm-cache-dtype", "float32"]).engine.mamba_ssm_cache_dtype == "float32"
    assert from_cli(["--mamba-cache-dtype", "bfloat16"]).engine.mamba_cache_dtype == "bfloat16"


def test_linear_layers_hold_no_kv_and_decode_eagerly(checkpoint_factory, monkeypatch):
    """Only the full-attention layer has K/V in the pool (a block's bytes count it alone); the
    default compiled decode is off, with the reason in the kernels line."""
    monkeypatch.delenv("SHOAL_EAGER_DECODE", raising=False)  # (the suite's default)
    path = checkpoint_factory("qwen3_5")
    llm = LLM(str(path), num_kv_blocks=8, block_size=4, eager_decode=False)
    try:
        runner = llm.engine.executor.runner
        assert runner.kv_cache.shape[0] == 1  # of 3 layers
        assert runner.kernels.decode == "eager" and "linear-attention" in runner.kernels.decode_off
        out = llm.generate([PROMPTS[0]], GREEDY)[0]
        assert out.outputs[0].token_ids == hf_greedy(path, PROMPTS[0], MAX_TOKENS)
    finally:
        llm.shutdown()


# ---- the gated delta rule --------------------------------------------------------------

def written_out(q, k, v, g, beta, state):
    """The recurrence token by token, as the layer's definition says it (prepared inputs)."""
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", state, k[t])
        state = state + k[t][:, :, None] * ((v[t] - predicted) * beta[t][:, None])[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(outs), state


@pytest.mark.parametrize("length,split", [(1, 1), (63, 20), (64, 64), (150, 70), (200, 129)])
def test_the_chunked_rule_is_the_recurrence(length, split):
    gen = torch.Generator().manual_seed(length)
    q, k = torch.randn(length, 2, 16, generator=gen), torch.randn(length, 2, 16, generator=gen)
    v = torch.randn(length, 4, 8, generator=gen)
    g, beta = -torch.rand(length, 4, generator=gen), torch.rand(length, 4, generator=gen)
    q, k, v, g, beta = gated_delta.prepared(q, k, v, g, beta)
    start = torch.randn(4, 16, 8, generator=gen)  # a state left by earlier tokens
    want, want_state = written_out(q, k, v, g, beta, start)
    state = start.clone()
    got = torch.cat([gated_delta.chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state)
                     for a, b in ((0, split), (split, length)) if b > a])
    assert torch.allclose(got, want, atol=1e-4) and torch.allclose(state, want_state, atol=1e-4)
    state = start.clone()[None]
    got = torch.cat([gated_delta.recurrent_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
                     for t in range(length)])
    assert torch.allclose(got, want, atol=1e-4) and torch.allclose(state[0], want_state, atol=1e-4)


@pytest.mark.parametrize("length,split", [(1, 1), (64, 30), (150, 70)])
def test_the_chunked_state_space_model_is_the_recurrence(length, split):
    """Mamba-2's SSD chunks against S = exp(dt A) S + dt x B^T, y = S C written out."""
    from kernels import ssd

    gen = torch.Generator().manual_seed(length)
    x, dt = torch.randn(length, 4, 8, generator=gen), torch.rand(length, 4, generator=gen)
    a, b, c = -torch.rand(4, generator=gen) * 2, torch.randn(length, 2, 16, generator=gen), torch.randn(
        length, 2, 16, generator=gen)
    start = torch.randn(4, 8, 16, generator=gen)
    state, want = start.clone(), []
    for t in range(length):
        bt, ct = b[t].repeat_interleave(2, 0), c[t].repeat_interleave(2, 0)  # [heads, N]
        state = state * torch.exp(dt[t] * a)[:, None, None] + (dt[t][:, None] * x[t])[:, :, None] * bt[:, None, :]
        want.append(torch.einsum("hpn,hn->hp", state, ct))
    want = torch.stack(want)
    got_state = start.clone()
    got = torch.cat([ssd.chunked(x[i:j], dt[i:j], a, b[i:j], c[i:j], got_state)
                     for i, j in ((0, split), (split, length)) if j > i])
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4) and torch.allclose(got_state, state, atol=1e-4, rtol=1e-4)
    rows = start.clone()[None]
    got = torch.cat([ssd.step(x[t:t + 1], dt[t:t + 1], a, b[t:t + 1], c[t:t + 1], rows) for t in range(length)])
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4) and torch.allclose(rows[0], state, atol=1e-4, rtol=1e-4)


def test_the_convolution_carries_its_last_inputs():
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(11, 6, generator=gen), torch.randn(6, 4, generator=gen)
    whole = torch.nn.functional.silu(torch.nn.functional.conv1d(
        x.T[None], weight[:, None], padding=3, groups=6)[0, :, :11]).T
    state = torch.zeros(6, 3)
    pieces = [causal_conv.conv_prefill(x[:5], state, weight)]
    rows = state[None].clone()
    pieces += [causal_conv.conv_step(x[t:t + 1], rows, weight) for t in range(5, 11)]
    assert torch.allclose(torch.cat(pieces), whole, atol=1e-6)


# ---- tensor and pipeline parallel ---------------------------------------------------------

@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("arch,layout", [("qwen3_5", dict(tp_size=2)), ("qwen3_5_moe", dict(tp_size=2)),
                                         ("qwen3_next", dict(tp_size=2)), ("qwen3_5", dict(pp_size=2)),
                                         ("lfm2", dict(tp_size=2)), ("granitemoehybrid", dict(tp_size=2)),
                                         ("nemotron_h", dict(tp_size=2)), ("bamba", dict(pp_size=2)),
                                         ("nemotron_h", dict(tp_size=2, **NEMOTRON_MOE))],
                         ids=["tp2", "moe-tp2", "next-tp2", "pp2", "lfm2-tp2", "granite4-h-tp2", "nemotron-h-tp2",
                              "bamba-pp2", "nemotron-3-tp2"])
def test_hybrid_across_ranks_matches_transformers(local_ray, checkpoint_factory, arch, layout):
    """tp=2: each rank one key head and its two value heads, their convolution channels and gate
    rows (Qwen3-Next's cut out of its per-group layout); Mamba-2's: each rank one group of B / C
    with its heads; pp=2: the linear layers' states split with their layers."""
    layout = dict(layout)
    options = {k: layout.pop(k) for k in list(layout) if k not in ("tp_size", "pp_size")}  # (the checkpoint's)
    check(checkpoint_factory(arch, **options), PROMPTS[:5], shard_cpus=0.5, **layout)
