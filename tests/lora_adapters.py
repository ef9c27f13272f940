"""Random PEFT LoRA adapters for the tiny test checkpoints, built with `peft` offline.

PEFT starts lora_B at zero (an adapter that changes nothing); here both matrices are drawn
with a fixed seed and a scale large enough that greedy outputs differ from the base model's.
"""
from __future__ import annotations

import functools
import pathlib

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: pathlib.Path, out: pathlib.Path, targets=tuple(ALL_TARGETS), r: int = 8,
                 alpha: float = 16, seed: int = 0, std: float = 0.2, rslora: bool = False) -> pathlib.Path:
    """Write a PEFT adapter of `base` to `out` (adapter_config.json + adapter_model.safetensors)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        use_rslora=rslora, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    peft_model.save_pretrained(str(out))
    return out


@functools.lru_cache(maxsize=16)
def _peft_model(base: str, adapter: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    return PeftModel.from_pretrained(model, adapter).eval()


def peft_model(base, adapter):
    """The cached transformers + peft model (float32) of a base checkpoint with an adapter."""
    return _peft_model(str(pathlib.Path(base).resolve()), str(pathlib.Path(adapter).resolve()))
