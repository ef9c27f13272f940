"""LoRA adapters at run time: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

vLLM's request bodies and plain-text answers. Behind the API key like every /v1 route. The
engine client registers the adapter on every replica (app/serving/llm_server.py); the
adapter's files are checked there, so a bad one is a 400 naming what is wrong and nothing
is registered. Unloading an unknown name is a 404; requests in flight on it finish.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from app.api.errors import ApiError, engine_error
from app.api.request_context import Served
from app.protocol.models import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

router = APIRouter(tags=["LoRA"])


def lora_client(request: Request) -> Served:
    served = Served.of(request)
    if not getattr(served.client, "lora_enabled", False):
        raise ApiError(400, "LoRA adapters are off: start the server with --enable-lora "
                            "(or --lora-modules).", code="lora_disabled")
    return served


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request):
    served = lora_client(request)
    if body.lora_name in served.settings.model_names():
        raise ApiError(400, f"`{body.lora_name}` is the base model's name.", param="lora_name")
    try:
        await served.client.load_lora(body.lora_name, body.lora_path)
    except Exception as exc:
        raise (engine_error(exc) or exc) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request):
    served = lora_client(request)
    try:
        await served.client.unload_lora(body.lora_name)
    except Exception as exc:
        raise (engine_error(exc) or exc) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
