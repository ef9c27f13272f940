"""Engine throughput vs transformers, and engine step overhead vs a bare forward.

    .venv/bin/python tests/bench/bench_engine.py [--requests 64] [--output-len 128]

Everything is measured in this one process on the same checkpoint, so the ratios hold even
on a noisy machine. Prints a markdown table for docs/benchmarks.md.
"""
import argparse
import os
import statistics
import time

from actors.worker.process_tuning import openmp_env  # noqa: E402

os.environ.update(openmp_env())  # as `shoal` sets it (actors/executor/placement.py), before torch loads

import torch  # noqa: E402
from common import bench_checkpoint, workload  # noqa: E402

from actors.engine.llm import LLM  # noqa: E402
from actors.request import EngineRequest  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402


def shoal_throughput(path, prompts, out_len, eager_decode: bool) -> tuple[float, str]:
    """(output tok/s, where the time went); the engine is built (and its decode step compiled)
    before the clock starts."""
    llm = LLM(str(path), max_num_seqs=64, max_num_batched_tokens=2048, kv_cache_memory=2.0,
              eager_decode=eager_decode)
    llm.engine.executor.runner.finish_compiling()  # the compiled step in use before the clock starts
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    steps = {"decode": [0, 0.0], "prefill": [0, 0.0]}  # steps, seconds in ModelRunner.execute
    execute = llm.engine.executor.runner.execute

    def timed_execute(output, previous=None):
        t = time.perf_counter()
        result = execute(output, previous)
        kind = steps["decode" if output.num_decodes == len(output.rows) else "prefill"]
        kind[0] += 1
        kind[1] += time.perf_counter() - t
        return result

    llm.engine.executor.runner.execute = timed_execute
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    elapsed = time.perf_counter() - start
    (nd, td), (np_, tp) = steps["decode"], steps["prefill"]
    split = (f"{np_} steps with prefill {tp:.1f} s, {nd} decode steps {td:.1f} s "
             f"({1e3 * td / max(nd, 1):.0f} ms each), outside the runner {elapsed - td - tp:.1f} s")
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, split


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@torch.inference_mode()
def hf_throughput(model, prompts, out_len, batch) -> float:
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        width = max(map(len, group))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=out_len,
                             min_new_tokens=out_len, pad_token_id=0, eos_token_id=[])
        tokens += (out.shape[1] - width) * len(group)
    return tokens / (time.perf_counter() - start)


@torch.inference_mode()
def step_overhead(path, batch: int, steps: int = 30):
    """Median engine step vs median bare forward on the same decode batch (both eager)."""
    llm = LLM(str(path), max_num_seqs=batch, kv_cache_memory=2.0, eager_decode=True)
    engine = llm.engine
    for i, ids in enumerate(workload(batch, 96, 160, seed=1)):
        engine.add_request(EngineRequest(f"o{i}", ids, SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    step_times, forward_times = [], []
    runner = engine.executor.runner
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t)
        # The next step's batch, timed as a bare forward. Scheduling running sequences twice is
        # harmless: their blocks are already there and nothing was computed.
        output = engine.scheduler.schedule()
        runner.batch.update(output)
        ids, pos, meta = runner.prepare(output)
        t = time.perf_counter()
        hidden = runner.model(ids, pos, meta)
        runner.model.compute_logits(hidden[output.logit_rows])
        forward_times.append(time.perf_counter() - t)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    step, fwd = statistics.median(step_times), statistics.median(forward_times)
    return step, fwd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-single", type=int, default=8, help="requests timed for transformers batch 1")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = bench_checkpoint()
    prompts = workload(args.requests)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    shoal, shoal_split = shoal_throughput(path, prompts, args.output_len, eager_decode=False)
    eager, eager_split = shoal_throughput(path, prompts, args.output_len, eager_decode=True)
    model = hf_model(path)
    hf1 = hf_throughput(model, prompts[:args.hf_single], args.output_len, batch=1)
    hf16 = hf_throughput(model, prompts, args.output_len, batch=16)
    step, fwd = step_overhead(path, batch=32)
    print(f"load average at the start {load}, at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| measure | value | target |")
    print("| --- | --- | --- |")
    print(f"| shoal output tokens/s ({args.requests} requests) | {shoal:.0f} | |")
    print(f"| shoal with --eager-decode | {eager:.0f} tok/s | |")
    print(f"| compiled / eager decode | {shoal / eager:.2f}x | |")
    print(f"| where the time went, compiled | {shoal_split} | |")
    print(f"| where the time went, eager | {eager_split} | |")
    print(f"| transformers generate, batch 1 | {hf1:.0f} tok/s | |")
    print(f"| transformers generate, static batches of 16 | {hf16:.0f} tok/s | |")
    print(f"| shoal / transformers batch 1 | {shoal / hf1:.1f}x | >= 15x |")
    print(f"| shoal / transformers batch 16 | {shoal / hf16:.2f}x | >= 3x |")
    print(f"| engine step at batch 32 (median) | {step * 1e3:.1f} ms | |")
    print(f"| bare forward at batch 32 (median) | {fwd * 1e3:.1f} ms | |")
    print(f"| step overhead over the forward | {100 * (step / fwd - 1):.1f}% | <= 15% |")


if __name__ == "__main__":
    main()
