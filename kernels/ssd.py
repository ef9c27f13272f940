"""Mamba-2's state space model (the SSD form: Granite 4.0-H's Mamba layers), in plain torch.

Per head a state S [head_dim, d_state] (float32), per token with step dt > 0 and decay A < 0:

    S = exp(dt * A) * S + dt * x B^T      y = S C + D * x

B and C are shared by the heads of a group. A decode step applies this once per row
(`step`); a prompt chunk applies it CHUNK tokens at a time in matrix form (`chunked`): within a
chunk, y = ((C B^T) * decays, causal) (dt x) + (decayed start state) C, and the state at the
chunk's end is the decayed start state plus each token's write, decayed to the end.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def groups_to_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., heads, N], each group's row repeated for its heads."""
    return t.repeat_interleave(heads // t.shape[-2], -2)


def step(x, dt, A, B, C, state: torch.Tensor) -> torch.Tensor:
    """x [R, H, P], dt [R, H] (after softplus), A [H], B / C [R, G, N]; state [R, H, P, N] updated
    in place (computed in float32). Returns S C [R, H, P] (float32, without the D term)."""
    heads, s = x.shape[1], state.float()
    B, C = groups_to_heads(B.float(), heads), groups_to_heads(C.float(), heads)
    dt = dt.float()
    s.mul_(torch.exp(dt * A)[..., None, None]).add_((dt[..., None] * x.float())[..., None] * B[:, :, None, :])
    if s is not state:
        state.copy_(s)
    return torch.einsum("rhpn,rhn->rhp", s, C)


def chunked(x, dt, A, B, C, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """One sequence's L tokens: x [L, H, P], dt [L, H], A [H], B / C [L, G, N]; state [H, P, N]
    updated in place (computed in float32). Returns y [L, H, P] (float32, without the D term)."""
    length, heads = x.shape[:2]
    stored, state = state, state.float()
    B, C = groups_to_heads(B.float(), heads), groups_to_heads(C.float(), heads)
    xdt = x.float() * dt.float()[..., None]
    a = dt.float() * A  # [L, H] log decays
    pad = -length % chunk  # padding tokens: no decay, no write
    xdt, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xdt, B, C))
    a = F.pad(a, (0, 0, 0, pad))
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    out = torch.empty_like(xdt)
    for first in range(0, length + pad, chunk):
        part = slice(first, first + chunk)
        decay = a[part].cumsum(0)  # [c, H]: log decay from the chunk's start through each token
        between = (decay[:, None, :] - decay[None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
        scores = torch.einsum("lhn,shn->lsh", C[part], B[part]) * between
        out[part] = (torch.einsum("lsh,shp->lhp", scores, xdt[part])
                     + torch.einsum("lhn,hpn->lhp", C[part], state) * decay.exp()[..., None])
        to_end = (decay[-1] - decay).exp()  # [c, H]
        state.mul_(decay[-1].exp()[:, None, None]).add_(
            torch.einsum("shp,shn->hpn", xdt[part] * to_end[..., None], B[part]))
    if state is not stored:
        stored.copy_(state)
    return out[:length]
