"""Paged attention on one GPU: the Triton kernel (kernels/triton_attention.py) against the
native path (gather the blocks, then SDPA: kernels/attention.py) and flash where installed,
for decode batches and prefill / extend chunks, bf16. CUDA only.

    python tests/bench/bench_gpu_attention.py

Each case is timed with CUDA events over 50 calls after 10 warm-ups; the table gives
microseconds per call (one layer), what the Triton kernel's K/V reads come to in GB/s, and the
largest difference between the Triton and native outputs (bf16: ~1e-2 is rounding).
"""
from __future__ import annotations

import dataclasses
import random

import torch

from kernels import flash_attention, triton_attention
from kernels.attention import AttentionMetadata, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16
CASES = [  # (name, rows as (new tokens, context before the step))
    ("decode 256 x 512 keys", [(1, 511)] * 256),
    ("decode 64 x 4,096 keys", [(1, 4095)] * 64),
    ("decode 8 x 16,384 keys", [(1, 16383)] * 8),
    ("prefill 4 x 512 new", [(512, 0)] * 4),
    ("extend 16 x 64 new after 2,048 cached", [(64, 2048)] * 16),
]


def timed(fn, reps: int = 50) -> float:
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def case(rows):
    rng = random.Random(0)
    blocks = sum(-(-(s + n) // BLOCK) for n, s in rows)
    free = list(range(blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(s + n) // BLOCK))] for n, s in rows]
    width = max(map(len, tables))
    table = torch.zeros(len(rows), width, dtype=torch.long)
    for i, t in enumerate(tables):
        table[i, :len(t)] = torch.tensor(t)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM, **kw), torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM, **kw)
    q = torch.randn(sum(n for n, _ in rows), HEADS, HEAD_DIM, **kw)
    lens = [n for n, _ in rows]
    keys = torch.tensor([s + n for n, s in rows])
    tri = triton_attention.build_metadata(lens, keys, table, BLOCK, "cuda")
    nd = sum(n == 1 for n in lens)
    native = AttentionMetadata(torch.zeros(len(q), dtype=torch.long, device="cuda"), nd, BLOCK)
    if nd:
        native.decode_block_tables = table[:nd].cuda()
        native.decode_context_lens = keys[:nd].to("cuda", torch.int32)
    if nd < len(rows):
        offsets = [nd + sum(lens[nd:i]) for i in range(nd, len(rows))]
        native.prefill_chunks = [(o, n, s) for o, (n, s) in zip(offsets, rows[nd:])]
        native.prefill_block_tables = table[nd:].cuda()
    kv_bytes = 2 * int(keys.sum()) * KV_HEADS * HEAD_DIM * 2
    return q, k, v, tri, native, table, keys, lens, nd, kv_bytes


def main():
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_attention.py needs a CUDA device")
    library = flash_attention.installed()
    ops = flash_attention.load(library) if library and BLOCK % flash_attention.block_multiple(library) == 0 else None
    print(f"{torch.cuda.get_device_name(0)}; {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, block {BLOCK}, bf16")
    print("| case | triton (us) | GB/s | native (us) | native / triton | flash (us) | max abs diff |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, rows in CASES:
        q, k, v, tri, native, table, keys, lens, nd, kv_bytes = case(rows)
        t = timed(lambda: triton_attention.paged_attention(q, k, v, tri, HEAD_DIM ** -0.5))
        n = timed(lambda: paged_attention(q, k, v, native, HEAD_DIM ** -0.5))
        f = "-"
        if ops is not None:
            fm = flash_attention.build_metadata(lens, keys.tolist(), table, nd, BLOCK, "cuda", ops)
            f = f"{timed(lambda: flash_attention.paged_attention(q, k, v, fm, HEAD_DIM ** -0.5)):.0f}"
        diff = (triton_attention.paged_attention(q, k, v, tri, HEAD_DIM ** -0.5).float()
                - paged_attention(q, k, v, native, HEAD_DIM ** -0.5).float()).abs().max().item()
        print(f"| {name} | {t:.0f} | {kv_bytes / t / 1e3:.0f} | {n:.0f} | {n / t:.2f} | {f} | {diff:.1e} |",
              flush=True)
    # A decode-only kernel (a program per row and KV head, no query-block search): the split
    # kernel with one range per row, against the one-launch kernel on the same step.
    q, k, v, tri, native, table, keys, lens, nd, kv_bytes = case([(1, 511)] * 256)
    whole = timed(lambda: triton_attention.paged_attention(q, k, v, tri, HEAD_DIM ** -0.5))
    one = dataclasses.replace(tri, splits=1, keys_per_split=-(-512 // triton_attention.TILE) * triton_attention.TILE)
    block_m = 16 if HEADS // KV_HEADS <= 16 else HEADS // KV_HEADS
    split = timed(lambda: triton_attention._split_decode(q, k, v, one, HEAD_DIM ** -0.5, None, None,
                                                         HEADS // KV_HEADS, block_m))
    print(f"decode 256 x 512 keys: one-launch kernel {whole:.0f} us, split kernel with one range per row "
          f"{split:.0f} us ({whole / split:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
