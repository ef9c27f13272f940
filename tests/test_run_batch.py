"""`shoal run-batch`: line parsing (no engine), then the real command on a tiny checkpoint."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from actors.sampling_params import SamplingParams
from app.cli.run_batch import parse_line
from app.protocol.chat_template import render_chat_prompt

SHOAL = str(Path(sys.executable).parent / "shoal")
ENGINE = ["--dtype", "float32", "--device", "cpu", "--num-threads", "2"]
CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The quick brown fox"
TOKEN_PROMPT = [71, 72, 73, 74]
# Small on purpose: the tiny checkpoint has 512 positions and the tools go into the prompt.
DIGIT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["n"]}
TOOLS = [{"type": "function", "function": {"name": "pick", "parameters": DIGIT}}]
ASK = [{"role": "user", "content": "Pick a digit."}]


def line(custom_id, url, body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


INPUT = [
    line("chat", "/v1/chat/completions",
         {"model": "any", "messages": CHAT_MESSAGES, "max_tokens": 8, "temperature": 0}),
    line("chat-n", "/v1/chat/completions",
         {"messages": CHAT_MESSAGES, "max_tokens": 4, "n": 2, "seed": 1, "logprobs": True,
          "top_logprobs": 2}),
    line("text", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}),
    line("ids", "/v1/completions", {"prompt": TOKEN_PROMPT, "max_tokens": 8, "temperature": 0}),
    line("echo", "/v1/completions",
         {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}),
    line("multi", "/v1/completions",
         {"prompt": [PROMPT, "Once upon a time"], "n": 2, "max_tokens": 3, "seed": 5}),
    "{not json",
    line("bad-field", "/v1/completions", {"prompt": PROMPT, "temperature": -1}),
    line("too-long", "/v1/completions", {"prompt": PROMPT, "max_tokens": 100_000}),
    line("bad-url", "/v1/moderations", {"input": "x"}),
    line("embed", "/v1/embeddings", {"input": [PROMPT, "Once upon a time"], "dimensions": 16}),
    line("embed-b64", "/v1/embeddings", {"input": TOKEN_PROMPT, "encoding_format": "base64"}),
    line("embed-long", "/v1/embeddings", {"input": list(range(600))}),
    line("tool", "/v1/chat/completions",
         {"messages": ASK, "tools": TOOLS, "max_tokens": 60, "temperature": 0,
          "tool_choice": {"type": "function", "function": {"name": "pick"}}}),
    line("json", "/v1/chat/completions",
         {"messages": ASK, "max_tokens": 30, "temperature": 0, "response_format": {
             "type": "json_schema", "json_schema": {"name": "digit", "schema": DIGIT}}}),
    line("guided", "/v1/completions",
         {"prompt": PROMPT, "max_tokens": 8, "guided_choice": ["red", "green"]}),
    line("bad-tool", "/v1/chat/completions",
         {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
    "",  # a trailing blank line is not a request
]


# --------------------------------------------------------------------------- parsing only

def test_parse_line_errors():
    assert parse_line(1, "{nope").line_error["code"] == "invalid_json"
    assert parse_line(1, "[1]").line_error is not None
    bad_url = parse_line(1, line("a", "/v1/moderations", {}))
    assert bad_url.error["error"]["param"] == "url" and bad_url.custom_id == "a"
    bad_body = parse_line(1, line("b", "/v1/completions", {"prompt": "x", "top_p": 2}))
    assert bad_body.error["error"]["param"] == "top_p"
    ok = parse_line(1, line("c", "/v1/chat/completions", {"messages": CHAT_MESSAGES, "x": 1}))
    assert ok.error is None and ok.request.messages[0].content == CHAT_MESSAGES[0]["content"]


# --------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def results(llama_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("run_batch")
    src, dst = root / "in.jsonl", root / "out.jsonl"
    src.write_text("\n".join(INPUT) + "\n")
    proc = subprocess.run([SHOAL, "run-batch", "--model-path", str(llama_ckpt), "-i", str(src),
                           "-o", str(dst), "--tool-call-parser", "hermes", *ENGINE],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(text) for text in dst.read_text().splitlines()]
    return {row["custom_id"] or "malformed": row for row in rows}, rows, proc.stderr


@pytest.fixture(scope="module")
def llm(llama_ckpt):
    from actors.engine.llm import LLM
    return LLM(str(llama_ckpt), dtype="float32", device="cpu", num_threads=2)


def body(results, custom_id):
    row = results[0][custom_id]
    assert row["error"] is None and row["response"]["status_code"] == 200
    assert row["id"].startswith("batch_req_") and row["response"]["request_id"]
    return row["response"]["body"]


def greedy(llm, prompt, max_tokens=8):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0]


def test_one_line_per_input_line_in_order(results):
    _, rows, stderr = results
    ids = [row["custom_id"] for row in rows]
    assert ids == ["chat", "chat-n", "text", "ids", "echo", "multi", None, "bad-field",
                   "too-long", "bad-url", "embed", "embed-b64", "embed-long", "tool", "json", "guided", "bad-tool"]
    assert len({row["id"] for row in rows}) == len(rows)
    assert "requests" in stderr  # the tqdm bar


def test_chat_matches_in_process_generate(results, llm):
    chat = body(results, "chat")
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
    choice = chat["choices"][0]
    expected = greedy(llm, render_chat_prompt(llm.tokenizer, CHAT_MESSAGES)[1])
    assert choice["message"]["content"] == expected.text
    assert choice["finish_reason"] == expected.finish_reason
    assert chat["usage"]["completion_tokens"] == len(expected.token_ids)


def test_completions_match_in_process_generate(results, llm):
    for custom_id, prompt in (("text", PROMPT), ("ids", TOKEN_PROMPT)):
        completion = body(results, custom_id)
        assert completion["object"] == "text_completion" and completion["id"].startswith("cmpl-")
        assert completion["choices"][0]["text"] == greedy(llm, prompt).text


def test_n_and_logprobs(results):
    choices = body(results, "chat-n")["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for choice in choices:
        content = choice["logprobs"]["content"]
        assert len(content) == 4
        assert all(len(entry["top_logprobs"]) == 2 for entry in content)
        assert all(entry["logprob"] <= 0 for entry in content)


def test_echo_logprobs(results, llm):
    choice = body(results, "echo")["choices"][0]
    assert choice["text"] == PROMPT + greedy(llm, PROMPT, 3).text
    logprobs = choice["logprobs"]
    n_prompt = len(llm.tokenizer.encode(PROMPT))
    assert len(logprobs["tokens"]) == n_prompt + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp is not None for lp in logprobs["token_logprobs"][1:])
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"][1:])


def test_list_prompt_gives_prompt_major_choices(results):
    completion = body(results, "multi")
    assert [c["index"] for c in completion["choices"]] == [0, 1, 2, 3]
    assert completion["usage"]["completion_tokens"] == 4 * 3


def test_bad_lines_get_errors_and_do_not_stop_the_rest(results):
    malformed = results[0]["malformed"]
    assert malformed["response"] is None and malformed["error"]["code"] == "invalid_json"
    for custom_id, param in (("bad-field", "temperature"), ("too-long", "max_tokens"),
                             ("bad-url", "url"), ("bad-tool", "tool_choice")):
        response = results[0][custom_id]["response"]
        assert response["status_code"] == 400
        assert response["body"]["error"]["param"] == param
    too_long = results[0]["too-long"]["response"]["body"]["error"]
    assert too_long["code"] == "context_length_exceeded" and "100000" in too_long["message"]
    long_input = results[0]["embed-long"]["response"]["body"]["error"]
    assert long_input["code"] == "context_length_exceeded" and long_input["param"] == "input"
    assert "600 tokens in the input" in long_input["message"]


def test_embeddings_as_the_server_makes_them(results, llm):
    """/v1/embeddings lines: a vector per input in input order, cut to `dimensions` and
    renormalised, or base64 float32; the same vectors the engine's embed() gives."""
    import base64
    import struct

    from actors.pooling_params import PoolingParams
    embed = body(results, "embed")
    assert embed["object"] == "list" and [d["index"] for d in embed["data"]] == [0, 1]
    want = llm.embed([PROMPT, "Once upon a time"], PoolingParams(dimensions=16))
    for got, out in zip(embed["data"], want):
        assert len(got["embedding"]) == 16
        assert got["embedding"] == pytest.approx(out.embedding, abs=1e-5)
    assert embed["usage"]["prompt_tokens"] == len(llm.encode(PROMPT)) + len(llm.encode("Once upon a time"))
    packed = base64.b64decode(body(results, "embed-b64")["data"][0]["embedding"])
    full = llm.embed([TOKEN_PROMPT])[0].embedding
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(full, abs=1e-5)


def test_tool_calls_and_structured_outputs_as_the_server_makes_them(results):
    """A forced call comes back parsed into tool_calls; response_format and guided_* hold."""
    choice = body(results, "tool")["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "pick" and call["id"].startswith("call_")
    assert 0 <= json.loads(call["function"]["arguments"])["n"] <= 9
    content = body(results, "json")["choices"][0]["message"]["content"]
    assert 0 <= json.loads(content)["n"] <= 9
    assert body(results, "guided")["choices"][0]["text"] in ("red", "green")


def test_unknown_parser_fails_at_start(tmp_path):
    proc = subprocess.run([SHOAL, "run-batch", "-i", "x", "-o", "y", "--tool-call-parser", "nope"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--tool-call-parser" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("change, options, message", [
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, [], "'bitsandbytes' checkpoints"),
    ({}, ["--quantization", "awq"], "--quantization awq is for awq checkpoints; this one is not quantized"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [0, 0]}}, [], "FP8 checkpoint with"),
])
def test_a_checkpoint_or_setting_it_cannot_honour_fails_in_one_line(change, options, message, llama_ckpt, tmp_path):
    """As `shoal serve` does: one line naming the reason, exit 1, no traceback, no output file."""
    import shutil

    path = shutil.copytree(llama_ckpt, tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(line("plain", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8}) + "\n")
    proc = subprocess.run([SHOAL, "run-batch", "--model-path", str(path), "-i", str(src), "-o", str(dst), *ENGINE,
                           *options], capture_output=True, text=True, timeout=300)
    errors = [text for text in proc.stderr.splitlines() if "error" in text.lower()]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"shoal run-batch: error: {message}"), errors
    assert not dst.exists()


def test_the_models_sampling_defaults_apply(llama_ckpt, llm, tmp_path):
    """A line without temperature takes generation_config.json's (0 here: greedy), as `shoal serve`."""
    import shutil

    path = shutil.copytree(llama_ckpt, tmp_path / "model")
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.0}))
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(line("plain", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8}) + "\n")
    proc = subprocess.run([SHOAL, "run-batch", "--model-path", str(path), "-i", str(src), "-o", str(dst), *ENGINE],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "sampling defaults from the model's generation_config.json: temperature=0.0" in proc.stderr
    (row,) = [json.loads(text) for text in dst.read_text().splitlines()]
    assert row["response"]["body"]["choices"][0]["text"] == greedy(llm, PROMPT).text


@pytest.mark.parametrize("compile_after_s", [None, "0"])
def test_a_compiled_run_exits_with_its_results_and_its_compile_job_stopped(compile_after_s, llama_ckpt, llm, tmp_path):
    """The default (compiled decode): a batch shorter than 10 s of eager decode starts no compile
    job (it would not live to use it). Started at once (SHOAL_COMPILE_AFTER_S=0), its job is
    stopped on the way out of a batch shorter than the compile. Either writes its results and
    exits 0 without the interpreter's teardown."""
    env = {k: v for k, v in os.environ.items() if k != "SHOAL_EAGER_DECODE"}
    if compile_after_s is not None:
        env["SHOAL_COMPILE_AFTER_S"] = compile_after_s
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(line("text", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}) + "\n")
    proc = subprocess.run([SHOAL, "run-batch", "--model-path", str(llama_ckpt), "-i", str(src), "-o", str(dst), *ENGINE],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    (row,) = [json.loads(text) for text in dst.read_text().splitlines()]
    assert row["response"]["body"]["choices"][0]["text"] == greedy(llm, PROMPT).text
    job = re.search(r"compiling the decode step in the background \(pid (\d+)\)", proc.stderr)
    assert "decode compiled" in proc.stderr, proc.stderr  # (not eager: the compiled kind, its job waiting)
    if compile_after_s is None:
        assert job is None and "once idle or after 10 s of eager decode" in proc.stderr, proc.stderr
        return
    assert job, proc.stderr
    with pytest.raises(ProcessLookupError):
        os.kill(int(job.group(1)), 0)
