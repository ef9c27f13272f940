"""Decode throughput on one GPU: shoal's variants against each other, and against vLLM when it
is installed in the same environment (CUDA only; figures in docs/benchmarks.md).

    .venv/bin/python tests/bench/bench_gpu.py [--model-path DIR] [--requests 256] [--output-len 256]
    .venv/bin/python tests/bench/bench_gpu.py --workload nano-vllm [--variants triton]

Without --model-path it builds a ~0.5B-parameter random Llama (hidden 1024, 24 layers,
GQA 16/8 heads) in /tmp; `--workload nano-vllm` builds a random Qwen3-0.6B-shaped checkpoint
(vocab 151,936, 28 layers, hidden 1,024, 16/8 heads of 128) and runs nano-vllm's benchmark
workload (256 sequences, input and output lengths uniform in 100-1024). Every variant runs the
same prompts with ignore_eos in this one process, one after the other; the table gives
tokens/s and the ratio to vLLM (or to the first variant when vLLM is missing). Prints a
markdown table for docs/benchmarks.md.
"""
import argparse
import gc
import random
import time
from pathlib import Path

import torch
from common import make_checkpoint, workload

from actors.engine.llm import LLM
from actors.sampling_params import SamplingParams
from kernels import flash_attention

GPU_MODEL = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=4096, vocab_size=32000, max_position_embeddings=4096)


QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151936, max_position_embeddings=4096)


def gpu_checkpoint(root="/tmp/shoal-bench", workload_name: str = "llama") -> Path:
    arch, shape = ("qwen3", QWEN3_06B) if workload_name == "nano-vllm" else ("llama", GPU_MODEL)
    path = Path(root) / f"{arch}-gpu"
    if not (path / "config.json").exists():
        make_checkpoint(path, arch, init_std=0.05, **shape)
    return path


def shoal_tokens_per_s(path, prompts, out_lens, **options) -> float:
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_num_seqs=256, **options)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return rate


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


VARIANTS = {  # name -> (label, options)
    "native-eager": ("shoal native, eager", dict(attn_backend="native", eager_decode=True)),
    "native-graphs": ("shoal native, CUDA graphs", dict(attn_backend="native", max_seq_len_to_capture=2048)),
    "triton-eager": ("shoal triton, eager", dict(attn_backend="triton", eager_decode=True)),
    "triton-graphs": ("shoal triton, CUDA graphs", dict(attn_backend="triton", max_seq_len_to_capture=2048)),
    "flash-eager": ("shoal flash, eager", dict(attn_backend="flash", eager_decode=True)),
    "flash-graphs": ("shoal flash, CUDA graphs", dict(attn_backend="flash")),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path")
    ap.add_argument("--workload", choices=["llama", "nano-vllm"], default="llama")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="which of VARIANTS (flash where installed)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    path = Path(args.model_path) if args.model_path else gpu_checkpoint(workload_name=args.workload)
    if args.workload == "nano-vllm":  # nano-vllm's bench.py: lengths uniform in 100-1024
        rng = random.Random(0)
        prompts = [[rng.randrange(10000) for _ in range(rng.randint(100, 1024))] for _ in range(args.requests)]
        out_lens = [rng.randint(100, 1024) for _ in range(args.requests)]
        what = "prompts and outputs of 100-1024 tokens (nano-vllm's workload)"
    else:
        prompts = workload(args.requests, 64, 512)
        out_lens = [args.output_len] * args.requests
        what = f"prompts 64-512 tokens, {args.output_len} new tokens each"
    variants = dict(VARIANTS[v] for v in args.variants.split(",")
                    if not v.startswith("flash") or flash_attention.installed())
    rates = {}
    for name, opts in variants.items():
        try:
            rates[name] = shoal_tokens_per_s(path, prompts, out_lens, **opts)
        except Exception as exc:  # noqa: BLE001 - one variant failing must not lose the others' figures
            print(f"{name} failed: {type(exc).__name__}: {exc}", flush=True)
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
