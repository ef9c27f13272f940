"""Decode throughput on one GPU: shoal's variants against each other, and against vLLM when it
is installed in the same environment (CUDA only; figures in docs/benchmarks.md).

    .venv/bin/python tests/bench/bench_gpu.py [--model-path DIR] [--requests 256] [--output-len 256]
    .venv/bin/python tests/bench/bench_gpu.py --workload nano-vllm [--variants triton-graphs]
    .venv/bin/python tests/bench/bench_gpu.py --workload moe --variants triton-eager-unfused,triton-eager,triton-graphs
    .venv/bin/python tests/bench/bench_gpu.py --step-profile [--variants triton-graphs-sync,triton-graphs]

Without --model-path it builds a ~0.5B-parameter random Llama (hidden 1024, 24 layers,
GQA 16/8 heads) in /tmp; `--workload nano-vllm` builds a random Qwen3-0.6B-shaped checkpoint
(vocab 151,936, 28 layers, hidden 1,024, 16/8 heads of 128) and runs nano-vllm's benchmark
workload (256 sequences, input and output lengths uniform in 100-1024); `--workload moe` a small
random Qwen3-MoE (MOE_MODEL) on the Llama workload's requests. Every variant runs the
same prompts with ignore_eos, each in a process of its own (--in-process: one after the other
in this one); the table gives
tokens/s and the ratio to vLLM (or to the first variant when vLLM is missing). Prints a
markdown table for docs/benchmarks.md. `--step-profile` instead times decode-only steps at batch
256 against the memory-bandwidth floor and splits one into its host parts and GPU kernels.
With BENCH_PHASES=1 a single variant's run also prints its time by kind of step (prompt-chunk
steps, decode steps by rows).
"""
import argparse
import contextlib
import gc
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import make_checkpoint, workload

from actors.engine.llm import LLM
from actors.sampling_params import SamplingParams
from actors.worker.cuda_graphs import DecodeGraphs
from kernels import flash_attention

GPU_MODEL = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=4096, vocab_size=32000, max_position_embeddings=4096)


QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151936, max_position_embeddings=4096)


# A small Qwen3-MoE: ~0.9 B parameters, ~0.2 B active per token (4 of 32 experts).
MOE_MODEL = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
                 norm_topk_prob=True, vocab_size=32000, max_position_embeddings=4096)


def gpu_checkpoint(root="/tmp/shoal-bench", workload_name: str = "llama") -> Path:
    arch, shape = {"nano-vllm": ("qwen3", QWEN3_06B), "moe": ("qwen3_moe", MOE_MODEL)}.get(
        workload_name, ("llama", GPU_MODEL))
    path = Path(root) / f"{arch}-gpu"
    if not (path / "config.json").exists():
        make_checkpoint(path, arch, init_std=0.05, **shape)
    return path


def shoal_tokens_per_s(path, prompts, out_lens, **options) -> float:
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_num_seqs=256, **options)
    graphs = llm.engine.executor.runner.graphs
    if isinstance(graphs, DecodeGraphs) and not os.environ.get("BENCH_LAZY_GRAPHS"):
        # Every bucket before the timed run, as earlier figures had them (captured at start-up
        # then); the -lazy variants leave them to the run: each captured when its size recurs.
        start = time.perf_counter()
        graphs.capture_all()
        torch.cuda.synchronize()
        print(f"GRAPHS {len(graphs.graphs)} decode buckets captured in {time.perf_counter() - start:.2f} s",
              flush=True)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate(prompts[:32], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))  # warm-up
    torch.cuda.synchronize()
    phases = step_phases(llm.engine) if os.environ.get("BENCH_PHASES") else None
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    if phases is not None:
        print("PHASES " + ", ".join(f"{k}: {n} steps {t:.3f} s ({t / max(n, 1) * 1e3:.2f} ms each)"
                                    for k, (n, t) in phases.items()), flush=True)
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return rate


def step_phases(engine) -> dict:
    """{kind: [calls, seconds]}: engine.step calls timed and sorted by the step they finish
    (mixed: with prompt chunks; decode buckets by rows), filled in as the engine runs."""
    phases, step, record = {}, engine.step, engine.metrics.record_step
    seen = []

    def recorded(output, *args):
        seen.append(output)
        return record(output, *args)

    def timed():
        t = time.perf_counter()
        out = step()
        dt = time.perf_counter() - t
        o = seen.pop() if seen else None
        kind = ("empty" if o is None or not o.rows else "mixed" if o.num_decodes < len(o.rows)
                else f"decode<={1 << (len(o.rows) - 1).bit_length()}")
        n_t = phases.setdefault(kind, [0, 0.0])
        n_t[0] += 1
        n_t[1] += dt
        seen.clear()
        return out
    engine.metrics.record_step = recorded
    engine.step = timed
    return phases


def decode_step_profile(path, name: str, batch: int = 256, prompt_len: int = 512, **options) -> None:
    """Time decode-only steps at `batch` rows against the time an H100 / H200 needs to read the
    weights and the live KV once at its nominal memory bandwidth (the issue's ratio)."""
    from safetensors import safe_open
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_num_seqs=batch, **options)
    rng = random.Random(1)
    for i in range(batch):
        llm.add_request(str(i), [rng.randrange(min(10000, llm.engine.spec.args.vocab_size)) for _ in range(prompt_len)],
                        SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    engine, steps = llm.engine, 0
    while engine.scheduler.waiting or steps < 3 or any(  # until every row is decoding
            s.num_tokens - s.num_computed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
        steps += 1
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    reps, start = 50, time.perf_counter()
    for _ in range(reps):
        engine.step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / reps
    params = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            params += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    a = engine.spec.args
    context = prompt_len + 6 + reps // 2  # the mean context over the timed steps
    kv_bytes = a.num_layers * 2 * a.num_kv_heads * a.head_dim * 2 * context * batch
    bandwidth = 4.8e12 if "H200" in torch.cuda.get_device_name(0) else 3.35e12
    floor = (params * 2 + kv_bytes) / bandwidth
    print(f"{torch.cuda.get_device_name(0)}: {name}: decode step at batch {batch}, context ~{context}: {step_s * 1e3:.2f} ms; "
          f"reading {params / 1e9:.2f} B bf16 weights + {kv_bytes / 1e9:.2f} GB KV at "
          f"{bandwidth / 1e12:.2f} TB/s takes {floor * 1e3:.2f} ms; ratio {step_s / floor:.1f}x", flush=True)
    step_parts(engine)
    llm.shutdown()
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()


def step_parts(engine, reps: int = 20) -> None:
    """Where a decode step's time goes: the host time of engine.step's parts (resolve is the
    wait for the GPU; scheduling ahead, the next step is scheduled and executed before it,
    holding outputs, the previous step's outputs are made before it), then the GPU's own busy
    time."""
    from actors.core.step import RunnerOutput
    parts: dict[str, float] = {}

    def timed(owner, name, label):
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[label] = parts.get(label, 0.0) + (time.perf_counter() - t) / reps
        setattr(owner, name, wrapper)
        return fn

    originals = [(engine.scheduler, "schedule", timed(engine.scheduler, "schedule", "schedule")),
                 (engine.executor, "execute", timed(engine.executor, "execute", "execute")),
                 (engine.processor, "outputs", timed(engine.processor, "outputs", "outputs")),
                 (engine.metrics, "record_step", timed(engine.metrics, "record_step", "metrics")),
                 (engine.scheduler, "advance", timed(engine.scheduler, "advance", "advance")),
                 (engine.scheduler, "settle", timed(engine.scheduler, "settle", "settle")),
                 (RunnerOutput, "resolve", timed(RunnerOutput, "resolve", "resolve (GPU wait)"))]
    start = time.perf_counter()
    for _ in range(reps):
        engine.step()
    torch.cuda.synchronize()
    total = (time.perf_counter() - start) / reps
    for owner, name, fn in originals:
        if owner is RunnerOutput:
            setattr(owner, name, fn)
        else:
            delattr(owner, name)  # the instance attribute hid the class's method
    print(f"  step {total * 1e3:.2f} ms; host parts (ms): "
          + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in parts.items()), flush=True)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    busy = sum(e.self_device_time_total for e in events) / 5 / 1e3
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 5
    print(f"  GPU busy per step: {busy:.2f} ms in {kernels:.0f} kernels; top kernels (ms per step):", flush=True)
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:10]:
        print(f"    {e.self_device_time_total / 5 / 1e3:7.3f}  {e.key[:90]}", flush=True)


def vllm_tokens_per_s(path, prompts, out_lens) -> float | None:
    try:
        from vllm import LLM as VLLM
        from vllm import SamplingParams as VParams
        from vllm.inputs import TokensPrompt
    except ImportError:
        return None
    llm = VLLM(model=str(path), dtype="bfloat16", max_num_seqs=256, gpu_memory_utilization=0.85)
    params = [VParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(requests[:8], VParams(temperature=0, max_tokens=8, ignore_eos=True))
    start = time.perf_counter()
    outs = llm.generate(requests, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


GRAPHS = dict(attn_backend="triton", max_seq_len_to_capture=2048)
VARIANTS = {  # name -> (label, engine options, environment, decode launches by head size)
    "native-eager": ("shoal native, eager", dict(attn_backend="native", eager_decode=True)),
    "native-graphs": ("shoal native, CUDA graphs", dict(attn_backend="native", max_seq_len_to_capture=2048)),
    "triton-eager": ("shoal triton, eager", dict(attn_backend="triton", eager_decode=True)),
    "triton-eager-unfused": ("shoal triton, eager, unfused (torch experts)", dict(attn_backend="triton", eager_decode=True),
                             {"SHOAL_FUSED_KERNELS": "0"}),
    "triton-graphs": ("shoal triton, CUDA graphs", GRAPHS),
    "triton-graphs-lazy": ("shoal triton, CUDA graphs captured as their sizes recur (in the timed run)", GRAPHS,
                           {"BENCH_LAZY_GRAPHS": "1"}),
    "triton-graphs-sync": ("shoal triton, CUDA graphs, no async scheduling", dict(GRAPHS, async_scheduling=False)),
    "triton-graphs-held": ("shoal triton, CUDA graphs, outputs held a step (not scheduled ahead)", GRAPHS,
                           {"SHOAL_SCHEDULE_AHEAD": "0"}),
    "triton-graphs-unfused": ("shoal triton, CUDA graphs, unfused elementwise ops", GRAPHS,
                              {"SHOAL_FUSED_KERNELS": "0"}),
    # The decode launches a sweep on an H200 found fastest per call (docs/benchmarks.md)
    "triton-graphs-tuned": ("shoal triton, CUDA graphs, decode launches by head size", GRAPHS, {},
                            {64: dict(tile=128, num_warps=4, num_stages=3), 128: dict(tile=64, num_warps=4, num_stages=2)}),
    "triton-graphs-fp8": ("shoal triton, CUDA graphs, --quantization fp8", dict(GRAPHS, quantization="fp8")),
    "triton-graphs-int8": ("shoal triton, CUDA graphs, --quantization int8", dict(GRAPHS, quantization="int8")),
    "flash-eager": ("shoal flash, eager", dict(attn_backend="flash", eager_decode=True)),
    "flash-graphs": ("shoal flash, CUDA graphs", dict(attn_backend="flash")),
}


@contextlib.contextmanager
def variant(name: str):
    """The variant's engine options, with its environment and decode launches in force."""
    from kernels import triton_attention
    _, options, env, launches = (*VARIANTS[name], {}, {})[:4]
    saved_env, saved_launches = {k: os.environ.get(k) for k in env}, dict(triton_attention.DECODE)
    os.environ.update(env)
    triton_attention.DECODE.update({d: triton_attention.Launch(**kw) for d, kw in launches.items()})
    try:
        yield options
    finally:
        for k, v in saved_env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        triton_attention.DECODE.clear()
        triton_attention.DECODE.update(saved_launches)


def without_variants(argv: list[str]) -> list[str]:
    """The command line less its --variants (either spelling)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--variants":
            skip = True
        elif not a.startswith("--variants="):
            out.append(a)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path")
    ap.add_argument("--workload", choices=["llama", "nano-vllm", "moe"], default="llama",
                    help="moe: a small random Qwen3-MoE on the llama workload's requests")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="which of VARIANTS (flash where installed)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--step-profile", action="store_true",
                    help="time decode steps at batch 256 against the memory-bandwidth floor, per variant")
    ap.add_argument("--in-process", action="store_true",
                    help="run the variants in this process (else each in its own: see below)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    path = Path(args.model_path) if args.model_path else gpu_checkpoint(workload_name=args.workload)
    if args.step_profile:
        for name in args.variants.split(","):
            try:
                with variant(name) as options:
                    decode_step_profile(path, name, **options)
            except Exception as exc:  # noqa: BLE001
                print(f"{name} step profile failed: {type(exc).__name__}: {exc}", flush=True)
        return
    if args.workload == "nano-vllm":  # nano-vllm's bench.py: lengths uniform in 100-1024
        rng = random.Random(0)
        prompts = [[rng.randrange(10000) for _ in range(rng.randint(100, 1024))] for _ in range(args.requests)]
        out_lens = [rng.randint(100, 1024) for _ in range(args.requests)]
        what = "prompts and outputs of 100-1024 tokens (nano-vllm's workload)"
    else:
        prompts = workload(args.requests, 64, 512)
        out_lens = [args.output_len] * args.requests
        what = f"prompts 64-512 tokens, {args.output_len} new tokens each"
    names = [v for v in args.variants.split(",") if not v.startswith("flash") or flash_attention.installed()]
    rates = {}
    if args.in_process or len(names) == 1:
        for name in names:
            try:
                with variant(name) as options:
                    rates[VARIANTS[name][0]] = shoal_tokens_per_s(path, prompts, out_lens, **options)
            except Exception as exc:  # noqa: BLE001 - one variant failing must not lose the others' figures
                print(f"{name} failed: {type(exc).__name__}: {exc}", flush=True)
            print(f"RATE {name} {rates.get(VARIANTS[name][0], 0.0)}", flush=True)
    else:
        # Each variant in a process of its own: on the H200 the second engine built in one
        # process was up to 23% slower than the same engine built first (docs/benchmarks.md).
        for name in names:
            done = subprocess.run([sys.executable, __file__, *without_variants(sys.argv[1:]), f"--variants={name}"],
                                  capture_output=True, text=True)
            rate = next((float(line.split()[2]) for line in done.stdout.splitlines() if line.startswith("RATE ")), 0.0)
            for line in done.stdout.splitlines():
                if line.startswith("GRAPHS "):
                    print(f"{name}: {line.removeprefix('GRAPHS ')}", flush=True)
            if rate:
                rates[VARIANTS[name][0]] = rate
            else:
                print(f"{name} failed:\n{(done.stdout + done.stderr)[-2000:]}", flush=True)
    if not rates:
        return
    baseline = vllm_tokens_per_s(path, prompts, out_lens)
    if baseline is not None:
        rates["vLLM (same process)"] = baseline
    ref = baseline or next(iter(rates.values()))
    print(f"{torch.cuda.get_device_name(0)}; {args.requests} requests, {what}, bf16, {path.name}")
    print("| engine | tokens/s | ratio |\n| --- | ---: | ---: |")
    for name, rate in rates.items():
        print(f"| {name} | {rate:,.0f} | {rate / ref:.2f} |")


if __name__ == "__main__":
    main()
