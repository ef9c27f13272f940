"""Gemma 4's tool calls (`<|tool_call>call:NAME{key:value}<tool_call|>`) and thinking channel
(`<|channel>thought\\n...<channel|>`): the gemma4 tool-call format and reasoning parser on
hand-written outputs (whole, cut at every position, fuzzed), arguments as the chat template
writes them read back, the parsers' choice for a model, and one server end to end on a tiny
checkpoint that speaks Gemma 4's format (tests/gemma4_checkpoint.py), its output forced with
guided_regex."""
from __future__ import annotations

import json

import openai
import pytest
from gemma4_checkpoint import build_tokenizer, make_gemma4_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_api import running
from test_harmony import escaped

from actors.config import EngineConfig
from app.api.app import attach, build_api
from app.api.engine_client import LocalEngineClient
from app.api.settings import ServerSettings
from app.protocol.chat_output import plan_output
from app.protocol.chat_template import render_chat_text
from app.protocol.model_parsers import model_parsers
from app.protocol.models import ChatCompletionRequest
from app.protocol.reasoning import CONTENT, MARKERS, START, ReasoningScanner, initial_state, reasoning_parser_name
from app.protocol.tool_parsers import FORMATS, ToolCallScanner, detect, tool_format

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
W = ("get_weather", {"city": "Paris"})
A = ("add", {"a": 1, "b": 2})


def parse(text: str):
    found = ToolCallScanner(FORMATS["gemma4"]).feed(text, final=True)
    return found.content, [(c.name, json.loads(c.arguments)) for c in found.calls]


def stream(pieces: list[str]):
    scanner, content, calls = ToolCallScanner(FORMATS["gemma4"]), "", []
    for i, piece in enumerate(pieces):
        found = scanner.feed(piece, final=i == len(pieces) - 1)
        content, calls = content + found.content, calls + [(c.name, json.loads(c.arguments)) for c in found.calls]
    return content, calls


# --------------------------------------------------------------------------- tool calls

CALLS = [
    # (text, content, calls)
    ('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>', "", [W]),
    ('Let me check.\n<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
     "<|tool_call>call:add{a:1,b:2}<tool_call|>", "Let me check.", [W, A]),  # back to back
    ("Before <|tool_call>call:add{a:1,b:2}<tool_call|> after", "Before after", [A]),
    ('<|tool_call>call:book{city:<|"|>42<|"|>,extras:{floor:-1,tags:[],wifi:true},'
     'guests:[<|"|>ann<|"|>,{age:7,name:<|"|>bo<|"|>}],late:false,nights:3,note:None,price:99.5,'
     "small:1e-05}<tool_call|>", "",
     [("book", {"city": "42", "extras": {"floor": -1, "tags": [], "wifi": True},
                "guests": ["ann", {"age": 7, "name": "bo"}], "late": False, "nights": 3, "note": None,
                "price": 99.5, "small": 1e-05})]),  # a quoted number stays a string
    ('<|tool_call>call:write{path:<|"|>/tmp/a.txt<|"|>,text:<|"|>a{b},c]\n"d": 1<|"|>}<tool_call|>', "",
     [("write", {"path": "/tmp/a.txt", "text": 'a{b},c]\n"d": 1'})]),  # markup inside a string is text
    # as vLLM's and SGLang's parsers read them: blanks, a quoted key, null, a bare word, JSON text,
    # a trailing comma
    ('<|tool_call> call:add { <|"|>a<|"|> : 1 , b : null , unit: celsius, q: "x, y", }<tool_call|>', "",
     [("add", {"a": 1, "b": None, "unit": "celsius", "q": "x, y"})]),
    ("<|tool_call>call:ping{}<tool_call|>", "", [("ping", {})]),
    ("<|tool_call>call:add{a:1,b:2}", "", [A]),  # the end marker cut off: the call is whole
    ("no calls, just <|tool text and a <|\"|>", "no calls, just <|tool text and a <|\"|>", []),
]


@pytest.mark.parametrize("text,content,calls", CALLS)
def test_calls(text, content, calls):
    assert parse(text) == (content, calls)


MALFORMED = [
    '<|tool_call>call:get_weather{city:<|"|>Paris}<tool_call|>',  # unterminated string
    "<|tool_call>call:add{a:1,b:",  # cut by max_tokens
    "<|tool_call>call:add{a:1} and more<tool_call|>",
    "<|tool_call>add{a:1}<tool_call|>",  # no `call:`
    "<|tool_call>call:add<tool_call|>",  # no arguments object
    "<|tool_call>call:get weather{a:1}<tool_call|>",
    "<|tool_call>call:add{a 1}<tool_call|>",
    "<|tool_call>call:add{a:[1,2}<tool_call|>",
    "<|tool_call>call:add{a:{b:1}<tool_call|>",
    "<|tool_call>call:add{a:1e999}<tool_call|>",  # not a JSON number
    "<|tool_call>call:add{a:,b:1}<tool_call|>",
    "<|tool_call>call:add{a:1}{b:2}<tool_call|>",
    "<tool_call|> a stray end",
    "<|tool_call>",
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_calls_stay_text(text):
    assert parse(text) == (text, [])


@pytest.mark.parametrize("text,content,calls", CALLS + [(t, t, []) for t in MALFORMED])
def test_split_at_every_position(text, content, calls):
    for cut in range(len(text) + 1):
        assert stream([text[:cut], text[cut:]]) == (content, calls), cut


def test_stream_shows_no_markup_and_text_before_a_call_at_once():
    text = CALLS[1][0]
    scanner = ToolCallScanner(FORMATS["gemma4"])
    found = [scanner.feed(ch) for ch in text]  # never final: nothing waits for the end of output
    shown = [f.content for f in found]
    assert "".join(shown) == "Let me check." and not any("<" in piece for piece in shown)
    assert shown[len("Let me check.") - 1] == "."  # released with its character
    ends = [i for i in range(len(text)) if text[:i + 1].endswith("<tool_call|>")]
    assert [i for i, f in enumerate(found) if f.calls] == ends  # each call as its end marker comes


# --------------------------------------------------------------------------- the template's spelling

@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()  # trained here: ~1 s, so once


keys = st.from_regex(r"[A-Za-z_$][A-Za-z0-9_.$-]{0,8}", fullmatch=True)
strings = st.text(max_size=12).filter(lambda s: '<|"|>' not in s and "<tool_call|>" not in s)
values = st.recursive(
    st.one_of(strings, st.integers(-10**12, 10**12), st.floats(allow_nan=False, allow_infinity=False),
              st.booleans(), st.none()),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=3)),
    max_leaves=8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arguments=st.dictionaries(keys, values, max_size=4))
def test_arguments_as_the_template_writes_them_read_back(tokenizer, arguments):
    """A call in the history, rendered by the template's own value syntax (strings between
    `<|"|>`, Python's spelling of numbers and None), parses back to the same JSON."""
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "tool.v2", "arguments": json.dumps(arguments)}}]}
    text = render_chat_text(tokenizer, ChatCompletionRequest(model="m", messages=ASK + [turn]).messages)
    block = text[text.index("<|tool_call>"):text.index("<tool_call|>") + len("<tool_call|>")]
    assert parse(block) == ("", [("tool.v2", arguments)])


# --------------------------------------------------------------------------- thinking

def reason(text, state=START, implied=False, pieces=None):
    scanner = ReasoningScanner(state, implied, MARKERS["gemma4"])
    pieces = pieces or [text]
    out = [scanner.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


THINKING = [
    ("<|channel>thought\nThe user wants 2+2.<channel|>It is 4.", START, False, ("The user wants 2+2.", "It is 4.")),
    ("<|channel>thought\n<channel|>Just the answer.", START, False, ("", "Just the answer.")),
    ("<|channel>thought\nCut off by max_tokens", START, False, ("Cut off by max_tokens", "")),
    ("<|channel>thoughtful, at first<channel|>x", START, False, ("thoughtful, at first", "x")),
    ("thought\nNo channel.", START, False, ("", "thought\nNo channel.")),  # the label only inside one
    ("Thinking first.<channel|>Answer.", START, True, ("Thinking first.", "Answer.")),
    ("<|channel>thought\nx<channel|>y", CONTENT, False, ("", "<|channel>thought\nx<channel|>y")),
    ("<think>x</think>y", START, False, ("", "<think>x</think>y")),  # Qwen's markers are text here
]


@pytest.mark.parametrize("text,state,implied,expected", THINKING)
def test_thinking_split(text, state, implied, expected):
    assert reason(text, state, implied) == expected
    for cut in range(len(text) + 1):
        assert reason(text, state, implied, [text[:cut], text[cut:]]) == expected, cut


def test_thinking_start_follows_the_prompt():
    model = "<|turn>user\nHi<turn|>\n<|turn>model\n"
    assert initial_state("gemma4", model, False) == (START, False)  # thinking on: may open a channel
    assert initial_state("gemma4", model + "<|channel>thought\n<channel|>", True) == (CONTENT, False)
    assert initial_state("gemma4", model + "<|channel>", False) == (START, True)
    assert initial_state("gemma4", model + "<|channel>thought\n", False) == (START, True)
    assert initial_state("qwen3", model + "<|channel>thought\n<channel|>", False) == (START, False)


# --------------------------------------------------------------------------- names and choice

def test_names_and_the_models_choice(tokenizer):
    assert tool_format("gemma4").name == "gemma4" and reasoning_parser_name("Gemma4") == "gemma4"
    ServerSettings(tool_call_parser="gemma4", reasoning_parser="gemma4")  # start-up accepts them
    assert detect(tokenizer).name == "gemma4"
    # a line of Gemma 4's own template (llama.cpp's models/templates/gemma4.jinja)
    tokenizer_like = type("Tok", (), {"chat_template": "{{- '<|tool_call>call:' + function['name'] + '{' -}}"})
    assert detect(tokenizer_like).name == "gemma4"
    for model_type in ("gemma4", "gemma4_text"):
        assert model_parsers({"model_type": model_type}, "", tokenizer.chat_template) == {"reasoning_parser": "gemma4"}
    assert model_parsers({"model_type": "gemma3"}, "", tokenizer.chat_template) == {}
    assert model_parsers({"model_type": "gemma4", "reasoning_parser": "none"})["reasoning_parser"] == "none"


REASON_CALL = ('<|channel>thought\nNeed the weather tool.<channel|><|tool_call>call:get_weather'
               '{city:<|"|>Paris<|"|>,days:3}<tool_call|>')


@pytest.mark.parametrize("thinking", [True, False])
def test_a_gemma4_chat_is_planned_with_both_parsers(tokenizer, thinking):
    """The wiring: the model_type picks the thinking split, the template the call format, and
    the rendered prompt where the output starts (thinking off: the template closed the channel)."""
    body = ChatCompletionRequest(model="m", messages=ASK, tools=TOOLS,
                                 chat_template_kwargs={"enable_thinking": thinking})
    prompt = render_chat_text(tokenizer, body.messages, body.tools, chat_template_kwargs=body.chat_template_kwargs)
    plan = plan_output(ServerSettings(**model_parsers({"model_type": "gemma4"})), tokenizer, body, prompt)
    assert plan.tool_format.name == "gemma4" and plan.reasoning == ((START, False) if thinking else (CONTENT, False))
    text = REASON_CALL if thinking else REASON_CALL.split("<channel|>")[1]
    whole = plan.parser().feed(text, final=True)
    assert (whole.reasoning, whole.content) == ("Need the weather tool." if thinking else "", "")
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [("get_weather", {"city": "Paris", "days": 3})]
    parser, reasoning, content, calls = plan.parser(), "", "", []
    for i, ch in enumerate(text):
        out = parser.feed(ch, final=i == len(text) - 1)
        assert "<" not in out.reasoning + out.content
        reasoning, content, calls = reasoning + out.reasoning, content + out.content, calls + out.calls
    assert (reasoning, content, calls) == (whole.reasoning, whole.content, whole.calls)


# --------------------------------------------------------------------------- fuzz

FRAGMENTS = ["<|tool_call>", "<tool_call|>", "call:", "add", "get_weather", "{", "}", "[", "]", ":", ",",
             '<|"|>', "<|", "|>", "<|channel>", "<channel|>", "thought\n", "thought", "a", "b:", "1", "-2.5",
             "1e999", "true", "null", "None", '"x"', " ", "\n", "é", "🐟", "\\"]
texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4)), max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=texts, state=st.sampled_from([START, CONTENT]), implied=st.booleans(),
       cuts=st.lists(st.integers(0, 300), max_size=6))
def test_fuzz_any_chunking_gives_the_one_shot_split(text, state, implied, cuts):
    def split(pieces):
        reasoning = ReasoningScanner(state, implied, MARKERS["gemma4"])
        tools, out = ToolCallScanner(FORMATS["gemma4"]), ["", "", []]
        for i, piece in enumerate(pieces):
            final = i == len(pieces) - 1
            thought, content = reasoning.feed(piece, final)
            found = tools.feed(content, final)
            out = [out[0] + thought, out[1] + found.content, out[2] + found.calls]
        return out

    whole = split([text])  # must not raise
    bounds = sorted({min(c, len(text)) for c in cuts})
    assert split([text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]) == whole
    for call in whole[2]:
        assert isinstance(json.loads(call.arguments), dict)


# --------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_gemma4_checkpoint(tmp_path_factory.mktemp("gemma4") / "gemma-4-tiny",
                                  max_position_embeddings=1024)


@pytest.fixture(scope="module")
def engine(ckpt):
    client = LocalEngineClient(EngineConfig(model_path=str(ckpt), num_kv_blocks=256))
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def oai(engine, ckpt):
    # No tool-call parser named: the template's markup says gemma4. The reasoning parser as
    # vLLM's users name it (a real Gemma 4 checkpoint gets it from its model_type).
    settings = ServerSettings(model_path=str(ckpt), reasoning_parser="gemma4")
    with running(attach(build_api(settings), engine, engine.tokenizer, settings)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


THINK_ON = {"chat_template_kwargs": {"enable_thinking": True}}


def chat(oai, forced=None, thinking=False, **kwargs):
    extra = {**({"guided_regex": escaped(forced)} if forced else {}), **(THINK_ON if thinking else {})}
    return oai.chat.completions.create(model="", **{"messages": ASK, "max_tokens": 300,
                                                    "extra_body": extra, **kwargs})


def streamed(oai, forced, **kwargs):
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in chat(oai, forced, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            pieces = (getattr(delta, "reasoning_content", None) or "") + (delta.content or "")
            assert "<|" not in pieces and "|>" not in pieces and not pieces.endswith("<")
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for d in delta.tool_calls or []:
                calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


def test_served_thinking_then_call(oai):
    choice = chat(oai, REASON_CALL, thinking=True, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "Need the weather tool."
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 3})
    assert streamed(oai, REASON_CALL, thinking=True, tools=TOOLS) == (
        "Need the weather tool.", "", [{"name": "get_weather", "arguments": call.function.arguments}], "tool_calls")


TEXT_TWO_CALLS = ('Checking both.\n<|tool_call>call:get_weather{city:<|"|>Rome<|"|>,days:2}<tool_call|>'
                  "<|tool_call>call:add{a:4,b:true}<tool_call|>")


def test_served_text_and_two_calls_with_thinking_off(oai):
    choice = chat(oai, TEXT_TWO_CALLS, tools=TOOLS).choices[0]
    message = choice.message
    assert (message.content, getattr(message, "reasoning_content", None), choice.finish_reason) == (
        "Checking both.", None, "tool_calls")
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Rome", "days": 2}), ("add", {"a": 4, "b": True})]
    assert streamed(oai, TEXT_TWO_CALLS, tools=TOOLS) == ("", "Checking both.", calls, "tool_calls")


def test_served_thinking_then_answer(oai):
    forced = "<|channel>thought\nEasy: 2+2.<channel|>It is 4."
    message = chat(oai, forced, thinking=True).choices[0].message
    assert (message.reasoning_content, message.content) == ("Easy: 2+2.", "It is 4.")
    assert streamed(oai, forced, thinking=True) == ("Easy: 2+2.", "It is 4.", [], "stop")


def test_served_bad_call_is_text_not_an_error(oai):
    bad = '<|tool_call>call:get_weather{city:<|"|>Paris}<tool_call|>'
    choice = chat(oai, bad, tools=TOOLS).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (bad, None, "stop")


def test_served_forced_call(oai):
    choice = chat(oai, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  temperature=1.0, seed=3).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and choice.finish_reason == "tool_calls"
    assert set(json.loads(call.function.arguments)) == {"city", "days"}
