"""Hybrid decoders: layers whose past is a state per sequence between attention layers. Qwen3.5
(dense and MoE, its image-text releases served for their text) and Qwen3-Next: Gated DeltaNet
linear attention (kernels/gated_delta.py) between gated full-attention layers; LFM2: short
convolutions; Granite 4.0-H and Bamba: Mamba-2 (actors/models/mamba.py; Nemotron-H, whose layers
hold one mixer each: actors/models/nemotron_h.py).

The layers marked in ModelArgs.linear_layers keep, per sequence, a state instead of K/V in the
pool (a convolution's last inputs, a recurrent state). The state lives in the layer, one
row per row of the input batch (the persistent batch of actors/worker/input_batch.py: a row is
a live sequence's for as long as it runs), and is reset when a sequence's computation starts
at position 0 (a new request, or one preempted and recomputed). So a state is only ever the
state of the tokens before the step: a prefix-cache hit, which would skip tokens the state has
not seen, and speculative decoding, which would have to roll a state back, are off for these
models (actors/worker/model_spec.py). Qwen's other layers are full attention whose output is
gated per channel by a sigmoid of a second half of q_proj (per head: its query, then its gate),
with zero-centred (1 + w) norms and a quarter of each head rotated.

Under tensor parallelism each rank holds a share of the key heads and of the value heads (a
key head's value heads stay on its rank), of the convolution's channels and of the gate.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from actors.distributed.parallel import Parallel
from actors.models.args import LinearAttnArgs, MambaArgs, ModelArgs, ShortConvArgs
from actors.models.layers import ColumnParallelLinear, RowParallelLinear
from actors.models.llama import Attention, LlamaForCausalLM, local_heads
from actors.models.mamba import Mamba2Mixer, conv_rows, mamba_rule
from actors.models.moe import MoeForCausalLM
from kernels import causal_conv, gated_delta
from kernels.attention import AttentionMetadata, paged_attention, write_kv
from kernels.rotary import apply_rotary


class GatedAttention(Attention):
    """Full attention with a sigmoid output gate: q_proj gives each head its query and its gate."""

    def __init__(self, a: ModelArgs, p: Parallel, layer: int):
        super().__init__(a, p, layer)
        self.qkv_proj = ColumnParallelLinear(a.hidden_size, 2 * (self.h + self.kvh) * self.d, a.qkv_bias)
        self.fusable = False

    def forward(self, x, cos, sin, meta: AttentionMetadata, q_scale=None):
        t, h, kvh, d = x.shape[0], self.h, self.kvh, self.d
        qg, k, v = self.qkv_proj(x).split([2 * h * d, kvh * d, kvh * d], -1)
        q, gate = qg.view(t, h, 2 * d).split(d, -1)
        q, k = self.q_norm(q), self.k_norm(k.view(t, kvh, d))
        q, k = apply_rotary(q, k, cos, sin, self.interleaved)
        v = v.view(t, kvh, d)
        write_kv(self.k_cache, self.v_cache, meta.slot_mapping, k, v, self.k_scale, self.v_scale)
        o = paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, k, v, self.window, self.softcap,
                            self.sinks, self.k_scale, self.v_scale)
        return self.o_proj(o.reshape(t, h * d) * torch.sigmoid(gate.reshape(t, h * d)))


def linear_heads(a: ModelArgs, p: Parallel) -> tuple[int, int]:
    """(key heads, value heads) of a linear-attention layer on this rank."""
    la, t = a.linear_attn, p.tp_size
    if la.k_heads % t or la.v_heads % t:
        raise ValueError(f"tensor parallel size {t} must divide the linear-attention key heads ({la.k_heads}) "
                         f"and value heads ({la.v_heads})")
    return la.k_heads // t, la.v_heads // t


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear attention. in_proj is the checkpoint's in_proj_qkv, in_proj_z (the output
    gate), in_proj_b (beta) and in_proj_a (the decay's input) fused, this rank's share of each, as
    [q | k | v | z | b | a] (Qwen3-Next's in_proj_qkvz / in_proj_ba, grouped by key head, are cut
    into the same layout)."""
    caches_kv = False  # (its state is bound by actors/worker/kv_pool.py bind_states)
    nope = local_rope = scales_q = False  # (what the decoder asks of an attention layer)

    def __init__(self, a: ModelArgs, p: Parallel):
        super().__init__()
        la = a.linear_attn
        self.hk, self.hv = linear_heads(a, p)
        self.dk, self.dv = la.k_dim, la.v_dim
        self.conv_dim = 2 * self.hk * self.dk + self.hv * self.dv
        self.in_proj = ColumnParallelLinear(a.hidden_size, self.conv_dim + self.hv * self.dv + 2 * self.hv, False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, la.conv_kernel))
        self.A_log = nn.Parameter(torch.empty(self.hv))
        self.dt_bias = nn.Parameter(torch.empty(self.hv))
        self.norm_weight = nn.Parameter(torch.empty(self.dv))
        self.out_proj = RowParallelLinear(self.hv * self.dv, a.hidden_size, False, p)
        self.eps = a.rms_norm_eps
        # Per input-batch row (actors/worker/kv_pool.py bind_states): the convolution's last
        # inputs [channels, kernel - 1] and the recurrent state [value heads, dk, dv]
        self.state_shapes = {"conv_state": ((self.conv_dim, la.conv_kernel - 1), "conv"),
                             "state": ((self.hv, self.dk, self.dv), "ssm")}
        self.conv_state = self.state = None

    def forward(self, x, cos, sin, meta: AttentionMetadata, q_scale=None):
        t, hv, dv = x.shape[0], self.hv, self.dv
        mixed, z, b, a = self.in_proj(x).split([self.conv_dim, hv * dv, hv, hv], -1)
        rows = meta.recurrent
        if rows.fresh is not None:  # sequences starting at position 0 start from nothing
            self.conv_state.index_fill_(0, rows.fresh, 0.0)
            self.state.index_fill_(0, rows.fresh, 0.0)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = torch.empty(t, hv, dv, dtype=x.dtype, device=x.device)
        nd = rows.num_decodes
        if nd:  # one token a row, all at once
            conv, state = self.conv_state[rows.decode_rows], self.state[rows.decode_rows]
            mixed_d = causal_conv.conv_step(mixed[:nd], conv, self.conv_weight)
            out[:nd] = gated_delta.recurrent_step(*self._split(mixed_d, g[:nd], beta[:nd]), state).to(x.dtype)
            self.conv_state.index_copy_(0, rows.decode_rows, conv)
            self.state.index_copy_(0, rows.decode_rows, state)
        for first, count, row in rows.chunks:  # a prompt chunk at a time, each from its sequence's state
            end = first + count
            mixed_c = causal_conv.conv_prefill(mixed[first:end], self.conv_state[row], self.conv_weight)
            out[first:end] = gated_delta.chunked(*self._split(mixed_c, g[first:end], beta[first:end]),
                                                 self.state[row]).to(x.dtype)
        o = gated_delta.gated_rms_norm(out, z.view(t, hv, dv), self.norm_weight, self.eps)
        return self.out_proj(o.reshape(t, hv * dv))

    def _split(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
        t, kd = mixed.shape[0], self.hk * self.dk
        q, k, v = mixed.split([kd, kd, self.hv * self.dv], -1)
        return gated_delta.prepared(q.view(t, self.hk, self.dk), k.view(t, self.hk, self.dk),
                                    v.view(t, self.hv, self.dv), g, beta)


class ShortConv(nn.Module):
    """LFM2's convolution layer: in_proj gives B, C and x; the depthwise causal convolution of
    B * x, times C, through out_proj. Its state: the convolution's last inputs. Under tensor
    parallelism each rank holds a share of the channels (each channel is its own)."""
    caches_kv = False
    nope = local_rope = scales_q = False

    def __init__(self, a: ModelArgs, p: Parallel):
        super().__init__()
        conv = a.linear_attn
        if a.hidden_size % p.tp_size:
            raise ValueError(f"tensor parallel size {p.tp_size} must divide the hidden size ({a.hidden_size})")
        self.c = a.hidden_size // p.tp_size
        self.in_proj = ColumnParallelLinear(a.hidden_size, 3 * self.c, conv.bias)
        self.conv_weight = nn.Parameter(torch.empty(self.c, conv.kernel))
        self.conv_bias = nn.Parameter(torch.empty(self.c)) if conv.bias else None
        self.out_proj = RowParallelLinear(self.c, a.hidden_size, conv.bias, p)
        self.state_shapes = {"conv_state": ((self.c, conv.kernel - 1), "conv")}
        self.conv_state = None

    def forward(self, x, cos, sin, meta: AttentionMetadata, q_scale=None):
        b, c, h = self.in_proj(x).split(self.c, -1)
        bx, rows = b * h, meta.recurrent
        if rows.fresh is not None:
            self.conv_state.index_fill_(0, rows.fresh, 0.0)
        out = torch.empty_like(bx)
        nd = rows.num_decodes
        if nd:
            conv = self.conv_state[rows.decode_rows]
            out[:nd] = causal_conv.conv_step(bx[:nd], conv, self.conv_weight, self.conv_bias, silu=False)
            self.conv_state.index_copy_(0, rows.decode_rows, conv)
        for first, count, row in rows.chunks:
            end = first + count
            out[first:end] = causal_conv.conv_prefill(bx[first:end], self.conv_state[row], self.conv_weight,
                                                      self.conv_bias, silu=False)
        return self.out_proj(c * out)


class HybridForCausalLM(LlamaForCausalLM):
    def make_attention(self, layer: int) -> nn.Module:
        a, p = self.args, self.p
        if a.caches_kv(layer):
            return GatedAttention(a, p, layer) if a.attn_output_gate else Attention(a, p, layer)
        kinds = {LinearAttnArgs: GatedDeltaNet, ShortConvArgs: ShortConv, MambaArgs: Mamba2Mixer}
        return kinds[type(a.linear_attn)](a, p)

    @property
    def lfm2(self) -> bool:
        return isinstance(self.args.linear_attn, ShortConvArgs)

    def _layer_rule(self, prefix: str, rest: str):
        a, p = self.args, self.p
        if self.lfm2:
            return self._lfm2_rule(prefix, rest)
        if isinstance(a.linear_attn, MambaArgs):
            return self._granite_rule(prefix, rest)
        m = re.match(r"linear_attn\.(\w+)(?:\.weight)?$", rest)
        if m:
            return _linear_rule(prefix + "self_attn.", m.group(1), a, p)
        h, kvh, kv0 = local_heads(a, p)
        d = a.head_dim
        parts = {"q_proj": (0, p.tp_rank * 2 * h * d, 2 * h * d), "k_proj": (2 * h * d, kv0 * d, kvh * d),
                 "v_proj": (2 * h * d + kvh * d, kv0 * d, kvh * d)}
        m = re.match(r"self_attn\.([qkv]_proj)\.(weight|bias)$", rest)
        if m:
            offset, start, size = parts[m.group(1)]
            return (f"{prefix}self_attn.qkv_proj.{m.group(2)}", offset, 0, start, size)
        return super()._layer_rule(prefix, rest)

    def weight_rule(self, name: str):
        return super().weight_rule("model.norm.weight" if name == "model.embedding_norm.weight" else name)  # (LFM2's)

    def _granite_rule(self, prefix: str, rest: str):
        """Granite 4.0-H's and Bamba's names: mamba.*, Granite's dense models' shared_mlp as the MLP
        (an MoE model's: actors/models/moe.py), Bamba's feed_forward and pre_ff_layernorm."""
        a, p = self.args, self.p
        m = re.match(r"mamba\.(\w+?)(?:\.(weight|bias))?$", rest)
        if m:
            return mamba_rule(f"{prefix}self_attn.", *m.groups(), a.linear_attn, p)
        for theirs, ours in (("feed_forward.", "mlp."), ("pre_ff_layernorm.", "post_attention_layernorm.")):
            if rest.startswith(theirs):  # (Bamba's names)
                rest = ours + rest[len(theirs):]
        if a.moe is None and rest.startswith("shared_mlp."):  # [gate; up] fused, then down
            w, r = a.intermediate_size // p.tp_size, p.tp_rank
            if rest == "shared_mlp.input_linear.weight":
                return [(f"{prefix}mlp.gate_up_proj.weight", 0, 0, r * w, w),
                        (f"{prefix}mlp.gate_up_proj.weight", w, 0, a.intermediate_size + r * w, w)]
            return (f"{prefix}mlp.down_proj.weight", 0, 1, r * w, w)
        return super()._layer_rule(prefix, rest)

    def _lfm2_rule(self, prefix: str, rest: str):
        """LFM2's names: conv.* (this rank's channels of B, C and x, of the convolution and of
        out_proj's input), feed_forward.w1 / w3 / w2, operator_norm / ffn_norm, q/k_layernorm, out_proj."""
        p, c = self.p, self.args.hidden_size // self.p.tp_size
        m = re.match(r"conv\.(in_proj|conv|out_proj)\.(weight|bias)$", rest)
        if m:
            part, kind = m.groups()
            target = f"{prefix}self_attn."
            if part == "in_proj":  # [B; C; x], each hidden wide
                return [(f"{target}in_proj.{kind}", i * c, 0, i * self.args.hidden_size + p.tp_rank * c, c)
                        for i in range(3)]
            if part == "conv" and kind == "weight":  # [channels, 1, kernel]
                return (f"{target}conv_weight", 0, conv_rows(p.tp_rank * c, c), 0, 0)
            if part == "conv":
                return (f"{target}conv_bias", 0, 0, p.tp_rank * c, c)
            return (f"{target}out_proj.{kind}", 0, 1 if kind == "weight" else None, p.tp_rank * c, c)
        names = {"feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
                 "feed_forward.w2": "mlp.down_proj",
                 "operator_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 "self_attn.q_layernorm": "self_attn.q_norm", "self_attn.k_layernorm": "self_attn.k_norm",
                 "self_attn.out_proj": "self_attn.o_proj"}
        module, kind = rest.rsplit(".", 1)
        return super()._layer_rule(prefix, f"{names.get(module, module)}.{kind}")


class HybridMoeForCausalLM(HybridForCausalLM, MoeForCausalLM):
    """Qwen3.5-MoE and Qwen3-Next: the hybrid attention, MLPs as sparse blocks with a gated shared expert."""


def _linear_rule(prefix: str, part: str, a: ModelArgs, p: Parallel):
    """Where a Gated DeltaNet tensor, or this rank's share of it, goes."""
    la, r = a.linear_attn, p.tp_rank
    hk, hv = linear_heads(a, p)
    k_rows, v_rows = hk * la.k_dim, hv * la.v_dim
    k_all = la.k_heads * la.k_dim
    conv_local = 2 * k_rows + v_rows
    # q, k and v: this rank's rows of each part, in the checkpoint's [q; k; v] order
    qkv = [(0, r * k_rows, k_rows), (k_rows, k_all + r * k_rows, k_rows), (2 * k_rows, 2 * k_all + r * v_rows, v_rows)]
    if part == "in_proj_qkv":
        return [(f"{prefix}in_proj.weight", offset, 0, start, size) for offset, start, size in qkv]
    if part == "conv1d":  # [channels, 1, kernel]
        return [(f"{prefix}conv_weight", offset, conv_rows(start, size), 0, 0) for offset, start, size in qkv]
    if part in ("in_proj_qkvz", "in_proj_ba"):
        return _grouped_rules(f"{prefix}in_proj.weight", part, a, p)
    gate_rows = {"in_proj_z": (conv_local, r * v_rows, v_rows), "in_proj_b": (conv_local + v_rows, r * hv, hv),
                 "in_proj_a": (conv_local + v_rows + hv, r * hv, hv)}
    if part in gate_rows:
        offset, start, size = gate_rows[part]
        return (f"{prefix}in_proj.weight", offset, 0, start, size)
    if part in ("A_log", "dt_bias"):
        return (f"{prefix}{part}", 0, 0, r * hv, hv)
    if part == "norm":
        return (f"{prefix}norm_weight", 0, None, 0, 0)
    if part == "out_proj":
        return (f"{prefix}out_proj.weight", 0, 1, r * v_rows, v_rows)
    raise ValueError(f"unexpected linear-attention weight {part!r}")


def _grouped_rules(target: str, part: str, a: ModelArgs, p: Parallel) -> list:
    """Qwen3-Next's fused projections, grouped by key head: per group [q, k, v, z] (dk, dk and
    ratio x dv rows each) in in_proj_qkvz, [b, a] (ratio rows each) in in_proj_ba; this rank's
    groups' parts, each to its place in [q | k | v | z | b | a]."""
    la = a.linear_attn
    hk, hv = linear_heads(a, p)
    ratio, dk = la.v_heads // la.k_heads, la.k_dim
    vd = ratio * la.v_dim  # a group's value (and gate) rows
    conv_local = 2 * hk * dk + hv * la.v_dim
    rules = []
    for j in range(hk):
        group = p.tp_rank * hk + j
        if part == "in_proj_qkvz":
            first = group * (2 * dk + 2 * vd)
            rules += [(target, j * dk, 0, first, dk), (target, hk * dk + j * dk, 0, first + dk, dk),
                      (target, 2 * hk * dk + j * vd, 0, first + 2 * dk, vd),
                      (target, conv_local + j * vd, 0, first + 2 * dk + vd, vd)]
        else:
            first = group * 2 * ratio
            rules += [(target, conv_local + hv * la.v_dim + j * ratio, 0, first, ratio),
                      (target, conv_local + hv * la.v_dim + hv + j * ratio, 0, first + ratio, ratio)]
    return rules
