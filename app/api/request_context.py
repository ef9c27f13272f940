"""What a route needs from the app hosting it, and the two ways a route runs engine requests.

The host (`attach`) puts each model it serves (engine client, tokenizer, settings) on
`app.state`; `Served` is the state of the model a request names, with its request id.
`complete` waits for whole outputs, `stream` answers with server-sent events; both abort the
engine requests when the client goes away (see app/api/streams.py).
"""
from __future__ import annotations

import logging
import secrets
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from fastapi import Request

from actors.pooling_params import PoolingParams
from actors.request import EngineRequest, prompt_ids
from actors.sampling_params import SamplingParams
from app.api.engine_client import EngineClient
from app.api.errors import ApiError, engine_error, internal_error, not_ready, unknown_model
from app.api.middleware import new_request_id
from app.api.readiness import is_ready
from app.api.request_log import EngineSummary
from app.api.settings import ServerSettings
from app.api.streams import (
    Batch, ClientDisconnected, EngineStreams, EventStream, collect, event_body, unless_disconnected,
)

log = logging.getLogger("shoal.api")

LOG_TEXT_CHARS = 500  # log_requests=2 cuts prompts and outputs to this many characters


@dataclass
class Served:
    request: Request
    client: EngineClient
    tokenizer: object
    settings: ServerSettings
    request_id: str
    texts: dict = field(default_factory=lambda: defaultdict(str))  # (prompt, seq) -> text, for logs
    summary: EngineSummary = field(default_factory=EngineSummary)  # for the request's log line
    lora: str | None = None  # the LoRA adapter `model` names (None: the base model)
    sampling_defaults: dict = field(default_factory=dict)  # the model's generation_config.json values

    @classmethod
    def of(cls, request: Request, model: str | None = None) -> Served:
        """The state of the model `model` names (one the app serves by that name, else the
        default model, whose LoRA adapter it may name)."""
        models = getattr(request.app.state, "models", None)
        if not models:  # built but not attached to an engine yet
            raise not_ready()
        chosen = next((m for m in models if model and model in m.settings.model_names()), models[0])
        request_id = getattr(request.state, "request_id", None) or new_request_id()
        served = cls(request, chosen.client, chosen.tokenizer, chosen.settings, request_id,
                     sampling_defaults=chosen.sampling_defaults)
        request.state.engine_summary = served.summary  # the middleware logs it at the end
        return served

    @classmethod
    async def ready(cls, request: Request, model: str | None) -> Served:
        """The state for a request that will use the engine: known model, engine ready."""
        served = cls.of(request, model)
        served.check_model(model)
        await served.ensure_ready()
        return served

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name

    @property
    def max_model_len(self) -> int:
        return self.settings.max_model_len or self.client.max_model_len

    def check_model(self, model: str | None) -> None:
        """The base model (or none named), else a LoRA adapter's name: the engine refuses
        one it does not have with a 404 (replicas may load adapters at run time)."""
        if not model or model in self.settings.model_names():  # omitted: the one model served
            return
        if not getattr(self.client, "lora_enabled", False):
            raise unknown_model(model)
        self.lora = model

    async def ensure_ready(self) -> None:
        # The gate (app/api/readiness.py) has checked already; this covers an app built
        # without it. Cached, so it costs nothing once ready.
        if not await is_ready(self.request.app.state):
            raise not_ready()

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Prompt token ids, as the offline LLM makes them (special tokens added)."""
        return prompt_ids(self.tokenizer, prompt)

    # ---- running engine requests -------------------------------------------------------
    def open_streams(self, prompts: list[list[int]], params: list[SamplingParams],
                     priority: int = 0, whole: bool = False,
                     pooling: PoolingParams | None = None) -> EngineStreams:
        """whole: only finished outputs are needed (the engine sends each request's once).
        pooling: embedding requests (params: SamplingParams(max_tokens=0))."""
        generators = []
        for index, (ids, p) in enumerate(zip(prompts, params)):
            # The request id prefixes the engine id (grep finds both); the random tail keeps
            # engine ids unique when clients reuse an X-Request-Id.
            engine_id = f"{self.request_id}-{index}-{secrets.token_hex(3)}"
            self.log_engine_request(engine_id, ids, p)
            request = EngineRequest(engine_id, ids, p, priority, self.lora, whole=whole, pooling=pooling)
            generators.append(self.client.generate(request))
        return EngineStreams(generators)

    async def complete(self, prompts: list[list[int]], params: list[SamplingParams],
                       priority: int = 0, pooling: PoolingParams | None = None) -> Batch:
        """Cumulative outputs by prompt index; a client that leaves aborts them."""
        streams = self.open_streams(prompts, params, priority, whole=True, pooling=pooling)
        try:
            outputs = await unless_disconnected(self.request.receive, collect(streams))
        except Exception as exc:
            raise self.refusal(exc) from None
        finally:
            await streams.aclose()
        self.log_outputs(outputs)
        self.flush_output_log()
        return outputs

    async def stream(self, prompts: list[list[int]], params: list[SamplingParams], priority: int,
                     opening: list[dict], to_chunks: Callable[[Batch], list[dict]],
                     closing: Callable[[], list[dict]]) -> EventStream:
        """An SSE response. The status line waits for the first output, so a refusal (queue
        full, prompt too long) is still a proper HTTP error; the first token leaves at once."""
        streams = self.open_streams(prompts, params, priority)
        try:
            first = await unless_disconnected(self.request.receive, streams.next_batch())
        except Exception as exc:
            await streams.aclose()
            raise self.refusal(exc) from None
        except BaseException:  # cancelled by the server: stop the engine requests too
            await streams.aclose()
            raise

        def chunks(batch: Batch) -> list[dict]:
            self.log_outputs(batch)
            return to_chunks(batch)

        def close() -> list[dict]:
            self.flush_output_log()
            return closing()

        return EventStream(event_body(streams, first, opening, chunks, close, self.stream_error))

    def refusal(self, exc: Exception) -> Exception:
        """The HTTP error for an engine refusal; other exceptions pass on unchanged."""
        if isinstance(exc, ClientDisconnected):
            return ApiError(499, "The client closed the connection.", code="client_closed")
        return engine_error(exc) or exc

    def stream_error(self, exc: BaseException) -> dict:
        """The error event for a failure after the stream began."""
        error = engine_error(exc)
        if error is None:
            log.error("%s stream failed", self.request_id, exc_info=exc)
            error = internal_error(self.request_id)
        return error.body()

    # ---- request logs (settings.log_requests) -----------------------------------------------
    def log_engine_request(self, engine_id: str, ids: list[int], params: SamplingParams) -> None:
        level = self.settings.log_requests
        if level >= 1:
            log.info("%s engine request %s: %d prompt tokens, %s", self.request_id, engine_id,
                     len(ids), params)
        if level >= 2:
            log.info("%s prompt: %r", engine_id, self.cut(self.tokenizer.decode(ids)))

    def log_outputs(self, batch: Batch) -> None:
        """Collect output text (streams send deltas); `flush_output_log` writes it at the end."""
        self.summary.add(batch)
        if self.settings.log_requests < 2:
            return
        for index, output in batch.items():
            for out in output.outputs:
                self.texts[(index, out.index)] += out.text

    def flush_output_log(self) -> None:
        for (index, seq), text in sorted(self.texts.items()):
            log.info("%s output %d.%d: %r", self.request_id, index, seq, self.cut(text))
        self.texts.clear()

    def cut(self, text: str) -> str:
        return text if self.settings.log_requests >= 3 else text[:LOG_TEXT_CHARS]
