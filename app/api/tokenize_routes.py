"""vLLM's /tokenize and /detokenize: the server's own tokenizer and chat template, no engine.

Clients count tokens against `max_model_len` before sending a request, or check what the
chat template makes of their messages.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from app.api import limits
from app.api.errors import ApiError, bad_request
from app.api.request_context import Served
from app.protocol.chat_template import render_chat_text
from app.protocol.models import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse

router = APIRouter(tags=["Tokenizer"])


def tokenize_ids(served: Served, body: TokenizeRequest) -> list[int]:
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        return served.tokenizer.encode(body.prompt, add_special_tokens=add_special)
    try:
        text = render_chat_text(served.tokenizer, body.messages, body.tools,
                                body.add_generation_prompt, body.chat_template_kwargs,
                                served.settings.disable_thinking)
    except ValueError as exc:
        raise bad_request(exc, param="messages") from None
    # The template writes the special tokens itself (as chat requests encode it).
    return served.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request):
    limits.check(body, request.app.state.settings)
    served = await Served.ready(request, body.model)
    ids = tokenize_ids(served, body)
    strs = served.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=served.max_model_len,
                                         tokens=ids, token_strs=strs).model_dump())


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request):
    served = await Served.ready(request, body.model)
    vocab = len(served.tokenizer)
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"tokens: {bad} is not a token id of this model (0..{vocab - 1})",
                       param="tokens", code="invalid_value")
    text = served.tokenizer.decode(body.tokens)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())
