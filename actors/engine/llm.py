"""In-process use: `LLM(model_path).generate(prompts, SamplingParams(...))`, `.embed(prompts)`.
No HTTP, no Ray."""
from __future__ import annotations

import dataclasses
import itertools

from tqdm import tqdm

from actors.config import EngineConfig
from actors.engine.llm_engine import LLMEngine
from actors.outputs import RequestOutput
from actors.pooling_params import PoolingParams
from actors.request import EngineRequest, prompt_ids, resolve_max_tokens
from actors.sampling_params import SamplingParams


class LLM:
    def __init__(self, model_path: str | None = None, placement: tuple | None = None, **options):
        """options: EngineConfig fields. tp_size * pp_size > 1 starts shard actors on Ray."""
        if options.get("itl_target_ms") is None:  # whole requests: nobody waits between tokens
            options["itl_target_ms"] = 0
        self.engine = LLMEngine(EngineConfig(model_path=model_path, **options), placement)
        self.tokenizer = self.engine.tokenizer
        self.config = self.engine.config
        self.max_model_len = self.engine.max_model_len
        self._ids = itertools.count()
        self._pending: list[str] = []

    def shutdown(self) -> None:
        self.engine.shutdown()

    def encode(self, prompt: str | list[int]) -> list[int]:
        return prompt_ids(self.tokenizer, prompt)

    def add_lora(self, name: str, path: str) -> None:
        """Register a PEFT adapter (needs enable_lora=True or lora_modules)."""
        self.engine.add_lora(name, path)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, lora: str | None = None, pooling: PoolingParams | None = None) -> None:
        """Queue a request (on adapter `lora`, None: the base model); raises ValueError for
        one the engine can never serve. max_tokens None: all the context leaves. pooling: an
        embedding request (params: SamplingParams(max_tokens=0))."""
        ids = self.encode(prompt)
        max_tokens = resolve_max_tokens(params.max_tokens, len(ids), self.max_model_len)
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        request = EngineRequest(request_id, ids, params, priority, lora,
                                prompt=prompt if isinstance(prompt, str) else None, whole=True,
                                pooling=pooling)
        self.engine.check(request)
        self.engine.add_request(request)
        self._pending.append(request_id)

    def run(self, use_tqdm: bool = False) -> dict[str, RequestOutput]:
        """Step until every queued request has finished; their outputs by request id."""
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(self._pending), desc="requests", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():  # whole requests: each output is a finished one
                done[out.request_id] = out
                bar.update(1)
            for _, exc in self.engine.take_failures():
                raise exc
        bar.close()
        done = {rid: done[rid] for rid in self._pending}
        self._pending = []
        return done

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora: str | list[str | None] | None = None) -> list[RequestOutput]:
        """lora: one adapter name for every prompt, or one per prompt (None: the base model)."""
        return self._run_prompts(prompts, sampling_params or SamplingParams(), lora, use_tqdm)

    def embed(self, prompts, pooling: PoolingParams | None = None, use_tqdm: bool = False,
              lora: str | list[str | None] | None = None) -> list[RequestOutput]:
        """Each prompt's embedding, `output.embedding` (float32 values): its final hidden states
        pooled as the checkpoint says (actors/worker/pooling_config.py) unless `pooling` says
        otherwise. Generation and embedding requests share the engine (and its batches)."""
        return self._run_prompts(prompts, SamplingParams(max_tokens=0), lora, use_tqdm,
                                 pooling or PoolingParams())

    def _run_prompts(self, prompts, params: SamplingParams | list[SamplingParams], lora, use_tqdm: bool,
                     pooling: PoolingParams | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if isinstance(params, list) else [params] * len(prompts)
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        ids = [f"req-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p, name in zip(ids, prompts, params, loras):
            self.add_request(rid, prompt, p, lora=name, pooling=pooling)
        done = self.run(use_tqdm)
        return [done[rid] for rid in ids]
