"""Tool calls, structured outputs and reasoning end to end: uvicorn on 127.0.0.1, a real engine
on a tiny random checkpoint, the official `openai` client.

A random model follows no format by itself, so every test that needs a particular output gets
it the way a user would: tool_choice required/named, response_format or guided_* (constrained
decoding). The chat template renders tools Qwen-style, so the parser chosen is hermes.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_api import running

from actors.config import EngineConfig
from app.api.app import attach, build_api
from app.api.engine_client import LocalEngineClient
from app.api.settings import ServerSettings
from app.protocol.chat_template import render_chat_text
from app.protocol.models import ChatMessage, Tool

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 6},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "boolean"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# The hermes markup a Qwen model writes, forced with a regex so the test knows the output.
TWO_CALLS = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
             r'\{"city": "(Paris|Rome)", "unit": "celsius", "days": [1-3]\}\}\n</tool_call>\n'
             r'<tool_call>\n\{"name": "add", "arguments": \{"a": [1-9], "b": true\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def ckpt(checkpoint_factory):
    return checkpoint_factory("llama", max_position_embeddings=2048)  # prompts with tools are long


@pytest.fixture(scope="module")
def engine(ckpt):
    client = LocalEngineClient(EngineConfig(model_path=str(ckpt), num_kv_blocks=1600))
    yield client
    client.shutdown()


def serve(engine, ckpt, **options):
    settings = ServerSettings(model_path=str(ckpt), **options)
    return running(attach(build_api(settings), engine, engine.tokenizer, settings))


@pytest.fixture(scope="module")
def oai(engine, ckpt):
    with serve(engine, ckpt, reasoning_parser="qwen3") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(ckpt):
    return ckpt.name


def chat(oai, model, **kwargs):
    return oai.chat.completions.create(model=model, **{"messages": ASK, "max_tokens": 160, **kwargs})


def assert_valid_call(call):
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# --------------------------------------------------------------------------- forced tool calls

def test_named_tool_is_schema_valid_20_of_20_with_sampling(oai, model):
    # Two concurrent requests of 10 samples each: 20 constrained rows in one batch.
    def ten(seed):
        return chat(oai, model, tools=TOOLS, tool_choice=NAMED, temperature=1.0, seed=seed, n=10)
    with ThreadPoolExecutor(2) as pool:
        choices = [c for r in pool.map(ten, [1, 2]) for c in r.choices]
    assert len(choices) == 20
    for choice in choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert_valid_call(call)


def test_required_calls_only_given_tools(oai, model):
    r = chat(oai, model, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
             temperature=1.0, seed=5, n=3)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        assert_valid_call(choice.message.tool_calls[0])


@pytest.mark.parametrize("parser", ["llama3_json", "mistral", "json", "gemma"])
def test_forced_calls_in_every_format(engine, ckpt, model, parser):
    with serve(engine, ckpt, tool_call_parser=parser) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        r = chat(client, model, tools=TOOLS, temperature=1.0, seed=11, n=2,
                 tool_choice={"type": "function", "function": {"name": "add"}})
    for choice in r.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "add"
        assert_valid_call(call)


# --------------------------------------------------------------------------- auto and none

def test_auto_parses_calls_and_keeps_text(oai, model):
    r = chat(oai, model, tools=TOOLS, temperature=1.0, seed=2, extra_body={"guided_regex": TWO_CALLS})
    message = r.choices[0].message
    assert message.content == "Let me check."
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "add"]
    for call in message.tool_calls:
        assert_valid_call(call)
    assert r.choices[0].finish_reason == "tool_calls"


def test_streamed_tool_calls_reassemble_to_the_response(oai, model):
    kwargs = dict(tools=TOOLS, temperature=1.0, seed=4, extra_body={"guided_regex": TWO_CALLS})
    whole = chat(oai, model, **kwargs).choices[0]
    content, calls, finish, first_deltas = "", {}, None, {}
    for chunk in chat(oai, model, stream=True, **kwargs):
        choice = chunk.choices[0]
        assert "<tool_call>" not in (choice.delta.content or "")
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:  # OpenAI's shape: the first delta names the call
                assert d.id and d.type == "function" and d.function.name
                calls[d.index], first_deltas[d.index] = {"name": d.function.name, "arguments": ""}, d
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    assert content == whole.message.content and finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls]


def test_tool_choice_none_hides_the_tools(oai, model):
    call = r'<tool_call>\n\{"name": "add", "arguments": \{"a": 1, "b": true\}\}\n</tool_call>'
    forced = {"guided_regex": call}
    without = chat(oai, model, extra_body=forced)
    hidden = chat(oai, model, tools=TOOLS, tool_choice="none", extra_body=forced)
    shown = chat(oai, model, tools=TOOLS, extra_body=forced)
    assert hidden.usage.prompt_tokens == without.usage.prompt_tokens < shown.usage.prompt_tokens
    assert hidden.choices[0].message.tool_calls is None
    assert hidden.choices[0].message.content.startswith("<tool_call>")
    assert shown.choices[0].message.tool_calls[0].function.name == "add"


def test_tool_choice_errors_are_400s(oai, model):
    cases = [dict(tool_choice="required"),
             dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
             dict(extra_body={"guided_regex": "(", "guided_choice": ["a"]}),
             dict(extra_body={"guided_regex": "("}),
             dict(response_format={"type": "json_schema"})]
    for kwargs in cases:
        with pytest.raises(openai.BadRequestError) as info:
            chat(oai, model, max_tokens=8, **kwargs)
        assert "Traceback" not in str(info.value) and ".cc:" not in str(info.value)


def test_multi_turn_with_tool_results(oai, model, engine):
    turns = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    text = render_chat_text(engine.tokenizer, [ChatMessage(**m) for m in turns],
                            [Tool(**t) for t in TOOLS])
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius", "days": 1}}\n</tool_call><|im_end|>') in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>' in text
    r = chat(oai, model, messages=turns, tools=TOOLS, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length")


# --------------------------------------------------------------------------- structured outputs

def test_json_schema_parses_and_validates_20_of_20(oai, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    r = chat(oai, model, response_format=fmt, temperature=1.0, seed=7, n=20, max_tokens=120)
    assert len(r.choices) == 20
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), WEATHER)


def test_json_object_is_an_object(oai, model):
    r = chat(oai, model, response_format={"type": "json_object"}, temperature=0, max_tokens=60)
    choice = r.choices[0]
    if choice.finish_reason == "stop":  # a random model may write a long object
        assert isinstance(json.loads(choice.message.content), dict)
    assert choice.message.content.startswith("{")


def test_guided_fields_on_completions(oai, model):
    cases = [({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
             ({"guided_regex": r"[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{4}", t)),
             ({"guided_json": ADD}, lambda t: jsonschema.validate(json.loads(t), ADD) is None),
             ({"guided_grammar": 'root ::= "ab" | "cd"'}, lambda t: t in ("ab", "cd"))]
    for body, check in cases:
        r = oai.completions.create(model=model, prompt="Hello", max_tokens=40, temperature=1.0,
                                   seed=1, n=2, extra_body=body)
        assert all(check(c.text) for c in r.choices), (body, [c.text for c in r.choices])


def test_structured_stream_equals_response(oai, model):
    body = {"guided_json": ADD}
    whole = oai.completions.create(model=model, prompt="Hi", max_tokens=40, seed=9, extra_body=body)
    chunks = oai.completions.create(model=model, prompt="Hi", max_tokens=40, seed=9, stream=True,
                                    extra_body=body)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


# --------------------------------------------------------------------------- reasoning

THOUGHT = r"<think>\n[a-z]{3,8} [a-z]{3,8}\n</think>\n\n(yes|no)"


def test_reasoning_content_split(oai, model):
    r = chat(oai, model, max_tokens=40, temperature=1.0, seed=1, extra_body={"guided_regex": THOUGHT})
    message = r.choices[0].message
    assert re.fullmatch(r"[a-z]{3,8} [a-z]{3,8}", message.reasoning_content)
    assert message.content in ("yes", "no")
    chunks = chat(oai, model, max_tokens=40, temperature=1.0, seed=1, stream=True,
                  extra_body={"guided_regex": THOUGHT})
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert reasoning == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content


def test_thinking_disabled_leaves_everything_content(oai, model, engine, ckpt):
    off = {"chat_template_kwargs": {"enable_thinking": False}, "guided_regex": "(yes|no)"}
    message = chat(oai, model, max_tokens=10, extra_body=off).choices[0].message
    assert message.content in ("yes", "no") and getattr(message, "reasoning_content", None) is None
    with serve(engine, ckpt, reasoning_parser="deepseek_r1", disable_thinking=True) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        r = chat(client, model, max_tokens=10, extra_body={"guided_regex": "(yes|no)"})
    message = r.choices[0].message
    assert message.content in ("yes", "no") and getattr(message, "reasoning_content", None) is None


# --------------------------------------------------------------------------- template fuzz

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12)
texts = st.one_of(st.text(max_size=20), st.just("{{ x }}{% if %}"))
jsonish = st.one_of(st.text(max_size=20), st.sampled_from(['{"a": 1}', "{", "[]", "null", '{"{{": 1}']))
function_call = st.fixed_dictionaries({"name": names, "arguments": jsonish})
calls = st.lists(st.fixed_dictionaries({"id": names, "type": st.just("function"),
                                        "function": function_call}), max_size=2)
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "developer"]),
                           "content": texts}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(st.none(), texts),
                           "tool_calls": st.one_of(st.none(), calls),
                           "reasoning_content": st.one_of(st.none(), st.text(max_size=10))}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": jsonish, "tool_call_id": names}))
parameters = st.one_of(st.none(), st.just(WEATHER), st.dictionaries(names, names, max_size=2))
tools = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": names, "parameters": parameters})}), max_size=2)
GENERATION_PROMPT = {None: "<|im_start|>assistant\n", True: "<|im_start|>assistant\n",
                     False: "<|im_start|>assistant\n<think>\n\n</think>\n\n"}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(messages=st.lists(message, min_size=1, max_size=5), tools=tools,
       thinking=st.one_of(st.none(), st.booleans()))
def test_fuzz_chat_template_rendering(engine, messages, tools, thinking):
    kwargs = None if thinking is None else {"enable_thinking": thinking}
    messages, tools = [ChatMessage(**m) for m in messages], [Tool(**t) for t in tools] or None
    try:
        text = render_chat_text(engine.tokenizer, messages, tools, chat_template_kwargs=kwargs)
    except ValueError:
        return  # a refusal the route turns into a 400
    assert text.endswith(GENERATION_PROMPT[thinking])
