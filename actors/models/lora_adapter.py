"""A PEFT LoRA adapter on disk: adapter_config.json + adapter_model.safetensors.

`check_adapter` refuses, with one line, what the engine can't serve (DoRA, LoRA biases,
extra trained modules, an unknown target, a rank over --max-lora-rank, shapes that don't fit
the base model), so a bad adapter fails when it is registered, never inside a step.
`adapter_tensors` yields each LoRA matrix under the name of the base weight it adapts, with
its scaling (alpha / r, or alpha / sqrt(r) with rsLoRA), for the model runner to load.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

# The projections an adapter may target (Llama-family names), and where each sits in its
# (possibly fused) shoal layer: q/k/v are parts 0/1/2 of qkv_proj, gate/up 0/1 of gate_up_proj.
TARGETS = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "o_proj": 0, "gate_proj": 0, "up_proj": 1,
           "down_proj": 0}
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
# base_model.model.<module path>.<proj>.lora_<A|B>.weight, as PEFT's save_pretrained writes it
KEY = re.compile(r"^base_model\.model\.(model\.layers\.\d+\.(?:self_attn|mlp))\.(\w+)\.lora_([AB])\.weight$")
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraTensor:
    base_name: str  # the base checkpoint's weight it adapts, e.g. model.layers.0.self_attn.q_proj.weight
    proj: str  # q_proj, ..., down_proj
    part: str  # "A" ([r, in]) or "B" ([out, r])
    scaling: float  # to multiply B by


def read_config(path: str | Path) -> dict:
    file = Path(path) / "adapter_config.json"
    try:
        return json.loads(file.read_text())
    except OSError:
        raise ValueError(f"{path} is not a PEFT adapter directory (no readable adapter_config.json)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from None


def scaling(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling of one module: lora_alpha / r (rsLoRA: / sqrt(r)), per-module
    alpha_pattern and rank_pattern honoured."""
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rule: a pattern key matches a module name ending with it (as a regex)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def lora_tensors(path: str | Path) -> dict[str, LoraTensor]:
    """Every tensor key of the adapter's weights file, described (no weights read)."""
    from safetensors import safe_open
    config = read_config(path)
    file = Path(path) / WEIGHTS_FILE
    if not file.exists():
        raise ValueError(f"{path} has no {WEIGHTS_FILE} (only safetensors adapters are supported)")
    out = {}
    with safe_open(str(file), framework="pt") as f:
        for key in f.keys():
            m = KEY.match(key)
            if m is None or m.group(2) not in TARGETS:
                raise ValueError(f"adapter {path}: tensor {key!r} is not a LoRA matrix of a "
                                 f"supported projection ({', '.join(TARGETS)})")
            prefix, proj, part = m.groups()
            rank = f.get_slice(key).get_shape()[0 if part == "A" else 1]
            out[key] = LoraTensor(f"{prefix}.{proj}.weight", proj, part,
                                  scaling(config, f"{prefix}.{proj}", rank))
    if not out:
        raise ValueError(f"adapter {path} has no LoRA weights")
    return out


def check_adapter(path: str | Path, base_shapes: dict[str, tuple], max_rank: int, moe: bool) -> None:
    """Raise ValueError (one line) unless the engine can serve this adapter on this base model."""
    config = read_config(path)
    for flag, bad in (("use_dora", config.get("use_dora")),
                      ("bias", config.get("bias", "none") not in (None, "none")),
                      ("modules_to_save", config.get("modules_to_save"))):
        if bad:
            raise ValueError(f"adapter {path}: {flag}={config.get(flag)!r} is not supported "
                             "(plain LoRA on q/k/v/o/gate/up/down only)")
    from safetensors import safe_open
    with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as f:
        for key, t in lora_tensors(path).items():
            if moe and t.proj in MLP_TARGETS:
                raise ValueError(f"adapter {path}: LoRA on the MLP of a mixture-of-experts model "
                                 "is not supported (attention projections only)")
            _check_shape(path, key, t, tuple(f.get_slice(key).get_shape()), base_shapes, max_rank)


def _check_shape(path, key: str, t: LoraTensor, shape: tuple, base_shapes: dict, max_rank: int) -> None:
    base = base_shapes.get(t.base_name)
    if base is None:
        raise ValueError(f"adapter {path}: {key!r} adapts {t.base_name}, which the base model lacks")
    rank = shape[0] if t.part == "A" else shape[1]
    if rank > max_rank:
        raise ValueError(f"adapter {path}: rank {rank} of {t.base_name} is over --max-lora-rank {max_rank}")
    want = (rank, base[1]) if t.part == "A" else (base[0], rank)
    if shape != want:
        raise ValueError(f"adapter {path}: {key!r} has shape {list(shape)}, the base model needs {list(want)}")


def adapter_tensors(path: str | Path):
    """(LoraTensor, float32 tensor) for every LoRA matrix of the adapter."""
    from safetensors import safe_open
    described = lora_tensors(path)
    with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as f:
        for key, t in described.items():
            yield t, f.get_tensor(key).float()
