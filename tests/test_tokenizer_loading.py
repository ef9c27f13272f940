"""A Serve replica ends with the tokenizer of the class the engine's AutoTokenizer chose
(actors/worker/checkpoint_files.py): the one its files declare, loaded while the engine
starts, where that is the class; else loaded by the engine's class. The same tokenizer as
AutoTokenizer's, without importing torch.

Each case is a checkpoint whose files declare a tokenizer class the way released checkpoints
do (Qwen2's, GPT-2's, Llama 3's generic fast tokenizer, a Llama-class name over a byte-level
tokenizer.json, which AutoTokenizer replaces, none at all); loaded both ways, the class, the
ids of text and chat, and the decoded text must agree.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from actors.worker.checkpoint_files import (engine_tokenizer, load_declared_tokenizer, load_tokenizer,
                                           tokenizer_class_path)

REPO = Path(__file__).resolve().parent.parent
TEXTS = ["The quick brown fox, 1234 times!", "  leading spaces\nand a newline\t", "héllo wörld 日本"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]

# (model_type in config.json, tokenizer_class in tokenizer_config.json or None)
DECLARED = [("qwen2", "Qwen2Tokenizer"), ("gpt2", "GPT2Tokenizer"), ("llama", "PreTrainedTokenizerFast"),
            ("llama", "LlamaTokenizerFast"), ("qwen2", None), ("llama", "TokenizersBackend")]


def checkpoint_declaring(src: Path, dst: Path, model_type: str, tokenizer_class: str | None) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / name, dst / name)
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    tok_config = json.loads((dst / "tokenizer_config.json").read_text())
    tok_config.pop("tokenizer_class", None)
    if tokenizer_class is not None:
        tok_config["tokenizer_class"] = tokenizer_class
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return dst


@pytest.mark.parametrize("model_type,declared", DECLARED)
def test_the_replicas_tokenizer_equals_auto_tokenizer(llama_ckpt, tmp_path, model_type, declared):
    from transformers import AutoTokenizer

    path = checkpoint_declaring(llama_ckpt, tmp_path / "ckpt", model_type, declared)
    auto = AutoTokenizer.from_pretrained(str(path))
    guess = load_declared_tokenizer(path)
    by_class = engine_tokenizer(path, tokenizer_class_path(auto), guess)
    assert type(by_class) is type(auto)
    # the declared class is kept where AutoTokenizer chose it, and replaced where it did not
    assert (by_class is guess) == (guess is not None and type(guess) is type(auto))
    for text in TEXTS:
        assert by_class(text)["input_ids"] == auto(text)["input_ids"]
        assert by_class.decode(auto(text)["input_ids"]) == auto.decode(auto(text)["input_ids"])
    chat = dict(add_generation_prompt=True, tokenize=False)
    assert by_class.apply_chat_template(MESSAGES, **chat) == auto.apply_chat_template(MESSAGES, **chat)
    assert by_class.eos_token_id == auto.eos_token_id and by_class.all_special_ids == auto.all_special_ids


def test_a_declaration_that_does_not_load_leaves_the_engines_class(llama_ckpt, tmp_path):
    """The replica's guess never fails it: a class transformers lacks, or a config it cannot
    read (the engine, and so the server, fails on that one), guesses nothing."""
    path = checkpoint_declaring(llama_ckpt, tmp_path / "ckpt", "llama", "NoSuchTokenizer")
    assert load_declared_tokenizer(path) is None
    expected = load_tokenizer(path)
    tok = engine_tokenizer(path, tokenizer_class_path(expected), None)
    assert type(tok) is type(expected) and tok(TEXTS[0])["input_ids"] == expected(TEXTS[0])["input_ids"]
    (path / "tokenizer_config.json").write_text("{not json")
    assert load_declared_tokenizer(path) is None


def test_a_class_outside_transformers_goes_through_auto_tokenizer(llama_ckpt):
    """Remote code's classes live in modules the replica may not have: AutoTokenizer loads those."""
    tok = load_tokenizer(llama_ckpt, "transformers_modules.someone.tokenization:CustomTokenizer")
    assert tok("hello")["input_ids"] == load_tokenizer(llama_ckpt)("hello")["input_ids"]


def test_loading_by_class_imports_no_torch(llama_ckpt):
    """What the replica does, in a fresh process: no torch, and the tokenizer works. AutoTokenizer
    in the same kind of process does import it (the reason for the class path)."""
    def torch_after(load: str) -> bool:
        code = ("import sys; from pathlib import Path\n"
                "from actors.worker.checkpoint_files import engine_tokenizer, load_declared_tokenizer, load_tokenizer\n"
                f"tok = {load}\n"
                "assert tok.decode(tok('fox')['input_ids']) == 'fox'\n"
                "print('torch' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip() == "True"

    path = f"Path({str(llama_ckpt)!r})"
    class_path = tokenizer_class_path(load_tokenizer(llama_ckpt))
    assert not torch_after(f"engine_tokenizer({path}, {class_path!r}, load_declared_tokenizer({path}))")
    assert not torch_after(f"load_tokenizer({path}, {class_path!r})")
    assert torch_after(f"load_tokenizer({path})")
