"""Mamba-2's mixer (the SSD state space model, kernels/ssd.py), as Granite 4.0-H's, Bamba's and
Nemotron-H's Mamba layers run it, and where its checkpoint tensors go; Mamba(-1)'s (the selective
scan, kernels/selective_scan.py: Mamba, FalconMamba)."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from actors.distributed.parallel import Parallel
from actors.models.args import Mamba1Args, MambaArgs, ModelArgs
from actors.models.layers import ColumnParallelLinear, RowParallelLinear
from kernels import causal_conv, selective_scan, ssd
from kernels.attention import AttentionMetadata


class Mamba2Mixer(nn.Module):
    """Mamba-2's mixer (Granite 4.0-H's, Bamba's, Nemotron-H's mamba layers): in_proj gives the gate
    z, x with B and C (convolved, SiLU) and dt; the state space model (kernels/ssd.py) plus D x;
    y * SiLU(z), RMS-normed per group; out_proj. Its states: the convolution's last inputs and, per
    head, [head_dim, d_state] float32. Under tensor parallelism each rank holds a share of the
    groups with their heads (so every group norm is whole on one rank)."""
    caches_kv = False
    nope = local_rope = scales_q = False

    def __init__(self, a: ModelArgs, p: Parallel):
        super().__init__()
        m = a.linear_attn
        if m.groups % p.tp_size:
            raise ValueError(f"{a.architecture}'s Mamba layers need the tensor parallel size ({p.tp_size}) to divide "
                             f"their B / C groups ({m.groups})")
        t = p.tp_size
        self.m = dataclasses.replace(m, heads=m.heads // t, groups=m.groups // t, inner=m.inner // t)  # this rank's
        m = self.m
        self.conv_dim = m.inner + 2 * m.groups * m.d_state
        self.in_proj = ColumnParallelLinear(a.hidden_size, m.inner + self.conv_dim + m.heads, m.proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, m.conv_kernel))
        self.conv_bias = nn.Parameter(torch.empty(self.conv_dim)) if m.conv_bias else None
        self.dt_bias, self.A_log, self.D = (nn.Parameter(torch.empty(m.heads)) for _ in range(3))
        self.norm_weight = nn.Parameter(torch.empty(m.inner))
        self.out_proj = RowParallelLinear(m.inner, a.hidden_size, m.proj_bias, p)
        self.eps = a.rms_norm_eps
        self.state_shapes = {"conv_state": ((self.conv_dim, m.conv_kernel - 1), "conv"),
                             "state": ((m.heads, m.head_dim, m.d_state), "ssm")}
        self.conv_state = self.state = None

    def forward(self, x, cos, sin, meta: AttentionMetadata, q_scale=None):
        m, t, rows = self.m, x.shape[0], meta.recurrent
        z, xbc, dt = self.in_proj(x).split([m.inner, self.conv_dim, m.heads], -1)
        if rows.fresh is not None:
            self.conv_state.index_fill_(0, rows.fresh, 0.0)
            self.state.index_fill_(0, rows.fresh, 0.0)
        dt = F.softplus(dt + self.dt_bias).clamp(*m.dt_limit)
        a, d = -self.A_log.float().exp(), self.D.float()[:, None]
        y = torch.empty(t, m.heads, m.head_dim, dtype=torch.float32, device=x.device)
        nd = rows.num_decodes
        if nd:
            conv, state = self.conv_state[rows.decode_rows], self.state[rows.decode_rows]
            xs, b, c = self._split(causal_conv.conv_step(xbc[:nd], conv, self.conv_weight, self.conv_bias))
            y[:nd] = ssd.step(xs, dt[:nd], a, b, c, state) + d * xs.float()
            self.conv_state.index_copy_(0, rows.decode_rows, conv)
            self.state.index_copy_(0, rows.decode_rows, state)
        for first, count, row in rows.chunks:
            end = first + count
            xs, b, c = self._split(causal_conv.conv_prefill(xbc[first:end], self.conv_state[row], self.conv_weight,
                                                            self.conv_bias))
            y[first:end] = ssd.chunked(xs, dt[first:end], a, b, c, self.state[row]) + d * xs.float()
        return self.out_proj(self._gated_norm(y, z).to(x.dtype))

    def _split(self, conv: torch.Tensor):
        """Convolved [x | B | C] -> x [T, heads, head_dim], B and C [T, groups, d_state]."""
        m, t = self.m, conv.shape[0]
        xs, b, c = conv.split([m.inner, m.groups * m.d_state, m.groups * m.d_state], -1)
        return xs.view(t, m.heads, m.head_dim), b.view(t, m.groups, m.d_state), c.view(t, m.groups, m.d_state)

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y * SiLU(z), RMS-normed over each group's channels, in float32, then scaled."""
        m = self.m
        h = y.reshape(y.shape[0], m.inner) * F.silu(z.float())
        h = h.view(h.shape[0], m.groups, -1)
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).view(h.shape[0], m.inner)
        return self.norm_weight * h.to(self.norm_weight.dtype)


class Mamba1Mixer(nn.Module):
    """Mamba(-1)'s mixer: in_proj gives x and the gate z; x convolved (SiLU); x_proj gives dt's low
    rank part and B, C (FalconMamba: each RMS-normed, no weight); dt_proj widens dt to every
    channel (softplus); the selective scan plus D x, times SiLU(z); out_proj. Its states: the
    convolution's last inputs and, per channel, a d_state-wide state."""
    caches_kv = False
    nope = local_rope = scales_q = False

    def __init__(self, a: ModelArgs, p: Parallel):
        super().__init__()
        m = self.m = a.linear_attn
        if p.tp_size > 1:  # (x_proj reads every channel: a rank's share would need an all-reduce)
            raise ValueError(f"{a.architecture} is not supported with tensor parallelism yet")
        self.in_proj = ColumnParallelLinear(a.hidden_size, 2 * m.inner, m.proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(m.inner, m.conv_kernel))
        self.conv_bias = nn.Parameter(torch.empty(m.inner)) if m.conv_bias else None
        self.x_proj = nn.Linear(m.inner, m.dt_rank + 2 * m.d_state, bias=False)
        self.dt_proj = nn.Linear(m.dt_rank, m.inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(m.inner, m.d_state))
        self.D = nn.Parameter(torch.empty(m.inner))
        self.out_proj = RowParallelLinear(m.inner, a.hidden_size, m.proj_bias, p)
        self.state_shapes = {"conv_state": ((m.inner, m.conv_kernel - 1), "conv"),
                             "state": ((m.inner, m.d_state), "ssm")}
        self.conv_state = self.state = None

    def forward(self, x, cos, sin, meta: AttentionMetadata, q_scale=None):
        m, rows = self.m, meta.recurrent
        xs, z = self.in_proj(x).chunk(2, -1)
        if rows.fresh is not None:
            self.conv_state.index_fill_(0, rows.fresh, 0.0)
            self.state.index_fill_(0, rows.fresh, 0.0)
        a = -self.A_log.float().exp()
        conv = torch.empty_like(xs)
        y = torch.empty(xs.shape, dtype=torch.float32, device=x.device)
        nd = rows.num_decodes
        if nd:
            state = self.conv_state[rows.decode_rows]
            conv[:nd] = causal_conv.conv_step(xs[:nd], state, self.conv_weight, self.conv_bias)
            self.conv_state.index_copy_(0, rows.decode_rows, state)
        for first, count, row in rows.chunks:
            conv[first:first + count] = causal_conv.conv_prefill(xs[first:first + count], self.conv_state[row],
                                                                 self.conv_weight, self.conv_bias)
        dt, b, c = self.x_proj(conv).split([m.dt_rank, m.d_state, m.d_state], -1)
        if m.rms_eps is not None:  # FalconMamba
            dt, b, c = (_weightless_rms(t, m.rms_eps) for t in (dt, b, c))
        dt = F.softplus(self.dt_proj(dt).float())
        if nd:
            state = self.state[rows.decode_rows]
            y[:nd] = selective_scan.step(conv[:nd], dt[:nd], a, b[:nd], c[:nd], state)
            self.state.index_copy_(0, rows.decode_rows, state)
        for first, count, row in rows.chunks:
            end = first + count
            y[first:end] = selective_scan.scan(conv[first:end], dt[first:end], a, b[first:end], c[first:end],
                                               self.state[row])
        y = (y + self.D.float() * conv.float()) * F.silu(z.float())
        return self.out_proj(y.to(x.dtype))


def _weightless_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def mamba1_rule(target: str, rest: str, m: Mamba1Args):
    """Where a Mamba(-1) mixer's tensor goes (whole: it runs at tp=1)."""
    if rest == "conv1d.weight":  # [channels, 1, kernel]
        return (f"{target}conv_weight", 0, conv_rows(0, m.inner), 0, 0)
    if rest == "conv1d.bias":
        return (f"{target}conv_bias", 0, None, 0, 0)
    return (target + rest, 0, None, 0, 0)


def mamba_rule(target: str, part: str, kind: str | None, m: MambaArgs, p: Parallel):
    """Where a Mamba-2 tensor, or this rank's share of it, goes: in_proj's rows are [z | x | B | C |
    dt], the convolution's channels [x | B | C]; each rank its heads' rows of z, x and dt, its
    groups' of B and C (this rank's slices of each part, in that order)."""
    t, r = p.tp_size, p.tp_rank
    inner, gn, heads = m.inner // t, m.groups // t * m.d_state, m.heads // t
    all_gn = m.groups * m.d_state
    xbc = [(0, r * inner, inner), (inner, m.inner + r * gn, gn), (inner + gn, m.inner + all_gn + r * gn, gn)]
    if part == "in_proj":
        parts = [(0, r * inner, inner)] + [(inner + o, m.inner + s, n) for o, s, n in xbc]
        parts.append((2 * inner + 2 * gn, 2 * m.inner + 2 * all_gn + r * heads, heads))
        return [(f"{target}in_proj.{kind}", o, 0, s, n) for o, s, n in parts]
    if part == "conv1d":  # [channels, 1, kernel]; its bias [channels]
        if kind == "weight":
            return [(f"{target}conv_weight", o, conv_rows(s, n), 0, 0) for o, s, n in xbc]
        return [(f"{target}conv_bias", o, 0, s, n) for o, s, n in xbc]
    if part == "out_proj":
        return (f"{target}out_proj.{kind}", 0, 1 if kind == "weight" else None, r * inner, inner)
    if part == "norm":
        return (f"{target}norm_weight", 0, 0, r * inner, inner)
    return (target + part, 0, 0, r * heads, heads)  # dt_bias, A_log, D


def conv_rows(start: int, size: int):
    """A depthwise convolution's weight [channels, 1, kernel]: rows start.. as [size, kernel]."""
    return lambda t: t[start:start + size].reshape(size, -1)
