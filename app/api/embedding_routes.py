"""POST /v1/embeddings: a vector per input from the served model's final hidden states.

Every input is its own engine request, all submitted at once so continuous batching runs them
together (and beside generation requests). The engine pools each prompt as the checkpoint says
(actors/worker/pooling_config.py) and answers with the vector instead of tokens.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from actors.pooling_params import PoolingParams
from actors.sampling_params import SamplingParams
from app.api import limits
from app.api.errors import bad_request
from app.api.request_context import Served
from app.protocol import embeddings

router = APIRouter(tags=["OpenAI"])

EMBEDDING_PARAMS = SamplingParams(max_tokens=0)  # an embedding request generates nothing


@router.post("/v1/embeddings", response_model=embeddings.EmbeddingResponse)
async def create_embedding(body: embeddings.EmbeddingRequest, request: Request):
    limits.check(body, request.app.state.settings)
    served = await Served.ready(request, body.model)
    prompts = [served.encode(p) for p in body.prompts()]
    try:
        for ids in prompts:
            embeddings.check_input_length(ids, served.max_model_len)
    except ValueError as exc:
        raise bad_request(exc) from None
    outputs = await served.complete(prompts, [EMBEDDING_PARAMS] * len(prompts),
                                    pooling=PoolingParams(dimensions=body.dimensions))
    ordered = [outputs[i] for i in range(len(prompts))]
    response = embeddings.embedding_response(ordered, served.model_name, body.encoding_format)
    return JSONResponse(response.model_dump())
