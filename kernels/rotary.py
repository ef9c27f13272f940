"""Rotary position embeddings as Hugging Face computes them: the rotate-half layout (or GLM-4's
interleaved pairs), over all of a head or its first `dim` channels (partial rotary), with rope
scaling (linear, llama3, Phi-3's longrope, YaRN: gpt-oss, DeepSeek-V3; Gemma 4's proportional:
the whole head's rotate-half with only its lowest frequencies turning)."""
from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "proportional")


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
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)[0]
    if rope_type == "proportional":  # Gemma 4's global layers: the first pairs of the whole head rotate, the rest not
        angles = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        return torch.cat((inv_freq[:angles], torch.zeros(head_dim // 2 - angles))) / scaling.get("factor", 1.0)
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


def _yarn(dim: int, theta: float, s: dict) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention factor) as transformers' _compute_yarn_parameters computes
    them, operation for operation: the low frequencies interpolated (divided by `factor`), the
    high ones kept, a linear ramp between the dimensions that turn beta_fast and beta_slow times
    over the original context; cos and sin are then scaled by the attention factor."""
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or s["max_position_embeddings"] / original  # DeepSeek: the length ratio
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention = _yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
    low, high = _yarn_correction_dim(beta_fast, dim, theta, original), _yarn_correction_dim(beta_slow, dim, theta, original)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # 1: the frequency is kept (extrapolated), 0: divided by factor
    return interpolation * (1 - kept) + extrapolation * kept, attention


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(rotations: float, dim: int, theta: float, original: int) -> float:
    """The dimension whose frequency turns `rotations` times over the original context."""
    return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))


def cos_sin_cache(dim: int, theta: float, scaling: dict | None, max_positions: int,
                  interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position, shape [max_positions, dim], float32.

    longrope (Phi-3) scales by its short factors up to original_max_position_embeddings and by
    its long ones past it, position by position (transformers switches the whole sequence once
    it grows past that length, vLLM the whole batch; below it all three agree); longrope and
    yarn multiply cos and sin by their attention factor (PhiMoE's: short_mscale below that length,
    long_mscale past it; transformers' PhiMoE keeps the short factors past it too)."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    if (scaling or {}).get("rope_type") == "longrope":
        short, long, original, attention = _longrope(dim, theta, scaling)
        freqs = positions[:, None] * torch.where(positions[:, None] < original, short[None, :], long[None, :])
        if "short_mscale" in scaling:  # PhiMoE: its own attention factor below the original length and past it
            attention = torch.where(positions < original, scaling["short_mscale"], scaling["long_mscale"])[:, None]
    elif (scaling or {}).get("rope_type") == "yarn":
        inv_freq, attention = _yarn(dim, theta, scaling)
        freqs = positions[:, None] * inv_freq[None, :]
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
