"""MXFP4 checkpoints (gpt-oss's release: `quantization_config.quant_method: "mxfp4"`), read as
float: each quantized tensor is dequantised as it loads, one expert at a time.

A quantized weight W (transformers' layout [E, K, N], used as x @ W[e]) is stored transposed,
in groups of 32 along K, as
- `W_blocks` uint8 [E, N, K / 32, 16]: two FP4 (e2m1) codes per byte, the element 2i in the low
  nibble and 2i + 1 in the high one;
- `W_scales` uint8 [E, N, K / 32]: one power-of-two scale per group, e8m0 (2 ** (s - 127)).
The values are exact in float32 and bfloat16, so dequantising is exact; the model then holds
them in its compute dtype (and its experts compute in float, as with FP8 checkpoints,
actors/worker/fp8_checkpoint.py). The MXFP4 matmuls of a GPU are not used yet.
"""
from __future__ import annotations

import torch

from actors.worker.quantization_config import settings

# e2m1 code -> value: sign bit 3, then magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS, SCALES = "_blocks", "_scales"


def is_mxfp4(config: dict) -> bool:
    return settings(config).get("quant_method") == "mxfp4"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [E, N, G, 16], scales [E, N, G] -> float32 [E, G * 32, N] (transformers' layout)."""
    codes = blocks.to(torch.uint8)
    values = torch.tensor(FP4_VALUES, dtype=torch.float32)
    pairs = torch.stack((values[(codes & 0x0F).long()], values[(codes >> 4).long()]), dim=-1)  # [E, N, G, 16, 2]
    groups = pairs.reshape(*codes.shape[:-1], 32)
    w = torch.ldexp(groups, scales.to(torch.int32)[..., None] - 127)
    return w.reshape(*codes.shape[:-2], -1).transpose(1, 2)


class Dequantized:
    """A stacked MXFP4 tensor that reads and dequantises only the experts an index asks for:
    `t[e0:e1, ...]` indexes the float tensor [E, K, N] (the loader's weight rules take one
    expert's part at a time, so a rank never holds a whole layer's experts in float)."""

    def __init__(self, blocks, scales: torch.Tensor):
        self.blocks, self.scales = blocks, scales  # blocks: a lazy safetensors slice

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        experts = key[0] if isinstance(key[0], slice) else slice(key[0], key[0] + 1)
        w = dequantize(self.blocks[experts], self.scales[experts])
        return w[(slice(None), *key[1:])] if isinstance(key[0], slice) else w[(0, *key[1:])]
