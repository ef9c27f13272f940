"""Multi-LoRA cost: tokens/s of a batch of 32 where each row uses one of 8 adapters (rank 16,
every projection), against the same 32 prompts on the base model alone, in one engine.

    .venv/bin/python tests/bench/bench_lora.py [--requests 32] [--adapters 8] [--rank 16]

One engine serves both runs (LoRA on, 8 slots), so the only difference is the adapter delta
of each projection; the runs alternate (base, lora, base, lora, ...) and the best of each is
kept, so a noisy minute hurts both alike. Adapters are loaded into their slots by a warm-up
first (loading is a one-time cost, not throughput). The same comparison is then made on one
decode forward of the 32 rows (model time alone, the two batches alternating, fastest of
--forwards each), which a busy machine disturbs far less. Prints a markdown table.
"""
import argparse
import time
from pathlib import Path

import torch
from common import bench_checkpoint, workload

from actors.core.step import SchedulerOutput, StepRow
from actors.engine.llm import LLM
from actors.sampling_params import SamplingParams


def make_adapters(base: Path, count: int, rank: int, root: Path) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    paths = []
    for i in range(count):
        out = root / f"r{rank}-{i}"
        if not (out / "adapter_config.json").exists():
            model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
            config = LoraConfig(r=rank, lora_alpha=2 * rank, task_type="CAUSAL_LM",
                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                "gate_proj", "up_proj", "down_proj"])
            peft_model = get_peft_model(model, config)
            gen = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for name, param in peft_model.named_parameters():
                    if "lora_" in name:
                        param.copy_(torch.randn(param.shape, generator=gen) * 0.01)
            peft_model.save_pretrained(str(out))
        paths.append(out)
    return paths


def tokens_per_second(llm: LLM, prompts, out_len: int, loras) -> float:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora=loras)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def decode_step(slots: list[int], context: int = 64, block_size: int = 16) -> SchedulerOutput:
    """One decode token per row at position `context`, each row on its own blocks."""
    per_row = context // block_size + 1
    rows = [StepRow([7], context, list(range(i * per_row, (i + 1) * per_row)), s) for i, s in enumerate(slots)]
    return SchedulerOutput(rows, len(rows), list(range(len(rows))))


@torch.inference_mode()
def fastest_forwards(llm: LLM, steps: list[SchedulerOutput], n: int) -> list[float]:
    """Fastest model time (s) of each step over n alternating rounds."""
    best = [float("inf")] * len(steps)
    for _ in range(n):
        for i, step in enumerate(steps):
            start = time.perf_counter()
            llm.engine.executor.runner._forward(step)
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--forwards", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(2)
    base = bench_checkpoint()
    paths = make_adapters(base, args.adapters, args.rank, Path("/tmp/shoal-bench/lora"))
    names = [f"lora{i}" for i in range(args.adapters)]
    llm = LLM(str(base), max_num_seqs=64, max_num_batched_tokens=2048, kv_cache_memory=1.0,
              max_loras=args.adapters, max_lora_rank=args.rank,
              lora_modules=[f"{n}={p}" for n, p in zip(names, paths)])
    prompts = workload(args.requests, lo=16, hi=64)
    loras = [names[i % args.adapters] for i in range(args.requests)]
    llm.generate(prompts[:args.adapters], SamplingParams(max_tokens=2), lora=names)  # load every slot
    base_runs, lora_runs = [], []
    for _ in range(args.repeats):
        base_runs.append(tokens_per_second(llm, prompts, args.output_len, None))
        lora_runs.append(tokens_per_second(llm, prompts, args.output_len, loras))
    b, lo = max(base_runs), max(lora_runs)
    fb, fl = fastest_forwards(llm, [decode_step([-1] * args.requests),
                                    decode_step([i % args.adapters for i in range(args.requests)])],
                              args.forwards)
    print(f"runs base {[round(x) for x in base_runs]} lora {[round(x) for x in lora_runs]}")
    print("| measure | value | target |\n| --- | --- | --- |")
    print(f"| base model, {args.requests} requests (tokens/s, best of {args.repeats}) | {b:.0f} | |")
    print(f"| {args.adapters} adapters of rank {args.rank}, mixed in the batch (tokens/s) | {lo:.0f} | |")
    print(f"| LoRA cost, tokens/s (1 - lora / base) | {100 * (1 - lo / b):.1f}% | < 30% |")
    print(f"| decode forward, batch {args.requests}, base (fastest of {args.forwards}) | {fb * 1e3:.1f} ms | |")
    print(f"| decode forward, batch {args.requests}, {args.adapters} adapters | {fl * 1e3:.1f} ms | |")
    print(f"| LoRA cost, forward (1 - base / lora time) | {100 * (1 - fb / fl):.1f}% | < 30% |")
    llm.shutdown()


if __name__ == "__main__":
    main()
