"""Paged decode attention: the native CPU kernel vs the torch path (gather + SDPA).

    .venv/bin/python tests/bench/bench_paged_attention.py [--threads 2] [--steps 20]

Both variants run in this one process, interleaved (native, torch, native, ...), and the
ratios of medians are reported, so they hold on a noisy machine. The torch path is selected
by SHOAL_NATIVE_KERNELS=0, which kernels/attention.py reads on every call.
Prints markdown rows for docs/benchmarks.md.
"""
import argparse
import os
import statistics
import time

import torch
from common import BENCH_MODEL, bench_checkpoint, workload

from actors.engine.llm import LLM
from actors.request import EngineRequest
from actors.sampling_params import SamplingParams
from kernels import native
from kernels.attention import AttentionMetadata, paged_attention


def interleaved(fns: dict, reps: int) -> dict:
    """Median seconds of each callable, run round-robin so noise hits all of them alike."""
    times = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def with_native(flag: bool, fn):
    def run():
        os.environ["SHOAL_NATIVE_KERNELS"] = "1" if flag else "0"
        return fn()
    return run


def attention_alone(batch=64, ctx=300, heads=8, kv_heads=8, d=64, block_size=16, reps=30):
    nb = -(-ctx // block_size)
    num_blocks = batch * nb + 8
    k_cache = torch.randn(num_blocks * block_size, kv_heads, d)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks)[:batch * nb].view(batch, nb)  # scattered, like a busy pool
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    mask = (torch.arange(nb * block_size)[None, :] < lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(slot_mapping=torch.zeros(batch, dtype=torch.long), num_decode_tokens=batch,
                             block_size=block_size, decode_block_tables=tables, decode_context_lens=lens,
                             decode_mask=mask)
    q = torch.randn(batch, heads, d)
    call = lambda: paged_attention(q, k_cache, v_cache, meta, d ** -0.5)  # noqa: E731
    fns = {"native": with_native(True, call), "torch": with_native(False, call)}
    for f in fns.values():
        f()  # warm-up (and the native build / cache load)
    torch.testing.assert_close(fns["native"](), fns["torch"](), rtol=0, atol=1e-5)
    return interleaved(fns, reps)


@torch.inference_mode()
def engine_decode_step(path, batch=64, ctx=300, steps=20):
    """Median engine.step() at `batch` running decodes of ~ctx tokens, native vs torch."""
    llm = LLM(str(path), max_num_seqs=batch, max_num_batched_tokens=4096, kv_cache_memory=2.0)
    engine = llm.engine
    for i, ids in enumerate(workload(batch, ctx - 8, ctx + 8, seed=3)):
        params = SamplingParams(temperature=0, max_tokens=4 * steps + 8, ignore_eos=True)
        engine.add_request(EngineRequest(f"b{i}", ids, params))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    fns = {"native": with_native(True, engine.step), "torch": with_native(False, engine.step)}
    for f in fns.values():
        f()
    result = interleaved(fns, steps)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    assert native.paged_decode_attention_op() is not None, "native kernel did not build"
    print(f"native kernel load: {time.perf_counter() - t:.1f} s (build or cache hit)\n")
    h = BENCH_MODEL["num_attention_heads"]
    d = BENCH_MODEL["hidden_size"] // h
    print("| measure | native | torch path | speedup |")
    print("| --- | --- | --- | --- |")
    for kvh in (BENCH_MODEL["num_key_value_heads"], 2):
        r = attention_alone(heads=h, kv_heads=kvh, d=d, reps=args.reps)
        print(f"| decode attention, batch 64, ctx 300, {h} heads / {kvh} kv heads, d {d} (one layer) "
              f"| {r['native'] * 1e3:.1f} ms | {r['torch'] * 1e3:.1f} ms | {r['torch'] / r['native']:.2f}x |")
    r = engine_decode_step(bench_checkpoint(), steps=args.steps)
    print(f"| engine decode step, batch 64, ctx ~300, 20M model (8 layers) "
          f"| {r['native'] * 1e3:.1f} ms ({64 / r['native']:.0f} tok/s) "
          f"| {r['torch'] * 1e3:.1f} ms ({64 / r['torch']:.0f} tok/s) | {r['torch'] / r['native']:.2f}x |")


if __name__ == "__main__":
    main()
