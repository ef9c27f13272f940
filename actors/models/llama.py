"""Llama-family decoder: Llama (GQA, rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

q/k/v and gate/up are fused into one matmul each; `stacked_params` tells the weight loader
where each Hugging Face tensor goes.
"""
from __future__ import annotations

import torch
from torch import nn

from actors.models.args import ModelArgs
from kernels.activation import silu_and_mul
from kernels.attention import AttentionMetadata, paged_attention, write_kv
from kernels.norms import RMSNorm
from kernels.rotary import apply_rotary, cos_sin_cache, inv_frequencies


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.h, self.kvh, self.d = a.num_heads, a.num_kv_heads, a.head_dim
        self.qkv_proj = nn.Linear(a.hidden_size, (self.h + 2 * self.kvh) * self.d, bias=a.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, a.hidden_size, bias=a.o_bias)
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
        o = paged_attention(q, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=a.mlp_bias)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, cos, sin, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # (our fused parameter, Hugging Face's name, which part of it)
    stacked_params = [
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, args: ModelArgs, max_positions: int):
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq = inv_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
        cos, sin = cos_sin_cache(inv_freq, max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for layer in self.model.layers:
            x = layer(x, cos, sin, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def shard_offset(self, param_name: str, part, param: torch.Tensor) -> tuple[int, int]:
        """Row range of `part` inside a fused parameter."""
        a = self.args
        if "qkv_proj" in param_name:
            q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[part]
        half = param.shape[0] // 2
        return part * half, half
