"""Weight-only int8 (--quantization int8): each linear layer's weight as int8 with one float32
scale per output column (symmetric: max |w| / 127), multiplied by csrc/int8_linear.cpp.

A decode step reads every weight once, so its time follows the weights' bytes: int8 is a
quarter of float32's (the CPU's compute dtype; bfloat16 on a CPU without bf16 matmuls computes
in float32 too). Activations stay float32, so the only error is the weights' rounding: outputs
are those of float32 on the dequantised weights (`dequantize_int8`) up to float32 rounding.

Packing: the [N, K] weight becomes [ceil(N / 16), K, 16] panels, 16 output columns of one k
side by side (the kernel widens them to two 8-float vectors), padding columns zero.
Inside torch.compile the product is the opaque op `shoal::int8_linear`.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kernels import native

log = logging.getLogger("shoal.kernels")

PANEL = 16
QUANTIZATIONS = ("int8",)
_warned = False


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed [ceil(N / 16), K, 16] int8, scale [N] float32) of an [N, K] weight."""
    w = w.detach().float()
    n, k = w.shape
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=torch.int8, device=w.device)
    padded[:n] = q
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous(), scale.contiguous()


def dequantize_int8(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The [N, K] float32 weight a packed one stands for (the reference it computes with)."""
    k = packed.shape[1]
    return packed.transpose(1, 2).reshape(-1, k)[:scale.numel()].float() * scale[:, None]


def _int8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 portable: bool = False) -> torch.Tensor:
    global _warned
    flat = x.reshape(-1, x.shape[-1]).float().contiguous()
    op = native.int8_linear_op()
    if op is None:  # no compiler: correct, at float32's speed and a float32 copy per call
        if not _warned:
            log.warning("the int8 linear kernel is unavailable: int8 weights are dequantised on every call")
            _warned = True
        out = F.linear(flat, dequantize_int8(packed, scale), bias)
    else:
        out = flat.new_empty((flat.shape[0], scale.numel()))
        op(out, flat, packed, scale, torch.empty(0) if bias is None else bias.float().contiguous(), portable)
    return out.view(*x.shape[:-1], scale.numel()).to(x.dtype)


_library = torch.library.Library("shoal", "FRAGMENT")
_library.define("int8_linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias) -> Tensor")
_library.impl("int8_linear", _int8_linear, "CPU")


@torch.library.register_fake("shoal::int8_linear")
def _(x, packed, scale, bias):
    return x.new_empty((*x.shape[:-1], scale.shape[0]))


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (the dequantised weight)^T (+ bias), from the packed weight."""
    if torch.compiler.is_compiling():
        return torch.ops.shoal.int8_linear(x, packed, scale, bias)
    return _int8_linear(x, packed, scale, bias)


def int8_rows(ids: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the dequantised weight, in `dtype`: an int8 embedding's lookup."""
    return (packed[ids // PANEL, :, ids % PANEL].float() * scale[ids, None]).to(dtype)


def quantize_module(module) -> None:
    """Replace a layer's float weight by its int8 panels and scale (`weight_scale`);
    `out_dtype` keeps the dtype an embedding's lookups return."""
    module.out_dtype = module.weight.dtype
    packed, scale = quantize_int8(module.weight.data)
    module.weight = torch.nn.Parameter(packed, requires_grad=False)
    module.weight_scale = scale
