"""Decode throughput on one GPU: shoal's variants against each other, and against vLLM when it
is installed in the same environment (CUDA only; figures in docs/benchmarks.md).

    .venv/bin/python tests/bench/bench_gpu.py [--model-path DIR] [--requests 256] [--output-len 256]

Without --model-path it builds a ~0.5B-parameter random Llama (hidden 1024, 24 layers,
GQA 16/8 heads) in /tmp. Every variant runs the same prompts with ignore_eos in this one
process, one after the other; the table gives tokens/s and the ratio to vLLM (or to shoal
eager when vLLM is missing). Prints a markdown table for docs/benchmarks.md.
"""
import argparse
import gc
import time
from pathlib import Path

import torch
from common import make_checkpoint, workload

from actors.engine.llm import LLM
from actors.sampling_params import SamplingParams
from kernels import flash_attention

GPU_MODEL = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=4096, vocab_size=32000, max_position_embeddings=4096)


def gpu_checkpoint(root="/tmp/shoal-bench") -> Path:
    path = Path(root) / "llama-gpu"
    if not (path / "config.json").exists():
        make_checkpoint(path, "llama", init_std=0.05, **GPU_MODEL)
    return path


def shoal_tokens_per_s(path, prompts, out_len, **options) -> float:
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_num_seqs=256, **options)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
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


def vllm_tokens_per_s(path, prompts, out_len) -> float | None:
    try:
        from vllm import LLM as VLLM
        from vllm import SamplingParams as VParams
        from vllm.inputs import TokensPrompt
    except ImportError:
        return None
    llm = VLLM(model=str(path), dtype="bfloat16", max_num_seqs=256, gpu_memory_utilization=0.85)
    params = VParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(requests[:8], VParams(temperature=0, max_tokens=8, ignore_eos=True))
    start = time.perf_counter()
    outs = llm.generate(requests, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    path = Path(args.model_path) if args.model_path else gpu_checkpoint()
    prompts = workload(args.requests, 64, 512)
    variants = {"shoal native, eager": dict(attn_backend="native", eager_decode=True),
                "shoal native, CUDA graphs": dict(attn_backend="native", max_seq_len_to_capture=1024)}
    if flash_attention.installed():
        variants["shoal flash, eager"] = dict(attn_backend="flash", eager_decode=True)
        variants["shoal flash, CUDA graphs"] = dict(attn_backend="flash")
    rates = {name: shoal_tokens_per_s(path, prompts, args.output_len, **opts) for name, opts in variants.items()}
    baseline = vllm_tokens_per_s(path, prompts, args.output_len)
    if baseline is not None:
        rates["vLLM (same process)"] = baseline
    ref = baseline or rates["shoal native, eager"]
    print(f"{torch.cuda.get_device_name(0)}; {args.requests} requests, prompts 64-512 tokens, "
          f"{args.output_len} new tokens each, bf16")
    print("| engine | tokens/s | ratio |\n| --- | ---: | ---: |")
    for name, rate in rates.items():
        print(f"| {name} | {rate:,.0f} | {rate / ref:.2f} |")


if __name__ == "__main__":
    main()
