"""Benchmark prompts: synthetic ones of a given length, or read from a JSONL file.

A `BenchPrompt` is either text (`prompt`) or chat `messages`, with its output budget.
Synthetic text is random common words (about one token each for BPE vocabularies), one
random draw per prompt so a prefix cache can't turn the run into a cache benchmark; the
exact token counts come back in each response's usage and are what the report uses.
"""
from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

WORDS = ("the quick brown fox jumps over lazy dog a small boat drifted across quiet bay while "
         "fishermen mended their nets and talked about weather price of fuel long winter ahead "
         "nobody expected storm to arrive so early in season server answered questions all day "
         "it read every request carefully thought wrote back one token at time when many people "
         "asked once grouped into batches worked faster fish move together as if they were "
         "animal").split()


@dataclass
class BenchPrompt:
    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int = 128

    def as_messages(self) -> list[dict]:
        return self.messages or [{"role": "user", "content": self.prompt}]

    def as_text(self) -> str:
        if self.prompt is not None:
            return self.prompt
        return "\n".join(str(m.get("content", "")) for m in self.messages)


def synthetic(input_len: int, output_len: int, seed: int):
    """An endless supply of prompts of `input_len` random words."""
    rng = random.Random(seed)
    while True:
        yield BenchPrompt(prompt=" ".join(rng.choices(WORDS, k=input_len)), max_tokens=output_len)


def from_jsonl(path: str | Path, output_len: int):
    """Prompts of a JSONL file, cycled: each line has `prompt` (or `text`) or chat `messages`,
    and optionally its own `max_tokens` (or `output_len`)."""
    prompts = [parse_line(line, output_len, n)
               for n, line in enumerate(Path(path).read_text().splitlines(), 1) if line.strip()]
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return itertools.cycle(prompts)


def parse_line(line: str, output_len: int, number: int) -> BenchPrompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line {number}: not JSON ({exc})") from None
    budget = int(row.get("max_tokens") or row.get("output_len") or output_len)
    if isinstance(row.get("messages"), list):
        return BenchPrompt(messages=row["messages"], max_tokens=budget)
    text = row.get("prompt", row.get("text"))
    if not isinstance(text, str):
        raise ValueError(f"line {number}: needs a 'prompt' (or 'text') string or 'messages'")
    return BenchPrompt(prompt=text, max_tokens=budget)


def bench_prompts(args) -> Iterator[BenchPrompt]:
    if args.dataset:
        return from_jsonl(args.dataset, args.output_len)
    return synthetic(args.input_len, args.output_len, args.seed)
