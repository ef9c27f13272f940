"""FP8 checkpoints, read as float: each float8 weight is multiplied by its scale as it loads.

Two layouts are read, as their writers write them:
- transformers' fine-grained FP8 (`quantization_config.quant_method: "fp8"`, DeepSeek-V3's
  and Qwen3's FP8 releases): `W.weight` in float8 (e4m3) and `W.weight_scale_inv`, one float32
  per block of `weight_block_size` ([128, 128]) weights;
- compressed-tensors `float-quantized` (LLM Compressor's FP8 checkpoints): `W.weight` in
  float8 and `W.weight_scale`, per output channel ([N, 1]), one per tensor, or per block of the
  weights scheme's `block_structure` (FP8_BLOCK); `input_scale` (static activation scales) is
  not needed to compute in float.

A checkpoint's KV cache scales (LLM Compressor's `self_attn.k_scale` / `v_scale`, the older
`k_proj.output_scale` / `v_proj.output_scale`, or one `kv_scale` for both) are read by
`kv_scales`: the fp8 KV cache (--kv-cache-dtype fp8) uses them, and a layer without them gets
1.0, as in vLLM.

The model then holds the dequantised weights in its compute dtype; --quantization int8 or fp8
quantizes those again (fp8: per output channel, for a GPU's FP8 matmuls; a block-scaled
checkpoint loses some of its precision there).
"""
from __future__ import annotations

import torch

from actors.worker import quantization_config

FP8_DTYPES = ("F8_E4M3", "F8_E5M2")  # safetensors' names
# (.activation_scale: transformers' static FP8 activation scale, Mistral's FP8 releases)
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale", ".activation_scale", ".k_scale",
                  ".v_scale", ".kv_scale", ".k_proj.output_scale", ".v_proj.output_scale")
# A layer's KV scale tensors -> which scale they set
KV_SCALE_NAMES = {"self_attn.k_scale": ("k",), "self_attn.v_scale": ("v",), "self_attn.kv_scale": ("k", "v"),
                  "self_attn.k_proj.output_scale": ("k",), "self_attn.v_proj.output_scale": ("v",)}


def block_size(config: dict) -> tuple[int, int] | None:
    """The weights' scale block of a block-wise FP8 checkpoint's config (quantization_config.py
    `fp8_block`); None: not block-wise."""
    return quantization_config.fp8_block(quantization_config.settings(config))


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIXES)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               name: str = "a float8 weight") -> torch.Tensor:
    """A float8 weight [N, K] (or [N]) times its scale: one per block of `block` weights
    (`weight_scale_inv` [ceil(N / bn), ceil(K / bk)]), one per output channel ([N, 1] or [N]),
    or one for the tensor. ValueError (naming `name`) for a scale of any other shape."""
    w, s = weight.float(), scale.float()
    if s.numel() == 1:
        return w * s.reshape(())
    if block is not None and w.dim() == 2 and s.dim() == 2:
        (bn, bk), (n, k) = block, w.shape
        if s.shape != (-(-n // bn), -(-k // bk)):
            raise ValueError(f"{name} {tuple(w.shape)} has a scale of {tuple(s.shape)}, not one per block of "
                             f"{bn} x {bk} (config.json's block size) nor per channel")
        return w * s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    if s.numel() != w.shape[0]:
        raise ValueError(f"{name} {tuple(w.shape)} has {s.numel()} scales: expected one, or one per output channel")
    return w * s.reshape(w.shape[0], *([1] * (w.dim() - 1)))


def kv_scales(tensors) -> dict[int, dict[str, float]]:
    """{layer: {"k": scale, "v": scale}} from (name, tensor-reader) pairs of a checkpoint: one
    number per layer and plane (per-head scales are refused: the kernels take one)."""
    out: dict[int, dict[str, float]] = {}
    for name, read in tensors:
        if not name.startswith("model.layers."):
            continue
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        if rest not in KV_SCALE_NAMES or not layer.isdigit():
            continue
        value = read()
        if value.numel() != 1:
            raise ValueError(f"{name} holds {value.numel()} KV scales; the fp8 KV cache takes one per layer")
        value = float(value.float().reshape(()))
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{name} is {value}: a KV scale must be a positive finite number")
        for plane in KV_SCALE_NAMES[rest]:
            out.setdefault(int(layer), {})[plane] = value
    return out
