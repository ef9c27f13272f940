"""The OpenAI API as vLLM accepts it: request and response bodies as pydantic models.

Requests ignore unknown fields (clients send many we don't use); values we can't honour
fail validation with the field named, and `error_body` turns that into OpenAI's shape.
"""
from __future__ import annotations

import re
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator,
)

from actors.request import ContextLengthError, resolve_max_tokens
from actors.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request the server refuses; `param` names the offending field for the client."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


# --------------------------------------------------------------------------- requests

_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """Where `value` (parsed JSON) holds text that is not valid Unicode: a UTF-16 surrogate
    without its pair (JSON's "\\ud800"), which no tokenizer, template or UTF-8 encoder takes.
    JSON parsing already joins a valid pair into one character, so any surrogate left is lone."""
    if isinstance(value, str):
        return path or "body" if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and _SURROGATE.search(key):
            return path or "body"
        where = lone_surrogate(item, f"{path}{key}" if key.startswith("[") else f"{path}.{key}" if path else key)
        if where:
            return where
    return None


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = lone_surrogate(data)
        if where:
            raise ValueError(f"{where}: text that is not valid Unicode (a lone UTF-16 surrogate)")
        return data


class TextPart(OpenAIModel):
    type: str = "text"
    text: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value != "text":  # image_url, input_audio, file, ...
            raise ValueError(f"content parts of type {value!r} are not supported: shoal serves text only")
        return value


class FunctionCall(OpenAIModel):
    name: str
    arguments: str = "{}"  # a JSON string, as OpenAI sends it


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: which call this answers
    reasoning_content: str | None = None  # earlier assistant reasoning, for templates that show it

    def text(self) -> str | None:
        """Content as one string (text parts joined by newlines, as vLLM does)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage on every chunk


class SamplingRequest(OpenAIModel):
    """Fields both endpoints share; the OpenAI ones first, then vLLM's extras."""
    prompt_field: ClassVar[str] = "prompt"  # what a too-long prompt error points at
    model: str | None = None
    n: int = Field(1, ge=1)  # at most --max-n (app/api/limits.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1)  # prefix-cache blocks shared per salt only
    # vLLM's guided decoding (structured outputs, at most one; see app/protocol/structured_outputs.py)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's, not built here: refused rather than ignored, since ignoring changes the output
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    @field_validator("allowed_token_ids", "bad_words")
    @classmethod
    def _not_built(cls, value, info: ValidationInfo):
        if value:
            raise ValueError("not supported by this server")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias):
        for key, value in (bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"values must be in [-100, 100], got {value} for token {key}")
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM: only together with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams fields that map one to one; None means the engine default."""
        kwargs = dict(
            n=self.n, seed=self.seed, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [], skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            prompt_logprobs=self.prompt_logprobs, cache_salt=self.cache_salt,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
        )
        return {k: v for k, v in kwargs.items() if v is not None}

    def build_params(self, max_tokens: int | None, default_max_tokens: int | None,
                     max_model_len: int, prompt_len: int, **extra) -> SamplingParams:
        """SamplingParams with the token budget resolved against the context length: the
        request's one context-length check (actors/request.py)."""
        try:
            max_tokens = resolve_max_tokens(max_tokens, prompt_len, max_model_len, default_max_tokens)
        except ContextLengthError as exc:
            raise context_length_error(exc, self.prompt_field) from None
        try:
            return SamplingParams(max_tokens=max_tokens, **{**self.sampling_kwargs(), **extra})
        except ValueError as exc:  # SamplingParams puts the field name first
            raise RequestError(str(exc), param=str(exc).split()[0]) from exc


def context_length_error(exc: ContextLengthError, prompt_field: str = "prompt") -> RequestError:
    """OpenAI's error for it: the field to shorten is max_tokens unless the prompt alone is too long."""
    return RequestError(str(exc), param="max_tokens" if exc.prompt_len < exc.max_model_len else prompt_field,
                        code="context_length_exceeded")


class ChatCompletionRequest(SamplingRequest):
    prompt_field: ClassVar[str] = "messages"
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # How hard a reasoning model thinks: templates that know it (gpt-oss's) take it as a kwarg.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM extras
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs, with reasoning_effort unless they set it themselves."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, top_logprobs, info: ValidationInfo):
        if top_logprobs and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return top_logprobs

    def to_sampling_params(self, default_max_tokens: int | None, max_model_len: int,
                           prompt_len: int, **extra) -> SamplingParams:
        """extra: fields the output plan sets (actors/protocol/chat_output.py: constraint)."""
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.build_params(max_tokens, default_max_tokens, max_model_len, prompt_len,
                                 logprobs=logprobs, **extra)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's legacy default
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)  # OpenAI allows 5; vLLM up to 20
    suffix: str | None = None
    best_of: int | None = None
    return_token_ids: bool = False  # vLLM's: each choice carries its prompt and output token ids

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt):
        if not prompt or any(isinstance(p, list) and not p for p in prompt):
            raise ValueError("prompt must not be empty")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _reject_suffix(cls, suffix):
        if suffix is not None:
            raise ValueError("suffix is not supported")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, best_of, info: ValidationInfo):
        if best_of is not None and best_of != info.data.get("n", 1):
            raise ValueError("best_of is not supported (use n)")
        return best_of

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    def to_sampling_params(self, default_max_tokens: int | None, max_model_len: int,
                           prompt_len: int, **extra) -> SamplingParams:
        # echo with logprobs also scores the prompt tokens, which needs prompt logprobs.
        extra["logprobs"] = self.logprobs
        if self.echo and self.logprobs is not None:
            extra["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        return self.build_params(self.max_tokens, default_max_tokens, max_model_len,
                                 prompt_len, **extra)


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered with the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (vLLM's)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        return self


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


# --------------------------------------------------------------------------- responses

def random_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=lambda v: not v)
    reasoning_content: str | None = Field(None, exclude_if=lambda v: v is None)


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extra: the stop string or token that matched


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    """Only the fields a chunk carries appear (OpenAI sends `{}` on the final chunk)."""
    role: Literal["assistant"] | None = Field(None, exclude_if=lambda v: v is None)
    content: str | None = Field(None, exclude_if=lambda v: v is None)
    reasoning_content: str | None = Field(None, exclude_if=lambda v: v is None)
    tool_calls: list[dict[str, Any]] | None = Field(None, exclude_if=lambda v: v is None)


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl-"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "shoal"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class LoadLoraAdapterRequest(OpenAIModel):
    """POST /v1/load_lora_adapter (vLLM's shape)."""
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(OpenAIModel):
    """POST /v1/unload_lora_adapter (vLLM's shape; lora_int_id is accepted and unused)."""
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# --------------------------------------------------------------------------- errors

def error_body(message: str, param: str | None = None, code: str | None = None,
               type: str = "invalid_request_error") -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=param,
                                         code=code)).model_dump()


def validation_error_body(exc: ValidationError) -> dict[str, Any]:
    """One pydantic error as an OpenAI error body; `param` is the dotted field path.

    A union field reports one error per member; the deepest one is the most specific
    (e.g. an image part in `content` fails on `content.0.type`, not on "not a string").
    """
    paths = [[str(p) for p in e["loc"] if not _is_union_tag(p)] for e in exc.errors()]
    deepest = max(range(len(paths)), key=lambda i: len(paths[i]))
    param = ".".join(paths[deepest]) or None
    message = exc.errors()[deepest]["msg"].removeprefix("Value error, ")
    return error_body(f"{param}: {message}" if param else message, param=param,
                      code="invalid_value")


def request_error_body(exc: ValueError) -> dict[str, Any]:
    return error_body(str(exc), getattr(exc, "param", None), getattr(exc, "code", None))


def _is_union_tag(part) -> bool:
    # pydantic puts the union member in the location: "str", "list[int]", "NamedToolChoice".
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part
                                      or part[:1].isupper() or part.startswith("function-"))
