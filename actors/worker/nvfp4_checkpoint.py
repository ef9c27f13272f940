"""NVFP4 checkpoints, read as float: each packed weight is dequantised as it loads, like FP8 and
MXFP4 checkpoints (actors/worker/fp8_checkpoint.py, mxfp4_checkpoint.py), so the model holds its
compute dtype and every family, tp / pp sharding and --quantization int8 on top work as with a
float checkpoint. No FP4 matmuls: activations stay float (their scales are not read).

A quantized linear layer's weight W [N, K] is stored as FP4 (e2m1) codes, two to a byte along
K (element 2i in the low nibble, 2i + 1 in the high one), with one float8 (e4m3) scale per
group of 16 inputs and one float32 scale for the tensor. The two layouts, as their writers
write them:

- compressed-tensors `nvfp4-pack-quantized` (LLM Compressor's NVFP4 and NVFP4A16):
  `W.weight_packed` uint8 [N, K / 2], `W.weight_scale` e4m3 [N, K / 16],
  `W.weight_global_scale` float32 [1], a divisor: w = e2m1 * (weight_scale / weight_global_scale)
  (compressed-tensors' `_dequantize`; vLLM inverts it on load). `W.input_global_scale` is the
  activations'.
- ModelOpt NVFP4 (`quant_method: modelopt`, `quant_algo: NVFP4` or `W4A16_NVFP4`): `W.weight`
  uint8 [N, K / 2], `W.weight_scale` e4m3 [N, K / 16], `W.weight_scale_2` float32 scalar, a
  factor: w = e2m1 * (weight_scale * weight_scale_2) (ModelOpt's NVFP4QTensor.dequantize).
  `W.input_scale` is the activations'.

A module is NVFP4 when the checkpoint holds its tensor-wide scale: modules left float (the
config's `ignore` / `exclude_modules`, lm_head say) and a mixed checkpoint's FP8 layers are
found by their tensors, as the other readers find theirs. MoE experts stored one by one load
like any other linear layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.worker import quantization_config
from actors.worker.mxfp4_checkpoint import FP4_VALUES

GROUP = 16  # inputs per float8 scale


@dataclass(frozen=True)
class Nvfp4Layout:
    writer: str  # compressed-tensors | modelopt
    packed: str  # the codes' tensor suffix
    global_scale: str  # the tensor-wide scale's suffix
    divides: bool  # w = e2m1 * scale / global (compressed-tensors), else * global (ModelOpt)
    activations: tuple[str, ...]  # activation scales: not needed to compute in float

    @property
    def parts(self) -> tuple[str, ...]:
        return (self.packed, ".weight_scale", self.global_scale) + self.activations

    def module_of(self, name: str, names) -> str | None:
        """The module an NVFP4 tensor belongs to (`names`: every tensor in the checkpoint), else None."""
        for part in self.parts:
            if name.endswith(part):
                module = name.removesuffix(part)
                if module + self.global_scale in names:
                    return module
        return None

    def weight_of(self, name: str, names) -> str | None:
        """The float weight a packed tensor stands for (`X.weight_packed` -> `X.weight`), else None."""
        module = self.module_of(name, names) if name.endswith(self.packed) else None
        return None if module is None else module + ".weight"


LAYOUTS = {
    "compressed-tensors": Nvfp4Layout("compressed-tensors", ".weight_packed", ".weight_global_scale", True,
                                      (".input_global_scale",)),
    "modelopt": Nvfp4Layout("modelopt", ".weight", ".weight_scale_2", False, (".input_scale",)),
}


def read_layout(config: dict) -> Nvfp4Layout | None:
    """The checkpoint's NVFP4 layout from config.json (quantization_config.py decides which are
    read); None: not an NVFP4 checkpoint."""
    q = quantization_config.settings(config)
    if q.get("quant_method") == "compressed-tensors" and quantization_config.NVFP4_FORMAT in \
            quantization_config.compressed_formats(q):
        return LAYOUTS["compressed-tensors"]
    if q.get("quant_method") == "modelopt" and quantization_config.modelopt_algo(q) in quantization_config.NVFP4_ALGOS:
        return LAYOUTS["modelopt"]
    return None


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., C] -> the float32 values [..., 2C] of its e2m1 codes, low nibble first."""
    codes = packed.to(torch.uint8)
    values = torch.tensor(FP4_VALUES, dtype=torch.float32)
    pairs = torch.stack((values[(codes & 0x0F).long()], values[(codes >> 4).long()]), dim=-1)
    return pairs.reshape(*codes.shape[:-1], -1)


def dequantize(layout: Nvfp4Layout, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
               name: str = "an NVFP4 weight") -> torch.Tensor:
    """The float32 weight [N, K] of one module's tensors; ValueError (one line, naming `name`)
    when their shapes or dtypes are not NVFP4's."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"{name} is {packed.dtype} {tuple(packed.shape)}: NVFP4 codes are uint8 [N, K / 2]")
    n, k = packed.shape[0], packed.shape[1] * 2
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (n, k // GROUP) or k % GROUP:
        raise ValueError(f"{name} {tuple(packed.shape)} holds {k} inputs, but its weight_scale is {scale.dtype} "
                         f"{tuple(scale.shape)}: expected float8_e4m3fn {(n, k // GROUP)}, one per {GROUP} inputs")
    if global_scale.numel() != 1:
        raise ValueError(f"{name} has {global_scale.numel()} tensor-wide scales ({layout.global_scale}): expected one")
    tensor_wide = global_scale.float().reshape(())
    # as the writers' own readers compute it: the group scale times (or over) the tensor's, then the codes
    groups = scale.float() / tensor_wide if layout.divides else scale.float() * tensor_wide
    w = unpack(packed).reshape(n, k // GROUP, GROUP) * groups[..., None]
    return w.reshape(n, k)
