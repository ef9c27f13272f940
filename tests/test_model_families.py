"""The families built on the Llama block (actors/models/llama.py; DeepSeek's latent attention and
MoE too, actors/models/deepseek.py) against transformers, float32:
greedy tokens equal and prompt log-probs within 1e-4, through chunked prefill, a prefix-cache
hit and prompts and generations longer than the sliding window, at tp=1 (in process) and tp=2
(Ray shard actors). Each tiny checkpoint turns its family's twists up so they change the
output (tests/checkpoints.py FAMILY_DEFAULTS): a window of 8 keys, soft-caps the scores reach,
Granite's multipliers far from 1, partial and interleaved rotary, longrope."""
import os
import random

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
from oracle import hf_greedy, hf_prompt_logprobs  # noqa: E402
from test_engine import assert_pool_free, prompts_of  # noqa: E402

from actors.engine.llm import LLM  # noqa: E402
from actors.models.args import ModelArgs  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402
from actors.worker.checkpoint_files import read_config  # noqa: E402

FAMILIES = {
    "gemma": {},
    "gemma-tied": dict(arch="gemma", tie_word_embeddings=True),
    "gemma2": {},
    "gemma2-tied": dict(arch="gemma2", tie_word_embeddings=True),
    "gemma3": {},
    "phi3": {},
    "olmo2": {},
    "olmo3": {},  # OLMo 2's block, sliding layers with their own rotary
    "granite": {},
    "glm4": {},
    "smollm3": {},  # a NoPE layer
    "deepseek_v2": {},  # MLA and DeepSeek's MoE: also tests/test_deepseek.py
    "deepseek_v3": {},
    "mistral4": {},  # V3's latent attention, softmax routing over groups, queries scaled by position
    # V3 with sparse attention (its indexer's weights skipped): contexts within index_topk (64 here)
    "deepseek_v32": {},
    "glm_moe_dsa": {},  # GLM-5
    # Gemma 4: wider global heads whose values are their keys, the proportional rotary; E2B / E4B's
    # per-layer embeddings, KV shared by the last two layers and their double-wide MLPs; 26B-A4B's
    # MoE block beside each MLP
    "gemma4": {},
    "gemma4-tied": dict(arch="gemma4", tie_word_embeddings=True),
    "gemma4-e": dict(arch="gemma4", hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True,
                     attention_k_eq_v=False, num_global_key_value_heads=None),
    "gemma4-moe": dict(arch="gemma4", enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16),
    # its sparsemixer's two experts, biased LayerNorms and LM head, longrope's own factors (MoE: tests/test_moe.py)
    "phimoe": {},
    "phimoe-window": dict(arch="phimoe", sliding_window=8),
    "hunyuan_v1_moe": {},  # Hunyuan-A13B: a float32 router, a shared MLP
    # sliding windows the configs of older families carry
    "mistral-window": dict(arch="mistral", sliding_window=8),
    "ministral": {},  # Mistral's block, sliding and global layers by layer_types
    "seed_oss": {},
    "ernie4_5": {},
    "exaone4": {},
    "cohere": {},  # Command R+: per-head q/k LayerNorms (use_qk_norm)
    "cohere-aya": dict(arch="cohere", use_qk_norm=False),  # Command R, Aya Expanse
    "cohere2": {},  # Command R7B, Command A
    "starcoder2": {},
    "arcee": {},
    "nemotron": {},
    "phi": {},  # Phi-2
    "stablelm": {},
    "stablelm-parallel": dict(arch="stablelm", use_parallel_residual=True),  # its parallel-residual option
    "gpt_neox": {},  # Pythia
    "ministral3": {},  # queries scaled by position
    "hunyuan_v1_dense": {},
    "olmo": {},  # OLMo 1
    "gptj": {},
    "glm": {},  # GLM-4-9B-chat-hf: GLM-4's rotary and biases without its norms after each sublayer
    "helium": {},
    "apertus": {},  # xIELU with each layer's learned alphas
    # Falcon-7B: multi-query, attention and MLP in parallel off one norm, tied embeddings
    "falcon": dict(tie_word_embeddings=True),
    # Falcon-40B / 180B: KV groups in the fused query_key_value, a norm each for attention and MLP
    "falcon-new": dict(arch="falcon", new_decoder_architecture=True, num_kv_heads=2),
    "falcon-new-one-norm": dict(arch="falcon", new_decoder_architecture=True, num_kv_heads=2,
                                num_ln_in_parallel_attn=1),  # Falcon2-11B
    # q, k and v per head, Llama's order, biased projections (Falcon-RW's shape, on rotary)
    "falcon-sequential": dict(arch="falcon", multi_query=False, parallel_attn=False, bias=True),
    "gpt_neox-sequential": dict(arch="gpt_neox", use_parallel_residual=False),
    "gpt_neox-unbiased-attention": dict(arch="gpt_neox", attention_bias=False),  # (its MLP keeps its biases)
    # learned positions, LayerNorms with biases, ungated MLPs: vLLM's and transformers' first examples
    "opt": {},
    "gpt2": {},  # Conv1D weights stored [in, out], q/k/v fused
    "gpt2-tied": dict(arch="gpt2", tie_word_embeddings=True),
    "qwen2-window": dict(arch="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1),
}
SHARED = [random.Random(3).randrange(500) for _ in range(12)]
# short, past the window, a long one over several chunks, then two sharing a cached prefix
PROMPTS = prompts_of([5, 30, 13]) + [SHARED + [1, 2], SHARED + [5]]
MAX_TOKENS = 14
# Gemma 3 with a final soft-cap (its attention soft-cap transformers ignores, and so do we) and a
# head size that is not hidden / heads
GEMMA_EVERYTHING = dict(attn_logit_softcapping=4.0, final_logit_softcapping=8.0, head_dim=32)


def checkpoint(factory, name):
    options = dict(FAMILIES[name])
    return factory(options.pop("arch", name), **options)


def check(path, **layout):
    llm = LLM(str(path), num_kv_blocks=96, block_size=4, max_num_batched_tokens=16, **layout)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0)
        outs = llm.generate(PROMPTS[:-1], params)
        for ids, out in zip(PROMPTS, outs):
            ours = [next(iter(d.values())) for d in out.prompt_logprobs[1:]]
            assert ours == pytest.approx(hf_prompt_logprobs(path, ids), abs=1e-4)
        # once the prompt it shares a prefix with is cached (prompt log-probs skip the cache)
        outs += llm.generate(PROMPTS[-1:], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        for ids, out in zip(PROMPTS, outs):
            assert out.outputs[0].token_ids == hf_greedy(path, ids, MAX_TOKENS), f"prompt of {len(ids)} tokens"
        if not layout:
            assert llm.engine.scheduler.hit_tokens > 0
        assert_pool_free(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers(checkpoint_factory, name):
    check(checkpoint(checkpoint_factory, name))


def test_the_twists_are_read_from_the_configs(checkpoint_factory):
    """Each family's settings reach ModelArgs (a family parsed as plain Llama would fail above,
    but this says which setting went missing)."""
    import json

    def args(name):
        return ModelArgs.from_hf(json.loads((checkpoint(checkpoint_factory, name) / "config.json").read_text()))

    g2, g3, phi, olmo, granite, glm = (args(n) for n in ("gemma2", "gemma3", "phi3", "olmo2", "granite", "glm4"))
    assert g2.layer_windows == (8, None) and g2.attn_softcap == 4.0 and g2.final_softcap == 8.0
    assert g2.norm_offset == 1.0 and g2.embed_scale == 8.0 and g2.activation == "gelu_tanh" and g2.norms == "sandwich"
    assert g2.attn_scale == 24 ** -0.5
    assert g3.layer_windows == (8, None) and g3.qk_norm == "head"
    assert (g3.rope.theta, g3.rope.scaling["factor"], g3.local_rope.theta) == (1e6, 2.0, 1e4)
    assert phi.rope.dim == 12 and phi.rope.scaling["rope_type"] == "longrope"
    assert olmo.qk_norm == "all" and olmo.norms == "post"
    assert (granite.embed_scale, granite.residual_scale, granite.attn_scale, granite.logits_divisor) == (3, .5, .2, 2)
    assert glm.rope.interleaved and glm.rope.dim == 8 and glm.qkv_bias and not glm.o_bias and glm.norms == "sandwich"
    g1 = args("gemma")
    assert (g1.norm_offset, g1.embed_scale, g1.activation, g1.norms, g1.attn_scale, g1.head_dim) == \
        (1.0, 8.0, "gelu_tanh", "pre", None, 24)
    legacy = json.loads((checkpoint(checkpoint_factory, "gemma") / "config.json").read_text()) | {"hidden_act": "gelu"}
    assert ModelArgs.from_hf(legacy).activation == "gelu_tanh"  # Gemma 1's releases say "gelu", mean tanh
    assert args("smollm3").nope_layers == (False, True)
    o3 = args("olmo3")
    assert o3.qk_norm == "all" and o3.norms == "post" and o3.layer_windows == (8, None)
    assert (o3.rope.theta, o3.rope.scaling["factor"], o3.local_rope.theta, o3.local_rope.scaling) == (5e5, 2.0, 1e4, None)
    assert args("qwen2-window").layer_windows == (None, 8)
    assert args("mistral-window").layer_windows == (8, 8)
    assert args("ministral").layer_windows == (8, None)
    seed, ernie, exaone = args("seed_oss"), args("ernie4_5"), args("exaone4")
    assert seed.qkv_bias and not seed.o_bias
    assert ernie.rope.interleaved and ernie.qkv_bias and ernie.o_bias and ernie.mlp_bias
    assert exaone.qk_norm == "head" and exaone.norms == "post" and exaone.layer_windows == (8, None)
    assert exaone.nope_layers == (False, True)
    cohere, cohere2 = args("cohere"), args("cohere2")
    assert (cohere.norms, cohere.norm_kind, cohere.qk_norm) == ("parallel", "layer", "head_layer")
    assert cohere.logit_scale == 0.5
    assert cohere.rope.interleaved and cohere.rms_norm_eps == 1e-5
    assert cohere2.layer_windows == (8, None) and cohere2.nope_layers == (False, True) and cohere2.qk_norm is None


# A config naming only the model's size (hidden 64, 4 heads: head_dim 16 unless the class says otherwise)
SIZE_ONLY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize("arch,config_class,fields", [
    ("GlmForCausalLM", "GlmConfig", {}), ("Glm4ForCausalLM", "Glm4Config", {}),
    ("HeliumForCausalLM", "HeliumConfig", {}),
    ("ApertusForCausalLM", "ApertusConfig", {}),
    ("ApertusForCausalLM", "ApertusConfig", dict(rope_theta=5e5)),  # (its class: llama3 over 12M all the same)
    ("PhimoeForCausalLM", "PhimoeConfig", {}), ("HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Config", {}),
])
def test_fields_a_config_leaves_out_are_read_as_transformers_reads_them(arch, config_class, fields):
    """Released configs leave out what their config class fills in (GLM's 128-wide heads, two KV
    heads, half the head rotated, q/k/v biases; Helium's rotary base; Apertus's llama3 rotary):
    the attention's shape, norms and rotary read as transformers' class reads them."""
    import transformers

    hf = getattr(transformers, config_class)(**SIZE_ONLY, **fields)
    ours = ModelArgs.from_hf(dict(SIZE_ONLY, architectures=[arch], **fields))
    rope = hf.rope_parameters
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (ours.head_dim, ours.num_kv_heads, ours.rms_norm_eps, ours.max_position_embeddings) == (
        head_dim, hf.num_key_value_heads, hf.rms_norm_eps, hf.max_position_embeddings)
    assert (ours.rope.theta, ours.rope.dim) == (rope["rope_theta"], int(head_dim * rope.get("partial_rotary_factor", 1)))
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    assert (ours.rope.scaling or {"rope_type": "default"}) == scaling
    assert (ours.qkv_bias, ours.tie_word_embeddings) == (hf.attention_bias, hf.tie_word_embeddings)


def test_falcon_configs_as_released():
    """Falcon-7B's (multi-query, parallel attention, one norm, tied) and Falcon-40B's (the new
    architecture: KV groups, two norms) fields read as transformers' class reads them; alibi (Falcon-RW)
    and the new architecture without parallel attention (which transformers' class cannot run) are
    refused in one line."""
    f7 = dict(architectures=["FalconForCausalLM"], alibi=False, bias=False, hidden_size=4544, multi_query=True,
              new_decoder_architecture=False, num_attention_heads=71, num_hidden_layers=32, parallel_attn=True,
              vocab_size=65024, layer_norm_epsilon=1e-5)
    a = ModelArgs.from_hf(f7)
    assert (a.num_kv_heads, a.head_dim, a.intermediate_size, a.norms, a.norm_kind) == (1, 64, 4 * 4544, "parallel",
                                                                                      "layer_bias")
    assert a.tie_word_embeddings and not a.qkv_bias and not a.gated_mlp and a.activation == "gelu"
    assert (a.rope.theta, a.rope.dim, a.rope.interleaved) == (10000.0, 64, False)
    f40 = dict(f7, hidden_size=8192, num_attention_heads=128, num_kv_heads=8, new_decoder_architecture=True,
               num_hidden_layers=60)
    b = ModelArgs.from_hf(f40)
    assert (b.num_kv_heads, b.head_dim, b.norms) == (8, 64, "parallel2")
    for fields, refusal in ((dict(alibi=True), "alibi"), (dict(parallel_attn=False), "parallel_attn off")):
        with pytest.raises(ValueError, match=refusal):
            ModelArgs.from_hf(f40 | fields)


def test_gemma4_config_as_released(checkpoint_factory, tmp_path):
    """Gemma 4's releases name global_head_dim and num_global_key_value_heads, not the per-layer
    config transformers writes back: its class works the layers out from them (and the output is
    transformers' on the same checkpoint)."""
    from test_hybrid import as_released

    def release(config):
        config.pop("per_layer_config")
        config.update(global_head_dim=32, num_global_key_value_heads=1)

    path = as_released(checkpoint_factory("gemma4"), tmp_path / "gemma4", release)
    assert ModelArgs.from_hf(read_config(path)).gemma4.head_dims == (16, 32, 16, 32)
    check(path)


def test_gpt2_as_its_first_release_wrote_it(checkpoint_factory, tmp_path):
    """`gpt2`'s own files: names without the `transformer.` prefix, the causal-mask buffers
    (`attn.bias`, `attn.masked_bias`) beside the weights, no lm_head (tied)."""
    import json

    import torch
    from checkpoints import _write_copy
    from safetensors.torch import load_file

    src = checkpoint_factory("gpt2", tie_word_embeddings=True)
    tensors = {n.removeprefix("transformer."): t for n, t in load_file(src / "model.safetensors").items()}
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 512, 512))
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    (tmp_path / "gpt2").mkdir()
    path = _write_copy(src, tmp_path / "gpt2", tensors, json.loads((src / "config.json").read_text()))
    assert "lm_head.weight" not in tensors and "wte.weight" in tensors
    llm = LLM(str(path), num_kv_blocks=32)
    try:
        ids = PROMPTS[0]
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        assert out[0].outputs[0].token_ids == hf_greedy(src, ids, MAX_TOKENS)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("fields", [dict(do_layer_norm_before=False), dict(word_embed_proj_dim=32)])
def test_opt_350m_layouts_are_refused_in_one_line(checkpoint_factory, tmp_path, fields):
    import json
    import shutil

    path = shutil.copytree(checkpoint_factory("opt"), tmp_path / "opt")
    (path / "config.json").write_text(json.dumps(json.loads((path / "config.json").read_text()) | fields))
    with pytest.raises(ValueError, match="OPT-350m"):
        LLM(str(path))


def test_unsupported_architecture_fails_at_start_with_one_line(checkpoint_factory, tmp_path):
    import json
    import shutil

    path = shutil.copytree(checkpoint_factory("llama"), tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["RwkvForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        LLM(str(path))
    message = str(e.value)
    assert "\n" not in message and "'RwkvForCausalLM'" in message
    assert "Gemma2ForCausalLM" in message and "LlamaForCausalLM" in message


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("name,options", [
    ("gemma2", {}), ("gemma3", {}), ("phi3", {}), ("granite", {}), ("glm4", {}),
    ("olmo2", dict(num_key_value_heads=1)),  # its all-heads k norm with the one KV head on both ranks
    ("cohere", {}),  # each rank its heads' q/k LayerNorm weights
    ("starcoder2", {}),  # its ungated MLP's biased up rows split, the down bias added once
    ("gpt2", {}),  # each rank's heads and MLP columns cut from Conv1D weights stored [in, out]
    ("phi", {}),  # each rank its vocabulary rows of the LM head's bias
    ("gpt_neox", {}),  # each rank its heads' q, k and v rows out of the per-head fused query_key_value
    ("gptj", {}),  # the parallel block, a biased LM head, interleaved partial rotary
    ("glm", {}),  # each rank its heads' q/k/v biases, its gate and up rows of the fused gate_up_proj
    ("helium", {}),
    ("apertus", {}),  # each layer's xIELU parameters whole on both ranks
    ("falcon", {}),  # multi-query: the one KV head's rows on both ranks, each rank its query heads
    ("falcon-new", {}),  # each rank its KV group's query heads, key and value
    ("gemma4-e", {}),  # replicated per-layer embeddings, the shared caches on each rank
    ("gemma4-moe", {}),  # the one global KV head on both ranks; each rank half of every expert's width
], ids=["gemma2", "gemma3", "phi3", "granite", "glm4", "olmo2-kv1", "cohere", "starcoder2", "gpt2", "phi",
        "gpt_neox", "gptj", "glm", "helium", "apertus", "falcon", "falcon-new", "gemma4-e", "gemma4-moe"])  # DeepSeek at tp=2: tests/test_moe.py
def test_family_at_tp2_matches_transformers(local_ray, checkpoint_factory, name, options):
    base = dict(FAMILIES[name])
    path = checkpoint_factory(base.pop("arch", name), **base, **options)
    check(path, tp_size=2, shard_cpus=0.5)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek_v3", "gpt_oss", "opt"])
def test_pp2_matches_transformers(local_ray, checkpoint_factory, arch):
    """Two pipeline stages: DeepSeek-V3's latent caches and MoE layers split 2 + 1, gpt-oss's
    sliding and full layers (and their sinks) one per stage, OPT's position table on the first."""
    check(checkpoint_factory(arch), pp_size=2, shard_cpus=0.5)


def test_a_generation_far_past_the_window_holds_a_window_of_blocks(checkpoint_factory):
    """Mistral, window 8, blocks of 4: 10 prompt tokens + 150 generated need 40 blocks without
    giving any back; a pool of 10 serves it without a preemption, token for token."""
    path = checkpoint(checkpoint_factory, "mistral-window")
    llm = LLM(str(path), num_kv_blocks=10, block_size=4, max_num_seqs=1)
    prompt = prompts_of([10], seed=9)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(path, prompt, 150)
    assert llm.engine.scheduler.num_preemptions == 0 and llm.engine.scheduler.released_blocks >= 36
    assert_pool_free(llm)


def served_checkpoint(factory, tmp_path, name):
    """A copy of the family's checkpoint whose generation_config.json sets temperature 0 and
    top_p 0.5, and adds as an EOS id the token that first appears k >= 3 tokens into transformers'
    greedy answer to MESSAGES: (path, chat prompt ids, the answer's k tokens)."""
    import json
    import shutil

    from transformers import AutoTokenizer

    path = shutil.copytree(checkpoint(factory, name), tmp_path / name)
    ids = AutoTokenizer.from_pretrained(path).apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                 tokenize=True, return_dict=False)
    greedy = hf_greedy(path, ids, 24)
    k = next(i for i in range(3, 24) if greedy[i] not in greedy[:i])
    generation = json.loads((path / "generation_config.json").read_text())
    generation.update(temperature=0.0, top_p=0.5, eos_token_id=[generation["eos_token_id"], greedy[k]])
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path, ids, greedy[:k]


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def check_served(url, name, path, ids, answer):
    """The chat template renders the prompt, a request without temperature takes the model's
    (0: greedy, as transformers), and the EOS id only generation_config.json lists ends the
    answer with finish_reason stop."""
    import httpx
    from transformers import AutoTokenizer

    r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                   json={"model": name, "messages": MESSAGES, "max_tokens": 24})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == AutoTokenizer.from_pretrained(path).decode(answer, skip_special_tokens=True)
    n = len(answer) + 1  # and the EOS token
    assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}


@pytest.mark.slow
def test_shoal_serve_runs_the_ray_serve_llm_config_with_every_family_and_an_embedder(
        checkpoint_factory, llama_ckpt, tmp_path):
    """`shoal serve --config serve_configs/ray-serve-llm.yaml` (Ray Serve LLM's llm_configs
    shape), its one entry turned into seven models in one application, one LLMServer pool each
    behind one ingress: the six families not run through `shoal serve` elsewhere (Gemma 2:
    tests/test_compiled_decode.py) and an embedding model (a Llama with mean pooling,
    normalised, as its sentence-transformers files say). A request's `model` picks the pool:
    each family gets check_served's answers (its chat template, generation_config.json's
    sampling defaults and EOS), the embedder's vectors equal transformers'; an unknown model is
    a 404, /metrics has each model's series, Gemma 3 speculates (vLLM's speculative_config in
    its engine_kwargs); SIGTERM stops everything (exit 0, no process left)."""
    import copy
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import httpx
    import torch
    import yaml
    from serving import free_port, loopback_env, stop_process, wait_process_ready
    from test_embeddings import reference, write_sentence_transformers

    repo = Path(__file__).resolve().parent.parent
    families = ["gemma3", "phi3", "olmo2", "granite", "glm4", "deepseek_v3"]
    served = {name: served_checkpoint(checkpoint_factory, tmp_path, name) for name in families}
    embedder = shutil.copytree(llama_ckpt, tmp_path / "embedder")
    write_sentence_transformers(embedder, "mean", normalize=True)
    port, log, path = free_port(), tmp_path / "serve.log", tmp_path / "serve.yaml"
    config = yaml.safe_load((repo / "serve_configs/ray-serve-llm.yaml").read_text())
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    entry = args["llm_configs"][0]
    entry["engine_kwargs"].update(max_model_len=256, num_gpu_blocks_override=64)
    entry["placement_group_config"]["bundles"] = [{"CPU": 0.2}]  # seven models on two cores
    args.update(replica_cpus=0.04, ingress_cpus=0.04)
    models = {**{n: p for n, (p, _, _) in served.items()}, "tiny-embed": embedder}
    args["llm_configs"] = [{**copy.deepcopy(entry), "model_loading_config": {"model_id": name, "model_source": str(p)}}
                           for name, p in models.items()]
    # Gemma 3 proposes n-gram drafts (vLLM's speculative_config in engine_kwargs): its greedy
    # answers must not change.
    args["llm_configs"][0]["engine_kwargs"]["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3,
                                                                     "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    path.write_text(yaml.safe_dump(config))
    with open(log, "w") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "shoal"), "serve", "--config", str(path)],
                                cwd=repo, env=loopback_env(), stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_process_ready(url, proc, log)
        listed = httpx.get(f"{url}/v1/models").json()["data"]
        assert [m["id"] for m in listed] == list(models)
        for name, (p, ids, answer) in served.items():
            check_served(url, name, p, ids, answer)
        ids = [5, 17, 42, 8, 99, 3]
        r = httpx.post(f"{url}/v1/embeddings", json={"model": "tiny-embed", "input": [ids]}, timeout=30)
        assert r.status_code == 200, r.text
        assert (torch.tensor(r.json()["data"][0]["embedding"]) - reference(embedder, ids, "mean")).abs().max() < 1e-5
        missing = httpx.post(f"{url}/v1/embeddings", json={"model": "nope", "input": "x"})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
        assert 'shoal_prompt_tokens_total{model="tiny-embed"} 6.0' in httpx.get(f"{url}/metrics").text
        replicas = httpx.get(f"{url}/stats", timeout=30).json()["replicas"]
        assert [r["model"] for r in replicas if "speculative" in r] == ["gemma3"]
    finally:
        code, outliving = stop_process(proc)
    assert code == 0 and not outliving, log.read_text()[-3000:]


def test_older_config_spellings():
    """transformers 4.x configs on the Hub: Phi-3's rope_scaling type "su" with its lengths beside
    it, Gemma 3's rope_local_base_freq and sliding_window_pattern, Gemma 2 without layer_types."""
    common = dict(vocab_size=10, hidden_size=64, intermediate_size=8, num_hidden_layers=7, num_attention_heads=4)
    phi = ModelArgs.from_hf(dict(common, architectures=["Phi3ForCausalLM"], max_position_embeddings=131072,
                                 original_max_position_embeddings=4096, partial_rotary_factor=0.75,
                                 rope_scaling={"type": "su", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}))
    assert phi.rope.dim == 12 and phi.rope.scaling["rope_type"] == "longrope"
    assert phi.rope.scaling["original_max_position_embeddings"] == 4096
    gemma = dict(common, head_dim=16, query_pre_attn_scalar=16, sliding_window=512)
    g3 = ModelArgs.from_hf(dict(gemma, architectures=["Gemma3ForCausalLM"], rope_theta=1e6, rope_local_base_freq=1e4,
                                rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=6))
    assert g3.layer_windows == (512,) * 5 + (None, 512)
    assert (g3.rope.theta, g3.rope.scaling["factor"], g3.local_rope.theta, g3.local_rope.scaling) == (1e6, 8.0, 1e4, None)
    g2 = ModelArgs.from_hf(dict(gemma, architectures=["Gemma2ForCausalLM"]))
    assert g2.layer_windows == (512, None) * 3 + (512,) and g2.tie_word_embeddings


def test_gemma_decode_through_emulated_cuda_graphs(checkpoint_factory):
    """The CUDA-graph path's static buffers (emulated on CPU) on Gemma 3 with a final soft-cap:
    windows, local rotary, per-head norms and capped logits equal eager and transformers.
    (Compiled decode on the same checkpoint: tests/test_compiled_decode.py.)"""
    from oracle import assert_equals_eager_and_hf
    from test_compiled_decode import OPTIONS
    from test_gpu_path import with_emulated_graphs

    path = checkpoint_factory("gemma3", **GEMMA_EVERYTHING)
    prompts = prompts_of([3, 9, 30, 1, 5, 14])  # 6 rows; the 30-token one outgrows the graphs' 40 keys
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    want = LLM(str(path), **OPTIONS).generate(prompts, params)
    graphed = LLM(str(path), **OPTIONS)
    graphs = with_emulated_graphs(graphed, [1, 2, 4, 8], max_seq_len=40)
    assert_equals_eager_and_hf(path, prompts, graphed.generate(prompts, params), want, 16)
    assert graphs.replays > 0
