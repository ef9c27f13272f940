"""Engine output streams for one HTTP request: merge, coalesce, and abort on disconnect.

Abort rule: an engine request stops when its async generator is closed or cancelled. Every
way out of a request (finished, error, client gone, server cancelling the handler) goes
through `EngineStreams.aclose`, which cancels the pump tasks; the cancellation lands in the
engine generator's `await`, whose `finally` aborts the request and frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from actors.outputs import Pending, RequestOutput

log = logging.getLogger("shoal.api")

_DONE = object()  # a pump's last item: its engine generator has finished

Batch = dict[int, RequestOutput]  # prompt index -> one (merged) delta


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


class EngineStreams:
    """The delta outputs of one engine request per prompt, read together in batches.

    Each generator is pumped into one queue by its own task, so a reader can take everything
    that is ready without waiting: the first token leaves alone, and when the client (or the
    event loop) falls behind, the deltas that piled up leave as one chunk per sequence.
    """

    def __init__(self, generators: list[AsyncIterator[RequestOutput]]):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(generators)
        self._tasks = [asyncio.create_task(self._pump(i, g)) for i, g in enumerate(generators)]

    async def _pump(self, index: int, generator) -> None:
        try:
            async with contextlib.aclosing(generator):
                async for output in generator:
                    self._queue.put_nowait((index, output))
        except Exception as exc:  # raised again in the reader's task, which owns the response
            self._queue.put_nowait((index, exc))
        self._queue.put_nowait((index, _DONE))

    async def next_batch(self) -> Batch | None:
        """Wait for at least one output, then take all that are ready; None once all finished."""
        ready: list[tuple[int, RequestOutput]] = []
        while self._open and not ready:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            for index, item in items:
                if item is _DONE:
                    self._open -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    ready.append((index, item))
        return merge(ready) if ready else None

    async def aclose(self) -> None:
        """Stop every engine request still running (a no-op for finished ones)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def merge(ready: list[tuple[int, RequestOutput]]) -> Batch:
    """Fold the outputs of each prompt's request into one (fewer, larger chunks)."""
    by_prompt: dict[int, Pending] = {}
    for index, output in ready:
        by_prompt.setdefault(index, Pending()).add(output)
    return {index: by_prompt[index].output for index in sorted(by_prompt)}


async def collect(streams: EngineStreams) -> Batch:
    """Run to the end: one whole output per prompt index."""
    outputs: dict[int, Pending] = {}
    while (batch := await streams.next_batch()) is not None:
        for index, output in batch.items():
            outputs.setdefault(index, Pending()).add(output)
    return {index: pending.output for index, pending in outputs.items()}


# --------------------------------------------------------------------------- disconnects

async def wait_for_disconnect(receive: Receive) -> None:
    # The body has been read by now, so the next message is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, awaitable):
    """Await `awaitable`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            task.cancel()  # a no-op for the one that finished
        await asyncio.wait({work, watch})
    if work.cancelled():
        raise ClientDisconnected()
    return work.result()


class EventStream(StreamingResponse):
    """A server-sent-events response that notices a disconnect whatever the ASGI version,
    and always closes its body generator (whose `finally` closes the engine streams)."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], headers: dict[str, str] | None = None):
        # no-cache / no buffering: proxies must pass each event through as it is written.
        super().__init__(body, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                        **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({sending, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sending, watching):
                task.cancel()
            await asyncio.wait({sending, watching})
            if hasattr(self.body_iterator, "aclose"):
                await self.body_iterator.aclose()
        error = None if sending.cancelled() else sending.exception()
        if isinstance(error, Exception) and not isinstance(error, OSError):  # OSError: client left
            raise error


# --------------------------------------------------------------------------- SSE bodies

def sse(chunks: list[dict]) -> bytes:
    return b"".join(event_line(c) + b"data: " + json.dumps(c, ensure_ascii=False).encode()
                    + b"\n\n" for c in chunks)


def event_line(chunk: dict) -> bytes:
    # Responses API events name themselves in an `event:` line too, as OpenAI sends them;
    # chat and completion chunks (no `type`) are data only.
    kind = chunk.get("type")
    return f"event: {kind}\n".encode() if isinstance(kind, str) else b""


SSE_DONE = b"data: [DONE]\n\n"


async def event_body(streams: EngineStreams, first: Batch | None, opening: list[dict],
                     to_chunks: Callable[[Batch], list[dict]], closing: Callable[[], list[dict]],
                     on_error: Callable[[BaseException], dict]):
    """The SSE bytes of one response: the opening chunks with the first batch in one write,
    then one write per batch, the closing chunks (usage) and `[DONE]`. An engine failure
    mid-stream becomes an error event (the status line has gone already)."""
    try:
        yield sse(opening + (to_chunks(first) if first else []))
        while (batch := await streams.next_batch()) is not None:
            if chunks := to_chunks(batch):  # none when all new text is held back (stop prefix)
                yield sse(chunks)
        yield sse(closing()) + SSE_DONE
    except Exception as exc:
        yield sse([on_error(exc)]) + SSE_DONE
    finally:
        await streams.aclose()
