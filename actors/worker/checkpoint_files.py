"""Find a checkpoint on disk and read its config and tokenizer. No torch here: the HTTP
processes (ingress, replica) use this, and importing torch would cost them seconds at start."""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import tempfile
import threading
from pathlib import Path

from actors.models.args import ARCH_ALIASES, IMAGE_TEXT_ARCHS, TEXT_ARCH_OF
from actors.worker import gguf_checkpoint

BUNDLED_MODEL = Path(__file__).resolve().parents[1] / "demo_model"


def resolve_model_path(model: str | None) -> Path:
    """A local directory, a GGUF file (gguf_checkpoint), or a repo id already in the local Hugging Face
    cache (never downloads)."""
    if model is None:
        if not (BUNDLED_MODEL / "config.json").exists():
            raise FileNotFoundError(f"the bundled model is missing at {BUNDLED_MODEL}; pass --model-path")
        return BUNDLED_MODEL
    path = Path(model).expanduser()
    gguf = gguf_checkpoint.gguf_file(path)
    if gguf is not None:  # llama.cpp's file: read as the directory made from it once
        return gguf_checkpoint.converted(gguf)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
        return path
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(model, local_files_only=True))
    except Exception:
        raise FileNotFoundError(
            f"model {model!r} is neither a local directory nor in the local Hugging Face cache "
            f"(offline only: download it first, e.g. `huggingface-cli download {model}`)") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def resolve_tokenizer_path(tokenizer: str | None, model: str | None) -> Path:
    """Where the tokenizer's files are: `tokenizer` (vLLM's --tokenizer: a folder of them, which
    needs no config.json, or any checkpoint resolve_model_path finds), else the model's."""
    if tokenizer is None:
        return resolve_model_path(model)
    path = Path(tokenizer).expanduser()
    if path.is_dir() and any((path / name).exists() for name in TOKENIZER_FILES):
        return path
    return resolve_model_path(tokenizer)


# Where older GPTQ / AWQ releases (AutoGPTQ, AutoAWQ) keep their quantization settings when
# config.json has no quantization_config.
LEGACY_QUANTIZATION_FILES = ("quantize_config.json", "quant_config.json")
# ModelOpt's exports keep theirs in hf_quant_config.json, under "quantization" (vLLM reads it too)
MODELOPT_QUANTIZATION_FILE = "hf_quant_config.json"
# transformers' GPT2Config.attribute_map: the engine reads the common names
GPT2_FIELDS = {"num_hidden_layers": "n_layer", "hidden_size": "n_embd", "num_attention_heads": "n_head",
               "max_position_embeddings": "n_positions"}


# Qwen-VL's language model is Qwen2's (Qwen3-VL's: Qwen3's) with M-RoPE, whose three position
# streams (time, height, width) are one and the same on text: the plain rotary of the same
# frequencies, however its sections are laid out.
QWEN_VL_TEXT = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2",
                "qwen3_vl": "qwen3", "qwen3_vl_text": "qwen3", "qwen3_vl_moe": "qwen3_moe",
                "qwen3_vl_moe_text": "qwen3_moe"}
# What a Qwen-VL language model does that its text family's config must be told: Qwen3-VL-MoE's
# router always renormalises its top-k weights (Qwen3-MoE's reads norm_topk_prob, default off)
QWEN_VL_FIXED = {"qwen3_moe": {"norm_topk_prob": True}}


def _json_float(obj: dict):
    """transformers writes floats JSON has no literal for as {"__float__": "Infinity"}."""
    return float(obj["__float__"]) if obj.keys() == {"__float__"} else obj


def read_config(path: Path) -> dict:
    """config.json, with a legacy GPTQ / AWQ settings file (or ModelOpt's hf_quant_config.json)
    as its quantization_config where it has none (AutoAWQ's names no method: its `w_bit` tells
    it from GPTQ's `bits`); an
    image-text checkpoint's is its language model's config; a release's remote-code class name
    (ARCH_ALIASES) reads as transformers' own; COMPLETED_BY_TRANSFORMERS' are completed by its class."""
    config = json.loads((path / "config.json").read_text(), object_hook=_json_float)
    if (config.get("architectures") or [None])[0] in ARCH_ALIASES:  # (a release's remote-code class name)
        config["architectures"] = [ARCH_ALIASES[config["architectures"][0]]]
    if (config.get("architectures") or [None])[0] in IMAGE_TEXT_ARCHS:
        config = text_config(config)
    elif config.get("model_type") in COMPLETED_BY_TRANSFORMERS:
        config = completed(config)
    for ours, theirs in GPT2_FIELDS.items():  # GPT-2's own names for the common fields
        if ours not in config and theirs in config:
            config[ours] = config[theirs]
    if config.get("quantization_config") is None:
        for name in LEGACY_QUANTIZATION_FILES:
            if (path / name).exists():
                q = json.loads((path / name).read_text())
                method = q.get("quant_method") or ("awq" if "w_bit" in q or "version" in q else "gptq")
                config["quantization_config"] = {**q, "quant_method": method}
                break
    if config.get("quantization_config") is None and (path / MODELOPT_QUANTIZATION_FILE).exists():
        q = json.loads((path / MODELOPT_QUANTIZATION_FILE).read_text()).get("quantization")
        config["quantization_config"] = {"quant_method": "modelopt", **q} if isinstance(q, dict) else q
    return config


def text_config(config: dict) -> dict:
    """An image-text checkpoint's language model config, every field filled in: their
    text_config often names only what differs from the family's defaults (Gemma 3 4B's names
    5 fields), so transformers' own config class completes it (which imports torch: ~2 s more
    in a process without it). The wrapper's tie_word_embeddings (what transformers ties by) and
    quantization_config apply to it."""
    configs = import_transformers("transformers.models.auto.configuration_auto").CONFIG_MAPPING
    wrapper, text = config["architectures"][0], config.get("text_config")
    if text is None:  # Qwen2-VL as transformers 4 wrote it: the text fields at the top
        text = {k: v for k, v in config.items() if k not in ("vision_config", "architectures", "model_type")}
    if not isinstance(text, dict):
        raise ValueError(f"{wrapper}'s text_config must be a mapping of the language model's settings, "
                         f"got {type(text).__name__}")
    kind = released = text.get("model_type") or IMAGE_TEXT_ARCHS[wrapper]
    if kind in QWEN_VL_TEXT:
        kind = QWEN_VL_TEXT[kind]
        text = _without_mrope(text, kind)
    if kind not in TEXT_ARCH_OF:
        raise ValueError(f"{wrapper}'s language model ({kind}) is not one shoal runs; it runs "
                         f"{', '.join(TEXT_ARCH_OF)} inside image-text checkpoints")
    if kind not in configs:  # an older transformers than the checkpoint's
        raise ValueError(f"{wrapper}'s language model ({kind}) needs a newer transformers than the one "
                         "installed to read its settings")
    full = configs[kind](**text).to_dict()
    full["architectures"] = [TEXT_ARCH_OF[kind]]
    full["image_text_architecture"] = wrapper
    if released in ("qwen3_vl_moe", "qwen3_vl_moe_text"):  # its experts stacked for x @ W (MoeArgs)
        full["experts_stacked_for_x_at_w"] = True
    for key in ("tie_word_embeddings", "quantization_config"):
        if key in config:
            full[key] = config[key]
    return full


def _without_mrope(text: dict, kind: str) -> dict:
    """Qwen-VL's text config as `kind`'s, M-RoPE's sections dropped (see QWEN_VL_TEXT)."""
    text = dict(text, model_type=kind, **QWEN_VL_FIXED.get(kind, {}))
    for key in ("rope_scaling", "rope_parameters"):
        rope = text.get(key)
        if isinstance(rope, dict):
            rope = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
            if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
                rope = {k: v for k, v in rope.items() if k != "type"} | {"rope_type": "default"}
            text[key] = rope
    return text


# Text configs whose settings transformers' config class works out from what the file names
# (Gemma 4's per-layer head sizes from global_head_dim, its layer types and rotary by type;
# LFM2's layer types from full_attn_idxs, its releases' block_ff_dim and tie_embedding; Nemotron-H's
# from hybrid_override_pattern)
COMPLETED_BY_TRANSFORMERS = ("gemma4_text", "lfm2", "nemotron_h")


def completed(config: dict) -> dict:
    """`config` as transformers' class for its model_type fills it in (it imports torch)."""
    configs = import_transformers("transformers.models.auto.configuration_auto").CONFIG_MAPPING
    kind = config["model_type"]
    if kind not in configs:
        raise ValueError(f"{config.get('architectures')} ({kind}) needs a newer transformers than the one installed "
                         "to read its settings")
    return {**configs[kind](**config).to_dict(), "architectures": config.get("architectures")}


_IMPORTING = threading.Lock()


def import_transformers(module: str):
    """A module of transformers, imported by one thread at a time: the engine loads its tokenizer
    in a thread while it reads the config, and two threads importing transformers at once can
    find it half-initialised (ImportError: "partially initialized module")."""
    with _IMPORTING:
        return importlib.import_module(module)


def load_tokenizer(path: Path, class_path: str | None = None, trust_remote_code: bool = False):
    """The checkpoint's tokenizer, as AutoTokenizer loads it. class_path ("module:Class", see
    tokenizer_class_path): the class AutoTokenizer chose for these files in another process, the
    engine's. A Serve replica loads that class directly: AutoTokenizer's choice imports torch
    (transformers' config module does), ~2 s of CPU at start and ~185 MB in a process that has
    no other use for it. Every branch of AutoTokenizer that a local checkpoint takes ends in
    `Class.from_pretrained(path)`; remote code (a class outside transformers) goes through it.
    Without class_path, the class AutoTokenizer chose at an earlier start for the same files
    (and transformers version) is loaded directly too: its choice costs ~1 s of CPU even in a
    process that has torch (transformers' model configuration modules, torch.distributed.tensor,
    sympy)."""
    if class_path is None:
        class_path = remembered_tokenizer_class(path)
    if class_path is not None and class_path.startswith("transformers."):
        module, name = class_path.split(":")
        return getattr(import_transformers(module), name).from_pretrained(str(path))
    tokenizer = import_transformers("transformers").AutoTokenizer.from_pretrained(
        str(path), trust_remote_code=trust_remote_code)  # (--trust-remote-code: a tokenizer's own code)
    remember_tokenizer_class(path, tokenizer_class_path(tokenizer))
    return tokenizer


def tokenizer_cache_dir() -> Path:
    return Path(os.environ.get("SHOAL_TOKENIZER_CACHE") or Path.home() / ".cache" / "shoal" / "tokenizers")


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _tokenizer_choice_key(path: Path) -> str:
    """What AutoTokenizer's choice can depend on: the directory, every file in it but the
    weights (name, size, modification time) and transformers' version."""
    from importlib.metadata import version  # (importing transformers takes ~0.5 s)
    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in path.resolve().iterdir()
                   if f.is_file() and f.suffix not in WEIGHT_SUFFIXES)
    text = json.dumps([str(path.resolve()), version("transformers"), files])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def remembered_tokenizer_class(path: Path) -> str | None:
    try:
        return (tokenizer_cache_dir() / _tokenizer_choice_key(path)).read_text().strip() or None
    except (OSError, ImportError):  # never recorded, an unreadable cache, no transformers: AutoTokenizer decides
        return None


def remember_tokenizer_class(path: Path, class_path: str) -> None:
    """Record a class inside transformers (remote code always goes through AutoTokenizer)."""
    if not class_path.startswith("transformers."):
        return
    try:
        folder = tokenizer_cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, delete=False) as tmp:
            tmp.write(class_path)
        os.replace(tmp.name, folder / _tokenizer_choice_key(path))  # whole, whoever writes at once
    except (OSError, ImportError):  # a read-only home: every start asks AutoTokenizer
        pass


def tokenizer_class_path(tokenizer) -> str:
    cls = type(tokenizer)
    return f"{cls.__module__}:{cls.__qualname__}"


def load_declared_tokenizer(path: Path):
    """The tokenizer by the class its tokenizer_config.json declares, where transformers has
    that class (no torch); else None. Usually the class AutoTokenizer picks, but not always (it
    overrides some declarations): a replica loads this while its engine starts, then keeps it
    only if the engine's class is the same (`engine_tokenizer`)."""
    try:
        name = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
        if not isinstance(name, str):
            return None
        return getattr(import_transformers("transformers"), name).from_pretrained(str(path))
    except Exception:  # no such file, a class transformers lacks or one that needs what is not installed
        return None


def engine_tokenizer(path: Path, class_path: str, declared=None, trust_remote_code: bool = False):
    """The tokenizer as the engine loaded it (class_path, see tokenizer_class_path): `declared`
    (load_declared_tokenizer's) where it is of that class, else loaded by that class."""
    if declared is not None and tokenizer_class_path(declared) == class_path:
        return declared
    return load_tokenizer(path, class_path, trust_remote_code)


def declared_eos_id(path: Path) -> int | None:
    """The tokenizer's eos token id as its files state it (tokenizer_config.json's `eos_token`,
    looked up in tokenizer.json), without importing transformers (~1 s at start); None where
    they do not state it plainly (no fast tokenizer file, no `eos_token`, a special_tokens_map.json
    that says otherwise): then only the loaded tokenizer can tell."""
    def token(file: Path):
        if not file.exists():
            return None
        eos = json.loads(file.read_text()).get("eos_token")
        return eos.get("content") if isinstance(eos, dict) else eos

    eos = token(path / "tokenizer_config.json")
    mapped = token(path / "special_tokens_map.json")
    if not isinstance(eos, str) or not (path / "tokenizer.json").exists() or mapped not in (None, eos):
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id(eos)


def eos_token_ids(path: Path, cfg: dict, tokenizer_eos_id: int | None) -> set[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer together."""
    ids: set[int] = set()
    sources = [cfg.get("eos_token_id")]
    gen = path / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    sources.append(tokenizer_eos_id)
    for s in sources:
        if isinstance(s, int):
            ids.add(s)
        elif isinstance(s, list):
            ids.update(i for i in s if isinstance(i, int))
    return ids
