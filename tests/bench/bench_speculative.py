"""Speculative decoding (n-gram prompt lookup, or a draft model): output tokens/s with and
without it.

    .venv/bin/python tests/bench/bench_speculative.py [--model DIR | --demo] [--k 3]
        [--lookup-max 4] [--lookup-min 2 | --draft DIR | --draft-layers 0,1,3,4]
        [--concurrency 1 32] [--requests 4] [--batches 1]
        [--max-tokens 128] [--workloads grounded open] [--show N]

`--draft DIR` verifies a draft model's proposals instead of prompt lookups; `--draft-layers`
builds that draft from the target's own layers (the self-speculative recipe: a copy without
the others, tests/checkpoints.py draft_copy).

Two in-process engines on the same checkpoint (float32), one plain and one with
`speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": ..,
"prompt_lookup_min": ..}` (vLLM's spelling), live side by side in this process and take turns
on the same prompts, the order flipped every `generate` call (every request at concurrency 1,
every batch of 32 at concurrency 32, and on across workloads), so drift of the machine's
speed cancels and the ratio holds on a noisy machine. Before each workload and concurrency
both engines run an untimed warm-up on other prompts of the workload (kernels for new batch
shapes are built once per process, so otherwise the engine that goes first pays for both).
Each measured prompt is new to each engine (its prefix cache has not seen it). Greedy, so the
two must write the same tokens: the table counts the requests where they do not.

Model: SmolLM2-135M-Instruct (tests/bench/smollm2.py builds it under ~/.cache/shoal on first
use; `make smollm2`), `--model DIR` for another chat model, `--demo` for the bundled demo model.

Time on the 2-core AMD EPYC (2026-11-28): the default SmolLM2 run takes about 7 minutes, of
which ~2.5 are the two engines' start (compiling the decode step of 30 layers, ~125 s for the
first engine; `--eager-decode` skips it, but an eager batch of 32 is ~35% slower than a
compiled one, which would flatter a speculative engine whose verify steps run eagerly);
plain output tok/s there was ~12-13 at concurrency 1 and ~110-200 at concurrency 32. The
measured part is ~4 minutes: at ~12 tok/s, 4 requests a workload at concurrency 1 (one per
grounded task type) are what fits; `--requests 16 --batches 2` gives steadier figures in
~15 minutes. `--demo` (16 requests, 2 batches) takes about a minute.

Workloads (each prompt chat-formatted with the model's template, greedy, --max-tokens):
- grounded: answers that copy long spans of the prompt. Four task types, interleaved
  (programmatically varied, all distinct):
  * typo: "Fix the typo in this paragraph: ..." (a 4-sentence paragraph, two letters of one
    word swapped). SmolLM2 writes the paragraph back nearly word for word (fixing the typo
    or not); now and then it rewrites it in its own words instead.
  * docstring: "Add a docstring to this function: ..." (16-20 lines of Python). SmolLM2
    writes the function back, body copied line by line (it seldom adds the docstring, and
    drops or changes the last few lines).
  * sort: "Sort these words alphabetically, one per line: ..." / "Repeat the following list,
    sorted alphabetically: ..." (6-10 words). SmolLM2 copies the words, mostly in the
    given order; on longer lists it can fall into repeating one word ("Guava, Guava, ..."),
    which a prompt lookup also predicts.
  * json: "Call the function `f` with these values as JSON: {...}" / "Format these values as
    JSON: key=value, ...". The weakest copy: SmolLM2 writes a JSON object or a Python
    function with the keys (and some values) copied, then drifts into made-up fields.
  The first two copy best; the sort and json prompts are there for shorter, tool-call-like
  copies.
- open: answers that copy nothing ("Write a short story about ...", "Explain why the sky is
  blue.", "Give me some tips for ...", "Describe ...").
- demo (the default with --demo): the demo model's copying tasks (docs/demo-model.md,
  app/demo/data.py): held-out tool calls from the eval set (a tool name and argument values
  copied from the schema and the request), "Repeat this line:" and "Quote these words as a
  JSON list:".
- demo-arith (also with --demo): the demo model's arithmetic with a scratchpad (restates
  numbers, little else to copy).

Acceptance figures come from the engine's speculator (`num_draft_tokens` proposed,
`num_accepted_tokens`, `num_drafts` rows that carried a proposal): acceptance = accepted / proposed, mean acceptance length
= 1 + accepted / drafts (vLLM's: tokens a verified row gains, the target's own one counted).
"engine steps" are `stats.steps` of each engine over the measured requests.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from actors.worker.process_tuning import openmp_env  # noqa: E402

os.environ.update(openmp_env())  # as `shoal` sets it (actors/executor/placement.py), before torch loads
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from smollm2 import smollm2_checkpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from checkpoints import draft_copy  # noqa: E402

from actors.engine.llm import LLM  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402
from actors.worker.checkpoint_files import resolve_model_path  # noqa: E402

SPEC_STATS = ("spec_draft_tokens", "spec_accepted_tokens", "spec_drafts")

# --------------------------------------------------------------------------- grounded prompts

PARAGRAPHS = [
    ("The old lighthouse stood at the edge of the cliff for more than two hundred years. Every "
     "night its keeper climbed the narrow stairs to light the lamp. Ships passing along the coast "
     "relied on its beam to avoid the rocks below. When the keeper retired, the town voted to keep "
     "the light burning with an automatic lamp."),
    ("Photosynthesis is the process by which green plants turn sunlight into chemical energy. "
     "The leaves take in carbon dioxide from the air and water from the soil. Using the energy of "
     "light, they produce glucose and release oxygen. This process supports almost all life on "
     "Earth."),
    ("Our team meeting has been moved from Tuesday to Thursday afternoon. Please bring the "
     "quarterly report and your notes on the new budget. We will also discuss the schedule for "
     "the product launch. Lunch will be provided for everyone who attends."),
    ("The city library opens at nine in the morning and closes at eight in the evening. Members "
     "can borrow up to ten books at a time for three weeks. Children under twelve need a parent "
     "to sign their application form. The reading room on the second floor is always quiet."),
    ("Coffee was first grown in the mountains of Ethiopia many centuries ago. Traders carried the "
     "beans across the Red Sea to Yemen. From there, coffee houses spread to Cairo, Istanbul and "
     "later to Europe. Today it is one of the most traded goods in the world."),
    ("To reset your password, open the settings page and choose the security tab. Click the button "
     "labeled change password and enter your current password. Then type the new password twice "
     "and press save. You will receive an email to confirm the change."),
    ("The marathon starts at seven in the morning near the central station. Runners should arrive "
     "at least one hour early to collect their numbers. Water stations are placed every five "
     "kilometers along the route. The finish line is in front of the town hall."),
    ("Honey bees live in colonies that can hold tens of thousands of workers. Each colony has a "
     "single queen who lays all the eggs. The workers collect nectar and pollen from flowers and "
     "bring them back to the hive. In winter the bees cluster together to stay warm."),
]


def with_typo(paragraph: str, rng: random.Random) -> str:
    """Two neighbouring letters of one word of five or more letters swapped."""
    words = paragraph.split(" ")
    candidates = [i for i, w in enumerate(words) if len(w) >= 5 and w.isalpha()]
    i = rng.choice(candidates)
    w = words[i]
    j = rng.randrange(1, len(w) - 2)
    words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


FUNCTIONS = [
    '''def {name}(items, limit={n}):
    result = []
    seen = set()
    for item in items:
        key = item.strip().lower()
        if not key:
            continue
        if key in seen:
            continue
        seen.add(key)
        result.append(item.strip())
        if len(result) >= limit:
            break
    result.sort(key=len)
    total = sum(len(x) for x in result)
    if total > {m}:
        result = result[:len(result) // 2]
    return result''',
    '''def {name}(path, encoding="utf-8"):
    counts = {{}}
    lines = 0
    with open(path, encoding=encoding) as handle:
        for line in handle:
            lines += 1
            for word in line.split():
                word = word.strip(".,;:!?").lower()
                if len(word) < {n}:
                    continue
                counts[word] = counts.get(word, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: kv[1], reverse=True)
    top = ranked[:{m}]
    if not top:
        return lines, []
    return lines, [word for word, _ in top]''',
    '''def {name}(orders, tax_rate=0.{n}):
    subtotal = 0.0
    discounts = 0.0
    for order in orders:
        price = order["price"]
        quantity = order.get("quantity", 1)
        line_total = price * quantity
        if quantity >= {m}:
            discount = line_total * 0.1
            discounts += discount
            line_total -= discount
        subtotal += line_total
    tax = subtotal * tax_rate
    total = subtotal + tax
    return {{
        "subtotal": round(subtotal, 2),
        "discounts": round(discounts, 2),
        "tax": round(tax, 2),
        "total": round(total, 2),
    }}''',
    '''def {name}(grid):
    rows = len(grid)
    cols = len(grid[0]) if rows else 0
    visited = [[False] * cols for _ in range(rows)]
    islands = 0
    for r in range(rows):
        for c in range(cols):
            if grid[r][c] != {n} or visited[r][c]:
                continue
            islands += 1
            stack = [(r, c)]
            while stack:
                y, x = stack.pop()
                if y < 0 or y >= rows or x < 0 or x >= cols:
                    continue
                if visited[y][x] or grid[y][x] != {n}:
                    continue
                visited[y][x] = True
                stack.extend([(y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)])
    return islands''',
    '''def {name}(text, width={m}):
    words = text.split()
    lines = []
    current = []
    length = 0
    for word in words:
        if length + len(word) + len(current) > width:
            lines.append(" ".join(current))
            current = [word]
            length = len(word)
        else:
            current.append(word)
            length += len(word)
    if current:
        lines.append(" ".join(current))
    if len(lines) > {n}:
        lines = lines[:{n}] + ["..."]
    return "\\n".join(lines)''',
    '''def {name}(temperatures, threshold={m}):
    if not temperatures:
        return None
    highest = max(temperatures)
    lowest = min(temperatures)
    average = sum(temperatures) / len(temperatures)
    hot_days = 0
    streak = 0
    longest = 0
    for value in temperatures:
        if value > threshold:
            hot_days += 1
            streak += 1
            longest = max(longest, streak)
        else:
            streak = 0
    return {{"max": highest, "min": lowest, "mean": round(average, {n}),
            "hot_days": hot_days, "longest_streak": longest}}''',
]
FUNCTION_NAMES = ["process", "summarize", "compute_totals", "count_regions", "wrap_text", "analyze",
                  "clean_up", "collect", "report", "scan", "tally", "format_block"]

LIST_WORDS = ("banana apple cherry mango peach grape lemon orange plum kiwi melon pear apricot "
              "fig lime papaya guava coconut Berlin Paris Tokyo Madrid Lisbon Oslo Vienna Prague "
              "Dublin Cairo Lima Toronto Sydney Nairobi Alice Bob Carol David Emma Frank Grace "
              "Henry Irene Jack Karen Liam Mona Noah Olivia Peter").split()

JSON_CALLS = [
    ("book_flight", [("origin", ["Boston", "Denver", "Chicago", "Seattle"]),
                     ("destination", ["Lisbon", "Tokyo", "Nairobi", "Reykjavik"]),
                     ("date", ["2025-03-14", "2025-07-01", "2025-11-23"]),
                     ("passengers", [1, 2, 3, 4]), ("cabin", ["economy", "business"])]),
    ("create_event", [("title", ["Quarterly planning review", "Team offsite kickoff",
                                 "Budget sign-off meeting"]),
                      ("start", ["2025-05-02T09:30", "2025-06-18T14:00"]),
                      ("duration_minutes", [30, 45, 60, 90]),
                      ("location", ["Room 4B, Building North", "Main auditorium"]),
                      ("attendees", ["alice@example.com", "bob@example.com"])]),
    ("send_email", [("to", ["maria.gonzalez@example.org", "team-leads@example.com"]),
                    ("subject", ["Invoice 4471 overdue", "Updated shipping address",
                                 "Welcome to the project"]),
                    ("body", ["Please find the signed contract attached.",
                              "The package will arrive on Friday morning."]),
                    ("priority", ["high", "normal"])]),
    ("get_weather", [("city", ["San Francisco", "Buenos Aires", "Ulaanbaatar", "Wellington"]),
                     ("units", ["metric", "imperial"]), ("days", [1, 3, 5, 7]),
                     ("include_hourly", ["true", "false"])]),
    ("add_customer", [("first_name", ["Priya", "Tomasz", "Haruto", "Chiara"]),
                      ("last_name", ["Raghunathan", "Kowalczyk", "Yamamoto", "Bianchi"]),
                      ("email", ["p.raghunathan@example.net", "tk@example.io"]),
                      ("phone", ["+1-415-555-0142", "+44-20-7946-0958"]),
                      ("plan", ["starter", "professional", "enterprise"])]),
]


def grounded_prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct copying prompts, the four task types interleaved."""
    rng = random.Random(seed)
    makers = [
        lambda i: ("Repeat the following list, sorted alphabetically: " if i % 2 else
                   "Sort these words alphabetically, one per line: ")
                  + ", ".join(rng.sample(LIST_WORDS, rng.randint(6, 10))),
        lambda i: _json_prompt(rng, i),
        lambda i: "Fix the typo in this paragraph:\n\n" + with_typo(PARAGRAPHS[i % len(PARAGRAPHS)], rng),
        lambda i: "Add a docstring to this function:\n\n```python\n" + FUNCTIONS[i % len(FUNCTIONS)].format(
            name=FUNCTION_NAMES[rng.randrange(len(FUNCTION_NAMES))] + f"_{rng.choice('abcdefgh')}",
            n=rng.randint(2, 9), m=rng.randint(10, 99)) + "\n```",
    ]
    out, seen = [], set()
    i = 0
    while len(out) < n:
        prompt = makers[len(out) % len(makers)](i // len(makers))
        i += 1
        if prompt not in seen:
            seen.add(prompt)
            out.append(prompt)
    return out


def _json_prompt(rng: random.Random, i: int) -> str:
    """Half as a tool call with the arguments in JSON already, half as key=value pairs."""
    name, fields = JSON_CALLS[i % len(JSON_CALLS)]
    values = {key: rng.choice(choices) for key, choices in fields}
    if i % 2 == 0:
        return f"Call the function `{name}` with these values as JSON: {json.dumps(values)}"
    return "Format these values as JSON: " + ", ".join(f"{k}={v}" for k, v in values.items())


# --------------------------------------------------------------------------- open prompts

STORY = ["a lost robot", "a dragon who is afraid of heights", "a girl who finds a secret door",
         "two friends on a fishing trip", "a cat that becomes mayor", "the last tree on a planet",
         "a baker who wins a race", "a ghost who wants to be seen"]
EXPLAIN = ["why the sky is blue", "why we have seasons", "how vaccines work",
           "why bread rises", "how a rainbow forms", "why the ocean is salty",
           "how airplanes stay in the air", "why leaves change color in autumn"]
TIPS = ["learning a new language", "sleeping better", "saving money", "staying focused at work",
        "starting to run", "cooking for a family", "keeping houseplants alive", "public speaking"]
DESCRIBE = ["a busy market in the morning", "a quiet beach at sunset", "a mountain village in winter",
            "a city after the rain", "a forest in spring", "an old train station",
            "a kitchen during a holiday", "a small island"]


def open_prompts(n: int, seed: int = 0) -> list[str]:
    forms = [("Write a short story about {}.", STORY), ("Explain {}.", EXPLAIN),
             ("Give me some tips for {}.", TIPS), ("Describe {}.", DESCRIBE)]
    out = []
    for i in range(n):
        form, subjects = forms[i % len(forms)]
        subject = subjects[(i // len(forms)) % len(subjects)]
        text = form.format(subject)
        round_ = i // (len(forms) * len(subjects))
        out.append(text if round_ == 0 else f"{text} Keep it under {100 + 20 * round_} words.")
    return out


# --------------------------------------------------------------------------- demo prompts

def demo_samples(kind: str, n: int, seed: int = 0) -> list[dict]:
    """app/demo/data.py samples: tool calls (held-out), copy and quote ("demo"), or
    arithmetic with a scratchpad ("demo-arith")."""
    from app.demo import data
    rng = random.Random(seed)
    if kind == "demo-arith":
        evals = data.eval_set(n, seed=seed + 20261122)
        mixed = [s for pair in zip(evals["mul22_think"], evals["add_think"]) for s in pair]
        return mixed[:n]
    calls = data.eval_set(n, seed=seed + 20261122)["tool_call"]
    out = []
    for i in range(n):
        out.append(calls[i] if i % 2 == 0 else
                   data.copy_sample(rng, False) if i % 4 == 1 else data.quote_sample(rng, False))
    return out


# --------------------------------------------------------------------------- prompts as ids

def chat_prompt_ids(tokenizer, workload: str, n: int) -> list[list[int]]:
    if workload in ("demo", "demo-arith"):
        chats = [(s["messages"], s["tools"] or None, s["thinking"]) for s in demo_samples(workload, n)]
    else:
        texts = grounded_prompts(n) if workload == "grounded" else open_prompts(n)
        chats = [([{"role": "user", "content": t}], None, False) for t in texts]
    out = []
    for messages, tools, thinking in chats:
        kwargs = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=thinking, **kwargs)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


# --------------------------------------------------------------------------- measuring

def stat_values(llm) -> dict:
    """The engine's step and token counters, and its speculator's (None without one)."""
    stats, speculator = llm.engine.stats, llm.engine.scheduler.speculator
    out = {"steps": stats.steps, "generated_tokens": stats.generated_tokens}
    for name, field in zip(SPEC_STATS, ("num_draft_tokens", "num_accepted_tokens", "num_drafts")):
        out[name] = getattr(speculator, field, None)
    return out


def measure(engines: dict, prompts: list[list[int]], concurrency: int, params: SamplingParams,
            turn: int = 0) -> dict:
    """Each engine runs every prompt once, in groups of `concurrency` (one `generate` call
    each), the engines taking turns and the order flipped every group (`turn`: groups run
    before, so the flipping goes on across calls). Per engine: seconds, output tokens, the
    token ids per prompt, and its stats' increase."""
    names = list(engines)
    res = {name: dict(seconds=0.0, tokens=0, ids=[None] * len(prompts), stats={}) for name in names}
    before = {name: stat_values(llm) for name, llm in engines.items()}
    for g, start in enumerate(range(0, len(prompts), concurrency)):
        group = prompts[start:start + concurrency]
        for name in (names if (turn + g) % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            outs = engines[name].generate(group, params)
            res[name]["seconds"] += time.perf_counter() - t
            for i, out in enumerate(outs):
                ids = list(out.outputs[0].token_ids)
                res[name]["ids"][start + i] = ids
                res[name]["tokens"] += len(ids)
    for name, llm in engines.items():
        after, earlier = stat_values(llm), before[name]
        res[name]["stats"] = {k: (after[k] - earlier[k] if after[k] is not None and earlier[k] is not None
                                  else None) for k in after}
    return res


def warm_up(engines: dict, prompts: list[list[int]], max_tokens: int) -> None:
    """Untimed: each engine runs these prompts (not the measured ones) in one call, row i
    stopping after i + 2 tokens, so the batch shrinks through every size it will meet.
    Kernels for a new shape are built on first use and kept process-wide (oneDNN), so
    without this whichever engine meets a batch size first pays for both (a group of 32 on
    the demo model ran 24% slower first)."""
    params = [SamplingParams(temperature=0, max_tokens=min(max_tokens, i + 2 if len(prompts) > 1 else 8),
                             ignore_eos=True) for i in range(len(prompts))]
    for llm in engines.values():
        llm.generate(prompts, params)


def build_engines(path, args) -> tuple[dict, str | None]:
    """{"plain": LLM, "spec": LLM} (no "spec" where the engine cannot speculate: then the
    reason as well)."""
    common = dict(dtype="float32", kv_cache_memory=args.kv_cache_gib, max_num_seqs=max(64, *args.concurrency))
    if args.eager_decode:
        common["eager_decode"] = True
    engines = {"plain": LLM(path, **common)}
    spec = {"method": "ngram", "num_speculative_tokens": args.k,
            "prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min}
    if args.draft:
        spec = {"model": args.draft, "num_speculative_tokens": args.k}
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    engines["spec"] = LLM(path, speculative_config=spec, **common)
    warm = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]] * 2
    for llm in engines.values():  # first steps (allocations, kernel choices) off the clock
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return engines


def fmt(x, spec: str) -> str:
    return "n/a" if x is None else x if isinstance(x, str) else format(x, spec)


def cpu_model() -> str:
    try:
        from app.cli.collect_env import cpu_model as model
        return model()
    except Exception:  # noqa: BLE001 - a label only
        import platform
        return platform.processor() or platform.machine()


def other_load() -> str:
    """Test runs going on now (their timings would be off)."""
    try:
        found = subprocess.run(["pgrep", "-f", "--", "-m pytest"], capture_output=True, text=True,
                               check=False).stdout.split()
    except OSError:
        return ""
    found = [p for p in found if int(p) != os.getpid()]
    return f" ({len(found)} pytest processes running: timings are off)" if found else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = ap.add_mutually_exclusive_group()
    model.add_argument("--model", help="a chat checkpoint directory (default: SmolLM2-135M-Instruct)")
    model.add_argument("--demo", action="store_true", help="the bundled demo model, LLM(None)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    draft = ap.add_mutually_exclusive_group()
    draft.add_argument("--draft", help="a draft model's checkpoint instead of n-gram lookup")
    draft.add_argument("--draft-layers", help="a draft model of the target's own layers, e.g. 0,1,3,4 "
                                              "(tests/checkpoints.py draft_copy, kept under ~/.cache/shoal/drafts)")
    ap.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    ap.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="passed on when given (the engine's default otherwise)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--requests", type=int, help="prompts per workload at concurrency 1 "
                    "(default 4, 16 with --demo)")
    ap.add_argument("--batches", type=int, help="generate calls per engine and workload at "
                    "concurrency > 1, the order flipped each call (default 1, 2 with --demo)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--workloads", nargs="+", choices=["grounded", "open", "demo", "demo-arith"],
                    help="default: grounded open (demo demo-arith with --demo)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-gib", type=float, default=1.5, help="per engine")
    ap.add_argument("--eager-decode", action="store_true", help="both engines (no compiled decode)")
    ap.add_argument("--show", type=int, default=0, help="print the first N answers per workload")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.requests = args.requests or (16 if args.demo else 4)
    args.batches = args.batches or (2 if args.demo else 1)
    workloads = args.workloads or (["demo", "demo-arith"] if args.demo else ["grounded", "open"])
    path = None if args.demo else (args.model or str(smollm2_checkpoint()))
    if args.draft_layers:
        layers = [int(x) for x in args.draft_layers.split(",")]
        target = Path(path or resolve_model_path(None))
        args.draft = str(draft_copy(target, Path.home() / ".cache/shoal/drafts" / f"{target.name}-{'-'.join(map(str, layers))}",
                                    layers))

    print(f"CPU: {cpu_model()}, {args.threads} torch threads; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}{other_load()}")
    how = f"draft model {args.draft}" if args.draft else \
        f"ngram, prompt_lookup {args.lookup_min}..{args.lookup_max}"
    print(f"model: {path or 'bundled demo model'} (float32); speculation: {how}, k={args.k}; greedy, "
          f"max_tokens {args.max_tokens}")
    t = time.perf_counter()
    engines = build_engines(path, args)
    print(f"engines built in {time.perf_counter() - t:.0f} s")
    tokenizer = engines["plain"].tokenizer
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    rows, turn = [], 0
    for workload in workloads:
        n_max = max(args.requests if c == 1 else c * args.batches for c in args.concurrency)
        all_prompts = chat_prompt_ids(tokenizer, workload, n_max + max(args.concurrency))
        spare = all_prompts[n_max:]  # for the warm-up
        for c in args.concurrency:
            prompts = all_prompts[:args.requests if c == 1 else c * args.batches]
            t = time.perf_counter()
            warm_up(engines, spare[:c], args.max_tokens)
            res = measure(engines, prompts, c, params, turn)
            turn += -(-len(prompts) // c)
            plain = res["plain"]
            row = dict(workload=workload, c=c, n=len(prompts),
                       prompt_len=sum(map(len, prompts)) / len(prompts),
                       out_len=plain["tokens"] / len(prompts),
                       plain=plain["tokens"] / plain["seconds"], wall=time.perf_counter() - t)
            if "spec" in res:
                spec = res["spec"]
                st = spec["stats"]
                row.update(spec=spec["tokens"] / spec["seconds"],
                           mismatches=sum(a != b for a, b in zip(plain["ids"], spec["ids"])))
                row["ratio"] = row["spec"] / row["plain"]
                drafted, accepted, drafts = (st.get(k) for k in SPEC_STATS)
                row["acceptance"] = accepted / drafted if drafted and accepted is not None else None
                row["accepted_len"] = 1 + accepted / drafts if drafts and accepted is not None else None
                if drafted == 0:  # counted, and none proposed (the batch was too big, or no match)
                    row["acceptance"] = row["accepted_len"] = "no drafts"
                row["steps"] = (plain["stats"]["steps"], st["steps"])
            rows.append(row)
            print(f"  {workload} c={c}: {len(prompts)} requests in {row['wall']:.0f} s", flush=True)
            for i in range(min(args.show, len(prompts))) if c == args.concurrency[0] else ():
                print(textwrap.indent(f"--- {workload} #{i}: "
                                      + tokenizer.decode(plain["ids"][i], skip_special_tokens=True), "    "))

    print(f"\nload average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}{other_load()}\n")
    print("| workload | concurrency | requests | prompt / output tokens (mean) | plain tok/s | "
          "speculative tok/s | speculative / plain | acceptance | mean acceptance length | "
          "engine steps plain / spec | outputs differing |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        steps = r.get("steps")
        print(f"| {r['workload']} | {r['c']} | {r['n']} | {r['prompt_len']:.0f} / {r['out_len']:.0f} | "
              f"{r['plain']:.1f} | {fmt(r.get('spec'), '.1f')} | {fmt(r.get('ratio'), '.2f')}"
              f"{'x' if 'ratio' in r else ''} | {fmt(r.get('acceptance'), '.0%')} | "
              f"{fmt(r.get('accepted_len'), '.2f')} | "
              f"{f'{steps[0]} / {steps[1]}' if steps else 'n/a'} | "
              f"{fmt(r.get('mismatches'), 'd')}{'/' + str(r['n']) if 'mismatches' in r else ''} |")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
