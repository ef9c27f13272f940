"""The engine: requests in, delta outputs out.

`step()` = schedule -> execute -> update -> outputs: the scheduler picks the step's rows
(actors/core/scheduler.py), the model runner computes and samples them (actors/worker/model_runner.py;
with shard ranks too), the scheduler advances its sequences with the sampled tokens, and
the engine turns what changed into delta RequestOutputs (text, stop strings, log-probs).
"""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field

import torch

from actors.config import EngineConfig
from actors.core.block_manager import BlockManager
from actors.core.lora_slots import LoraRef
from actors.core.scheduler import Scheduler
from actors.core.sequence import Sequence
from actors.core.step import ScheduledSeq, SchedulerOutput
from actors.core.structured import Grammars
from actors.engine.detokenizer import IncrementalDetokenizer
from actors.engine.lora_registry import LoraRegistry
from actors.engine.metrics import EngineMetrics
from actors.errors import RequestFailedError, UnknownAdapterError
from actors.executor.executor import Executor
from actors.outputs import CompletionOutput, RequestOutput
from actors.sampling_params import SamplingParams
from actors.worker.loader import checkpoint_shapes, load_tokenizer, resolve_model_path
from actors.worker.model_runner import RunnerOutput
from actors.worker.model_spec import resolve_model
from actors.worker.process_tuning import freeze_startup_heap

log = logging.getLogger("shoal.engine")


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    seqs: list[Sequence] = field(default_factory=list)
    detoks: list[IncrementalDetokenizer] = field(default_factory=list)
    prompt: str | None = None
    prompt_logprobs: list | None = None  # grows chunk by chunk; position 0 has none
    prompt_logprobs_sent: bool = False
    finish_sent: set[int] = field(default_factory=set)  # samples whose finish went out
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # its first step (metrics: queue time)
    first_token_time: float | None = None
    token_times: dict[int, float] = field(default_factory=dict)  # seq index -> its last token's time

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig, placement: tuple | None = None):
        """placement: (placement group, first bundle for shard rank 1) when the caller reserved one."""
        config.validate()
        self.config = config
        self.tokenizer = load_tokenizer(resolve_model_path(config.model_path))
        self.spec = resolve_model(config, self.tokenizer)
        self.model_path, self.max_model_len, self.eos_ids = self.spec.path, self.spec.max_model_len, self.spec.eos_ids
        self.loras = self._lora_registry(config)  # before the weights: a bad adapter fails at once
        torch.manual_seed(config.seed)
        self.executor = Executor(config, self.spec, placement)
        self.rank_infos = self.executor.rank_infos()
        self.blocks = BlockManager(self.executor.num_blocks, self.spec.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.blocks, self.max_model_len, self.eos_ids)
        self.requests: dict[str, Request] = {}
        self.grammars = Grammars(self.tokenizer, self.spec.args.vocab_size, sorted(self.eos_ids))
        self.metrics = EngineMetrics(config)
        self.stats = self.metrics.stats
        self.failures: list[tuple[str, Exception]] = []  # requests whose post-processing raised
        self._finished_on_arrival: list[str] = []  # nothing to compute (max_tokens=0)
        freeze_startup_heap()  # no 350 ms full collections mid-step (actors/worker/process_tuning.py)

    def _lora_registry(self, config: EngineConfig) -> LoraRegistry | None:
        if not config.enable_lora:
            return None
        registry = LoraRegistry(checkpoint_shapes(self.model_path), config.max_lora_rank,
                                self.spec.args.moe is not None)
        for name, path in config.lora_module_paths().items():
            registry.add(name, path)
        return registry

    # ---- LoRA adapters (callable from any thread) -------------------------------------
    def add_lora(self, name: str, path: str) -> LoraRef:
        """Register an adapter; it is read into a slot when a request first needs it."""
        if self.loras is None:
            raise ValueError("LoRA adapters are off: start the server with --enable-lora "
                             "(or --lora-modules)")
        return self.loras.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unregister an adapter: new requests for it get UnknownAdapterError."""
        if self.loras is None:
            raise UnknownAdapterError(f"The lora adapter '{name}' cannot be found.")
        self.loras.remove(name)

    def list_loras(self) -> list[LoraRef]:
        return self.loras.list() if self.loras is not None else []

    def lora_ref(self, name: str | None) -> LoraRef | None:
        """The registered adapter a request names (None: the base model)."""
        if name is None:
            return None
        if self.loras is None:
            raise UnknownAdapterError(f"The model `{name}` does not exist.")
        return self.loras.get(name)

    # ---- requests ---------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      lora: str | None = None) -> None:
        """Raise ValueError (with the numbers) for a request this engine can never serve;
        UnknownAdapterError (a ValueError) for an adapter it does not have."""
        self.lora_ref(lora)
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        max_tokens = params.max_tokens or 0
        if n + max_tokens > self.max_model_len:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens; "
                             f"the request has {n} prompt tokens and asks for {max_tokens} more")
        vocab = self.spec.args.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        need = self.blocks.blocks_needed(n + max(max_tokens, 1))
        if need > self.blocks.num_blocks:
            raise ValueError(f"the request needs {need} KV blocks but the pool has {self.blocks.num_blocks}")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, prompt: str | None = None, grammar=None,
                    lora: str | None = None) -> None:
        """`grammar`: params.structured already compiled (AsyncEngine compiles off this thread).
        `lora`: the name of a registered adapter to run the request on (None: the base model)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_token_ids, params, lora)
        ref = self.lora_ref(lora)
        if params.structured is not None and grammar is None:
            grammar = self.grammars.compile(params.structured)
        params = copy.copy(params)  # callers may share one SamplingParams between requests
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(prompt_token_ids)
        req = Request(request_id, list(prompt_token_ids), params, priority, prompt=prompt)
        for i in range(params.n):
            seq = Sequence(request_id, i, list(prompt_token_ids), len(prompt_token_ids), params, priority,
                           cache_key=cache_key(params, ref), lora=ref)
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.executor.device).manual_seed(params.seed + i)
            if grammar is not None:
                seq.matcher = self.grammars.matcher(grammar)
            req.seqs.append(seq)
            req.detoks.append(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                                     params.skip_special_tokens,
                                                     params.include_stop_str_in_output))
        self.requests[request_id] = req
        self.metrics.request_added(lora)
        first = req.seqs[0]
        first.children = req.seqs[1:]  # the other samples wait for its prompt, then share its blocks
        if params.max_tokens == 0 and params.prompt_logprobs is None:
            self.scheduler.finish(first, "length")
            self._finished_on_arrival.append(request_id)
        else:
            self.scheduler.add(first)

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.metrics.aborted(req)
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def take_failures(self) -> list[tuple[str, Exception]]:
        """(request id, error) of the requests that failed alone since the last call."""
        failures, self.failures = self.failures, []
        return failures

    def shutdown(self) -> None:
        self.executor.shutdown()

    # ---- one step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        output = self.scheduler.schedule()
        start = time.monotonic()
        result = self.executor.execute(output)
        self.scheduler.update(output, result.tokens)
        now = time.monotonic()
        self.metrics.record_step(output, result.tokens, self.requests, start, now)
        return self._outputs(output, result, now)

    def _outputs(self, output: SchedulerOutput, result: RunnerOutput, now: float) -> list[RequestOutput]:
        """One delta per request that changed; a finished request's last one carries its metrics."""
        deltas: dict[str, RequestOutput] = {}
        for s, token, lps, prompt_lps in zip(output.seqs, result.tokens, result.logprobs, result.prompt_logprobs):
            req = self.requests.get(s.seq.request_id)
            if req is None:  # aborted, or failed earlier in this step
                continue
            try:
                self._process(req, s, token, lps, prompt_lps, deltas)
            except Exception as exc:  # a bug in one request's handling fails that request alone
                self._fail(req, exc, deltas)
        for seq in output.finished:  # outgrew the KV pool: ends with what it has
            req = self.requests.get(seq.request_id)
            if req is not None:
                out = _output(self._delta(req, deltas), seq.index)
                out.text += req.detoks[seq.index].release(final=True)
                self._report_finish(req, seq, out)
        for rid in self._finished_on_arrival:
            if rid in self.requests:
                self._delta(self.requests[rid], deltas)
        self._finished_on_arrival = []
        for rid, delta in deltas.items():
            req = self.requests[rid]
            if req.finished:
                self._report_finishes(req, delta)
                delta.finished = True
                delta.metrics = self.metrics.finished_request(self.requests.pop(rid), now)
        return list(deltas.values())

    def _process(self, req: Request, s: ScheduledSeq, token, lps, prompt_lps, deltas: dict) -> None:
        seq = s.seq
        if prompt_lps is not None:
            self._add_prompt_logprobs(req, s, prompt_lps)
        if token is not None and seq.params.max_tokens != 0:  # the scheduler appended it
            out = _output(self._delta(req, deltas), seq.index)
            out.token_ids.append(token)
            if lps is not None:
                out.logprobs = (out.logprobs or []) + [lps]
            out.text += self._detokenize(req, seq, token)
        if seq.finished:
            self._report_finish(req, seq, _output(self._delta(req, deltas), seq.index))

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
        """This step's output for req, created on first use (it carries the prompt log-probs once)."""
        if req.request_id not in deltas:
            d = RequestOutput(req.request_id, req.prompt_token_ids, [], prompt=req.prompt,
                              num_cached_tokens=req.seqs[0].num_cached_tokens)
            complete = req.prompt_logprobs is not None and len(req.prompt_logprobs) >= len(req.prompt_token_ids)
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
                self._report_finish(req, seq, _output(delta, seq.index))

    def _fail(self, req: Request, exc: Exception, deltas: dict) -> None:
        log.exception("request %s failed after step %d", req.request_id, self.stats.steps)
        self.failures.append((req.request_id, RequestFailedError(
            f"request {req.request_id} failed: {type(exc).__name__}: {exc}")))
        deltas.pop(req.request_id, None)
        self.abort_request(req.request_id)


def cache_key(params: SamplingParams, lora: LoraRef | None = None) -> tuple:
    """What a sequence's prefix-cache blocks are keyed on besides its tokens (actors/core/block_manager.py):
    its cache salt and its adapter (the adapter changes the KV of the same tokens)."""
    salt = ("salt", params.cache_salt) if params.cache_salt is not None else ()
    return salt + (lora.cache_key if lora is not None else ())


def _output(delta: RequestOutput, index: int) -> CompletionOutput:
    for out in delta.outputs:
        if out.index == index:
            return out
    out = CompletionOutput(index)
    delta.outputs.append(out)
    return out
