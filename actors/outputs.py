"""What the engine hands back: one `RequestOutput` per request per step that changed it.

A streamed request's outputs are deltas (the new tokens and text of each sequence); a `whole`
request (EngineRequest.whole) gets one cumulative output, when it finishes. The request's
prompt ids, prompt text and prompt log-probs come once, on its first output that can carry
them. Deltas that pile up anywhere on the way (the engine's host, the replica, the HTTP
stream) are folded into one by `Pending`, the one place outputs are merged.
"""
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
    prompt_token_ids: list[int] | None  # on the request's first output only (merged ones keep it)
    outputs: list[CompletionOutput]  # only the sequences that changed (cumulative after merging)
    finished: bool = False
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # sent once, first position None
    num_cached_tokens: int = 0
    prompt: str | None = None  # on the first output, where the request had a text prompt
    metrics: RequestMetrics | None = None  # set on the last output (actors/engine/metrics.py)
    embedding: list[float] | None = None  # an embedding request's vector, on its last output


def merge(acc: RequestOutput, delta: RequestOutput) -> RequestOutput:
    """`delta` folded into `acc` (a request's earlier output, changed in place): the same as
    if the engine had sent them as one."""
    acc.finished = delta.finished
    acc.num_cached_tokens = max(acc.num_cached_tokens, delta.num_cached_tokens)
    for name in ("prompt_token_ids", "prompt", "prompt_logprobs", "metrics", "embedding"):
        if getattr(delta, name) is not None:
            setattr(acc, name, getattr(delta, name))
    by_index = {out.index: out for out in acc.outputs}
    for out in delta.outputs:
        seq = by_index.get(out.index)
        if seq is None:
            seq = by_index[out.index] = CompletionOutput(out.index)
            acc.outputs.append(seq)
        seq.text += out.text
        seq.token_ids.extend(out.token_ids)
        if out.logprobs is not None:
            seq.logprobs = (seq.logprobs or []) + out.logprobs
        if out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
    acc.outputs.sort(key=lambda out: out.index)
    return acc


def copy_output(output: RequestOutput) -> RequestOutput:
    """A copy whose sequences can be merged into without touching the original's."""
    return merge(RequestOutput(output.request_id, None, []), output)


class Pending:
    """One request's news not taken yet: its outputs merged as they come, and the error that
    ended it, if one did."""

    __slots__ = ("output", "error", "owned")

    def __init__(self):
        self.output: RequestOutput | None = None
        self.error: BaseException | None = None
        self.owned = False  # self.output is our own copy (its sender may still hold the first)

    def add(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self.error = item
        elif self.output is None:
            self.output, self.owned = item, False
        else:
            if not self.owned:
                self.output, self.owned = copy_output(self.output), True
            merge(self.output, item)

    @property
    def empty(self) -> bool:
        return self.output is None and self.error is None

    @property
    def tokens(self) -> int:
        """New tokens waiting (of the choice with most)."""
        return max((len(c.token_ids) for c in self.output.outputs), default=0) if self.output else 0

    @property
    def ended(self) -> bool:
        """The request is over: finished, or failed."""
        return self.error is not None or (self.output is not None and self.output.finished)

    def take(self) -> tuple[RequestOutput | None, BaseException | None]:
        """(merged output or None, error or None), and start empty again."""
        taken = self.output, self.error
        self.output = self.error = None
        return taken


def accumulate(outputs) -> RequestOutput:
    """A request's outputs folded into one (the whole output of a stream of deltas)."""
    pending = Pending()
    for output in outputs:
        pending.add(output)
    if pending.output is None:
        raise ValueError("no outputs to accumulate")
    return pending.output
