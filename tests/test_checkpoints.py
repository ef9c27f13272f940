"""The tiny-checkpoint factory and the transformers oracle that every parity test relies on."""
import filecmp
import json
import pathlib

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from checkpoints import ARCHS, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, make_checkpoint
from oracle import hf_greedy, hf_logits, hf_model, hf_prompt_logprobs

PROMPTS = ["The quick brown fox", "Once upon a time", "héllo 世界 🙂", "User: What is 2+2?"]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
SYSTEM_USER = [{"role": "system", "content": "You are terse."},
               {"role": "user", "content": "Hi!"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _tensor_names(path):
    names = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names.update(f.keys())
    return names


def _assert_not_degenerate(path, prompts=PROMPTS):
    """Greedy must vary and sit far from ties, or parity tests would prove little."""
    tok = AutoTokenizer.from_pretrained(path)
    gaps = []
    for prompt in prompts:
        ids = tok.encode(prompt)
        new = hf_greedy(path, ids, 32)
        assert len(new) == 32
        assert len(set(new)) >= 5, (prompt, new)
        top2 = hf_logits(path, ids + new).topk(2, dim=-1).values
        gaps.append(top2[:, 0] - top2[:, 1])
    gaps = torch.cat(gaps)
    assert (gaps > 1e-3).float().mean() > 0.97
    assert gaps.median() > 0.1


# --------------------------------------------------------------------------- tokenizer

def test_tokenizer_special_tokens(llama_ckpt):
    tok = AutoTokenizer.from_pretrained(llama_ckpt)
    assert len(tok) == 512
    ids = tok.convert_tokens_to_ids(SPECIAL_TOKENS)
    assert ids == list(range(505, 512))
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN and tok.bos_token is None
    for token, token_id in zip(SPECIAL_TOKENS, ids):
        assert tok.encode(token) == [token_id]  # one id each, no bos added


@pytest.mark.parametrize("text", ["héllo 世界 🙂", "The quick brown fox.", "  two  spaces\n\ttab",
                                  "<|im_start|>user\nhi<|im_end|>", '{"a": [1, 2.5e-3]}', ""])
def test_tokenizer_round_trip(llama_ckpt, text):
    tok = AutoTokenizer.from_pretrained(llama_ckpt)
    assert tok.decode(tok.encode(text)) == text


# --------------------------------------------------------------------------- chat template

def test_chat_template_generation_prompt(llama_ckpt):
    tok = AutoTokenizer.from_pretrained(llama_ckpt)
    assert (llama_ckpt / "chat_template.jinja").exists()
    base = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
            "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    render = dict(tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(SYSTEM_USER, **render) == base
    assert tok.apply_chat_template(SYSTEM_USER, **render, enable_thinking=True) == base
    assert (tok.apply_chat_template(SYSTEM_USER, **render, enable_thinking=False)
            == base + "<think>\n\n</think>\n\n")
    assert tok.apply_chat_template(SYSTEM_USER, tokenize=False) == base[:-len(
        "<|im_start|>assistant\n")]


def test_chat_template_tools(llama_ckpt):
    tok = AutoTokenizer.from_pretrained(llama_ckpt)
    messages = SYSTEM_USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": "20C"},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True, enable_thinking=False)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n') in text
    assert ("<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n20C"
            "\n</tool_response><|im_end|>\n") in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # tools without a system message still get a system turn
    alone = tok.apply_chat_template(SYSTEM_USER[1:], tools=TOOLS, tokenize=False)
    assert alone.startswith("<|im_start|>system\n# Tools\n")


# --------------------------------------------------------------------------- models

@pytest.mark.parametrize("arch", ARCHS)
def test_arch_loads_and_is_not_degenerate(checkpoint_factory, arch):
    path = checkpoint_factory(arch)
    config = AutoConfig.from_pretrained(path)
    # MLA (DeepSeek, GLM-4.7-Flash, GLM-5, Mistral 4): K/V heads = heads (transformers repeats by the
    # ratio); 3 layers
    mla = arch.startswith("deepseek") or arch in ("glm4_moe_lite", "mistral4", "glm_moe_dsa")
    # (OPT, GPT-2: multi-head; Falcon: num_kv_heads, read in its new architecture only, multi-query here)
    kv_heads = (config.per_layer_config[0].num_key_value_heads if arch == "gemma4"  # (a per-layer field there)
                else getattr(config, "num_key_value_heads", config.num_attention_heads))
    # (GPT-NeoX's config keeps the builder's num_key_value_heads, which its attention never reads)
    mamba = arch in ("mamba", "falcon_mamba")  # (no attention, no positions)
    assert mamba or config.num_attention_heads == 4 and kv_heads == (
        4 if mla or arch in ("opt", "gpt2", "gptj", "falcon") else 2)
    # (a linear / conv, a full, a linear layer)
    hybrid = arch in ("qwen3_5", "qwen3_5_moe", "qwen3_next", "lfm2", "granitemoehybrid", "bamba")
    layers = (4 if arch in ("llama4", "gemma4", "nemotron_h")
              else 3 if mla or hybrid or arch in ("glm4_moe", "ernie4_5_moe") else 2)
    assert config.hidden_size == 64 and config.num_hidden_layers == layers
    assert config.vocab_size == 512 and (mamba or config.max_position_embeddings == 512)
    assert config.eos_token_id == 507 and config.pad_token_id == 505
    assert json.loads((path / "config.json").read_text())["dtype"] == "float32"
    names = _tensor_names(path)
    assert ("embed_out.weight" if arch == "gpt_neox" else "lm_head.weight") in names
    if arch == "mistral":
        assert config.sliding_window is None
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in names
    if arch == "qwen3":
        assert config.head_dim == 32
        assert "model.layers.0.self_attn.q_norm.weight" in names
        assert hf_model(path).model.layers[0].self_attn.q_proj.weight.shape == (128, 64)
    _assert_not_degenerate(path)


def test_tied_embeddings(checkpoint_factory):
    path = checkpoint_factory("qwen2", tie_word_embeddings=True)
    assert AutoConfig.from_pretrained(path).tie_word_embeddings
    assert "lm_head.weight" not in _tensor_names(path)
    model = hf_model(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    _assert_not_degenerate(path, PROMPTS[:2])


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0}, LLAMA3_ROPE])
def test_rope_scaling(checkpoint_factory, llama_ckpt, spelling, rope):
    path = checkpoint_factory("llama", **{spelling: rope})
    written = json.loads((path / "config.json").read_text())["rope_parameters"]
    assert written == {**rope, "rope_theta": 10000.0}
    ids = AutoTokenizer.from_pretrained(path).encode(PROMPTS[0] * 3)
    # same weights, different rotary -> the scaling really is applied
    assert not torch.allclose(hf_logits(path, ids), hf_logits(llama_ckpt, ids))


def test_sharded_matches_single_file(checkpoint_factory, llama_ckpt):
    path = checkpoint_factory("llama", sharded=True)
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) >= 2
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    ids = list(range(20))
    assert torch.equal(hf_logits(path, ids), hf_logits(llama_ckpt, ids))


def test_overrides(checkpoint_factory):
    path = checkpoint_factory("llama", hidden_size=96, num_hidden_layers=3,
                              num_attention_heads=6, num_key_value_heads=3,
                              intermediate_size=160, vocab_size=640, max_position_embeddings=256)
    config = AutoConfig.from_pretrained(path)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.vocab_size,
            config.max_position_embeddings) == (96, 3, 6, 3, 160, 640, 256)
    assert hf_logits(path, [1, 2, 3]).shape == (3, 640)
    with pytest.raises(ValueError):
        make_checkpoint(path.parent / "too-small", vocab_size=100)


def test_deterministic(tmp_path):
    a = make_checkpoint(tmp_path / "a", "qwen3", sharded=True)
    b = make_checkpoint(tmp_path / "b", "qwen3", sharded=True)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(a, b, files, shallow=False)
    assert mismatch == [] and errors == []
    c = make_checkpoint(tmp_path / "c", "qwen3", sharded=True, seed=1)
    assert not filecmp.cmp(a / "model-00001-of-00004.safetensors",
                           c / "model-00001-of-00004.safetensors", shallow=False)


def test_loads_with_plain_from_pretrained(qwen3_ckpt):
    model = AutoModelForCausalLM.from_pretrained(qwen3_ckpt)
    assert model.dtype == torch.float32
    assert type(model).__name__ == "Qwen3ForCausalLM"


# --------------------------------------------------------------------------- oracle

def test_prompt_logprobs_match_logits(qwen3_ckpt):
    ids = [5, 77, 300, 12, 507, 42]
    lps = hf_prompt_logprobs(qwen3_ckpt, ids)
    assert len(lps) == len(ids) - 1 and all(lp < 0 for lp in lps)
    logits = hf_logits(qwen3_ckpt, ids)
    expected = torch.log_softmax(logits[2], -1)[ids[3]].item()
    assert lps[2] == pytest.approx(expected, abs=1e-6)


def test_greedy_matches_full_recompute(llama_ckpt):
    """generate() with its KV cache picks the same argmax as re-running the whole prefix."""
    ids = AutoTokenizer.from_pretrained(llama_ckpt).encode(PROMPTS[1])
    new = hf_greedy(llama_ckpt, ids, 12)
    seq = list(ids)
    for _ in range(12):
        seq.append(int(hf_logits(llama_ckpt, seq)[-1].argmax()))
    assert new == seq[len(ids):]


def test_greedy_eos_handling(llama_ckpt):
    ids = AutoTokenizer.from_pretrained(llama_ckpt).encode(PROMPTS[0])
    new = hf_greedy(llama_ckpt, ids, 16)
    gen_config = hf_model(llama_ckpt).generation_config
    saved = gen_config.eos_token_id
    gen_config.eos_token_id = new[5]  # pretend a token greedy emits is eos
    try:
        assert hf_greedy(llama_ckpt, ids, 16) == new  # ignored by default
        stopped = hf_greedy(llama_ckpt, ids, 16, stop_at_eos=True)
    finally:
        gen_config.eos_token_id = saved
    assert stopped == new[:new.index(new[5]) + 1]


def test_the_eos_id_read_from_the_tokenizer_files_is_transformers(checkpoint_factory, tmp_path):
    """The engine starts on the eos id its tokenizer files state (actors/worker/checkpoint_files.py
    declared_eos_id) while transformers loads the tokenizer beside the model: it must be the id
    transformers gives, and None (wait for transformers) where the files do not state it plainly."""
    import shutil

    from actors.worker.checkpoint_files import BUNDLED_MODEL, declared_eos_id

    from harmony_checkpoint import make_harmony_checkpoint

    smollm2 = pathlib.Path.home() / ".cache/shoal/smollm2-135m-instruct"  # a real release's files, where at hand
    paths = [checkpoint_factory("llama"), BUNDLED_MODEL, make_harmony_checkpoint(tmp_path / "harmony")]
    for path in paths + ([smollm2] if (smollm2 / "tokenizer.json").exists() else []):
        assert declared_eos_id(path) == AutoTokenizer.from_pretrained(str(path)).eos_token_id is not None, path
    src = checkpoint_factory("llama")
    cases = {
        "dict": ({"eos_token": {"content": EOS_TOKEN, "special": True}}, None, True),
        "unknown token": ({"eos_token": "<|never|>"}, None, False),
        "no eos": ({}, None, False),
        "map disagrees": ({"eos_token": EOS_TOKEN}, {"eos_token": PAD_TOKEN}, False),
    }
    for name, (config_eos, mapped, stated) in cases.items():
        dst = tmp_path / name.replace(" ", "-")
        shutil.copytree(src, dst)
        config = json.loads((dst / "tokenizer_config.json").read_text())
        config.pop("eos_token", None)
        (dst / "tokenizer_config.json").write_text(json.dumps({**config, **config_eos}))
        if mapped is not None:
            (dst / "special_tokens_map.json").write_text(json.dumps(mapped))
        want = AutoTokenizer.from_pretrained(str(src)).convert_tokens_to_ids(EOS_TOKEN) if stated else None
        assert declared_eos_id(dst) == want, name
    shutil.copytree(src, tmp_path / "slow")
    (tmp_path / "slow" / "tokenizer.json").unlink()
    assert declared_eos_id(tmp_path / "slow") is None
