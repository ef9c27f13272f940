"""Checkpoints in PyTorch's .bin files (actors/worker/weight_files.py): single, sharded with
an index, the legacy pre-zip format, a tied head saved beside the embedding; each gives
transformers' greedy tokens on the same weights. A .bin that pickles more than tensors is
refused without running it, and a directory without weights says what it looked for."""
from __future__ import annotations

import json

import pytest
import torch
from oracle import hf_greedy
from safetensors.torch import load_file
from test_engine import GREEDY, prompts_of

from actors.engine.llm import LLM
from actors.worker.weight_files import weight_files


def bin_copy(src, dst, shards: int = 1, legacy: bool = False, tied_head: bool = False):
    """`src` with its weights in pytorch_model*.bin files as transformers' save_pretrained wrote
    them before safetensors (`shards` > 1: with pytorch_model.bin.index.json)."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    if tied_head:  # older writers kept the tied head's key, sharing the embedding's storage
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    names = sorted(tensors)
    parts = [names[i::shards] for i in range(shards)]
    files = ["pytorch_model.bin"] if shards == 1 else [f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
                                                        for i in range(shards)]
    for part, file in zip(parts, files, strict=True):
        torch.save({n: tensors[n] for n in part}, dst / file, _use_new_zipfile_serialization=not legacy)
    if shards > 1:
        index = {"metadata": {}, "weight_map": {n: f for part, f in zip(parts, files) for n in part}}
        (dst / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("arch, shards, legacy", [("llama", 1, False), ("llama", 3, False), ("qwen3", 1, True)])
def test_bin_checkpoints_give_transformers_tokens(arch, shards, legacy, checkpoint_factory, tmp_path):
    tied = arch == "qwen3"
    src = checkpoint_factory(arch, tie_word_embeddings=tied)
    path = bin_copy(src, tmp_path / "bin", shards, legacy, tied_head=tied)
    assert len(weight_files(path)) == shards and not list(path.glob("*.safetensors"))
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    try:
        prompts = prompts_of([4, 19])
        for ids, out in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
            assert out.outputs[0].token_ids == hf_greedy(src, ids, GREEDY.max_tokens)
    finally:
        llm.shutdown()


class NotATensor:
    pass


def test_a_bin_that_pickles_code_is_refused_unrun(checkpoint_factory, tmp_path):
    path = bin_copy(checkpoint_factory("llama"), tmp_path / "bin")
    torch.save({"model.norm.weight": NotATensor()}, path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin holds more than tensors"):
        LLM(str(path), num_kv_blocks=16)


def test_a_directory_without_weights_says_what_it_looked_for(checkpoint_factory, tmp_path):
    src = checkpoint_factory("llama")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"expected \*.safetensors or pytorch_model\*.bin"):
        weight_files(tmp_path)
