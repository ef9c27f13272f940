"""Paged attention in plain torch.

The KV cache is a flat pool of slots ([num_slots, kv_heads, head_dim] per layer); a sequence's
keys live in the slots its block table names. Each step the batch is laid out with the
single-token queries (decodes) first, then the multi-token chunks (prefills). Each group
gathers its keys from the pool once and runs one scaled-dot-product attention call, so the
whole batch costs two kernel calls per layer, whatever its mix.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decode_tokens: int  # the first rows are single-token queries
    decode_kv_slots: torch.Tensor | None = None  # [Bd, Ld] slots each decode row attends to
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, Ld] True where a key is valid
    prefill_q_rows: torch.Tensor | None = None  # [Bp, Lq] token rows of each chunk (padded)
    prefill_q_valid: torch.Tensor | None = None  # [Bp, Lq] True for real (not padding) rows
    prefill_kv_slots: torch.Tensor | None = None  # [Bp, Lk]
    prefill_mask: torch.Tensor | None = None  # [Bp, 1, Lq, Lk] causal over the context


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, d] -> [T, heads, d]. K/V of this step must already be written."""
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        out[:nd] = _attend(q[:nd].unsqueeze(1), k_cache, v_cache,
                           meta.decode_kv_slots, meta.decode_mask, scale).squeeze(1)
    if meta.prefill_q_rows is not None:
        rows, valid = meta.prefill_q_rows, meta.prefill_q_valid
        o = _attend(q[rows], k_cache, v_cache, meta.prefill_kv_slots, meta.prefill_mask, scale)
        out[rows[valid]] = o[valid]
    return out


def _attend(q, k_cache, v_cache, slots, mask, scale):
    """q: [B, Lq, h, d]; slots: [B, Lk] -> [B, Lq, h, d]."""
    k = k_cache[slots].transpose(1, 2)  # [B, kvh, Lk, d]
    v = v_cache[slots].transpose(1, 2)
    q = q.transpose(1, 2)  # [B, h, Lq, d]
    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return o.transpose(1, 2)
