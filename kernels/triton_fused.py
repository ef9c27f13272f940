"""The elementwise work between a decoder layer's matmuls, fused into Triton kernels.

Run as separate torch ops, a decode step of a 28-layer model launches ~60 small kernels per
layer (RMSNorm alone is a cast, a square, a mean, an rsqrt, two products and a cast), each
costing a few microseconds however little it reads. These do each job in one launch:

- `rms_norm`, and `add_rms_norm`: the residual add and the next RMSNorm in one pass;
- `qk_rope_write`: from the fused q/k/v projection, each query head's (optional per-head
  RMSNorm and) rotary into q, each KV head's key the same way and its value, both written to
  the paged pool at the token's slot;
- `silu_and_mul` over a fused gate/up projection.

They round to the tensors' dtype where the torch definitions (kernels/norms.py,
kernels/rotary.py, kernels/activation.py, transformers) do; only the order of a reduction
differs. The model runs them on the steps of the Triton attention backend
(actors/models/llama.py), and the suite runs them on CPU under TRITON_INTERPRET=1
(kernels/triton_programs.py). SHOAL_FUSED_KERNELS=0 turns them off (the separate torch ops run).
"""
from __future__ import annotations

import torch

from kernels import triton_programs
from kernels.env import flag


def enabled() -> bool:
    """Whether models built now use these kernels on Triton-backend steps."""
    return flag("SHOAL_FUSED_KERNELS", True)


def _programs():
    return triton_programs.load("triton_fused_programs")


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last axis (kernels/norms.py's rms_norm; Gemma's with offset 1)."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _norm(rows, None, weight, out, None, eps, offset)
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + add), x + add): a residual add and the norm after it in one pass."""
    rows, adds = _rows(x), _rows(add)
    out, total = torch.empty_like(rows), torch.empty_like(rows)
    _norm(rows, adds, weight, out, total, eps, offset)
    return out.view(x.shape), total.view(x.shape)


def _norm(x, add, weight, out, total, eps, offset):
    n = x.shape[-1]
    block = _pow2(n)
    if not x.shape[0]:
        return
    _programs().rms_norm[(x.shape[0],)](
        x, add if add is not None else x, weight, out, total if total is not None else out, n,
        x.stride(0), add.stride(0) if add is not None else 0, out.stride(0),
        total.stride(0) if total is not None else 0, eps,
        HAS_ADD=add is not None, OFFSET=float(offset), BLOCK=block, num_warps=min(max(block // 256, 1), 8))


def qk_rope_write(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                  slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                  eps: float = 0.0, offset: float = 0.0) -> torch.Tensor:
    """qkv: [T, (heads + 2 kv_heads) x d], the fused projection; cos / sin: [T, d] (the whole
    head rotates, rotate-half layout); q_weight / k_weight: per-head RMSNorm weights applied
    before the rotary (Qwen3), or None. Writes each token's key and value at its slot of
    k_cache / v_cache ([slots, kv_heads, d]) and returns the rotated queries [T, heads, d]."""
    tokens = qkv.shape[0]
    d = k_cache.shape[-1]
    q = torch.empty(tokens, heads, d, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    norm = q_weight is not None
    _programs().qk_rope_write[(tokens, heads + kv_heads)](
        qkv, q, k_cache, v_cache, slots, cos, sin, q_weight if norm else qkv, k_weight if norm else qkv,
        qkv.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), cos.stride(0), eps,
        HEADS=heads, KV_HEADS=kv_heads, HALF=d // 2, HALF_PAD=max(_pow2(d // 2), 16), NORM=norm,
        OFFSET=float(offset), num_warps=1 if d <= 128 else 2)
    return q


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over [..., 2 x width] (gate first): kernels/activation.py's silu_and_mul."""
    rows = _rows(gate_up)
    width = rows.shape[-1] // 2
    out = torch.empty(rows.shape[0], width, dtype=rows.dtype, device=rows.device)
    block = min(_pow2(width), 1024)
    if rows.shape[0]:
        _programs().silu_and_mul[(rows.shape[0], -(-width // block))](
            rows, out, width, rows.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], width)
