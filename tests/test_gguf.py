"""GGUF checkpoints (actors/worker/gguf_checkpoint.py): llama.cpp's files served as they are.

The writer (tests/gguf_checkpoint.py) lays each tiny checkpoint out as llama.cpp's
convert_hf_to_gguf.py does and keeps a float checkpoint of what the file's weights stand for
(its blocks decoded by gguf-py, the converter's permutation undone): the loader's weights equal
that checkpoint's bit for bit, and the engine gives transformers' greedy tokens (float32) on
it, for the block formats gguf-py writes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16, F16) and K-quants
(Q4_K, Q5_K, Q6_K), for Llama (q / k rows permuted, Llama 3's rotary as `rope_freqs`), Qwen2
(biases), Qwen3 (a head size that is not hidden / heads), Qwen2-MoE (shared expert),
Qwen3-MoE (stacked experts), Gemma 2 (norms stored + 1, soft-capping), Gemma 3 (a rotary by
layer type), Phi-3 (fused projections, longrope factors as tensors, a partial rotary) and Qwen3.5
dense and MoE (gated delta nets: value heads tiled, A_log stored as -exp, norms + 1), LFM2,
gpt-oss (MXFP4 experts stored as matrices, gate and up apart; sinks; YaRN); the
tokenizer, chat template and end-of-turn tokens come from the file; a tp=2 rank holds its slices;
`--quantization int8` on top; `shoal serve` on a .gguf path; a file shoal cannot read is refused
in one line."""
from __future__ import annotations

import json
import os
import shutil

import gguf
import pytest
import torch
from checkpoints import quantized_reference_copy
from gguf_checkpoint import gguf_copy
from oracle import hf_greedy, hf_prompt_logprobs
from safetensors.torch import load_file
from test_engine import GREEDY, assert_pool_free, prompts_of

from actors.engine.llm import LLM
from actors.sampling_params import SamplingParams
from actors.worker import gguf_checkpoint
from actors.worker.checkpoint_files import read_config, resolve_model_path

LLAMA3_ROPE = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}}
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
OLMO3_YARN = {"sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
              "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "original_max_position_embeddings": 16, "attention_factor": 1.2}}
K_QUANT_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
CASES = {  # name: (family, its overrides, the ggml type of each matrix)
    "llama-legacy-blocks": ("llama", {}, {"token_embd": "Q8_0", "ffn_gate": "Q4_0", "ffn_up": "Q4_1",
                                          "ffn_down": "Q5_0", "attn_q": "Q5_1", "*": "F16"}),
    "llama-k-quants": ("llama", K_QUANT_SHAPE, {"ffn_down": "Q6_K", "ffn": "Q4_K", "attn_v": "Q5_K", "*": "Q8_0"}),
    "llama3-rope-bf16": ("llama", LLAMA3_ROPE, "BF16"),
    "qwen2-biases": ("qwen2", {}, {"ffn": "Q8_0", "*": "F32"}),
    "qwen3-head-dim": ("qwen3", dict(head_dim=32), "Q8_0"),
    "qwen2-moe-shared": ("qwen2_moe", {}, {"exps": "Q4_0", "*": "Q8_0"}),
    "qwen3-moe": ("qwen3_moe", {}, {"exps": "Q8_0", "*": "F16"}),
    # Gemma as llama.cpp runs it (its files state neither): queries scaled by the head size,
    # Gemma 3's layers global every sixth, its local rotary unscaled at base 10,000
    "gemma2-softcaps": ("gemma2", dict(query_pre_attn_scalar=16, tie_word_embeddings=True, init_std=0.1),
                        {"ffn": "Q8_0", "*": "BF16"}),
    "gemma3-rope-by-type": ("gemma3", dict(query_pre_attn_scalar=16, num_hidden_layers=6, init_std=0.1,
                                           layer_types=["sliding_attention"] * 5 + ["full_attention"]),
                            {"attn": "Q5_0", "*": "Q8_0"}),
    # Phi-4-mini's shape: q/k/v and gate/up fused, three quarters of each head rotated, longrope
    "phi3-longrope-partial": ("phi3", {}, {"attn_qkv": "Q8_0", "ffn_up": "Q4_1", "*": "F16"}),
    # Qwen3.5: gated delta net layers (value heads tiled, -exp(A_log), norms + 1) and attention ones
    "qwen3.5-hybrid": ("qwen3_5", {}, {"ssm_out": "Q4_0", "attn_qkv": "Q4_1", "*": "Q8_0"}),
    "qwen3.5-moe": ("qwen3_5_moe", {}, {"exps": "Q8_0", "*": "BF16"}),
    # LFM2: short convolutions (squeezed to [channels, kernel]) beside attention layers
    "lfm2-short-convolutions": ("lfm2", {}, {"ffn": "Q4_0", "*": "Q8_0"}),
    # gpt-oss: experts in MXFP4 as matrices, gate and up apart, biases beside them; sinks; YaRN.
    # (Its SwiGLU limit is not in the file: llama.cpp's is the release's 7.)
    "gpt-oss-mxfp4": ("gpt_oss", dict(swiglu_limit=7.0), {"exps.weight": "MXFP4", "exps.bias": "F32", "*": "Q8_0"}),
    # Mixtral: llama.cpp writes it as a Llama with experts, stacked, or in files made before it
    # stacked them (early 2024), one tensor an expert
    "mixtral": ("mixtral", {}, {"exps": "Q4_1", "*": "Q8_0"}),
    "mixtral-one-tensor-an-expert": ("mixtral", {}, {"ffn": "Q5_0", "*": "Q8_0"}, {"one_tensor_an_expert": True}),
    # DeepSeek-V3 (sigmoid routing, a score bias, q through its low-rank pair) as converters write
    # it since mid-2025: kv_b_proj cut in two for llama.cpp's absorbed attention; YaRN with mscale
    "deepseek-v3-latent-split": ("deepseek_v3", dict(rope_parameters=DEEPSEEK_YARN), {"exps": "Q8_0", "*": "F16"}),
    # DeepSeek-V2-Lite's shape (softmax routing, no q low-rank pair) as older files hold it: attn_kv_b whole
    "deepseek-v2-kv-b": ("deepseek_v2", {}, {"ffn": "Q4_0", "*": "F16"}, {"latent_split": False}),
    # GLM-4.5: sigmoid routing with a score bias and groups, q / k norms and biases, half of each
    # head rotated, a multi-token-prediction layer after the model's (read past)
    "glm4-moe": ("glm4_moe", {}, {"exps": "Q8_0", "*": "F16"}),
    # Qwen3-VL's language model (its files hold no vision): Qwen3 / Qwen3-MoE with M-RoPE sections
    "qwen3-vl": ("qwen3", dict(head_dim=32), "Q8_0", {"arch": "QWEN3VL"}),
    "qwen3-vl-moe": ("qwen3_moe", {}, {"exps": "Q4_0", "*": "Q8_0"}, {"arch": "QWEN3VLMOE"}),
    # IBM Granite: Llama's block (q / k permuted) and its four multipliers
    "granite": ("granite", {}, {"ffn": "Q5_1", "*": "Q8_0"}),
    # SmolLM3: every fourth layer without rotary (NoPE), the pattern llama.cpp fixes for it
    "smollm3-nope": ("smollm3", dict(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0]), "Q8_0"),
    # OLMo 2 (q / k norms over all heads, norms after attention and MLP), and OLMo 3: sliding
    # layers and a global one whose rotary alone is YaRN-scaled
    "olmo2": ("olmo2", {}, {"ffn": "Q4_1", "*": "Q8_0"}),
    "olmo3-yarn": ("olmo3", dict(rope_parameters=OLMO3_YARN), "Q8_0"),
}


@pytest.fixture(scope="module")
def copies(checkpoint_factory, tmp_path_factory):
    root, built = tmp_path_factory.mktemp("gguf"), {}

    def get(case):
        if case not in built:
            family, overrides, types, *writer = CASES[case]
            built[case] = gguf_copy(checkpoint_factory(family, **overrides), root / case, types, **(writer or [{}])[0])
        return built[case]
    return get


@pytest.mark.parametrize("case", CASES)
def test_weights_are_those_the_file_stands_for(case, copies):
    from actors.worker.loader import checkpoint_tensors, weight_files

    file, reference = copies(case)
    path = resolve_model_path(str(file))
    want = load_file(reference / "model.safetensors")
    got = {name: t[:] for name, t in checkpoint_tensors(path, weight_files(path)) if t is not None}
    assert set(got) == set(want)
    for name, w in want.items():
        assert torch.equal(got[name], w), name


@pytest.mark.parametrize("case", CASES)
def test_greedy_equals_transformers_on_the_weights_the_file_stands_for(case, copies):
    file, reference = copies(case)
    llm = LLM(str(file), dtype="float32", num_kv_blocks=64)
    try:
        prompts = prompts_of([5, 19])
        for ids, out in zip(prompts, llm.generate(prompts, GREEDY)):
            assert out.outputs[0].token_ids == hf_greedy(reference, ids, GREEDY.max_tokens)
        assert_pool_free(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("case", ["qwen3.5-hybrid", "qwen3.5-moe", "lfm2-short-convolutions"])
def test_the_writer_lays_the_newer_files_out_as_transformers_reads_them(case, copies):
    """transformers' own GGUF reading of Qwen3.5 and LFM2 (its conversion mapping, written apart
    from ours) takes the file to the reference's weights: the writer's layout is the one it reads,
    not only the one our reader undoes. A_log within float32's log rounding."""
    from transformers import AutoModelForCausalLM

    file, reference = copies(case)
    theirs = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).state_dict()
    for name, w in load_file(reference / "model.safetensors").items():
        tolerance = 1e-7 if name.endswith("A_log") else 0.0
        assert (theirs[name] - w).abs().max() <= tolerance, name


def test_prompt_logprobs_and_the_rotary_scaling_the_file_keeps(copies):
    """Llama 3's rotary scaling travels as a tensor of divisors (`rope_freqs`): read back, the
    prompt's log-probs are transformers' on the llama3-scaled checkpoint within 1e-4, and they
    would not be without it."""
    file, reference = copies("llama3-rope-bf16")
    ids = prompts_of([40], seed=3)[0]
    want = hf_prompt_logprobs(reference, ids)
    llm = LLM(str(file), dtype="float32", num_kv_blocks=64)
    try:
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
        got = [next(iter(p.values())) for p in out.prompt_logprobs[1:]]
        assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < 1e-4
    finally:
        llm.shutdown()
    rope = read_config(resolve_model_path(str(file)))["rope_parameters"]
    assert rope["rope_type"] == "longrope" and max(rope["short_factor"]) == 8.0
    unscaled = json.loads((reference / "config.json").read_text())
    unscaled["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    plain = reference.parent / "unscaled"
    shutil.copytree(reference, plain, dirs_exist_ok=True)
    (plain / "config.json").write_text(json.dumps(unscaled))
    assert max(abs(g - w) for g, w in zip(got, hf_prompt_logprobs(plain, ids))) > 1e-3


def test_gpt_oss_settings_come_from_its_file(copies):
    """gpt-oss's settings are read from the file by shoal (transformers' reading of these files
    fails on their YaRN fields): the checkpoint's own, its YaRN's unrounded range included."""
    from transformers import AutoConfig

    file, reference = copies("gpt-oss-mxfp4")
    got = AutoConfig.from_pretrained(resolve_model_path(str(file))).to_dict()
    want = AutoConfig.from_pretrained(reference).to_dict()
    assert got["rope_parameters"] == want["rope_parameters"] and want["rope_parameters"]["truncate"] is False
    for key in ("layer_types", "sliding_window", "head_dim", "num_local_experts", "num_experts_per_tok",
                "intermediate_size", "num_key_value_heads", "vocab_size", "tie_word_embeddings", "eos_token_id"):
        assert got[key] == want[key], key


def test_a_harmony_file_ends_where_gpt_oss_ends(tmp_path):
    """A gpt-oss file with harmony's tokens: generation ends at <|return|>, <|call|> and
    <|endoftext|> (the release's generation_config.json), not at <|end|>, which ends the analysis
    before the answer (llama.cpp drops it from its end tokens the same way); the template is the
    file's."""
    from harmony_checkpoint import GENERATION_EOS, make_harmony_checkpoint
    from transformers import AutoTokenizer

    source = make_harmony_checkpoint(tmp_path / "harmony", swiglu_limit=7.0)
    file, _ = gguf_copy(source, tmp_path / "gguf", {"exps.weight": "MXFP4", "*": "Q8_0"})
    path = resolve_model_path(str(file))
    tok = AutoTokenizer.from_pretrained(source)
    ends = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    assert ends == sorted(tok.convert_tokens_to_ids(GENERATION_EOS))
    assert AutoTokenizer.from_pretrained(path).chat_template == tok.chat_template


def test_tokenizer_chat_template_and_settings_come_from_the_file(copies, checkpoint_factory):
    from transformers import AutoTokenizer

    file, reference = copies("qwen3-head-dim")
    path = resolve_model_path(str(file))
    ours = AutoTokenizer.from_pretrained(path)
    from_file = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)  # transformers' own reading
    source = AutoTokenizer.from_pretrained(reference)  # the checkpoint the file was made from
    for text in ("The quick fish swims <|im_end|> under the boat, 1234!", "ünïcödé\n\n  tabs\tand 😀"):
        assert ours(text).input_ids == from_file(text).input_ids
        assert ours.decode(ours(text).input_ids) == text
    every = list(range(len(source)))
    assert ours.convert_ids_to_tokens(every) == source.convert_ids_to_tokens(every)
    messages = [{"role": "user", "content": "hello there"}]
    assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == source.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    config = read_config(path)
    assert config["head_dim"] == 32 and config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["quantization_config"]["quant_method"] == "gguf" and config["dtype"] == "bfloat16"
    assert json.loads((reference / "config.json").read_text())["eos_token_id"] == config["eos_token_id"]
    # where generation ends: the file's eos and the end-of-turn tokens llama.cpp stops at
    ends = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    assert ends == sorted({config["eos_token_id"], *source.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])})


def test_the_file_is_converted_once_and_found_in_its_directory(copies, tmp_path):
    file, _ = copies("qwen2-biases")
    path = resolve_model_path(str(file))
    made = (path / "config.json").stat().st_mtime_ns
    assert resolve_model_path(str(file)) == path and (path / "config.json").stat().st_mtime_ns == made
    assert resolve_model_path(str(file.parent)) == path  # a GGUF repository's folder: its one .gguf
    assert (path / gguf_checkpoint.LINK_NAME).resolve() == file.resolve()
    twice = tmp_path / "two"
    twice.mkdir()
    for name in ("a.gguf", "b.gguf"):
        os.symlink(file, twice / name)
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        resolve_model_path(str(twice))
    part = tmp_path / "model-00001-of-00002.gguf"
    os.symlink(file, part)
    with pytest.raises(ValueError, match="one part of a split GGUF"):
        resolve_model_path(str(part))


def test_a_cache_it_cannot_write_is_named_in_one_line(copies, tmp_path, monkeypatch):
    file, _ = copies("qwen2-biases")
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("SHOAL_GGUF_CACHE", str(tmp_path / "a-file" / "gguf"))
    with pytest.raises(ValueError, match="cannot write the directory made from it under .*set SHOAL_GGUF_CACHE"):
        resolve_model_path(str(file))


def test_the_tokenizer_option_takes_another_checkpoints_tokenizer(copies, tmp_path):
    """vLLM's `tokenizer=`: the engine tokenizes and renders chats with that checkpoint's
    tokenizer (here the source release's, its chat template changed), not the file's."""
    file, reference = copies("qwen2-biases")
    other = tmp_path / "tokenizer"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(reference / name, other / name)
    settings = json.loads((other / "tokenizer_config.json").read_text())
    settings["chat_template"] = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    (other / "tokenizer_config.json").write_text(json.dumps(settings))
    llm = LLM(str(file), tokenizer=str(other), dtype="float32", num_kv_blocks=64)
    try:
        out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=2))[0]
        assert out.prompt == "<<hello>>" and out.prompt_token_ids == llm.tokenizer.encode("<<hello>>")
    finally:
        llm.shutdown()


def test_int8_on_top_equals_the_int8_reference(copies, tmp_path):
    file, reference = copies("qwen2-biases")
    oracle = quantized_reference_copy(reference, tmp_path / "int8")
    llm = LLM(str(file), dtype="float32", num_kv_blocks=64, quantization="int8")
    try:
        prompts = prompts_of([9])
        for ids, out in zip(prompts, llm.generate(prompts, GREEDY)):
            assert out.outputs[0].token_ids == hf_greedy(oracle, ids, GREEDY.max_tokens)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("case", ["llama-legacy-blocks", "qwen3-moe", "gpt-oss-mxfp4", "mixtral-one-tensor-an-expert",
                                  "deepseek-v3-latent-split"])
def test_tp2_ranks_hold_their_slices(case, copies):
    """Built in process: each tp=2 rank's parameters from the GGUF equal those it builds from
    the reference (column- and row-parallel slices; experts)."""
    from actors.distributed.parallel import Parallel
    from actors.worker import loader

    file, reference = copies(case)
    path = resolve_model_path(str(file))
    cfg = json.loads((reference / "config.json").read_text())
    for rank in (0, 1):
        models = [loader.build_model(p, read_config(p), torch.float32, torch.device("cpu"), 64,
                                     Parallel(rank=rank, tp_size=2)) for p in (path, reference)]
        got, want = (dict(m.named_parameters()) for m in models)
        assert set(got) == set(want) and cfg["num_hidden_layers"] <= 3
        for name in want:
            assert torch.equal(got[name], want[name]), (rank, name)


def test_quantization_gguf_names_the_format():
    """vLLM's `--quantization gguf` is accepted for a GGUF and refused for another checkpoint."""
    from actors.worker import quantization_config

    quantization_config.check({"quantization_config": {"quant_method": "gguf"}}, "gguf")
    with pytest.raises(ValueError, match="--quantization gguf is for gguf checkpoints; this one is not quantized"):
        quantization_config.check({}, "gguf")


def _minimal_gguf(path, arch: str):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_file_shoal_cannot_read_is_refused_in_one_line(tmp_path):
    """An architecture outside the read ones, before any weight is read; the same from `shoal
    serve` before Ray starts."""
    import subprocess
    import sys
    from pathlib import Path

    from serving import loopback_env

    file = _minimal_gguf(tmp_path / "bert.gguf", "bert")
    with pytest.raises(ValueError, match="GGUF architecture 'bert' is not one shoal reads") as raised:
        resolve_model_path(str(file))
    assert "\n" not in str(raised.value)
    repo = Path(__file__).resolve().parents[1]
    run = subprocess.run([str(Path(sys.executable).parent / "shoal"), "serve", "--model-path", str(file),
                          "--host", "127.0.0.1", "--port", "8151"], cwd=repo, env=loopback_env(PYTHONPATH=str(repo)),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert [line for line in run.stderr.splitlines() if line.startswith("shoal serve: error:")] == [
        f"shoal serve: error: {raised.value}"], run.stderr[-2000:]
    assert "Traceback" not in run.stderr


def test_a_deepseek2_file_with_settings_shoal_does_not_read_is_refused(tmp_path):
    """Mistral 4's files (deepseek2, queries scaled by position) and a router gating function
    other than softmax or sigmoid: refused in one line rather than served without them."""
    for key, value, says in (("attention.temperature_scale", 0.1, "scaled by position"),
                             ("expert_gating_func", 3, "gating function 3")):
        file = tmp_path / f"{key}.gguf"
        writer = gguf.GGUFWriter(str(file), "deepseek2")
        writer.add_block_count(1)
        writer.add_token_list(["a", "b"])
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"deepseek2.{key}", value)
        writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
        for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
            write()
        writer.close()
        with pytest.raises(ValueError, match=f"shoal cannot read its settings: .*{says}") as raised:
            resolve_model_path(str(file))
        assert "\n" not in str(raised.value)


def test_shoal_serve_a_gguf_file(copies, tmp_path):
    """`shoal serve --model-path model.gguf --quantization gguf`, with vLLM's `--tokenizer` (the
    release the file was made from) and `--chat-template` (a file): a completion of token ids is
    transformers' greedy text on the weights the file stands for, a chat renders through the
    given template (/tokenize) and answers, an over-long prompt gets 400, SIGTERM leaves nothing
    running."""
    import subprocess
    import sys
    from pathlib import Path

    import httpx
    from transformers import AutoTokenizer

    from serving import free_port, loopback_env, stop_process, wait_process_ready

    file, reference = copies("llama-legacy-blocks")
    repo = Path(__file__).resolve().parents[1]
    port, log, template = free_port(), tmp_path / "serve.log", tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]")
    with log.open("w") as sink:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "shoal"), "serve", "--model-path", str(file),
                                 "--quantization", "gguf", "--dtype", "float32", "--host", "127.0.0.1", "--port",
                                 str(port), "--eager-decode", "--max-model-len", "256", "--tokenizer", str(reference),
                                 "--chat-template", str(template)], cwd=repo,
                                env=loopback_env(PYTHONPATH=str(repo)), stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_process_ready(url, proc, log)
        ids = prompts_of([7], seed=5)[0]
        r = httpx.post(f"{url}/v1/completions", json={"model": str(file), "prompt": ids, "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        want = AutoTokenizer.from_pretrained(reference).decode(hf_greedy(reference, ids, 8))
        assert r.json()["choices"][0]["text"] == want
        messages = [{"role": "user", "content": "hello"}]
        rendered = httpx.post(f"{url}/tokenize", json={"model": str(file), "messages": messages}).json()["tokens"]
        assert rendered == AutoTokenizer.from_pretrained(reference).encode("[user] hello\n[assistant]",
                                                                          add_special_tokens=False)
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": str(file), "messages": messages, "max_tokens": 4})
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(rendered), chat.text
        long = httpx.post(f"{url}/v1/completions", json={"model": str(file), "prompt": [5] * 300, "max_tokens": 4})
        assert long.status_code == 400 and long.json()["error"]["message"], long.text
    finally:
        code, outliving = stop_process(proc)
    assert code == 0 and not outliving, log.read_text()[-3000:]
