"""x @ W^T for weights held as packed integers (GPTQ / AWQ / compressed-tensors checkpoints:
actors/worker/int4_checkpoint.py reads them and `to_kernel_layout` brings each to this one), in
one Triton kernel: each program dequantises its tiles of W in registers and multiplies them
with fp16 / bf16 (or float32) activations, summing in float32 (w4a16 for 4 bits, w8a16 for 8).

The layout (GPTQ's, with the zero points stored as themselves plus `zero_offset`):
- qweight int32 [K / per, N], per = 32 // bits codes of one output column packed along the input
  dim, code k % per in bits [bits * (k % per), ...);
- qzeros int32 [G, N / per], the zero points packed along the output dim the same way; the zero
  point is the code + zero_offset (1 for GPTQ's v1 format, which stores z - 1);
- scales [G, N] (any float dtype; read as float32); g_idx int32 [K], each input column's group
  (act-order permutes them; without it k // group_size).
w[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n], rounded to x's dtype before the product.

The model's linear layers call it when they keep a checkpoint's packed weights
(SHOAL_INT4_KERNEL=1, actors/worker/loader.py); otherwise those are dequantised at load. On CPU
it runs only under Triton's interpreter (TRITON_INTERPRET=1, how the suite checks it); it has
not run on a GPU yet (docs/quantization.md).
"""
from __future__ import annotations

import torch

from kernels import triton_programs


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
               bits: int, zero_offset: int = 0) -> torch.Tensor:
    """The float32 weight [N, K] of the kernel's layout, in torch: the reference it is checked
    against."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    mask = (1 << bits) - 1
    q = ((qweight[:, None, :] >> shifts[None, :, None]) & mask).reshape(-1, qweight.shape[1])  # [K, N]
    z = ((qzeros[:, :, None] >> shifts) & mask).reshape(qzeros.shape[0], -1) + zero_offset  # [G, N]
    g = g_idx.long()
    return ((q[:g.numel()] - z[g]).float() * scales.float()[g]).t()


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor, bits: int = 4, zero_offset: int = 0,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype, W in the layout above."""
    k, n = g_idx.numel(), qweight.shape[1]
    if qweight.shape[0] * (32 // bits) < k or n % (32 // bits):
        raise ValueError(f"packed weight {tuple(qweight.shape)} does not hold {k} x {n} {bits}-bit codes")
    flat = x.reshape(-1, k).contiguous()
    m = flat.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        bn, bk = 32, 32
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        programs = triton_programs.load("int4_linear_programs")
        programs.w4a16_matmul[(-(-m // bm), -(-n // bn))](
            flat, qweight.contiguous(), qzeros.contiguous(), scales.contiguous(), g_idx.to(torch.int32).contiguous(),
            bias if bias is not None else out, out, m, n, k, flat.stride(0), out.stride(0),
            BITS=bits, ZERO_OFFSET=zero_offset, HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk,
            PRECISION=precision, DOT_F32=triton_programs.interpreted() and x.dtype == torch.bfloat16)
    return out.view(*x.shape[:-1], n)
