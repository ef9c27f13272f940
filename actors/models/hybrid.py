"""Hybrid decoders: Gated DeltaNet linear-attention layers between gated full-attention layers
(Qwen3.5, dense and MoE, its image-text releases served for their text; Qwen3-Next), LFM2's
short-convolution layers and Granite 4.0-H's and Nemotron-H's Mamba-2 layers between attention layers.

Three layers in four (ModelArgs.linear_layers) are linear attention: a sequence's past is a
state per layer (kernels/gated_delta.py), not K/V in the pool. The state lives in the layer, one
row per row of the input batch (the persistent batch of actors/worker/input_batch.py: a row is
a live sequence's for as long as it runs), and is reset when a sequence's computation starts
at position 0 (a new request, or one preempted and recomputed). So a state is only ever the
state of the tokens before the step: a prefix-cache hit, which would skip tokens the state has
not seen, and speculative decoding, which would have to roll a state back, are off for these
models (actors/worker/model_spec.py). The other layers are full attention whose output is
gated per channel by a sigmoid of a second half of q_proj (per head: its query, then its gate),
with Qwen3.5's zero-centred (1 + w) norms and a quarter of each head rotated.

Under tensor parallelism each rank holds a share of the key heads and of the value heads (a
key head's value heads stay on its rank), of the convolution's channels and of the gate.
"""
from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn

from actors.distributed.parallel import Parallel
from actors.models.args import LinearAttnArgs, MambaArgs, ModelArgs, ShortConvArgs
from actors.models.layers import ColumnParallelLinear, RowParallelLinear
from actors.models.llama import Attention, LlamaForCausalLM, PlainMLP, local_heads
from actors.models.moe import MoeForCausalLM, Router
from kernels import gated_delta, ssd
from kernels.activation import plain_activation
from kernels.moe import grouped, route_grouped
from kernels.attention import AttentionMetadata, paged_attention, write_kv
from kernels.norms import RMSNorm
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
        # inputs [channels, kernel - 1] and the recurrent state [value heads, dk, dv], float32
        self.state_shapes = {"conv_state": ((self.conv_dim, la.conv_kernel - 1), None),
                             "state": ((self.hv, self.dk, self.dv), torch.float32)}
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
            mixed_d = gated_delta.conv_step(mixed[:nd], conv, self.conv_weight)
            out[:nd] = gated_delta.recurrent_step(*self._split(mixed_d, g[:nd], beta[:nd]), state).to(x.dtype)
            self.conv_state.index_copy_(0, rows.decode_rows, conv)
            self.state.index_copy_(0, rows.decode_rows, state)
        for first, count, row in rows.chunks:  # a prompt chunk at a time, each from its sequence's state
            end = first + count
            mixed_c = gated_delta.conv_prefill(mixed[first:end], self.conv_state[row], self.conv_weight)
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
        self.state_shapes = {"conv_state": ((self.c, conv.kernel - 1), None)}
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
            out[:nd] = gated_delta.conv_step(bx[:nd], conv, self.conv_weight, self.conv_bias, silu=False)
            self.conv_state.index_copy_(0, rows.decode_rows, conv)
        for first, count, row in rows.chunks:
            end = first + count
            out[first:end] = gated_delta.conv_prefill(bx[first:end], self.conv_state[row], self.conv_weight,
                                                      self.conv_bias, silu=False)
        return self.out_proj(c * out)


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
        self.state_shapes = {"conv_state": ((self.conv_dim, m.conv_kernel - 1), None),
                             "state": ((m.heads, m.head_dim, m.d_state), torch.float32)}
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
            xs, b, c = self._split(gated_delta.conv_step(xbc[:nd], conv, self.conv_weight, self.conv_bias))
            y[:nd] = ssd.step(xs, dt[:nd], a, b, c, state) + d * xs.float()
            self.conv_state.index_copy_(0, rows.decode_rows, conv)
            self.state.index_copy_(0, rows.decode_rows, state)
        for first, count, row in rows.chunks:
            end = first + count
            xs, b, c = self._split(gated_delta.conv_prefill(xbc[first:end], self.conv_state[row], self.conv_weight,
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
            return _mamba_rule(f"{prefix}self_attn.", *m.groups(), a.linear_attn, p)
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
                return (f"{target}conv_weight", 0, _conv_rows(p.tp_rank * c, c), 0, 0)
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


class NoMixer(nn.Module):
    """A Nemotron-H MLP layer's place for a mixer: it has neither K/V nor a state."""
    caches_kv = False
    nope = local_rope = scales_q = False


class NemotronMoe(nn.Module):
    """Nemotron 3's MoE: DeepSeek-V3's routing (sigmoid scores, a bias on the choice, groups),
    ungated squared-ReLU experts reading (with moe_latent_size) a projection of the hidden state,
    and a shared expert. Each rank holds a share of every expert's width and of the shared one's;
    their partial sums meet in one all-reduce."""

    def __init__(self, a: ModelArgs, p: Parallel):
        super().__init__()
        m, t = a.moe, p.tp_size
        if m.intermediate_size % t or m.shared_intermediate_size % t:
            raise ValueError(f"tensor parallel size {t} must divide the expert width ({m.intermediate_size}) and "
                             f"the shared expert's ({m.shared_intermediate_size})")
        self.m, self.p, self.act = m, p, plain_activation(a.activation)
        width, dim = m.intermediate_size // t, m.latent_size or a.hidden_size
        self.gate = Router(a.hidden_size, m.num_experts, score_bias=True)
        self.experts = nn.Module()
        self.experts.up_proj = nn.Parameter(torch.empty(m.num_experts, width, dim))
        self.experts.down_proj = nn.Parameter(torch.empty(m.num_experts, dim, width))
        self.shared_experts = nn.Module()
        self.shared_experts.up_proj = nn.Linear(a.hidden_size, m.shared_intermediate_size // t, bias=a.mlp_bias)
        if a.mlp_bias and t > 1:  # (each rank's down bias would be summed over the ranks)
            raise ValueError("Nemotron-H's MoE with MLP biases is not supported with tensor parallelism")
        self.shared_experts.down_proj = nn.Linear(m.shared_intermediate_size // t, a.hidden_size, bias=a.mlp_bias)
        if m.latent_size:
            self.fc1_latent_proj = nn.Linear(a.hidden_size, m.latent_size, bias=False)
            self.fc2_latent_proj = nn.Linear(m.latent_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, r = self.m, self.m.routing
        logits = F.linear(x.float(), self.gate.weight.float())
        weights, ids = route_grouped(logits, m.top_k, m.renormalize, r.scoring, r.group_score, r.n_group,
                                     r.topk_group, self.gate.e_score_correction_bias, r.scale)
        up, down = self.experts.up_proj, self.experts.down_proj
        h = self.fc1_latent_proj(x) if m.latent_size else x
        y = grouped(h, weights, ids, up.shape[0], lambda e, xs: F.linear(self.act(F.linear(xs, up[e])), down[e]))
        y = self.fc2_latent_proj(y) if m.latent_size else y
        shared = self.shared_experts
        return self.p.all_reduce(y + shared.down_proj(self.act(shared.up_proj(x))))


class MixerBlock(nn.Module):
    """Nemotron-H's layer: x + mixer(norm(x)), the mixer Mamba-2, attention, an MLP or an MoE."""

    def __init__(self, a: ModelArgs, p: Parallel, layer: int):
        super().__init__()
        self.kind = a.mixer_blocks[layer]
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = PlainMLP(a, p) if self.kind == "mlp" else NemotronMoe(a, p) if self.kind == "moe" else None
        self.self_attn = (NoMixer() if self.mlp is not None else Attention(a, p, layer) if self.kind == "attention"
                          else Mamba2Mixer(a, p))

    def forward(self, x, cos, sin, meta, q_scale=None):
        h = self.norm(x)
        return x + (self.mlp(h) if self.mlp is not None else self.self_attn(h, cos, sin, meta))


class NemotronHForCausalLM(HybridForCausalLM):
    """Nemotron-H: MixerBlocks; its checkpoint's backbone.* names read as the Llama layout's."""
    NAMES = (("backbone.embeddings.", "model.embed_tokens."), ("backbone.norm_f.", "model.norm."),
             ("backbone.layers.", "model.layers."))

    def make_layer(self, layer: int) -> nn.Module:
        return MixerBlock(self.args, self.p, layer)

    def moe_blocks(self) -> list:
        """(Its MoE layers keep no expert-load record: no SparseMoeBlock to re-plan.)"""
        return []

    def weight_rule(self, name: str):
        for theirs, ours in self.NAMES:
            if name.startswith(theirs):
                name = ours + name[len(theirs):]
                break
        return super().weight_rule(name)

    def _layer_rule(self, prefix: str, rest: str):
        if rest.startswith("norm."):
            return (prefix + rest, 0, None, 0, 0)
        block = self.model.layers[int(prefix.split(".")[2])]
        rest = rest.removeprefix("mixer.")
        if block.kind == "mamba":
            return self._granite_rule(prefix, "mamba." + rest)
        if block.kind == "moe":
            return _nemotron_moe_rule(f"{prefix}mlp.", rest, block.mlp, self.p)
        return LlamaForCausalLM._layer_rule(self, prefix, ("mlp." if block.kind == "mlp" else "self_attn.") + rest)


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
        return [(f"{prefix}conv_weight", offset, _conv_rows(start, size), 0, 0) for offset, start, size in qkv]
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


def _mamba_rule(target: str, part: str, kind: str | None, m: MambaArgs, p: Parallel):
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
            return [(f"{target}conv_weight", o, _conv_rows(s, n), 0, 0) for o, s, n in xbc]
        return [(f"{target}conv_bias", o, 0, s, n) for o, s, n in xbc]
    if part == "out_proj":
        return (f"{target}out_proj.{kind}", 0, 1 if kind == "weight" else None, r * inner, inner)
    if part == "norm":
        return (f"{target}norm_weight", 0, 0, r * inner, inner)
    return (target + part, 0, 0, r * heads, heads)  # dt_bias, A_log, D


def _nemotron_moe_rule(target: str, rest: str, moe: NemotronMoe, p: Parallel):
    """Nemotron 3's MoE tensors: the router and latent projections whole, this rank's share of
    each expert's width (stacked [E, I, dim] / [E, dim, I], or one tensor per expert) and of the
    shared expert's."""
    w, r = moe.experts.up_proj.shape[1], p.tp_rank
    m = re.match(r"experts\.(up_proj|down_proj)$", rest)
    if m:
        if m.group(1) == "up_proj":
            return (f"{target}{rest}", 0, lambda t: t[:, r * w:(r + 1) * w], 0, 0)
        return (f"{target}{rest}", 0, lambda t: t[:, :, r * w:(r + 1) * w], 0, 0)
    m = re.match(r"experts\.(\d+)\.(up_proj|down_proj)\.weight$", rest)
    if m:
        return (f"{target}experts.{m.group(2)}", 0, 0 if m.group(2) == "up_proj" else 1, r * w, w, int(m.group(1)))
    m = re.match(r"shared_experts\.(up_proj|down_proj)\.(weight|bias)$", rest)
    if m:
        ws = moe.shared_experts.down_proj.in_features
        if m.group(1) == "down_proj":
            return (f"{target}{rest}", 0, 1, r * ws, ws)
        return (f"{target}{rest}", 0, 0, r * ws, ws)
    return (target + rest, 0, None, 0, 0)  # gate.weight, gate.e_score_correction_bias, fc1 / fc2_latent_proj


def _conv_rows(start: int, size: int):
    return lambda t: t[start:start + size].reshape(size, -1)
