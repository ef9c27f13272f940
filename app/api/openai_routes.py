"""The OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models.

A request's `model` is the served model, or a LoRA adapter's name (app/api/lora_routes.py
loads them); /v1/models lists the adapters with the base model as their `parent`.

Each route: validate (pydantic, in the signature), check the model and readiness, build the
prompt ids and SamplingParams (refusals are 400s naming the field), then either wait for
whole outputs or stream them. Bodies come from app/protocol/responses.py.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from actors.sampling_params import SamplingParams
from app.api import limits
from app.api.errors import bad_request, unknown_model
from app.api.request_context import Served
from app.protocol.chat_output import OutputPlan, constraint, plan_output, tools_in_use
from app.protocol.chat_template import render_chat_prompt
from app.protocol.generation_defaults import with_model_defaults
from app.protocol.models import (
    ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse, ModelCard,
    ModelList, random_id,
)
from app.protocol.responses import ChatStream, CompletionStream, chat_response, completion_response

router = APIRouter(tags=["OpenAI"])


def sampling_params(served: Served, body, prompt_len: int, plan: OutputPlan | None = None) -> SamplingParams:
    """The request's SamplingParams, built and checked once (its grammar and output plan
    included); a 400 naming the field, and for length the numbers, when they can't be."""
    try:
        return with_model_defaults(body, served.sampling_defaults).to_sampling_params(
            served.settings.default_max_tokens, served.max_model_len, prompt_len, **constraint(body, plan))
    except ValueError as exc:  # RequestError
        raise bad_request(exc) from None


def chat_prompt(served: Served, body: ChatCompletionRequest) -> tuple[str, list[int]]:
    tools = body.tools if tools_in_use(body) else None
    try:
        return render_chat_prompt(served.tokenizer, body.messages, tools,
                                  body.add_generation_prompt, body.template_kwargs(),
                                  served.settings.disable_thinking)
    except ValueError as exc:  # the template refused these messages
        raise bad_request(exc, param="messages") from None


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    limits.check(body, request.app.state.settings)
    served = await Served.ready(request, body.model)
    text, ids = chat_prompt(served, body)
    plan = plan_output(served.settings, served.tokenizer, body, text)
    params = sampling_params(served, body, len(ids), plan)
    response_id = random_id("chatcmpl-")
    if body.stream:
        stream = ChatStream(body, served.tokenizer, served.model_name, response_id, plan=plan,
                            prompt_tokens=len(ids))
        return await served.stream(
            [ids], [params], body.priority, opening=stream.role_chunks(),
            to_chunks=lambda batch: stream.chunks(batch[0]),
            closing=lambda: [c for c in [stream.usage_chunk()] if c])
    outputs = await served.complete([ids], [params], body.priority)
    return JSONResponse(chat_response(body, outputs[0], served.tokenizer, served.model_name,
                                      response_id, plan=plan))


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(body: CompletionRequest, request: Request):
    limits.check(body, request.app.state.settings)
    served = await Served.ready(request, body.model)
    prompts = [served.encode(p) for p in body.prompts()]
    params = [sampling_params(served, body, len(ids)) for ids in prompts]
    response_id = random_id("cmpl-")
    if body.stream:
        stream = CompletionStream(body, served.tokenizer, served.model_name, response_id,
                                  prompt_tokens=sum(map(len, prompts)))
        return await served.stream(
            prompts, params, body.priority, opening=[],
            to_chunks=lambda batch: [c for i, out in batch.items() for c in stream.chunks(out, i)],
            closing=lambda: [c for c in [stream.usage_chunk()] if c])
    outputs = await served.complete(prompts, params, body.priority)
    ordered = [outputs[i] for i in range(len(prompts))]
    return JSONResponse(completion_response(body, ordered, served.tokenizer, served.model_name,
                                            response_id))


def model_card(model) -> ModelCard:
    """The card of a ServedModel (app/api/app.py)."""
    settings = model.settings
    return ModelCard(id=settings.served_model_name, root=settings.model_path,
                     max_model_len=settings.max_model_len or getattr(model.client, "max_model_len", None))


async def model_cards(request: Request) -> list[ModelCard]:
    """Each model the app serves, followed by its registered LoRA adapters (their parent)."""
    cards = []
    for model in getattr(request.app.state, "models", []):
        base = model_card(model)
        cards.append(base)
        if getattr(model.client, "lora_enabled", False):
            cards += [ModelCard(id=a["name"], root=a["path"], parent=base.id, max_model_len=base.max_model_len)
                      for a in await model.client.list_loras()]
    return cards


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request):
    return JSONResponse(ModelList(data=await model_cards(request)).model_dump())


@router.get("/v1/models/{model:path}", response_model=ModelCard)
async def retrieve_model(model: str, request: Request):
    for served in getattr(request.app.state, "models", []):
        if model in served.settings.model_names():
            return JSONResponse(model_card(served).model_dump())
    for card in await model_cards(request):
        if card.id == model:
            return JSONResponse(card.model_dump())
    raise unknown_model(model)
