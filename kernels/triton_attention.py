"""Paged attention in Triton: one launch per layer for a whole mixed step (decodes, prefill
chunks, chunks that continue a prefix-cache hit), reading K/V in place from the paged pool.

Each program takes one KV head and up to BLOCK_Q query tokens of one sequence, with that KV
head's query heads packed beside them (BLOCK_M = BLOCK_Q x heads-per-KV-head rows), so a GQA
group reads each key once. It walks the sequence's keys TILE at a time with an online
softmax; each key's slot comes from the block table, so any block size works, and nothing is
gathered or padded. The mask is causal: a query token at position p (its sequence's context
before the step, plus its index in the chunk) sees keys 0..p, or only p - WINDOW < j <= p for a
layer with a sliding window (whose earlier tiles are skipped); SOFTCAP > 0 caps scores to
SOFTCAP * tanh(s / SOFTCAP) (Gemma 2).

A decode-only step with few rows and long contexts would leave most of the GPU idle (a
program per row and KV head): it splits each row's keys into SPLITS ranges instead
(flash-decoding), one program per (row, KV head, range), each writing its partial output and
log-sum-exp; a small torch reduction combines the ranges. `build_metadata` decides from the
host's key counts, so CUDA graphs (whose metadata is static) never split.

Which sequence a program serves is found in the kernel (a binary search over the step's
query offsets, as vLLM's unified attention does), so a step needs no per-program table from
the host: the metadata is the query offsets, each row's key count and the block tables.

Under TRITON_INTERPRET=1 the same kernel runs on CPU tensors (numpy): that is how the suite
checks it on machines without a GPU. Triton fixes interpreted or compiled at its own import
(its standard library is jitted then), so the variable must be set before the process imports
Triton: the suite's conftest sets it first thing on machines without CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TILE = 32  # keys per inner iteration (a power of two, >= 16 for tl.dot)
# Split-KV decode: a decode-only step of fewer than SPLIT_ROWS rows splits each row's keys into
# ranges of at least SPLIT_MIN_KEYS, into at most SPLIT_ROWS // rows ranges.
SPLIT_ROWS = 64
SPLIT_MIN_KEYS = 512


@dataclass
class TritonMetadata:
    query_start: torch.Tensor  # [B + 1] int32: each row's first query token in the step
    seq_lens: torch.Tensor  # [B] int32: each row's keys, this step's included
    block_tables: torch.Tensor  # [B, width]: each row's blocks
    block_size: int
    splits: int = 1  # > 1: a decode-only step whose rows' keys are split into this many ranges
    keys_per_split: int = 0  # the keys of each range (a multiple of TILE)


def build_metadata(query_lens: list[int], seq_lens: torch.Tensor, block_tables: torch.Tensor,
                   block_size: int, device) -> TritonMetadata:
    """Each row's new tokens, keys (this step's included; a host tensor) and block table, on
    `device`, and whether the step splits its keys."""
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    return TritonMetadata(starts.to(device), seq_lens.to(device, torch.int32),
                          block_tables.to(device, torch.int32), block_size,
                          *key_splits(query_lens, int(seq_lens.max()) if len(query_lens) else 0))


def key_splits(query_lens: list[int], longest: int) -> tuple[int, int]:
    """(ranges, keys per range) for a step: (1, 0) unless it is a decode-only step of few rows
    with long enough contexts."""
    rows = len(query_lens)
    if not rows or rows >= SPLIT_ROWS or any(n != 1 for n in query_lens):
        return 1, 0
    splits = min(longest // SPLIT_MIN_KEYS, SPLIT_ROWS // rows)
    if splits < 2:
        return 1, 0
    per = -(-longest // splits)
    per = -(-per // TILE) * TILE
    return -(-longest // per), per


_kernel = None  # built on first use


def interpreted() -> bool:
    """Triton runs kernels on CPU tensors through its interpreter (TRITON_INTERPRET=1)."""
    from kernels.env import flag
    return flag("TRITON_INTERPRET", False)


def available() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton") is not None


def _build():
    """The jitted kernel, built on first use."""
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if interpreted() != isinstance(tl.standard.zeros, InterpretedFunction):
            raise RuntimeError("TRITON_INTERPRET was changed after Triton was imported; Triton reads it at "
                               "import, so set it before the process starts")

        @triton.jit
        def attention(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, q_start_ptr, scale, num_seqs,
                      q_stride_t, q_stride_h, kv_stride_s, kv_stride_h, o_stride_t, o_stride_h, table_stride,
                      QPKV: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                      HEAD_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                      TILE: tl.constexpr, PRECISION: tl.constexpr, WINDOW: tl.constexpr,
                      SOFTCAP: tl.constexpr):
            q_block = tl.program_id(0)
            kv_head = tl.program_id(1)
            # The sequence whose query blocks hold q_block: sequence s's start at q_start[s] // BLOCK_Q + s.
            lo = 0
            hi = num_seqs
            while lo < hi:
                mid = (lo + hi) // 2
                if tl.load(q_start_ptr + mid) // BLOCK_Q + mid <= q_block:
                    lo = mid + 1
                else:
                    hi = mid
            seq = lo - 1
            q_start = tl.load(q_start_ptr + seq)
            q_len = tl.load(q_start_ptr + seq + 1) - q_start
            local = q_block - (q_start // BLOCK_Q + seq)
            if local * BLOCK_Q < q_len:
                offs_m = tl.arange(0, BLOCK_M)
                offs_d = tl.arange(0, HEAD_PAD)
                q_pos = local * BLOCK_Q + offs_m // QPKV  # the row's token, within the chunk
                head = kv_head * QPKV + offs_m % QPKV
                row_ok = (q_pos < q_len) & (offs_m < BLOCK_Q * QPKV)
                d_ok = offs_d < HEAD_DIM
                q_rows = (q_start + q_pos).to(tl.int64)
                q = tl.load(q_ptr + q_rows[:, None] * q_stride_t + head[:, None] * q_stride_h + offs_d[None, :],
                            mask=row_ok[:, None] & d_ok[None, :], other=0.0)
                seq_len = tl.load(seq_lens_ptr + seq)
                context = seq_len - q_len
                sees = context + q_pos  # the last key each row sees
                keys = context + tl.minimum((local + 1) * BLOCK_Q, q_len)  # keys this block needs
                m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
                l_i = tl.zeros([BLOCK_M], tl.float32)
                acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
                lo_key = 0
                if WINDOW > 0:  # the block's first row sees nothing before this tile
                    lo_key = tl.maximum(context + local * BLOCK_Q - WINDOW + 1, 0) // TILE * TILE
                for first in range(lo_key, keys, TILE):
                    offs_t = first + tl.arange(0, TILE)
                    t_ok = offs_t < keys
                    block = tl.load(tables_ptr + seq * table_stride + offs_t // BLOCK_SIZE, mask=t_ok, other=0)
                    slot = block.to(tl.int64) * BLOCK_SIZE + offs_t % BLOCK_SIZE
                    k = tl.load(k_ptr + slot[None, :] * kv_stride_s + kv_head * kv_stride_h + offs_d[:, None],
                                mask=t_ok[None, :] & d_ok[:, None], other=0.0)
                    v = tl.load(v_ptr + slot[:, None] * kv_stride_s + kv_head * kv_stride_h + offs_d[None, :],
                                mask=t_ok[:, None] & d_ok[None, :], other=0.0)
                    s = tl.dot(q, k, input_precision=PRECISION) * scale
                    if SOFTCAP > 0:  # tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both ends
                        s = SOFTCAP * (1.0 - 2.0 / (tl.exp(2.0 * s / SOFTCAP) + 1.0))
                    seen = (offs_t[None, :] <= sees[:, None]) & t_ok[None, :]
                    if WINDOW > 0:
                        seen = seen & (offs_t[None, :] > sees[:, None] - WINDOW)
                    s = tl.where(seen, s, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(s, 1))
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
                    p = tl.exp(s - m_safe[:, None])
                    alpha = tl.exp(m_i - m_safe)
                    l_i = l_i * alpha + tl.sum(p, 1)
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                    m_i = m_new
                acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
                tl.store(out_ptr + q_rows[:, None] * o_stride_t + head[:, None] * o_stride_h + offs_d[None, :],
                         acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

        @triton.jit
        def decode_split(q_ptr, k_ptr, v_ptr, part_ptr, lse_ptr, tables_ptr, seq_lens_ptr, scale, keys_per_split,
                         q_stride_t, q_stride_h, kv_stride_s, kv_stride_h, table_stride,
                         QPKV: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HEAD_PAD: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
                         PRECISION: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                         SPLITS: tl.constexpr):
            """One decode row (its token is row `seq` of q), one KV head with its query heads,
            one range of keys: the range's normalised output and log-sum-exp per query head."""
            seq = tl.program_id(0)
            kv_head = tl.program_id(1)
            split = tl.program_id(2)
            offs_m = tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, HEAD_PAD)
            head = kv_head * QPKV + offs_m
            row_ok = offs_m < QPKV
            d_ok = offs_d < HEAD_DIM
            q = tl.load(q_ptr + seq.to(tl.int64) * q_stride_t + head[:, None] * q_stride_h + offs_d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            seq_len = tl.load(seq_lens_ptr + seq)
            sees = seq_len - 1  # the token's own key is the last it sees
            lo_key = split * keys_per_split
            hi_key = tl.minimum(lo_key + keys_per_split, seq_len)
            if WINDOW > 0:
                lo_key = tl.maximum(lo_key, tl.maximum(sees - WINDOW + 1, 0) // TILE * TILE)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
            for first in range(lo_key, hi_key, TILE):
                offs_t = first + tl.arange(0, TILE)
                t_ok = offs_t < hi_key
                block = tl.load(tables_ptr + seq * table_stride + offs_t // BLOCK_SIZE, mask=t_ok, other=0)
                slot = block.to(tl.int64) * BLOCK_SIZE + offs_t % BLOCK_SIZE
                k = tl.load(k_ptr + slot[None, :] * kv_stride_s + kv_head * kv_stride_h + offs_d[:, None],
                            mask=t_ok[None, :] & d_ok[:, None], other=0.0)
                v = tl.load(v_ptr + slot[:, None] * kv_stride_s + kv_head * kv_stride_h + offs_d[None, :],
                            mask=t_ok[:, None] & d_ok[None, :], other=0.0)
                s = tl.dot(q, k, input_precision=PRECISION) * scale
                if SOFTCAP > 0:
                    s = SOFTCAP * (1.0 - 2.0 / (tl.exp(2.0 * s / SOFTCAP) + 1.0))
                seen = t_ok[None, :] & (offs_m[:, None] >= 0)
                if WINDOW > 0:
                    seen = seen & (offs_t[None, :] > sees - WINDOW)
                s = tl.where(seen, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
            acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
            heads = tl.num_programs(1) * QPKV
            part = (seq * heads + head).to(tl.int64) * SPLITS + split  # [B, heads, SPLITS] order
            tl.store(lse_ptr + part, lse, mask=row_ok)
            tl.store(part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])

        _kernel = attention, decode_split
    return _kernel


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: TritonMetadata, scale: float, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q: [T, heads, d] -> [T, heads, d]; this step's K/V already written to the pool
    ([num_slots, kv_heads, d] per layer)."""
    tokens, heads, d = q.shape
    kv_heads = k_cache.shape[1]
    qpkv = heads // kv_heads
    block_m = 16 if qpkv <= 16 else 1 << (qpkv - 1).bit_length()
    if meta.splits > 1:
        return _split_decode(q, k_cache, v_cache, meta, scale, window, softcap, qpkv, block_m)
    block_q = block_m // qpkv
    out = torch.empty_like(q)
    num_seqs = meta.seq_lens.shape[0]
    grid = (tokens // block_q + num_seqs, kv_heads)
    _build()[0][grid](
        q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, meta.query_start, scale, num_seqs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0),
        QPKV=qpkv, BLOCK_SIZE=meta.block_size, HEAD_DIM=d, HEAD_PAD=max(16, 1 << (d - 1).bit_length()),
        BLOCK_Q=block_q, BLOCK_M=block_m, TILE=TILE,
        PRECISION="ieee" if q.dtype == torch.float32 else None,  # float32: no TF32 rounding
        WINDOW=window or 0, SOFTCAP=float(softcap or 0.0))
    return out


def _split_decode(q, k_cache, v_cache, meta: TritonMetadata, scale: float, window, softcap, qpkv: int,
                  block_m: int) -> torch.Tensor:
    """A decode-only step with its keys split into meta.splits ranges, then the ranges
    combined by their log-sum-exps (ranges with no key weigh nothing)."""
    tokens, heads, d = q.shape
    parts = torch.empty(tokens, heads, meta.splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(tokens, heads, meta.splits, dtype=torch.float32, device=q.device)
    _build()[1][(tokens, k_cache.shape[1], meta.splits)](
        q, k_cache, v_cache, parts, lse, meta.block_tables, meta.seq_lens, scale, meta.keys_per_split,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), meta.block_tables.stride(0),
        QPKV=qpkv, BLOCK_SIZE=meta.block_size, HEAD_DIM=d, HEAD_PAD=max(16, 1 << (d - 1).bit_length()),
        BLOCK_M=block_m, TILE=TILE, PRECISION="ieee" if q.dtype == torch.float32 else None,
        WINDOW=window or 0, SOFTCAP=float(softcap or 0.0), SPLITS=meta.splits)
    weights = torch.softmax(lse, dim=-1)  # each row's first range always has keys
    return (parts * weights[..., None]).sum(dim=2).to(q.dtype)
