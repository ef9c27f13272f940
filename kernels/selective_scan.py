"""Mamba(-1)'s selective scan (Mamba, FalconMamba), in plain torch.

Per channel a state s [d_state] (float32) with its own decay rates A [channels, d_state] < 0; per
token with step dt > 0 (per channel):

    s = exp(dt A) * s + dt x B      y = s . C (+ D x, added by the layer)

B and C are shared by the channels. The decay differs per state dimension, so there is no
matrix form as cheap as Mamba-2's: a prompt runs token by token (`scan`), a decode step once
per row (`step`).
"""
from __future__ import annotations

import torch


def step(x, dt, A, B, C, state: torch.Tensor) -> torch.Tensor:
    """x, dt [R, D], A [D, N], B / C [R, N]; state [R, D, N] updated in place (in float32).
    Returns y [R, D] float32 (without the D term)."""
    s, dt = state.float(), dt.float()
    s.mul_(torch.exp(dt[..., None] * A)).add_((dt * x.float())[..., None] * B.float()[:, None, :])
    if s is not state:
        state.copy_(s)
    return torch.einsum("rdn,rn->rd", s, C.float())


def scan(x, dt, A, B, C, state: torch.Tensor) -> torch.Tensor:
    """One sequence's L tokens: x, dt [L, D], A [D, N], B / C [L, N]; state [D, N] updated in
    place (in float32). Returns y [L, D] float32 (without the D term)."""
    s, dt = state.float(), dt.float()
    decay = torch.exp(dt[..., None] * A)  # [L, D, N]
    write = (dt * x.float())[..., None] * B.float()[:, None, :]
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        s = s * decay[t] + write[t]
        out[t] = s @ C[t].float()
    state.copy_(s)
    return out
