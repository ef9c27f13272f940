"""The gated delta rule (Gated DeltaNet: Qwen3.5's and Qwen3-Next's linear-attention layers), in
plain torch (the short causal convolution in front of it: kernels/causal_conv.py).

A linear-attention layer keeps, per sequence, a state instead of a KV cache: S [heads, dk, dv]
(float32) and the last K - 1 inputs of its depthwise convolution. Token t updates and reads it:

    S = exp(g_t) * S                      (decay, g_t <= 0)
    S = S + k_t (beta_t (v_t - S^T k_t))^T (the delta rule: write only what S mispredicts)
    o_t = S^T q_t

with q and k L2-normalised per head and q scaled by dk ** -0.5. A decode step applies this once
per row (`recurrent_step`); a prompt chunk applies it to chunks of CHUNK tokens at a time in the
equivalent matrix form (`chunked`: within a chunk, the delta-rule updates are the solution of
one unit-lower-triangular system, so a chunk costs a few matmuls instead of CHUNK sequential
updates), starting from the state the sequence's earlier chunks left.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2_normalised(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepared(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """q, k [..., Hk, dk], v [..., Hv, dv], g and beta [..., Hv] -> float32, q and k normalised
    and repeated so that each of the Hv // Hk value heads of a key head reads it, q scaled."""
    ratio = v.shape[-2] // k.shape[-2]
    q, k = l2_normalised(q.float()), l2_normalised(k.float())
    if ratio > 1:
        q, k = q.repeat_interleave(ratio, -2), k.repeat_interleave(ratio, -2)
    return q * q.shape[-1] ** -0.5, k, v.float(), g.float(), beta.float()


def recurrent_step(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token per row: q, k [B, H, dk], v [B, H, dv], g, beta [B, H] (prepared), state
    [B, H, dk, dv] updated in place (computed in float32 whatever it is stored in). Returns o [B, H, dv]."""
    s = state.float()
    s.mul_(g.exp()[..., None, None])
    predicted = torch.einsum("bhkv,bhk->bhv", s, k)
    s.add_(k[..., :, None] * ((v - predicted) * beta[..., None])[..., None, :])
    if s is not state:
        state.copy_(s)
    return torch.einsum("bhkv,bhk->bhv", s, q)


def chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """One sequence's L tokens: q, k [L, H, dk], v [L, H, dv], g, beta [L, H] (prepared),
    state [H, dk, dv] updated in place (computed in float32). Returns o [L, H, dv]."""
    length, stored = q.shape[0], state
    state = stored.float()
    pad = -length % chunk  # padding tokens: no decay (g 0), no write (beta 0, k 0, v 0)
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (q, k, v))  # [H, L', d]
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(0, 1) for x in (g, beta))  # [H, L']
    heads, n = q.shape[0], q.shape[1] // chunk
    q, k, v = (x.reshape(heads, n, chunk, x.shape[-1]) for x in (q, k, v))
    decay = g.reshape(heads, n, chunk).cumsum(-1)  # log of the decay from the chunk's start to each token
    beta = beta.reshape(heads, n, chunk, 1)
    # exp(decay_i - decay_j) for j <= i: what token j's write has decayed to when token i reads
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    between = (decay[..., :, None] - decay[..., None, :]).masked_fill(later, float("-inf")).exp()
    k_beta = k * beta
    # Token i's write depends on the writes of tokens j < i: U = (I + A)^-1 (...), A strictly lower
    # (the solver reads the lower triangle only and takes the diagonal as ones)
    system = k_beta @ k.transpose(-1, -2) * between
    writes = torch.linalg.solve_triangular(system, v * beta, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                          unitriangular=True)
    within = q @ k.transpose(-1, -2) * between  # causal, the diagonal included
    q_decayed = q * decay.exp()[..., None]
    k_decayed = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    out = torch.empty_like(v)
    for i in range(n):
        corrected = writes[:, i] - reads[:, i] @ state  # the writes less what the state already predicts
        out[:, i] = q_decayed[:, i] @ state + within[:, i] @ corrected
        state.mul_(chunk_decay[:, i]).add_(k_decayed[:, i].transpose(-1, -2) @ corrected)
    if state is not stored:
        stored.copy_(state)
    return out.reshape(heads, n * chunk, -1)[:, :length].transpose(0, 1)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head's output RMS-normalised, scaled, then gated by SiLU(gate), in float32 (as FLA and
    transformers compute it)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(dtype) * F.silu(gate.float())).to(dtype)
