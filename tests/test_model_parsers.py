"""The model's own output parsers (app/protocol/model_parsers.py): declared in a checkpoint's
config.json or implied by its family, used wherever the flags are silent: the HTTP server
(`attach`, which `shoal serve` and `serve run` go through; tests/test_serve_e2e.py runs
dev.yaml on the bundled model) and `shoal run-batch`."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from test_api import running

from actors.config import EngineConfig
from actors.worker.checkpoint_files import BUNDLED_MODEL
from app.api.app import attach, build_api
from app.api.engine_client import LocalEngineClient
from app.api.settings import ServerSettings
from app.protocol.model_parsers import model_parsers

THOUGHT = r"<think>\n[a-z]{3,8} [a-z]{3,8}\n</think>\n\n(yes|no)"
ASK = [{"role": "user", "content": "Is it raining?"}]


def test_declared_then_family_then_nothing():
    declared = {"model_type": "llama", "reasoning_parser": "deepseek_r1", "tool_call_parser": "hermes"}
    assert model_parsers(declared) == {"reasoning_parser": "deepseek_r1", "tool_call_parser": "hermes"}
    assert model_parsers({"model_type": "qwen3"}) == {"reasoning_parser": "qwen3"}
    for family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):  # (Qwen3.5's image-text wrappers' model_type)
        assert model_parsers({"model_type": family}) == {"reasoning_parser": "qwen3"}
    assert model_parsers({"model_type": "qwen3_moe", "tool_call_parser": "hermes"}) == {
        "reasoning_parser": "qwen3", "tool_call_parser": "hermes"}
    assert model_parsers({"model_type": "qwen2"}, "DeepSeek-R1-Distill-Qwen-7B") == {
        "reasoning_parser": "deepseek_r1"}
    assert model_parsers({"model_type": "llama"}, "Llama-3.1-8B") == {}
    bundled = json.loads((BUNDLED_MODEL / "config.json").read_text())
    assert model_parsers(bundled) == {"reasoning_parser": "qwen3", "tool_call_parser": "hermes"}


@pytest.fixture(scope="module")
def declaring_ckpt(llama_ckpt, tmp_path_factory):
    """The tiny llama checkpoint, with its config.json declaring the qwen3 reasoning parser."""
    path = tmp_path_factory.mktemp("declaring") / "thinker"
    shutil.copytree(llama_ckpt, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "reasoning_parser": "qwen3"}))
    return path


@pytest.fixture(scope="module")
def engine(declaring_ckpt):
    client = LocalEngineClient(EngineConfig(model_path=str(declaring_ckpt), num_kv_blocks=128))
    yield client
    client.shutdown()


def ask(engine, path, **settings):
    settings = ServerSettings(model_path=str(path), **settings)
    with running(attach(build_api(settings), engine, engine.tokenizer, settings)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        return client.chat.completions.create(model="", messages=ASK, max_tokens=40,
                                              extra_body={"guided_regex": THOUGHT}).choices[0].message


def test_server_without_flags_splits_what_the_model_declares(engine, declaring_ckpt):
    message = ask(engine, declaring_ckpt)
    assert len(message.reasoning_content.split()) == 2 and message.content in ("yes", "no")
    off = ask(engine, declaring_ckpt, reasoning_parser="none")  # a flag always wins
    assert getattr(off, "reasoning_content", None) is None  # the thought stays in the content
    assert len(off.content.split()) == 3 and off.content.split()[-1] in ("yes", "no")


def test_run_batch_without_flags_splits_what_the_model_declares(declaring_ckpt, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "t", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"messages": ASK, "max_tokens": 40,
                                        "guided_regex": THOUGHT}}) + "\n")
    shoal = str(Path(sys.executable).parent / "shoal")
    proc = subprocess.run([shoal, "run-batch", "--model-path", str(declaring_ckpt), "-i", str(src),
                           "-o", str(dst), "--device", "cpu", "--num-kv-blocks", "64"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    message = json.loads(dst.read_text())["response"]["body"]["choices"][0]["message"]
    assert len(message["reasoning_content"].split()) == 2 and message["content"] in ("yes", "no")
