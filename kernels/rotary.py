"""Rotary position embeddings as Hugging Face computes them: the rotate-half layout (or GLM-4's
interleaved pairs), over all of a head or its first `dim` channels (partial rotary), with rope
scaling (linear, llama3, Phi-3's longrope)."""
from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def _inv_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies, bit-for-bit as transformers computes them (longrope: _longrope)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin_cache(dim: int, theta: float, scaling: dict | None, max_positions: int,
                  interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position, shape [max_positions, dim], float32.

    longrope (Phi-3) scales by its short factors up to original_max_position_embeddings and by
    its long ones past it, position by position (transformers switches the whole sequence once
    it grows past that length, vLLM the whole batch; below it all three agree), and multiplies
    cos and sin by its attention factor."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    if (scaling or {}).get("rope_type") == "longrope":
        short, long, original, attention = _longrope(dim, theta, scaling)
        freqs = positions[:, None] * torch.where(positions[:, None] < original, short[None, :], long[None, :])
    else:
        freqs, attention = positions[:, None] * _inv_frequencies(dim, theta, scaling)[None, :], 1.0
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention, emb.sin() * attention


def _longrope(dim: int, theta: float, s: dict) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or s["max_position_embeddings"] / original
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    short = 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32) * base)
    long = 1.0 / (torch.tensor(s["long_factor"], dtype=torch.float32) * base)
    return short, long, original, attention


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool = False):
    """q: [T, heads, d], k: [T, kv_heads, d]; cos/sin: [T, dim] already gathered by position.
    dim < d: only the first dim channels rotate (partial rotary)."""
    cos, sin = cos[:, None, :].to(q.dtype), sin[:, None, :].to(q.dtype)
    rotate = _rotate_pairs if interleaved else _rotate_half
    dim = cos.shape[-1]
    if dim == q.shape[-1]:
        return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
    qr, kr = q[..., :dim], k[..., :dim]
    return (torch.cat((qr * cos + rotate(qr) * sin, q[..., dim:]), -1),
            torch.cat((kr * cos + rotate(kr) * sin, k[..., dim:]), -1))
