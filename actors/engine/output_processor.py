"""A step's sampled tokens -> one RequestOutput per request that changed.

Each request keeps its sequences (n samples), an incremental detokenizer per sequence (whole
characters only, stop strings held back: actors/engine/detokenizer.py) and what it has sent.
A streamed request gets a delta per step; a `whole` one gets one cumulative output when it
finishes. A stop string finishes its sequence here (the scheduler then frees its blocks). A
request whose own processing raises fails alone (RequestFailedError); the others go on.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from actors.core.scheduler import Scheduler
from actors.core.sequence import Sequence
from actors.core.step import RunnerOutput, ScheduledSeq, SchedulerOutput
from actors.engine.detokenizer import IncrementalDetokenizer
from actors.engine.embedding import PooledPrompt
from actors.engine.metrics import EngineMetrics
from actors.errors import RequestFailedError
from actors.outputs import CompletionOutput, Pending, RequestOutput
from actors.request import EngineRequest

log = logging.getLogger("shoal.engine")


@dataclass
class Request:
    """The engine's state of one request."""
    request: EngineRequest
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    prompt_logprobs: list | None = None  # grows chunk by chunk; position 0 has none
    prompt_logprobs_sent: bool = False
    first_sent: bool = False  # its first output (with the prompt ids) went out
    finish_sent: set[int] = field(default_factory=set)  # samples whose finish went out
    whole: Pending | None = None  # a whole request's outputs so far
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # its first step (metrics: queue time)
    first_token_time: float | None = None
    token_times: dict[int, float] = field(default_factory=dict)  # seq index -> its last token's time
    pooled: PooledPrompt | None = None  # an embedding request's vector so far

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, metrics: EngineMetrics):
        self.scheduler, self.metrics = scheduler, metrics
        self.requests: dict[str, Request] = {}
        self.failures: list[tuple[str, Exception]] = []  # requests whose processing raised
        self.finished_on_arrival: list[str] = []  # nothing to compute (max_tokens=0)

    def outputs(self, output: SchedulerOutput, tokens: RunnerOutput, now: float) -> list[RequestOutput]:
        """One output per request that changed; a finished request's last one carries its metrics."""
        deltas: dict[str, RequestOutput] = {}
        for s, token, lps, prompt_lps, pooled in zip(output.seqs, tokens.tokens, tokens.logprobs,
                                                     tokens.prompt_logprobs, tokens.pooled):
            req = self.requests.get(s.seq.request_id)
            # (aborted, failed earlier in this step, or, under async scheduling, a sample that
            # a stop string finished after this step was scheduled)
            if req is None or s.seq.index in req.finish_sent:
                continue
            try:
                self._process(req, s, token, lps, prompt_lps, pooled, deltas)
            except Exception as exc:  # a bug in one request's handling fails that request alone
                self._fail(req, exc, deltas)
        for seq in output.finished:  # outgrew the KV pool: ends with what it has
            req = self.requests.get(seq.request_id)
            if req is not None:
                out = _sequence(self._delta(req, deltas), seq.index)
                out.text += req.detoks[seq.index].release(final=True)
                self._report_finish(req, seq, out)
        for rid in self.finished_on_arrival:
            if rid in self.requests:
                self._delta(self.requests[rid], deltas)
        self.finished_on_arrival = []
        return [out for rid, delta in deltas.items() if (out := self._send(self.requests[rid], delta, now))]

    def _send(self, req: Request, delta: RequestOutput, now: float) -> RequestOutput | None:
        """What leaves for this request this step: its delta, or for a whole request its
        cumulative output once it has finished (None before)."""
        req.first_sent = True
        if req.finished:
            self._report_finishes(req, delta)
            delta.finished = True
            delta.metrics = self.metrics.finished_request(self.requests.pop(req.request_id), now)
        if req.whole is None:
            return delta
        req.whole.add(delta)
        return req.whole.output if delta.finished else None

    def _process(self, req: Request, s: ScheduledSeq, token, lps, prompt_lps, pooled, deltas: dict) -> None:
        seq = s.seq
        if prompt_lps is not None:
            self._add_prompt_logprobs(req, s, prompt_lps)
        if pooled is not None:
            req.pooled.add(s.start, pooled)
        if token is not None and seq.params.max_tokens != 0:  # the scheduler appended it (them)
            out = _sequence(self._delta(req, deltas), seq.index)
            tokens = token if isinstance(token, list) else [token]  # a list: a verified row's
            for t, lp in zip(tokens, lps if isinstance(lps, list) else [lps] * len(tokens)):
                out.token_ids.append(t)
                if lp is not None:
                    out.logprobs = (out.logprobs or []) + [lp]
                out.text += self._detokenize(req, seq, t)
                if isinstance(seq.stop_reason, str):  # a stop string ended it: drop what follows
                    break
        if seq.finished:
            delta = self._delta(req, deltas)
            if req.pooled is not None:  # the scheduler finished it with its prompt computed
                delta.embedding = req.pooled.embedding()
            self._report_finish(req, seq, _sequence(delta, seq.index))

    def _detokenize(self, req: Request, seq: Sequence, token: int) -> str:
        """New text, holding back what may still become a stop string (which finishes seq)."""
        if seq.finish_reason == "stop" and seq.stop_reason == token:
            return req.detoks[seq.index].release(final=True)  # a stop token's text is never shown
        detok = req.detoks[seq.index]
        stop_str = detok.add(token, check_stop=seq.num_output_tokens >= seq.params.min_tokens)
        if stop_str is not None:
            if seq.finished:  # a stop string outranks a length limit reached by the same token
                seq.finish_reason, seq.stop_reason = "stop", stop_str
            else:
                self.scheduler.finish(seq, "stop", stop_str)
        return detok.release(final=seq.finished)

    def _add_prompt_logprobs(self, req: Request, s: ScheduledSeq, lps: list) -> None:
        """Append this chunk's prompt log-probs (a recomputed chunk adds only what is new)."""
        acc = req.prompt_logprobs if req.prompt_logprobs is not None else [None]
        first = s.start + 1  # the prompt position the chunk's first row predicts
        acc.extend(lps[max(0, len(acc) - first):])
        req.prompt_logprobs = acc

    def _delta(self, req: Request, deltas: dict) -> RequestOutput:
        """This step's output for req, created on first use: the request's first output carries
        its prompt (ids and text), the one after its prompt's log-probs are complete carries those."""
        if req.request_id not in deltas:
            first = not req.first_sent
            r = req.request
            d = RequestOutput(r.request_id, r.prompt_token_ids if first else None, [],
                              prompt=r.prompt if first else None,
                              num_cached_tokens=req.seqs[0].num_cached_tokens)
            complete = req.prompt_logprobs is not None and len(req.prompt_logprobs) >= len(r.prompt_token_ids)
            if complete and not req.prompt_logprobs_sent:
                d.prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
            deltas[req.request_id] = d
        return deltas[req.request_id]

    def _report_finish(self, req: Request, seq: Sequence, out: CompletionOutput) -> None:
        out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason
        req.finish_sent.add(seq.index)

    def _report_finishes(self, req: Request, delta: RequestOutput) -> None:
        """Samples that finished without a step of their own (e.g. with their first sample)."""
        for seq in req.seqs:
            if seq.index not in req.finish_sent:
                self._report_finish(req, seq, _sequence(delta, seq.index))

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.metrics.aborted(req)
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq)
        return True

    def _fail(self, req: Request, exc: Exception, deltas: dict) -> None:
        log.exception("request %s failed after step %d", req.request_id, self.metrics.stats.steps)
        self.failures.append((req.request_id, RequestFailedError(
            f"request {req.request_id} failed: {type(exc).__name__}: {exc}")))
        deltas.pop(req.request_id, None)
        self.abort(req.request_id)


def _sequence(delta: RequestOutput, index: int) -> CompletionOutput:
    for out in delta.outputs:
        if out.index == index:
            return out
    out = CompletionOutput(index)
    delta.outputs.append(out)
    return out
