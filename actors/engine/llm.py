"""In-process use: `LLM(model_path).generate(prompts, SamplingParams(...))`, `.chat(messages)`,
`.embed(prompts)`, with vLLM's prompt forms (text, token ids, {"prompt": ...} or
{"prompt_token_ids": ...}). No HTTP, no Ray."""
from __future__ import annotations

import dataclasses
import itertools

from tqdm import tqdm

from actors.config import EngineConfig, engine_options
from actors.engine.llm_engine import LLMEngine
from actors.outputs import RequestOutput
from actors.pooling_params import PoolingParams
from actors.request import EngineRequest, prompt_ids, resolve_max_tokens
from actors.sampling_params import SamplingParams


class LLM:
    def __init__(self, model_path: str | None = None, placement: tuple | None = None, **options):
        """options: EngineConfig fields, or vLLM's and SGLang's names for them (`model=`,
        `tensor_parallel_size=`, `enforce_eager=`). tp_size * pp_size > 1 starts shard actors on Ray."""
        options = engine_options({**options, **({"model_path": model_path} if model_path is not None else {})})
        model_path = options.pop("model_path", None)
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

    def get_tokenizer(self):
        return self.tokenizer

    def add_lora(self, name: str, path: str) -> None:
        """Register a PEFT adapter (needs enable_lora=True or lora_modules)."""
        self.engine.add_lora(name, path)

    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams,
                    priority: int = 0, lora: str | None = None, pooling: PoolingParams | None = None) -> None:
        """Queue a request (on adapter `lora`, None: the base model); raises ValueError for
        one the engine can never serve. max_tokens None: all the context leaves. pooling: an
        embedding request (params: SamplingParams(max_tokens=0))."""
        prompt = _prompt(prompt)
        if isinstance(prompt, tuple):  # the text and its ids
            prompt, ids = prompt
        else:
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
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():  # whole requests: each output is a finished one
                    done[out.request_id] = out
                    bar.update(1)
                for _, exc in self.engine.take_failures():
                    raise exc
        except BaseException:  # a failed request, Ctrl-C: the call's others end too, the engine stays usable
            for rid in self._pending:
                self.engine.abort_request(rid)
            self._pending = []
            raise
        finally:
            bar.close()
        done = {rid: done[rid] for rid in self._pending}
        self._pending = []
        return done

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora: str | list[str | None] | None = None) -> list[RequestOutput]:
        """lora: one adapter name for every prompt, or one per prompt (None: the base model)."""
        return self._run_prompts(prompts, sampling_params or SamplingParams(), lora, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False,
             lora: str | list[str | None] | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} messages) or a list
        of them, each rendered by the model's chat template (or `chat_template`), then generated."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        for c, conversation in enumerate(conversations):
            _check_text_only(c, conversation)
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt can't both be set")
        if chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template or use generate")
        prompts = [self.tokenizer.apply_chat_template(
            conversation, chat_template=chat_template, tools=tools, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=False, **(chat_template_kwargs or {}))
            for conversation in conversations]
        # The template wrote any BOS itself: encode without adding specials again.
        ids = [self.tokenizer.encode(text, add_special_tokens=False) for text in prompts]
        return self._run_prompts([{"prompt": text, "prompt_token_ids": i} for text, i in zip(prompts, ids)],
                                 sampling_params or SamplingParams(), lora, use_tqdm)

    def embed(self, prompts, pooling: PoolingParams | None = None, use_tqdm: bool = False,
              lora: str | list[str | None] | None = None) -> list[RequestOutput]:
        """Each prompt's embedding, `output.embedding` (float32 values): its final hidden states
        pooled as the checkpoint says (actors/worker/pooling_config.py) unless `pooling` says
        otherwise. Generation and embedding requests share the engine (and its batches)."""
        return self._run_prompts(prompts, SamplingParams(max_tokens=0), lora, use_tqdm,
                                 pooling or PoolingParams())

    def _run_prompts(self, prompts, params: SamplingParams | list[SamplingParams], lora, use_tqdm: bool,
                     pooling: PoolingParams | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError("prompts are text, token ids, a prompt dict or a list of them, "
                            f"got {type(prompts).__name__}")
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError("sampling_params is a SamplingParams or a list of them, got "
                            + ", ".join(sorted({type(p).__name__ for p in params if not isinstance(p, SamplingParams)})))
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        for name, given in (("sampling_params", params), ("lora", loras)):
            if len(given) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(given)} {name}")
        for prompt in prompts:  # every one read before any is queued
            _prompt(prompt)
        ids = [f"req-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p, name in zip(ids, prompts, params, loras):
                self.add_request(rid, prompt, p, lora=name, pooling=pooling)
        except Exception:  # none of this call's prompts stays queued for a later call
            for rid in ids:
                self.engine.abort_request(rid)
            self._pending = [rid for rid in self._pending if rid not in ids]
            raise
        done = self.run(use_tqdm)
        return [done[rid] for rid in ids]


def _prompt(prompt) -> str | list[int] | tuple[str, list[int]]:
    """One prompt in any of vLLM's forms: text, token ids, {"prompt": text} or
    {"prompt_token_ids": ids} (both: the ids, with the text kept for the output)."""
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown or not prompt:
            raise TypeError(f"a prompt dict holds \"prompt\" or \"prompt_token_ids\", got keys {sorted(prompt)}")
        text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if ids is None:
            return _prompt(text)
        if not _token_ids(ids):
            raise TypeError(f"\"prompt_token_ids\" must be a list of token ids (ints), got {type(ids).__name__}")
        ids = list(ids)
        if text is None:
            return ids
        if not isinstance(text, str):
            raise TypeError(f"\"prompt\" must be text, got {type(text).__name__}")
        return text, ids
    if isinstance(prompt, str):
        return prompt
    if _token_ids(prompt):
        return list(prompt)
    what = "a list holding other than ints" if isinstance(prompt, (list, tuple)) else type(prompt).__name__
    raise TypeError(f"a prompt is text, a list of token ids (ints) or a dict of either, got {what}")


def _token_ids(value) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _check_text_only(c: int, conversation) -> None:
    """A chat's content parts are text (as the server's API): a template would drop an image
    part, or put placeholders for an image no model here sees."""
    for m, message in enumerate(conversation):
        content = message.get("content") if isinstance(message, dict) else None
        for i, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type", "text") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"conversation {c}, message {m}, content part {i}: parts of type {kind!r} are "
                                 "not supported: shoal serves text")
