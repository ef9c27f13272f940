"""/v1/embeddings in OpenAI's shape (vLLM's too): the request, and the response whose vectors
are floats or base64 (little-endian float32 bytes, what the openai client decodes)."""
from __future__ import annotations

import base64
import struct
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from actors.outputs import RequestOutput
from app.protocol.models import OpenAIModel, RequestError, now, random_id


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    # One text, several, one prompt's token ids, or several prompts' token ids.
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # the first N dimensions (Matryoshka)
    user: str | None = None  # accepted, as OpenAI's clients send it; not used

    @field_validator("input")
    @classmethod
    def _no_empty_input(cls, value):
        # OpenAI refuses empty inputs too: an empty prompt has no hidden state to pool.
        if not value:
            raise ValueError("input must not be empty")
        if isinstance(value, list) and not isinstance(value[0], int) and not all(value):
            raise ValueError("input must not contain an empty string or an empty list of token ids")
        return value

    def prompts(self) -> list[str | list[int]]:
        """One prompt per embedding, in the order of `data`."""
        if isinstance(self.input, str) or isinstance(self.input[0], int):
            return [self.input]
        return list(self.input)


def check_input_length(ids: list[int], max_model_len: int) -> None:
    """RequestError (400, context_length_exceeded) for an input longer than the context."""
    if len(ids) > max_model_len:
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens. However, you "
                           f"requested {len(ids)} tokens in the input for embedding generation. Please "
                           "reduce the length of the input.", param="input", code="context_length_exceeded")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a base64 string with encoding_format "base64"


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("embd-"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def embedding_response(outputs: list[RequestOutput], model: str, encoding_format: str) -> EmbeddingResponse:
    """outputs: the finished embedding requests, in input order."""
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return EmbeddingResponse(
        model=model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        data=[Embedding(index=i, embedding=encode_embedding(out.embedding, encoding_format))
              for i, out in enumerate(outputs)])
