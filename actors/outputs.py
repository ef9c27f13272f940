"""What the engine hands back. Streaming outputs are deltas; `accumulate` folds them."""
from __future__ import annotations

from dataclasses import dataclass, field

# One position's log-probs: {token_id: logprob}, the chosen token first.
TokenLogprobs = dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""  # new text since the previous output of this sequence
    token_ids: list[int] = field(default_factory=list)  # new token ids
    logprobs: list[TokenLogprobs] | None = None  # one entry per new token id
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Engine-side timings of a finished request, in seconds (on its last output)."""
    queue_time: float  # arrival to the first step that computed it
    ttft: float | None  # arrival to the first token; None: no token was generated
    e2e: float  # arrival to finish
    replica: str = "local"  # the replica whose engine ran it


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # only the sequences that changed (cumulative after accumulate)
    finished: bool = False
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # sent once, first position None
    num_cached_tokens: int = 0
    prompt: str | None = None
    metrics: RequestMetrics | None = None  # set on the last output (actors/engine/metrics.py)


def accumulate(deltas) -> RequestOutput:
    """Fold a request's stream of delta outputs into one cumulative output."""
    final: RequestOutput | None = None
    by_index: dict[int, CompletionOutput] = {}
    for delta in deltas:
        if final is None:
            final = RequestOutput(delta.request_id, delta.prompt_token_ids, [], prompt=delta.prompt)
        final.finished = delta.finished
        final.num_cached_tokens = max(final.num_cached_tokens, delta.num_cached_tokens)
        if delta.prompt_logprobs is not None:
            final.prompt_logprobs = delta.prompt_logprobs
        if delta.metrics is not None:
            final.metrics = delta.metrics
        for out in delta.outputs:
            acc = by_index.setdefault(out.index, CompletionOutput(out.index))
            merge_into(acc, out)
    if final is None:
        raise ValueError("no outputs to accumulate")
    final.outputs = [by_index[i] for i in sorted(by_index)]
    return final


def merge_into(acc: CompletionOutput, out: CompletionOutput) -> None:
    acc.text += out.text
    acc.token_ids.extend(out.token_ids)
    if out.logprobs is not None:
        acc.logprobs = (acc.logprobs or []) + out.logprobs
    if out.finish_reason is not None:
        acc.finish_reason, acc.stop_reason = out.finish_reason, out.stop_reason
