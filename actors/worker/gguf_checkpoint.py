"""GGUF checkpoints (llama.cpp's files: `shoal serve --model-path model-Q4_K_M.gguf`), read as a
Hugging Face checkpoint directory whose weights are the file's, dequantised as they load.

A GGUF holds the config and the tokenizer as metadata and the weights under llama.cpp's names,
in its block formats (Q8_0, Q4_K, ...). transformers reads all three (its GGUF support, the
oracle the tests compare with); at the first start the file is turned once into a small
directory under ~/.cache/shoal/gguf (`SHOAL_GGUF_CACHE`): config.json, the tokenizer's files,
and the table from the file's tensor names to transformers' (`gguf_tensors.json`), beside a
link to the file itself. Every process then reads that directory as any checkpoint (the HTTP
replicas load the saved tokenizer, without torch or the gguf package) and the loader opens
the file through `GgufWeights`: each tensor is dequantised by the gguf package (llama.cpp's own
Python reader) when it is read, then undone from llama.cpp's layout by transformers' tensor
processor for the architecture (Llama's rotary permutation of q / k, Gemma's norms stored + 1,
experts stacked). The weights are then float, as GPTQ and AWQ ones are: every family, tp / pp
and `--quantization int8` on top work as on a float checkpoint.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import NamedTuple

FORMAT = 4  # of the converted directory: a change to what it holds gives it a new name
TENSORS_FILE = "gguf_tensors.json"
LINK_NAME = "model.gguf"


def gguf_file(path: Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one .gguf in a directory without a
    config.json (a GGUF repository as downloaded); None where it is not a GGUF checkpoint.
    ValueError (one line) for a directory of several, and for a file split in parts."""
    if path.is_dir():
        if (path / "config.json").exists():
            return None
        files = sorted(path.glob("*.gguf"))
        if not files:
            return None
        if len(files) > 1 and not _split_parts(files):
            raise ValueError(f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}): "
                             "pass the one to serve as --model-path")
        path = files[0]
    if path.suffix != ".gguf" or not path.is_file():
        return None
    if _split_parts([path]):
        raise ValueError(f"{path.name} is one part of a split GGUF: join the parts first "
                         "(llama.cpp's `llama-gguf-split --merge`)")
    return path


def _split_parts(files: list[Path]) -> bool:
    """Files named as `llama-gguf-split` names its parts (`model-00001-of-00003.gguf`)."""
    return all("-of-" in f.stem and f.stem.rsplit("-of-", 1)[1].isdigit() for f in files)


def cache_dir() -> Path:
    return Path(os.environ.get("SHOAL_GGUF_CACHE") or Path.home() / ".cache" / "shoal" / "gguf")


def converted(file: Path) -> Path:
    """The checkpoint directory standing for GGUF `file`, made at the first start (one process at
    a time: the others wait for it, then read it)."""
    file = file.resolve()
    stat = file.stat()
    key = json.dumps([str(file), stat.st_size, stat.st_mtime_ns, _version("transformers"), _version("gguf"), FORMAT])
    target = cache_dir() / f"{file.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (target / TENSORS_FILE).exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(target.parent / f".{target.name}.lock", "w")
    except OSError as exc:
        raise ValueError(f"{file.name}: cannot write the directory made from it under {target.parent} "
                         f"({exc.strerror}); set SHOAL_GGUF_CACHE to a writable folder") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / TENSORS_FILE).exists():
            tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
            try:
                convert(file, tmp)
                shutil.rmtree(target, ignore_errors=True)
                os.replace(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def convert(file: Path, out: Path) -> None:
    """Write `file`'s config, tokenizer and tensor-name table into directory `out`."""
    if _version("gguf") is None:
        raise ValueError(f"{file.name} is a GGUF checkpoint: reading it needs the gguf package "
                         "(`pip install gguf`)")
    config, arch = gguf_config(file)
    _tokenizer(file, arch).save_pretrained(out)
    # Loaded back as saved: a family's own class (Qwen2Tokenizer, say) would put its own split of
    # the text in place of the one the file states (tokenizer.ggml.pre)
    settings = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**settings, "tokenizer_class": "PreTrainedTokenizerFast"},
                                                          indent=2))
    names = tensor_names(file, config, arch)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": end_of_generation(file, config, out)}))
    (out / TENSORS_FILE).write_text(json.dumps({"architecture": arch, "names": names, "where": where(file)}, indent=1))
    (out / LINK_NAME).symlink_to(file)


# Tokens that end a turn in the chat formats llama.cpp knows, which it stops at wherever a
# file's vocabulary has them (llama-vocab.cpp): a GGUF names one eos, where a Hugging Face
# release's generation_config.json lists them all (Qwen's <|im_end|> and <|endoftext|>)
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
               "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")


def end_of_generation(file: Path, config: dict, out: Path) -> list[int]:
    """The ids llama.cpp ends generation at: the file's eos, eot and eom tokens and END_OF_TURN's
    that its vocabulary holds (Llama 3's <|end_of_text|> and <|eot_id|>, Qwen's <|endoftext|>
    and <|im_end|>, Phi-3's <|endoftext|> and <|end|>, gpt-oss's <|return|> and <|call|>, as
    llama.cpp finds them in their files)."""
    reader = _reader(str(file))
    ids = {config.get("eos_token_id")} | {reader.fields[k].contents() for k in
                                           ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                                           if k in reader.fields}
    vocab = json.loads((out / "tokenizer.json").read_text())
    model = vocab["model"].get("vocab") or {}
    if isinstance(model, list):  # a Unigram model's [piece, score] pairs, by id
        model = {piece: i for i, (piece, _) in enumerate(model)}
    by_text = {**model, **{t["content"]: t["id"] for t in vocab.get("added_tokens", [])}}
    ids |= {by_text[t] for t in END_OF_TURN if isinstance(by_text.get(t), int)}
    if {"<|return|>", "<|call|>", "<|end|>"} <= by_text.keys():
        # harmony (gpt-oss): <|end|> ends a message, not the turn (the answer follows the analysis)
        ids.discard(by_text["<|end|>"])
    tokens = len(reader.fields["tokenizer.ggml.tokens"].data)  # (transformers may add tokens past the file's)
    return sorted(i for i in ids if isinstance(i, int) and i < tokens)


def gguf_config(file: Path) -> tuple[dict, str]:
    """(config.json as transformers reads the file's metadata, llama.cpp's architecture name).
    Its dtype is the file's float type (bfloat16 where the weights are blocks: what most models
    it was made from hold), its quantization_config {"quant_method": "gguf"} (`--quantization
    gguf` checks for it, as vLLM's does)."""
    import gguf
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    reader = _reader(str(file))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    if arch not in SUPPORTED:
        raise ValueError(f"{file.name}: GGUF architecture {arch!r} is not one shoal reads; it reads "
                         f"{', '.join(sorted(SUPPORTED))}")
    try:
        config = (OWN_SETTINGS[arch](reader) if arch in OWN_SETTINGS
                  else AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name).to_dict())
    except KeyError as exc:  # (a setting the file lacks)
        raise ValueError(f"{file.name}: its settings cannot be read (no {exc})") from None
    except ValueError as exc:
        reader_name = "shoal" if arch in OWN_SETTINGS else "transformers"
        raise ValueError(f"{file.name}: {reader_name} cannot read its settings: {str(exc).splitlines()[0]}") from None
    if arch == "llama" and (experts := reader.fields.get("llama.expert_count")) and experts.contents():
        config = _mixtral_config(config, reader)
    kind = config["model_type"]
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{file.name}: no causal language model for model type {kind!r} in transformers")
    config.update(_stated_settings(reader, arch, config))
    types = {t.tensor_type for t in reader.tensors}
    floats = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    dtype = ("bfloat16" if types - floats or gguf.GGMLQuantizationType.BF16 in types
             else "float16" if gguf.GGMLQuantizationType.F16 in types else "float32")
    config.update(architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind]], dtype=dtype, torch_dtype=dtype,
                  quantization_config={"quant_method": "gguf", "file": file.name,
                                       "types": sorted(gguf.GGMLQuantizationType(t).name for t in types)})
    return config, arch


_REQUIRED = object()


def _settings_of(reader, arch: str):
    """key(name, default): the file's `{arch}.{name}` setting (KeyError where it has none and no
    default is given)."""
    def key(name, default=_REQUIRED):
        f = reader.fields.get(f"{arch}.{name}")
        if f is None and default is _REQUIRED:
            raise KeyError(f"{arch}.{name}")
        return default if f is None else f.contents()
    return key


def _common_settings(reader, key) -> dict:
    """What every family whose settings shoal reads takes from its file alike."""
    ids = {k: reader.fields[f"tokenizer.ggml.{k}_token_id"].contents() for k in ("bos", "eos", "padding")
           if f"tokenizer.ggml.{k}_token_id" in reader.fields}
    return dict(vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), hidden_size=key("embedding_length"),
                num_attention_heads=key("attention.head_count"), max_position_embeddings=key("context_length"),
                rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
                tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
                bos_token_id=ids.get("bos"), eos_token_id=ids.get("eos"), pad_token_id=ids.get("padding"))


def _gpt_oss_config(reader) -> dict:
    """gpt-oss's settings from its file (transformers 5.24's reading of these files fails on their
    YaRN fields: it takes each field's length for its value). The rotary's scaling: _rotary."""
    from transformers import GptOssConfig

    key = _settings_of(reader, "gpt-oss")
    return GptOssConfig(
        **_common_settings(reader, key), intermediate_size=key("expert_feed_forward_length"),
        num_hidden_layers=key("block_count"), num_key_value_heads=key("attention.head_count_kv"),
        head_dim=key("attention.key_length"), num_local_experts=key("expert_count"),
        num_experts_per_tok=key("expert_used_count"), sliding_window=key("attention.sliding_window"),
        rope_parameters={"rope_type": "default", "rope_theta": key("rope.freq_base")}).to_dict()


def _deepseek_config(reader) -> dict:
    """DeepSeek-V2 / V3's settings (transformers reads none of llama.cpp's deepseek2 files): V3 where
    the router scores by sigmoid (or has a score bias), else V2. Latent attention's sizes as the
    file states them: newer files store it as MQA over the latent (head_count_kv 1, key_length
    kv_lora_rank + rope) with the heads' sizes in key_length_mla / value_length_mla; older ones
    (a joined attn_kv_b) state the heads' sizes in key_length / value_length."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    key = _settings_of(reader, "deepseek2")
    if key("expert_gating_func", 1) not in (1, 2):
        raise ValueError(f"its router scores by llama.cpp's gating function {key('expert_gating_func')}, "
                         "which shoal does not read (softmax and sigmoid only)")
    if key("attention.temperature_scale", None):  # (Mistral 4's queries scaled by position)
        raise ValueError("its queries are scaled by position (attention.temperature_scale), "
                         "which shoal does not read from a GGUF file")
    rope = key("rope.dimension_count")
    head_k, head_v = key("attention.key_length_mla", None) or key("attention.key_length"), key(
        "attention.value_length_mla", None) or key("attention.value_length")
    groups = key("expert_group_count", 1)
    v3 = key("expert_gating_func", 1) == 2 or any(t.name.endswith("exp_probs_b.bias") for t in reader.tensors)
    settings = dict(
        **_common_settings(reader, key), intermediate_size=key("feed_forward_length"),
        moe_intermediate_size=key("expert_feed_forward_length"), num_hidden_layers=key("block_count"),
        num_key_value_heads=key("attention.head_count"),  # (the heads' own; the file's 1 is the latent MQA's)
        q_lora_rank=key("attention.q_lora_rank", None) or None, kv_lora_rank=key("attention.kv_lora_rank"),
        qk_rope_head_dim=rope, qk_nope_head_dim=head_k - rope, v_head_dim=head_v,
        n_routed_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
        n_shared_experts=key("expert_shared_count", 0), first_k_dense_replace=key("leading_dense_block_count", 0),
        routed_scaling_factor=key("expert_weights_scale", 1.0), norm_topk_prob=bool(key("expert_weights_norm", False)),
        n_group=groups, topk_group=key("expert_group_used_count", 1),
        rope_parameters={"rope_type": "default", "rope_theta": key("rope.freq_base", 10000.0)})
    if v3:
        return DeepseekV3Config(**settings).to_dict()
    return DeepseekV2Config(**settings, topk_method="group_limited_greedy" if groups > 1 else "greedy").to_dict()


def _glm4moe_config(reader) -> dict:
    """GLM-4.5's settings (transformers reads none of llama.cpp's glm4moe files). The file counts
    its multi-token-prediction layers in block_count (nextn_predict_layers of them, last)."""
    from transformers import Glm4MoeConfig

    key = _settings_of(reader, "glm4moe")
    tensors = {t.name for t in reader.tensors}
    head_dim = key("attention.key_length", key("embedding_length") // key("attention.head_count"))
    return Glm4MoeConfig(
        **_common_settings(reader, key), intermediate_size=key("feed_forward_length"),
        moe_intermediate_size=key("expert_feed_forward_length"),
        num_hidden_layers=key("block_count") - key("nextn_predict_layers", 0),
        num_key_value_heads=key("attention.head_count_kv"), head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": key("rope.freq_base", 10000.0),
                         "partial_rotary_factor": key("rope.dimension_count", head_dim // 2) / head_dim},
        n_routed_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
        n_shared_experts=key("expert_shared_count", 0), first_k_dense_replace=key("leading_dense_block_count", 0),
        routed_scaling_factor=key("expert_weights_scale", 1.0), norm_topk_prob=bool(key("expert_weights_norm", False)),
        n_group=key("expert_group_count", 1), topk_group=key("expert_group_used_count", 1),
        use_qk_norm="blk.0.attn_q_norm.weight" in tensors, attention_bias="blk.0.attn_q.bias" in tensors,
        num_nextn_predict_layers=0).to_dict()


def _qwen3vl_config(reader) -> dict:
    """Qwen3-VL's language model (llama.cpp keeps its vision in a separate mmproj file) as Qwen3 or
    Qwen3-MoE: on text, whose three position axes are equal, its interleaved M-RoPE is the plain
    rotary, and DeepStack adds nothing without images. (transformers reads neither arch.)"""
    from transformers import Qwen3Config, Qwen3MoeConfig

    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    key = _settings_of(reader, arch)
    settings = dict(**_common_settings(reader, key), intermediate_size=key("feed_forward_length"),
                    num_hidden_layers=key("block_count"), num_key_value_heads=key("attention.head_count_kv"),
                    head_dim=key("attention.key_length"),
                    rope_parameters={"rope_type": "default", "rope_theta": key("rope.freq_base")})
    if arch == "qwen3vl":
        return Qwen3Config(**settings).to_dict()
    return Qwen3MoeConfig(**settings, num_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
                          moe_intermediate_size=key("expert_feed_forward_length"),
                          norm_topk_prob=bool(key("expert_weights_norm", True))).to_dict()  # (as llama.cpp's Qwen3-MoE)


def _granite_config(reader) -> dict:
    """IBM Granite (3.x, dense): Llama's block and four multipliers, written as *_scale where they
    are not 0. (transformers reads no granite file.)"""
    from transformers import GraniteConfig

    key = _settings_of(reader, "granite")
    return GraniteConfig(
        **_common_settings(reader, key), intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"), num_key_value_heads=key("attention.head_count_kv"),
        rope_parameters={"rope_type": "default", "rope_theta": key("rope.freq_base", 10000.0)},
        attention_multiplier=key("attention.scale", 1.0), embedding_multiplier=key("embedding_scale", 1.0),
        residual_multiplier=key("residual_scale", 1.0), logits_scaling=key("logit_scale", 1.0)).to_dict()


def _smollm3_config(reader) -> dict:
    """SmolLM3: Llama's block with every fourth layer's rotary off (NoPE), as llama.cpp fixes it
    (the file states no pattern; its releases all have that one). (transformers reads no smollm3
    file.)"""
    from transformers import SmolLM3Config

    key = _settings_of(reader, "smollm3")
    return SmolLM3Config(
        **_common_settings(reader, key), intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"), num_key_value_heads=key("attention.head_count_kv"),
        rope_parameters={"rope_type": "default", "rope_theta": key("rope.freq_base", 10000.0)},
        no_rope_layer_interval=4, no_rope_layers=None).to_dict()


def _olmo_config(reader) -> dict:
    """OLMo 2, or OLMo 3 where the file states a sliding window (llama.cpp writes both as olmo2):
    OLMo 3's rotary by layer type, its scaling (_rotary) on the global layers alone, as llama.cpp
    runs it. (transformers reads no olmo2 file.)"""
    from transformers import Olmo2Config, Olmo3Config

    key = _settings_of(reader, "olmo2")
    settings = dict(**_common_settings(reader, key), intermediate_size=key("feed_forward_length"),
                    num_hidden_layers=key("block_count"), num_key_value_heads=key("attention.head_count_kv"))
    rope = {"rope_type": "default", "rope_theta": key("rope.freq_base", 10000.0)}
    if (window := key("attention.sliding_window", None)) is None:
        return Olmo2Config(**settings, rope_parameters=rope).to_dict()
    local = {**rope, "rope_theta": key("rope.freq_base_swa", rope["rope_theta"])}
    return Olmo3Config(**settings, sliding_window=window,
                       rope_parameters={"sliding_attention": local, "full_attention": rope}).to_dict()


# Architectures whose settings shoal reads from the file itself
OWN_SETTINGS = {"gpt-oss": _gpt_oss_config, "deepseek2": _deepseek_config, "glm4moe": _glm4moe_config,
                "qwen3vl": _qwen3vl_config, "qwen3vlmoe": _qwen3vl_config, "granite": _granite_config,
                "smollm3": _smollm3_config, "olmo2": _olmo_config}

# What a Llama (or Mistral) config and a Mixtral one share
MIXTRAL_KEPT = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")


def _mixtral_config(config: dict, reader) -> dict:
    """llama.cpp writes Mixtral as a Llama with experts; transformers' reading keeps the Llama and
    drops the experts."""
    from transformers import MixtralConfig

    return MixtralConfig(**{k: config[k] for k in MIXTRAL_KEPT if k in config}, sliding_window=None,
                         num_local_experts=reader.fields["llama.expert_count"].contents(),
                         num_experts_per_tok=reader.fields["llama.expert_used_count"].contents()).to_dict()


# Settings llama.cpp's converter writes that transformers' GGUF reading leaves at its config
# class's defaults (one release's values: Qwen3's head_dim 128, Qwen3-MoE's expert width 768)
STATED = {"attention.key_length": "head_dim", "expert_feed_forward_length": "moe_intermediate_size",
          "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
          "expert_weights_norm": "norm_topk_prob", "attn_logit_softcapping": "attn_logit_softcapping",
          "final_logit_softcapping": "final_logit_softcapping"}
ROPE_SCALING = {"linear": "linear", "yarn": "yarn"}  # rope.scaling.type -> transformers' rope_type
YARN = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow", "yarn_attn_factor": "attention_factor",
        "attn_factor": "attention_factor"}  # (OLMo 3's converter writes the latter)


def _stated_settings(reader, arch: str, config: dict) -> dict:
    """What the file states that transformers' reading of it missed (STATED; rotary scaling)."""
    setting = _settings_of(reader, arch)

    def field(name):
        return setting(name, None)

    stated = {hf: value for key, hf in STATED.items() if (value := field(key)) is not None}
    if arch == "deepseek2":  # (its key_length is the latent's: _deepseek_config read the heads' sizes)
        stated.pop("head_dim", None)
    pattern = field("attention.sliding_window_pattern")  # (newer converters: a flag a layer)
    if isinstance(pattern, list) and len(pattern) == config["num_hidden_layers"]:
        stated["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    if arch in GEMMA_27B_LAYERS:
        # llama.cpp scales Gemma's queries by the head size, but 27B's by hidden / heads (its
        # query_pre_attn_scalar); the file states neither
        heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
        stated["query_pre_attn_scalar"] = (config["hidden_size"] // heads if layers == GEMMA_27B_LAYERS[arch]
                                           else config["head_dim"])
    if arch == "phi3":  # 0: none (Phi-4), else Phi-3's window
        stated["sliding_window"] = field("attention.sliding_window") or None
    stated.update(_rotary(reader, field, config))
    rope = stated.get("rope_parameters") or config.get("rope_parameters") or {}
    if arch == "gpt-oss" and rope.get("rope_type") == "yarn":  # (its release's YaRN: the range not rounded)
        stated["rope_parameters"] = {**rope, "truncate": False}
    if arch == "deepseek2" and rope.get("rope_type") == "yarn" and field("rope.scaling.yarn_log_multiplier"):
        # the converter writes 0.1 * mscale_all_dim; DeepSeek's releases have mscale equal to it
        scale = round(field("rope.scaling.yarn_log_multiplier") / 0.1, 6)
        stated["rope_parameters"] = {**rope, "mscale": scale, "mscale_all_dim": scale}
    return stated


# Gemma 2 and 3 27B's layer counts (llama.cpp tells its query scale by them)
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _rotary(reader, field, config: dict) -> dict:
    """The rotary scaling the file states: linear or YaRN in its metadata (Gemma 3: its global
    layers'), Llama 3's as a tensor. {} where transformers' reading has it already."""
    params = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)}
    by_type = "full_attention" in params  # (Gemma 3: one rotary per layer type; llama.cpp scales the global one)
    rope = dict(params["full_attention"] if by_type else params)
    kind = ROPE_SCALING.get(field("rope.scaling.type"))
    if kind is not None and field("rope.scaling.factor"):
        rope.update(rope_type=kind, factor=field("rope.scaling.factor"))
        if field("rope.scaling.original_context_length"):
            rope["original_max_position_embeddings"] = field("rope.scaling.original_context_length")
        for key, hf in YARN.items():
            if kind == "yarn" and field(f"rope.scaling.{key}") is not None:
                rope[hf] = field(f"rope.scaling.{key}")
    tensors = {t.name: [float(x) for x in t.data] for t in reader.tensors
               if t.name in ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")}
    if "rope_freqs.weight" in tensors:
        # Llama 3's rotary scaling, as the converter stores it: a divisor per frequency. Phi-3's
        # longrope with one list for every length and no attention factor is that same rotary.
        f = tensors["rope_freqs.weight"]
        rope.update(rope_type="longrope", short_factor=f, long_factor=f, attention_factor=1.0,
                    original_max_position_embeddings=config["max_position_embeddings"])
        rope.pop("factor", None)
    if "rope_factors_long.weight" in tensors:  # Phi-3's longrope: its two lists and attention factor
        rope.update(rope_type="longrope", short_factor=tensors["rope_factors_short.weight"],
                    long_factor=tensors["rope_factors_long.weight"],
                    original_max_position_embeddings=field("rope.scaling.original_context_length"))
        if field("rope.scaling.attn_factor") is not None:
            rope["attention_factor"] = field("rope.scaling.attn_factor")
    rotated, head_dim = field("rope.dimension_count"), config.get("head_dim") or (
        config["hidden_size"] // config["num_attention_heads"])
    if rotated and rotated != head_dim and not by_type:  # (Phi-4-mini rotates three quarters of each head)
        rope["partial_rotary_factor"] = rotated / head_dim
    rope = {**params, "full_attention": rope} if by_type else rope
    return {"rope_parameters": rope} if rope != params else {}


def _tokenizer(file: Path, arch: str):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # (files whose settings shoal reads itself: AutoTokenizer would read them as transformers can't)
    kind = PreTrainedTokenizerFast if arch in OWN_SETTINGS else AutoTokenizer
    try:
        return kind.from_pretrained(str(file.parent), gguf_file=file.name)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"{file.name}: transformers cannot build its tokenizer ({str(exc).splitlines()[0]})") from None


def tensor_names(file: Path, config: dict, arch: str) -> dict[str, str]:
    """{the file's tensor name: transformers' name}, as transformers maps them: its model for
    the config, built on the meta device, names every weight, and llama.cpp's own table
    (gguf.TensorNameMap) gives each one's GGUF name. (transformers' get_gguf_hf_weights_map
    does the same, then again for every submodule: 5 s for a 30-layer model, for the names
    that Bloom's files alone need.)"""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "quantization_config"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    kind = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(kind, config["num_hidden_layers"])
    processor, table = _processor(arch, config), {}
    present = {t.name for t in _reader(str(file)).tensors}
    for hf_name in model.state_dict():
        name = processor.preprocess_name(hf_name)
        base, dot, suffix = name.rpartition(".") if name.endswith((".weight", ".bias")) else (name, "", "")
        found = name_map.get_name(base)
        if found is None or not {found + dot + suffix, f"{found}.weight"} & present:  # (a fused name the file splits)
            processor.perform_fallback_tensor_mapping(table, dot + suffix, "", name)
        else:
            table[found + dot + suffix] = name
    names = {g: h for g, h in table.items() if g in present or f"{g}.weight" in present}
    expert_parts = {g for g in present if _EXPERTS.search(g)}  # stacked: the processor names them (process)
    # llama.cpp writes a multi-token-prediction block as one more layer (Qwen3.5's nextn): not served
    extra = {g for g in present if (m := re.match(r"blk\.(\d+)\.", g)) and int(m[1]) >= config["num_hidden_layers"]}
    named = set(names) | {f"{g}.weight" for g in names}  # (a parameter the file stores as a module's weight)
    missing = sorted(present - named - expert_parts - extra - IGNORED)
    if missing:
        raise ValueError(f"{file.name}: {len(missing)} tensors have no place in {config['architectures'][0]} "
                         f"(e.g. {', '.join(missing[:3])})")
    return names


def where(file: Path) -> dict[str, list]:
    """{tensor: [first byte, bytes, ggml type, numpy dtype, shape as stored]}: what reading a
    tensor needs, so a loading process maps the file without parsing its header again (gguf-py
    parses every metadata value: 2 s for a vocabulary of 49k tokens)."""
    return {t.name: [int(t.data_offset), int(t.n_bytes), int(t.tensor_type), t.data.dtype.str, list(t.data.shape)]
            for t in _reader(str(file)).tensors}


# Stacked experts (`blk.N.ffn_gate_exps.weight`): transformers' tensor processor names them
_EXPERTS = re.compile(r"\.ffn_(gate|up|down|gate_up)_exps(\.weight)?$")
# Tensors llama.cpp writes that are not weights of the model: precomputed rotary frequencies
IGNORED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def _processor(arch: str, config: dict):
    if arch in ("qwen35", "qwen35moe"):
        return Qwen35Processor(config)
    if arch == "gpt-oss":
        return GptOssProcessor()
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor
    if arch in ("deepseek2", "glm4moe"):
        return DeepseekProcessor(TENSOR_PROCESSORS["qwen2moe"](config=config))
    if arch == "llama" and config.get("num_local_experts"):
        return MixtralProcessor(TENSOR_PROCESSORS["llama"](config=config), TENSOR_PROCESSORS["qwen2moe"](config=config),
                                config["num_local_experts"])
    # (Qwen3-VL's language model: Qwen3-MoE's tensors; Granite's and SmolLM3's: Llama's, q / k permuted)
    arch = {"qwen3vlmoe": "qwen3moe", "granite": "llama", "smollm3": "llama"}.get(arch, arch)
    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)


class Processed(NamedTuple):
    weights: object
    name: str | None


class Qwen35Processor:
    """Qwen3.5's files undone as transformers' GGUF conversion for it undoes them (its
    integrations/gguf mapping, which transformers' older per-tensor processors lack):
    - the zero-centred norms stored as w + 1 (all but the gated delta net's own, ssm_norm);
    - ssm_a holds -exp(A_log);
    - conv1d squeezed to [channels, kernel];
    - value heads tiled (v0k0 v0k1 v1k0 ...) where transformers groups them by key head
      (v0k0 v1k0 v0k1 ...): the rows of what produces values (the value part of in_proj_qkv and
      conv1d, in_proj_z; and per head: in_proj_a / b, A_log, dt_bias), the columns of out_proj;
    - the experts' gate and up stacked apart (joined as gate_up_proj), the shared expert's gate a
      vector.
    The same interface as transformers' TensorProcessor (preprocess_name, the fallback, process)."""

    NORMS = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight",
             "output_norm.weight")

    def __init__(self, config: dict):
        import numpy as np

        keys = config["linear_num_key_heads"]
        per_key = config["linear_num_value_heads"] // keys
        self.value_rows = self._grouped(keys, per_key, config["linear_value_head_dim"])
        self.head_rows = self._grouped(keys, per_key, 1)
        self.qk_rows = 2 * config["linear_key_head_dim"] * keys  # in_proj_qkv / conv1d: q and k before v
        self.np = np

    @staticmethod
    def _grouped(keys: int, per_key: int, size: int):
        """Indices that take tiled rows to grouped ones."""
        import numpy as np
        return np.argsort(np.arange(keys * per_key * size).reshape(keys, per_key, size).transpose(1, 0, 2).reshape(-1))

    def preprocess_name(self, hf_name: str) -> str:
        return hf_name

    def perform_fallback_tensor_mapping(self, table: dict, suffix: str, qual_name: str, hf_name: str) -> None:
        if m := re.fullmatch(r"model\.layers\.(\d+)\.linear_attn\.dt_bias", hf_name):
            table[f"blk.{m[1]}.ssm_dt.bias"] = hf_name
        elif m := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj", hf_name):
            table[f"blk.{m[1]}.ffn_gate_exps"] = table[f"blk.{m[1]}.ffn_up_exps"] = hf_name

    def process(self, weights, name: str, tensor_key_mapping=None, parsed_parameters=None, **_) -> Processed:
        np = self.np
        w = np.asarray(weights, dtype=np.float32)
        if name.endswith(self.NORMS):
            w = w - np.float32(1)
        elif re.search(r"\.ssm_a$", name):
            w = np.log(-w)[self.head_rows]
        elif name.endswith(("ssm_dt.bias", "ssm_alpha.weight", "ssm_beta.weight")):
            w = w[self.head_rows]
        elif name.endswith("attn_gate.weight"):
            w = w[self.value_rows]
        elif name.endswith(("attn_qkv.weight", "ssm_conv1d.weight")):
            w = np.concatenate([w[:self.qk_rows], w[self.qk_rows:][self.value_rows]])
            if name.endswith("ssm_conv1d.weight"):
                w = w[:, None, :]
        elif name.endswith("ssm_out.weight"):
            w = w[:, self.value_rows]
        elif name.endswith("ffn_gate_inp_shexp.weight") and w.ndim == 1:
            w = w[None, :]
        elif m := re.fullmatch(r"(blk\.\d+)\.ffn_(gate|up)_exps\.weight", name):
            target = tensor_key_mapping[f"{m[1]}.ffn_{m[2]}_exps"]
            parts = parsed_parameters.setdefault("parts", {}).setdefault(target, {})
            parts[m[2]] = w
            if len(parts) == 2:  # gate first, up second along the rows of each expert
                import torch
                parsed_parameters["tensors"][target] = torch.from_numpy(np.concatenate([parts["gate"], parts["up"]], 1))
            return Processed(w, None)
        return Processed(w, name)


class StackedExperts:
    """A family's processor around transformers' Qwen2-MoE one, which joins the stacked experts
    (ffn_gate_exps, ffn_up_exps) into gate_up_proj; subclasses add their own tensors."""

    def __init__(self, experts):
        self.experts = experts

    def preprocess_name(self, hf_name: str) -> str:
        return self.experts.preprocess_name(hf_name)

    def perform_fallback_tensor_mapping(self, table: dict, suffix: str, qual_name: str, hf_name: str) -> None:
        self.experts.perform_fallback_tensor_mapping(table, suffix, qual_name, hf_name)

    def process(self, weights, name: str, tensor_key_mapping=None, parsed_parameters=None, **_) -> Processed:
        out = self.experts.process(weights, name, tensor_key_mapping=tensor_key_mapping,
                                   parsed_parameters=parsed_parameters)
        return Processed(out.weights, out.name)


class MixtralProcessor(StackedExperts):
    """Mixtral's files: Llama's permuted q / k rows, and experts stacked as Qwen2-MoE's are
    (transformers' processors for each), or in the files made before llama.cpp stacked them
    (early 2024), one tensor an expert (`blk.N.ffn_gate.E.weight`), stacked here."""

    ONE_EXPERT = re.compile(r"(blk\.\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")

    def __init__(self, llama, experts, count: int):
        super().__init__(experts)
        self.llama, self.count = llama, count

    def perform_fallback_tensor_mapping(self, table: dict, suffix: str, qual_name: str, hf_name: str) -> None:
        super().perform_fallback_tensor_mapping(table, suffix, qual_name, hf_name)
        if m := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj", hf_name):
            parts = ("gate", "up") if m[2] == "gate_up" else ("down",)
            table.update({f"blk.{m[1]}.ffn_{p}.{e}.weight": hf_name for p in parts for e in range(self.count)})

    def process(self, weights, name: str, tensor_key_mapping=None, parsed_parameters=None, **_) -> Processed:
        if ".attn_q." in name or ".attn_k." in name:
            return Processed(self.llama.process(weights, name).weights, name)
        if (m := self.ONE_EXPERT.fullmatch(name)) is None:
            return super().process(weights, name, tensor_key_mapping, parsed_parameters)
        import torch
        target = tensor_key_mapping[name]
        parts = parsed_parameters.setdefault("parts", {}).setdefault(target, {})
        parts[m[2], int(m[3])] = torch.from_numpy(weights.astype("float32"))
        if len(parts) == self.count * (1 if m[2] == "down" else 2):  # gate before up in each expert's rows
            parsed_parameters["tensors"][target] = torch.stack([
                parts["down", e] if m[2] == "down" else torch.cat([parts["gate", e], parts["up", e]])
                for e in range(self.count)])
        return Processed(weights, None)


class DeepseekProcessor(StackedExperts):
    """DeepSeek-V2 / V3's files (and GLM-4.5's, which share their MoE): experts stacked as
    Qwen2-MoE's are (transformers' processor for them), the router's score bias as
    `exp_probs_b.bias`, and, in DeepSeek's newer files, kv_b_proj cut for
    llama.cpp's absorbed attention into attn_k_b [heads, kv_lora_rank, nope] (transposed) and
    attn_v_b [heads, v, kv_lora_rank], joined back here."""

    LATENT = re.compile(r"(blk\.\d+)\.attn_([kv])_b\.weight")

    def perform_fallback_tensor_mapping(self, table: dict, suffix: str, qual_name: str, hf_name: str) -> None:
        super().perform_fallback_tensor_mapping(table, suffix, qual_name, hf_name)
        if m := re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.kv_b_proj\.weight", hf_name):
            table[f"blk.{m[1]}.attn_k_b.weight"] = table[f"blk.{m[1]}.attn_v_b.weight"] = hf_name
        elif m := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias", hf_name):
            table[f"blk.{m[1]}.exp_probs_b.bias"] = hf_name

    def process(self, weights, name: str, tensor_key_mapping=None, parsed_parameters=None, **_) -> Processed:
        if (m := self.LATENT.fullmatch(name)) is None:
            return super().process(weights, name, tensor_key_mapping, parsed_parameters)
        import numpy as np
        import torch
        target = tensor_key_mapping[name]
        parts = parsed_parameters.setdefault("parts", {}).setdefault(target, {})
        parts[m[2]] = np.asarray(weights, dtype=np.float32)
        if len(parts) == 2:  # per head: its nope rows of k, then its v rows
            k, v = parts["k"].swapaxes(1, 2), parts["v"]
            joined = np.concatenate([k, v], axis=1).reshape(-1, k.shape[-1])
            parsed_parameters["tensors"][target] = torch.from_numpy(joined)
        return Processed(weights, None)


class GptOssProcessor:
    """gpt-oss's files undone (convert_hf_to_gguf.py GptOssModel): transformers keeps each layer's
    experts as gate_up_proj [E, H, 2I] (gate and up columns interleaved) and down_proj [E, I, H],
    used as x @ W; the file stacks them as matrices, ffn_gate_exps / ffn_up_exps [E, I, H] and
    ffn_down_exps [E, H, I], with biases beside them split the same way. (transformers' own
    gpt-oss processor expects other names.)"""

    EXPERTS = re.compile(r"(blk\.\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)")

    def preprocess_name(self, hf_name: str) -> str:
        return hf_name

    def perform_fallback_tensor_mapping(self, table: dict, suffix: str, qual_name: str, hf_name: str) -> None:
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj(_bias)?", hf_name)
        if m:
            kind = ".bias" if m[3] else ".weight"
            parts = ("gate", "up") if m[2] == "gate_up" else ("down",)
            table.update({f"blk.{m[1]}.ffn_{p}_exps{kind}": hf_name for p in parts})

    def process(self, weights, name: str, tensor_key_mapping=None, parsed_parameters=None, **_) -> Processed:
        import numpy as np
        import torch

        m = self.EXPERTS.fullmatch(name)
        if m is None:
            return Processed(weights, name)
        w = np.asarray(weights, dtype=np.float32)
        if m[3] == "weight":
            w = w.swapaxes(1, 2)  # [E, out, in] -> transformers' [E, in, out]
        if m[2] == "down":
            return Processed(w, name)
        target = tensor_key_mapping[name]
        parts = parsed_parameters.setdefault("parts", {}).setdefault(target, {})
        parts[m[2]] = w
        if len(parts) == 2:  # gate in the even columns, up in the odd ones
            joined = np.empty((*w.shape[:-1], 2 * parts["gate"].shape[-1]), dtype=np.float32)
            joined[..., 0::2], joined[..., 1::2] = parts["gate"], parts["up"]
            parsed_parameters["tensors"][target] = torch.from_numpy(joined)
        return Processed(w, None)


@functools.lru_cache(maxsize=4)
def _reader(file: str):
    """The file's header, parsed once while the file is converted."""
    import gguf
    return gguf.GGUFReader(file)


class GgufWeights:
    """A GGUF file's tensors under transformers' names, answering as safetensors' `safe_open`
    does (keys, get_slice, get_tensor). A tensor is dequantised to float32 whole when it is
    first sliced (a rank then copies its part)."""

    def __init__(self, file: Path):
        import numpy as np

        table = json.loads((file.parent / TENSORS_FILE).read_text())
        self.config = json.loads((file.parent / "config.json").read_text())
        self.arch = table["architecture"]
        self.where = table["where"]
        # pages read as tensors are; a plain array: gguf-py cuts it into row groups, and a memmap
        # view costs 1.5 us each (0.75 s of a 0.5B model's 7 s)
        self.bytes = np.memmap(file.resolve(), mode="r", dtype=np.uint8).view(np.ndarray)
        self.processor = _processor(self.arch, self.config)
        self.sources: dict[str, list[str]] = {}  # transformers' name -> the file's tensors making it
        for g in self.where:
            # (a parameter, not a module's weight: stacked experts, gpt-oss's sinks; the table
            # holds it without the `.weight` the file adds)
            hf = table["names"].get(g) or table["names"].get(g.removesuffix(".weight"))
            if hf is not None:
                self.sources.setdefault(hf, []).append(g)

    def keys(self) -> list[str]:
        return list(self.sources)

    def get_slice(self, name: str) -> "_Lazy":
        return _Lazy(self, name)

    def get_tensor(self, name: str):
        import numpy as np
        import torch
        from gguf import dequantize

        parsed: dict = {"tensors": {}}
        table = {**{g: name for g in self.sources[name]},
                 **{g.removesuffix(".weight"): name for g in self.sources[name]}}
        result = None
        for g in self.sources[name]:
            start, size, kind, dtype, shape = self.where[g]
            data = self.bytes[start:start + size].view(np.dtype(dtype)).reshape(shape)
            out = self.processor.process(weights=dequantize(data, kind), name=g,
                                         tensor_key_mapping=table, parsed_parameters=parsed)
            if out.name is not None:
                result = torch.from_numpy(np.array(out.weights, dtype=np.float32))  # (a copy: the map is read-only)
        if name in parsed["tensors"]:  # several of the file's tensors put together (stacked experts)
            result = parsed["tensors"][name].float()
        return result


class _Lazy:
    """One tensor, read when sliced."""

    def __init__(self, weights: GgufWeights, name: str):
        self.weights, self.name = weights, name

    @functools.cached_property
    def tensor(self):
        return self.weights.get_tensor(self.name)

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, key):
        return self.tensor[key]


# llama.cpp's architecture names whose files shoal reads: those transformers' GGUF support maps
# (config, tokenizer, weights) whose model shoal runs.
SUPPORTED = {"llama", "mistral", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3", "qwen35",
             "qwen35moe", "lfm2", "gpt-oss", "deepseek2", "glm4moe", "qwen3vl", "qwen3vlmoe",
             "granite", "smollm3", "olmo2"}
