"""DeepSeek-V2 / V3 (and V3.2, GLM-4.7-Flash, GLM-5, Mistral 4): multi-head latent attention (MLA) on
the MoE decoder.

Each token caches one latent vector (kv_lora_rank wide, after its norm) and one rotary key
(rope_dim) shared by every head: [latent | rope key] is the whole cache entry, one "KV head"
of kv_lora_rank + rope_dim channels and one plane (ModelArgs.kv_planes), where a same-size
GQA model caches 2 x kv_heads x head_dim.

Attention runs on the cache as it is, with kv_b_proj absorbed (DeepSeek-V2's paper, vLLM's
and SGLang's MLA decode): a head's key is W_uk[h] @ latent, so q_nope . key = (W_uk[h]^T q_nope)
. latent. Each query head is turned into latent space ([W_uk^T q_nope | rotated q_rope]) and
attends over the cache entries as multi-query attention whose values are the entries
themselves; the first kv_lora_rank channels of the result, through W_uv[h], are the head's
output. The same paged-attention kernels serve MLA and GQA, for prefill and decode alike.

Under tensor parallelism each rank holds its share of the heads (q_b_proj's and kv_b_proj's
rows, o_proj's columns); the latent projection and the cache are replicated.
"""
from __future__ import annotations

import torch
from torch import nn

from actors.distributed.parallel import Parallel
from actors.models.args import ModelArgs
from actors.models.layers import ColumnParallelLinear, RowParallelLinear
from actors.models.moe import MoeForCausalLM
from kernels.attention import AttentionMetadata, paged_attention, write_kv
from kernels.norms import RMSNorm
from kernels.rotary import apply_rotary


class LatentAttention(nn.Module):
    def __init__(self, a: ModelArgs, p: Parallel):
        super().__init__()
        m = a.mla
        if a.num_heads % p.tp_size:
            raise ValueError(f"tensor parallel size {p.tp_size} must divide the attention heads ({a.num_heads})")
        self.h, self.kvh, self.d = a.num_heads // p.tp_size, 1, a.head_dim  # d: the cached entry's width
        self.m, self.scale, self.interleaved = m, a.attn_scale, a.rope.interleaved
        self.local_rope = self.nope = False  # one rotary table for every layer
        self.scales_q = a.q_position_scale is not None  # Mistral 4: queries scaled by position
        qk = m.nope_dim + m.rope_dim
        if m.q_lora_rank:
            self.q_a_proj = ColumnParallelLinear(a.hidden_size, m.q_lora_rank, a.qkv_bias)  # replicated
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, a.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, self.h * qk, False)
        else:
            self.q_proj = ColumnParallelLinear(a.hidden_size, self.h * qk, False)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(a.hidden_size, m.kv_lora_rank + m.rope_dim, a.qkv_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, a.rms_norm_eps)
        # Never multiplied as a linear layer: its per-head blocks are absorbed (above), so it
        # stays a plain weight (int8 quantization leaves it float too).
        self.kv_b_proj = nn.Module()
        self.kv_b_proj.weight = nn.Parameter(torch.empty(self.h * (m.nope_dim + m.v_dim), m.kv_lora_rank))
        self.o_proj = RowParallelLinear(self.h * m.v_dim, a.hidden_size, a.o_bias, p)
        self.k_cache = self.v_cache = None  # one plane of the engine's KV pool (both names, one tensor)
        self.k_scale = self.v_scale = 1.0  # an fp8 pool's scale: one plane, so k_scale serves both

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.m.q_lora_rank:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def forward(self, x, cos, sin, meta: AttentionMetadata, q_scale: torch.Tensor | None = None):
        """q_scale: [T] per-token factors on the queries (Mistral 4)."""
        m, t, h = self.m, x.shape[0], self.h
        q_nope, q_rope = self._query(x).view(t, h, m.nope_dim + m.rope_dim).split([m.nope_dim, m.rope_dim], -1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.rope_dim], -1)
        q_rope, k_rope = apply_rotary(q_rope, k_rope.view(t, 1, m.rope_dim), cos, sin, self.interleaved)
        entry = torch.cat([self.kv_a_layernorm(latent).view(t, 1, m.kv_lora_rank), k_rope], -1)  # [t, 1, d]
        write_kv(self.k_cache, None, meta.slot_mapping, entry, None, self.k_scale)
        w_uk, w_uv = self.kv_b_proj.weight.view(h, m.nope_dim + m.v_dim, m.kv_lora_rank).split(
            [m.nope_dim, m.v_dim], 1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [t, h, kv_lora_rank]
        q = torch.cat([q_latent, q_rope], -1)
        if q_scale is not None:
            q = q * q_scale[:, None, None]
        o = paged_attention(q, self.k_cache, self.k_cache, meta, self.scale, entry, entry,
                            k_scale=self.k_scale, v_scale=self.k_scale)
        o = torch.bmm(o[..., :m.kv_lora_rank].transpose(0, 1), w_uv.transpose(1, 2))  # [h, t, v_dim]
        return self.o_proj(o.transpose(0, 1).reshape(t, h * m.v_dim))


class DeepseekForCausalLM(MoeForCausalLM):
    def make_attention(self, layer: int) -> nn.Module:
        return LatentAttention(self.args, self.p)

    def _layer_rule(self, prefix: str, rest: str):
        if rest.startswith("self_attn.indexer."):  # V3.2's key picker: a no-op at the lengths served
            return None
        if not rest.startswith("self_attn."):
            return super()._layer_rule(prefix, rest)
        m, p = self.args.mla, self.p
        h = self.args.num_heads // p.tp_size
        module, kind = rest.rsplit(".", 1)
        heads = {  # this rank's heads: rows of the query and kv_b projections, columns of o_proj
            "self_attn.q_proj": (0, h * (m.nope_dim + m.rope_dim)),
            "self_attn.q_b_proj": (0, h * (m.nope_dim + m.rope_dim)),
            "self_attn.kv_b_proj": (0, h * (m.nope_dim + m.v_dim)),
            "self_attn.o_proj": (1, h * m.v_dim),
        }
        if module not in heads or (module == "self_attn.o_proj" and kind == "bias"):
            return (prefix + rest, 0, None, 0, 0)  # replicated: the latent projections, norms, o_proj's bias
        dim, size = heads[module]
        return (prefix + rest, 0, dim, p.tp_rank * size, size)
