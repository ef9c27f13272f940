"""The short depthwise causal convolution of the hybrid models' state layers (in front of Gated
DeltaNet and Mamba-2; LFM2's convolution layers are it alone), over a state of each sequence's
last kernel - 1 inputs, in plain torch."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_prefill(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 silu: bool = True) -> torch.Tensor:
    """One sequence's tokens through the depthwise causal convolution (and SiLU): x [L, C], state
    [C, K - 1] (the inputs before x: zeros at a sequence's start), updated in place to the last
    K - 1 inputs; weight [C, K]. Returns [L, C]."""
    width = weight.shape[1] - 1
    seen = torch.cat((state.to(x.dtype), x.transpose(0, 1)), 1)  # [C, K - 1 + L]
    state.copy_(seen[:, seen.shape[1] - width:])
    y = F.conv1d(seen[None].to(weight.dtype), weight[:, None, :], bias, groups=weight.shape[0])[0]
    return (F.silu(y) if silu else y).transpose(0, 1).to(x.dtype)


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              silu: bool = True) -> torch.Tensor:
    """One token per row: x [B, C], state [B, C, K - 1] (updated in place), weight [C, K]."""
    seen = torch.cat((state.to(x.dtype), x[..., None]), -1)  # [B, C, K]
    state.copy_(seen[..., 1:])
    y = (seen.to(weight.dtype) * weight).sum(-1)
    y = y if bias is None else y + bias
    return (F.silu(y) if silu else y).to(x.dtype)
