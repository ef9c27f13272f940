"""Paged attention in plain torch.

The KV cache is a flat pool of slots ([num_slots, kv_heads, head_dim] per layer), cut into
blocks of `block_size` slots; a sequence's keys live in the blocks its block table names.
Each step the batch is laid out with the single-token queries (decodes) first, then the
multi-token chunks (prefills). The decodes run as one batched call; each prefill chunk runs
its own causal scaled-dot-product attention over exactly its keys (no padding to the longest
chunk, no dense mask): a chunk that starts its sequence attends to the keys it has just
computed, with nothing gathered from the pool; a later chunk (chunked prefill, prefix-cache
hit) gathers its context's blocks. A loop over chunks costs one call per chunk per layer,
nothing per token.

On CPU the decode rows use the native kernel (kernels/native.py, csrc/paged_attention.cpp)
when it is available: it reads K/V straight from the pool instead of gathering a copy. So do
short chunks that continue their sequence (SHORT_CHUNK below), a kernel row per token.
`SHOAL_NATIVE_KERNELS=0` forces the torch path.

With the flash backend (CUDA) the runner sets `meta.flash` and the step goes to
kernels/flash_attention.py instead, on the same pool; with the triton backend `meta.triton`,
and the step goes to kernels/triton_attention.py (one launch for the whole step).

Every backend takes a layer's sliding window (a query at position p sees keys p - window < j
<= p: Mistral, Gemma's local layers) and its score soft-capping (softcap * tanh(s / softcap):
Gemma 2), since both differ from layer to layer. The torch path, the native kernel and Triton
also take attention sinks (gpt-oss): one learned logit per head that joins the softmax's
denominator as a key with no value, so a head can attend to "nothing"; flash-attn has no such
argument, and the backend choice never gives it a model with sinks.

With --kv-cache-dtype fp8 the pool holds float8 e4m3 (kernels/kv_quant.py): `write_kv`
quantises with the layer's K / V scale, and every path here reads stored * scale (the torch
path dequantises what it gathers, the native kernel and Triton convert as they load). Every
chunk then reads its keys from the pool, the ones it has just written included, so all rows
see the same rounded K/V. flash-attn can't read this pool (the backend choice never gives it one).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import flash_attention, kv_quant, native, triton_attention


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decode_tokens: int  # the first rows are single-token queries
    block_size: int = 16
    decode_block_tables: torch.Tensor | None = None  # [Bd, nb] blocks each decode row attends to
    decode_context_lens: torch.Tensor | None = None  # [Bd] int32 keys per decode row
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, nb * block_size] (torch path; else built here)
    prefill_chunks: list[tuple[int, int, int]] | None = None  # (first token row, tokens, first position)
    prefill_block_tables: torch.Tensor | None = None  # [Bp, nb]
    flash: flash_attention.FlashMetadata | None = None  # set: the flash backend runs the step
    triton: triton_attention.TritonMetadata | None = None  # set: the triton backend runs the step
    # Built by the step's first layer: the short continuation chunks as decode-kernel rows
    short_chunks: "ShortChunks | None" = None
    recurrent: "RecurrentRows | None" = None  # set: the model has linear-attention layers


@dataclass
class RecurrentRows:
    """Where a step's sequences keep their linear-attention state (actors/models/hybrid.py): a
    state row each, the input-batch row the sequence holds while it runs."""
    num_decodes: int  # the first rows: one token each
    decode_rows: torch.Tensor  # [num_decodes] their state rows (on the device)
    chunks: list[tuple[int, int, int]]  # the other rows: (first token row, tokens, state row)
    fresh: torch.Tensor | None  # state rows of sequences computed from position 0 this step: reset first


# A chunk that continues its sequence (a prefix-cache hit's last tokens, say) and has at most
# this many tokens goes through the native decode kernel, one row per token, instead of a
# gather of its context and SDPA: with a prefix cache most prompts leave a few tokens to compute,
# and a step of 32 such prompts spent ~15 of its ~60 ms in per-chunk gathers, masks and SDPA
# calls (docs/benchmarks.md). Token i of a chunk at position s attends to s + i + 1 keys, as a
# decode row would; a row re-reads its context once per token, so long chunks stay with SDPA.
SHORT_CHUNK = 16


@dataclass
class ShortChunks:
    rows: torch.Tensor | slice  # their token rows in the step (a slice when contiguous)
    block_tables: torch.Tensor  # [T, nb] each token's sequence's blocks
    context_lens: torch.Tensor  # [T] int32
    rest: list[int]  # indexes of the chunks left to the per-chunk loop


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor | None, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor | None, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """This step's K/V into their slots (v_cache None: MLA's one plane, k only); into an fp8
    pool quantised with the layer's scales."""
    for cache, x, s in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        if cache is None:
            continue
        if kv_quant.is_fp8(cache):  # (index_copy_ has no float8 kernel on CPU: copy the bytes)
            cache.view(torch.uint8).index_copy_(0, slots, kv_quant.quantize(x, s).view(torch.uint8))
        else:
            cache.index_copy_(0, slots, x)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                    window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """q: [T, heads, d] -> [T, heads, d]. K/V of this step must already be written; k/v
    ([T, kv_heads, d], this step's) spare the gather for chunks that start their sequence.
    sinks: [heads] logits, one per query head (None: no sinks). k_scale / v_scale: an fp8
    pool's scales (ignored for a float pool)."""
    fp8 = kv_quant.is_fp8(k_cache)
    if meta.flash is not None:
        if sinks is not None:
            raise ValueError("flash-attn has no attention sinks; the triton or native backend has")
        if fp8:
            raise ValueError("flash-attn can't read an fp8 KV cache; the triton or native backend can")
        return flash_attention.paged_attention(q, k_cache, v_cache, meta.flash, scale, window, softcap)
    if meta.triton is not None:
        return triton_attention.paged_attention(q, k_cache, v_cache, meta.triton, scale, window, softcap, sinks,
                                                k_scale, v_scale)
    if fp8:  # every chunk reads its keys back from the pool, rounded as the decodes see them
        k = v = None
    scales = (k_scale, v_scale) if fp8 else (1.0, 1.0)
    out = q.new_empty(q.shape)
    nd = meta.num_decode_tokens
    # the kernel reads float32 sinks (a handful of numbers per layer)
    native_extra = (window or 0, softcap or 0.0, None if sinks is None else sinks.float().contiguous()) + \
        ((k_scale, v_scale) if fp8 else ())
    if nd:
        op = _native_decode_op(q, k_cache, meta)
        if op is not None:
            op(out[:nd], q[:nd], k_cache, v_cache, meta.decode_block_tables,
               meta.decode_context_lens, meta.block_size, scale, *native_extra)
        else:
            out[:nd] = _attend(q[:nd].unsqueeze(1), k_cache, v_cache, meta.decode_block_tables,
                               meta.block_size, _decode_mask(meta, window), scale, softcap, sinks,
                               scales).squeeze(1)
    chunks = meta.prefill_chunks or []
    todo = range(len(chunks))
    op = _native_decode_op(q, k_cache, meta, prefill=True) if chunks else None
    if op is not None:
        if meta.short_chunks is None:
            meta.short_chunks = _short_chunks(meta)
        _attend_short_chunks(op, q, out, k_cache, v_cache, meta.short_chunks, meta.block_size, scale,
                             native_extra)
        todo = meta.short_chunks.rest
    for i in todo:
        row, n, start = chunks[i]
        if start == 0 and k is not None:
            ki, vi = k[row:row + n], v[row:row + n]
        else:
            nb = -(-(start + n) // meta.block_size)
            table = meta.prefill_block_tables[i:i + 1, :nb]
            ki = gather_blocks(k_cache, table, meta.block_size, q.dtype, scales[0])[0, :start + n]
            vi = gather_blocks(v_cache, table, meta.block_size, q.dtype, scales[1])[0, :start + n]
        out[row:row + n] = _causal(q[row:row + n], ki, vi, start, scale, window, softcap, sinks)
    return out


def _short_chunks(meta: AttentionMetadata) -> ShortChunks:
    """The step's short continuation chunks as decode-kernel rows (once per step, for every layer)."""
    rows, chunk_of, lens, rest = [], [], [], []
    for i, (row, n, start) in enumerate(meta.prefill_chunks):
        if start > 0 and n <= SHORT_CHUNK:
            rows.extend(range(row, row + n))
            chunk_of.extend([i] * n)
            lens.extend(range(start + 1, start + n + 1))
        else:
            rest.append(i)
    contiguous = bool(rows) and rows[-1] - rows[0] == len(rows) - 1
    tables = meta.prefill_block_tables
    return ShortChunks(slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows, device=tables.device),
                       tables[torch.tensor(chunk_of, dtype=torch.long, device=tables.device)],
                       torch.tensor(lens, dtype=torch.int32, device=tables.device), rest)


def _attend_short_chunks(op, q, out, k_cache, v_cache, short: ShortChunks, block_size: int, scale: float,
                         extra: tuple) -> None:
    """The short chunks' tokens through the decode kernel, into their rows of out."""
    if not short.context_lens.numel():
        return
    if isinstance(short.rows, slice):  # the kernel writes straight into out's rows
        op(out[short.rows], q[short.rows], k_cache, v_cache, short.block_tables, short.context_lens,
           block_size, scale, *extra)
        return
    o = q.new_empty((short.context_lens.numel(), *q.shape[1:]))
    op(o, q[short.rows], k_cache, v_cache, short.block_tables, short.context_lens, block_size, scale, *extra)
    out.index_copy_(0, short.rows, o)


def _decode_mask(meta: AttentionMetadata, window: int | None) -> torch.Tensor:
    lens = meta.decode_context_lens
    keys = torch.arange(meta.decode_block_tables.shape[1] * meta.block_size, device=lens.device)
    mask = meta.decode_mask if meta.decode_mask is not None else (keys[None, :] < lens[:, None])[:, None, None, :]
    if window:  # a row's query sits at position len - 1
        mask = mask & (keys[None, :] >= lens[:, None] - window)[:, None, None, :]
    return mask


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
            window: int | None = None, softcap: float | None = None,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One chunk: q [n, h, d] at positions start.. over keys k/v [start + n, kvh, d] -> [n, h, d]."""
    n = q.shape[0]
    q, k, v = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, h, L, d]
    if start == 0 and not window and not softcap and sinks is None:
        # SDPA maps query head i to kv head i // group, copying nothing
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    else:  # query i sees keys start + i - window < j <= start + i
        mask = torch.ones(n, start + n, dtype=torch.bool, device=q.device).tril(start)
        if window:
            mask = mask.triu(start - window + 1)
        o = _sdpa(q, k, v, mask, scale, softcap, None if sinks is None else sinks[:, None, None])
    return o[0].transpose(0, 1)


def _sdpa(q, k, v, mask, scale: float, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over [.., heads, L, d] (k/v may have fewer heads, a GQA group each); by hand when the
    scores are soft-capped or have sinks (shaped to broadcast over the scores' last column),
    which SDPA can't do."""
    gqa = k.shape[-3] != q.shape[-3]
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    if softcap:
        s = torch.tanh((q @ k.transpose(-1, -2)) * (scale / softcap)) * softcap
    else:
        s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(s, -1).to(v.dtype) @ v
    # the sink joins the softmax as one more logit, then is dropped (transformers' gpt-oss eager)
    s = torch.cat((s, sinks.to(s.dtype).expand(*s.shape[:-1], 1)), -1)
    return torch.softmax(s - s.amax(-1, keepdim=True), -1)[..., :-1].to(v.dtype) @ v


_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _native_decode_op(q, k_cache, meta: AttentionMetadata, prefill: bool = False):
    """The native decode kernel when it applies here (CPU, a supported dtype), else None."""
    if (q.device.type != "cpu" or q.dtype not in _NATIVE_DTYPES
            or k_cache.dtype not in (q.dtype, kv_quant.FP8)
            or q.stride(-1) != 1 or k_cache.stride(-1) != 1
            or (meta.prefill_block_tables if prefill else meta.decode_context_lens) is None):
        return None
    return native.paged_decode_attention_op()  # builds or loads it on first use


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                  dtype: torch.dtype | None = None, kv_scale: float = 1.0) -> torch.Tensor:
    """[num_slots, kvh, d] pool -> [B, nb * block_size, kvh, d], whole blocks at a time; an
    fp8 pool's blocks come dequantised (times kv_scale) to `dtype`."""
    b, nb = block_tables.shape
    _, kvh, d = cache.shape
    fp8 = kv_quant.is_fp8(cache)
    blocks = (cache.view(torch.uint8) if fp8 else cache).view(-1, block_size * kvh * d)
    out = blocks.index_select(0, block_tables.reshape(-1)).view(b, nb * block_size, kvh, d)
    return kv_quant.dequantize(out.view(kv_quant.FP8), kv_scale, dtype or torch.float32) if fp8 else out


def _attend(q, k_cache, v_cache, block_tables, block_size, mask, scale, softcap=None, sinks=None,
            scales=(1.0, 1.0)):
    """q: [B, 1, h, d] decode rows; block_tables: [B, nb]; mask [B, 1, 1, Lk]; sinks [h] or
    None -> [B, 1, h, d].

    Grouped-query heads are folded into the query axis ([B, kvh, group, d]: query head i reads
    kv head i // group, as repeat_interleave would), so K/V are never copied per query head:
    on a GPU that copy was ~70% of a decode step (docs/gpu.md)."""
    b, _, h, d = q.shape
    k = gather_blocks(k_cache, block_tables, block_size, q.dtype, scales[0]).transpose(1, 2)  # [B, kvh, Lk, d]
    v = gather_blocks(v_cache, block_tables, block_size, q.dtype, scales[1]).transpose(1, 2)
    q = q.reshape(b, k.shape[1], h // k.shape[1], d)
    if sinks is not None:  # query head i sits at [i // group, i % group], its sink beside it
        sinks = sinks.reshape(k.shape[1], h // k.shape[1], 1)
    o = _sdpa(q, k, v, mask, scale, softcap, sinks)
    return o.reshape(b, 1, h, d)
