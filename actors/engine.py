"""The engine: requests in, delta outputs out. `step()` = schedule -> run -> postprocess."""
from __future__ import annotations

import copy
import logging
import resource
import time
from dataclasses import dataclass, field

import torch

from actors.block_manager import BlockManager
from actors.config import EngineConfig
from actors.detokenizer import IncrementalDetokenizer
from actors.errors import RequestFailedError
from actors.loader import eos_token_ids, load_tokenizer, read_config, resolve_dtype, resolve_model_path
from actors.metrics import EngineMetrics
from actors.model_runner import ModelRunner
from actors.outputs import CompletionOutput, RequestOutput
from actors.parallel import Parallel, parse_layer_split
from actors.sampling_params import SamplingParams
from actors.scheduler import Scheduler
from actors.shard_actor import rank_info, start_shards
from actors.sequence import Sequence
from actors.structured import Grammars, accept

log = logging.getLogger("shoal.engine")


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    seqs: list[Sequence] = field(default_factory=list)
    detoks: list[IncrementalDetokenizer] = field(default_factory=list)
    pending_children: list[Sequence] = field(default_factory=list)  # n > 1: wait for the prompt
    prompt: str | None = None
    prompt_logprobs: list | None = None  # grows chunk by chunk; position 0 has none
    prompt_logprobs_sent: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # its first step (metrics: queue time)
    first_token_time: float | None = None
    token_times: dict[int, float] = field(default_factory=dict)  # seq index -> its last token's time

    @property
    def finished(self) -> bool:
        return not self.pending_children and all(s.finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig, placement: tuple | None = None):
        """placement: (placement group, first bundle for shard rank 1) when the caller reserved one."""
        config.validate()
        self.config = config
        self.model_path = resolve_model_path(config.model_path)
        hf_config = read_config(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_ids = eos_token_ids(self.model_path, hf_config, self.tokenizer)
        limit = hf_config.get("max_position_embeddings", 2048)
        if config.max_model_len and config.max_model_len > limit:
            raise ValueError(f"--max-model-len {config.max_model_len} is over the model's "
                             f"max_position_embeddings {limit}")
        self.max_model_len = config.max_model_len or limit
        dtype = resolve_dtype(config.dtype, hf_config)
        torch.manual_seed(config.seed)
        start = time.perf_counter()
        split = parse_layer_split(config.pp_layer_split, hf_config["num_hidden_layers"], config.pp_size)
        parallel = Parallel(config.tp_size, config.pp_size, 0, layer_split=split,
                            expert_parallel=config.expert_parallel, redundant_experts=config.num_redundant_experts)
        self.runner = ModelRunner(config, self.model_path, hf_config, dtype, self.max_model_len,
                                  self.eos_ids, parallel)
        log.info("rank 0 loaded in %.2f s, peak RSS %.0f MiB", time.perf_counter() - start,
                 resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        self.shards = None
        if parallel.world_size > 1:
            self.shards = start_shards(config, self.runner, self.runner.num_blocks, self.max_model_len,
                                       placement)
        # Where every rank runs (/stats): pid, node, device, GPU ids.
        self.rank_infos = [rank_info(0, self.runner.device)] + (self.shards.infos if self.shards else [])
        self.failures: list[tuple[str, Exception]] = []  # requests whose post-processing raised
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.blocks)
        self.requests: dict[str, Request] = {}
        self.grammars = Grammars(self.tokenizer, self.runner.args.vocab_size, sorted(self.eos_ids))
        self.stats = EngineStats()
        self.metrics = EngineMetrics(config)

    # ---- requests ---------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (with the numbers) for a request this engine can never serve."""
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        max_tokens = params.max_tokens or 0
        if n + max_tokens > self.max_model_len:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens; "
                             f"the request has {n} prompt tokens and asks for {max_tokens} more")
        vocab = self.runner.args.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        need = self.blocks.blocks_needed(n + max(max_tokens, 1))
        if need > self.blocks.num_blocks:
            raise ValueError(f"the request needs {need} KV blocks but the pool has {self.blocks.num_blocks}")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, prompt: str | None = None, grammar=None) -> None:
        """`grammar`: params.structured already compiled (AsyncEngine compiles off this thread)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_token_ids, params)
        if params.structured is not None and grammar is None:
            grammar = self.grammars.compile(params.structured)
        params = copy.copy(params)  # callers may share one SamplingParams between requests
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(prompt_token_ids)
        req = Request(request_id, list(prompt_token_ids), params, priority, prompt=prompt)
        for i in range(params.n):
            seq = Sequence(request_id, i, list(prompt_token_ids), len(prompt_token_ids), params, priority)
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed + i)
            if grammar is not None:
                seq.matcher = self.grammars.matcher(grammar)
            req.seqs.append(seq)
            req.detoks.append(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                                     params.skip_special_tokens,
                                                     params.include_stop_str_in_output))
        # Later samples wait until the first has computed the prompt, then share its blocks.
        req.pending_children = req.seqs[1:]
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])
        if params.max_tokens == 0 and params.prompt_logprobs is None:
            req.pending_children = []
            for seq in req.seqs:
                self._finish(seq, "length")

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

    def shutdown(self) -> None:
        """Stop the shard actors of a multi-rank layout and leave the process group."""
        if self.shards is not None:
            try:
                self.runner.stop_workers()
            except Exception as exc:  # a shard already gone: killing them below is all that is left
                log.warning("could not stop the shard loops cleanly: %s", exc)
            self.shards.shutdown()
            self.shards = None
            import torch.distributed as dist
            dist.destroy_process_group()

    # ---- one step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return self._drain_finished()
        start = time.monotonic()
        result = self.runner.execute(batch)
        now = time.monotonic()
        self.stats.record_step(batch, now - start)
        self.metrics.step(now - start, len(batch))
        deltas: dict[str, RequestOutput] = {}
        for s, token, lps, prompt_lps in zip(batch, result.tokens, result.logprobs, result.prompt_logprobs):
            req = self.requests.get(s.seq.request_id)
            if req is None:  # failed earlier in this step
                continue
            try:
                self._postprocess(req, s, token, lps, prompt_lps, deltas, start, now)
            except Exception as exc:  # a bug in one request's handling fails that request alone
                log.exception("request %s failed after step %d", req.request_id, self.stats.steps)
                self.failures.append((req.request_id, RequestFailedError(
                    f"request {req.request_id} failed: {type(exc).__name__}: {exc}")))
                deltas.pop(req.request_id, None)
                self.abort_request(req.request_id)
        self.metrics.end_step()
        for rid, delta in deltas.items():
            delta.finished = self.requests[rid].finished
            if delta.finished:
                delta.metrics = self.metrics.finished_request(self.requests.pop(rid), now)
        return list(deltas.values()) + self._drain_finished()

    def _postprocess(self, req: Request, s, token, lps, prompt_lps, deltas, start: float, now: float) -> None:
        seq = s.seq
        if req.scheduled_time is None:
            self.metrics.scheduled(req, start)
        if prompt_lps is not None:
            self._add_prompt_logprobs(req, seq, prompt_lps)
        seq.num_computed_tokens += s.num_tokens
        self.blocks.cache_full_blocks(seq)
        if token is not None:
            self._append_token(req, seq, token, lps, deltas, now)
        if seq.index == 0 and s.samples and req.pending_children:
            for child in req.pending_children:
                self.scheduler.add(child)
            req.pending_children = []

    def take_failures(self) -> list[tuple[str, Exception]]:
        """(request id, error) of the requests that failed alone since the last call."""
        failures, self.failures = self.failures, []
        return failures

    def _add_prompt_logprobs(self, req: Request, seq: Sequence, lps: list) -> None:
        """Append this chunk's prompt log-probs (a recomputed chunk adds only what is new)."""
        acc = req.prompt_logprobs if req.prompt_logprobs is not None else [None]
        first = seq.num_computed_tokens + 1  # the prompt position the chunk's first row predicts
        acc.extend(lps[max(0, len(acc) - first):])
        req.prompt_logprobs = acc
        if len(acc) >= seq.num_prompt_tokens:
            for sibling in req.seqs:
                sibling.prompt_logprobs_sent = True

    def _append_token(self, req: Request, seq: Sequence, token: int, lps, deltas, now: float) -> None:
        p = seq.params
        if p.max_tokens == 0:  # only the prompt was wanted (prompt log-probs): drop the token
            req.pending_children = []
            for s in req.seqs:
                self._finish(s, "length")
                _output(self._delta(req, deltas), s.index).finish_reason = "length"
            return
        seq.token_ids.append(token)
        self.metrics.token(req, seq.index, now)
        detok = req.detoks[seq.index]
        out = _output(self._delta(req, deltas), seq.index)
        out.token_ids.append(token)
        if lps is not None:
            out.logprobs = (out.logprobs or []) + [lps]
        stopped_by_token = (token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos))
        past_min = seq.num_output_tokens >= p.min_tokens
        if seq.matcher is not None and accept(seq.matcher, token):
            stopped_by_token = past_min = True  # the grammar is complete: nothing may follow
        stop_str = None
        if not (stopped_by_token and past_min):  # a stop token's text is never shown
            stop_str = detok.add(token, check_stop=past_min)
        if stopped_by_token and past_min:
            self._finish(seq, "stop", token)
        elif stop_str is not None:
            self._finish(seq, "stop", stop_str)
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length")
        out.text += detok.release(final=seq.finished)
        if seq.finished:
            out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason

    def _finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)

    def _delta(self, req: Request, deltas: dict) -> RequestOutput:
        """This step's output for req, created on first use (it carries the prompt log-probs once)."""
        if req.request_id not in deltas:
            d = RequestOutput(req.request_id, req.prompt_token_ids, [], prompt=req.prompt,
                              num_cached_tokens=req.seqs[0].num_cached_tokens)
            if req.seqs[0].prompt_logprobs_sent and not req.prompt_logprobs_sent:
                d.prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
            deltas[req.request_id] = d
        return deltas[req.request_id]

    def _drain_finished(self) -> list[RequestOutput]:
        """Requests that finished without producing a token this step (e.g. max_tokens=0)."""
        done = []
        for rid, req in list(self.requests.items()):
            if req.finished:
                d = self._delta(req, {})
                d.outputs = [CompletionOutput(s.index, finish_reason=s.finish_reason,
                                              stop_reason=s.stop_reason) for s in req.seqs]
                d.finished = True
                d.metrics = self.metrics.finished_request(req, time.monotonic())
                done.append(d)
                del self.requests[rid]
        return done


def _output(delta: RequestOutput, index: int) -> CompletionOutput:
    for out in delta.outputs:
        if out.index == index:
            return out
    out = CompletionOutput(index)
    delta.outputs.append(out)
    return out


class EngineStats:
    """Running counters for /stats and the benchmarks."""

    def __init__(self):
        self.steps = 0
        self.step_time = 0.0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.decode_tokens = 0  # sampled by one-token rows (decode), for the progress line

    def record_step(self, batch, seconds: float) -> None:
        self.steps += 1
        self.step_time += seconds
        for s in batch:
            if s.samples:
                self.generated_tokens += 1
                self.decode_tokens += s.num_tokens == 1
            self.prompt_tokens += max(0, min(s.num_tokens, s.seq.num_prompt_tokens - s.seq.num_computed_tokens))
