"""Engine step time with half of a batch of 32 under a JSON-schema constraint vs none.

    .venv/bin/python tests/bench/bench_structured.py [--steps 60] [--vocab 32000]

One process, two engines on the same checkpoint stepped in turn (one with 32 free rows, one
with 16 constrained + 16 free), so the ratio holds on a noisy machine. The checkpoint is the
~20M Llama-style bench model with a byte-level BPE vocabulary of --vocab tokens (trained
here on synthetic words), so the grammar masks are as wide as a real model's. Prints a markdown table for docs/benchmarks.md.
"""
import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from checkpoints import make_checkpoint
from common import BENCH_MODEL, workload

from actors.engine.llm import LLM
from actors.request import EngineRequest
from actors.sampling_params import SamplingParams, StructuredOutput

SCHEMA = {"type": "object", "required": ["rows"], "properties": {"rows": {
    "type": "array", "minItems": 500, "items": {
        "type": "object", "required": ["name", "age", "tags", "ok"], "properties": {
            "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
            "ok": {"type": "boolean"}}}}}}


def big_vocab_tokenizer(size: int):
    """A byte-level BPE of `size` tokens, trained on random syllable words and JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in ["a", "e", "i", "o", "u", "ai", "ou"]]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(60000)]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(20000)]
    lines += [json.dumps({"name": w, "age": i, "ok": i % 2 == 0}) for i, w in enumerate(words[:5000])]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")


def checkpoint(vocab: int, root: str = "/tmp/shoal-bench") -> Path:
    path = Path(root) / f"llama-20m-vocab{vocab}"
    if not (path / "config.json").exists():
        tok = big_vocab_tokenizer(vocab)
        make_checkpoint(path, "llama", init_std=0.05, **{**BENCH_MODEL, "vocab_size": len(tok)})
        for old in path.glob("tokenizer*"):
            old.unlink()
        tok.save_pretrained(path)
        for name in ("config.json", "generation_config.json"):  # the new tokenizer's ids
            config = json.loads((path / name).read_text())
            config["eos_token_id"], config["pad_token_id"] = tok.eos_token_id, tok.pad_token_id
            (path / name).write_text(json.dumps(config))
    return path


def running_batch(llm: LLM, constrained: int, size: int = 32) -> list[str]:
    """`size` decoding sequences, the first `constrained` under SCHEMA; prompts already done."""
    engine, ids = llm.engine, []
    so = StructuredOutput.json_schema(SCHEMA)
    for i, prompt in enumerate(workload(size, 96, 160, seed=1)):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=400, ignore_eos=True,
                                structured=so if i < constrained else None)
        rid = f"r{constrained}-{i}-{time.monotonic_ns()}"
        engine.add_request(EngineRequest(rid, prompt, params))
        ids.append(rid)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()
    return ids


def interleaved_steps(free: LLM, mixed: LLM, steps: int, clock) -> tuple[list, list, float]:
    """Step the two engines in turn, so load on the machine hits both alike; grammar seconds
    are counted in the mixed engine's steps only."""
    ids = running_batch(free, 0), running_batch(mixed, 16)
    free_times, mixed_times, grammar = [], [], 0.0
    for _ in range(steps):
        for llm, times in ((free, free_times), (mixed, mixed_times)):
            clock.seconds = 0.0
            start = time.perf_counter()
            llm.engine.step()
            times.append(time.perf_counter() - start)
            assert len(llm.engine.scheduler.running) == 32, "a sequence finished early"
        grammar += clock.seconds
    for llm, rids in zip((free, mixed), ids):
        for rid in rids:
            llm.engine.abort_request(rid)
    return free_times, mixed_times, grammar / steps


class GrammarClock:
    """Seconds spent in the grammar parts of steps: mask fill, mask apply, matcher advance."""

    def __init__(self):
        import actors.core.scheduler
        import actors.worker.sampler
        import kernels.sampling
        self.seconds = 0.0
        for module, name in ((actors.worker.sampler, "fill_bitmask_after"), (actors.core.scheduler, "accept"),
                             (kernels.sampling, "apply_token_bitmask")):
            setattr(module, name, self.timed(getattr(module, name)))

    def timed(self, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return wrapper


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(checkpoint(args.vocab))
    free, mixed = (LLM(path, max_num_seqs=32, kv_cache_memory=0.6) for _ in range(2))
    start = time.perf_counter()
    mixed.engine.grammars.compile(StructuredOutput.json_schema(SCHEMA))
    compile_s = time.perf_counter() - start
    clock = GrammarClock()
    interleaved_steps(free, mixed, 5, clock)  # warm-up
    free_times, mixed_times, grammar = interleaved_steps(free, mixed, args.steps, clock)
    f, m = statistics.median(free_times), statistics.median(mixed_times)
    vocab = mixed.engine.executor.runner.args.vocab_size
    print(f"| measure (vocab {vocab}, {args.threads} threads, {args.steps} steps) | value | target |")
    print("| --- | --- | --- |")
    print(f"| engine step, batch 32, unconstrained (median) | {f * 1e3:.1f} ms | |")
    print(f"| engine step, batch 32, 16 rows under a JSON schema (median) | {m * 1e3:.1f} ms | |")
    print(f"| slowdown | {100 * (m / f - 1):.1f}% | < 20% |")
    print(f"| grammar work per step (16 masks filled + applied, 16 matchers advanced) | "
          f"{grammar * 1e3:.2f} ms | |")
    print(f"| schema compile (first time, then cached) | {compile_s * 1e3:.0f} ms | |")


if __name__ == "__main__":
    main()
