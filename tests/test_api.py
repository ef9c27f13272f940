"""The HTTP API end to end: uvicorn on 127.0.0.1 in a thread, real HTTP, the official
`openai` client and raw httpx.

Two servers per module: `real` runs a LocalEngineClient over a tiny llama checkpoint;
`stub` runs a scripted EngineClient (queue full, dead engine, not ready, a bug) with an
API key and CORS on, so every refusal is reachable without timing tricks.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

import httpx
import openai
import pytest
from oracle import hf_prompt_logprobs

from actors.config import EngineConfig
from actors.engine.llm import LLM
from actors.errors import EngineDeadError, QueueFullError
from actors.outputs import CompletionOutput, RequestOutput
from actors.sampling_params import SamplingParams
from app.api.app import attach, build_api
from app.api.embedded import serve_in_thread
from app.api.engine_client import LocalEngineClient
from app.api.settings import ServerSettings
from app.api.streams import EngineStreams
from app.protocol.chat_template import render_chat_prompt

USER = [{"role": "user", "content": "Tell me about the quick brown fox."}]
KEY = "sekret"
ORIGIN = "http://ui.example"


# --------------------------------------------------------------------------- servers

running = serve_in_thread  # other test modules import it from here


@pytest.fixture(scope="module")
def engine(llama_ckpt):
    client = LocalEngineClient(EngineConfig(model_path=str(llama_ckpt), num_kv_blocks=640))
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def real(engine, llama_ckpt):
    settings = ServerSettings(model_path=str(llama_ckpt))
    with running(attach(build_api(settings), engine, engine.tokenizer, settings)) as url:
        yield url


@pytest.fixture(scope="module")
def oai(real):
    return openai.OpenAI(base_url=f"{real}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(llama_ckpt):
    return llama_ckpt.name  # the default served name: the checkpoint directory's name


class StubClient:
    """An EngineClient that answers "ok" or fails the way `mode` says."""
    max_model_len = 64

    def __init__(self):
        self.mode, self.is_ready, self.prompts, self.request_ids = "ok", True, [], []

    def generate(self, request):
        self.prompts.append(request.prompt_token_ids)
        self.request_ids.append(request.request_id)
        return self._outputs(request.prompt_token_ids, request.request_id)

    async def _outputs(self, ids, request_id):
        errors = {"queue_full": QueueFullError("3 requests are waiting (limit 2)"),
                  "dead": EngineDeadError("the engine failed: boom"),
                  "bug": RuntimeError("secret internal detail")}
        if self.mode in errors:
            raise errors[self.mode]
        out = CompletionOutput(0, "ok", [5], finish_reason=None)
        yield RequestOutput(request_id, ids, [out])
        if self.mode == "dies_midstream":
            await asyncio.sleep(0.05)  # after the first chunk has gone
            raise EngineDeadError("the engine failed: boom")
        yield RequestOutput(request_id, ids, [CompletionOutput(0, "!", [6], finish_reason="stop")],
                            finished=True)

    async def stats(self):
        return {"replicas": [{"engine_alive": self.mode != "dead"}]}

    async def ready(self):
        return self.is_ready


@pytest.fixture(scope="module")
def stub_app(engine):
    settings = ServerSettings(model_path="/models/stub", api_key=KEY, allowed_origins=[ORIGIN],
                              disable_thinking=True)
    app = attach(build_api(settings), StubClient(), engine.tokenizer, settings)
    with running(app) as url:
        yield app, url


@pytest.fixture()
def stub(stub_app):
    app, url = stub_app
    app.state.models[0].client.mode, app.state.models[0].client.is_ready = "ok", True
    return app, httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"})


def sse_events(response) -> list:
    """Parsed `data:` payloads of an SSE response ("[DONE]" kept as a string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(response, status: int, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert "Traceback" not in response.text
    return error


# --------------------------------------------------------------------------- chat

def test_chat_stream_text_equals_non_streaming(oai, model):
    whole = oai.chat.completions.create(model=model, messages=USER, max_tokens=24, temperature=0)
    chunks = list(oai.chat.completions.create(model=model, messages=USER, max_tokens=24,
                                              temperature=0, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert whole.usage.completion_tokens <= 24 and whole.usage.prompt_tokens > 0


def test_chat_usage_chunk_shape(real, model):
    body = {"model": model, "messages": USER, "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{real}/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 6
    assert all(c["usage"] is None and c["object"] == "chat.completion.chunk" for c in chunks)
    # Without include_usage there is no usage chunk.
    body.pop("stream_options")
    with httpx.stream("POST", f"{real}/v1/chat/completions", json=body) as response:
        assert all(e == "[DONE]" or e["choices"] for e in sse_events(response))


def test_chat_n2_streaming_and_not(oai, model):
    whole = oai.chat.completions.create(model=model, messages=USER, max_tokens=8, n=2, seed=3)
    assert [c.index for c in whole.choices] == [0, 1]
    chunks = oai.chat.completions.create(model=model, messages=USER, max_tokens=8, n=2, seed=3,
                                         stream=True)
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {c.index: c.message.content for c in whole.choices}


def test_stop_string_is_never_shown(oai, model):
    free = oai.chat.completions.create(model=model, messages=USER, max_tokens=24, temperature=0)
    text = free.choices[0].message.content
    # Two plain letters from the second half (the random model also writes U+FFFD).
    at = next(i for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].isalpha())
    stop = text[at:at + 2]
    cut = oai.chat.completions.create(model=model, messages=USER, max_tokens=24, temperature=0,
                                      stop=[stop])
    assert cut.choices[0].message.content == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    chunks = oai.chat.completions.create(model=model, messages=USER, max_tokens=24,
                                         temperature=0, stop=stop, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == cut.choices[0].message.content


def test_seed_reproducible_at_temperature_1(oai, model):
    def sample(seed):
        return oai.chat.completions.create(model=model, messages=USER, max_tokens=16,
                                           temperature=1.0, seed=seed).choices[0].message.content
    assert sample(11) == sample(11)
    assert len({sample(11), sample(12), sample(13)}) > 1


def test_chat_logprobs(oai, model):
    out = oai.chat.completions.create(model=model, messages=USER, max_tokens=6, temperature=0,
                                      logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: top-1


def test_vllm_extra_fields_are_honoured(oai, model):
    out = oai.completions.create(model=model, prompt="the", max_tokens=20, temperature=0,
                                 extra_body={"ignore_eos": True, "min_tokens": 20, "top_k": 1})
    assert out.usage.completion_tokens == 20


# --------------------------------------------------------------------------- completions

def test_completions_echo_token_ids_and_logprobs(oai, model, engine):
    ids = engine.tokenizer.encode("Once upon a time", add_special_tokens=True)
    out = oai.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0,
                                 echo=True, logprobs=2)
    choice = out.choices[0]
    assert choice.text.startswith(engine.tokenizer.decode(ids))
    assert len(choice.logprobs.tokens) == len(ids) + 5
    assert choice.logprobs.token_logprobs[0] is None  # the first prompt token has no context
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    assert out.usage.prompt_tokens == len(ids)


def test_completions_list_of_prompts_streaming_and_not(oai, model):
    prompts = ["The fox", "A small boat"]
    whole = oai.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    texts: dict[int, str] = {}
    for chunk in oai.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0,
                                        n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in whole.choices}


@pytest.fixture(scope="module")
def offline(llama_ckpt):
    return LLM(str(llama_ckpt), num_kv_blocks=32)


def test_greedy_http_equals_offline_engine(oai, model, offline, engine):
    ids = render_chat_prompt(engine.tokenizer, USER)[1]
    want = offline.generate(ids, SamplingParams(max_tokens=20, temperature=0))[0].outputs[0].text
    chat = oai.chat.completions.create(model=model, messages=USER, max_tokens=20, temperature=0)
    assert chat.choices[0].message.content == want
    text = "Shoals of fish move together"
    want = offline.generate(text, SamplingParams(max_tokens=20, temperature=0))[0].outputs[0].text
    assert oai.completions.create(model=model, prompt=text, max_tokens=20,
                                  temperature=0).choices[0].text == want


def test_models(oai, model, real):
    assert [m.id for m in oai.models.list().data] == [model]
    assert oai.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("nope")
    # `model` may be omitted: one model is served.
    r = httpx.post(f"{real}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == model


# --------------------------------------------------------------------------- scoring

def test_generate(real):
    body = {"prompts": ["The fox", "Once upon"], "max_tokens": 5, "temperature": 0}
    r = httpx.post(f"{real}/generate", json=body)
    assert r.status_code == 200
    out = r.json()
    assert len(out["completions"]) == 2 and out["usage"]["completion_tokens"] <= 10
    assert httpx.post(f"{real}/generate", json=body).json()["completions"] == out["completions"]


def test_loglikelihood_matches_transformers(real, engine, llama_ckpt):
    prompts, continuations = ["The quick brown", "Once upon a"], [" fox jumps", " time there"]
    r = httpx.post(f"{real}/loglikelihood", json={"prompts": prompts,
                                                  "continuations": continuations})
    assert r.status_code == 200
    tok = engine.tokenizer
    for prompt, cont, got in zip(prompts, continuations, r.json()["ll"]):
        context = tok.encode(prompt, add_special_tokens=True)
        ids = context + tok.encode(cont, add_special_tokens=False)
        want = sum(hf_prompt_logprobs(llama_ckpt, ids)[len(context) - 1:])
        assert got == pytest.approx(want, abs=1e-4)


def test_loglikelihood_length_mismatch(real):
    r = httpx.post(f"{real}/loglikelihood", json={"prompts": ["a", "b"], "continuations": ["c"]})
    assert_error(r, 400, "continuations")


# --------------------------------------------------------------------------- errors

@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "temperature": -1}, "temperature"),
    ({"messages": USER, "seed": 2**64}, "seed"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": USER, "max_tokens": 100_000}, "max_tokens"),
])
def test_invalid_fields_are_400_naming_the_field(real, body, param):
    error = assert_error(httpx.post(f"{real}/v1/chat/completions", json=body), 400, param)
    if param == "max_tokens":  # the numbers: the limit and what was asked
        assert "512" in error["message"] and "100000" in error["message"]


def test_an_infinite_temperature_is_400(real):
    """Python's JSON reads `Infinity`; -inf logits (banned tokens) / inf would be NaN."""
    body = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}'
    r = httpx.post(f"{real}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert_error(r, 400, "temperature")


def test_invalid_json_and_prompt_too_long(real, engine):
    r = httpx.post(f"{real}/v1/chat/completions", content=b'{"messages": [',
                   headers={"Content-Type": "application/json"})
    assert "JSON" in assert_error(r, 400)["message"]
    long_prompt = list(range(10, 10 + 600))
    r = httpx.post(f"{real}/v1/completions", json={"prompt": long_prompt, "max_tokens": 4})
    assert "512" in assert_error(r, 400, "prompt")["message"]


def test_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="gpt-9", messages=USER)
    assert info.value.body["param"] == "model"


def test_queue_full_dead_engine_not_ready_and_bugs(stub):
    app, http = stub
    chat = {"messages": USER, "max_tokens": 4}
    app.state.models[0].client.mode = "queue_full"
    r = http.post("/v1/chat/completions", json=chat)
    assert_error(r, 429) and r.headers["Retry-After"] == "1"
    r = http.post("/v1/chat/completions", json={**chat, "stream": True})
    assert_error(r, 429)  # refused before the stream starts: still a status, not an event
    app.state.models[0].client.mode = "dead"
    assert_error(http.post("/v1/completions", json={"prompt": "hi"}), 503)
    assert http.get("/health").status_code == 503
    app.state.models[0].client.mode = "bug"
    r = http.post("/v1/chat/completions", json=chat)
    assert_error(r, 500)
    assert "secret" not in r.text and r.headers["X-Request-Id"] in r.json()["error"]["message"]
    app.state.models[0].client.mode, app.state.models[0].client.is_ready, app.state.ready_seen = "ok", False, False
    assert_error(http.post("/v1/chat/completions", json=chat), 503)
    # Ready means ready: every route but the probes says so, /v1/models included.
    for r in (http.get("/v1/models"), http.post("/tokenize", json={"prompt": "hi"}),
              http.post("/v1/responses", json={"input": "hi"}), http.get("/version")):
        assert assert_error(r, 503)["code"] == "not_ready" and r.headers["Retry-After"]
    assert http.get("/readyz").status_code == 503 and http.get("/healthz").status_code == 200
    assert http.get("/health").status_code == 503
    app.state.models[0].client.is_ready = True
    assert http.get("/v1/models").status_code == 200
    assert http.get("/readyz").status_code == 200
    assert http.post("/v1/chat/completions", json=chat).status_code == 200


def test_failure_mid_stream_is_an_error_event(stub):
    app, http = stub
    app.state.models[0].client.mode = "dies_midstream"
    with http.stream("POST", "/v1/chat/completions",
                     json={"messages": USER, "stream": True}) as r:
        events = sse_events(r)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "engine_dead"


def test_api_key(stub):
    app, http = stub
    bare = httpx.Client(base_url=str(http.base_url))
    for path in ("/v1/models", "/health", "/stats", "/version"):
        assert_error(bare.get(path), 401)
    assert_error(bare.post("/v1/chat/completions", json={"messages": USER}), 401)
    wrong = {"Authorization": "Bearer nope"}
    assert_error(bare.post("/generate", json={"prompts": ["a"]}, headers=wrong), 401)
    assert bare.get("/healthz").status_code == 200 and bare.get("/readyz").status_code == 200
    assert http.get("/v1/models").json()["data"][0]["id"] == "stub"


def test_cors_off_by_default_and_on_with_origins(real, stub):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    off = httpx.options(f"{real}/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in off.headers
    app, http = stub
    on = http.options("/v1/chat/completions", headers=preflight)
    assert on.status_code == 200 and on.headers["access-control-allow-origin"] == ORIGIN
    r = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()


def test_disable_thinking_unless_the_request_says(stub, engine):
    app, http = stub
    http.post("/v1/chat/completions", json={"messages": USER})
    assert "<think>" in engine.tokenizer.decode(app.state.models[0].client.prompts[-1])
    http.post("/v1/chat/completions", json={"messages": USER,
                                            "chat_template_kwargs": {"enable_thinking": True}})
    assert "<think>" not in engine.tokenizer.decode(app.state.models[0].client.prompts[-1])


def test_request_id_echoed_and_logged(real, caplog):
    caplog.set_level(logging.INFO, logger="shoal.api")
    r = httpx.get(f"{real}/v1/models", headers={"X-Request-Id": "my-trace-42"})
    assert r.headers["X-Request-Id"] == "my-trace-42"
    generated = httpx.get(f"{real}/v1/models").headers["X-Request-Id"]
    assert generated.startswith("req-")
    unusable = "x" * 300  # too long for a header we echo and log: replaced
    assert httpx.get(f"{real}/v1/models", headers={"X-Request-Id": unusable}).headers[
        "X-Request-Id"].startswith("req-")
    time.sleep(0.1)  # the access line is written when the response has gone
    assert any("my-trace-42" in rec.getMessage() for rec in caplog.records)


def test_request_id_prefixes_engine_ids_and_request_logs(stub, caplog):
    app, http = stub
    caplog.set_level(logging.INFO, logger="shoal.api")
    model = app.state.models[0]
    app.state.models[0] = dataclasses.replace(model, settings=dataclasses.replace(model.settings, log_requests=2))
    try:
        http.post("/v1/completions", json={"prompt": ["The fox", "A boat"]},
                  headers={"X-Request-Id": "trace-7"})
    finally:
        app.state.models[0] = model
    assert all(rid.startswith("trace-7-") for rid in app.state.models[0].client.request_ids[-2:])
    logged = " ".join(rec.getMessage() for rec in caplog.records)
    assert "The fox" in logged and "trace-7 output 1.0: 'ok!'" in logged


def test_disable_log_requests_moves_each_requests_line_to_debug(stub, caplog):
    app, http = stub
    caplog.set_level(logging.INFO, logger="shoal.api")
    settings = app.state.settings
    app.state.settings = dataclasses.replace(settings, disable_log_requests=True)
    try:
        http.get("/v1/models", headers={"X-Request-Id": "quiet-1"})
    finally:
        app.state.settings = settings
    http.get("/v1/models", headers={"X-Request-Id": "loud-1"})
    logged = " ".join(rec.getMessage() for rec in caplog.records)
    assert "loud-1" in logged and "quiet-1" not in logged


def test_docs_and_probes(real):
    assert httpx.get(f"{real}/docs").status_code == 200
    paths = httpx.get(f"{real}/openapi.json").json()["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/generate", "/loglikelihood"} <= set(paths)
    assert httpx.get(f"{real}/health").json()["status"] == "ok"
    assert httpx.get(f"{real}/version").json()["version"]


# --------------------------------------------------------------------------- concurrency and aborts

def wait_idle(real, timeout=10.0) -> dict:
    """/stats of the one replica once nothing runs and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{real}/stats").json()["replicas"][0]
        idle = stats["running"] == 0 and stats["waiting"] == 0
        if idle and stats["kv_blocks_free"] == stats["kv_blocks_total"]:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


# 16 x 480 tokens: seconds of work even for the tiny model, so an abort shows in the counts.
LONG = {"prompt": ["The quick brown fox"] * 16, "max_tokens": 480, "ignore_eos": True}
LONG_TOKENS = 16 * 480


def test_cancelled_stream_frees_its_blocks(real):
    before = wait_idle(real)
    with httpx.stream("POST", f"{real}/v1/completions", json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # generation is under way
    after = wait_idle(real)  # closed mid-stream: aborted, blocks back in the pool
    assert after["generated_tokens"] - before["generated_tokens"] < LONG_TOKENS


def test_client_gone_aborts_a_non_streaming_request(real):
    before = wait_idle(real)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{real}/v1/completions", json=LONG, timeout=0.3)
    after = wait_idle(real)
    assert after["generated_tokens"] - before["generated_tokens"] < LONG_TOKENS


def test_64_concurrent_streams_complete(real, model):
    client = openai.AsyncOpenAI(base_url=f"{real}/v1", api_key="unused", max_retries=0)

    async def one(i):
        stream = await client.completions.create(model=model, prompt=f"Request {i}:",
                                                 max_tokens=8, stream=True,
                                                 extra_body={"ignore_eos": True})
        return [c.choices[0].finish_reason async for c in stream if c.choices][-1]

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    assert asyncio.run(all_of_them()) == ["length"] * 64
    wait_idle(real)


# --------------------------------------------------------------------------- streams unit

def delta(text, finished=False):
    out = CompletionOutput(0, text, [1], finish_reason="stop" if finished else None)
    return RequestOutput("r", [1, 2], [out], finished=finished)


def test_streams_send_first_at_once_then_coalesce_and_abort_on_close():
    async def scenario():
        gate, closed = asyncio.Event(), asyncio.Event()

        async def engine():
            try:
                yield delta("a")
                await gate.wait()  # the engine is busy: nothing more yet
                for piece in "bcd":
                    yield delta(piece)
                await asyncio.Event().wait()  # never finishes by itself
            finally:
                closed.set()  # where AsyncEngine.generate posts its abort

        streams = EngineStreams([engine()])
        first = await asyncio.wait_for(streams.next_batch(), 1.0)
        assert first[0].outputs[0].text == "a"
        gate.set()
        await asyncio.sleep(0.01)  # b, c and d pile up while the "client" is slow
        merged = await streams.next_batch()
        assert merged[0].outputs[0].text == "bcd" and merged[0].outputs[0].token_ids == [1] * 3
        await streams.aclose()
        assert closed.is_set()

    asyncio.run(scenario())
