"""Scoring routes for evaluation clients: /generate (batch completions) and /loglikelihood.

Every prompt of a batch is its own engine request, all submitted at once so continuous
batching runs them together.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field, field_validator

from actors.request import ContextLengthError, resolve_max_tokens
from actors.sampling_params import SamplingParams
from app.api import limits
from app.api.errors import ApiError, bad_request
from app.api.request_context import Served
from app.protocol.models import OpenAIModel, RequestError, context_length_error
from app.protocol.responses import usage

router = APIRouter(tags=["Scoring"])


def as_list(value):
    # A lone prompt is a batch of one.
    return [value] if isinstance(value, str) else value


class GenerateRequest(OpenAIModel):
    model: str | None = None
    prompts: list[str | list[int]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)  # None: --default-max-tokens, capped by context
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None

    @field_validator("prompts", mode="before")
    @classmethod
    def _lone_prompt(cls, value):
        return as_list(value)


class LoglikelihoodRequest(OpenAIModel):
    model: str | None = None
    prompts: list[str] = Field(min_length=1)
    continuations: list[str] = Field(min_length=1)

    @field_validator("prompts", "continuations", mode="before")
    @classmethod
    def _lone_prompt(cls, value):
        return as_list(value)


def generate_params(served: Served, body: GenerateRequest, prompt_len: int) -> SamplingParams:
    try:
        max_tokens = resolve_max_tokens(body.max_tokens, prompt_len, served.max_model_len,
                                        served.settings.default_max_tokens)
    except ContextLengthError as exc:
        raise bad_request(context_length_error(exc)) from None
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature,
                              top_p=body.top_p, seed=body.seed, stop=body.stop or [])
    except ValueError as exc:  # SamplingParams names the field first
        raise bad_request(RequestError(str(exc), param=str(exc).split()[0])) from None


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request):
    """`{prompts, max_tokens, temperature, top_p, seed, stop}` -> `{completions, usage}`."""
    limits.check(body, request.app.state.settings)
    served = await Served.ready(request, body.model)
    prompts = [served.encode(p) for p in body.prompts]
    params = [generate_params(served, body, len(ids)) for ids in prompts]
    outputs = await served.complete(prompts, params)
    results = [outputs[i] for i in range(len(prompts))]
    return JSONResponse({
        "completions": [r.outputs[0].text for r in results],
        "finish_reasons": [r.outputs[0].finish_reason for r in results],
        "usage": usage(sum(len(r.prompt_token_ids) for r in results),
                       sum(len(r.outputs[0].token_ids) for r in results)).model_dump(),
    })


# --------------------------------------------------------------------------- loglikelihood

# One forward over prompt + continuation: the prompt log-probs are the scores (the one
# sampled token is thrown away; max_tokens=0 would finish before the prefill runs).
SCORING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)


def scoring_ids(served: Served, prompt: str, continuation: str) -> tuple[list[int], int]:
    """(prompt ids + continuation ids, where the continuation starts)."""
    context = served.encode(prompt)
    if not context:  # the first continuation token needs something to be conditioned on
        tok = served.tokenizer
        context = [tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id]
    ids = context + served.tokenizer.encode(continuation, add_special_tokens=False)
    if len(ids) + 1 > served.max_model_len:
        raise ApiError(400, f"This model's maximum context length is {served.max_model_len} "
                            f"tokens; scoring needs {len(ids) + 1} ({len(context)} in the prompt, "
                            f"{len(ids) - len(context)} in the continuation, 1 generated).",
                       param="continuations", code="context_length_exceeded")
    return ids, len(context)


@router.post("/loglikelihood")
async def loglikelihood(body: LoglikelihoodRequest, request: Request):
    """`{prompts, continuations}` -> `{ll}`: log P(continuation | prompt), summed over tokens."""
    limits.check(body, request.app.state.settings)
    served = await Served.ready(request, body.model)
    if len(body.prompts) != len(body.continuations):
        raise ApiError(400, f"prompts has {len(body.prompts)} entries and continuations has "
                            f"{len(body.continuations)}; they must match", param="continuations")
    pairs = [scoring_ids(served, p, c) for p, c in zip(body.prompts, body.continuations)]
    todo = [i for i, (ids, start) in enumerate(pairs) if start < len(ids)]  # empty scores 0
    outputs = await served.complete([pairs[i][0] for i in todo], [SCORING_PARAMS] * len(todo))
    ll = [0.0] * len(pairs)
    for k, i in enumerate(todo):
        ids, start = pairs[i]
        positions = outputs[k].prompt_logprobs
        ll[i] = sum(positions[j][ids[j]] for j in range(start, len(ids)))
    return JSONResponse({"ll": ll})
