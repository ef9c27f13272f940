"""OpenAI protocol: request validation, SamplingParams mapping, response and chunk shapes.

No engine here: outputs are built by hand, the tokenizer is the tiny test BPE.
"""
import argparse

import pytest
from pydantic import ValidationError

from actors.config import EngineConfig
from actors.outputs import CompletionOutput, RequestOutput
from app.cli.engine_args import add_engine_args, engine_config_from_args, engine_overrides
from app.cli.main import build_parser
from app.protocol.chat_template import render_chat_prompt, render_chat_text
from app.protocol.models import (
    ChatCompletionRequest, CompletionRequest, RequestError, validation_error_body,
)
from app.protocol.responses import (
    ChatStream, CompletionStream, chat_response, completion_response, token_text,
)
from checkpoints import build_tokenizer

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def chat(**body):
    return ChatCompletionRequest.model_validate({"messages": USER, **body})


def completion(**body):
    return CompletionRequest.model_validate({"prompt": "hello", **body})


def error_of(cls, body) -> dict:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    return validation_error_body(info.value)["error"]


# --------------------------------------------------------------------------- validation

@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "temperature": -1}, "temperature"),
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": USER, "n": 0}, "n"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "presence_penalty": 3}, "presence_penalty"),
    ({"messages": USER, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"12": 101}}, "logit_bias"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": USER, "stop": 5}, "stop"),
    ({"messages": USER, "tool_choice": "maybe"}, "tool_choice"),
    ({"messages": USER, "min_p": 2}, "min_p"),
    ({"messages": USER, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0.type"),
])
def test_chat_errors_name_the_field(body, param):
    error = error_of(ChatCompletionRequest, body)
    assert error["param"] == param
    assert error["message"].startswith(param + ": ")
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": [[1, "a"]]}, "prompt.0.1"),
])
def test_completion_errors_name_the_field(body, param):
    assert error_of(CompletionRequest, body)["param"] == param


def test_error_body_has_openai_shape():
    with pytest.raises(ValidationError) as info:
        chat(temperature=-1)
    body = validation_error_body(info.value)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_unknown_fields_are_ignored():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x", "weird": 1}], "store": True,
        "metadata": {"a": "b"}, "service_tier": "auto"})
    assert not hasattr(req, "store")
    assert completion(modalities=["text"]).prompt == "hello"


def test_message_content_forms():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": [{"type": "text", "text": "a"},
                                       {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]})
    assert req.messages[0].text() == "a\nb"
    assert req.messages[1].tool_calls[0].function.name == "f"
    assert req.messages[2].tool_call_id == "c1"


def test_completion_prompt_forms():
    assert completion(prompt="a").prompts() == ["a"]
    assert completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert completion(prompt=[1, 2]).prompts() == [[1, 2]]
    assert completion(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]


# --------------------------------------------------------------------------- sampling params

def test_chat_to_sampling_params_maps_every_field():
    params = chat(
        n=2, max_tokens=9, max_completion_tokens=7, temperature=0.5, top_p=0.9, seed=3,
        stop="END", presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"5": -100},
        logprobs=True, top_logprobs=4, top_k=-1, min_p=0.05, repetition_penalty=1.1,
        ignore_eos=True, min_tokens=2, stop_token_ids=[7], skip_special_tokens=False,
        include_stop_str_in_output=True, prompt_logprobs=1,
    ).to_sampling_params(None, 100, 10)
    assert (params.n, params.max_tokens, params.temperature, params.top_p) == (2, 7, 0.5, 0.9)
    assert (params.seed, params.stop, params.stop_token_ids) == (3, ["END"], [7])
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.logit_bias == {5: -100.0}
    assert (params.logprobs, params.prompt_logprobs) == (4, 1)
    assert (params.top_k, params.min_p, params.repetition_penalty) == (0, 0.05, 1.1)
    assert params.ignore_eos and params.min_tokens == 2
    assert not params.skip_special_tokens and params.include_stop_str_in_output


def test_defaults_map_to_engine_defaults():
    params = chat().to_sampling_params(None, 100, 10)
    assert (params.temperature, params.top_p, params.top_k, params.logprobs) == (1.0, 1.0, 0, None)
    assert params.max_tokens == 90  # the rest of the context
    assert chat().to_sampling_params(32, 100, 10).max_tokens == 32
    assert chat().to_sampling_params(500, 100, 10).max_tokens == 90
    assert chat(logprobs=True).to_sampling_params(None, 100, 10).logprobs == 0
    assert completion().to_sampling_params(None, 100, 10).max_tokens == 16


def test_completion_echo_logprobs_asks_for_prompt_logprobs():
    params = completion(echo=True, logprobs=3).to_sampling_params(None, 100, 5)
    assert (params.logprobs, params.prompt_logprobs) == (3, 3)
    assert completion(logprobs=3).to_sampling_params(None, 100, 5).prompt_logprobs is None


def test_context_length_error_has_the_numbers():
    with pytest.raises(RequestError) as info:
        chat(max_tokens=50).to_sampling_params(None, 100, 60)
    assert "100" in str(info.value) and "110" in str(info.value)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(RequestError) as info:
        chat().to_sampling_params(None, 100, 100)  # nothing left to generate
    assert info.value.param == "messages"
    assert completion(max_tokens=0).to_sampling_params(None, 100, 100).max_tokens == 0


# --------------------------------------------------------------------------- responses

def test_token_text_escapes_partial_characters(tok):
    ids = tok.encode("a 你")
    texts = [token_text(tok, i) for i in ids]
    assert texts[0] == ("a", [97])
    partial = [t for t in texts if t[0].startswith("\\x")]
    assert partial and all(len(raw) == 1 for _, raw in partial)
    assert b"".join(bytes(raw) for _, raw in texts).decode() == "a 你"


def test_chat_response_shape_and_logprobs(tok):
    a, b, c = tok.encode("hello world fish")[:3]
    out = RequestOutput("r", [1, 2, 3], [
        CompletionOutput(0, "x", [a, b], [{a: -0.5, b: -0.1, c: -2.0}, {b: float("-inf"), a: -0.2}],
                         "stop", "END")], finished=True)
    body = chat_response(chat(logprobs=True, top_logprobs=2), out, tok, "m", "chatcmpl-1")
    assert set(body) == {"id", "object", "created", "model", "choices", "usage",
                         "system_fingerprint"}
    assert (body["id"], body["object"], body["model"]) == ("chatcmpl-1", "chat.completion", "m")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "x", "refusal": None}
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "END")
    first, second = choice["logprobs"]["content"]
    assert first["token"] == token_text(tok, a)[0] and first["logprob"] == -0.5
    assert first["bytes"] == list(first["token"].encode())
    assert [t["logprob"] for t in first["top_logprobs"]] == [-0.1, -0.5]  # the top 2, sorted
    assert set(first["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    assert second["logprob"] == -9999.0  # -inf is not JSON
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert chat_response(chat(), out, tok, "m", "c")["choices"][0]["logprobs"] is None


def test_completion_response_echo_and_multiple_prompts(tok):
    p1, p2 = tok.encode("hello world"), tok.encode("abc")
    g = tok.encode(" fish")[0]
    outs = [
        RequestOutput("a", p1, [CompletionOutput(0, " fish", [g], [{g: -1.0}], "length"),
                                CompletionOutput(1, " fish", [g], [{g: -1.5}], "length")],
                      True, prompt_logprobs=[None] + [{t: -2.0} for t in p1[1:]]),
        RequestOutput("b", p2, [CompletionOutput(0, " fish", [g], [{g: -1.0}], "stop", g),
                                CompletionOutput(1, "", [], [], "length")],
                      True, prompt_logprobs=[None] + [{t: -3.0} for t in p2[1:]]),
    ]
    req = completion(prompt=["hello world", "abc"], n=2, echo=True, logprobs=1)
    body = completion_response(req, outs, tok, "m", "cmpl-1")
    assert (body["object"], body["id"]) == ("text_completion", "cmpl-1")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    first = body["choices"][0]
    assert first["text"] == "hello world fish"
    lp = first["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [-2.0] * (len(p1) - 1) + [-1.0]
    assert "".join(lp["tokens"]) == "hello world fish"
    assert lp["text_offset"][-1] == len("hello world")
    assert body["choices"][2]["text"] == "abc fish"
    assert body["choices"][2]["stop_reason"] == g
    assert body["usage"]["prompt_tokens"] == len(p1) + len(p2)
    assert body["usage"]["completion_tokens"] == 3


def delta(rid, outputs, finished=False, prompt=(1, 2)):
    return RequestOutput(rid, list(prompt), outputs, finished)


def test_chat_stream_chunks(tok):
    stream = ChatStream(chat(n=2, stream=True, stream_options={"include_usage": True}),
                        tok, "m", "chatcmpl-9")
    roles = stream.role_chunks()
    assert [c["choices"][0]["delta"] for c in roles] == [{"role": "assistant", "content": ""}] * 2
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in roles)
    chunks = stream.chunks(delta("r", [CompletionOutput(0, "he", [3]),
                                       CompletionOutput(1, "", [4])]))
    assert len(chunks) == 1  # choice 1 has no visible text yet
    assert chunks[0]["choices"][0] == {"index": 0, "delta": {"content": "he"}, "logprobs": None,
                                       "finish_reason": None, "stop_reason": None}
    last = stream.chunks(delta("r", [CompletionOutput(1, "", [5], finish_reason="length")], True))
    final = last[0]["choices"][0]
    assert final["delta"] == {} and final["finish_reason"] == "length"
    usage = stream.usage_chunk()
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 2 + 3
    assert usage["id"] == "chatcmpl-9"


def test_chat_stream_first_delta_carries_the_role(tok):
    stream = ChatStream(chat(stream=True), tok, "m", "chatcmpl-9")
    first = stream.chunks(delta("r", [CompletionOutput(0, "", [4])]))
    assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    second = stream.chunks(delta("r", [CompletionOutput(0, "a", [5])]))
    assert second[0]["choices"][0]["delta"] == {"content": "a"}


def test_chat_stream_without_usage_has_no_usage_key(tok):
    stream = ChatStream(chat(stream=True), tok, "m", "chatcmpl-9")
    assert "usage" not in stream.role_chunks()[0]
    assert stream.usage_chunk() is None


def test_completion_stream_echo_and_indices(tok):
    req = completion(prompt=["ab", "cd"], n=1, echo=True, stream=True,
                     stream_options={"include_usage": True})
    stream = CompletionStream(req, tok, "m", "cmpl-9")
    first = stream.chunks(delta("r1", [CompletionOutput(0, "x", [9])], prompt=[1]), 1)
    assert first[0]["choices"][0]["text"] == "cdx" and first[0]["choices"][0]["index"] == 1
    again = stream.chunks(delta("r1", [CompletionOutput(0, "y", [9], finish_reason="stop")],
                                True, prompt=[1]), 1)
    assert again[0]["choices"][0]["text"] == "y"
    assert first[0]["object"] == "text_completion" and first[0]["usage"] is None
    assert stream.usage_chunk()["usage"] == {"prompt_tokens": 1, "completion_tokens": 2,
                                             "total_tokens": 3}


# --------------------------------------------------------------------------- chat template

def test_render_chat_joins_text_parts_and_parses_tool_arguments(tok):
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "2"}],
        "tools": [{"type": "function", "function": {"name": "f"}}]})
    text = render_chat_text(tok, req.messages, req.tools)
    assert "<|im_start|>user\na\nb<|im_end|>" in text
    assert '{"name": "f", "arguments": {"x": 1}}' in text
    assert '"name": "f"' in text.split("<tools>\n")[1]
    ids = render_chat_prompt(tok, req.messages, req.tools)[1]
    assert ids == tok.encode(text, add_special_tokens=False)


def test_render_chat_thinking_switch(tok):
    off = render_chat_text(tok, USER, disable_thinking=True)
    assert off.endswith("<think>\n\n</think>\n\n")
    assert not render_chat_text(tok, USER).endswith("</think>\n\n")
    kept = render_chat_text(tok, USER, chat_template_kwargs={"enable_thinking": True},
                            disable_thinking=True)
    assert not kept.endswith("</think>\n\n")  # the request's own setting wins


def test_render_chat_template_without_thinking_and_errors():
    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert render_chat_text(tok, USER, disable_thinking=True) == "hi"
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate"):
        render_chat_prompt(tok, USER)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        render_chat_prompt(tok, USER)


# --------------------------------------------------------------------------- cli

def test_engine_args_cover_every_config_field():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    assert dests == EngineConfig.field_names()


@pytest.mark.parametrize("argv, expected", [
    (["--model", "m"], {"model_path": "m"}),
    (["--model-name-or-path", "m"], {"model_path": "m"}),
    (["--gpu-memory-utilization", "0.5"], {"gpu_memory_utilization": 0.5}),
    (["--mem-fraction-static", "0.5"], {"gpu_memory_utilization": 0.5}),
    (["--enforce-eager"], {"eager_decode": True}),
    (["--cuda-graph-sizes", "1", "2", "64"], {"cuda_graph_sizes": [1, 2, 64]}),
    (["--max-seq-len-to-capture", "4096"], {"max_seq_len_to_capture": 4096}),
    (["--no-enable-prefix-caching"], {"enable_prefix_caching": False}),
    (["--chunked-prefill-size", "64"], {"max_num_batched_tokens": 64}),
    (["--max-running-prompts", "4"], {"max_num_seqs": 4}),
    (["--max-running-requests", "4"], {"max_num_seqs": 4}),
    (["--tensor-parallel-size", "2", "--pp", "2"], {"tp_size": 2, "pp_size": 2}),
    (["-tp", "2", "--pipeline-parallel-size", "3"], {"tp_size": 2, "pp_size": 3}),
    (["--dtype", "half"], {"dtype": "float16"}),
    ([], {}),
])
def test_engine_arg_aliases_and_only_given_options(argv, expected):
    args = build_parser().parse_args(["run-batch", "-i", "x", "-o", "y", *argv])
    assert engine_overrides(args) == expected
    config = engine_config_from_args(args, base={"block_size": 32})
    assert config.block_size == 32 and config.seed == EngineConfig().seed


def test_bad_engine_option_is_rejected():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run-batch", "-i", "x", "-o", "y", "--device", "tpu"])


def test_generation_config_sampling_defaults_fill_only_unset_fields(tmp_path):
    import json

    from app.protocol.generation_defaults import model_sampling_defaults, with_model_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "max_length": 99, "min_p": None}))
    defaults = model_sampling_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert model_sampling_defaults(tmp_path, "vllm") == {} and model_sampling_defaults(tmp_path / "none") == {}
    params = with_model_defaults(chat(temperature=0.0), defaults).to_sampling_params(None, 100, 10)
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.9, 20)  # the request's temperature wins
    assert with_model_defaults(completion(), {}).to_sampling_params(None, 100, 10).top_k == completion().to_sampling_params(
        None, 100, 10).top_k
