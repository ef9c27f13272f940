"""The web chat page (GET /) in a real headless Chromium: type, send, watch the answer
stream in, a second turn that carries the first, the Stop button aborting the request on
the server, and the API key the page sends.

The server is the real API on 127.0.0.1 over the real engine on a tiny checkpoint, with an API
key. Its engine client records prompts and, in "slow" mode, reads the engine's stream slowly
and asks for the whole context, so Stop has something to stop however fast the machine is.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time

import httpx
import openai
import pytest
from browser import chromium_page, find_chromium

from actors.config import EngineConfig
from app.api.app import attach, build_api
from app.api.embedded import serve_in_thread
from app.api.engine_client import LocalEngineClient
from app.api.settings import ServerSettings

KEY = "sekret"
CHROMIUM = find_chromium()


class ScriptedClient:
    """The real engine, recording prompts; in mode "slow" its stream is read slowly (and runs to
    the end of the context), so a person has time to press Stop."""

    def __init__(self, inner):
        self.inner, self.tokenizer = inner, inner.tokenizer
        self.max_model_len = inner.max_model_len
        self.mode, self.prompts, self.closed = "real", [], []

    def generate(self, request):
        self.prompts.append(self.tokenizer.decode(request.prompt_token_ids))
        if self.mode == "slow":
            params = dataclasses.replace(request.params, ignore_eos=True,
                                         max_tokens=self.max_model_len - len(request.prompt_token_ids))
            return self.slow(dataclasses.replace(request, params=params))
        return self.inner.generate(request)

    async def slow(self, request):
        finished = False
        try:
            async for out in self.inner.generate(request):
                finished = out.finished
                yield out
                await asyncio.sleep(0.05)
        finally:  # closed before the end: the server stopped reading, as it does on Stop
            if not finished:
                self.closed.append(request.request_id)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def engine(llama_ckpt):
    client = ScriptedClient(LocalEngineClient(EngineConfig(model_path=str(llama_ckpt),
                                                           num_kv_blocks=128)))
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def server(engine, llama_ckpt):
    settings = ServerSettings(model_path=str(llama_ckpt), api_key=KEY)
    with serve_in_thread(attach(build_api(settings), engine, engine.tokenizer, settings)) as url:
        yield url


def test_page_is_open_but_the_api_is_not(server):
    page = httpx.get(server + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="send"' in page.text and "chat/completions" in page.text
    assert httpx.get(server + "/v1/models").status_code == 401  # the key still guards the API


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH: apt-get install -y chromium "
                                              "(make test does) or set SHOAL_CHROMIUM")
def test_chat_in_headless_chromium(server, engine):
    oai = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
    with chromium_page(CHROMIUM) as page:
        page.goto(server + "/")
        page.type_into("#api-key", KEY)
        page.js("document.getElementById('api-key').dispatchEvent(new Event('change'))")
        page.wait_for("document.getElementById('model').textContent.length > 0", what="model name")
        page.js("document.getElementById('temperature').value = '0';"
                "document.getElementById('max-tokens').value = '8'")

        first = ask(page, "Tell me about the fox")
        expected = oai.chat.completions.create(
            model=oai.models.list().data[0].id, temperature=0, max_tokens=8,
            messages=[{"role": "user", "content": "Tell me about the fox"}])
        assert first == expected.choices[0].message.content
        stats = page.js("document.getElementById('stats').textContent")
        assert f"{expected.usage.completion_tokens} tokens" in stats and "TTFT" in stats

        ask(page, "And the dog?")
        second = engine.prompts[-1]  # the second turn carries the first
        assert "Tell me about the fox" in second and first in second and "And the dog?" in second

        engine.mode = "slow"
        try:
            check_stop(page, engine)
        finally:
            engine.mode = "real"


def ask(page, text: str) -> str:
    """Type a message, send it, wait for the answer to finish; returns the answer's text."""
    answers = page.js("document.querySelectorAll('.msg.assistant').length")
    page.type_into("#input", text)
    page.js("document.getElementById('send').click()")
    page.wait_for(f"document.querySelectorAll('.msg.assistant').length === {answers + 1} && "
                  "document.body.dataset.state === 'idle'", what="the answer")
    assert not page.js("document.querySelector('.msg.error')"), page.js(
        "document.querySelector('.msg.error').textContent")
    return page.js("[...document.querySelectorAll('.msg.assistant')].pop().textContent")


def check_stop(page, engine) -> None:
    """Stop mid-stream: text was showing while streaming, the page settles, the server aborts."""
    page.type_into("#input", "Go on forever")
    page.js("document.getElementById('send').click()")
    # A rate needs two tokens; one token may already be longer than 3 characters.
    page.wait_for("document.body.dataset.state === 'streaming' && "
                  "[...document.querySelectorAll('.msg.assistant')].pop().textContent.length > 3 && "
                  "document.getElementById('stats').textContent.includes('tok/s')",
                  what="streamed text and its rate")
    page.js("document.getElementById('stop').click()")
    page.wait_for("document.body.dataset.state === 'idle'", what="the page to stop")
    assert page.js("[...document.querySelectorAll('.msg.assistant')].pop().textContent"
                   ".endsWith('[stopped]')")
    wait_closed(engine)


def wait_closed(engine, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not engine.closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.closed, "the server did not abort the stopped request"
