"""NVFP4 checkpoints (actors/worker/nvfp4_checkpoint.py): compressed-tensors' nvfp4-pack-quantized
and ModelOpt's NVFP4, dequantised as they load.

The packer (tests/checkpoints.py nvfp4_copies) quantizes as the writers do; its bit order is
pinned here against bytes worked out by hand from their packing code (compressed-tensors'
pack_fp4_to_uint8 `indices[:, 0] | (indices[:, 1] << 4)`, ModelOpt's NVFP4QTensor
`(q[..., 1::2] << 4) | q[..., 0::2]`), and the tensor-wide scale's direction (a divisor in
compressed-tensors, a factor in ModelOpt) against the float weights it was quantized from. The
loader's weights then equal, bit for bit, a float checkpoint holding what the codes stand for,
and the engine gives transformers' greedy tokens (float32) on it: Llama and Qwen3 in both
layouts, with and without activation scales, settings in config.json or ModelOpt's
hf_quant_config.json, Qwen3-MoE and DeepSeek-V3 (MLA) with each expert quantized, modules left float (the LM head,
an `ignore`d projection); a tp=2 rank holds its slices; what it can't read is refused in one
line."""
from __future__ import annotations

import json

import pytest
import torch
from checkpoints import QUANTIZED_PROJECTIONS, nvfp4_copies, pack_e2m1, quantize_nvfp4
from oracle import hf_greedy
from safetensors.torch import load_file
from test_engine import GREEDY, assert_pool_free, prompts_of

from actors.engine.llm import LLM
from actors.worker import quantization_config
from actors.worker.nvfp4_checkpoint import LAYOUTS, dequantize, read_layout, unpack


def test_bit_order_and_scales_are_the_writers():
    """[0.5, -6, 1, 2, 3, -0.5]: codes 1, 0xF, 2, 4, 5, 9, element 2i in the low nibble, so bytes
    0xF1, 0x42, 0x95; a group scale of 2 with a tensor-wide 4 is a step of 2 / 4 in
    compressed-tensors' layout and 2 * 4 in ModelOpt's."""
    values = torch.tensor([[0.5, -6.0, 1.0, 2.0, 3.0, -0.5]])
    assert pack_e2m1(values).tolist() == [[0xF1, 0x42, 0x95]]
    assert torch.equal(unpack(torch.tensor([[0xF1, 0x42, 0x95]], dtype=torch.uint8)), values)
    codes = torch.tensor([[0xF1, 0x42, 0x95, 0, 0, 0, 0, 0]], dtype=torch.uint8)  # one group of 16
    scale = torch.tensor([[2.0]]).to(torch.float8_e4m3fn)
    row = torch.cat([values, torch.zeros(1, 10)], dim=1)
    assert torch.equal(dequantize(LAYOUTS["compressed-tensors"], codes, scale, torch.tensor([4.0])), row / 2)
    assert torch.equal(dequantize(LAYOUTS["modelopt"], codes, scale, torch.tensor(4.0)), row * 8)


@pytest.mark.parametrize("writer", ["compressed-tensors", "modelopt"])
def test_the_packer_stays_within_half_a_step_of_the_float_weights(writer):
    """Read back by the loader's dequantize, every value is within one e2m1 step (a group's
    amax / 6, its e4m3 rounding aside) of the weight it was quantized from: a tensor-wide scale
    taken the wrong way round would be off by its square."""
    torch.manual_seed(0)
    w = torch.randn(48, 64) * torch.logspace(-2, 1, 64)  # groups of very different sizes
    parts, reference = quantize_nvfp4(w, writer)
    layout = LAYOUTS[writer]
    got = dequantize(layout, parts[layout.packed], parts[".weight_scale"], parts[layout.global_scale])
    assert torch.equal(got, reference)
    group_amax = w.reshape(48, 4, 16).abs().amax(-1, keepdim=True)
    assert ((got - w).reshape(48, 4, 16).abs() <= group_amax / 6 * 1.1).all()


CASES = {
    "ct-llama": ("llama", "compressed-tensors", dict(float_modules=("model.layers.0.mlp.down_proj",))),
    "ct-a16-qwen3-moe": ("qwen3_moe", "compressed-tensors", dict(activations=False)),  # each expert quantized
    "modelopt-llama": ("llama", "modelopt", dict()),
    "modelopt-a16-qwen3-hf-quant-config": ("qwen3", "modelopt", dict(activations=False, hf_quant_config=True)),
    "modelopt-deepseek-v3": ("deepseek_v3", "modelopt", dict()),  # MLA's projections, each expert quantized
}


@pytest.fixture(scope="module")
def copies(checkpoint_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4")
    return lambda case: nvfp4_copies(checkpoint_factory(CASES[case][0]), root / case, CASES[case][1],
                                     **CASES[case][2])


@pytest.mark.parametrize("case", CASES)
def test_dequantised_weights_are_those_the_checkpoint_stands_for(case, copies):
    """Every weight the loader reads equals the reference's exactly (the float ones as they
    are); the checkpoint holds no float copy of a quantized projection, and its shapes (what
    LoRA adapters are checked against) are the float weights'."""
    from actors.worker.loader import checkpoint_shapes, checkpoint_tensors, read_config, weight_files

    paths = copies(case)
    assert read_layout(read_config(paths["packed"])) is LAYOUTS[CASES[case][1]]
    reference = load_file(paths["reference"] / "model.safetensors")
    seen = {name: tensor[:] for name, tensor in checkpoint_tensors(paths["packed"], weight_files(paths["packed"]))
            if tensor is not None}
    assert set(seen) == set(reference)
    for name, w in reference.items():
        assert torch.equal(seen[name], w), name
    assert checkpoint_shapes(paths["packed"]) == {name: tuple(w.shape) for name, w in reference.items()}
    packed = load_file(paths["packed"] / "model.safetensors")
    quantized = [n for n in reference if n.endswith(QUANTIZED_PROJECTIONS)
                 and n.removesuffix(".weight") not in CASES[case][2].get("float_modules", ())]
    assert quantized and all(packed.get(n, torch.empty(0, dtype=torch.uint8)).dtype == torch.uint8 for n in quantized)
    assert "lm_head.weight" not in packed or packed["lm_head.weight"].dtype == torch.float32
    if "moe" in case:
        assert any(".experts.7." in n for n in quantized)


@pytest.mark.parametrize("case", CASES)
def test_greedy_equals_transformers_on_the_dequantised_weights(case, copies):
    paths = copies(case)
    llm = LLM(str(paths["packed"]), dtype="float32", num_kv_blocks=64)
    try:
        prompts = prompts_of([5, 17])
        for ids, out in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
            assert out.outputs[0].token_ids == hf_greedy(paths["reference"], ids, GREEDY.max_tokens)
        assert_pool_free(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("case", ["ct-llama", "modelopt-llama"])
def test_tensor_parallel_ranks_hold_their_slices(case, copies):
    """tp=2, built in process: each rank's parameters from the NVFP4 checkpoint equal those it
    builds from the reference (column- and row-parallel slices of the dequantised weights)."""
    from actors.distributed.parallel import Parallel
    from actors.worker import loader

    paths = copies(case)
    cfg = json.loads((paths["reference"] / "config.json").read_text())
    for rank in (0, 1):
        models = [loader.build_model(paths[kind], cfg, torch.float32, torch.device("cpu"), 64,
                                     Parallel(tp_size=2, rank=rank)) for kind in ("packed", "reference")]
        got, want = (dict(m.named_parameters()) for m in models)
        assert set(got) == set(want)
        for name in want:
            assert torch.equal(got[name], want[name]), (rank, name)


def test_int8_on_top_equals_the_int8_reference(copies, tmp_path):
    """--quantization int8 quantizes the dequantised weights again."""
    from checkpoints import quantized_reference_copy

    paths = copies("modelopt-llama")
    oracle = quantized_reference_copy(paths["reference"], tmp_path / "int8")
    llm = LLM(str(paths["packed"]), dtype="float32", num_kv_blocks=64, quantization="int8")
    try:
        prompts = prompts_of([9])
        for ids, out in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
            assert out.outputs[0].token_ids == hf_greedy(oracle, ids, GREEDY.max_tokens)
    finally:
        llm.shutdown()


NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}


def _ct(weights=None, fmt="nvfp4-pack-quantized", **groups):
    group = {"weights": {**NVFP4_WEIGHTS, **(weights or {})}, "format": fmt}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group, **groups}}


@pytest.mark.parametrize("quant, message", [
    (_ct({"group_size": 32}), "nvfp4-pack-quantized weights of 4 bits, type 'float', group_size 32: shoal reads "
                              "NVFP4's symmetric 4-bit floats in groups of 16"),
    (_ct({"type": "int"}), "nvfp4-pack-quantized weights of 4 bits, type 'int'"),
    (_ct(group_1={"weights": {"num_bits": 4, "type": "int"}, "format": "pack-quantized"}),
     "compressed-tensors checkpoint mixing nvfp4-pack-quantized with pack-quantized layers"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32},
     "ModelOpt NVFP4 checkpoint with group_size 32: shoal reads NVFP4's groups of 16"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4_AWQ"}, "ModelOpt NVFP4_AWQ checkpoints are not supported"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_NVFP4_FP8"}, "ModelOpt W4A8_NVFP4_FP8 checkpoints are not"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}, "ModelOpt MIXED_PRECISION checkpoints are not"),
])
def test_a_config_it_cannot_read_is_refused_in_one_line(quant, message):
    with pytest.raises(ValueError, match=message) as raised:
        quantization_config.check({"quantization_config": quant})
    assert "\n" not in str(raised.value)


def test_what_it_reads_passes_and_modelopt_fp4_names_it():
    """vLLM's `--quantization modelopt_fp4` names ModelOpt's NVFP4 and nothing else."""
    modelopt = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "nvfp4", "group_size": 16}}
    for config in (modelopt, {"quantization_config": _ct()}, {"quantization_config": _ct(dense={"format": "dense"})}):
        quantization_config.check(config)
    quantization_config.check(modelopt, "modelopt_fp4")
    quantization_config.check(modelopt, "modelopt")
    with pytest.raises(ValueError, match="--quantization modelopt_fp4 is for ModelOpt NVFP4 checkpoints; this "
                                         "one's quant_algo is 'FP8'"):
        quantization_config.check({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}},
                                  "modelopt_fp4")
    with pytest.raises(ValueError, match="--quantization modelopt_fp4 is for modelopt checkpoints"):
        quantization_config.check({"quantization_config": _ct()}, "modelopt_fp4")


@pytest.mark.parametrize("change, message", [
    (lambda t, m: t.__setitem__(m + ".weight_scale", t[m + ".weight_scale"][:, :-1].contiguous()),
     r"'model.layers.1.self_attn.q_proj.weight_packed' \(64, 32\) holds 64 inputs, but its weight_scale is "
     r"torch.float8_e4m3fn \(64, 3\): expected float8_e4m3fn \(64, 4\)"),
    (lambda t, m: t.__setitem__(m + ".weight_scale", t[m + ".weight_scale"].float()), "but its weight_scale is "
                                                                                       "torch.float32"),
    (lambda t, m: t.__setitem__(m + ".weight_global_scale", torch.ones(2)), "has 2 tensor-wide scales"),
    (lambda t, m: t.pop(m + ".weight_scale"), "the checkpoint lacks 'model.layers.1.self_attn.q_proj.weight_scale'"),
])
def test_tensors_that_are_not_nvfp4_are_refused_in_one_line(change, message, copies, tmp_path):
    """Scales of the wrong shape or dtype, or missing: one line naming the tensor, not a model
    that loads and talks nonsense."""
    import shutil

    from safetensors.torch import save_file

    src = copies("ct-llama")["packed"]
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    change(tensors, "model.layers.1.self_attn.q_proj")
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=message) as raised:
        LLM(str(tmp_path), dtype="float32", num_kv_blocks=16)
    assert "\n" not in str(raised.value)
