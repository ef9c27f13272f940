"""Tiny random Hugging Face checkpoints, built offline for parity tests.

`make_checkpoint(path, arch)` writes config.json + safetensors + a BPE tokenizer trained
here with `tokenizers` + a ChatML chat template, so no test ever needs the hub.
Same arguments -> byte-identical files.
"""
from __future__ import annotations

import pathlib
import random
import re

import torch

from app.protocol.chatml import CHAT_TEMPLATE  # the template the demo model ships with

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "minimax_m2",
         "glm4_moe_lite", "ernie4_5_moe", "granitemoe", "granitemoeshared", "phimoe",
         "hunyuan_v1_moe",
         "gemma", "gemma2", "gemma3", "phi3", "olmo2", "olmo3", "granite", "glm4", "smollm3", "ministral",
         "seed_oss", "ernie4_5", "exaone4", "cohere", "cohere2", "starcoder2", "opt", "gpt2",
         "arcee", "nemotron", "phi", "stablelm", "gpt_neox", "llama4", "ministral3",
         "hunyuan_v1_dense", "olmo", "gptj", "glm", "helium", "apertus", "falcon", "deepseek_v2", "deepseek_v3",
         "gpt_oss",
         "qwen3_5", "qwen3_5_moe", "qwen3_next", "mistral4", "gemma4",
         "deepseek_v32", "glm_moe_dsa", "lfm2", "granitemoehybrid",
         "nemotron_h", "bamba", "mamba", "falcon_mamba")
# Image-text checkpoints (their language model's family, their class), a tiny vision tower each
IMAGE_TEXT = {"gemma3_vision": ("gemma3", "Gemma3ForConditionalGeneration"),
              "mistral3": ("mistral", "Mistral3ForConditionalGeneration"),
              "llava": ("llama", "LlavaForConditionalGeneration"),
              "qwen2_5_vl": ("qwen2", "Qwen2_5_VLForConditionalGeneration"),
              "qwen3_vl": ("qwen3", "Qwen3VLForConditionalGeneration"),
              "qwen3_vl_moe": ("qwen3_moe", "Qwen3VLMoeForConditionalGeneration"),
              "llama4_vision": ("llama4", "Llama4ForConditionalGeneration"),
              "ministral3_vision": ("ministral3", "Mistral3ForConditionalGeneration"),
              "mistral4_vision": ("mistral4", "Mistral3ForConditionalGeneration"),
              "gemma4_vision": ("gemma4", "Gemma4ForConditionalGeneration"),
              "qwen3_5_vl": ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
              "qwen3_5_moe_vl": ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")}
# Text families transformers' AutoModelForCausalLM does not map: their class by name
OUTSIDE_CAUSAL_LM_AUTO = {"mistral4": "Mistral4ForCausalLM"}

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
]
BPE_VOCAB = 505  # + 7 special tokens appended after training = 512 ids in total
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

DEFAULTS = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
)
# Mixture-of-experts archs: 8 small experts, top-2; the rest as above. Override any field,
# e.g. mlp_only_layers=[0] or decoder_sparse_step=2 for dense layers between sparse ones.
MOE_DEFAULTS = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True),
    # q/k norms over all heads, clamped q/k/v (a bound the tiny model's projections reach)
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False, clip_qkv=2.0),
    # DeepSeek-V3's routing (4 groups, the best 2 eligible, a bias on the choice, scaled) on GQA
    # attention with per-head q/k norms, q/k/v biases, half the head rotated; a dense first layer
    "glm4_moe": dict(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                     norm_topk_prob=True, use_qk_norm=True, attention_bias=True, head_dim=16),
    # sigmoid routing with a bias, q/k norms over all heads, half the head rotated (its releases'
    # `rotary_dim` spelling)
    "minimax_m2": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
                       rotary_dim=8),
    # softmax routing steered by a bias, shared experts, the first layer dense; ERNIE's interleaved rotary
    "ernie4_5_moe": dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
                         moe_layer_start_index=1, num_hidden_layers=3),
    # PhiMoE: the sparsemixer's two experts, a threshold that leaves some logits in each softmax and
    # masks others; biased LayerNorms, attention and LM head; longrope with its own attention factors
    "phimoe": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, router_jitter_noise=0.3,
                   attention_bias=True, lm_head_bias=True,
                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                    "short_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
                                    "long_factor": [2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0],
                                    "short_mscale": 1.2, "long_mscale": 1.5, "original_max_position_embeddings": 256}),
    # HunYuan MoE (Hunyuan-A13B): a float32 softmax router renormalised, a shared MLP beside the experts;
    # the dense family's per-head q/k norms after its NTK-alpha rotary
    "hunyuan_v1_moe": dict(num_experts=8, moe_topk=2, intermediate_size=32, head_dim=16,
                           rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0,
                                            "factor": 1.0}),
    # Granite's multipliers far from 1 (as "granite" below); experts stacked; Shared: an ungated shared MLP
    "granitemoe": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, embedding_multiplier=3.0,
                       residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0),
    # Granite 4.0-H: Mamba-2 layers around an attention layer without rotary, its MoE with a shared
    # MLP and Granite's multipliers; 2 groups of B and C for 4 heads (num_local_experts=0: 4.0-H-Micro's
    # dense shared MLP alone)
    "granitemoehybrid": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                             shared_intermediate_size=48, embedding_multiplier=3.0, residual_multiplier=0.5,
                             attention_multiplier=0.2, logits_scaling=2.0, num_hidden_layers=3,
                             layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4, mamba_n_groups=2,
                             mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16),
    "granitemoeshared": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                             shared_intermediate_size=48, embedding_multiplier=3.0, residual_multiplier=0.5,
                             attention_multiplier=0.2, logits_scaling=2.0),
    # Qwen3.5-MoE: the hybrid layers of "qwen3_5" below, every MLP sparse with a gated shared expert
    "qwen3_5_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48),
    # Qwen3-Next: the same, its linear layers' projections grouped by key head, a dense first layer
    "qwen3_next": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, mlp_only_layers=[0]),
}
# Qwen3.5: Gated DeltaNet layers around a gated full-attention one; 2 key heads for 4 value heads
_HYBRID = dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
               head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=8, linear_conv_kernel_dim=4)
# Random weights at std 0.02 give a near-uniform next-token distribution and greedy
# output that repeats one token; a larger std gives confident, varied argmax choices.
INIT_STD = 0.2
# (their tiny models repeat or sit near ties at 0.2; Apertus's xIELU, quadratic above 0, saturates)
FAMILY_INIT_STD = {"gpt2": 0.3, "gptj": 0.3, "falcon": 0.3, "apertus": 0.15}
SEED = 1234

# --------------------------------------------------------------------------- corpus

_PARAGRAPHS = """\
The quick brown fox jumps over the lazy dog. A small boat drifted across the quiet bay
while the fishermen mended their nets and talked about the weather, the price of fuel and
the long winter ahead. Nobody expected the storm to arrive so early in the season.

Once upon a time there was a little server that answered questions all day long. It read
every request carefully, thought about the answer, and wrote it back one token at a time.
When many people asked at once, it grouped their questions into batches and worked faster.

Shoals of fish move together as if they were one animal: each fish watches its neighbours
and turns when they turn. Scientists have studied this behaviour for many years, and they
still find new patterns in the way the groups split, merge and change direction.

User: What is the capital of France?
Assistant: The capital of France is Paris. It is known for the Eiffel Tower, museums,
cafes and long walks along the river Seine.
User: Can you call a tool to check the weather in Paris today?
Assistant: Sure, I will call the get_weather function with the city name.

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"type": "function", "function": {"name": "add", "parameters": {"a": 1, "b": 2}}}

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 3.14159 2.71828 -7 +8 1e-3.
Dates and times: 2024-01-15, 12:30:45, Monday, Tuesday, Wednesday, Thursday, Friday.
Punctuation: hello, world! (yes) [no] {maybe} "quoted" 'single' a-b a_b a/b a\\b 50% $9.99
#tag @user & * ^ ~ ` | < > = ; : ? ... -- __init__ def main(): return x + y * z
"""

_WORDS = (
    "the a an and or but if then when while because so of to in on at by for with from "
    "about into over under between after before model token server request batch cache "
    "block prefix layer head weight value key query tensor shard rank node cluster ray "
    "fish boat sea river city water light dark green blue red quick slow small large new "
    "old good bad first last next each every some many few one two three four five is are "
    "was were be been has have had do does did can will would should may might must say "
    "go make take see know think come give find tell ask work seem feel try leave call"
).split()


def _corpus() -> list[str]:
    """A few fixed paragraphs plus deterministic pseudo-sentences for more merges."""
    rng = random.Random(7)
    lines = _PARAGRAPHS.splitlines()
    for _ in range(400):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        sentence = " ".join(words).capitalize() + rng.choice([".", "!", "?", ",", ";"])
        lines.append(sentence + " " + str(rng.randint(0, 9999)))
    return lines


# --------------------------------------------------------------------------- tokenizer

def build_tokenizer():
    """Train a byte-level BPE (any UTF-8 round-trips) and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Specials go after the learned vocab, like Qwen's added tokens.
    tok.add_special_tokens(SPECIAL_TOKENS)

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        clean_up_tokenization_spaces=False,
        model_max_length=DEFAULTS["max_position_embeddings"],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


# --------------------------------------------------------------------------- model

def _rope_parameters(cfg: dict) -> dict:
    """Accept the 4.x `rope_scaling` spelling too; transformers 5 writes `rope_parameters`
    (rope_type, rope_theta and the scaling fields in one dict)."""
    scaling = cfg.pop("rope_scaling", None)
    rope = dict(cfg.pop("rope_parameters", None) or scaling or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))  # 4.x also said "type"
    rope.setdefault("rope_theta", cfg.pop("rope_theta", 10000.0))
    return rope


# (num_key_value_heads: transformers repeats DeepSeek's K/V by heads / it, so it must equal the heads)
_DEEPSEEK = dict(num_hidden_layers=3, num_key_value_heads=4, first_k_dense_replace=1, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, n_group=4, topk_group=2)
# Each family's twists, set so they change the output of a tiny model: windows shorter than the
# test prompts, soft-caps the scores reach, multipliers far from 1, partial rotary.
FAMILY_DEFAULTS = {
    "gemma": dict(head_dim=24),  # (not hidden / heads)
    "smollm3": dict(no_rope_layers=[1, 0]),  # the second layer without rotary (NoPE)
    "seed_oss": dict(head_dim=16, attention_bias=True, attention_out_bias=False),  # q/k/v biased, o not
    "ernie4_5": dict(head_dim=16, use_bias=True),  # interleaved rotary; every projection biased
    # a sliding layer with rotary, a global one without (NoPE); q/k norms per head; norms after
    "exaone4": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "ministral": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"], head_dim=16),
    # LayerNorm, attention and MLP in parallel, interleaved rotary, a logit scale; Cohere's per-head
    # q/k LayerNorms (Command R+); Cohere 2's sliding layers with rotary, global ones without
    "cohere": dict(logit_scale=0.5, use_qk_norm=True, layer_norm_eps=1e-5),
    "cohere2": dict(logit_scale=0.5, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    # LayerNorms with biases, an ungated GELU MLP, every projection biased, a window on every layer
    "starcoder2": dict(sliding_window=8, norm_epsilon=1e-5),
    # an ungated squared-ReLU MLP (Nemotron's also: LayerNorms scaling by 1 + weight, half the head rotated)
    "arcee": dict(hidden_act="relu2"),
    # Phi-2: Cohere's parallel block with biased LayerNorms, GELU, partial rotary, a biased LM head
    "phi": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # Llama 4: 4 layers, the last without rotary, its queries scaled past every 8th position; MoE in
    # layers 1 and 3 (interleave step 2), one of 8 experts, a shared expert; a dense MLP of its own
    # width in layers 0 and 2; weightless q/k norms
    "llama4": dict(num_hidden_layers=4, intermediate_size=32, intermediate_size_mlp=96, num_local_experts=8,
                   num_experts_per_tok=1, interleave_moe_layer_step=2, head_dim=16, attention_chunk_size=256,
                   floor_scale=8, attn_scale=0.5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    # Ministral 3: Mistral's block, queries scaled past every 16th position (llama_4_scaling_beta),
    # YaRN over an original 16 positions
    "ministral3": dict(head_dim=16, rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 32.0,
                                                     "original_max_position_embeddings": 16, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                                                     "llama_4_scaling_beta": 0.5}),
    # Gemma 4 (31B-like): sliding layers of 16-wide heads, global ones of 32-wide heads with one KV
    # head whose values are its keys (attention_k_eq_v), the proportional rotary, a final soft-cap.
    # Its E2B / E4B twists (per-layer embeddings, KV sharing, double-wide MLPs) and 26B-A4B's MoE
    # block are overrides (tests/test_model_families.py)
    "gemma4": dict(num_hidden_layers=4, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                   attention_k_eq_v=True, sliding_window=8, final_logit_softcapping=8.0,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                   hidden_size_per_layer_input=0, vocab_size_per_layer_input=512),
    "qwen3_5": _HYBRID,
    # Bamba: Mamba-2 layers around an attention layer (half the head rotated), Llama's MLP
    "bamba": dict(num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2,
                  mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16),
    # Mamba and FalconMamba: every layer a Mamba(-1) mixer (FalconMamba's dt / B / C RMS-normed)
    "mamba": dict(state_size=8, expand=2, conv_kernel=4, time_step_rank=8),
    "falcon_mamba": dict(state_size=8, expand=2, conv_kernel=4, time_step_rank=8),
    # Nemotron-H (Nano 2): a Mamba-2 layer, an MLP layer, an attention layer, an MLP layer
    "nemotron_h": dict(layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"], head_dim=16,
                       intermediate_size=96, mamba_num_heads=4, mamba_head_dim=32, n_groups=2, ssm_state_size=16,
                       conv_kernel=4, expand=2, chunk_size=16, num_hidden_layers=4),
    # LFM2: short-convolution layers around an attention one; its MLP's width worked out (x 2/3,
    # a multiplier, a multiple of 16)
    "lfm2": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3,
                 intermediate_size=192, block_ffn_dim_multiplier=1.2, block_multiple_of=16, norm_eps=1e-5),
    "qwen3_5_moe": _HYBRID,
    "qwen3_next": _HYBRID,
    # OLMo (1): LayerNorms without parameters, clamped q/k/v (a bound the tiny model reaches)
    "olmo": dict(clip_qkv=2.0),
    # HunYuan: per-head q/k norms after the rotary, its NTK-alpha rotary base
    "hunyuan_v1_dense": dict(head_dim=16, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                           "alpha": 1000.0, "factor": 1.0}),
    # the parallel block with a norm per sublayer, a quarter of the head rotated, q/k/v fused per head
    "gpt_neox": dict(rotary_pct=0.25, use_parallel_residual=True),
    # StableLM 2: biased LayerNorms, q/k/v biases, a quarter of the head rotated; Llama's gated MLP
    "stablelm": dict(use_qkv_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 0.25}),
    "nemotron": dict(hidden_act="relu2", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.5}),
    # a sliding layer, then a global one with its own (scaled) rotary
    "olmo3": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                      "rope_theta": 500000.0}}),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=4.0,
                   final_logit_softcapping=8.0, hidden_activation="gelu_pytorch_tanh"),
    "gemma3": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 1000000.0}}),
    # longrope: positions stay below original_max_position_embeddings in the tests (see kernels/rotary.py)
    "phi3": dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                  "short_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0],
                                  "long_factor": [2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
                                  "original_max_position_embeddings": 256}),
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
                    logits_scaling=2.0),
    "glm4": dict(head_dim=16),
    # GLM-4-9B (chat-hf): GLM-4's interleaved half-head rotary and q/k/v biases on Llama's block
    "glm": dict(head_dim=16),
    # Helium: interleaved full-head rotary, q/k/v biased and the output projection not
    "helium": dict(head_dim=16, attention_bias=True),
    # Apertus: an ungated xIELU MLP (each layer's own alphas), per-head q/k norms, its llama3 rotary
    # over an original 64 positions
    "apertus": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 12_000_000.0, "factor": 8.0,
                                     "original_max_position_embeddings": 64, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0}),
    # V2-Lite's shape scaled down (no query compression, softmax routing over expert groups, a
    # dense first layer) and V3's (query compression, sigmoid + bias routing, renormalised and
    # scaled weights). A latent of 32 + a rope key of 16: a 48-wide cache entry per token and layer.
    # (V2 picks from 1 of 2 groups: with top-2 of the best 2 groups, a group's best expert
    # scoring it, the pick would be the plain top-2 whatever the groups)
    "deepseek_v2": dict(**{**_DEEPSEEK, "n_group": 2, "topk_group": 1}, q_lora_rank=None, n_shared_experts=2,
                        topk_method="group_limited_greedy", routed_scaling_factor=1.5),
    "deepseek_v3": dict(**_DEEPSEEK, q_lora_rank=48, n_shared_experts=1, norm_topk_prob=True,
                        routed_scaling_factor=2.5),
    # Mistral 4: V3's latent attention, softmax routing over 4 groups (the best 2 eligible), YaRN over
    # an original 16 positions and queries scaled past every 16th (llama_4_scaling_beta)
    "mistral4": dict(**_DEEPSEEK, q_lora_rank=48, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=1.5,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0,
                                      "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.5}),
    # DeepSeek-V3.2 and GLM-5: V3 with an indexer that picks index_topk keys per query (64 here:
    # every key of the tests' contexts, which stay within it)
    "deepseek_v32": dict(**_DEEPSEEK, q_lora_rank=48, n_shared_experts=1, norm_topk_prob=True,
                         routed_scaling_factor=2.5, index_topk=64, index_head_dim=16, index_n_heads=2),
    "glm_moe_dsa": dict(**_DEEPSEEK, q_lora_rank=48, n_shared_experts=1, norm_topk_prob=True,
                        routed_scaling_factor=2.5, index_topk=64, index_head_dim=16, index_n_heads=2),
    # GLM-4.7-Flash: V3's latent attention and GLM-4.5's MoE; its dense layers by mlp_layer_types
    "glm4_moe_lite": dict(**_DEEPSEEK, q_lora_rank=48, n_shared_experts=1, norm_topk_prob=True,
                          routed_scaling_factor=1.8, mlp_layer_types=["dense", "sparse", "dense"]),
    # alternating windows of 8 keys, a SwiGLU limit the tiny experts reach, gpt-oss's YaRN (factor 32 = 512 / 16)
    "gpt_oss": dict(head_dim=16, sliding_window=8, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                    swiglu_limit=2.0, rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                       "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                       "original_max_position_embeddings": 16}),
}


def _image_text_config(arch: str, text):
    """The wrapper config of an image-text checkpoint around the text config `text`: a one-layer
    vision tower of 28-pixel images, ties as the text model does (transformers ties by the
    wrapper's setting)."""
    import transformers

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    common = dict(text_config=text.to_dict(), tie_word_embeddings=text.tie_word_embeddings)
    if arch == "gemma3_vision":
        return transformers.Gemma3Config(**common, vision_config=transformers.SiglipVisionConfig(**vision).to_dict(),
                                         mm_tokens_per_image=4, image_token_index=500)
    if arch == "gemma4_vision":  # (image ids inside the tiny vocabulary; no audio tower)
        tower = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                                patch_size=14, position_embedding_size=64)
        ids = dict(boi_token_id=498, eoi_token_id=499, image_token_id=500, video_token_id=501, boa_token_id=502,
                   eoa_token_index=503, audio_token_id=504)
        return transformers.Gemma4Config(**common, vision_config=tower.to_dict(), **ids)
    if arch in ("mistral3", "ministral3_vision", "mistral4_vision"):
        return transformers.Mistral3Config(**common, image_token_index=500, vision_config=transformers.PixtralVisionConfig(
            **vision, head_dim=16).to_dict())
    if arch in ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5_vl", "qwen3_5_moe_vl"):
        # M-RoPE's sections: a third of the rotary pairs each
        head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        half = int(head * text.rope_parameters.get("partial_rotary_factor", 1.0)) // 2
        rope = {**text.rope_parameters, "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}
        if arch != "qwen2_5_vl":
            rope["mrope_interleaved"] = True
        tower = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text.hidden_size)
        if arch == "qwen2_5_vl":
            tower.update(fullatt_block_indexes=[0])
        elif arch in ("qwen3_vl", "qwen3_vl_moe"):
            tower.update(deepstack_visual_indexes=[0])
        wrapper = {"qwen2_5_vl": transformers.Qwen2_5_VLConfig, "qwen3_vl": transformers.Qwen3VLConfig,
                   "qwen3_vl_moe": transformers.Qwen3VLMoeConfig, "qwen3_5_vl": transformers.Qwen3_5Config,
                   "qwen3_5_moe_vl": transformers.Qwen3_5MoeConfig}[arch]
        return wrapper(**{**common, "text_config": {**text.to_dict(), "rope_parameters": rope}}, image_token_id=500,
                       video_token_id=501, vision_config=tower)
    if arch == "llama4_vision":
        tower = transformers.Llama4VisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                intermediate_size=64, image_size=28, patch_size=14,
                                                vision_output_dim=32, projector_input_dim=32,
                                                projector_output_dim=text.hidden_size)
        return transformers.Llama4Config(**common, vision_config=tower.to_dict(), image_token_index=500)
    return transformers.LlavaConfig(**common, image_token_index=500,
                                    vision_config=transformers.CLIPVisionConfig(**vision).to_dict())


def _config(arch: str, vocab_size: int, overrides: dict):
    from transformers import (
        ApertusConfig, ArceeConfig, BambaConfig, Cohere2Config, CohereConfig, DeepseekV2Config, DeepseekV3Config,
        Ernie4_5_MoeConfig, Ernie4_5Config, Exaone4Config, FalconMambaConfig, Gemma2Config, Gemma3TextConfig, Gemma4TextConfig,
        GemmaConfig, Glm4Config,
        Glm4MoeConfig, Glm4MoeLiteConfig, GlmConfig, GPTNeoXConfig, GptOssConfig, GraniteConfig, GraniteMoeConfig,
        GraniteMoeSharedConfig, HeliumConfig, HunYuanDenseV1Config, HunYuanMoEV1Config, Llama4TextConfig, LlamaConfig,
        MambaConfig, MiniMaxM2Config, Ministral3Config, MinistralConfig, Mistral4Config, MistralConfig, MixtralConfig,
        DeepseekV32Config, GlmMoeDsaConfig, GraniteMoeHybridConfig, Lfm2Config, NemotronHConfig,
        NemotronConfig, Olmo2Config, Olmo3Config, OlmoConfig, OlmoeConfig, Phi3Config, PhiConfig, PhimoeConfig,
        Qwen2Config, Qwen2MoeConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3Config, Qwen3MoeConfig,
        Qwen3NextConfig, SeedOssConfig, SmolLM3Config, StableLmConfig, Starcoder2Config,
    )

    # Qwen3-VL-MoE's stacked experts must not be square (H != 2I): transformers' load transposes
    # them only where the shape tells the layouts apart
    wrapper = {"moe_intermediate_size": 24} if arch == "qwen3_vl_moe" else {}
    arch = IMAGE_TEXT[arch][0] if arch in IMAGE_TEXT else arch  # (the language model's family)
    if arch in ("opt", "gpt2", "gptj", "falcon"):
        return _gpt_config(arch, vocab_size, overrides)
    cfg = {**DEFAULTS, **MOE_DEFAULTS.get(arch, {}), **FAMILY_DEFAULTS.get(arch, {}), **wrapper,
           "vocab_size": vocab_size, **overrides}
    if arch not in ("gemma3", "olmo3", "gemma4"):  # their rope_parameters are by layer type
        cfg["rope_parameters"] = _rope_parameters(cfg)
    cfg.setdefault("tie_word_embeddings", False)
    cfg.setdefault("rms_norm_eps", 1e-6)
    common = dict(bos_token_id=None, dtype="float32")
    if arch == "llama":
        return LlamaConfig(**common, **cfg)
    if arch == "mistral":
        cfg.setdefault("sliding_window", None)
        return MistralConfig(**common, **cfg)
    if arch == "qwen2":
        return Qwen2Config(**common, **cfg)  # q/k/v projections always carry a bias
    if arch == "qwen3":
        # head_dim != hidden/heads on purpose, so a loader cannot assume it.
        cfg.setdefault("head_dim", 32)
        return Qwen3Config(**common, **cfg)
    if arch == "mixtral":
        cfg.setdefault("sliding_window", None)
        return MixtralConfig(**common, **cfg)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**common, **cfg)  # with the shared expert and its sigmoid gate
    if arch == "qwen3_moe":
        cfg.setdefault("head_dim", 32)
        return Qwen3MoeConfig(**common, **cfg)
    families = {"gemma": GemmaConfig, "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig, "phi3": Phi3Config,
                "olmo2": Olmo2Config, "olmo3": Olmo3Config, "ministral": MinistralConfig,
                "seed_oss": SeedOssConfig, "ernie4_5": Ernie4_5Config, "exaone4": Exaone4Config,
                "granite": GraniteConfig, "glm4": Glm4Config, "smollm3": SmolLM3Config,
                "deepseek_v2": DeepseekV2Config, "deepseek_v3": DeepseekV3Config, "gpt_oss": GptOssConfig,
                "olmoe": OlmoeConfig, "glm4_moe": Glm4MoeConfig, "minimax_m2": MiniMaxM2Config,
                "glm4_moe_lite": Glm4MoeLiteConfig, "ernie4_5_moe": Ernie4_5_MoeConfig,
                "granitemoe": GraniteMoeConfig, "cohere": CohereConfig, "cohere2": Cohere2Config,
                "starcoder2": Starcoder2Config, "arcee": ArceeConfig, "nemotron": NemotronConfig, "phi": PhiConfig,
                "stablelm": StableLmConfig, "gpt_neox": GPTNeoXConfig, "llama4": Llama4TextConfig,
                "ministral3": Ministral3Config, "hunyuan_v1_dense": HunYuanDenseV1Config,
                "olmo": OlmoConfig, "glm": GlmConfig, "helium": HeliumConfig,
                "apertus": ApertusConfig, "phimoe": PhimoeConfig, "hunyuan_v1_moe": HunYuanMoEV1Config,
                "qwen3_5": Qwen3_5TextConfig, "qwen3_5_moe": Qwen3_5MoeTextConfig, "qwen3_next": Qwen3NextConfig,
                "mistral4": Mistral4Config, "gemma4": Gemma4TextConfig, "deepseek_v32": DeepseekV32Config,
                "glm_moe_dsa": GlmMoeDsaConfig, "lfm2": Lfm2Config, "granitemoehybrid": GraniteMoeHybridConfig,
                "nemotron_h": NemotronHConfig, "bamba": BambaConfig, "mamba": MambaConfig,
                "falcon_mamba": FalconMambaConfig,
                "granitemoeshared": GraniteMoeSharedConfig}
    if arch in families:
        return families[arch](**common, **cfg)
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _gpt_config(arch: str, vocab_size: int, overrides: dict):
    """OPT, GPT-2, GPT-J and Falcon in their own config fields: DEFAULTS' shape (GPT-J: a quarter of
    each head rotated)."""
    from transformers import FalconConfig, GPT2Config, GPTJConfig, OPTConfig

    d = DEFAULTS
    common = dict(bos_token_id=None, dtype="float32", vocab_size=vocab_size)
    overrides = {"tie_word_embeddings": False, **overrides}
    if arch == "opt":
        shape = dict(hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"],
                     num_attention_heads=d["num_attention_heads"], ffn_dim=d["intermediate_size"],
                     max_position_embeddings=d["max_position_embeddings"], word_embed_proj_dim=d["hidden_size"],
                     activation_function="relu")
        return OPTConfig(**common, **{**shape, **overrides})
    if arch == "falcon":  # Falcon-7B's layout by default: multi-query, attention and MLP in parallel
        shape = dict(hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"],
                     num_attention_heads=d["num_attention_heads"], ffn_hidden_size=d["intermediate_size"],
                     max_position_embeddings=d["max_position_embeddings"])
        return FalconConfig(**common, **{**shape, **overrides})
    shape = dict(n_embd=d["hidden_size"], n_layer=d["num_hidden_layers"], n_head=d["num_attention_heads"],
                 n_inner=d["intermediate_size"], n_positions=d["max_position_embeddings"])
    if arch == "gptj":
        return GPTJConfig(**common, **{**shape, "rotary_dim": 4, **overrides})
    return GPT2Config(**common, **{**shape, **overrides})


def _init_weights(model, seed: int, std: float) -> None:
    """Seeded, scaled-up init. Norm weights and biases are random too (not 1 / 0) so a
    loader that forgets to load them gives different logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name and not name.endswith(".bias"):  # (a LayerNorm's bias: as any bias)
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".sinks"):  # gpt-oss: logits that outweigh some heads' keys
                param.copy_(2.0 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(std * noise)
        for name, buffer in sorted(model.named_buffers()):  # DeepSeek-V3's (GLM-4.5's, MiniMax-M2's) routing bias
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))


def make_checkpoint(path, arch: str = "llama", *, sharded: bool = False, seed: int = SEED,
                    init_std: float | None = None, **overrides) -> pathlib.Path:
    """Write a tiny random `arch` checkpoint (float32) with tokenizer and chat template.

    `overrides` are config fields (hidden_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, intermediate_size, vocab_size, max_position_embeddings, head_dim,
    tie_word_embeddings, rope_scaling / rope_parameters, rope_theta, ...).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging

    logging.disable_progress_bar()  # "Writing model shards" bars only clutter test output
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    eos, pad = tok.convert_tokens_to_ids(EOS_TOKEN), tok.convert_tokens_to_ids(PAD_TOKEN)
    if overrides.get("vocab_size", len(tok)) < len(tok):
        raise ValueError(f"vocab_size must be >= the tokenizer's {len(tok)} ids")
    config = _config(arch, len(tok), overrides)
    config.eos_token_id, config.pad_token_id = eos, pad
    init_std = init_std or FAMILY_INIT_STD.get(arch, INIT_STD)
    config.initializer_range = init_std

    if arch in IMAGE_TEXT:
        config = _image_text_config(arch, config)
        config.eos_token_id, config.pad_token_id = eos, pad
    with torch.random.fork_rng():  # transformers' own init is overwritten; keep global RNG as is
        if arch in IMAGE_TEXT:
            import transformers
            model = getattr(transformers, IMAGE_TEXT[arch][1])(config).to(torch.float32)
        elif arch in OUTSIDE_CAUSAL_LM_AUTO:
            import transformers
            model = getattr(transformers, OUTSIDE_CAUSAL_LM_AUTO[arch])(config).to(torch.float32)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed, init_std)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad,
                                               bos_token_id=None, do_sample=False)
    # A shard limit below the model size gives several files + model.safetensors.index.json.
    shard = max(_model_bytes(model) // 3, 1) if sharded else "50GB"
    if arch == "qwen3_vl_moe":  # (transformers 5.24 fails to revert its experts' layout on save)
        model.save_pretrained(path, max_shard_size=shard, save_original_format=False)
        _stack_experts_as_released(path)
    else:
        model.save_pretrained(path, max_shard_size=shard)
    tok.model_max_length = config.get_text_config().max_position_embeddings
    tok.save_pretrained(path)
    return path


def special_tokenizer(special_tokens: list[str], eos: str, pad: str, chat_template: str):
    """The byte-level BPE of `build_tokenizer` with another family's special tokens after the
    learned vocabulary and its chat template (tests/harmony_checkpoint.py, gemma4_checkpoint.py)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens(special_tokens)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token=pad, clean_up_tokenization_spaces=False,
        additional_special_tokens=[t for t in special_tokens if t not in (eos, pad)])
    hf_tok.chat_template = chat_template
    return hf_tok


def with_tokenizer(path, arch: str, tok, eos: str, pad: str, generation_eos: list[str], **overrides) -> pathlib.Path:
    """The `arch` checkpoint of `make_checkpoint` with tokenizer `tok` (special_tokenizer) and its
    eos ids in config.json (`eos`) and generation_config.json (`generation_eos`)."""
    import json

    path = make_checkpoint(path, arch, vocab_size=len(tok), **overrides)
    for stale in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (path / stale).unlink(missing_ok=True)
    tok.model_max_length = overrides.get("max_position_embeddings", 512)
    tok.save_pretrained(path)
    for name, fields in (("config.json", dict(eos_token_id=tok.convert_tokens_to_ids(eos))),
                         ("generation_config.json", dict(eos_token_id=tok.convert_tokens_to_ids(generation_eos)))):
        file = path / name
        file.write_text(json.dumps({**json.loads(file.read_text()), **fields,
                                    "pad_token_id": tok.convert_tokens_to_ids(pad)}, indent=2))
    return path


def _stack_experts_as_released(path: pathlib.Path) -> None:
    """Qwen3-VL-MoE's releases stack each layer's experts for `x @ W`: gate_up_proj [E, H, 2I],
    down_proj [E, I, H] (transformers transposes them on load)."""
    from safetensors.torch import load_file, save_file

    for file in path.glob("*.safetensors"):
        tensors = {name: t.transpose(1, 2).contiguous() if name.endswith(("experts.gate_up_proj", "experts.down_proj"))
                   else t for name, t in load_file(file).items()}
        save_file(tensors, file, metadata={"format": "pt"})


def _model_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


_TOKENIZER = None


def _tokenizer():
    """Training takes ~1 s; every checkpoint uses the same tokenizer, so train once."""
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = build_tokenizer()
    return _TOKENIZER


def read_checkpoint(src: pathlib.Path) -> tuple[dict, dict]:
    """(config.json, every tensor of the safetensors files) of checkpoint `src`: what the
    quantized copies below start from."""
    import json

    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    return json.loads((src / "config.json").read_text()), tensors


def _write_copy(src: pathlib.Path, dst: pathlib.Path, tensors: dict, config: dict) -> pathlib.Path:
    """A checkpoint at `dst` of these tensors and config, with `src`'s other files (tokenizer,
    generation config, chat template)."""
    import json
    import shutil

    from safetensors.torch import save_file

    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def draft_copy(src, dst, layers: list[int]) -> pathlib.Path:
    """A checkpoint of `src` with only the decoder layers `layers` (renumbered), its
    embeddings, final norm, LM head and tokenizer: a draft model for `src` (speculative
    decoding; skipping layers is the self-speculative recipe) that shares its vocabulary.
    Written once per `dst`."""
    import json

    from safetensors.torch import load_file

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    if (dst / "config.json").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = len(layers)
    if config.get("layer_types"):
        config["layer_types"] = [config["layer_types"][i] for i in layers]
    renumber = {old: new for new, old in enumerate(layers)}
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            parts = name.split(".")
            if "layers" in parts:
                at = parts.index("layers") + 1
                if int(parts[at]) not in renumber:
                    continue
                parts[at] = str(renumber[int(parts[at])])
            tensors[".".join(parts)] = t
    return _write_copy(src, dst, tensors, config)


# The linear layers the checkpoint writers below quantize: every projection, MLA's fused
# kv_a_proj_with_mqa and Mixtral's experts (w1 / w2 / w3) included, as LLM Compressor,
# GPTQModel and AutoAWQ quantize them.
QUANTIZED_PROJECTIONS = ("_proj.weight", "_proj_with_mqa.weight", ".w1.weight", ".w2.weight", ".w3.weight")
FLOAT_UNDER_QUANTIZATION = re.compile(r"\.experts\.|\.shared_experts?\.|kv_b_proj")
# What --quantization quantizes, under each family's names: the linear layers (OPT's fc1 / fc2 /
# out_proj, GPT-2's and StarCoder2's c_attn / c_fc / c_proj, Gated DeltaNet's in_proj_qkv / z / a / b
# (Qwen3-Next's in_proj_qkvz / ba), LFM2's w1 / w2 / w3 too), and which of them are row-parallel
LINEAR_WEIGHTS = re.compile(r"(_proj|_proj_with_mqa|_proj_(?:qkvz?|z|a|b|ba)|\.w[123]|\.c_fc|\.c_attn|\.fc1|\.fc2|"
                            r"\.dense|\.query_key_value|"
                            r"\.dense_h_to_4h|\.dense_4h_to_h)\.weight$")
ROW_PARALLEL_WEIGHTS = re.compile(r"(o_proj|down_proj|out_proj|\.w2|\.fc2|\.c_proj|\.dense|\.dense_4h_to_h)\.weight$")
EMBEDDINGS = ("model.embed_tokens.weight", "model.decoder.embed_tokens.weight", "transformer.wte.weight",
              "backbone.embeddings.weight",
              "gpt_neox.embed_in.weight")


def quantized_reference_copy(src, dst, kind: str = "int8", tp: int = 1) -> pathlib.Path:
    """`src` with every weight that --quantization `kind` quantizes (the attention and dense MLP
    projections, not MoE experts nor MLA's kv_b_proj; for int8 and w8a8_int8 the LM head and the
    embedding too) replaced by its dequantised value
    (a tied head written out beside the embedding): transformers on it computes what the
    quantized model should, in float32. At `tp` > 1 each rank quantizes its own shard, so a
    row-parallel layer's (o_proj, down_proj) input columns are quantized in `tp` parts. Written
    once per `dst`."""

    from kernels.quantization import dequantize, quantize

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    if (dst / "config.json").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    config, tensors = read_checkpoint(src)
    embedding = next(n for n in EMBEDDINGS if n in tensors)
    head = "embed_out.weight" if "embed_out.weight" in tensors else "lm_head.weight"  # (GPT-NeoX's name)
    if head not in tensors:  # tied: the head gets its own copy
        tensors[head] = tensors[embedding].clone()
    config["tie_word_embeddings"] = False
    conv1d = config.get("model_type") == "gpt2"  # GPT-2's projections are stored [in, out]
    for name, t in tensors.items():
        if FLOAT_UNDER_QUANTIZATION.search(name):  # MoE experts and MLA's absorbed kv_b_proj stay float
            continue
        if LINEAR_WEIGHTS.search(name) or (kind in ("int8", "w8a8_int8") and name in (head, embedding)):
            w = t.t() if conv1d and ".h." in name else t  # (as the engine holds it: [out, in])
            parts = w.chunk(tp, dim=1) if ROW_PARALLEL_WEIGHTS.search(name) else [w]
            w = torch.cat([dequantize(*quantize(part, kind)) for part in parts], dim=1).to(t.dtype)
            tensors[name] = w.t().contiguous() if conv1d and ".h." in name else w
    return _write_copy(src, dst, tensors, config)


def fp8_copies(src, root, block=(48, 48)) -> dict[str, pathlib.Path]:
    """`src`'s projections in float8 (e4m3) as FP8 checkpoints are written: {"block": the
    fine-grained layout of transformers (`weight_scale_inv` per `block`, which need not divide
    the shapes), "ct-block": the same blocks as compressed-tensors writes them (`weight_scale`,
    strategy "block"), "channel": compressed-tensors' (`weight_scale` per output channel, with a
    static `input_scale` beside it), and "reference-block" / "reference-channel": the float
    checkpoints of the weights each stands for}. Written once per `root`."""

    src, root = pathlib.Path(src), pathlib.Path(root)
    paths = {kind: root / kind for kind in ("block", "ct-block", "channel", "reference-block", "reference-channel")}
    if (paths["reference-channel"] / "config.json").exists():
        return paths
    config, tensors = read_checkpoint(src)
    out = {kind: {} for kind in paths}
    fmax = torch.finfo(torch.float8_e4m3fn).max
    for name, w in tensors.items():
        if not name.endswith(QUANTIZED_PROJECTIONS):
            for kind in paths:
                out[kind][name] = w
            continue
        w = w.float()
        n, k = w.shape
        bn, bk = block
        blocks = torch.zeros(-(-n // bn), -(-k // bk))
        for i in range(blocks.shape[0]):
            for j in range(blocks.shape[1]):
                blocks[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max() / fmax
        per_block = blocks.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        q_block = (w / per_block).to(torch.float8_e4m3fn)
        out["block"][name], out["block"][name + "_scale_inv"] = q_block, blocks
        out["ct-block"][name], out["ct-block"][name + "_scale"] = q_block, blocks
        rows = w.abs().amax(dim=1, keepdim=True) / fmax
        q_rows = (w / rows).to(torch.float8_e4m3fn)
        out["channel"][name], out["channel"][name + "_scale"] = q_rows, rows
        out["channel"][name.removesuffix("weight") + "input_scale"] = torch.tensor([0.05])
        out["reference-block"][name] = q_block.float() * per_block
        out["reference-channel"][name] = q_rows.float() * rows
    quant = {"block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": list(block)},
             "ct-block": {"quant_method": "compressed-tensors", "format": "float-quantized",
                          "config_groups": {"group_0": {
                              "targets": ["Linear"],
                              "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                          "block_structure": list(block), "symmetric": True, "dynamic": False},
                              "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                                    "group_size": 128, "symmetric": True, "dynamic": True}}},
                          "ignore": ["lm_head"]},
             "channel": {"quant_method": "compressed-tensors", "format": "float-quantized",
                         "config_groups": {"group_0": {
                             "targets": ["Linear"],
                             "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                         "symmetric": True, "dynamic": False},
                             "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                   "symmetric": True, "dynamic": False}}},
                         "ignore": ["lm_head"]}}
    for kind, path in paths.items():
        path.mkdir(parents=True, exist_ok=True)
        _write_copy(src, path, out[kind], {**config, **({"quantization_config": quant[kind]} if kind in quant else {})})
    return paths


def fp8_channel_copy(paths: dict, dst, quant: dict, key: str = "quantization_config",
                     suffixes: dict | None = None) -> pathlib.Path:
    """fp8_copies' per-channel checkpoint under another writer's quantization_config (Meta's
    fbgemm_fp8, NVIDIA ModelOpt's FP8: the same float8 weights and `weight_scale`s), under
    config.json's `key`, its tensors' `suffixes` renamed ({".weight_scale": ".weight_scale_inv"}: the names
    transformers' FP8Linear gives them)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    dst = pathlib.Path(dst)
    if not (dst / "config.json").exists():
        shutil.copytree(paths["channel"], dst)
        config = {k: v for k, v in json.loads((dst / "config.json").read_text()).items() if k != "quantization_config"}
        (dst / "config.json").write_text(json.dumps({**config, key: quant}))
        tensors = load_file(dst / "model.safetensors")
        for old, new in (suffixes or {}).items():
            tensors = {name.removesuffix(old) + new if name.endswith(old) else name: t for name, t in tensors.items()}
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def int8_copy(src, dst, strategy: str = "channel", activations: str | None = "dynamic",
              weights: dict | None = None) -> tuple[pathlib.Path, pathlib.Path]:
    """`src`'s projections as compressed-tensors `int-quantized` writes them (LLM Compressor's
    W8A8 / W8A16 int8): int8 codes `W.weight` = round(w / s) clamped to [-128, 127] with s =
    max |w| / 127.5 per output channel or for the tensor (its symmetric scale; a row's largest
    negative weight codes as -128), `W.weight_scale` [N, 1] (or [1]) in the weights' dtype,
    `W.input_scale` for static activations; the LM head left float (`ignore`). Returns (that
    checkpoint, the float checkpoint of the weights it stands for). `weights`: overrides of the
    weights' scheme (to write configs shoal refuses). Written once per `dst`."""

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    reference = dst.with_name(dst.name + "-reference")
    if (reference / "config.json").exists():
        return dst, reference
    config, tensors = read_checkpoint(src)
    out, ref = {}, {}
    for name, w in tensors.items():
        out[name] = ref[name] = w
        if not name.endswith(QUANTIZED_PROJECTIONS):
            continue
        wf = w.float()
        top = wf.abs().amax(dim=1, keepdim=True) if strategy == "channel" else wf.abs().max().reshape(1)
        scale = (top / 127.5).to(w.dtype)
        codes = torch.round(wf / scale.float().reshape(-1, 1)).clamp(-128, 127).to(torch.int8)
        out[name], out[name + "_scale"] = codes, scale
        if activations == "static":
            out[name.removesuffix("weight") + "input_scale"] = torch.tensor([0.02], dtype=w.dtype)
        ref[name] = (codes.float() * scale.float().reshape(-1, 1)).to(w.dtype)
    group = {"targets": ["Linear"],
             "weights": {"num_bits": 8, "type": "int", "strategy": strategy, "symmetric": True, "dynamic": False,
                         "group_size": None, **(weights or {})}}
    if activations:
        group["input_activations"] = {"num_bits": 8, "type": "int", "symmetric": True,
                                      "strategy": "token" if activations == "dynamic" else "tensor",
                                      "dynamic": activations == "dynamic"}
    quant = {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": group}, "ignore": ["lm_head"], "kv_cache_scheme": None}
    for path, written, cfg in ((dst, out, {**config, "quantization_config": quant}), (reference, ref, config)):
        path.mkdir(parents=True, exist_ok=True)
        _write_copy(src, path, written, cfg)
    return dst, reference


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stacked expert weight [E, K, N] (transformers' layout, x @ W[e]) as an MXFP4 checkpoint
    stores it: (blocks uint8 [E, N, K / 32, 16], scales uint8 [E, N, K / 32]). Each group of 32
    gets the smallest power-of-two scale that fits its largest value into e2m1's +-6, and each
    value the nearest e2m1 code; element 2i goes in a byte's low nibble, 2i + 1 in its high one."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    groups = w.float().transpose(1, 2).reshape(w.shape[0], w.shape[2], w.shape[1] // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -126)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / torch.exp2(exponent)
    magnitude = (scaled.abs()[..., None] - grid).abs().argmin(-1)
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent[..., 0] + 127).to(torch.uint8)


def mxfp4_copy(src, dst) -> pathlib.Path:
    """`src` (a gpt_oss checkpoint) with its experts' projections in MXFP4, laid out as
    gpt-oss's release lays them out (`*_blocks` / `*_scales`, quantization_config mxfp4 that
    leaves attention, router, embedding and head in float). Written once per `dst`."""
    import json

    from safetensors.torch import load_file

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    if (dst / "config.json").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(t)
            else:
                tensors[name] = t
    return _write_copy(src, dst, tensors, config)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (held in int64) as the int32 the writers save."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _pack(codes: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Codes (0 .. 2 ** bits - 1) packed 32 // bits to an int32 along `dim`, code i of a
    word in bits [bits * i, bits * (i + 1)); `order[i]`: which of the word's columns goes in
    slot i (AWQ's interleave), else the i-th."""
    per = 32 // bits
    codes = codes.long() if dim == 1 else codes.long().t()
    rows, cols = codes.shape
    chunks = codes.view(rows, cols // per, per)
    if order is not None:
        chunks = chunks[:, :, list(order)]
    words = (chunks << (torch.arange(per) * bits)).sum(-1)
    return _as_int32(words if dim == 1 else words.t()).contiguous()


def quantize_int4(w: torch.Tensor, bits: int, group_size: int, sym: bool, g_idx: torch.Tensor,
                  scale_dtype=torch.float16):
    """GPTQ's grid for W [N, K]: per (output row, group of input columns) a scale (rounded to
    `scale_dtype`, as the writers store it) and a zero point; sym puts the zero at 2 ** (bits - 1).
    Returns (codes [N, K], scales [N, G], zeros [N, G]) and g_idx [K] picks each column's group."""
    maxq = 2 ** bits - 1
    groups = int(g_idx.max()) + 1
    n, k = w.shape
    scales, zeros = torch.zeros(n, groups), torch.zeros(n, groups, dtype=torch.long)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            scale, zero = 2 * hi / maxq, torch.full((n,), (maxq + 1) // 2)
        else:
            scale = (hi - lo) / maxq
            zero = torch.round(-lo / scale.clamp(min=1e-8)).long()
        scales[:, g] = scale.clamp(min=1e-8).to(scale_dtype).float()
        zeros[:, g] = zero
    codes = torch.clamp(torch.round(w / scales[:, g_idx]) + zeros[:, g_idx], 0, maxq).long()
    return codes, scales, zeros


def pack_int4(method: str, w: torch.Tensor, *, bits: int = 4, group_size: int = 32, sym: bool = True,
              act_order: bool = False, v2: bool = False, generator=None) -> tuple[dict, torch.Tensor]:
    """One weight W [N, K] as `method` writes it (see int4_copies): ({suffix: tensor} of the
    module, the weight those stand for, in W's dtype)."""
    n, k = w.shape
    size = k if group_size == -1 else group_size
    if act_order == "shared":  # one permutation per input width, as GPTQ's (from the input's Hessian)
        generator = torch.Generator().manual_seed(k)
    rank = torch.randperm(k, generator=generator) if act_order else torch.arange(k)
    g_idx = rank // size  # column c is the rank[c]-th one quantized
    scale_dtype = torch.bfloat16 if method == "compressed-tensors" else torch.float16
    codes, scales, zeros = quantize_int4(w.float(), bits, group_size, sym, g_idx, scale_dtype)
    mask, parts = 2 ** bits - 1, {}
    if method == "gptq":
        offset = 0 if v2 else 1
        stored = (zeros - offset) & mask  # v1 stores z - 1 (a zero of 0 reads back as 16)
        zeros = stored + offset
        parts[".qweight"] = _pack(codes.t(), bits, 0)  # [K / 8, N]
        parts[".qzeros"] = _pack(stored.t(), bits, 1)  # [G, N / 8]
        parts[".scales"] = scales.t().to(torch.float16).contiguous()
        parts[".g_idx"] = g_idx.to(torch.int32)
    elif method == "awq":
        awq_order = (0, 2, 4, 6, 1, 3, 5, 7)
        parts[".qweight"] = _pack(codes.t(), bits, 1, awq_order)  # [K, N / 8]
        parts[".qzeros"] = _pack(zeros.t(), bits, 1, awq_order)  # [G, N / 8]
        parts[".scales"] = scales.t().to(torch.float16).contiguous()
    else:
        parts[".weight_packed"] = _pack(codes, bits, 1)  # [N, K / 8], codes = value + 8
        parts[".weight_scale"] = scales.to(torch.bfloat16).contiguous()
        parts[".weight_shape"] = torch.tensor([n, k])
        if not sym:
            parts[".weight_zero_point"] = _pack(zeros, bits, 0)  # [N / 8, G]
        if act_order:
            parts[".weight_g_idx"] = g_idx.to(torch.int32)
    return parts, ((codes - zeros[:, g_idx]).float() * scales[:, g_idx]).to(w.dtype)


def int4_copies(src, root, method: str, *, bits: int = 4, group_size: int = 32, sym: bool = True,
                act_order: bool = False, v2: bool = False, float_modules: tuple = ()) -> dict[str, pathlib.Path]:
    """`src`'s attention and MLP projections packed as `method` writes them ("gptq": AutoGPTQ /
    GPTQModel's qweight / qzeros / scales / g_idx, v1 zeros stored minus 1 unless `v2`; "awq":
    AutoAWQ's GEMM layout; "compressed-tensors": LLM Compressor's pack-quantized), group_size -1
    per output channel, act_order a random permutation of the columns before grouping (g_idx;
    "shared": one per input width, so q/k/v and gate/up share theirs as GPTQ's do);
    `float_modules` (and the LM head and embedding) stay float. Returns {"packed": the
    checkpoint, "reference": the float checkpoint of the weights it stands for}. Written once
    per `root`."""

    src, root = pathlib.Path(src), pathlib.Path(root)
    paths = {kind: root / kind for kind in ("packed", "reference")}
    if (paths["reference"] / "config.json").exists():
        return paths
    config, tensors = read_checkpoint(src)
    generator = torch.Generator().manual_seed(7)
    packed, reference = {}, {}
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        if not name.endswith(QUANTIZED_PROJECTIONS) or module in float_modules:
            packed[name] = reference[name] = w
            continue
        parts, reference[name] = pack_int4(method, w, bits=bits, group_size=group_size, sym=sym,
                                           act_order=act_order, v2=v2, generator=generator)
        packed.update({module + suffix: t for suffix, t in parts.items()})
    if method == "gptq":
        quant = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order,
                 "sym": sym, "true_sequential": True, "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    elif method == "awq":
        quant = {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True,
                 "version": "gemm", "modules_to_not_convert": list(float_modules) or None}
    else:
        # every field as LLM Compressor writes it (observer_kwargs an object, sparsity and transforms empty)
        weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
                   "strategy": "channel" if group_size == -1 else "group",
                   "group_size": None if group_size == -1 else group_size,
                   "actorder": "group" if act_order else None, "block_structure": None, "observer": "minmax",
                   "observer_kwargs": {}}
        quant = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                 "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                               "output_activations": None, "format": "pack-quantized"}},
                 "ignore": ["lm_head", *float_modules], "global_compression_ratio": None, "kv_cache_scheme": None,
                 "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
                 "version": "0.10.2"}
    for kind, out in (("packed", packed), ("reference", reference)):
        paths[kind].mkdir(parents=True, exist_ok=True)
        _write_copy(src, paths[kind], out, {**config, **({"quantization_config": quant} if kind == "packed" else {})})
    return paths


E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; bit 3 the sign
E4M3_MAX = 448.0


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """Values on the e2m1 grid [N, K] -> uint8 [N, K / 2] as both NVFP4 writers pack them
    (compressed-tensors' pack_fp4_to_uint8 `indices[:, 0] | (indices[:, 1] << 4)`, ModelOpt's
    `(q[..., 1::2] << 4) | q[..., 0::2]`): element 2i in the low nibble, 2i + 1 in the high one."""
    magnitude = (values.abs()[..., None] - torch.tensor(E2M1_MAGNITUDES)).abs().argmin(-1)
    codes = (magnitude | (torch.signbit(values).long() << 3)).to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def quantize_nvfp4(w: torch.Tensor, writer: str) -> tuple[dict, torch.Tensor]:
    """A weight [N, K] as `writer` ("compressed-tensors" or "modelopt") quantizes it to NVFP4:
    ({suffix: tensor}, the float32 weight the tensors stand for). The tensor-wide scale maps the
    weight's amax to e4m3's 448 times e2m1's 6 (ModelOpt stores amax / 2688 as weight_scale_2,
    compressed-tensors its reciprocal as weight_global_scale, a divisor); each group of 16
    gets its amax / 6 over the tensor-wide scale in e4m3, each value the nearest e2m1 code."""
    w = w.float()
    n, k = w.shape
    groups = w.reshape(n, k // 16, 16)
    amax = w.abs().max().clamp(min=1e-12)
    if writer == "compressed-tensors":
        tensor_wide = (E4M3_MAX * 6.0 / amax).reshape(1)  # generate_gparam
        scale = (tensor_wide * groups.abs().amax(-1) / 6.0).to(torch.float8_e4m3fn)  # calculate_qparams
        step = scale.float() / tensor_wide  # _dequantize: scale / global_scale
    else:
        tensor_wide = amax / (6.0 * E4M3_MAX)  # get_weights_scaling_factor_2
        scale = (groups.abs().amax(-1) / (6.0 * tensor_wide)).to(torch.float8_e4m3fn)
        step = scale.float() * tensor_wide  # NVFP4QTensor.dequantize: scale * double_scale
    step = torch.where(step == 0, torch.ones_like(step), step)
    scaled = (groups / step[..., None]).clamp(-6.0, 6.0)
    grid = torch.tensor(E2M1_MAGNITUDES)
    values = grid[(scaled.abs()[..., None] - grid).abs().argmin(-1)] * scaled.sign()
    reference = (values * step[..., None]).reshape(n, k)
    packed = pack_e2m1(values.reshape(n, k))
    if writer == "compressed-tensors":
        return {".weight_packed": packed, ".weight_scale": scale, ".weight_global_scale": tensor_wide}, reference
    return {".weight": packed, ".weight_scale": scale, ".weight_scale_2": tensor_wide}, reference


def nvfp4_copies(src, root, writer: str, *, activations: bool = True, float_modules: tuple = (),
                 hf_quant_config: bool = False) -> dict[str, pathlib.Path]:
    """`src`'s attention and MLP projections (each MoE expert's too; the router, embedding and
    LM head stay float, as do `float_modules`) in NVFP4 as `writer` writes them:
    "compressed-tensors" (LLM Compressor's nvfp4-pack-quantized: NVFP4 with
    `input_global_scale`s, NVFP4A16 without `activations`) or "modelopt" (quant_algo NVFP4 with
    `input_scale`s, W4A16_NVFP4 without; its settings in hf_quant_config.json instead of
    config.json with `hf_quant_config`). Returns {"packed": the checkpoint, "reference": the
    float checkpoint of the weights it stands for}. Written once per `root`."""
    import json

    src, root = pathlib.Path(src), pathlib.Path(root)
    paths = {kind: root / kind for kind in ("packed", "reference")}
    if (paths["reference"] / "config.json").exists():
        return paths
    config, tensors = read_checkpoint(src)
    packed, reference = {}, {}
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        if not name.endswith(QUANTIZED_PROJECTIONS) or module in float_modules:
            packed[name] = reference[name] = w
            continue
        parts, reference[name] = quantize_nvfp4(w, writer)
        packed.update({module + suffix: t for suffix, t in parts.items()})
        if activations:  # static activation scales: not read (activations stay float)
            scale = ".input_global_scale" if writer == "compressed-tensors" else ".input_scale"
            packed[module + scale] = torch.tensor([2.5]) if writer == "compressed-tensors" else torch.tensor(0.4)
    if writer == "compressed-tensors":
        fp4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
               "dynamic": False, "observer": "minmax"}
        group = {"targets": ["Linear"], "weights": fp4, "format": "nvfp4-pack-quantized",
                 "input_activations": {**fp4, "dynamic": "local"} if activations else None}
        quant = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                 "quantization_status": "compressed", "config_groups": {"group_0": group},
                 "ignore": ["lm_head", *float_modules]}
    else:
        quant = {"quant_method": "modelopt", "quant_algo": "NVFP4" if activations else "W4A16_NVFP4",
                 "group_size": 16, "kv_cache_quant_algo": None, "exclude_modules": ["lm_head", *float_modules]}
    for kind, out in (("packed", packed), ("reference", reference)):
        paths[kind].mkdir(parents=True, exist_ok=True)
        in_config = kind == "packed" and not hf_quant_config
        _write_copy(src, paths[kind], out, {**config, **({"quantization_config": quant} if in_config else {})})
    if hf_quant_config:
        settings = {k: v for k, v in quant.items() if k != "quant_method"}
        (paths["packed"] / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.37.0"}, "quantization": settings}))
    return paths
