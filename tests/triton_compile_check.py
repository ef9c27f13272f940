"""Compile every Triton program shoal launches for NVIDIA GPUs, on a machine without one.

The suite runs the Triton kernels under TRITON_INTERPRET=1, which checks their arithmetic but
not that they compile: the interpreter accepts programs the GPU compiler refuses (a dot of the
wrong shape or dtypes, a value of the wrong type in a loop), and the wrappers take other
branches there (bf16 dots run in float32 when interpreted). Device time comes in minutes, so a
program that does not compile must not be found there.

This calls the real wrappers (kernels/triton_attention.py, triton_fused.py, triton_moe.py,
int4_linear.py, quantization.py) with CPU tensors on the shapes the engine launches, with
Triton's launch turned into an ahead-of-time compile (JITFunction's own warm-up, so the
specialisations are the ones a launch makes) for a CUDA target, through Triton's bundled ptxas,
and checks each program's shared memory against the architecture's limit.

    python tests/triton_compile_check.py [--arch 90] [--arch 80] [--quick]

Triton must be imported compiled (TRITON_INTERPRET unset); tests/test_triton_compile.py runs
this in a process of its own. PYTHONPATH=/path/to/another/triton checks another Triton release
(the GPU machine's image has 3.6).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Shared memory a block may opt into, by compute capability (CUDA's occupancy tables).
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


class CompileOnlyDriver:
    """Triton's driver interface as far as a launch's compile needs it: the target, no device."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return self.target.arch  # JITFunction keeps a binder per device, made for its target

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        return self.target


class Recorder:
    """Turns `kernel[grid](...)` into JITFunction.run(..., warmup=True): compile, never launch."""

    def __init__(self) -> None:
        self.compiled: dict[tuple, dict] = {}

    def install(self) -> None:
        from triton.runtime.jit import JITFunction
        recorder = self

        def compile_only(kernel, grid):
            def run(*args, **kwargs):
                start = time.perf_counter()
                compiled = kernel.run(*args, grid=grid, warmup=True, **kwargs)
                meta = compiled.metadata
                key = (kernel.fn.__name__, meta.hash)
                if key not in recorder.compiled:
                    recorder.compiled[key] = dict(name=kernel.fn.__name__, shared=meta.shared,
                                                  warps=meta.num_warps, stages=meta.num_stages,
                                                  seconds=time.perf_counter() - start)
            return run

        JITFunction.__getitem__ = compile_only


def attention_cases(quick: bool):
    """Mixed steps, decode-only steps (the engine's launch), split-KV decode; every option."""
    import torch
    from kernels import kv_quant, triton_attention as ta

    def step(query_lens, keys, heads, kv_heads, d, dtype, block=16, fp8=False, **options):
        tokens = sum(query_lens)
        blocks = max(-(-k // block) for k in keys)
        pool_dtype = kv_quant.FP8 if fp8 else dtype
        k_cache = torch.zeros(blocks * len(keys) * block, kv_heads, d, dtype=pool_dtype)
        tables = torch.arange(blocks * len(keys)).view(len(keys), blocks)
        meta = ta.build_metadata(query_lens, torch.tensor(keys), tables, block, "cpu")
        q = torch.zeros(tokens, heads, d, dtype=dtype)
        ta.paged_attention(q, k_cache, k_cache.clone(), meta, d ** -0.5, k_scale=0.5, v_scale=0.5, **options)

    dtypes = [torch.bfloat16, torch.float32] + ([] if quick else [torch.float16])
    shapes = [(16, 8, 128), (16, 8, 64)] + ([] if quick else [(14, 2, 64), (32, 8, 128), (8, 1, 256),
                                                              (64, 8, 64), (12, 12, 80)])
    for dtype in dtypes:
        for heads, kv_heads, d in shapes:
            step([1] * 4, [40, 17, 64, 3], heads, kv_heads, d, dtype)  # decode-only
            step([5, 1, 33], [70, 9, 33], heads, kv_heads, d, dtype)  # mixed
            step([1, 1], [4096, 700], heads, kv_heads, d, dtype)  # split-KV decode
    for options in [dict(window=32), dict(softcap=30.0), dict(fp8=True), dict(block=32)]:
        fp8 = options.pop("fp8", False)
        block = options.pop("block", 16)
        sinks = torch.zeros(64, dtype=torch.float32) if not options else None
        for query_lens, keys in [([1] * 3, [40, 17, 64]), ([9, 1], [20, 5]), ([1], [3000])]:
            step(query_lens, keys, 64, 8, 64, torch.bfloat16, block=block, fp8=fp8, **options)
            if sinks is not None:  # gpt-oss: sinks with a window
                step(query_lens, keys, 64, 8, 64, torch.bfloat16, window=128, sinks=sinks)


def fused_cases(quick: bool):
    import torch
    from kernels import triton_fused as tf

    for dtype in [torch.bfloat16, torch.float32] + ([] if quick else [torch.float16]):
        for hidden in [1024, 896] + ([] if quick else [4096, 2304]):
            x = torch.zeros(3, hidden, dtype=dtype)
            w = torch.zeros(hidden, dtype=dtype)
            tf.rms_norm(x, w, 1e-6)
            tf.add_rms_norm(x, x.clone(), w, 1e-6, offset=1.0)
            tf.silu_and_mul(torch.zeros(3, 2 * hidden * 4, dtype=dtype))
        for heads, kv_heads, d in [(16, 8, 128), (16, 8, 64)] + ([] if quick else [(8, 4, 256), (14, 2, 64)]):
            for norm in (False, True):
                qkv = torch.zeros(3, (heads + 2 * kv_heads) * d, dtype=dtype)
                cache = torch.zeros(64, kv_heads, d, dtype=dtype)
                cos = torch.zeros(3, d, dtype=torch.float32)
                nw = torch.zeros(d, dtype=dtype) if norm else None
                tf.qk_rope_write(qkv, heads, kv_heads, cos, cos.clone(), torch.arange(3), cache, cache.clone(),
                                 nw, nw, eps=1e-6)


def moe_cases(quick: bool):
    import torch
    from kernels import triton_moe

    for dtype in [torch.bfloat16, torch.float32]:
        for tokens in [3] + ([] if quick else [600]):
            experts, hidden, inter, k = 8, 256, 128, 2
            x = torch.zeros(tokens, hidden, dtype=dtype)
            ids = torch.zeros(tokens, k, dtype=torch.int64)
            weights = torch.zeros(tokens, k, dtype=torch.float32)
            gate_up = torch.zeros(experts, 2 * inter, hidden, dtype=dtype)
            down = torch.zeros(experts, hidden, inter, dtype=dtype)
            triton_moe.grouped_experts(x, weights, ids, gate_up, down)
            triton_moe.grouped_experts(x, weights, ids, gate_up, down, torch.zeros(experts, 2 * inter, dtype=dtype),
                                       torch.zeros(experts, hidden, dtype=dtype), swiglu=(1.702, 7.0))


def quantized_cases(quick: bool):
    import torch
    from kernels import int4_linear, quantization

    n, k = 512, 1024
    for dtype in [torch.bfloat16, torch.float16, torch.float32]:
        for rows in [1, 40] + ([] if quick else [300]):
            x = torch.zeros(rows, k, dtype=dtype)
            for bits in (4, 8):
                per = 32 // bits
                qweight = torch.zeros(k // per, n, dtype=torch.int32)
                qzeros = torch.zeros(k // 128, n // per, dtype=torch.int32)
                scales = torch.zeros(k // 128, n, dtype=dtype)
                g_idx = torch.arange(k, dtype=torch.int32) // 128
                int4_linear.int4_linear(x, qweight, qzeros, scales, g_idx, bits=bits, zero_offset=1,
                                        bias=torch.zeros(n, dtype=dtype))
            for wdtype in (torch.int8, quantization.FP8):
                weight = torch.zeros(n, k, dtype=wdtype)
                quantization.triton_weight_only_linear(x, weight, torch.ones(n), None)
                quantization.triton_weight_only_linear(x, weight, torch.ones(n), torch.zeros(n, dtype=dtype))


CASES = dict(attention=attention_cases, fused=fused_cases, moe=moe_cases, quantized=quantized_cases)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append", help="compute capability x 10 (default: 90)")
    parser.add_argument("--quick", action="store_true", help="the main shapes only")
    parser.add_argument("--only", choices=sorted(CASES), action="append")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("unset TRITON_INTERPRET: this compiles the programs, it does not interpret them")
    import triton
    from triton.runtime import driver

    recorder = Recorder()
    recorder.install()
    failures = 0
    for arch in args.arch or [90]:
        driver.set_active(CompileOnlyDriver(arch))
        recorder.compiled.clear()
        start = time.perf_counter()
        for name in args.only or CASES:
            try:
                CASES[name](args.quick)
            except Exception as error:  # report every family, then fail
                failures += 1
                print(f"FAILED sm_{arch} {name}: {type(error).__name__}: {error}"[:4000], flush=True)
        limit = SHARED_LIMIT.get(arch)
        for entry in recorder.compiled.values():
            over = limit is not None and entry["shared"] > limit
            failures += over
            print(f"{'OVER ' if over else ''}sm_{arch} {entry['name']}: {entry['shared']} B shared, "
                  f"{entry['warps']} warps, {entry['stages']} stages ({entry['seconds']:.1f} s)")
        print(f"sm_{arch}: {len(recorder.compiled)} programs compiled with Triton {triton.__version__} "
              f"in {time.perf_counter() - start:.0f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
