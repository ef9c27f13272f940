"""gpt-oss's mixture-of-experts compute: its router (softmax over the top-k logits) and its
experts (biases, and a SwiGLU whose gate and up are clamped), in plain torch, operation for
operation as transformers' GptOssTopKRouter / GptOssExperts compute them.

The grouping is kernels/moe.py's: assignments sorted by expert, one matrix product per
expert over all of its tokens, one index_add back to the tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.moe import grouped


def route_top_logits(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]): the k largest logits, then a softmax over those k
    (in the logits' dtype, as transformers does)."""
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype), ids


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[.., 2I] (gate columns, then up columns) -> [.., I]: (up + 1) * gate * sigmoid(alpha * gate),
    the gate clamped from above and up from both sides at `limit`."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor,
                    gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor,
                    down_bias: torch.Tensor | None, alpha: float, limit: float) -> torch.Tensor:
    """sum_k weights[t, k] * FFN_{local_ids[t, k]}(x[t]) over the experts held here (local_ids
    < 0: held elsewhere, skipped), FFN_e(x) = down_e clamped_swiglu(gate_up_e x + b_e) + c_e.

    x [T, H]; gate_up [L, 2I, H] (gate rows, then up rows) with gate_up_bias [L, 2I]; down
    [L, H, I] with down_bias [L, H], or None where another rank adds it (tensor parallel
    experts: each rank holds a slice of I, and the bias belongs to the sum)."""
    def ffn(e: int, xs: torch.Tensor) -> torch.Tensor:
        y = F.linear(clamped_swiglu(F.linear(xs, gate_up[e]) + gate_up_bias[e], alpha, limit), down[e])
        return y if down_bias is None else y + down_bias[e]
    return grouped(x, weights, local_ids, gate_up.shape[0], ffn)
