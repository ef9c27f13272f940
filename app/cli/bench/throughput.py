"""`shoal bench throughput`: the in-process engine (actors.engine.llm.LLM), no HTTP, every request
submitted at once; what the engine alone can do on this machine.

Synthetic prompts are random token ids of exactly --input-len (special tokens left out), and
`ignore_eos` makes every output exactly --output-len, so runs compare token for token.
"""
from __future__ import annotations

import itertools
import random
import time

from app.cli.bench.prompts import from_jsonl


def token_prompts(tokenizer, count: int, input_len: int, seed: int) -> list[list[int]]:
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(seed)
    return [rng.choices(vocab, k=input_len) for _ in range(count)]


def dataset_prompts(tokenizer, path: str, count: int, output_len: int):
    """(token ids, max_tokens) per request; chat lines go through the model's chat template."""
    prompts = []
    for item in itertools.islice(from_jsonl(path, output_len), count):
        if item.messages:
            text = tokenizer.apply_chat_template(item.messages, tokenize=False,
                                                 add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(item.prompt, add_special_tokens=True)
        prompts.append((ids, item.max_tokens))
    return prompts


def run_throughput(llm, prompts, temperature: float, show_progress: bool) -> dict:
    from actors.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True)
              for _, n in prompts]
    llm.generate([4] * 4, SamplingParams(max_tokens=2))  # warm-up: first-step costs aside
    start = time.perf_counter()
    outputs = llm.generate([ids for ids, _ in prompts], params, use_tqdm=show_progress)
    elapsed = time.perf_counter() - start
    input_tokens = sum(len(ids) for ids, _ in prompts)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"num_requests": len(prompts), "elapsed_time": elapsed,
            "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
            "requests_per_second": len(prompts) / elapsed,
            "tokens_per_second": (input_tokens + output_tokens) / elapsed,
            "output_tokens_per_second": output_tokens / elapsed}


def format_result(result: dict) -> str:
    return (f"Throughput: {result['requests_per_second']:.2f} requests/s, "
            f"{result['tokens_per_second']:.2f} total tokens/s, "
            f"{result['output_tokens_per_second']:.2f} output tokens/s "
            f"({result['num_requests']} requests, {result['total_input_tokens']} prompt + "
            f"{result['total_output_tokens']} output tokens in {result['elapsed_time']:.2f} s)")
