"""Harmony (gpt-oss): the channel parser on hand-written outputs, the parser names and their
choice for a model, rendering, and one server end to end on a tiny gpt-oss checkpoint
(GptOssForCausalLM) that speaks harmony (tests/harmony_checkpoint.py), its output forced with
guided_regex and logit_bias."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from harmony_checkpoint import build_tokenizer, make_harmony_checkpoint
from test_api import running

from actors.config import EngineConfig
from app.api.app import attach, build_api
from app.api.engine_client import LocalEngineClient
from app.api.settings import ServerSettings, check_parsers
from app.protocol.chat_output import constraint, plan_output
from app.protocol.chat_template import render_chat_text
from app.protocol.model_parsers import model_parsers
from app.protocol.models import ChatCompletionRequest
from app.protocol.reasoning import reasoning_parser_name
from app.protocol.responses import chat_message
from app.protocol.tool_parsers import tool_format

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

REASON_FINAL = ("<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
                "<|start|>assistant<|channel|>final<|message|>It is 4.")
REASON_CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|>"
               "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
               '<|message|>{"city":"Paris"}')  # <|call|> ended generation: not in the text
TWO_CALLS = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}'
             "<|call|><|start|>assistant to=functions.add<|channel|>commentary json"
             '<|message|>{"a": 1, "b": 2}<|call|>')
PREAMBLE_CALL = ("<|channel|>commentary<|message|>Checking the weather.<|end|>"
                 "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                 '<|message|>{"city": "Oslo"}')
ONLY_REASONING = "<|channel|>analysis<|message|>Thinking about it and then"  # cut by max_tokens
BAD_JSON = ("<|channel|>commentary to=functions.get_weather <|constrain|>json"
            "<|message|>{city: Paris")


def plan(reasoning="harmony", tool_parser="openai", **request):
    body = ChatCompletionRequest(model="m", messages=ASK, **request)
    settings = ServerSettings(reasoning_parser=reasoning, tool_call_parser=tool_parser)
    return plan_output(settings, None, body, "<|start|>assistant")


def parse(text, **kwargs):
    parsed = plan(tools=TOOLS, **kwargs).parser().feed(text, final=True)
    return parsed.reasoning, parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.calls]


# --------------------------------------------------------------------------- the parser

def test_reasoning_then_final():
    assert parse(REASON_FINAL) == ("User asks 2+2. Easy.", "It is 4.", [])


def test_reasoning_then_call():
    assert parse(REASON_CALL) == ("Need the weather tool.", "", [("get_weather", {"city": "Paris"})])


def test_two_calls_either_recipient_position():
    assert parse(TWO_CALLS) == ("", "", [("get_weather", {"city": "Rome"}), ("add", {"a": 1, "b": 2})])
    assert parse(TWO_CALLS, parallel_tool_calls=False)[2] == [("get_weather", {"city": "Rome"})]


def test_preamble_is_content():
    assert parse(PREAMBLE_CALL) == ("", "Checking the weather.", [("get_weather", {"city": "Oslo"})])


def test_missing_final_leaves_content_null():
    assert parse(ONLY_REASONING) == ("Thinking about it and then", "", [])
    out = SimpleNamespace(text=ONLY_REASONING, finish_reason="length")
    message, finish = chat_message(out, plan(tools=TOOLS))
    assert (message.content, message.reasoning_content, finish) == (
        None, "Thinking about it and then", "length")
    message, finish = chat_message(SimpleNamespace(text=REASON_CALL, finish_reason="stop"), plan(tools=TOOLS))
    assert message.content is None and finish == "tool_calls"
    assert message.tool_calls[0].function.arguments == '{"city": "Paris"}'


def test_bad_output_degrades_to_content():
    assert parse(BAD_JSON) == ("", "{city: Paris", [])
    assert parse("no harmony markup at all") == ("", "no harmony markup at all", [])
    long_plain = "word " * 80  # longer than any header: streamed as plain text
    assert parse(long_plain) == ("", long_plain, [])
    assert parse(REASON_FINAL + "<|end|>" + long_plain)[1] == "It is 4.\n" + long_plain  # junk after
    assert parse("<|channel|>analysis<|mess") == ("", "", [])  # cut inside a header: hidden
    assert parse(" to=functions.get_wea") == ("", "", [])
    assert parse('{"tag": "<|x|>"}') == ("", '{"tag": "<|x|>"}', [])  # response_format JSON: no header


def test_switches():
    assert parse(REASON_FINAL, reasoning="none") == ("", "User asks 2+2. Easy.\nIt is 4.", [])
    no_tools = plan().parser().feed(REASON_CALL, final=True)
    assert (no_tools.reasoning, no_tools.content, no_tools.calls) == (
        "Need the weather tool.", '{"city":"Paris"}', [])


@pytest.mark.parametrize("text", [REASON_FINAL, REASON_CALL, TWO_CALLS, PREAMBLE_CALL, BAD_JSON,
                                  ONLY_REASONING, REASON_FINAL + "<|end|>" + "word " * 60])
def test_every_chunk_boundary_gives_the_same_split(text):
    whole = parse(text)
    for cut in range(1, len(text)):
        for pieces in ([text[:cut], text[cut:]], [text[:cut], text[cut:cut + 3], text[cut + 3:]]):
            parser = plan(tools=TOOLS).parser()
            reasoning, content, calls = "", "", []
            for i, piece in enumerate(pieces):
                out = parser.feed(piece, final=i == len(pieces) - 1)
                assert "<" not in out.reasoning + out.content, (cut, out)  # no marker, not even half
                reasoning, content, calls = reasoning + out.reasoning, content + out.content, calls + out.calls
            assert (reasoning, content, [(c.name, json.loads(c.arguments)) for c in calls]) == whole, cut


def test_text_streams_before_its_message_ends():
    parser = plan(tools=TOOLS).parser()
    assert parser.feed("<|channel|>analysis<|message|>Thinking hard<|").reasoning == "Thinking hard"
    assert parser.feed("end|><|start|>assistant<|channel|>final<|message|>Ye").content == "Ye"


# --------------------------------------------------------------------------- names and choice

def test_parser_names_as_vllm_users_spell_them():
    for name in ("harmony", "openai_gptoss", "openai-gptoss", "gpt_oss"):
        assert reasoning_parser_name(name) == "harmony"
    assert tool_format("openai") is tool_format("harmony") and tool_format("openai").channels
    check_parsers("openai", "openai_gptoss")  # start-up accepts them


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()  # trained here: ~1 s, so once


def test_gpt_oss_and_harmony_templates_pick_harmony(tokenizer):
    harmony = {"reasoning_parser": "harmony", "tool_call_parser": "harmony"}
    assert model_parsers({"model_type": "gpt_oss"}) == harmony
    assert model_parsers({"model_type": "llama"}, "", tokenizer.chat_template) == harmony
    assert model_parsers({"model_type": "gpt_oss", "tool_call_parser": "hermes"})["tool_call_parser"] == "hermes"
    assert tool_format(None, tokenizer).channels  # tools read from the template's markup


def test_forced_calls_spelled_as_harmony_and_stops_added(tokenizer):
    body = ChatCompletionRequest(model="m", messages=ASK, tools=TOOLS, stop_token_ids=[7],
                                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    p = plan_output(ServerSettings(reasoning_parser="harmony"), tokenizer, body, "")
    fields = constraint(body, p)
    tag = json.loads(fields["structured"].spec)["format"]
    assert tag["begin"] == "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    ids = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    assert fields["stop_token_ids"] == [7] + ids and fields["skip_special_tokens"] is False


def test_follow_up_renders_reasoning_calls_results_and_effort(tokenizer):
    turns = ASK + [
        {"role": "assistant", "reasoning_content": "Need the tool.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 21}'}]
    body = ChatCompletionRequest(model="m", messages=turns, tools=TOOLS, reasoning_effort="high")
    text = render_chat_text(tokenizer, body.messages, body.tools, chat_template_kwargs=body.template_kwargs())
    assert text.startswith("<|start|>system<|message|>Reasoning: high\n")
    assert ("<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
            '<|message|>{"city": "Paris"}<|call|>'
            "<|start|>functions.get_weather to=assistant<|channel|>commentary"
            '<|message|>{"temperature": 21}<|end|><|start|>assistant') in text
    own = body.model_copy(update={"chat_template_kwargs": {"reasoning_effort": "low"}})
    text = render_chat_text(tokenizer, own.messages, chat_template_kwargs=own.template_kwargs())
    assert "Reasoning: low" in text  # the request's own chat_template_kwargs win


# --------------------------------------------------------------------------- end to end

def escaped(text: str) -> str:
    """The regex of exactly this text (xgrammar warns at escaped blanks and quotes)."""
    return re.escape(text).replace('\\"', '"').replace("\\ ", " ").replace("\\\n", "\\n")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_harmony_checkpoint(tmp_path_factory.mktemp("harmony") / "gpt-oss-tiny",
                                   max_position_embeddings=1024)


@pytest.fixture(scope="module")
def engine(ckpt):
    client = LocalEngineClient(EngineConfig(model_path=str(ckpt), num_kv_blocks=256))
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def oai(engine, ckpt):
    settings = ServerSettings(model_path=str(ckpt))  # no parser flags: the template says harmony
    with running(attach(build_api(settings), engine, engine.tokenizer, settings)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def chat(oai, forced=None, **kwargs):
    extra = {"guided_regex": escaped(forced)} if forced else {}
    return oai.chat.completions.create(model="", **{"messages": ASK, "max_tokens": 300,
                                                    "extra_body": extra, **kwargs})


def streamed(oai, forced, **kwargs):
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in chat(oai, forced, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            pieces = (getattr(delta, "reasoning_content", None) or "") + (delta.content or "")
            assert "<|" not in pieces and not pieces.endswith("<")
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for d in delta.tool_calls or []:
                calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


def test_served_reasoning_and_final(oai):
    message = chat(oai, REASON_FINAL).choices[0].message
    assert (message.reasoning_content, message.content, message.tool_calls) == (
        "User asks 2+2. Easy.", "It is 4.", None)
    assert streamed(oai, REASON_FINAL) == ("User asks 2+2. Easy.", "It is 4.", [], "stop")


def test_served_tool_call(oai):
    choice = chat(oai, REASON_CALL, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "Need the weather tool."
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert streamed(oai, REASON_CALL, tools=TOOLS) == (
        "Need the weather tool.", "", [{"name": "get_weather", "arguments": '{"city": "Paris"}'}], "tool_calls")


def test_served_bad_call_is_text_not_an_error(oai):
    choice = chat(oai, BAD_JSON, tools=TOOLS).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (
        "{city: Paris", None, "stop")


def test_served_forced_call(oai):
    choice = chat(oai, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  temperature=1.0, seed=3).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and choice.finish_reason == "tool_calls"
    assert isinstance(json.loads(call.function.arguments)["city"], str)


@pytest.mark.parametrize("marker", ["<|return|>", "<|call|>"])
def test_served_stop_markers_end_output_unseen(oai, engine, marker):
    token = engine.tokenizer.convert_tokens_to_ids(marker)
    r = chat(oai, logit_bias={str(token): 100}, max_tokens=5)
    choice = r.choices[0]
    assert (choice.finish_reason, choice.message.content, r.usage.completion_tokens) == ("stop", None, 1)
    # Completions have no output plan (no added stop ids): the stop is the checkpoint's eos
    # (<|call|> only in generation_config.json).
    r = oai.completions.create(model="", prompt="Hi", logit_bias={str(token): 100}, max_tokens=5)
    assert (r.choices[0].finish_reason, r.choices[0].text, r.usage.completion_tokens) == ("stop", "", 1)


def test_served_reasoning_effort_reaches_the_template(oai, engine):
    def prompt_tokens(effort):
        text = render_chat_text(engine.tokenizer, ChatCompletionRequest(model="m", messages=ASK).messages,
                                chat_template_kwargs={"reasoning_effort": effort})
        assert f"Reasoning: {effort}\n" in text
        return len(engine.tokenizer.encode(text, add_special_tokens=False))

    expected = {effort: prompt_tokens(effort) for effort in ("low", "medium", "high")}
    assert len(set(expected.values())) == 3  # so the counts tell the efforts apart
    for effort in ("low", "high"):
        assert chat(oai, reasoning_effort=effort, max_tokens=1).usage.prompt_tokens == expected[effort]
    assert chat(oai, max_tokens=1).usage.prompt_tokens == expected["medium"]  # the template's default


def test_served_responses_api_items(oai):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    r = oai.responses.create(model="", input=ASK[0]["content"], tools=[tool], reasoning={"effort": "low"},
                             max_output_tokens=300, extra_body={"guided_regex": escaped(REASON_CALL)})
    reasoning, call = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Need the weather tool."
    assert (call.type, call.name, call.arguments) == ("function_call", "get_weather", '{"city": "Paris"}')


def test_parallel_calls_render_one_per_turn_each_with_its_result(tokenizer):
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": args}}
             for i, (name, args) in enumerate([("get_weather", '{"city": "Rome"}'), ("add", '{"a": 1}')])]
    results = [{"role": "tool", "tool_call_id": "c1", "content": "2"},  # out of order: matched by id
               {"role": "tool", "tool_call_id": "c0", "content": "sunny"}]
    body = ChatCompletionRequest(model="m", messages=ASK + [{"role": "assistant", "tool_calls": calls}] + results)
    text = render_chat_text(tokenizer, body.messages)
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>'
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>"
            '<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 1}<|call|>'
            "<|start|>functions.add to=assistant<|channel|>commentary<|message|>2<|end|>") in text


def test_served_json_answer_without_headers_is_content(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}
    choice = chat(oai, response_format=fmt, temperature=1.0, seed=1).choices[0]
    assert choice.finish_reason == "stop" and getattr(choice.message, "reasoning_content", None) is None
    assert isinstance(json.loads(choice.message.content)["city"], str)


def test_call_turn_text_joins_its_reasoning(tokenizer):
    call = {"id": "c0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    turn = {"role": "assistant", "content": "Adding.", "reasoning_content": "Use add.", "tool_calls": [call]}
    body = ChatCompletionRequest(model="m", messages=ASK + [turn, {"role": "tool", "content": "1"}])
    text = render_chat_text(tokenizer, body.messages)  # gpt-oss's template refuses both: joined
    assert ("<|start|>assistant<|channel|>analysis<|message|>Use add.\nAdding.<|end|>"
            "<|start|>assistant to=functions.add<|channel|>commentary json") in text


def test_null_answer_in_history_renders_empty(tokenizer):
    turns = ASK + [{"role": "assistant", "content": None, "reasoning_content": "Hmm."},
                   {"role": "user", "content": "Well?"}]
    text = render_chat_text(tokenizer, ChatCompletionRequest(model="m", messages=turns).messages)
    assert "<|start|>assistant<|channel|>final<|message|><|end|><|start|>user<|message|>Well?" in text


# --------------------------------------------------------------------------- fuzz

PIECES = ["<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary", " to=functions.add",
          " <|constrain|>json", "<|message|>", "<|end|>", "<|call|>", "<|return|>", '{"a": 1}', "{", "hi ",
          "<", "|", "\n"]


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=30), cuts=st.lists(st.integers(0, 400), max_size=4))
def test_fuzz_any_chunking_gives_the_one_shot_split(pieces, cuts):
    text = "".join(pieces)
    whole = plan(tools=TOOLS).parser().feed(text, final=True)
    parser, got = plan(tools=TOOLS).parser(), ("", "", [])
    bounds = [0] + sorted(min(c, len(text)) for c in cuts) + [len(text)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        out = parser.feed(text[a:b], final=i == len(bounds) - 2)
        got = (got[0] + out.reasoning, got[1] + out.content, got[2] + out.calls)
    assert got == (whole.reasoning, whole.content, whole.calls)


turn = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user"]), "content": st.text(max_size=8)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(st.none(), st.text(max_size=8)),
                           "reasoning_content": st.one_of(st.none(), st.text(max_size=8)),
                           "tool_calls": st.one_of(st.none(), st.lists(st.fixed_dictionaries({
                               "id": st.sampled_from(["a", "b"]), "type": st.just("function"),
                               "function": st.fixed_dictionaries({"name": st.sampled_from(["add", "f"]),
                                                                  "arguments": st.sampled_from(['{"a": 1}', "{", "[]"])})}),
                               max_size=3))}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": st.one_of(st.none(), st.text(max_size=8)),
                           "tool_call_id": st.one_of(st.none(), st.sampled_from(["a", "b", "c"]))}))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(turn, min_size=1, max_size=6))
def test_fuzz_harmony_rendering_renders_or_refuses(tokenizer, turns):
    messages = ChatCompletionRequest(model="m", messages=turns).messages
    try:
        text = render_chat_text(tokenizer, messages, TOOLS)
    except ValueError:
        return  # the route's 400
    assert text.endswith("<|start|>assistant")
