"""Image-text checkpoints served for their text (actors/worker/checkpoint_files.py text_config,
actors/worker/weight_files.py text_name): Gemma 3 (4B-27B ship as Gemma3ForConditionalGeneration),
Mistral Small 3.x (Mistral3ForConditionalGeneration), LLaVA, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE
(M-RoPE, one position stream on text; the MoE's experts stacked in one tensor per projection) and
Llama 4 give transformers' own greedy tokens (the wrapper class on text prompts; Llama 4's text
model), in transformers 4's weight and config layout and 5's, with a text_config that names only
what differs from the family's defaults (as Gemma 3 4B's does); the vision tower is never read."""
from __future__ import annotations

import json

import pytest
from checkpoints import IMAGE_TEXT, _write_copy
from oracle import hf_greedy
from safetensors.torch import load_file
from test_engine import assert_pool_free, prompts_of

from actors.engine.llm import LLM
from actors.sampling_params import SamplingParams
from actors.models.args import TEXT_ARCH_OF
from actors.worker.checkpoint_files import read_config

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def assert_follows_transformers(path, reference=None):
    llm = LLM(str(path), num_kv_blocks=64)
    try:
        prompts = prompts_of([5, 17, 30])
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert got == [hf_greedy(reference or path, ids, 12) for ids in prompts]
        assert_pool_free(llm)
        return llm.engine.spec.args.architecture
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch, overrides", [("gemma3_vision", {}), ("mistral3", {}), ("llava", {}),
                                             ("llava", {"tie_word_embeddings": True}), ("qwen2_5_vl", {}),
                                             ("qwen3_vl", {}), ("qwen3_vl_moe", {}), ("llama4_vision", {}),
                                             ("ministral3_vision", {}), ("mistral4_vision", {}),
                                             ("gemma4_vision", {})])
def test_the_language_model_gives_transformers_tokens(checkpoint_factory, arch, overrides, tmp_path):
    path = checkpoint_factory(arch, **overrides)
    names = load_file(path / "model.safetensors")
    assert any(n.startswith(("vision_tower.", "model.visual.", "visual.", "vision_model.", "model.vision_model.",
                             "model.vision_tower."))
               for n in names)  # (an image-text checkpoint)
    family = {"gemma3": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM", "llama": "LlamaForCausalLM",
              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
              "llama4": "Llama4ForCausalLM", "ministral3": "Ministral3ForCausalLM", "mistral4": "Mistral4ForCausalLM",
              "gemma4": "Gemma4ForCausalLM"}
    # (transformers 5.24's Llama 4 wrapper fails on a text-only prompt: its text model is the oracle)
    reference = language_model_copy(path, tmp_path / "text") if arch == "llama4_vision" else None
    assert assert_follows_transformers(path, reference) == family[IMAGE_TEXT[arch][0]]


def language_model_copy(src, dst):
    """The wrapper's language model (`language_model.*`) as a text checkpoint of its own."""
    tensors = {n.removeprefix("language_model."): t for n, t in load_file(src / "model.safetensors").items()
               if n.startswith("language_model.")}
    config = json.loads((src / "config.json").read_text())
    dst.mkdir()
    return _write_copy(src, dst, tensors, config["text_config"] | {"architectures": [TEXT_ARCH_OF["llama4_text"]]})


def test_transformers_5_layout_and_a_sparse_text_config(checkpoint_factory, tmp_path):
    """Weights under `model.language_model.` (transformers 5 writes it), and a text_config with
    only the fields that differ from Gemma3TextConfig's defaults: shoal fills them in as
    transformers does."""
    from transformers import Gemma3TextConfig

    src = checkpoint_factory("gemma3_vision")
    tensors = {(n.replace("language_model.model.", "model.language_model.", 1)
                .replace("vision_tower.", "model.vision_tower.", 1)
                .replace("multi_modal_projector.", "model.multi_modal_projector.", 1)): t
               for n, t in load_file(src / "model.safetensors").items()}
    config = json.loads((src / "config.json").read_text())
    defaults = Gemma3TextConfig().to_dict()
    text = config["text_config"]
    config["text_config"] = {k: v for k, v in text.items() if k == "model_type" or defaults.get(k) != v}
    assert len(config["text_config"]) < len(text) - 5  # (defaults were dropped)
    (tmp_path / "v5-sparse").mkdir()
    path = _write_copy(src, tmp_path / "v5-sparse", tensors, config)
    assert read_config(path)["query_pre_attn_scalar"] == text["query_pre_attn_scalar"]
    assert assert_follows_transformers(path, reference=src) == "Gemma3ForCausalLM"


def test_qwen_vl_as_transformers_4_wrote_it(checkpoint_factory, tmp_path):
    """Qwen2.5-VL's first release: the text fields at the top of config.json with M-RoPE's
    `rope_scaling`, the weights under `model.` and `visual.`."""
    src = checkpoint_factory("qwen2_5_vl")
    config = json.loads((src / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**text, **config, "model_type": "qwen2_5_vl", "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    tensors = {n.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1): t
               for n, t in load_file(src / "model.safetensors").items()}
    assert any(n.startswith("visual.") for n in tensors) and any(n.startswith("model.layers.") for n in tensors)
    (tmp_path / "flat").mkdir()
    path = _write_copy(src, tmp_path / "flat", tensors, flat)
    assert assert_follows_transformers(path, reference=src) == "Qwen2ForCausalLM"


def test_a_text_config_without_its_model_type_is_the_wrappers_language_model(checkpoint_factory, tmp_path):
    """(transformers reads a Gemma 3 wrapper's text_config as Gemma 3 text where it names none)"""
    src = checkpoint_factory("gemma3_vision")
    config = json.loads((src / "config.json").read_text())
    del config["text_config"]["model_type"]
    (tmp_path / "unnamed").mkdir()
    path = _write_copy(src, tmp_path / "unnamed", load_file(src / "model.safetensors"), config)
    assert assert_follows_transformers(path, reference=src) == "Gemma3ForCausalLM"


@pytest.mark.parametrize("text_config", ["oops", [1, 2]])
def test_a_text_config_that_is_not_a_mapping_is_refused_in_one_line(checkpoint_factory, tmp_path, text_config):
    src = checkpoint_factory("llava")
    config = json.loads((src / "config.json").read_text()) | {"text_config": text_config}
    (tmp_path / "bad").mkdir()
    path = _write_copy(src, tmp_path / "bad", load_file(src / "model.safetensors"), config)
    with pytest.raises(ValueError, match="LlavaForConditionalGeneration's text_config must be a mapping"):
        read_config(path)


def test_a_language_model_it_does_not_run_is_refused_in_one_line(checkpoint_factory, tmp_path):
    src = checkpoint_factory("llava")
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["model_type"] = "phi"
    (tmp_path / "llava-phi").mkdir()
    path = _write_copy(src, tmp_path / "llava-phi", load_file(src / "model.safetensors"), config)
    with pytest.raises(ValueError, match=r"LlavaForConditionalGeneration's language model \(phi\) is not one"):
        LLM(str(path), num_kv_blocks=16)


def test_a_fresh_process_reads_it_while_its_tokenizer_loads(checkpoint_factory):
    """The engine loads its tokenizer in a thread while it reads the config, and completing an
    image-text config imports transformers too: two threads importing it at once once failed
    with "partially initialized module". In a process that has not imported transformers yet:"""
    import subprocess
    import sys

    path = checkpoint_factory("gemma3_vision")
    code = ("from actors.engine.llm import LLM\nfrom actors.sampling_params import SamplingParams\n"
            f"llm = LLM({str(path)!r}, num_kv_blocks=16)\n"
            "print(len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids))")
    for _ in range(2):  # (the second start loads the tokenizer class the first one remembered)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.strip().endswith("3"), done.stderr[-2000:]
