"""Llama-family decoder: Llama (GQA, rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

q/k/v and gate/up are fused into one matmul each. Under tensor parallelism each rank holds
its share of the heads and of the MLP; under pipeline parallelism each stage holds a slice of
the layers (the first also the embedding, the last the final norm and LM head).
`weight_rule` says where each Hugging Face tensor, or the slice of it this rank needs, goes.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from actors.distributed.parallel import Parallel
from actors.models.args import ModelArgs
from actors.models.layers import (
    ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding, vocab_shard,
)
from kernels.activation import silu_and_mul
from kernels.attention import AttentionMetadata, paged_attention, write_kv
from kernels.norms import RMSNorm
from kernels.rotary import apply_rotary, cos_sin_cache, inv_frequencies


def local_heads(a: ModelArgs, p: Parallel) -> tuple[int, int, int]:
    """(q heads, kv heads, first kv head) on this rank; kv heads are replicated when fewer than ranks."""
    t = p.tp_size
    if a.num_heads % t or a.intermediate_size % t:
        raise ValueError(f"tensor parallel size {t} must divide the attention heads ({a.num_heads}) "
                         f"and the MLP width ({a.intermediate_size})")
    if a.num_kv_heads >= t:
        if a.num_kv_heads % t:
            raise ValueError(f"tensor parallel size {t} must divide the KV heads ({a.num_kv_heads})")
        kvh = a.num_kv_heads // t
        return a.num_heads // t, kvh, p.tp_rank * kvh
    if t % a.num_kv_heads:
        raise ValueError(f"KV heads ({a.num_kv_heads}) must divide the tensor parallel size {t}")
    return a.num_heads // t, 1, p.tp_rank * a.num_kv_heads // t


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, p: Parallel):
        super().__init__()
        self.h, self.kvh, _ = local_heads(a, p)
        self.d = a.head_dim
        self.qkv_proj = ColumnParallelLinear(a.hidden_size, (self.h + 2 * self.kvh) * self.d, a.qkv_bias)
        self.o_proj = RowParallelLinear(self.h * self.d, a.hidden_size, a.o_bias, p)
        self.q_norm = RMSNorm(self.d, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(self.d, a.rms_norm_eps) if a.qk_norm else None
        self.scale = self.d ** -0.5
        self.k_cache = self.v_cache = None  # views into the engine's KV pool, set at start-up

    def forward(self, x, cos, sin, meta: AttentionMetadata):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.h * self.d, self.kvh * self.d, self.kvh * self.d], -1)
        q, k, v = q.view(t, self.h, self.d), k.view(t, self.kvh, self.d), v.view(t, self.kvh, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, cos, sin)
        write_kv(self.k_cache, self.v_cache, meta.slot_mapping, k, v)
        o = paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, k, v)
        return self.o_proj(o.reshape(t, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs, p: Parallel):
        super().__init__()
        width = a.intermediate_size // p.tp_size
        self.gate_up_proj = ColumnParallelLinear(a.hidden_size, 2 * width, a.mlp_bias)
        self.down_proj = RowParallelLinear(width, a.hidden_size, a.mlp_bias, p)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, p: Parallel, mlp: nn.Module):
        super().__init__()
        self.self_attn = Attention(a, p)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, cos, sin, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, a: ModelArgs, p: Parallel, make_mlp):
        super().__init__()
        if p.first_stage:
            self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, p)
        self.layers = nn.ModuleList(DecoderLayer(a, p, make_mlp(i)) for i in p.layers(a.num_layers))
        if p.last_stage:
            self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: ModelArgs, max_positions: int, p: Parallel | None = None):
        super().__init__()
        self.args, self.p = args, p or Parallel()
        self.model = LlamaModel(args, self.p, self.make_mlp)
        self.first_layer = self.p.layers(args.num_layers).start
        if self.p.last_stage:
            self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, self.p)
        cos, sin = cos_sin_cache(inv_frequencies(args.head_dim, args.rope_theta, args.rope_scaling),
                                 max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def make_mlp(self, layer: int) -> nn.Module:
        """The feed-forward block of (global) layer `layer`; MoE models put their experts here."""
        return MLP(self.args, self.p)

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings and self.p.first_stage and self.p.last_stage:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, x, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Token ids (first stage) or hidden states (later stages) -> this stage's output."""
        if self.p.first_stage:
            x = self.model.embed_tokens(x)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for layer in self.model.layers:
            x = layer(x, cos, sin, meta)
        return self.model.norm(x) if self.p.last_stage else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # ---- weight loading -----------------------------------------------------------------
    def weight_rule(self, name: str):
        """(param name, row offset in the param, dim to slice, start, size) or None to skip.

        dim/start/size pick this rank's slice of the checkpoint tensor (dim None: all of it).
        """
        a, p = self.args, self.p
        if "rotary_emb.inv_freq" in name:
            return None
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if m:
            layer = int(m.group(1))
            if layer not in self.p.layers(a.num_layers):
                return None
            return self._layer_rule(f"model.layers.{layer - self.first_layer}.", m.group(2))
        vocab_start, vocab_rows = vocab_shard(a.vocab_size, p)
        rows = min(vocab_rows, a.vocab_size - vocab_start)
        if name == "model.embed_tokens.weight":
            if p.last_stage and a.tie_word_embeddings and not p.first_stage:
                return ("lm_head.weight", 0, 0, vocab_start, rows)
            return ("model.embed_tokens.weight", 0, 0, vocab_start, rows) if p.first_stage else None
        if name == "lm_head.weight":
            return ("lm_head.weight", 0, 0, vocab_start, rows) if p.last_stage else None
        if name.startswith("model.norm."):
            return (name, 0, None, 0, 0) if p.last_stage else None
        return (name, 0, None, 0, 0)

    def _layer_rule(self, prefix: str, rest: str):
        a, p = self.args, self.p
        h, kvh, kv0 = local_heads(a, p)
        d, width = a.head_dim, a.intermediate_size // p.tp_size
        kind = rest.rsplit(".", 1)[-1]  # weight | bias
        row_parallel = 1 if kind == "weight" else None  # their biases stay whole
        rules = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, 0, p.tp_rank * h * d, h * d),
            "self_attn.k_proj": ("self_attn.qkv_proj", h * d, 0, kv0 * d, kvh * d),
            "self_attn.v_proj": ("self_attn.qkv_proj", (h + kvh) * d, 0, kv0 * d, kvh * d),
            "self_attn.o_proj": ("self_attn.o_proj", 0, row_parallel, p.tp_rank * h * d, h * d),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, 0, p.tp_rank * width, width),
            "mlp.up_proj": ("mlp.gate_up_proj", width, 0, p.tp_rank * width, width),
            "mlp.down_proj": ("mlp.down_proj", 0, row_parallel, p.tp_rank * width, width),
        }
        module = rest.rsplit(".", 1)[0]
        if module in rules:
            target, offset, dim, start, size = rules[module]
            return (f"{prefix}{target}.{kind}", offset, dim, start, size)
        return (prefix + rest, 0, None, 0, 0)
