"""The engine: requests in, outputs out, one `step()` at a time.

`step()` = schedule -> execute -> update -> outputs: the scheduler picks the step's rows
(actors/core/scheduler.py), the executor runs them on every rank and samples
(actors/executor/executor.py -> actors/worker/model_runner.py), the scheduler advances its
sequences with the sampled tokens, and the output processor turns what changed into
RequestOutputs (actors/engine/output_processor.py).

Async scheduling (the default on CUDA) keeps the GPU busy while the host works (docs/gpu.md):
- with one rank, the next step is scheduled and launched before this step's tokens are read:
  its rows take the tokens still on the device (placeholders), so the host's update, outputs
  and scheduling run while the GPU computes. A step whose rows need their last token on the
  host to go on (a grammar, penalties, prompt log-probs, embeddings) runs in turn instead;
- otherwise (or for such a step) a step's outputs are made during the next step: `step()`
  then returns the previous step's outputs.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from actors.config import EngineConfig
from actors.core.block_manager import BlockManager
from actors.core.lora_slots import LoraRef
from actors.core.scheduler import Scheduler
from actors.core.sequence import Sequence
from actors.core.speculation import Speculator
from actors.core.structured import Grammars
from actors.engine.detokenizer import IncrementalDetokenizer
from actors.engine.embedding import PooledPrompt
from actors.engine.lora_registry import LoraRegistry
from actors.engine.metrics import EngineMetrics
from actors.engine.output_processor import OutputProcessor, Request
from actors.errors import UnknownAdapterError
from actors.executor.executor import Executor
from actors.outputs import Pending, RequestOutput
from actors.pooling_params import PoolingParams
from actors.request import EngineRequest, resolve_max_tokens
from actors.sampling_params import SamplingParams
from actors.worker.checkpoint_files import (declared_eos_id, load_tokenizer, remembered_tokenizer_class,
                                           resolve_model_path, resolve_tokenizer_path, tokenizer_class_path)
from actors.worker.draft_model import DraftModel
from actors.worker.loader import checkpoint_shapes
from actors.worker.model_spec import resolve_model
from actors.worker.process_tuning import freeze_startup_heap

log = logging.getLogger("shoal.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, placement: tuple | None = None):
        """placement: (placement group, first bundle for shard rank 1) when the caller reserved one."""
        config.validate()
        self.config = config
        path = resolve_model_path(config.model_path)
        vocab = resolve_tokenizer_path(config.tokenizer, config.model_path)  # the tokenizer's files
        # The tokenizer loads beside the model (transformers' import and the tokenizer take ~1 s
        # of start-up): the engine needs it for requests, not to start. Its eos id comes from
        # its files where they state it.
        loading = ThreadPoolExecutor(1, thread_name_prefix="shoal-tokenizer")
        self._tokenizer_class = remembered_tokenizer_class(vocab)  # (None: AutoTokenizer decides)
        self._tokenizer = loading.submit(load_tokenizer, vocab, self._tokenizer_class, config.trust_remote_code)
        loading.shutdown(wait=False)  # (its thread ends with the load)
        eos = declared_eos_id(vocab)
        self.spec = resolve_model(config, eos if eos is not None else self.tokenizer.eos_token_id)
        self.model_path, self.max_model_len, self.eos_ids = self.spec.path, self.spec.max_model_len, self.spec.eos_ids
        self.loras = self._lora_registry(config)  # before the weights: a bad adapter fails at once
        speculative = config.speculative  # (a draft model that can't serve fails at once too)
        draft = DraftModel(config, self.tokenizer, self.spec) \
            if speculative is not None and speculative.method == "draft_model" else None
        torch.manual_seed(config.seed)
        self.executor = Executor(config, self.spec, placement, draft.block_bytes() if draft else 0)
        self.rank_infos = self.executor.rank_infos()
        windows = self.spec.args.layer_windows
        self.blocks = BlockManager(self.executor.num_blocks, self.spec.block_size, self._prefix_caching(config),
                                   sliding_window=max(windows) if windows and all(windows) else None)
        device = self.executor.device.type
        self.scheduler = Scheduler(config, self.blocks, self.max_model_len, self.eos_ids, Speculator.create(
            speculative, device, draft and draft.load(self.executor.num_blocks)), config.itl_target_seconds(device),
            self.executor.padded_rows)
        # (the future's own method: a lambda over self would be a cycle, and gc.freeze below keeps
        # cycles from start-up for good, so a freed engine would never go)
        self.grammars = Grammars(self._tokenizer.result, self.spec.args.vocab_size, sorted(self.eos_ids))
        self.metrics = EngineMetrics(config)
        self.stats = self.metrics.stats
        self.processor = OutputProcessor(self.scheduler, self.metrics)
        self.requests = self.processor.requests  # request id -> Request, until it finishes
        self._held = None  # async scheduling: the last step, its outputs not made yet
        self._launched = None  # async scheduling: (output, result, start) of the step launched ahead
        self._busy_end = None  # when the last step ended, if it left requests running
        freeze_startup_heap()  # no 350 ms full collections mid-step (actors/worker/process_tuning.py)

    def _prefix_caching(self, config: EngineConfig) -> bool:
        """--enable-prefix-caching, except for linear-attention models: a cached prefix's K/V
        would skip tokens their layers' state has to see (actors/models/hybrid.py)."""
        if config.enable_prefix_caching and self.spec.args.linear_attn is not None:
            log.info("prefix caching off: %s keeps a linear-attention state per sequence", self.spec.args.architecture)
            return False
        return config.enable_prefix_caching

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer (waits for it while it still loads)."""
        return self._tokenizer.result()

    @property
    def tokenizer_class(self) -> str:
        """The tokenizer's class as "module:Class": the HTTP processes load that class. The class
        remembered for these files is the one loading (a replica need not wait for it); else
        this waits for AutoTokenizer's choice."""
        return self._tokenizer_class or tokenizer_class_path(self.tokenizer)

    # ---- one step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        launched, self._launched = self._launched, None
        output, result, start = launched or self._launch(self.scheduler.schedule())
        outputs = self._held_outputs()  # (the last step's, if it held them: the GPU runs this one)
        # (while rows may propose drafts, steps run in turn: a pending token has nothing to look up)
        ahead = self.executor.runs_ahead and all(map(_runs_ahead, output.seqs)) \
            and not self.scheduler.speculating()
        if ahead:  # the next step goes to the GPU before this one's tokens are read
            self.scheduler.advance(output)
            self._launched = self._launch(self.scheduler.schedule(), previous=result)
        result.resolve()
        if ahead:
            self.scheduler.settle(output, result.tokens)
        else:
            self.scheduler.update(output, result.tokens)
        now = time.monotonic()
        self.metrics.record_step(output, result.tokens, self.requests, start, now)
        # What steps cost, and the host's time between two steps while requests run
        between = start - self._busy_end if self._busy_end is not None and start > self._busy_end else None
        self.scheduler.observe(output.seqs, result.tokens, now - start, between)
        if ahead or not self.executor.async_scheduling:
            outputs += self.processor.outputs(output, result, now)
        else:
            self._held = (output, result)
        if self._launched is not None and not self.requests:  # its rows all finished meanwhile
            self._launched[1].resolve()
            self._launched = None
        self._busy_end = now if self.requests else None
        return outputs

    def _launch(self, output, previous=None) -> tuple:
        """Start the step on the executor: (output, its RunnerOutput, start time)."""
        start = time.monotonic()
        return output, self.executor.execute(output, previous), start

    def _held_outputs(self) -> list[RequestOutput]:
        if self._held is None:
            return []
        held, self._held = self._held, None
        return self.processor.outputs(*held, time.monotonic())

    # ---- requests ---------------------------------------------------------------------
    def check(self, request: EngineRequest) -> None:
        """Raise ValueError (with the numbers) for a request this engine can never serve:
        ContextLengthError past the context, UnknownAdapterError for an adapter it lacks."""
        self.lora_ref(request.lora)
        ids, max_tokens = request.prompt_token_ids, request.params.max_tokens
        if not ids:
            raise ValueError("the prompt is empty")
        if max_tokens is None:
            raise ValueError("max_tokens is not set (the API and LLM.add_request resolve it)")
        if request.pooling is not None:
            self._check_pooling(request)
        resolve_max_tokens(max_tokens, len(ids), self.max_model_len)
        vocab = self.spec.args.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        params = request.params
        for field, given in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in given if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"{field}: {bad} is not a token id of this model (0..{vocab - 1})")
        # Its prompt and first token must fit the pool; a sequence that outgrows it later ends
        # with "length" (actors/core/scheduler.py).
        need = self.blocks.blocks_needed(len(ids) + 1)
        if need > self.blocks.num_blocks:
            raise ValueError(f"the prompt needs {need} KV blocks but the pool has {self.blocks.num_blocks}")

    def _check_pooling(self, request: EngineRequest) -> None:
        if request.params.max_tokens != 0 or request.params.n != 1:
            raise ValueError("an embedding request generates nothing: its params must be "
                             "SamplingParams(max_tokens=0)")
        dimensions, hidden = request.pooling.dimensions, self.spec.args.hidden_size
        if dimensions is not None and not 1 <= dimensions <= hidden:
            raise ValueError(f"dimensions must be between 1 and the model's {hidden}, got {dimensions}")

    def add_request(self, request: EngineRequest, grammar=None) -> None:
        """Start a request that `check` passed. `grammar`: its params.structured already
        compiled (AsyncEngine compiles off the loop thread)."""
        rid, params = request.request_id, request.params
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        ref = self.lora_ref(request.lora)  # (an adapter unloaded since `check` is refused here)
        if params.structured is not None and grammar is None:
            grammar = self.grammars.compile(params.structured)
        # An embedding request's pooling: the model's where the request leaves it open.
        pooling = request.pooling.resolved(self.spec.pooling) if request.pooling is not None else None
        req = Request(request, [], [], whole=Pending() if request.whole else None,
                      pooled=PooledPrompt(pooling, len(request.prompt_token_ids)) if pooling else None)
        for i in range(params.n):
            req.seqs.append(self._sequence(request, i, ref, grammar, pooling))
            req.detoks.append(IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.stop,
                                                     params.skip_special_tokens,
                                                     params.include_stop_str_in_output))
        self.requests[rid] = req
        self.metrics.request_added(request.lora)
        first = req.seqs[0]
        first.children = req.seqs[1:]  # the other samples wait for its prompt, then share its blocks
        if params.max_tokens == 0 and params.prompt_logprobs is None and pooling is None:
            self.scheduler.finish(first, "length")
            self.processor.finished_on_arrival.append(rid)
        else:
            self.scheduler.add(first)

    def _sequence(self, request: EngineRequest, index: int, ref: LoraRef | None, grammar,
                  pooling: PoolingParams | None) -> Sequence:
        params, ids = request.params, request.prompt_token_ids
        seq = Sequence(request.request_id, index, list(ids), len(ids), params, request.priority,
                       cache_key=cache_key(params, ref), lora=ref, pooling=pooling)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.executor.device).manual_seed(params.seed + index)
        if grammar is not None:
            seq.matcher = self.grammars.matcher(grammar)
        return seq

    def abort_request(self, request_id: str) -> bool:
        return self.processor.abort(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def take_failures(self) -> list[tuple[str, Exception]]:
        """(request id, error) of the requests that failed alone since the last call."""
        failures, self.processor.failures = self.processor.failures, []
        return failures

    def shutdown(self) -> None:
        self.executor.shutdown()

    # ---- LoRA adapters (callable from any thread) -------------------------------------
    def _lora_registry(self, config: EngineConfig) -> LoraRegistry | None:
        if not config.enable_lora:
            return None
        registry = LoraRegistry(checkpoint_shapes(self.model_path), config.max_lora_rank,
                                self.spec.args.moe is not None)
        for name, path in config.lora_module_paths().items():
            registry.add(name, path)
        return registry

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


def _runs_ahead(s) -> bool:
    """Whether the step after s's may be scheduled before s's token is read: nothing in it
    needs that token on the host first (a grammar's next mask, penalties over the output, or
    its drafts' verification: how many were accepted)."""
    seq, p = s.seq, s.seq.params
    return (seq.matcher is None and seq.pooling is None and not s.prompt_logprobs and p.max_tokens != 0
            and not p.penalizes_output and not s.draft)


def cache_key(params: SamplingParams, lora: LoraRef | None = None) -> tuple:
    """What a sequence's prefix-cache blocks are keyed on besides its tokens (actors/core/block_manager.py):
    its cache salt and its adapter (the adapter changes the KV of the same tokens)."""
    salt = ("salt", params.cache_salt) if params.cache_salt is not None else ()
    return salt + (lora.cache_key if lora is not None else ())
