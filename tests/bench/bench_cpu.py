"""CPU facts behind the engine's choices (docs/benchmarks.md), one subcommand each.

    .venv/bin/python tests/bench/bench_cpu.py matmul [--threads 1]
        F.linear in float32 vs bfloat16 at the bench model's shapes (is bf16 fast here?)
    .venv/bin/python tests/bench/bench_cpu.py linear [--threads 2]
        float32 linear layers through MKL (F.linear), oneDNN and the AVX-512 panel kernel
        (kernels/linear.py) at one decoder layer's shapes plus the LM head, from 1 to 2048 rows
    .venv/bin/python tests/bench/bench_cpu.py linear-bf16 [--threads 2]
        bfloat16 linear layers through oneDNN and the AVX512-BF16 pairs kernel at a
        Qwen2.5-0.5B layer's shapes and its 151,936-row head, from 1 to 256 rows
    .venv/bin/python tests/bench/bench_cpu.py threads
        a decode step at batch 32 with 1 thread, 2 spinning and 2 passive OpenMP threads,
        each in its own process (the wait policy is read when OpenMP loads)
    .venv/bin/python tests/bench/bench_cpu.py attention [--threads 2]
        the native paged decode attention kernel over 8 layers of float32 K/V (more than the
        L3 cache) at the bench model's shape, as GB/s of K/V read, next to torch's sum of 256 MiB
    .venv/bin/python tests/bench/bench_cpu.py prefill --root CHECKOUT [--threads 1]
        CPU seconds to prefill 3 x 64 prompts of 32-256 tokens with CHECKOUT's engine (run it
        for an older export and this one, alternating, to compare)

Every line printed carries the load average.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # this checkout's engine (prefill --root puts another first)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def median_ms(fn, n: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def matmul(args) -> None:
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(args.threads)
    print(f"oneDNN bf16 kernels: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}; load average {load()}")
    print("| rows x (in -> out) | float32 | bfloat16 | bf16 / f32 time |")
    print("| --- | --- | --- | --- |")
    for rows, (out, inp) in [(32, (1536, 512)), (32, (2048, 512)), (64, (1536, 512)), (256, (2048, 512))]:
        x, w = torch.randn(rows, inp), torch.randn(out, inp)
        xb, wb = x.bfloat16(), w.bfloat16()
        f32 = median_ms(lambda: F.linear(x, w))
        bf16 = median_ms(lambda: F.linear(xb, wb))
        print(f"| {rows} x ({inp} -> {out}) | {f32:.2f} ms | {bf16:.2f} ms | {bf16 / f32:.1f}x |")
    print(f"load average at the end {load()}")


def linear(args) -> None:
    """One llama layer's four projections (the llama.cpp comparison model) and the LM head,
    through MKL (`F.linear`), oneDNN on its packed weight, and the AVX-512 panel kernel on its
    packed weight, interleaved. Eight copies of every weight, used in turn, so each call reads
    its weight from DRAM as in an engine step; the median of 15 passes over the eight."""
    import statistics

    import torch
    import torch.nn.functional as F

    from kernels import linear as L
    from kernels import native
    torch.set_num_threads(args.threads)
    panel = native.panel_linear_op()
    shapes = [(512, 1024), (512, 512), (512, 2304), (1152, 512), (512, 8000)]  # in -> out
    print(f"threads {args.threads}; panel kernel {'built' if panel else 'unavailable (no AVX-512?)'}; "
          f"load average {load()}")
    print("| rows | " + " | ".join(f"{i} -> {o}: oneDNN / panel" for i, o in shapes)
          + " | all: MKL | all: oneDNN | all: panel | panel vs oneDNN |")
    print("| --- " * (len(shapes) + 5) + "|")
    for rows in (1, 2, 8, 32, 64, 256, 2048):
        cells, total = [], {"mkl": 0.0, "onednn": 0.0, "panel": 0.0}
        for inp, out in shapes:
            x = torch.randn(rows, inp)
            ws = [torch.randn(out, inp) * 0.05 for _ in range(8)]
            runs = {"mkl": lambda: [F.linear(x, w) for w in ws]}
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in ws]
            runs["onednn"] = lambda: [L._LINEAR(x, p, None, "none", [], "") for p in packed]
            if panel is not None:
                panels, y = [L.pack_panels(w) for w in ws], torch.empty(rows, out)
                runs["panel"] = lambda: [panel(y, x, p, L._NO_BIAS) for p in panels]
            times = {name: [] for name in runs}
            for _ in range(15):
                for name, run in runs.items():
                    times[name].append(_timed(run) / len(ws))
            t = {name: statistics.median(v) for name, v in times.items()}
            flops = 2 * rows * inp * out
            cells.append(f"{flops / t['onednn'] / 1e9:.0f} / {flops / t['panel'] / 1e9:.0f} GFLOP/s"
                         if "panel" in t else f"{flops / t['onednn'] / 1e9:.0f} GFLOP/s / -")
            for name in t:
                total[name] += t[name]
        ratio = f"**{total['onednn'] / total['panel']:.2f}x**" if total["panel"] else "-"
        print(f"| {rows} | {' | '.join(cells)} | {total['mkl'] * 1e3:.3f} ms | {total['onednn'] * 1e3:.3f} ms "
              f"| {total['panel'] * 1e3:.3f} ms | {ratio} |", flush=True)
    print(f"load average at the end {load()}")


def linear_bf16(args) -> None:
    """A Qwen2.5-0.5B layer's four projections and its LM head in bfloat16, through oneDNN on its
    packed weight and the pairs kernel (csrc/bf16_linear.cpp) on its packed weight, interleaved.
    Eight copies of every layer weight (one of the 272 MB head), used in turn, so each call
    reads its weight from DRAM as in an engine step; the median of 9 passes."""
    import torch

    from kernels import linear as L
    from kernels import native, packed_weights
    torch.set_num_threads(args.threads)
    op = native.bf16_linear_op()
    if op is None:
        raise SystemExit("the pairs kernel is unavailable here (no AVX512-BF16, AMX, or no compiler)")
    shapes = {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896), "head": (896, 151936)}
    print(f"threads {args.threads}; load average {load()}")
    print("| rows | " + " | ".join(f"{n} oneDNN / pairs" for n in shapes) + " | layer: pairs vs oneDNN | head |")
    print("| --- " * (len(shapes) + 3) + "|")
    empty = torch.empty(0, dtype=torch.bfloat16)
    for rows in (1, 2, 8, 32, 64, 256):
        cells, t = [], {}
        for name, (inp, out) in shapes.items():
            x = torch.randn(rows, inp).bfloat16()
            ws = [(torch.randn(out, inp) * 0.05).bfloat16() for _ in range(1 if name == "head" else 8)]
            onednn = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in ws]
            pairs, y = [packed_weights.pairs(w) for w in ws], torch.empty(rows, out, dtype=torch.bfloat16)
            runs = {"onednn": lambda: [L._LINEAR(x, p, None, "none", [], "") for p in onednn],
                    "pairs": lambda: [op(y, x, p, empty) for p in pairs]}
            times = {k: [] for k in runs}
            for _ in range(9):
                for k, run in runs.items():
                    times[k].append(_timed(run) / len(ws))
            t[name] = {k: statistics.median(v) for k, v in times.items()}
            macs = rows * inp * out
            cells.append(f"{macs / t[name]['onednn'] / 1e9:.0f} / {macs / t[name]['pairs'] / 1e9:.0f} GMAC/s")
        layer = {k: sum(t[n][k] for n in shapes if n != "head") for k in ("onednn", "pairs")}
        print(f"| {rows} | {' | '.join(cells)} | **{layer['onednn'] / layer['pairs']:.2f}x** | "
              f"{t['head']['onednn'] / t['head']['pairs']:.2f}x |", flush=True)
    print(f"load average at the end {load()}")


def attention(args) -> None:
    """The decode kernel's K/V read rate, the default path (AVX-512 or AVX2 where the CPU has it) and
    the portable loop in the same run, against torch's sum of a DRAM-sized tensor."""
    import torch

    from kernels import native
    torch.set_num_threads(args.threads)
    kernels = {"default": native.paged_decode_attention_op(),
               "portable": torch.ops.shoal.paged_decode_attention_portable.default}
    heads, d, bs, layers = 8, 64, 16, 8
    big = torch.randn(64 * 2**20)  # 256 MiB: summing it reads from DRAM
    read_s = min(_timed(big.sum) for _ in range(5))
    print(f"threads {args.threads}; torch sum of 256 MiB reads {big.numel() * 4 / read_s / 1e9:.1f} GB/s; "
          f"load average {load()}")
    print("| dtype | batch x context | K/V read (8 layers) | default | portable | GB/s default / portable | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for dtype in (torch.float32, torch.bfloat16):
        for batch, ctx in [(32, 100), (32, 300), (64, 300)]:
            per_row = -(-ctx // bs)
            slots = (batch * per_row + 1) * bs
            caches = [(torch.randn(slots, heads, d).to(dtype), torch.randn(slots, heads, d).to(dtype))
                      for _ in range(layers)]
            tables = torch.randperm(batch * per_row).view(batch, per_row)  # scattered blocks
            q, lens = torch.randn(batch, heads, d).to(dtype), torch.full((batch,), ctx, dtype=torch.int32)
            out = torch.empty_like(q)
            times = {}
            for name, op in kernels.items():
                run = lambda: [op(out, q, k, v, tables, lens, bs, d ** -0.5) for k, v in caches]  # noqa: E731
                run()
                times[name] = min(_timed(run) for _ in range(10))
            read = layers * 2 * batch * ctx * heads * d * dtype.itemsize
            t, tp = times["default"], times["portable"]
            print(f"| {str(dtype)[6:]} | {batch} x {ctx} | {read / 2**20:.0f} MiB | {t * 1e3:.1f} ms | {tp * 1e3:.1f} ms "
                  f"| {read / t / 1e9:.1f} / {read / tp / 1e9:.1f} | {tp / t:.2f}x |")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_step(args) -> None:
    """(child) median decode step at batch 32 after the prefill."""
    import torch
    from common import bench_checkpoint, workload

    from actors.engine.llm import LLM
    from actors.request import EngineRequest
    from actors.sampling_params import SamplingParams
    torch.set_num_threads(args.threads)
    llm = LLM(str(bench_checkpoint()), max_num_seqs=32, kv_cache_memory=1.0, num_threads=args.threads)
    engine = llm.engine
    for i, ids in enumerate(workload(32, 32, 128, seed=1)):
        params = SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)
        engine.add_request(EngineRequest(f"o{i}", ids, params))
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()
    times = []
    for _ in range(30):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    print(f"{statistics.median(times) * 1e3:.0f}")


def threads(args) -> None:
    settings = [("1 thread", 1, {}), ("2 threads, libgomp default (spin)", 2, {}),
                ("2 threads, GOMP_SPINCOUNT=10000", 2, {"GOMP_SPINCOUNT": "10000"}),
                ("2 threads, OMP_WAIT_POLICY=PASSIVE", 2, {"OMP_WAIT_POLICY": "PASSIVE"}),
                ("2 threads, PASSIVE + GOMP_SPINCOUNT=10000 (shoal's default)", 2,
                 {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"})]
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    print("| setting | median decode step, batch 32 (per pass) | load average at the start |")
    print("| --- | --- | --- |")
    for name, n, env in settings:
        results, before = [], load()
        for _ in range(args.passes):
            out = subprocess.run([sys.executable, __file__, "decode-step", "--threads", str(n)],
                                 env={**base, **env}, capture_output=True, text=True, check=True)
            results.append(out.stdout.strip().splitlines()[-1] + " ms")
        print(f"| {name} | {' / '.join(results)} | {before} |", flush=True)


def prefill(args) -> None:
    sys.path.insert(0, str(args.root))
    import torch
    from common import bench_checkpoint, workload

    from actors.engine.llm import LLM
    from actors.request import EngineRequest
    from actors.sampling_params import SamplingParams
    torch.set_num_threads(args.threads)
    llm = LLM(str(bench_checkpoint()), max_num_seqs=64, kv_cache_memory=1.0, max_num_batched_tokens=2048)
    engine, seconds = llm.engine, []
    for rep in range(3):
        for i, ids in enumerate(workload(64, 32, 256, seed=3 + rep)):
            params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            engine.add_request(EngineRequest(f"o{rep}-{i}", ids, params))
        start = time.process_time()
        while engine.has_unfinished():
            engine.step()
        seconds.append(time.process_time() - start)
    print(f"{args.root}: prefill CPU seconds {' / '.join(f'{s:.2f}' for s in seconds)}; load average {load()}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["matmul", "linear", "linear-bf16", "threads", "prefill", "decode-step", "attention"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--root", type=Path, default=HERE.parents[1])
    args = ap.parse_args()
    {"matmul": matmul, "linear": linear, "linear-bf16": linear_bf16, "threads": threads, "prefill": prefill, "decode-step": decode_step,
     "attention": attention}[args.what](args)


if __name__ == "__main__":
    main()
