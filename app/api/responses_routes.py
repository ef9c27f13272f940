"""POST /v1/responses: the OpenAI Responses API, stateless (nothing is stored).

The request becomes the chat request with the same prompt (app/protocol/responses_api.py),
which runs through the chat route's steps: template, output plan (the server's reasoning and
tool-call parsers), sampling params and constraints. Only the body differs: output items
instead of choices, and the Responses event stream (app/protocol/responses_output.py).
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from app.api import limits
from app.api.errors import bad_request
from app.api.openai_routes import chat_prompt, sampling_params
from app.api.request_context import Served
from app.protocol.chat_output import plan_output
from app.protocol.models import RequestError
from app.protocol.responses_api import ResponsesRequest, to_chat_request
from app.protocol.responses_output import ResponseShell, ResponsesStream, whole_response

router = APIRouter(tags=["OpenAI"])


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    served = await Served.ready(request, body.model)
    try:
        chat = to_chat_request(body)
    except RequestError as exc:
        raise bad_request(exc) from None
    limits.check(chat, request.app.state.settings)  # the limits name the chat request's fields
    text, ids = chat_prompt(served, chat)
    plan = plan_output(served.settings, served.tokenizer, chat, text)
    params = sampling_params(served, chat, len(ids), plan)
    shell = ResponseShell(body, served.model_name)
    if body.stream:
        stream = ResponsesStream(shell, plan, served.tokenizer)
        return await served.stream([ids], [params], chat.priority, opening=stream.opening(),
                                   to_chunks=lambda batch: stream.chunks(batch[0]),
                                   closing=lambda: [])
    outputs = await served.complete([ids], [params], chat.priority)
    return JSONResponse(whole_response(shell, outputs[0], plan, served.tokenizer))
