"""Tool-call formats and the reasoning split, without a model: every format's calls, several
calls, malformed blocks (they stay text), streams cut at every position, and hypothesis fuzz
(no exception escapes; any chunking gives the one-shot result)."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.api.settings import ServerSettings
from app.protocol.reasoning import CONTENT, START, ReasoningScanner, initial_state, reasoning_parser_name
from app.protocol.tool_parsers import FORMATS, ParsedCall, ToolCallScanner, detect, tool_format
from app.protocol.tool_parsers.calls import forced_calls_tag

NAMES = ["get_weather", "add"]
W = ParsedCall("get_weather", '{"city": "Paris"}')
A = ParsedCall("add", '{"a": 1, "b": 2}')


def parse(fmt: str, text: str, names=NAMES):
    found = ToolCallScanner(FORMATS[fmt], names).feed(text, final=True)
    return found.content, found.calls


def stream(fmt: str, pieces: list[str], names=NAMES):
    scanner = ToolCallScanner(FORMATS[fmt], names)
    content, calls = "", []
    for i, piece in enumerate(pieces):
        found = scanner.feed(piece, final=i == len(pieces) - 1)
        content, calls = content + found.content, calls + found.calls
    return content, calls


# --------------------------------------------------------------------------- each format

CASES = [
    # (format, text, content, calls)
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [W]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
               '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "Let me check.", [W, A]),
    ("hermes", 'Before <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> after',
     "Before after", [A]),
    ("hermes", '<tool_call>{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [A]),  # no end tag
    ("hermes", "no calls here, just <tool text", "no calls here, just <tool text", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [W]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [W, A]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "add", "arguments": {"a": 1, "b": 2}}]', "", [W, A]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
                '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', "Sure.", [W, A]),
    ("gemma", 'Checking.\n```tool_code\nget_weather(city="Paris")\nadd(a=1, b=2)\n```',
     "Checking.", [W, A]),
    ("gemma", '```tool_code\n[get_weather(city="Paris"), add(a=1, b=2)]\n```\nDone.', "Done.", [W, A]),
    ("json", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [W]),
    ("json", '```json\n[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
             '{"type": "function", "function": {"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}}]\n```',
     "", [W, A]),
    ("json", '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}', "", [A]),
    # the XML formats (no schemas here: a value that reads as JSON is JSON, others are strings)
    ("qwen3_coder", "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
                    "<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>", "Sure.", [W, A]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
              "<tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b</arg_key>"
              "<arg_value>2</arg_value></tool_call>", "", [W, A]),  # 4.5's layout, then 4.7's
    ("minimax_m2", 'Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
                   '</parameter>\n</invoke>\n<invoke name="add">\n<parameter name="a">1</parameter>\n'
                   '<parameter name="b">2</parameter>\n</invoke>\n</minimax:tool_call>', "Checking.", [W, A]),
]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_formats(fmt, text, content, calls):
    assert parse(fmt, text) == (content, calls)


MALFORMED = [
    ("hermes", "Hi <tool_call>{not json}</tool_call> there"),
    ("hermes", '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"x": NaN}}</tool_call>'),
    ("hermes", "</tool_call> stray end"),
    ("llama3_json", '{"name": "get_weather"}'),  # no parameters: an answer, not a call
    ("llama3_json", '{"name": "unknown_tool", "parameters": {}}'),
    ("llama3_json", "The answer is {1}"),
    ("mistral", "[TOOL_CALLS] nonsense"),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1} trailing'),
    ("gemma", "```tool_code\nimport os\n```"),
    ("gemma", "```tool_code\nadd(1, 2)\n```"),  # positional arguments
    ("gemma", "```tool_code\nadd(a=open('x'))\n```"),  # not a literal
    ("json", '{"name": "Bob", "age": 3}'),  # a JSON answer
    ("json", '{"a": 1} {"b": 2}'),
    ("qwen3_coder", "<tool_call>\n<parameter=a>\n1\n</parameter>\n</tool_call>"),  # no function
    ("qwen3_coder", "<tool_call>\n<function=add>\nstray text\n</function>\n</tool_call>"),
    ("glm45", "<tool_call>add\n<arg_key>a</arg_key> no value</tool_call>"),
    ("glm45", "<tool_call>two words<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="add">\n<parameter name="a">1</invoke>\n</minimax:tool_call>'),
    ("minimax_m2", "<minimax:tool_call>just text</minimax:tool_call>"),
]


@pytest.mark.parametrize("fmt,text", MALFORMED)
def test_malformed_blocks_stay_text(fmt, text):
    assert parse(fmt, text) == (text, [])


def test_text_without_calls_is_unchanged():
    text = "  Hello <tool\n\n"
    assert parse("hermes", text) == (text, [])


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_split_at_every_position(fmt, text, content, calls):
    for cut in range(len(text) + 1):
        assert stream(fmt, [text[:cut], text[cut:]]) == (content, calls), cut


def test_split_at_every_pair_of_positions():
    text = CASES[1][1] + " then <tool_call>{bad}</tool_call>"
    whole = parse("hermes", text)
    for i in range(0, len(text) + 1, 3):
        for j in range(i, len(text) + 1, 5):
            assert stream("hermes", [text[:i], text[i:j], text[j:]]) == whole, (i, j)


def test_stream_never_shows_markup_before_a_call_completes():
    text = CASES[1][1]
    scanner = ToolCallScanner(FORMATS["hermes"], NAMES)
    shown = "".join(scanner.feed(ch).content for ch in text)
    assert "<" not in shown and shown == "Let me check."


SCHEMAS = {"book": {"type": "object", "properties": {
    "city": {"type": "string"}, "nights": {"type": "integer"}, "price": {"type": "number"},
    "late": {"type": "boolean"}, "guests": {"type": "array"}, "extras": {"type": "object"},
    "note": {"type": ["string", "null"]}, "code": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}}
XML_BOOKINGS = {  # every value as the format's template writes it
    "qwen3_coder": "<tool_call>\n<function=book>\n" + "".join(
        f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in
        [("city", "42"), ("nights", "3"), ("price", "99.5"), ("late", "true"), ("guests", '["ann", "bo"]'),
         ("extras", "{'wifi': True}"), ("note", "null"), ("code", "A1"), ("other", "[1, 2]")])
        + "</function>\n</tool_call>",
    "glm45": "<tool_call>book\n" + "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in
        [("city", "42"), ("nights", "3"), ("price", "99.5"), ("late", "true"), ("guests", '["ann", "bo"]'),
         ("extras", "{'wifi': True}"), ("note", "null"), ("code", "A1"), ("other", "[1, 2]")]) + "</tool_call>",
    "minimax_m2": '<minimax:tool_call>\n<invoke name="book">\n' + "".join(
        f'<parameter name="{k}">{v}</parameter>\n' for k, v in
        [("city", "42"), ("nights", "3"), ("price", "99.5"), ("late", "true"), ("guests", '["ann", "bo"]'),
         ("extras", "{'wifi': True}"), ("note", "null"), ("code", "A1"), ("other", "[1, 2]")])
        + "</invoke>\n</minimax:tool_call>",
}


@pytest.mark.parametrize("fmt", list(XML_BOOKINGS))
def test_xml_arguments_are_typed_by_the_tools_schema(fmt):
    """A string stays a string even when it looks like a number; other types are read as the
    schema says (Python literals too, as vLLM's parsers read them); a parameter the schema
    does not name is JSON if it reads as JSON. A value that cannot be its type leaves the block text."""
    found = ToolCallScanner(FORMATS[fmt], ["book"], SCHEMAS).feed(XML_BOOKINGS[fmt], final=True)
    assert found.content == "" and [c.name for c in found.calls] == ["book"]
    assert json.loads(found.calls[0].arguments) == dict(
        city="42", nights=3, price=99.5, late=True, guests=["ann", "bo"], extras={"wifi": True}, note=None,
        code="A1", other=[1, 2])
    bad = XML_BOOKINGS[fmt].replace("99.5", "cheap")
    assert ToolCallScanner(FORMATS[fmt], ["book"], SCHEMAS).feed(bad, final=True).calls == []


def test_a_glm_chat_is_planned_with_its_format_its_reasoning_and_the_tools_schemas():
    """The wiring: GLM-4.5's template picks its format, its model_type the <think> split, and
    the request's tool schemas reach the scanner, so a string that looks like a number stays one."""
    from app.protocol.chat_output import plan_output
    from app.protocol.model_parsers import model_parsers
    from app.protocol.models import ChatCompletionRequest

    class Tok:
        chat_template = "{% for tc in m.tool_calls %}<tool_call>{{ tc.name }}<arg_key>{{ k }}</arg_key>{% endfor %}"

    book = {"type": "function", "function": {"name": "book", "parameters": SCHEMAS["book"]}}
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Book Paris"}], tools=[book])
    settings = ServerSettings(**model_parsers({"model_type": "glm4_moe"}))
    plan = plan_output(settings, Tok(), body, "<|assistant|>")
    assert plan.tool_format.name == "glm45" and plan.reasoning is not None
    out = plan.parser().feed("<think>Book it.</think>\n<tool_call>book\n<arg_key>city</arg_key>\n"
                             "<arg_value>42</arg_value>\n<arg_key>nights</arg_key>\n<arg_value>2</arg_value>\n"
                             "</tool_call>", final=True)
    assert out.reasoning == "Book it." and out.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("book", {"city": "42", "nights": 2})]


# --------------------------------------------------------------------------- choosing

def test_choose_format_by_name_or_template():
    class Tok:
        chat_template = "... <tool_call> ..."
    assert tool_format("auto", Tok()).name == "hermes"
    assert tool_format("mistral").name == "mistral"
    assert tool_format("Llama3-JSON").name == "llama3_json"
    Tok.chat_template = "{{ '[TOOL_CALLS]' }}"
    assert detect(Tok()).name == "mistral"
    for markup, name in (("<tool_call>\n<function=", "qwen3_coder"), ("<tool_call>{{ name }}<arg_key>", "glm45"),
                         ("<minimax:tool_call>\n<invoke", "minimax_m2")):
        Tok.chat_template = f"... {markup} ..."  # (their templates say <tool_call> too)
        assert detect(Tok()).name == name
    Tok.chat_template = None
    assert detect(Tok()).name == "json"
    with pytest.raises(ValueError, match="unknown tool call parser"):
        tool_format("nope")


def test_unknown_parser_names_fail_at_start_up():
    assert ServerSettings(tool_call_parser="Qwen", reasoning_parser="deepseek-r1")
    for options in ({"tool_call_parser": "nope"}, {"reasoning_parser": "o1"}):
        with pytest.raises(ValueError, match="choose from"):
            ServerSettings(**options)


def test_forced_call_tags_are_structural_tag_json():
    class Fn:
        name, parameters = "add", {"type": "object", "properties": {"a": {"type": "integer"}}}

    class T:
        function = Fn
    for name in ("hermes", "llama3_json", "mistral", "json"):
        tag = forced_calls_tag(FORMATS[name], [T, T], single=False)
        assert json.loads(json.dumps(tag))["type"] == "structural_tag"
    single = forced_calls_tag(FORMATS["hermes"], [T], single=True)["format"]
    assert single["begin"] == '<tool_call>\n{"name": "add", "arguments": '
    assert single["end"] == "}\n</tool_call>"


# --------------------------------------------------------------------------- reasoning

def reason(text, state=START, implied=False, pieces=None):
    scanner = ReasoningScanner(state, implied)
    pieces = pieces or [text]
    out = [scanner.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


REASONING_CASES = [
    ("<think>\nLet me think.\n</think>\n\nThe answer is 4.", START, False,
     ("Let me think.", "The answer is 4.")),
    ("Thinking first.\n</think>\n\nAnswer.", START, True, ("Thinking first.", "Answer.")),
    ("<think>\nCut off by max_tokens", START, False, ("Cut off by max_tokens", "")),
    ("Just an answer", START, False, ("", "Just an answer")),
    ("Just an answer", CONTENT, False, ("", "Just an answer")),
    ("<think>x</think>y", CONTENT, False, ("", "<think>x</think>y")),
]


@pytest.mark.parametrize("text,state,implied,expected", REASONING_CASES)
def test_reasoning_split(text, state, implied, expected):
    assert reason(text, state, implied) == expected
    for cut in range(len(text) + 1):
        assert reason(text, state, implied, [text[:cut], text[cut:]]) == expected, cut


def test_reasoning_start_follows_the_prompt():
    assert initial_state("qwen3", "<|im_start|>assistant\n", False) == (START, False)
    assert initial_state("qwen3", "<|im_start|>assistant\n<think>\n", False) == (START, True)
    assert initial_state("qwen3", "assistant\n<think>\n\n</think>\n\n", True) == (CONTENT, False)
    assert initial_state("deepseek_r1", "<｜Assistant｜>", False) == (START, True)
    assert initial_state("deepseek_r1", "<｜Assistant｜>", True) == (START, False)
    assert reasoning_parser_name("deepseek-r1") == "deepseek_r1"
    with pytest.raises(ValueError):
        reasoning_parser_name("o1")


# --------------------------------------------------------------------------- fuzz

FRAGMENTS = ["<tool_call>", "</tool_call>", "<function=add>", "<parameter=a>", "</parameter>", "</function>",
             "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<minimax:tool_call>", "</minimax:tool_call>",
             '<invoke name="add">', "</invoke>", '<parameter name="a">', "<tool", "call>", "<think>", "</think>",
             "[TOOL_CALLS]", "[ARGS]", "```tool_code", "```", "```json", "<|python_tag|>", '{"name": "add", ',
             '"arguments": {"a": 1}}', '"parameters": {}}', '{"name": "get_weather", "arguments": {}}',
             "add(a=1)", "get_weather(city='x')", "[", "]", "{", "}", '"', "\\", ";", ",", "\n", " ",
             "\t", "hello", "é", "🐟", "NaN", "null", "1e999", "\x00"]
texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=25).map("".join)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(fmt=st.sampled_from(sorted(FORMATS)), text=texts, cuts=st.lists(st.integers(0, 400), max_size=6))
def test_fuzz_tool_parsers(fmt, text, cuts):
    whole = parse(fmt, text)  # must not raise
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]
    assert stream(fmt, pieces) == whole
    for call in whole[1]:
        assert isinstance(json.loads(call.arguments), dict)


@FUZZ
@given(text=texts, state=st.sampled_from([START, CONTENT]), implied=st.booleans(),
       cuts=st.lists(st.integers(0, 400), max_size=6))
def test_fuzz_reasoning(text, state, implied, cuts):
    whole = reason(text, state, implied)
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]
    assert reason(text, state, implied, pieces) == whole
