"""POST /v1/responses end to end: uvicorn on 127.0.0.1, a real engine on a tiny random
checkpoint, the official `openai` client's `responses.create`, streamed and not.

As in tests/test_tools_api.py, outputs a random model would never write (tool calls, JSON,
a think block) are forced the way a user would force them: tool_choice, text.format, or
vLLM's guided_regex.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from test_api import running

from actors.config import EngineConfig
from app.api.app import attach, build_api
from app.api.engine_client import LocalEngineClient
from app.api.settings import ServerSettings

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": WEATHER}]
THOUGHT = r"<think>\n[a-z]{3,8} [a-z]{3,8}\n</think>\n\n(yes|no)"
QUESTION = "What is the weather in Paris?"
EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
          "response.content_part.added", "response.output_text.delta"]
TEXT_END = ["response.output_text.done", "response.content_part.done",
            "response.output_item.done"]


@pytest.fixture(scope="module")
def ckpt(checkpoint_factory):
    return checkpoint_factory("llama", max_position_embeddings=2048)  # prompts with tools are long


@pytest.fixture(scope="module")
def url(ckpt):
    engine = LocalEngineClient(EngineConfig(model_path=str(ckpt), num_kv_blocks=800))
    settings = ServerSettings(model_path=str(ckpt), reasoning_parser="qwen3")
    with running(attach(build_api(settings), engine, engine.tokenizer, settings)) as base:
        yield base
    engine.shutdown()


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(ckpt):
    return ckpt.name


def types(events) -> list[str]:
    return [e.type for e in events]


def test_text_response_equals_chat_and_its_stream(oai, model):
    kwargs = dict(model=model, instructions="Answer briefly.", input=QUESTION,
                  max_output_tokens=12, temperature=0)
    r = oai.responses.create(**kwargs)
    chat = oai.chat.completions.create(
        model=model, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": QUESTION}])
    assert r.object == "response" and r.id.startswith("resp_") and r.store is False
    assert r.output_text == chat.choices[0].message.content
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"

    events = list(oai.responses.create(stream=True, **kwargs))
    assert types(events)[:5] == EVENTS
    assert types(events)[-4:-1] == TEXT_END
    assert types(events)[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens


def test_input_items_and_a_tool_round_trip(oai, model):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris", "unit": "celsius"}'}
    r = oai.responses.create(model=model, tools=TOOLS, max_output_tokens=4, input=[
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}, call,
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature": 21}'}])
    assert r.status in ("completed", "incomplete") and r.usage.input_tokens > 50


def test_forced_function_call_streamed_and_not(oai, model):
    kwargs = dict(model=model, input=QUESTION, tools=TOOLS, temperature=1.0,
                  tool_choice={"type": "function", "name": "get_weather"},
                  max_output_tokens=120, extra_body={"seed": 3})
    r = oai.responses.create(**kwargs)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and r.status == "completed"
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)

    events = list(oai.responses.create(stream=True, **kwargs))
    kinds = types(events)
    at = kinds.index("response.function_call_arguments.delta")
    assert kinds[at - 1:at + 3] == ["response.output_item.added", "response.function_call_arguments.delta",
                                    "response.function_call_arguments.done", "response.output_item.done"]
    added, done = events[at - 1].item, events[at + 2].item
    assert added.type == "function_call" and added.status == "in_progress"
    assert events[at].delta == events[at + 1].arguments == done.arguments == calls[0].arguments
    assert kinds[-1] == "response.completed"
    assert [i.type for i in events[-1].response.output] == [i.type for i in r.output]


def test_json_schema_text_format(oai, model):
    fmt = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}}
    for seed in (1, 2):
        r = oai.responses.create(model=model, input=QUESTION, text=fmt, temperature=1.0,
                                 max_output_tokens=80, extra_body={"seed": seed})
        jsonschema.validate(json.loads(r.output_text), WEATHER)
        assert r.text.format.type == "json_schema"


def test_reasoning_item_streamed_and_not(oai, model):
    kwargs = dict(model=model, input=QUESTION, max_output_tokens=40, temperature=1.0,
                  extra_body={"guided_regex": THOUGHT, "seed": 1})
    r = oai.responses.create(**kwargs)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert reasoning.content[0].type == "reasoning_text"
    assert len(reasoning.content[0].text.split()) == 2 and r.output_text in ("yes", "no")
    assert r.usage.output_tokens_details.reasoning_tokens > 0

    events = list(oai.responses.create(stream=True, **kwargs))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == reasoning.content[0].text
    assert types(events).index("response.reasoning_text.done") < types(events).index(
        "response.output_text.delta")
    assert events[-1].response.output_text == r.output_text


def test_stateless_and_bad_input_are_400s(url, oai, model):
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model=model, input="hi", previous_response_id="resp_123")
    assert info.value.body["param"] == "previous_response_id"
    assert "does not store responses" in info.value.body["message"]
    bad = [({"input": []}, "input"),
           ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.message.content"),
           ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
           ({"input": "hi", "max_output_tokens": 100_000}, "max_tokens")]
    for body, param in bad:
        r = httpx.post(f"{url}/v1/responses", json={"model": model, **body}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"].startswith(param), r.json()
