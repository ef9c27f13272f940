"""A Serve replica ends with the tokenizer of the class the engine's AutoTokenizer chose
(actors/worker/checkpoint_files.py): the one its files declare, loaded while the engine
starts, where that is the class; else loaded by the engine's class. The same tokenizer as
AutoTokenizer's, without importing torch. The engine, at its second start on the same files,
loads the class AutoTokenizer chose at its first.

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
    assert torch_after(f"__import__('transformers').AutoTokenizer.from_pretrained(str({path}))")


@pytest.fixture
def tokenizer_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_TOKENIZER_CACHE", str(tmp_path / "tokenizer-cache"))
    return tmp_path / "tokenizer-cache"


def auto_tokenizer_calls(monkeypatch) -> list:
    """Count AutoTokenizer's loads (it still loads): the remembered class must make them unneeded."""
    from transformers import AutoTokenizer
    calls, real = [], AutoTokenizer.from_pretrained.__func__

    def counted(cls, *args, **kwargs):
        calls.append(args[0])
        return real(cls, *args, **kwargs)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(counted))
    return calls


@pytest.mark.parametrize("model_type,declared", DECLARED)
def test_a_later_load_takes_the_class_auto_tokenizer_chose(llama_ckpt, tmp_path, tokenizer_cache, monkeypatch,
                                                          model_type, declared):
    """The engine's tokenizer at its next start: the class AutoTokenizer chose at the first,
    loaded directly (AutoTokenizer's choice costs ~1 s of imports); the same tokenizer."""
    path = checkpoint_declaring(llama_ckpt, tmp_path / "ckpt", model_type, declared)
    calls = auto_tokenizer_calls(monkeypatch)
    first = load_tokenizer(path)
    again = load_tokenizer(path)
    assert calls == [str(path)]  # only the first asked AutoTokenizer
    assert type(again) is type(first)
    for text in TEXTS:
        assert again(text)["input_ids"] == first(text)["input_ids"]
    chat = dict(add_generation_prompt=True, tokenize=False)
    assert again.apply_chat_template(MESSAGES, **chat) == first.apply_chat_template(MESSAGES, **chat)
    assert again.eos_token_id == first.eos_token_id and again.all_special_ids == first.all_special_ids


def test_changed_files_ask_auto_tokenizer_again(llama_ckpt, tmp_path, tokenizer_cache, monkeypatch):
    """A file edited in place (here the declared class, which AutoTokenizer then follows) is a new
    choice; so is another directory with the same files."""
    path = checkpoint_declaring(llama_ckpt, tmp_path / "ckpt", "llama", "Qwen2Tokenizer")
    calls = auto_tokenizer_calls(monkeypatch)
    assert type(load_tokenizer(path)).__name__ == "Qwen2Tokenizer"
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    assert type(load_tokenizer(path)).__name__ == "GPT2Tokenizer"
    copy = shutil.copytree(path, tmp_path / "copy")
    load_tokenizer(copy)
    assert calls == [str(path), str(path), str(copy)]
    load_tokenizer(path), load_tokenizer(copy)
    assert len(calls) == 3


def test_an_unwritable_cache_only_costs_time(llama_ckpt, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SHOAL_TOKENIZER_CACHE", str(blocker / "cache"))  # a folder under a file
    calls = auto_tokenizer_calls(monkeypatch)
    assert load_tokenizer(llama_ckpt)("fox")["input_ids"] == load_tokenizer(llama_ckpt)("fox")["input_ids"]
    assert len(calls) == 2


def test_the_engine_names_the_remembered_class_while_its_tokenizer_loads(llama_ckpt, tokenizer_cache, monkeypatch):
    """A replica asks the engine for its tokenizer's class as soon as the engine is up: where the
    class is remembered, the answer does not wait for the load (the class being loaded is that one)."""
    import threading

    from actors.config import EngineConfig
    from actors.engine import llm_engine

    first = llm_engine.LLMEngine(EngineConfig(model_path=str(llama_ckpt), num_kv_blocks=32))
    chosen = first.tokenizer_class  # nothing remembered: AutoTokenizer's choice, waited for
    assert chosen == tokenizer_class_path(first.tokenizer)
    release, real = threading.Event(), llm_engine.load_tokenizer

    def held(*args):
        assert release.wait(60)
        return real(*args)
    monkeypatch.setattr(llm_engine, "load_tokenizer", held)
    again = llm_engine.LLMEngine(EngineConfig(model_path=str(llama_ckpt), num_kv_blocks=32))
    assert again.tokenizer_class == chosen and not again._tokenizer.done()
    release.set()
    assert tokenizer_class_path(again.tokenizer) == chosen
