"""One sequence being generated: its tokens, how many are computed, and its KV blocks."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

from actors.pooling_params import PoolingParams
from actors.sampling_params import SamplingParams

# A token a step is still sampling on the GPU while the next step is scheduled (async
# scheduling, actors/engine/llm_engine.py): the next step's input id comes from the device.
PLACEHOLDER = -1

_arrivals = itertools.count()
_seq_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt then output
    num_prompt_tokens: int
    params: SamplingParams
    priority: int = 0
    arrival: int = field(default_factory=lambda: next(_arrivals))
    seq_id: int = field(default_factory=lambda: next(_seq_ids))  # its row key on every rank
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks already registered in the prefix cache
    num_released_blocks: int = 0  # leading blocks given back: before every layer's sliding window
    num_sent_blocks: int = 0  # leading blocks the ranks' input batches have (0: no row there)
    prompt_logprobs_done: bool = False  # its prompt's log-probs are computed (or never wanted)
    children: list[Sequence] = field(default_factory=list)  # samples waiting for this one's prompt
    generator: object | None = None  # torch.Generator for seeded sampling
    matcher: object | None = None  # grammar matcher of a constrained request (actors/core/structured.py)
    # What besides the tokens must match for KV blocks to be shared (the request's cache salt
    # and LoRA adapter: actors/engine/llm_engine.py::cache_key). () shares with all.
    cache_key: tuple = ()
    lora: object | None = None  # the LoraRef (actors/models/lora_adapter.py) of its adapter; None: the base model
    lora_slot: int = -1  # the adapter slot it runs in while running (-1: none)
    pooling: PoolingParams | None = None  # resolved: its prompt is pooled instead of generating
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_done

    @property
    def needs_every_prompt_token(self) -> bool:
        """Every prompt position's output is still wanted (prompt log-probs, mean pooling), so
        none may come from the prefix cache."""
        pools_all = self.pooling is not None and self.pooling.needs_every_prompt_token
        return self.needs_prompt_logprobs or pools_all

    @property
    def pending(self) -> bool:
        """Its last token is still being sampled (a placeholder until the step resolves)."""
        return self.token_ids[-1] == PLACEHOLDER

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def sort_key(self) -> tuple[int, int]:
        """Scheduling order under the priority policy: lower priority value first, then age."""
        return (self.priority, self.arrival)
