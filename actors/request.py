"""One generation (or embedding) request, as every hop carries it: the API (or `LLM` offline) builds it, the
replica and the engine's host pass it on, the engine runs it. Its outputs come back as delta
`RequestOutput`s (actors/outputs.py).

`SamplingParams` are validated and defaulted when the request is built (at the API boundary,
or in `LLM.add_request`): the engine trusts them. What only the engine knows (its KV pool,
its vocabulary, its adapters) it checks itself when a request arrives (LLMEngine.check).
"""
from __future__ import annotations

from dataclasses import dataclass

from actors.pooling_params import PoolingParams
from actors.sampling_params import SamplingParams


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # max_tokens resolved (never None once built by a boundary)
    priority: int = 0  # with --scheduling-policy priority: lower runs first
    lora: str | None = None  # a registered LoRA adapter's name; None: the base model
    prompt: str | None = None  # the prompt's text where the caller had one (given back on outputs)
    whole: bool = False  # only the finished output is wanted: the engine sends it once, cumulative
    # An embedding request: its prompt is pooled into RequestOutput.embedding and nothing is
    # generated (its params: SamplingParams(max_tokens=0)).
    pooling: PoolingParams | None = None


class ContextLengthError(ValueError):
    """The prompt and the tokens asked for do not fit the model's context."""

    def __init__(self, max_model_len: int, prompt_len: int, max_tokens: int):
        self.max_model_len, self.prompt_len, self.max_tokens = max_model_len, prompt_len, max_tokens
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} in the completion). Please reduce the length of the prompt or completion.")

    def __reduce__(self):  # crosses processes (the engine's socket, Ray) with its numbers
        return type(self), (self.max_model_len, self.prompt_len, self.max_tokens)


def resolve_max_tokens(max_tokens: int | None, prompt_len: int, max_model_len: int,
                       default: int | None = None) -> int:
    """max_tokens for a request: as asked, else `default` capped by what the context leaves,
    else all the context leaves. Raises ContextLengthError when it does not fit, or when
    nothing is left and none was asked for."""
    budget = max_model_len - prompt_len
    if max_tokens is None:
        if budget <= 0:
            raise ContextLengthError(max_model_len, prompt_len, 0)
        return budget if default is None else min(default, budget)
    if prompt_len + max_tokens > max_model_len:
        raise ContextLengthError(max_model_len, prompt_len, max_tokens)
    return max_tokens


def prompt_ids(tokenizer, prompt: str | list[int]) -> list[int]:
    """A prompt's token ids: text is encoded with the tokenizer's special tokens (BOS) added,
    as transformers does; ids pass as they are."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True)
    return list(prompt)
