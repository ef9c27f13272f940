"""Mixture of experts: tokens/s at EP=1 vs EP=2 (and TP=2 without EP), and expert-load
balancedness before/after re-planning a skewed workload.

    .venv/bin/python tests/bench/bench_moe.py

The model is a random Mixtral-style checkpoint (hidden 256, 4 layers, 8 experts of width 512,
top-2, vocab 8000, float32). EP=2 runs two ranks (rank 0 here, one Ray shard actor) over gloo.
"""
import os
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
import torch  # noqa: E402
from checkpoints import make_checkpoint  # noqa: E402
from common import workload  # noqa: E402  (sets sys.path for the test helpers)

from actors.engine.llm import LLM  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402

MOE_MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                 intermediate_size=512, num_local_experts=8, num_experts_per_tok=2, vocab_size=8000,
                 max_position_embeddings=1024)
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def moe_checkpoint(root: str = "/tmp/shoal-bench") -> Path:
    path = Path(root) / "mixtral-tiny"
    if not (path / "config.json").exists():
        make_checkpoint(path, "mixtral", init_std=0.05, **MOE_MODEL)
    return path


def tokens_per_second(path, **layout) -> float:
    llm = LLM(str(path), kv_cache_memory=0.5, shard_cpus=1, **layout)
    prompts = workload(16, 32, 128, seed=3)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm up
    start = time.perf_counter()
    outs = llm.generate(prompts, GREEDY)
    rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    llm.shutdown()
    return rate


def replanned_balancedness(path) -> tuple[float, float, bool]:
    """The same skewed workload before and after one re-plan: (before, after, same tokens)."""
    prompts = [[t] * 48 for t in (11, 11, 12, 12)] * 2  # repeated tokens: all route alike
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # one run = 1 prefill step + 15 decode steps; the only re-plan (step 28) falls in the second run
    llm = LLM(str(path), tp_size=2, enable_expert_parallel=True, num_redundant_experts=2,
              eplb_window_size=16, eplb_step_interval=28, enable_prefix_caching=False,
              kv_cache_memory=0.5, shard_cpus=1)
    runs, figures = [], []
    for _ in range(3):
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        figures.append(llm.engine.executor.runner.expert_stats()["balancedness"])
    llm.shutdown()
    return figures[0], figures[2], runs[0] == runs[2]


def main():
    torch.set_num_threads(1)
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False)
    path = moe_checkpoint()
    ep1 = tokens_per_second(path)
    ep2 = tokens_per_second(path, tp_size=2, enable_expert_parallel=True)
    tp2 = tokens_per_second(path, tp_size=2)
    before, after, same = replanned_balancedness(path)
    print("| measure | value |")
    print("| --- | --- |")
    print(f"| tokens/s EP=1 (16 requests x 64 tokens) | {ep1:.0f} |")
    print(f"| tokens/s EP=2 | {ep2:.0f} ({ep2 / ep1:.2f}x of EP=1) |")
    print(f"| tokens/s TP=2, no EP (each expert split by width) | {tp2:.0f} ({tp2 / ep1:.2f}x of EP=1) |")
    print(f"| balancedness, skewed workload, initial placement | {before:.3f} |")
    print(f"| balancedness, same workload after one re-plan (K=2) | {after:.3f} (outputs identical: {same}) |")
    ray.shutdown()


if __name__ == "__main__":
    main()
