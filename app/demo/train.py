"""Train the bundled demo model: `python -m app.demo.train --out actors/demo_model`.

A BPE tokenizer (digits one per token) and a few-million-parameter Qwen3 decoder trained on
the synthetic chats of app/demo/data.py, loss on assistant tokens only: a base run, then two
tuning stages that teach copying and read a tool's description before its name (`Run`;
`--base` tunes a finished model). Fixed seeds. Every
`--save-minutes` the training state and a loadable checkpoint go to the --state folder, so a
run stopped at any point loses a few minutes at most: the next run continues from there
(`--fresh` starts over). Only a finished run writes --out. A run pauses while a test run is
going (app/demo/yielding.py).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from actors.worker.model_spec import cpu_has_matmul
from app.demo import data
from app.demo.yielding import tests_running
from app.protocol.chatml import CHAT_TEMPLATE

# The tuning stages and the shipped model read each tool's description before its name. A
# causal model reading a schema name-first cannot know at the name what the tool does, so
# a call had to find the matching description and step back to the name before it (half of
# the 2026-11-26 misses copied the other tool's name, or pieces of both). Description first,
# the name's tokens carry what the tool does and one lookup finds them. The base stage keeps
# the OpenAI order (name first), the order the shipped base checkpoint was trained on.
DESCRIPTION_FIRST_TEMPLATE = CHAT_TEMPLATE.replace("{{- tool | tojson }}", """
        {%- set fn = tool.function if tool.function is defined else tool %}
        {{- '{"type": "function", "function": {' }}
        {%- if fn.description %}{{- '"description": ' + fn.description | tojson + ', ' }}{%- endif %}
        {{- '"name": ' + fn.name | tojson }}
        {%- if fn.parameters is defined %}{{- ', "parameters": ' + fn.parameters | tojson }}{%- endif %}
        {{- '}}' }}""")
assert DESCRIPTION_FIRST_TEMPLATE != CHAT_TEMPLATE
STAGE_TEMPLATE = {"base": CHAT_TEMPLATE, "copy": DESCRIPTION_FIRST_TEMPLATE,
                  "mix": DESCRIPTION_FIRST_TEMPLATE}

SEED = 1234
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
EOS, PAD = "<|im_end|>", "<|endoftext|>"
# Fixed text of the prompt that the model reads but never writes: the chat template's tools
# preamble and the JSON scaffolding of a tool schema (as `tojson` renders the OpenAI
# layout). As BPE pieces (merges never cross a word) they were ~75% of a tool sample's
# prompt; as tokens of their own a tool call sample takes ~115 tokens instead of ~320.
# Every name and key in a schema keeps the BPE tokens around it that it has in a call
# (`{"name": "` name `",`, ` {"` key `":`), so a copy can find it by them. Two runs whose
# pieces swallowed some of those (`{"name": "`, then `{"name":`) copied keys and a name's
# later pieces but seldom a name's first (docs/demo-model.md).
PROMPT_PIECES = [
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within ",
    " XML tags:\n",
    '\n{"name": <function-name>, "arguments": <args-json-object>}\n',
    '{"type": "function", "function": ',
    ' "description": "',
    ' "parameters": {"type": "object", "properties":',
    ' {"type": "string"},',
    ' {"type": "number"},',
    ' {"type": "string"}},',
    ' {"type": "number"}},',
    ' "required":',
    '"]}}}',
]
BPE_VOCAB = 1024
# ~3.7 M parameters (14.8 MB in float32, the limit is 20 MB): a fifth layer and a wider
# residual for bare answers (a carry done in one step) and for copying unseen tool names.
MODEL = dict(hidden_size=256, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, intermediate_size=640, max_position_embeddings=1024,
             tie_word_embeddings=True, rms_norm_eps=1e-6,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
MAX_LEN = 512  # longest rendered sample (3 tool schemas + a tool turn) is ~350 tokens


# --------------------------------------------------------------------------- tokenizer

def build_tokenizer():
    """Byte-level BPE (any UTF-8 round-trips) with every digit its own token, so numbers
    are spelled digit by digit and arithmetic is learnable."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB,
                                  special_tokens=SPECIAL_TOKENS + PROMPT_PIECES,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(map(_without_prompt_pieces, data.corpus()), trainer=trainer)
    tok = _markup_not_special(tok)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False, model_max_length=MODEL["max_position_embeddings"])
    hf.chat_template = CHAT_TEMPLATE  # the base stage's; Run.train_stage sets each stage's
    return hf


def _without_prompt_pieces(text: str) -> str:
    for piece in PROMPT_PIECES:
        text = text.replace(piece, " ")
    return text


def _markup_not_special(tok):
    """As in Qwen3, <think>, <tool_call>, <tool_response> and their closers are single
    tokens (ids 3-8, never merged) but not "special": decoding with skip_special_tokens
    keeps them, so reasoning and tool-call parsers still see the markup."""
    from tokenizers import Tokenizer
    spec = json.loads(tok.to_str())
    for entry in spec["added_tokens"]:
        if entry["content"] not in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
            entry["special"] = False
    return Tokenizer.from_str(json.dumps(spec))


def render_prompt(tok, sample: dict) -> str:
    return tok.apply_chat_template(sample["messages"], tools=sample["tools"], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=sample["thinking"])


def encode(tok, sample: dict, request_spelling: bool = False) -> tuple[list[int], list[int]]:
    """Prompt and target are tokenized apart, exactly as the server sees the prompt and the
    model then emits its reply; the loss covers the target and the closing <|im_end|>.
    With `request_spelling`, values copied from the request keep its tokens (below)."""
    prompt = tok.encode(render_prompt(tok, sample), add_special_tokens=False)
    copied = sample.get("copied", ()) if request_spelling else ()
    target = encode_target(tok, sample["target"] + EOS, copied)
    ids = (prompt + target)[:MAX_LEN]
    labels = ([-100] * len(prompt) + target)[:MAX_LEN]
    return ids, labels


def encode_target(tok, text: str, copied) -> list[int]:
    """The target's tokens, with each copied value (in order, each a quoted JSON string in
    `text`) spelled as in the request: `Thailand` after a space there is ` T`, `h`, `ail`,
    `an`, `d`, and quoted its canonical tokens are `Th`, `ail`, `an`, `d`. Written as `T`,
    `h`, `ail`, `an`, `d` (the same text), a copy is one piece with its space dropped and
    then the request's tokens one for one, which is what an induction head does; the
    canonical spelling must find `ail` after a token the request does not have (the value
    every tuned model miscopied, docs/demo-model.md)."""
    def enc(t):
        return tok.encode(t, add_special_tokens=False)
    ids, at = [], 0
    for value in copied:
        start = text.index(f'"{value}"', at) + 1
        spelled = enc(" " + value)
        head = tok.decode(spelled[:1])[1:]  # the first piece without its space
        ids += enc(text[at:start]) + (enc(head) if head else []) + spelled[1:]
        at = start + len(value)
    return ids + enc(text[at:])


# --------------------------------------------------------------------------- batches

def batches(tok, seed: int, tokens_per_batch: int, pool: int = 256, mixture: list = data.MIXTURE,
            request_spelling: bool = False):
    """Length-grouped padded batches of about `tokens_per_batch` tokens (padding waste
    stays small because a pool of samples is sorted by length before it is cut)."""
    it = data.stream(seed, mixture)
    rng = random.Random(seed + 1)
    pad = tok.convert_tokens_to_ids(PAD)
    while True:
        enc = sorted((encode(tok, next(it), request_spelling) for _ in range(pool)),
                     key=lambda e: len(e[0]))
        groups, cur = [], []
        for e in enc:
            if cur and (len(cur) + 1) * len(e[0]) > tokens_per_batch:
                groups.append(cur)
                cur = []
            cur.append(e)
        groups.append(cur)
        rng.shuffle(groups)
        for g in groups:
            n = max(len(e[0]) for e in g)
            ids = torch.tensor([e[0] + [pad] * (n - len(e[0])) for e in g])
            labels = torch.tensor([e[1] + [-100] * (n - len(e[1])) for e in g])
            mask = torch.tensor([[1] * len(e[0]) + [0] * (n - len(e[0])) for e in g])
            yield ids, labels, mask


# --------------------------------------------------------------------------- model

def build_model(tok):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    eos, pad = tok.convert_tokens_to_ids(EOS), tok.convert_tokens_to_ids(PAD)
    cfg = Qwen3Config(vocab_size=len(tok), bos_token_id=None, eos_token_id=eos, pad_token_id=pad,
                      dtype="float32", initializer_range=0.02, **MODEL)
    torch.manual_seed(SEED)
    return Qwen3ForCausalLM(cfg)


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine down to 10% of the peak as
    `progress` (fraction of the step or time budget, whichever is further) goes to 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, progress)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


# --------------------------------------------------------------------------- quick eval

@torch.no_grad()
def greedy(model, tok, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Batched greedy decoding with transformers (left padding)."""
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=tok.convert_tokens_to_ids(EOS),
                         pad_token_id=tok.convert_tokens_to_ids(PAD))
    return tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=False)


def quick_eval(model, tok, n: int = 12) -> dict[str, float]:
    """Exact-match rates on a few held-out problems (the full eval is app/demo/eval.py)."""
    from app.demo.eval import answer_number, parse_tool_calls
    model.eval()
    res = {}
    sets = data.eval_set(n, seed=7)
    for kind in ("add", "mul21", "mul22_think", "tool_call"):
        samples = sets[kind]
        outs = greedy(model, tok, [render_prompt(tok, s) for s in samples],
                      120 if "think" in kind else 60)
        ok = 0
        for s, o in zip(samples, outs):
            o = o.split(EOS)[0]
            if kind == "tool_call":
                calls = parse_tool_calls(o)[1]
                ok += calls == [s["expect"]]
            else:
                ok += answer_number(o) == s["expect"]
        res[kind] = ok / n
    # Copying a line of unseen names (what a call needs for an unseen tool's name) and
    # quoting words into JSON strings (what its argument values need).
    rng = random.Random(7)
    for kind, make in (("copy", data.copy_sample), ("quote", data.quote_sample)):
        samples = [make(rng, False) for _ in range(n)]
        outs = greedy(model, tok, [render_prompt(tok, s) for s in samples], 60)
        res[kind] = sum(o.split(EOS)[0] == s["expect"] for s, o in zip(samples, outs)) / n
    model.train()
    return res


# --------------------------------------------------------------------------- save / main

def save(model, tok, out: Path, dtype: torch.dtype) -> None:
    from transformers import GenerationConfig
    out.mkdir(parents=True, exist_ok=True)
    eos, pad = tok.convert_tokens_to_ids(EOS), tok.convert_tokens_to_ids(PAD)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad,
                                               bos_token_id=None, do_sample=False)
    # The output parsers it needs (app/protocol/model_parsers.py): it thinks in <think> blocks
    # and calls tools in Qwen's (hermes) markup.
    model.config.reasoning_parser, model.config.tool_call_parser = "qwen3", "hermes"
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as the embedding; loaders tie it
    model.save_pretrained(out, state_dict=state)
    tok.padding_side = "right"
    tok.backend_tokenizer.no_padding()  # a quick check's batched greedy turned it on
    tok.save_pretrained(out)


def fingerprint(args) -> str:
    """What a resumable state must match: model shape, tokenizer, the data (its first samples, so an
    edit that changes no sample keeps the run) and optimizer settings. Not the budgets: a
    larger --minutes continues a run on a longer schedule."""
    import hashlib
    import itertools
    samples = list(itertools.islice(data.stream(SEED), 300))
    key = json.dumps([MODEL, BPE_VOCAB, SPECIAL_TOKENS, PROMPT_PIECES, samples,
                      args.tokens_per_batch, args.lr, args.warmup, args.bf16], sort_keys=True)
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def tune_fingerprint(args) -> str:
    """What a saved state of the tuning stages must match, besides the base run's fingerprint
    (not the step budgets: a longer stage continues the run)."""
    import hashlib
    import itertools
    samples = list(itertools.islice(data.stream(SEED, data.TUNE_MIXTURE), 300))
    key = json.dumps([samples, args.tune_lr, args.base, STAGE_TEMPLATE], sort_keys=True)
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def optimizer(model, lr: float):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.98), eps=1e-8)


class Run:
    """A training run across its stages: the model, its optimizer and where it stands.

    Stages: "base" (data.MIXTURE, the step or wall-time budget, cosine LR), then tuning with a
    fresh optimizer: "copy" (half the samples copying a line or quoting words, --copy-steps,
    LR warm-up to --tune-lr) and "mix" (a fifth, --mix-steps, cosine to 10%). A base run
    alone guesses the tokens of an unseen tool name rather than copying them
    (docs/demo-model.md); a stage heavy in copying forms the heads that copy, and the other
    half keeps the other tasks.
    """

    def __init__(self, args, tok, model):
        self.args, self.tok, self.model = args, tok, model
        self.opt = optimizer(model, args.lr)
        self.stage, self.step, self.stage_step, self.seen = "base", 0, 0, 0
        self.start = time.time()  # moved on by pauses, so time.time() - start is training time
        self.state_path = Path(args.state)
        self.work = self.state_path.parent / "model"  # the latest checkpoint, loadable meanwhile
        self.ids = {"run": fingerprint(args), "tune": tune_fingerprint(args)}

    def resume(self) -> None:
        """Continue the saved run, if it is this one (same model, data, optimizer settings)."""
        if self.args.fresh or not self.state_path.exists():
            return
        st = torch.load(self.state_path, weights_only=False)
        if self.args.base and st.get("stage", "base") == "base":
            return  # a base run's state: tuning --base starts from that checkpoint instead
        if st.get("run") != self.ids["run"] or (st.get("stage", "base") != "base"
                                                and st.get("tune") != self.ids["tune"]):
            print(f"{self.state_path} is from another run (model, data or optimizer changed): "
                  "starting over", flush=True)
            return
        self.stage, self.stage_step = st.get("stage", "base"), st.get("stage_step", st["step"])
        if self.stage != "base":
            self.opt = optimizer(self.model, self.args.tune_lr)
        self.model.load_state_dict(st["model"])
        self.opt.load_state_dict(st["opt"])
        self.step, self.seen = st["step"], st["seen"]
        self.start = time.time() - st["elapsed"]
        print(f"resumed at step {self.step} ({self.stage} stage), "
              f"{st['elapsed'] / 60:.1f} min in", flush=True)

    def checkpoint(self, folder: Path) -> None:
        save(self.model, self.tok, folder, getattr(torch, self.args.save_dtype))
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                    "step": self.step, "stage": self.stage, "stage_step": self.stage_step,
                    "elapsed": time.time() - self.start, "seen": self.seen, **self.ids},
                   self.state_path)

    def next_stage(self, stage: str) -> None:
        """Tuning starts with a fresh optimizer (the base run's moments are for its LR)."""
        self.stage, self.stage_step = stage, 0
        if stage == "copy":
            self.opt = optimizer(self.model, self.args.tune_lr)

    def lr(self) -> float | None:
        """This step's LR, or None when the stage is over."""
        a = self.args
        if self.stage == "base":
            progress = max(self.step / a.steps, (time.time() - self.start) / (a.minutes * 60))
            return None if progress >= 1.0 else lr_at(self.step, progress, a.lr, a.warmup)
        if self.stage == "copy":
            return None if self.stage_step >= a.copy_steps else \
                a.tune_lr * min(1.0, (self.stage_step + 1) / a.warmup)
        return None if self.stage_step >= a.mix_steps else \
            lr_at(a.warmup, self.stage_step / a.mix_steps, a.tune_lr, a.warmup)

    def train_stage(self) -> None:
        from tqdm import tqdm
        a = self.args
        mixture = {"base": data.MIXTURE, "copy": data.COPY_MIXTURE, "mix": data.TUNE_MIXTURE}[self.stage]
        self.tok.chat_template = STAGE_TEMPLATE[self.stage]  # checkpoints save it too
        total = {"base": a.steps, "copy": a.copy_steps, "mix": a.mix_steps}[self.stage]
        # The data stream is keyed by the step it resumes from, so a resumed run sees new samples.
        # The tuning stages spell copied values the request's way (encode_target).
        stream = batches(self.tok, SEED + self.step, a.tokens_per_batch, mixture=mixture,
                         request_spelling=self.stage != "base")
        last_save = last_eval = time.time()
        bar = tqdm(total=total, initial=self.stage_step, dynamic_ncols=True, mininterval=5,
                   desc=self.stage)
        ema = None
        while True:
            if tests_running():
                self.checkpoint(self.work)
                bar.write(f"step {self.step}: a test run started; paused (checkpoint saved)")
                paused = time.time()
                while tests_running():
                    time.sleep(5)
                # The pause is not training time: the budget and the timers skip it.
                idle = time.time() - paused
                self.start, last_save, last_eval = self.start + idle, last_save + idle, last_eval + idle
                bar.write(f"step {self.step}: resumed after {idle / 60:.1f} min")
            ids, labels, mask = next(stream)
            lr = self.lr()
            if lr is None:
                break
            for g in self.opt.param_groups:
                g["lr"] = lr
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
                loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.step, self.stage_step = self.step + 1, self.stage_step + 1
            self.seen += int(mask.sum())
            ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
            elapsed = time.time() - self.start
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.1e}", tok_s=f"{self.seen / elapsed:.0f}")
            if time.time() - last_save > a.save_minutes * 60:
                self.checkpoint(self.work)
                last_save = time.time()
            if time.time() - last_eval > a.eval_minutes * 60:
                bar.write(f"step {self.step} loss {ema:.3f} {elapsed / 60:.1f} min  eval "
                          + self.quick_check())
                last_eval = time.time()
        bar.close()
        print(f"{self.stage} stage done at step {self.step}: {self.quick_check()}", flush=True)

    def quick_check(self) -> str:
        if not self.args.eval_n:
            return "-"
        figs = quick_eval(self.model, self.tok, self.args.eval_n)
        return " ".join(f"{k} {v:.0%}" for k, v in figs.items())


def main(argv=None) -> None:
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="actors/demo_model")
    p.add_argument("--state", default="build/demo_train/state.pt", help="resumable training state")
    p.add_argument("--steps", type=int, default=100_000, help="step budget of the base stage")
    p.add_argument("--minutes", type=float, default=105.0,
                   help="wall-time budget of the base stage: its LR schedule follows whichever "
                        "budget is further along, so a slow (shared) machine still anneals and stops")
    p.add_argument("--tokens-per-batch", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--copy-steps", type=int, default=2400,
                   help="tuning: steps of the mixture with half the samples copying or quoting")
    p.add_argument("--mix-steps", type=int, default=2500,
                   help="tuning: steps of the mixture with copying (data.TUNE_MIXTURE)")
    p.add_argument("--tune-lr", type=float, default=1e-3)
    p.add_argument("--base", default=None,
                   help="tune this checkpoint instead of training a base model first")
    p.add_argument("--save-minutes", type=float, default=4.0)
    p.add_argument("--eval-minutes", type=float, default=10.0)
    p.add_argument("--eval-n", type=int, default=12, help="problems per quick check (0: none)")
    # Two threads on an idle 2-core machine: 1.30x one (bf16; tests/bench/bench_demo_train.py).
    # On shared, busy cores use 1: a second OpenMP thread then mostly spin-waits for a
    # descheduled partner (measured 10x slower wall time than one thread under load).
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fp32", action="store_true",
                   help="train in float32 even where the CPU has bf16 matmuls (bf16 autocast "
                        "is ~1.5x faster with AMX, and ~20x slower without native bf16)")
    # float32 keeps the trained weights exact and is still only ~15 MB (limit 20 MB).
    p.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--fresh", action="store_true",
                   help="start over instead of continuing from --state")
    args = p.parse_args(argv)
    args.bf16 = not args.fp32 and cpu_has_matmul(torch.bfloat16)

    torch.set_num_threads(args.threads)
    random.seed(SEED)
    torch.manual_seed(SEED)
    tok = build_tokenizer()
    model = build_model(tok)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer {len(tok)} ids; model {n_params / 1e6:.2f}M parameters; "
          f"{'bf16 autocast' if args.bf16 else 'float32'}", flush=True)
    if args.base:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        if AutoTokenizer.from_pretrained(args.base).get_vocab() != tok.get_vocab():
            raise SystemExit(f"{args.base} has another tokenizer than this recipe's")
        model.load_state_dict(AutoModelForCausalLM.from_pretrained(args.base).state_dict())
    run = Run(args, tok, model)
    if args.base:
        run.next_stage("copy")
    run.resume()
    for stage in ("base", "copy", "mix"):
        if run.stage != stage:
            continue
        run.train_stage()
        if stage == "base":
            run.checkpoint(run.state_path.parent / "base")  # the base model, for --base
        if stage != "mix":
            run.next_stage({"base": "copy", "copy": "mix"}[stage])
    run.checkpoint(Path(args.out))  # only a finished run replaces --out
    print(f"done: {run.step} steps, {run.seen} tokens, {(time.time() - run.start) / 60:.1f} min "
          f"-> {args.out}", flush=True)


if __name__ == "__main__":
    main()
