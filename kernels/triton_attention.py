"""Paged attention in Triton: one launch per layer for a whole mixed step (decodes, prefill
chunks, chunks that continue a prefix-cache hit), reading K/V in place from the paged pool.

Each program takes one KV head and up to BLOCK_Q query tokens of one sequence, with that KV
head's query heads packed beside them (BLOCK_M = BLOCK_Q x heads-per-KV-head rows), so a GQA
group reads each key once. It walks the sequence's keys TILE at a time with an online
softmax; each key's slot comes from the block table, so any block size works, and nothing is
gathered or padded. The mask is causal: a query token at position p (its sequence's context
before the step, plus its index in the chunk) sees keys 0..p, or only p - WINDOW < j <= p for a
layer with a sliding window (whose earlier tiles are skipped); SOFTCAP > 0 caps scores to
SOFTCAP * tanh(s / SOFTCAP) (Gemma 2). Attention sinks (gpt-oss: a logit per head that joins
the softmax's denominator) start each row's online softmax as its first "key", one with no
value; split-KV decode adds them once, where the ranges are combined.

A decode-only step with few rows and long contexts would leave most of the GPU idle (a
program per row and KV head): it splits each row's keys into SPLITS ranges instead
(flash-decoding), one program per (row, KV head, range), each writing its partial output and
log-sum-exp; a small torch reduction combines the ranges. `build_metadata` decides from the
host's key counts, so CUDA graphs (whose metadata is static) never split.

Which sequence a program serves is found in the kernel (a binary search over the step's
query offsets, as vLLM's unified attention does), so a step needs no per-program table from
the host: the metadata is the query offsets, each row's key count and the block tables.

An fp8 pool (--kv-cache-dtype fp8, kernels/kv_quant.py) is passed as its bytes (uint8): the
kernels turn each loaded e4m3 byte into float32 by bit arithmetic (no FP8 instructions, so any
GPU and the interpreter run it), times the layer's K or V scale, in q's dtype.

Under TRITON_INTERPRET=1 the same kernel runs on CPU tensors (numpy): that is how the suite
checks it on machines without a GPU (kernels/triton_programs.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import kv_quant, triton_programs
from kernels.host_copies import to_device

TILE = 32  # keys per inner iteration (a power of two, >= 16 for tl.dot)


@dataclass(frozen=True)
class Launch:
    """How the one-launch kernel runs: keys per inner iteration (a power of two, >= 16 for
    tl.dot), and Triton's warps per program and software-pipelining stages (ignored when
    interpreted)."""
    tile: int = TILE
    num_warps: int = 4
    num_stages: int = 3


MIXED = Launch()  # steps with prefill chunks, and decode-only steps of head sizes not in DECODE
# Decode-only steps (what CUDA graphs capture) by head size: memory-bound, so the tile and
# pipelining that keep the most key bytes in flight (tests/bench/bench_gpu_attention.py --sweep).
DECODE: dict[int, Launch] = {}
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
    return TritonMetadata(to_device(starts, device), to_device(seq_lens, device, torch.int32),
                          to_device(block_tables, device, torch.int32), block_size,
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


def _programs():
    return triton_programs.load("triton_attention_programs")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: TritonMetadata, scale: float, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """q: [T, heads, d] -> [T, heads, d]; this step's K/V already written to the pool
    ([num_slots, kv_heads, d] per layer). sinks: [heads] logits or None. k_scale / v_scale:
    an fp8 pool's scales (ignored for a float pool)."""
    fp8 = kv_quant.is_fp8(k_cache)
    if fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    else:
        k_scale = v_scale = 1.0
    tokens, heads, d = q.shape
    kv_heads = k_cache.shape[1]
    qpkv = heads // kv_heads
    block_m = 16 if qpkv <= 16 else 1 << (qpkv - 1).bit_length()
    if meta.splits > 1:
        return _split_decode(q, k_cache, v_cache, meta, scale, window, softcap, qpkv, block_m, sinks,
                             (float(k_scale), float(v_scale)) if fp8 else None)
    block_q = block_m // qpkv
    out = torch.empty_like(q)
    num_seqs = meta.seq_lens.shape[0]
    launch = DECODE.get(d, MIXED) if tokens == num_seqs else MIXED
    grid = (tokens // block_q + num_seqs, kv_heads)
    _programs().attention[grid](
        q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, meta.query_start,
        q if sinks is None else sinks, scale, num_seqs,  # (q: a pointer never read)
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), float(k_scale), float(v_scale),
        QPKV=qpkv, BLOCK_SIZE=meta.block_size, HEAD_DIM=d, HEAD_PAD=max(16, 1 << (d - 1).bit_length()),
        BLOCK_Q=block_q, BLOCK_M=block_m, TILE=launch.tile,
        PRECISION="ieee" if q.dtype == torch.float32 else None,  # float32: no TF32 rounding
        WINDOW=window or 0, SOFTCAP=float(softcap or 0.0), HAS_SINKS=sinks is not None, KV_FP8=fp8, num_warps=launch.num_warps,
        num_stages=launch.num_stages)
    return out


def _split_decode(q, k_cache, v_cache, meta: TritonMetadata, scale: float, window, softcap, qpkv: int,
                  block_m: int, sinks: torch.Tensor | None = None,
                  fp8_scales: tuple[float, float] | None = None) -> torch.Tensor:
    """A decode-only step with its keys split into meta.splits ranges, then the ranges
    combined by their log-sum-exps (ranges with no key weigh nothing; a sink is one more
    range, of no value)."""
    tokens, heads, d = q.shape
    parts = torch.empty(tokens, heads, meta.splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(tokens, heads, meta.splits, dtype=torch.float32, device=q.device)
    _programs().decode_split[(tokens, k_cache.shape[1], meta.splits)](
        q, k_cache, v_cache, parts, lse, meta.block_tables, meta.seq_lens, scale, meta.keys_per_split,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), meta.block_tables.stride(0),
        *(fp8_scales or (1.0, 1.0)), QPKV=qpkv, BLOCK_SIZE=meta.block_size, HEAD_DIM=d, HEAD_PAD=max(16, 1 << (d - 1).bit_length()),
        BLOCK_M=block_m, TILE=TILE, PRECISION="ieee" if q.dtype == torch.float32 else None,
        WINDOW=window or 0, SOFTCAP=float(softcap or 0.0), SPLITS=meta.splits,
        KV_FP8=fp8_scales is not None)
    if sinks is not None:
        lse = torch.cat((lse, sinks.float()[None, :, None].expand(tokens, heads, 1)), dim=-1)
    weights = torch.softmax(lse, dim=-1)[..., :meta.splits]  # each row's first range always has keys
    return (parts * weights[..., None]).sum(dim=2).to(q.dtype)
