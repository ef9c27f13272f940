"""In-process use: `LLM(model_path).generate(prompts, SamplingParams(...))`. No HTTP, no Ray."""
from __future__ import annotations

import itertools
from collections import defaultdict

from tqdm import tqdm

from actors.config import EngineConfig
from actors.engine.llm_engine import LLMEngine
from actors.outputs import RequestOutput, accumulate
from actors.sampling_params import SamplingParams


class LLM:
    def __init__(self, model_path: str | None = None, placement: tuple | None = None, **options):
        """options: EngineConfig fields. tp_size * pp_size > 1 starts shard actors on Ray."""
        self.engine = LLMEngine(EngineConfig(model_path=model_path, **options), placement)
        self.tokenizer = self.engine.tokenizer
        self.config = self.engine.config
        self.max_model_len = self.engine.max_model_len
        self._ids = itertools.count()
        self._pending: list[str] = []

    def shutdown(self) -> None:
        self.engine.shutdown()

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def add_lora(self, name: str, path: str) -> None:
        """Register a PEFT adapter (needs enable_lora=True or lora_modules)."""
        self.engine.add_lora(name, path)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, lora: str | None = None) -> None:
        """Queue a request (on adapter `lora`, None: the base model); raises ValueError for
        one the engine can never serve."""
        text = prompt if isinstance(prompt, str) else None
        self.engine.add_request(request_id, self.encode(prompt), params, priority, prompt=text, lora=lora)
        self._pending.append(request_id)

    def run(self, use_tqdm: bool = False) -> dict[str, RequestOutput]:
        """Step until every queued request has finished; cumulative outputs by request id."""
        deltas = defaultdict(list)
        bar = tqdm(total=len(self._pending), desc="requests", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                deltas[out.request_id].append(out)
                bar.update(out.finished)
            for _, exc in self.engine.take_failures():
                raise exc
        bar.close()
        done = {rid: accumulate(deltas[rid]) for rid in self._pending}
        self._pending = []
        return done

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora: str | list[str | None] | None = None) -> list[RequestOutput]:
        """lora: one adapter name for every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p, name in zip(ids, prompts, params, loras):
            self.add_request(rid, prompt, p, lora=name)
        done = self.run(use_tqdm)
        return [done[rid] for rid in ids]
