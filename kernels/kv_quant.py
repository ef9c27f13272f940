"""The fp8 KV cache's number format (--kv-cache-dtype fp8): float8 e4m3 (finite, no infinities:
torch.float8_e4m3fn), one byte per element, with one K and one V scale per layer.

Writing stores round(x / scale) saturated to +-448 (e4m3's largest finite value; a plain cast
would turn anything larger into NaN); reading gives stored * scale. Every attention path
(kernels/attention.py's torch path, csrc/paged_attention.cpp, the Triton kernels) reads the
same value, stored * scale, computed in float32 and then rounded to the query's dtype where
the kernel computes in it, so each path on fp8 blocks computes what it computes in float on
K/V that went through `round_trip`.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def kv_cache_dtype(option: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for --kv-cache-dtype (auto: the model's)."""
    if option in ("fp8", "fp8_e4m3"):
        return FP8
    if option == "auto":
        return model_dtype
    raise ValueError(f"--kv-cache-dtype must be auto, fp8 or fp8_e4m3, got {option!r}")


def is_fp8(cache: torch.Tensor | None) -> bool:
    return cache is not None and cache.dtype == FP8


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale rounded to e4m3 (to nearest, ties to even), saturating at +-448."""
    x = x.float()
    if scale != 1.0:
        x = x / scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored e4m3 values times their scale, in float32, then in `dtype`."""
    x = x.float()
    if scale != 1.0:
        x = x * scale
    return x.to(dtype)


def round_trip(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x as the fp8 cache gives it back (in x's dtype): what an oracle's attention should see."""
    return dequantize(quantize(x, scale), scale, x.dtype)
