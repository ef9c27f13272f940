"""A draft model for speculative decoding (vLLM's "draft_model"): a small checkpoint with the
target's tokenizer proposes each decoding row's next k tokens, greedily.

It runs beside rank 0, unsharded, on rank 0's device: a ModelRunner of its own (eager, no
adapters) with its own paged KV pool of as many blocks as the target's (a draft caches no
more tokens than its sequence has, so it never needs more). A proposal for the step's rows
is k forwards of the batch: the first writes each row's tokens the draft has not cached (a
new sequence's whole prompt, else the one or two tokens the last verification added) and
reads the first draft token at its last position; each further one feeds the draft token
before. The drafts it fed stay cached: next step, those the target accepted are still valid
and the rest are overwritten, so no roll-back is needed.

Greedy drafts depend on the context alone, so verifying them as actors/worker/sampler.py
verifies a prompt lookup keeps the target's distribution at any temperature.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from actors.config import EngineConfig
from actors.core.step import SchedulerOutput, StepRow
from actors.worker.checkpoint_files import load_tokenizer, resolve_model_path
from actors.worker.model_runner import ModelRunner
from actors.worker.model_spec import ModelSpec, resolve_model

log = logging.getLogger("shoal.engine")


@dataclass
class _Cached:
    """What the draft's cache holds of one sequence."""
    blocks: list[int] = field(default_factory=list)
    sent: int = 0  # blocks the runner's input batch has
    base: int = 0  # leading tokens that are the sequence's own
    fed: list[int] = field(default_factory=list)  # the drafts fed after them (cached too)


class DraftModel:
    def __init__(self, config: EngineConfig, tokenizer, target: ModelSpec):
        """Checks the draft against the target (before anything loads); `load` loads it."""
        self.path = str(resolve_model_path(config.speculative.model))
        _check_tokenizer(self.path, tokenizer)
        self.config = dataclasses.replace(
            config, model_path=self.path, tp_size=1, pp_size=1, pp_layer_split=None, enable_lora=False,
            lora_modules=None, speculative_config=None, kv_cache_memory=None,
            max_model_len=target.max_model_len, block_size=target.block_size, eager_decode=True,
            async_scheduling=False, enable_expert_parallel=False, ep_size=None, num_redundant_experts=0,
            eplb_step_interval=0)
        try:
            self.spec = dataclasses.replace(resolve_model(self.config, tokenizer.eos_token_id), eos_ids=target.eos_ids)
        except ValueError as e:
            raise ValueError(f"the draft model {self.path}: {e}") from None
        self.vocab = min(self.spec.args.vocab_size, target.args.vocab_size)  # ids the target knows
        self.block_size = target.block_size
        self.runner: ModelRunner | None = None
        self.cached: dict[int, _Cached] = {}
        self.freed: list[int] = []  # sequences whose rows the runner drops at the next forward

    def block_bytes(self) -> int:
        """Bytes of one block of the draft's pool (rank 0 sizes its own pool with room for it)."""
        a = self.spec.args
        return a.kv_planes * a.num_kv_heads * a.head_dim * self.spec.kv_dtype.itemsize * a.num_layers * self.block_size

    def load(self, num_blocks: int) -> DraftModel:
        """The weights and a pool of `num_blocks` blocks (the target's pool size)."""
        start = time.perf_counter()
        self.runner = ModelRunner(dataclasses.replace(self.config, num_kv_blocks=num_blocks), self.spec)
        self.free = list(range(num_blocks - 1, -1, -1))
        log.info("draft model %s loaded in %.2f s (%d layers, %d KV blocks)", self.path,
                 time.perf_counter() - start, len(self.runner.model.model.layers), num_blocks)
        return self

    def propose(self, rows: list[tuple[int, list[int], int]]) -> dict[int, list[int]]:
        """rows: (seq id, its tokens, k) -> seq id: its k greedy drafts."""
        work = []
        for seq_id, tokens, k in rows:
            c = self.cached.setdefault(seq_id, _Cached())
            valid = c.base + _common_prefix(c.fed, tokens[c.base:])
            # (k drafts: the cache ends up holding the tokens and the first k - 1 of them)
            if self._grow(c, len(tokens) + k - 1):
                work.append((seq_id, c, tokens, min(valid, len(tokens) - 1), k))
        if not work:
            return {}
        drafts = {seq_id: [] for seq_id, *_ in work}
        # The first forward: every row's uncached tokens, one-token rows first (the kernels' order).
        first = sorted(work, key=lambda w: len(w[2]) - w[3] != 1)
        self._forward(first, [StepRow(seq_id, tokens[valid:], valid) for seq_id, _, tokens, valid, _ in first], drafts)
        for i in range(1, max(w[4] for w in work)):
            more = [w for w in work if w[4] > i]
            self._forward(more, [StepRow(seq_id, [drafts[seq_id][-1]], len(tokens) + i - 1)
                                 for seq_id, _, tokens, _, _ in more], drafts)
        for seq_id, c, tokens, _, k in work:
            c.base, c.fed = len(tokens), drafts[seq_id][:k - 1]
        return drafts

    def _forward(self, work: list, rows: list[StepRow], drafts: dict[int, list[int]]) -> None:
        """One forward of `rows`; each row's last position gives its next draft."""
        tables = []
        for seq_id, c, *_ in work:
            if len(c.blocks) > c.sent:
                tables.append((seq_id, c.sent, c.blocks[c.sent:]))
                c.sent = len(c.blocks)
        ends = torch.tensor([len(r.token_ids) for r in rows]).cumsum(0) - 1
        output = SchedulerOutput(rows, sum(len(r.token_ids) == 1 for r in rows), ends.tolist(), tables,
                                 freed=self.freed)
        self.freed = []
        logits, _ = self.runner.forward(output)
        for (seq_id, *_), token in zip(work, logits[:, :self.vocab].argmax(-1).tolist()):
            drafts[seq_id].append(token)

    def _grow(self, c: _Cached, tokens: int) -> bool:
        """Blocks for `tokens` tokens; False where the pool has too few free (no drafts then)."""
        need = -(-tokens // self.block_size) - len(c.blocks)
        if need > len(self.free):
            return False
        c.blocks += [self.free.pop() for _ in range(max(0, need))]
        return True

    def forget(self, seq_id: int) -> None:
        """The sequence left the batch: its blocks go back, its row at the next forward."""
        c = self.cached.pop(seq_id, None)
        if c is None:
            return
        self.free += c.blocks
        if c.sent:
            self.freed.append(seq_id)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _check_tokenizer(path: str, tokenizer) -> None:
    """A draft with a tokenizer of its own must have the target's vocabulary (its ids are
    proposed as the target's)."""
    try:
        own = load_tokenizer(resolve_model_path(path))
    except Exception:  # noqa: BLE001 - none in its folder: it uses the target's
        return
    if own.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"the draft model {path} has a different tokenizer from the target's: a draft "
                         "must share the target's vocabulary")
