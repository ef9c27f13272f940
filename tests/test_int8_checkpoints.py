"""compressed-tensors `int-quantized` checkpoints (LLM Compressor's W8A8 / W8A16 int8;
actors/worker/int8_checkpoint.py), and the refusal of quantized checkpoints shoal cannot read.

The packer (tests/checkpoints.py int8_copy) writes the layout as compressed-tensors' int
compressor does: int8 codes with a symmetric scale of max |w| / 127.5, so a row's most negative
weight codes as -128. Without an option the engine runs the checkpoint's scheme on exactly its
codes and scales, only in the layers it quantized (its float LM head stays float): checked
against transformers on the float checkpoint of the weights the codes stand for, with the
linear layers' inputs quantized per row (W8A8), or token for token (W8A16, float activations).
"""
from __future__ import annotations

import json

import pytest
import torch
from checkpoints import _write_copy, int8_copy
from oracle import hf_greedy
from safetensors.torch import load_file
from test_engine import GREEDY, assert_pool_free, prompts_of
from test_w8a8 import assert_greedy_up_to_flips

from actors.distributed.parallel import Parallel
from actors.engine.llm import LLM
from actors.worker import loader
from actors.worker.int8_checkpoint import scheme
from kernels.quantization import w8a8_rows


@pytest.fixture(scope="module")
def copies(checkpoint_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("int8")
    path = checkpoint_factory("llama")

    def copy(strategy="channel", activations="dynamic"):
        return int8_copy(path, root / f"{strategy}-{activations}", strategy, activations)
    return copy


def codes_by_layer(path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module name: (int8 codes, one float32 scale per row)} as the checkpoint stores them."""
    tensors = load_file(str(path / "model.safetensors"))
    return {name.removesuffix(".weight"): (t, tensors[name + "_scale"].float().reshape(-1).expand(t.shape[0]))
            for name, t in tensors.items() if t.dtype == torch.int8}


def build(path, rank=0, tp_size=1, **options):
    cfg = json.loads((path / "config.json").read_text())
    return loader.build_model(path, cfg, torch.float32, torch.device("cpu"), 64,
                              Parallel(rank=rank, tp_size=tp_size), **options)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_the_layers_hold_the_checkpoints_codes_and_scales(strategy, copies):
    """tp=1 and both ranks of tp=2: each fused or sharded layer's int8 values and scales are the
    checkpoint's own (-128 codes included), column-parallel rows and row-parallel columns
    alike; the LM head and the embedding, float in the checkpoint, stay float."""
    path, _ = copies(strategy)
    want = codes_by_layer(path)
    assert any((codes == -128).any() for codes, _ in want.values())
    for tp in (1, 2):
        for rank in range(tp):
            model = build(path, rank, tp, quantization="w8a8_int8", checkpoint_layers_only=True)
            layer = model.model.layers[1]
            qkv, o = layer.self_attn.qkv_proj, layer.self_attn.o_proj
            parts = [want[f"model.layers.1.self_attn.{p}_proj"] for p in "qkv"]
            rows = [c.shape[0] // tp for c, _ in parts]
            got = w8a8_rows(qkv.weight, qkv.weight_scale.shape[1])
            expect = torch.cat([c[rank * n:(rank + 1) * n] for (c, _), n in zip(parts, rows)])
            assert torch.equal(got, expect.short()), (tp, rank)
            assert torch.equal(qkv.weight_scale[0], torch.cat([s[rank * n:(rank + 1) * n] for (_, s), n in zip(parts, rows)]))
            codes, scale = want["model.layers.1.self_attn.o_proj"]
            width = codes.shape[1] // tp
            assert torch.equal(w8a8_rows(o.weight, o.weight_scale.shape[1]), codes[:, rank * width:(rank + 1) * width].short())
            assert torch.equal(o.weight_scale[0], scale)
            assert model.lm_head.weight.dtype == torch.float32
            assert model.model.embed_tokens.weight.dtype == torch.float32


def test_an_explicit_quantization_takes_every_layer_and_keeps_the_codes(copies):
    """--quantization int8 on an int8 checkpoint: the LM head is quantized too (its own scale),
    and the checkpoint's layers keep their codes (weight-only panels read back as rows)."""
    from kernels.quantization import dequantize

    path, _ = copies()
    model = build(path, quantization="int8")
    assert model.lm_head.weight.dtype == torch.int8
    codes, scale = codes_by_layer(path)["model.layers.0.mlp.down_proj"]
    down = model.model.layers[0].mlp.down_proj
    assert torch.equal(down.weight_scale, scale)
    assert torch.equal(dequantize(down.weight, down.weight_scale), codes.float() * scale[:, None])


@pytest.mark.parametrize("strategy, activations", [("channel", "dynamic"), ("tensor", "static")])
def test_a_w8a8_checkpoint_runs_as_w8a8_int8_and_follows_transformers(strategy, activations, copies):
    """No option: the engine picks w8a8_int8 for the checkpoint's layers (static activation
    scales become per-row ones) and follows transformers on the weights the codes stand for,
    with those layers' inputs quantized per row and the LM head's float, up to flips."""
    path, reference = copies(strategy, activations)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    try:
        runner = llm.engine.executor.runner
        assert llm.engine.spec.quantization == "w8a8_int8" and llm.engine.spec.checkpoint_layers_only
        assert runner.kernels.linear.startswith("w8a8_int8")
        assert runner.model.lm_head.weight.dtype == torch.float32
        prompts = prompts_of([5, 17, 33])
        assert_greedy_up_to_flips(reference, prompts, llm.generate(prompts, GREEDY), float_head=True)
        assert_pool_free(llm)
    finally:
        llm.shutdown()


def test_a_deepseek_w8a8_checkpoint_follows_transformers(checkpoint_factory, tmp_path):
    """MLA's projections (q_a / q_b, kv_a_proj_with_mqa) from the checkpoint's int8 codes with
    int8 activations; kv_b_proj, absorbed into the attention, and the MoE experts stay float."""
    path, reference = int8_copy(checkpoint_factory("deepseek_v3"), tmp_path / "ds", "channel", "dynamic")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    try:
        attn = llm.engine.executor.runner.model.model.layers[0].self_attn
        assert llm.engine.spec.quantization == "w8a8_int8"
        assert [n for n, p in attn.named_parameters() if p.dtype == torch.int8]  # the MLA projections' codes
        prompts = prompts_of([5, 17, 33])
        assert_greedy_up_to_flips(reference, prompts, llm.generate(prompts, GREEDY), float_head=True)
        assert_pool_free(llm)
    finally:
        llm.shutdown()


def test_compiled_decode_runs_the_checkpoints_layers(copies):
    """The compile job reads no weights: it finds the int8 layers in the files' headers, so its
    graph quantizes the same layers (not the head) and the compiled engine follows transformers
    as the eager one does."""
    from test_compiled_decode import compiled_llm

    path, reference = copies()
    llm = compiled_llm(path, dtype="float32")
    try:
        runner = llm.engine.executor.runner
        prompts = prompts_of([3, 9, 30])
        before = runner.graph_replays
        outs = llm.generate(prompts, GREEDY)
        assert runner.graph_replays > before
        assert_greedy_up_to_flips(reference, prompts, outs, float_head=True)
    finally:
        llm.shutdown()


def test_a_w8a16_checkpoint_runs_weight_only_token_for_token(copies):
    """Weights only (no input_activations): int8 weight-only layers on the checkpoint's codes,
    activations float, so greedy tokens equal transformers' on the dequantised weights."""
    path, reference = copies(activations=None)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    try:
        assert llm.engine.spec.quantization == "int8"
        prompts = prompts_of([4, 21])
        for ids, out in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
            assert out.outputs[0].token_ids == hf_greedy(reference, ids, GREEDY.max_tokens)
    finally:
        llm.shutdown()


def test_the_scheme_read_from_config():
    def config(weights=None, inputs=None, fmt="int-quantized"):
        group = {"weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, **(weights or {})}}
        if inputs is not None:
            group["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, **inputs}
        return {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt,
                                        "config_groups": {"group_0": group}}}

    assert scheme(config(inputs={})).kind == "w8a8_int8"
    assert scheme(config(inputs={"dynamic": False, "strategy": "tensor"})).static_activations
    assert scheme(config(fmt="naive-quantized")).kind == "int8"
    assert scheme(config(fmt="pack-quantized")) is None and scheme({}) is None
    for weights, message in [({"symmetric": False}, "asymmetric weights"), ({"strategy": "group"}, "strategy 'group'"),
                             ({"num_bits": 4}, "of 4 bits")]:
        with pytest.raises(ValueError, match=message):
            scheme(config(weights))
    with pytest.raises(ValueError, match="activations of 16 bits"):
        scheme(config(inputs={"num_bits": 16}))


@pytest.mark.parametrize("quant, message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' checkpoints .* are not supported"),
    ({"quant_method": "hqq"}, "'hqq' checkpoints .* shoal reads fp8, fbgemm_fp8, modelopt, compressed-tensors"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "ModelOpt W4A8_AWQ checkpoints are not supported"),
    ({"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"},
     "compressed-tensors format mxfp4-pack-quantized is not supported"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 64}}}}, "strategy 'group'"),
])
def test_a_quantized_checkpoint_it_cannot_read_is_refused_at_start(quant, message, checkpoint_factory, tmp_path):
    src = checkpoint_factory("llama")
    config = {**json.loads((src / "config.json").read_text()), "quantization_config": quant}
    _write_copy(src, tmp_path, load_file(str(src / "model.safetensors")), config)
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), num_kv_blocks=16)


def test_integer_weights_without_a_format_are_refused(checkpoint_factory, tmp_path):
    """A checkpoint whose config names no quantization but whose weights are integers (an int8
    export without its quantization_config): a one-line error naming the tensor, not a model
    that loads the codes as numbers and talks nonsense."""
    src = checkpoint_factory("llama")
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].sign().to(torch.int8)
    _write_copy(src, tmp_path, tensors, json.loads((src / "config.json").read_text()))
    with pytest.raises(ValueError, match=f"'{name}' holds torch.int8 integers"):
        LLM(str(tmp_path), num_kv_blocks=16)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["RwkvForCausalLM"]}, "unsupported architecture 'RwkvForCausalLM'; supported: "),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "'bitsandbytes' checkpoints "),
    ({"quantization_config": "gptq"}, "config.json's quantization_config is a str, not an object"),
    ({"quantization_config": [1, 2]}, "config.json's quantization_config is a list, not an object"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": [1]}},
     "compressed-tensors quantization_config.config_groups must map group names to objects"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [0, 0]}},
     "FP8 checkpoint with weight_block_size [0, 0]: expected two positive sizes"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, "FP8 checkpoint with weight_block_size"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": "128x128"}},
     "FP8 checkpoint with weight_block_size '128x128'"),
])
def test_shoal_serve_refuses_a_checkpoint_it_cannot_read_in_one_line_before_ray(change, message, checkpoint_factory,
                                                                                tmp_path):
    """The driver reads config.json (no torch) before it starts Ray: one line and exit 1, not an
    engine actor's traceback that Serve retries."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from serving import loopback_env

    repo = Path(__file__).resolve().parents[1]
    src = checkpoint_factory("llama")
    _write_copy(src, tmp_path, load_file(str(src / "model.safetensors")),
                {**json.loads((src / "config.json").read_text()), **change})
    start = time.monotonic()
    done = subprocess.run([str(Path(sys.executable).parent / "shoal"), "serve", "--model-path", str(tmp_path),
                           "--host", "127.0.0.1"], cwd=repo, env=loopback_env(PYTHONPATH=str(repo)),
                          capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"shoal serve: error: {message}"), lines
    assert time.monotonic() - start < 10  # no Ray
