"""Mixture-of-experts FFNs in two Triton kernels, with no host synchronisation: what lets a
MoE model's decode step run as a CUDA graph (kernels/moe.py's torch path reads each
expert's token count on the host and loops over experts).

The step's T x k assignments are sorted by expert on the device, and each expert's share is
cut into blocks of BM rows; a program takes one block and BN output columns: the first kernel
computes silu(x W_gate) x (x W_up) into the assignment's sorted row, the second that row
times W_down and the routing weight into the assignment's own row, and the k rows of each
token are summed. The grid is sized for the worst case (every expert's last block partly
full), and programs past the last block return at once, so the launch depends only on T.
Rounding follows the torch path (bf16 products rounded where its matmuls and products
round); the sum over a token's experts is one float32 sum instead of k rounded adds.
gpt-oss's experts (biases, clamped SwiGLU: kernels/swiglu_moe.py) are the same two kernels
with their biases added after each product and the activation switched.
"""
from __future__ import annotations

import torch

from kernels import triton_programs


def _programs():
    return triton_programs.load("triton_fused_programs")


def _tile(n: int, most: int) -> int:
    return max(16, min(most, 1 << max(n - 1, 0).bit_length()))


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None,
                    swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """kernels/moe.py's grouped_experts: sum_k weights[t, k] * FFN_{local_ids[t, k]}(x[t])
    over the experts held here (local_ids < 0: held elsewhere, skipped). x [T, H]; gate_up
    [L, 2I, H]; down [L, H, I]. gpt-oss (kernels/swiglu_moe.py): gate_up_bias [L, 2I],
    down_bias [L, H] (None: not added here) and swiglu (alpha, limit)."""
    tokens, k = local_ids.shape
    experts, width, hidden = gate_up.shape[0], gate_up.shape[1] // 2, gate_up.shape[2]
    out = torch.zeros(tokens * k, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out.view(tokens, k, hidden).sum(1)
    bm = 16 if tokens * k < 1024 else 64
    flat = local_ids.flatten()
    key = torch.where(flat >= 0, flat, experts)  # held elsewhere: after every expert here
    order = torch.argsort(key, stable=True).to(torch.int32)
    counts = torch.zeros(experts + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    counts = counts[:experts]
    starts = (counts.cumsum(0) - counts).to(torch.int32)
    block_cum = ((counts + bm - 1) // bm).cumsum(0).to(torch.int32)
    blocks = -(-tokens * k // bm) + min(experts, tokens * k)
    x = x.contiguous()
    precision = "ieee" if x.dtype == torch.float32 else None
    h = torch.empty(tokens * k, width, dtype=x.dtype, device=x.device)
    bn, bk = _tile(width, 64), _tile(hidden, 64)
    programs = _programs()
    alpha, limit = swiglu or (0.0, 0.0)
    programs.expert_gate_up[(blocks, -(-width // bn))](
        x, gate_up, h, order, block_cum, counts, starts, experts, k, hidden, width,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0), *_bias(gate_up_bias, x), alpha, limit,
        BM=bm, BN=bn, BK=bk, PRECISION=precision, HAS_BIAS=gate_up_bias is not None, SWIGLU=swiglu is not None)
    bn, bk = _tile(hidden, 64), _tile(width, 64)
    programs.expert_down[(blocks, -(-hidden // bn))](
        h, down, out, order, weights.contiguous(), block_cum, counts, starts, experts, hidden, width,
        h.stride(0), down.stride(0), down.stride(1), out.stride(0), *_bias(down_bias, x),
        BM=bm, BN=bn, BK=bk, PRECISION=precision, HAS_BIAS=down_bias is not None)
    return out.view(tokens, k, hidden).sum(1)


def _bias(bias: torch.Tensor | None, stand_in: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(pointer, stride between experts) of a stacked bias; without one, a pointer never read."""
    return (stand_in, 0) if bias is None else (bias, bias.stride(0))
