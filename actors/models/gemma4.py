"""Gemma 4 (`Gemma4ForCausalLM`, and `Gemma4ForConditionalGeneration` for its text).

Gemma 3's block (norms before and after each sublayer, sliding and global layers on rotaries
of their own, GeGLU, scaled embeddings, a final logit soft-cap) with:

- Per-layer shapes: the global layers' heads are wider (global_head_dim) and may have fewer KV
  heads, whose values are their keys' projection (attention_k_eq_v: no v_proj); the KV pool
  takes each layer's shape (actors/worker/kv_pool.py). q and k are RMS-normed per head, v too
  (without a weight), and scores are not scaled (the norms set them). Norm weights scale as they
  are (not 1 + w), in float32.
- The proportional rotary on global layers: the whole head's rotate-half, only its lowest
  frequencies turning (kernels/rotary.py).
- KV sharing: the last num_kv_shared_layers layers compute only queries and read the cache of
  the last earlier layer of their kind (its pool slice, aliased).
- Per-layer embeddings (the E2B / E4B models): per token a vector per layer, from a table of its
  own and a projection of the embedding, added at the end of each layer through a small gate.
- An MoE block beside each MLP (the 26B-A4B model): a router on the normed residual (its own
  scale and per-expert scales), GeGLU experts stacked as transformers holds them, each half
  normed before the two are added.

Under tensor parallelism each rank holds its share of the heads, the MLP and the experts' width;
the per-layer embeddings and their gates are replicated. Pipeline parallelism is refused where a
layer reads another's cache or the per-layer embeddings (they are made on the first stage).
"""
from __future__ import annotations

import dataclasses
import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from actors.distributed.parallel import Parallel
from actors.models.args import ModelArgs
from actors.models.layers import ColumnParallelLinear, RowParallelLinear
from actors.models.llama import MLP, LlamaForCausalLM, local_heads
from actors.models.moe import Experts, stacked_columns, stacked_rows
from kernels.activation import gelu_tanh_and_mul, plain_activation
from kernels.attention import AttentionMetadata, paged_attention, write_kv
from kernels.moe import grouped
from kernels.rotary import apply_rotary


GELU_TANH = plain_activation("gelu_tanh")


class Gemma4Norm(nn.Module):
    """RMSNorm scaled by its weight in float32, then cast (a weightless one for the values)."""

    def __init__(self, size: int, eps: float, weight: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size)) if weight else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (xf if self.weight is None else xf * self.weight.float()).to(x.dtype)


class Gemma4Attention(nn.Module):
    nope = scales_q = False  # (what the decoder asks of an attention layer)

    def __init__(self, a: ModelArgs, p: Parallel, layer: int):
        super().__init__()
        g = a.gemma4
        self.d = g.head_dims[layer]
        self.h, self.kvh, _ = local_heads(dataclasses.replace(a, num_kv_heads=g.kv_heads[layer]), p)
        self.kv_source = g.kv_source[layer]
        self.caches_kv = self.kv_source is None
        self.values_are_keys = g.values_are_keys[layer]
        kv_rows = 0 if not self.caches_kv else self.kvh * self.d * (1 if self.values_are_keys else 2)
        self.qkv_proj = ColumnParallelLinear(a.hidden_size, self.h * self.d + kv_rows, a.qkv_bias)
        self.o_proj = RowParallelLinear(self.h * self.d, a.hidden_size, a.o_bias, p)
        self.q_norm = Gemma4Norm(self.d, a.rms_norm_eps)
        self.k_norm = Gemma4Norm(self.d, a.rms_norm_eps) if self.caches_kv else None
        self.v_norm = Gemma4Norm(self.d, a.rms_norm_eps, weight=False)
        self.window = a.layer_windows[layer]
        self.local_rope = self.window is not None  # sliding layers: their own rotary table
        self.k_cache = self.v_cache = None  # this layer's pool slice, or its source layer's
        self.k_scale = self.v_scale = 1.0

    def forward(self, x, cos, sin, meta: AttentionMetadata):
        t, h, kvh, d = x.shape[0], self.h, self.kvh, self.d
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[:, :h * d].view(t, h, d))
        if not self.caches_kv:  # the source layer wrote this step's K/V already
            q = apply_rotary(q, q[:, :1], cos, sin)[0]
            o = paged_attention(q, self.k_cache, self.v_cache, meta, 1.0, window=self.window,
                                k_scale=self.k_scale, v_scale=self.v_scale)
            return self.o_proj(o.reshape(t, h * d))
        k = qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)
        v = k if self.values_are_keys else qkv[:, (h + kvh) * d:].view(t, kvh, d)
        q, k = apply_rotary(q, self.k_norm(k), cos, sin)
        v = self.v_norm(v)
        write_kv(self.k_cache, self.v_cache, meta.slot_mapping, k, v, self.k_scale, self.v_scale)
        o = paged_attention(q, self.k_cache, self.v_cache, meta, 1.0, k, v, self.window,
                            k_scale=self.k_scale, v_scale=self.v_scale)
        return self.o_proj(o.reshape(t, h * d))


class Router(nn.Module):
    """Gemma 4's router: the residual RMS-normed (no weight), scaled by its own weights and
    1 / sqrt(hidden), softmax over the experts, the top k renormalised, each times its expert's scale."""

    def __init__(self, hidden: int, experts: int, top_k: int, eps: float):
        super().__init__()
        self.proj = nn.Linear(hidden, experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(experts))
        self.norm = Gemma4Norm(hidden, eps, weight=False)
        self.top_k = top_k

    def forward(self, x: torch.Tensor):
        h = self.norm(x) * self.scale * self.scale.shape[0] ** -0.5
        probs = torch.softmax(self.proj(h), -1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4Layer(nn.Module):
    """The block, its modules named as the checkpoint names them (q/k/v fused, the rest as is)."""

    def __init__(self, a: ModelArgs, p: Parallel, layer: int):
        super().__init__()
        g, hidden, eps = a.gemma4, a.hidden_size, a.rms_norm_eps
        self.p = p
        self.self_attn = Gemma4Attention(a, p, layer)
        self.mlp = MLP(dataclasses.replace(a, intermediate_size=g.mlp_widths[layer]), p)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, Gemma4Norm(hidden, eps))
        self.router = self.experts = None
        if g.experts:
            count, top_k, width = g.experts
            if width % p.tp_size:
                raise ValueError(f"tensor parallel size {p.tp_size} must divide the expert width ({width})")
            self.router = Router(hidden, count, top_k, eps)
            self.experts = Experts(count, hidden, width // p.tp_size)
            self.post_feedforward_layernorm_1 = Gemma4Norm(hidden, eps)
            self.pre_feedforward_layernorm_2 = Gemma4Norm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma4Norm(hidden, eps)
        if g.ple_dim:
            self.per_layer_input_gate = nn.Linear(hidden, g.ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(g.ple_dim, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4Norm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def forward(self, x, cos, sin, meta, per_layer_input=None):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, meta))
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.experts is not None:
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(self._experts(x))
        x = x + self.post_feedforward_layernorm(h)
        if per_layer_input is not None:
            gate = GELU_TANH(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return x * self.layer_scalar

    def _experts(self, residual: torch.Tensor) -> torch.Tensor:
        """The MoE half: routed on the residual, computed on its own norm; this rank's share of
        every expert's width, summed over the ranks before its norm."""
        weights, ids = self.router(residual)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj

        def ffn(e: int, xs: torch.Tensor) -> torch.Tensor:
            return F.linear(gelu_tanh_and_mul(F.linear(xs, gate_up[e])), down[e])
        y = grouped(self.pre_feedforward_layernorm_2(residual), weights, ids, gate_up.shape[0], ffn)
        return self.p.all_reduce(y)


class Gemma4ForCausalLM(LlamaForCausalLM):
    def __init__(self, args: ModelArgs, max_positions: int, p: Parallel | None = None):
        g = args.gemma4
        if p is not None and p.pp_size > 1 and (g.ple_dim or any(s is not None for s in g.kv_source)):
            raise ValueError("Gemma 4 with per-layer embeddings or KV sharing (E2B, E4B) is not supported with "
                             "pipeline parallelism")
        super().__init__(args, max_positions, p)
        if g.ple_dim and self.p.first_stage:
            n = args.num_layers * g.ple_dim
            self.model.embed_tokens_per_layer = nn.Embedding(g.ple_vocab, n)
            self.model.per_layer_model_projection = nn.Linear(args.hidden_size, n, bias=False)
            self.model.per_layer_projection_norm = Gemma4Norm(g.ple_dim, args.rms_norm_eps)

    def make_layer(self, layer: int) -> nn.Module:
        return Gemma4Layer(self.args, self.p, layer)

    def forward(self, x, positions, meta: AttentionMetadata) -> torch.Tensor:
        a, ple = self.args, None
        if self.p.first_stage:
            ids = x
            x = self.model.embed_tokens(ids) * torch.tensor(a.embed_scale, dtype=self.model.embed_tokens.weight.dtype)
            if a.gemma4.ple_dim:
                ple = self._per_layer_inputs(ids, x)
        tables = {False: (self.rope_cos[positions], self.rope_sin[positions]),
                  True: (self.rope_local_cos[positions], self.rope_local_sin[positions])}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, *tables[layer.self_attn.local_rope], meta, None if ple is None else ple[:, i])
        return self.model.norm(x) if self.p.last_stage else x

    def _per_layer_inputs(self, ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """[T, layers, ple_dim]: each token's own per-layer vectors and a projection of its
        embedding (normed), averaged in the square-root sense (times 1 / sqrt(2))."""
        m, dim = self.model, self.args.gemma4.ple_dim
        table = m.embed_tokens_per_layer
        own = table(ids) * torch.tensor(math.sqrt(dim), dtype=table.weight.dtype)
        projected = m.per_layer_model_projection(embedded) * self.args.hidden_size ** -0.5
        projected = m.per_layer_projection_norm(projected.view(ids.shape[0], -1, dim))
        return (projected + own.view(ids.shape[0], -1, dim)) * 2 ** -0.5

    def _layer_rule(self, prefix: str, rest: str):
        """Rules for this rank's slices: q/k/v into qkv_proj, o_proj's and the MLP's shares, the
        experts' shares of their width; every other tensor whole, under its own name."""
        index = int(prefix.split(".")[2])
        layer, p = self.model.layers[index], self.p
        attn, width = layer.self_attn, layer.mlp.down_proj.in_features
        h, kvh, d = attn.h, attn.kvh, attn.d
        kind = rest.rsplit(".", 1)[-1]
        m = re.match(r"self_attn\.([qkvo])_proj\.(weight|bias)$", rest)
        if m:
            part = m.group(1)
            if part == "o":
                return (prefix + rest, 0, 1 if kind == "weight" else None, p.tp_rank * h * d, h * d)
            if part == "q":
                return (f"{prefix}self_attn.qkv_proj.{kind}", 0, 0, p.tp_rank * h * d, h * d)
            if not attn.caches_kv:
                return None  # (a layer reading another's cache uses no K/V projection of its own)
            kv0 = local_heads(dataclasses.replace(self.args, num_kv_heads=self.args.gemma4.kv_heads[
                self.first_layer + index]), p)[2]
            return (f"{prefix}self_attn.qkv_proj.{kind}", h * d if part == "k" else (h + kvh) * d, 0, kv0 * d, kvh * d)
        if rest.startswith(("self_attn.k_norm", "self_attn.v_norm")) and not attn.caches_kv:
            return None
        mlp = {"mlp.gate_proj": ("mlp.gate_up_proj", 0, 0), "mlp.up_proj": ("mlp.gate_up_proj", width, 0),
               "mlp.down_proj": ("mlp.down_proj", 0, 1)}.get(rest.rsplit(".", 1)[0])
        if mlp:
            return (f"{prefix}{mlp[0]}.{kind}", mlp[1], mlp[2], p.tp_rank * width, width)
        m = re.match(r"experts\.(gate_up_proj|down_proj)$", rest)
        if m:  # every expert, in transformers' own layout: this rank's share of each one's width
            w = layer.experts.down_proj.shape[-1]
            take = stacked_rows if m.group(1) == "gate_up_proj" else stacked_columns
            return [(prefix + rest, 0, take(e, p.tp_rank * w, w), 0, 0, e)
                    for e in range(layer.experts.down_proj.shape[0])]
        return (prefix + rest, 0, None, 0, 0)

    def weight_rule(self, name: str):
        if name.startswith(("model.embed_tokens_per_layer.", "model.per_layer_model_projection.",
                            "model.per_layer_projection_norm.")):
            return (name, 0, None, 0, 0) if self.p.first_stage else None
        return super().weight_rule(name)
