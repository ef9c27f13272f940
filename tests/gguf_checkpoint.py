"""GGUF copies of the test checkpoints, written as llama.cpp's convert_hf_to_gguf.py writes them
(its metadata keys, its tensor names from gguf-py's TensorNameMap, Llama's q / k rows permuted
for its rotary, Gemma's norms stored + 1, Qwen3.5's value heads tiled, experts stacked, Llama 3's rotary scaling as a
`rope_freqs` tensor), with a float checkpoint of what the file's weights stand for beside it:
the oracle a GGUF's reading is checked against."""
from __future__ import annotations

import json
import math
import pathlib
import re

import numpy as np
import torch

# transformers' model_type -> gguf-py's architecture
ARCHS = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "qwen3_moe": "QWEN3MOE",
         "qwen2_moe": "QWEN2MOE", "gemma2": "GEMMA2", "gemma3_text": "GEMMA3", "phi3": "PHI3",
         "qwen3_5_text": "QWEN35", "qwen3_5_moe_text": "QWEN35MOE", "lfm2": "LFM2", "gpt_oss": "GPT_OSS",
         "mixtral": "LLAMA", "deepseek_v2": "DEEPSEEK2", "deepseek_v3": "DEEPSEEK2", "glm4_moe": "GLM4_MOE",
         "granite": "GRANITE", "smollm3": "SMOLLM3", "olmo2": "OLMO2", "olmo3": "OLMO2"}
LLAMA = ("llama", "mistral", "mixtral", "granite", "smollm3")  # q / k rows permuted for llama.cpp's rotary
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
QWEN35 = ("qwen3_5_text", "qwen3_5_moe_text")
GEMMA = ("gemma2", "gemma3_text")  # norms stored + 1 (llama.cpp's RMSNorm multiplies by w alone)


def _permute(w: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """convert_hf_to_gguf.py LlamaModel.permute: each head's rotary halves interleaved."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(cfg: dict, head_dim: int) -> torch.Tensor:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: Llama 3's rotary scaling as a
    divisor per frequency."""
    rope = cfg["rope_parameters"]
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _tokenizer_fields(writer, src: pathlib.Path, cfg: dict) -> None:
    """The test tokenizer (byte-level BPE) as convert_hf_to_gguf.py's _set_vocab_gpt2 writes it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    spec = json.loads((src / "tokenizer.json").read_text())
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    tokens += [f"[PAD{i}]" for i in range(len(tokens), cfg["vocab_size"])]  # (as the converter pads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")  # GPT-2's split, the test tokenizer's
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 5 if i >= len(tok) else 1 for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])
    writer.add_add_bos_token(False)
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)


def _settings(writer, cfg: dict, tensors: dict, latent_split: bool) -> None:
    """TextModel.set_gguf_parameters (and the families' own) as the converter writes them."""
    import gguf

    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # (Gemma 3: the global layers' rotary; the local one is fixed)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    # (Glm4MoeModel: the multi-token-prediction layers counted, last; DeepseekV2Model skips them)
    writer.add_block_count(cfg["num_hidden_layers"] + _mtp_layers(cfg))
    if cfg["model_type"] == "lfm2":  # LFM2Model: the width it ends with, kv heads 0 on convolution layers
        writer.add_feed_forward_length(tensors["model.layers.0.feed_forward.w1.weight"].shape[0])
        writer.add_head_count_kv([cfg["num_key_value_heads"] if t == "full_attention" else 0
                                  for t in cfg["layer_types"]])
        writer.add_shortconv_l_cache(cfg["conv_L_cache"])
    elif cfg["model_type"] in DEEPSEEK:
        writer.add_feed_forward_length(cfg["intermediate_size"])
        _deepseek_settings(writer, cfg, latent_split)
    else:
        writer.add_feed_forward_length(cfg["intermediate_size"])
        writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_head_count(heads)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(cfg.get("norm_eps") if cfg["model_type"] == "lfm2" else cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    if "head_dim" in cfg and cfg["model_type"] not in DEEPSEEK + ("granite",):  # (GraniteModel drops head_dim)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if cfg["model_type"] in LLAMA:
        writer.add_rope_dimension_count(head_dim)
    if cfg["model_type"] in QWEN35:  # Qwen3_5TextModel: the gated delta net's sizes, the rotary's sections
        rotated = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        writer.add_full_attention_interval(cfg["layer_types"].index("full_attention") + 1)
        writer.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        writer.add_ssm_state_size(cfg["linear_key_head_dim"])
        writer.add_ssm_group_count(cfg["linear_num_key_heads"])
        writer.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        writer.add_ssm_inner_size(cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"])
        writer.add_rope_dimension_count(rotated)
        writer.add_rope_dimension_sections([rotated // 2, 0, 0, 0])  # (text: one position stream)
    if cfg["model_type"] == "olmo3":  # Olmo2Model.set_gguf_parameters
        writer.add_sliding_window(cfg["sliding_window"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
        if "attention_factor" in rope:
            writer.add_rope_scaling_attn_factors(rope["attention_factor"])
    if cfg["model_type"] == "granite":  # GraniteModel.set_gguf_parameters: the multipliers not 0
        for hf, scale in (("attention_multiplier", "attention_scale"), ("embedding_multiplier", "embedding_scale"),
                          ("residual_multiplier", "residual_scale"), ("logits_scaling", "logit_scale")):
            if cfg.get(hf):
                getattr(writer, f"add_{scale}")(cfg[hf])
    if cfg["model_type"] == "glm4_moe":  # Glm4MoeModel.set_gguf_parameters
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.5)))
        writer.add_expert_shared_count(cfg["n_shared_experts"])
        writer.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
        writer.add_expert_weights_norm(cfg["norm_topk_prob"])
        writer.add_expert_group_count(cfg["n_group"])
        writer.add_expert_group_used_count(cfg["topk_group"])
        writer.add_nextn_predict_layers(cfg["num_nextn_predict_layers"])
    if cfg["model_type"] == "phi3":  # Phi3MiniModel.set_gguf_parameters
        writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * cfg["hidden_size"]) // heads)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_sliding_window(cfg.get("sliding_window") or 0)
    if experts := cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"):
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    if cfg["model_type"] in GEMMA + ("gpt_oss",):
        writer.add_sliding_window(cfg["sliding_window"])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key) and cfg["model_type"] in GEMMA:
                getattr(writer, f"add_{key}")(cfg[key])
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if rope.get("rope_type") in ("linear", "yarn"):  # (TextModel.set_gguf_parameters)
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key in ("beta_fast", "beta_slow"):
            if key in rope:
                getattr(writer, f"add_rope_scaling_yarn_{key}")(rope[key])


# Mixtral's release names -> transformers 5's (the converter reads either)
MIXTRAL_NAMES = {"block_sparse_moe.gate.": "mlp.gate.", "block_sparse_moe.experts.": "mlp.experts.",
                 ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
_MIXTRAL_NAMES = re.compile("|".join(re.escape(k) for k in MIXTRAL_NAMES))


def _mtp_layers(cfg: dict) -> int:
    """Multi-token-prediction layers the converter writes after the model's (GLM-4.5's)."""
    return cfg.get("num_nextn_predict_layers", 0) if cfg["model_type"] == "glm4_moe" else 0


def _deepseek_settings(writer, cfg: dict, latent_split: bool) -> None:
    """DeepseekV2Model.set_gguf_parameters (and TextModel's MoE keys it relies on). latent_split:
    as converters since mid-2025 write it (MQA over the latent: kv_b_proj cut into attn_k_b and
    attn_v_b); else as older ones did (attn_kv_b, the heads' own sizes)."""
    import gguf

    rope, nope, v, latent = cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    if latent_split:
        writer.add_head_count_kv(1)
        writer.add_key_length(latent + rope)
        writer.add_value_length(latent)
        writer.add_key_length_mla(nope + rope)
        writer.add_value_length_mla(v)
    else:
        writer.add_head_count_kv(cfg["num_key_value_heads"])
        writer.add_key_length(nope + rope)
        writer.add_value_length(v)
    writer.add_kv_lora_rank(latent)
    if cfg.get("q_lora_rank"):
        writer.add_q_lora_rank(cfg["q_lora_rank"])
    writer.add_rope_dimension_count(rope)
    writer.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    writer.add_expert_shared_count(cfg["n_shared_experts"])
    writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    writer.add_expert_group_count(cfg["n_group"])
    writer.add_expert_group_used_count(cfg["topk_group"])
    v3 = cfg["model_type"] == "deepseek_v3"  # (its releases' scoring_func "sigmoid", V2's "softmax")
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if (mscale := (cfg.get("rope_parameters") or {}).get("mscale_all_dim")) is not None:
        writer.add_rope_scaling_yarn_log_mul(0.1 * mscale)


def _latent_split(tensors: dict, cfg: dict) -> dict:
    """kv_b_proj [heads * (nope + v), latent] cut as DeepseekV2Model.modify_tensors cuts it:
    k_b_proj [heads, latent, nope] (transposed) and v_b_proj [heads, v, latent]."""
    out, heads, nope = {}, cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
    for name, t in tensors.items():
        if name.endswith("kv_b_proj.weight"):
            k, v = t.reshape(heads, -1, t.shape[-1]).split([nope, cfg["v_head_dim"]], dim=1)
            out[name.replace("kv_b_proj", "k_b_proj")] = k.transpose(1, 2).contiguous()
            out[name.replace("kv_b_proj", "v_b_proj")] = v.contiguous()
        else:
            out[name] = t
    return out


def _latent_joined(tensors: dict) -> dict:
    """`_latent_split` undone."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("k_b_proj.weight"):
            v = tensors[name.replace("k_b_proj", "v_b_proj")]
            out[name.replace("k_b_proj", "kv_b_proj")] = torch.cat([t.transpose(1, 2), v], 1).reshape(-1, t.shape[1])
        elif not name.endswith("v_b_proj.weight"):
            out[name] = t
    return out


def _stacked(tensors: dict, cfg: dict) -> dict:
    """Per-expert tensors (mlp.experts.E.gate_proj.weight) stacked as the converter stacks them
    (mlp.experts.gate_proj.weight [E, I, H]); transformers 5's fused gate_up_proj cut apart."""
    out, experts = {}, {}
    for name, t in tensors.items():
        if cfg["model_type"] == "mixtral":
            name = _MIXTRAL_NAMES.sub(lambda m: MIXTRAL_NAMES[m[0]], name)
        parts = name.split(".")
        if cfg["model_type"] == "gpt_oss" and ".mlp.experts." in name:  # GptOssModel.modify_tensors
            out.update(_gpt_oss_stacked(name, t))
        elif ".mlp.experts." in name and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            key = ".".join(parts[:i + 1] + parts[i + 2:])
            experts.setdefault(key, {})[int(parts[i + 1])] = t
        elif name.endswith("mlp.experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj.weight")] = gate
            out[name.replace("gate_up_proj", "up_proj.weight")] = up
        elif name.endswith("mlp.experts.down_proj"):
            out[name + ".weight"] = t
        else:
            out[name] = t
    for key, by_index in experts.items():
        out[key] = torch.stack([by_index[e] for e in range(len(by_index))])
    return out


def _one_an_expert(tensors: dict) -> dict:
    """Stacked experts (mlp.experts.gate_proj.weight [E, I, H]) one tensor an expert
    (mlp.experts.E.gate_proj.weight)."""
    out = {}
    for name, t in tensors.items():
        if re.search(r"mlp\.experts\.(gate|up|down)_proj\.weight$", name):
            out.update({name.replace("experts.", f"experts.{e}."): t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


def _gpt_oss_stacked(name: str, t: torch.Tensor) -> dict:
    """gpt-oss's experts (used as x @ W, gate and up columns interleaved) as the converter writes
    them: matrices [E, out, in] and biases, gate and up apart."""
    if name.endswith("gate_up_proj"):
        return {name.replace("gate_up_proj", "gate_proj.weight"): t[..., 0::2].transpose(1, 2),
                name.replace("gate_up_proj", "up_proj.weight"): t[..., 1::2].transpose(1, 2)}
    if name.endswith("gate_up_proj_bias"):
        return {name.replace("gate_up_proj_bias", "gate_proj.bias"): t[..., 0::2],
                name.replace("gate_up_proj_bias", "up_proj.bias"): t[..., 1::2]}
    if name.endswith("down_proj"):
        return {name + ".weight": t.transpose(1, 2)}
    return {name.replace("down_proj_bias", "down_proj.bias"): t}


def _gpt_oss_unstacked(tensors: dict) -> dict:
    """`_gpt_oss_stacked` undone."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_proj.weight"):
            up = tensors[name.replace("gate_proj", "up_proj")]
            joined = torch.stack([t.transpose(1, 2), up.transpose(1, 2)], dim=-1)
            out[name.replace("gate_proj.weight", "gate_up_proj")] = joined.flatten(-2).contiguous()
        elif name.endswith("experts.gate_proj.bias"):
            up = tensors[name.replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj.bias", "gate_up_proj_bias")] = torch.stack([t, up], dim=-1).flatten(-2)
        elif name.endswith("experts.down_proj.weight"):
            out[name.removesuffix(".weight")] = t.transpose(1, 2).contiguous()
        elif name.endswith("experts.down_proj.bias"):
            out[name.replace("down_proj.bias", "down_proj_bias")] = t
        elif not name.endswith(("experts.up_proj.weight", "experts.up_proj.bias")):
            out[name] = t.contiguous()
    return out


def gguf_copy(src, dst: pathlib.Path, types: dict[str, str] | str = "F32", one_tensor_an_expert: bool = False,
              latent_split: bool = True, arch: str | None = None) -> tuple[pathlib.Path, pathlib.Path]:
    """(a GGUF of checkpoint `src`, a float checkpoint of the weights it stands for), both under
    `dst`. types: the ggml type of every matrix (norms, biases and other vectors stay F32, as the
    converter keeps them), or {GGUF name substring: type} with "*" for the rest, e.g.
    {"token_embd": "Q8_0", "ffn": "Q4_0", "*": "F16"}. K-quant types (Q4_K, Q6_K, ...), which
    gguf-py cannot quantize, are written as random valid blocks: the reference holds what they
    decode to. one_tensor_an_expert: experts as files made before llama.cpp stacked them
    (`blk.N.ffn_gate.E.weight`). latent_split: DeepSeek's kv_b_proj as newer converters write it
    (`_deepseek_settings`). arch: gguf-py's architecture to write instead of the family's (QWEN3VL:
    a Qwen3 checkpoint as Qwen3-VL's language model, Qwen3VLTextModel, with its M-RoPE sections)."""
    import gguf
    from tests.checkpoints import _write_copy, read_checkpoint

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    cfg, tensors = read_checkpoint(src)
    kind = cfg["model_type"]
    tensors = _stacked(tensors, cfg)
    if one_tensor_an_expert:
        tensors = _one_an_expert(tensors)
    if kind in DEEPSEEK and latent_split:
        tensors = _latent_split(tensors, cfg)
    arch = getattr(gguf.MODEL_ARCH, arch or ARCHS[kind])
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rng = np.random.default_rng(11)

    dst.mkdir(parents=True, exist_ok=True)
    file = dst / f"{src.name}.gguf"
    writer = gguf.GGUFWriter(str(file), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(src.name)
    _settings(writer, cfg, tensors, latent_split)
    if arch in (gguf.MODEL_ARCH.QWEN3VL, gguf.MODEL_ARCH.QWEN3VLMOE):  # Qwen3VLTextModel.set_gguf_parameters
        half = head_dim // 2
        writer.add_rope_dimension_sections([half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8, 0])
        writer.add_num_deepstack_layers(3)
    _tokenizer_fields(writer, src, cfg)
    reference = {}
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_factors(cfg, head_dim).numpy())
    if kind == "phi3" and rope.get("long_factor"):  # Phi3MiniModel.generate_extra_tensors
        scale = cfg["max_position_embeddings"] / rope["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"])) if scale > 1 else 1.0)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    for name, w in tensors.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings", kind in GEMMA):  # (Gemma's default)
            continue  # (the converter writes a tied head once, as the embedding)
        w = w.float()
        stored = w
        if kind in LLAMA and name.endswith("q_proj.weight"):
            stored = _permute(w, heads, heads)
        elif kind in LLAMA and name.endswith("k_proj.weight"):
            stored = _permute(w, heads, kv_heads)
        if kind in GEMMA and name.endswith("norm.weight"):
            stored = w + 1
        if name.endswith("shared_expert_gate.weight"):
            stored = w.reshape(-1)  # (the converter writes Qwen2-MoE's [1, H] gate as a vector)
        if kind in QWEN35:
            stored = torch.from_numpy(_qwen35_stored(name, w.numpy(), cfg))
        if name.endswith("conv.conv.weight"):  # (LFM2's short convolution, squeezed to [channels, kernel])
            stored = w[:, 0, :]
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if name.endswith("linear_attn.dt_bias"):  # (gguf-py's table has no entry for it)
            new = name.replace("model.layers.", "blk.").replace("linear_attn.dt_bias", "ssm_dt.bias")
        if m := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", name):
            new = f"blk.{m[1]}.ffn_{m[3]}.{m[2]}.weight"
        if name.endswith("e_score_correction_bias"):  # (the converter's own rename: exp_probs_b.bias)
            new = names.get_name(name.replace("_bias", ".bias"), try_suffixes=(".bias",))
        if name.endswith("self_attn.sinks"):  # (GptOssModel.filter_tensors names gpt-oss's sinks as a weight)
            new += ".weight"
        assert new is not None, name
        qtype = _type(types, new) if stored.dim() >= 2 and "conv.weight" not in new and "conv1d" not in new else "F32"
        data, decoded = _encode(stored.numpy(), qtype, rng)
        if qtype in ("F32", "F16"):
            writer.add_tensor(new, data)
        else:
            writer.add_tensor(new, data, raw_shape=data.shape, raw_dtype=getattr(gguf.GGMLQuantizationType, qtype))
        if kind in QWEN35:
            decoded = _qwen35_weights(name, decoded, cfg)
        reference[name] = _undo(torch.from_numpy(decoded), name, kind, heads, kv_heads).reshape(w.shape)
    for i in range(_mtp_layers(cfg)):
        # a multi-token-prediction layer, as the converter writes one after the model's (not served)
        layer, hidden = cfg["num_hidden_layers"] + i, cfg["hidden_size"]
        writer.add_tensor(f"blk.{layer}.nextn.eh_proj.weight", np.zeros((hidden, 2 * hidden), dtype=np.float32))
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ref = dst / "reference"
    ref.mkdir(exist_ok=True)
    if one_tensor_an_expert:
        reference = _stacked(reference, cfg)
    if kind in DEEPSEEK and latent_split:
        reference = _latent_joined(reference)
    _write_copy(src, ref, _gpt_oss_unstacked(reference) if kind == "gpt_oss" else _unstacked(reference), cfg)
    return file, ref


def _tiled(cfg: dict, size: int) -> np.ndarray:
    """Where each tiled row (value head v of key head k at v * keys + k, as llama.cpp's Qwen3.5
    converter lays value heads out) comes from among transformers' grouped ones (k * per_key + v)."""
    keys, per_key = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"] // cfg["linear_num_key_heads"]
    return np.arange(keys * per_key * size).reshape(keys, per_key, size).transpose(1, 0, 2).reshape(-1)


def _qwen35_value_rows(name: str, cfg: dict) -> tuple[int, int] | None:
    """(rows before the value part, rows a value head) of a tensor that produces value heads."""
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return 2 * cfg["linear_key_head_dim"] * cfg["linear_num_key_heads"], cfg["linear_value_head_dim"]
    if name.endswith("in_proj_z.weight"):
        return 0, cfg["linear_value_head_dim"]
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return 0, 1
    return None


def _qwen35_stored(name: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    """A Qwen3.5 tensor as the converter stores it: norms + 1 (not the gated delta net's own),
    -exp(A_log), conv1d squeezed, value heads tiled (rows, or out_proj's columns)."""
    if name.endswith("norm.weight") and "linear_attn" not in name:
        return w + np.float32(1)
    if name.endswith("A_log"):
        w = -np.exp(w)
    if name.endswith("conv1d.weight"):
        w = w[:, 0, :]
    if (rows := _qwen35_value_rows(name, cfg)) is not None:
        start, size = rows
        return np.concatenate([w[:start], w[start:][_tiled(cfg, size)]])
    if name.endswith("out_proj.weight"):
        return w[:, _tiled(cfg, cfg["linear_value_head_dim"])]
    return w


def _qwen35_weights(name: str, stored: np.ndarray, cfg: dict) -> np.ndarray:
    """The weight a stored Qwen3.5 tensor stands for (`_qwen35_stored` undone, in float32)."""
    if name.endswith("norm.weight") and "linear_attn" not in name:
        return stored - np.float32(1)
    if (rows := _qwen35_value_rows(name, cfg)) is not None:
        start, size = rows
        stored = np.concatenate([stored[:start], stored[start:][np.argsort(_tiled(cfg, size))]])
    elif name.endswith("out_proj.weight"):
        stored = stored[:, np.argsort(_tiled(cfg, cfg["linear_value_head_dim"]))]
    if name.endswith("A_log"):
        stored = np.log(-stored)
    return stored


def _type(types, gguf_name: str) -> str:
    if isinstance(types, str):
        return types
    return next((t for key, t in types.items() if key != "*" and key in gguf_name), types.get("*", "F32"))


def _encode(w: np.ndarray, qtype: str, rng) -> tuple[np.ndarray, np.ndarray]:
    """(what the file stores, the float32 values it decodes to)."""
    import gguf

    if qtype == "F32":
        return w, w
    if qtype == "F16":
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    if qtype == "BF16" or qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"):
        data = gguf.quants.quantize(w, kind)
    else:  # a K-quant: random blocks whose f16 super-block scales are small and finite
        block, size = gguf.GGML_QUANT_SIZES[kind]
        data = rng.integers(0, 256, size=(*w.shape[:-1], w.shape[-1] // block * size), dtype=np.uint8)
        scales = data.reshape(-1, size)
        if qtype in ("Q2_K", "Q4_K", "Q5_K"):  # d and dmin lead the block
            scales[:, :4] = np.frombuffer(np.array([2e-4, 1e-4], dtype=np.float16).tobytes(), np.uint8)
        else:  # Q3_K, Q6_K: d ends it
            scales[:, -2:] = np.frombuffer(np.array([2e-4], dtype=np.float16).tobytes(), np.uint8)
    return data, gguf.quants.dequantize(data, kind).astype(np.float32)


def _undo(t: torch.Tensor, name: str, kind: str, heads: int, kv_heads: int) -> torch.Tensor:
    """The float weight a stored tensor stands for (the converter's changes undone)."""
    if kind in LLAMA and name.endswith("q_proj.weight"):
        return _unpermute(t, heads, heads)
    if kind in LLAMA and name.endswith("k_proj.weight"):
        return _unpermute(t, heads, kv_heads)
    if kind in GEMMA and name.endswith("norm.weight"):
        return t - 1
    return t


def _unpermute(w: torch.Tensor, n_head: int, n_head_kv: int) -> torch.Tensor:
    n = n_head_kv if n_head != n_head_kv else n_head
    return w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unstacked(tensors: dict) -> dict:
    """Stacked experts back under transformers 5's names (gate_up_proj [E, 2I, H], down_proj)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_proj.weight"):
            up = tensors[name.replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj.weight", "gate_up_proj")] = torch.cat([t, up], dim=1).contiguous()
        elif name.endswith("mlp.experts.up_proj.weight"):
            continue
        elif name.endswith("mlp.experts.down_proj.weight"):
            out[name.removesuffix(".weight")] = t.contiguous()
        else:
            out[name] = t.contiguous()
    return out
