"""GPTQ, AWQ and compressed-tensors pack-quantized checkpoints (actors/worker/int4_checkpoint.py).

The packer (tests/checkpoints.py int4_copies) writes each layout as its writer does; the bit
orders are pinned here against words worked out by hand from the writers' packing loops
(AutoGPTQ's `qweight[row] |= intweight[j] << (bits * (j - i))`, AutoAWQ's order_map
[0, 2, 4, 6, 1, 3, 5, 7], compressed-tensors' `pack_to_int32`: value + 2 ** (bits - 1), first
element lowest). The engine then gives transformers' greedy tokens (float32) on a copy of the
checkpoint holding the weights the packed ones stand for: sym and asym, groups of 32 and 64 and
per channel, act-order g_idx, GPTQ's v1 and v2 zeros, 4 and 8 bits, Llama / Qwen2 (biases) /
Qwen3 / Qwen3-MoE and Mixtral (each expert packed), DeepSeek-V3 (MLA), modules left float, LoRA adapters, --quantization int8 on top; a tp=2 rank holds its slices of those
weights; a config it can't read is refused at start in one line."""
from __future__ import annotations

import json
import re

import pytest
import torch
from checkpoints import QUANTIZED_PROJECTIONS, int4_copies, quantized_reference_copy
from oracle import hf_greedy
from safetensors.torch import load_file
from test_engine import GREEDY, assert_pool_free, prompts_of

from actors.engine.llm import LLM
from actors.sampling_params import SamplingParams
from actors.worker import int4_checkpoint
from actors.worker.int4_checkpoint import Int4Format, dequantize, read_format, unpack


SHORT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)  # Triton's interpreter is slow


def test_bit_orders_are_the_writers():
    """Codes 0..7 of eight adjacent columns (or rows) in one word, as each writer packs them."""
    seq = torch.tensor([[0x76543210]], dtype=torch.int32)  # GPTQ, compressed-tensors: element i in nibble i
    assert unpack(seq, 4, 0)[:, 0].tolist() == list(range(8))
    assert unpack(seq, 4, 1)[0].tolist() == list(range(8))
    # AWQ: nibble i holds column (0, 2, 4, 6, 1, 3, 5, 7)[i], so columns 0..7 = codes 0..7 read 0x75316420
    awq = Int4Format("awq", 4, -1, sym=False)
    parts = {".qweight": torch.tensor([[0x75316420]], dtype=torch.int32),
             ".qzeros": torch.zeros(1, 1, dtype=torch.int32), ".scales": torch.ones(1, 8, dtype=torch.float16)}
    assert dequantize(awq, parts)[:, 0].tolist() == list(range(8))
    # a negative int32 (top nibble >= 8) is the same bits: 0xF7654321
    top = torch.tensor([[0xF7654321 - 2 ** 32]], dtype=torch.int32)
    assert unpack(top, 4, 1)[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 15]
    assert unpack(torch.tensor([[0x80FF017F - 2 ** 32]], dtype=torch.int32), 8, 1)[0].tolist() == [127, 1, 255, 128]
    # GPTQ v1 stores z - 1: a stored 0xF is a zero point of 16
    gptq = Int4Format("gptq", 4, -1, sym=False, zero_offset=1)
    parts = {".qweight": torch.zeros(1, 8, dtype=torch.int32), ".scales": torch.ones(1, 8, dtype=torch.float16),
             ".qzeros": torch.tensor([[0x0000000F]], dtype=torch.int32)}
    assert dequantize(gptq, parts)[:, 0].tolist() == [-16, -1, -1, -1, -1, -1, -1, -1]
    # compressed-tensors: codes are value + 8, a packed zero point too
    ct = Int4Format("compressed-tensors", 4, -1, sym=False)
    parts = {".weight_packed": torch.tensor([[0x76543210]], dtype=torch.int32),
             ".weight_scale": torch.ones(1, 1), ".weight_shape": torch.tensor([1, 8]),
             ".weight_zero_point": torch.tensor([[0x9]], dtype=torch.int32)}  # row 0's zero: 9 - 8 = 1
    assert dequantize(ct, parts)[0].tolist() == [v - 8 - 1 for v in range(8)]
    # older compressed-tensors writers: the zero point unpacked, int8 [N, G], signed
    assert torch.equal(dequantize(ct, {**parts, ".weight_zero_point": torch.tensor([[1]], dtype=torch.int8)}),
                       dequantize(ct, parts))
    # a symmetric GPTQ module written without qzeros: the midpoint 2 ** (bits - 1)
    sym = Int4Format("gptq", 4, -1, sym=True, zero_offset=1)
    parts = {".qweight": torch.full((1, 8), 0x76543210, dtype=torch.int32),  # 8 columns of k = 0..7
             ".scales": torch.ones(1, 8, dtype=torch.float16)}
    assert dequantize(sym, parts)[0].tolist() == [v - 8 for v in range(8)]


CASES = {
    "gptq-sym-g32": ("llama", "gptq", dict(sym=True)),
    "gptq-asym-actorder": ("qwen2", "gptq", dict(sym=False, act_order=True)),
    "gptq-8bit-channel-v2": ("qwen3", "gptq", dict(bits=8, group_size=-1, sym=False, v2=True)),
    "awq-g32-float-module": ("llama", "awq", dict(sym=False, float_modules=("model.layers.0.mlp.down_proj",))),
    "awq-g64": ("qwen3", "awq", dict(sym=False, group_size=64)),
    "ct-sym-g32": ("llama", "compressed-tensors", dict(sym=True)),
    "ct-asym-actorder": ("qwen2", "compressed-tensors", dict(sym=False, act_order=True)),
    "ct-asym-channel": ("qwen3", "compressed-tensors", dict(sym=False, group_size=-1)),
    "gptq-moe-experts": ("qwen3_moe", "gptq", dict(sym=True, act_order=True)),  # each expert packed
    "gptq-actorder-shared": ("llama", "gptq", dict(sym=False, act_order="shared")),  # q/k/v share a g_idx
    "awq-mixtral-experts": ("mixtral", "awq", dict(sym=False)),  # experts' w1 / w2 / w3 packed
    "gptq-deepseek-v3": ("deepseek_v3", "gptq", dict(sym=True)),  # MLA's q_a / q_b / kv_a_proj_with_mqa packed
}


@pytest.fixture(scope="module")
def copies(checkpoint_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    return lambda case: int4_copies(checkpoint_factory(CASES[case][0]), root / case, CASES[case][1],
                                    **CASES[case][2])


@pytest.mark.parametrize("case", CASES)
def test_dequantised_weights_are_those_the_checkpoint_stands_for(case, copies):
    """Every projection the loader reads equals the reference's weight exactly, and the packed
    checkpoint holds no float copy of it."""
    from actors.worker.loader import checkpoint_tensors, weight_files

    paths = copies(case)
    reference = load_file(paths["reference"] / "model.safetensors")
    seen = {}
    for name, tensor in checkpoint_tensors(paths["packed"], weight_files(paths["packed"])):
        if tensor is not None:
            seen[name] = tensor[:]
    assert set(seen) == set(reference)
    for name, w in reference.items():
        assert torch.equal(seen[name].to(w.dtype), w), name
    names = set(load_file(paths["packed"] / "model.safetensors"))
    float_modules = CASES[case][2].get("float_modules", ())
    assert not {n for n in names if n.endswith(QUANTIZED_PROJECTIONS) and n.removesuffix(".weight") not in float_modules}


@pytest.mark.parametrize("case", CASES)
def test_greedy_equals_transformers_on_the_dequantised_weights(case, copies):
    paths = copies(case)
    llm = LLM(str(paths["packed"]), dtype="float32", num_kv_blocks=64)
    try:
        prompts = prompts_of([5, 17])
        for ids, out in zip(prompts, llm.generate(prompts, GREEDY)):
            assert out.outputs[0].token_ids == hf_greedy(paths["reference"], ids, GREEDY.max_tokens)
        assert_pool_free(llm)
    finally:
        llm.shutdown()


def test_int8_on_top_equals_the_int8_reference(copies, tmp_path):
    """--quantization int8 quantizes the dequantised weights again."""
    paths = copies("gptq-asym-actorder")
    oracle = quantized_reference_copy(paths["reference"], tmp_path / "int8")
    llm = LLM(str(paths["packed"]), dtype="float32", num_kv_blocks=64, quantization="int8")
    try:
        attention = llm.engine.executor.runner.model.model.layers[0].self_attn
        assert any(p.dtype == torch.int8 for p in attention.parameters())
        prompts = prompts_of([9])
        for ids, out in zip(prompts, llm.generate(prompts, GREEDY)):
            assert out.outputs[0].token_ids == hf_greedy(oracle, ids, GREEDY.max_tokens)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("case", ["gptq-asym-actorder", "awq-g64", "ct-asym-channel"])
@pytest.mark.parametrize("layout", [dict(tp_size=2), dict(pp_size=2)])
def test_parallel_ranks_hold_their_slices(case, layout, copies, monkeypatch):
    """tp=2 and pp=2, built in process: each rank's parameters from the packed checkpoint equal
    those it builds from the reference (column- and row-parallel slices of the dequantised
    weights; a stage's own layers), and a stage dequantises only its own layers."""
    from actors.distributed.parallel import Parallel
    from actors.worker import loader

    paths = copies(case)
    cfg = json.loads((paths["reference"] / "config.json").read_text())
    read = []
    dequantize = int4_checkpoint.dequantize
    monkeypatch.setattr(int4_checkpoint, "dequantize", lambda fmt, parts: read.append(1) or dequantize(fmt, parts))
    for rank in (0, 1):
        read.clear()
        models = [loader.build_model(paths[kind], cfg, torch.float32, torch.device("cpu"), 64,
                                     Parallel(rank=rank, **layout)) for kind in ("packed", "reference")]
        projections = 7 * cfg["num_hidden_layers"]  # q, k, v, o, gate, up, down
        assert len(read) == (projections if "tp_size" in layout else projections // 2), len(read)
        got, want = (dict(m.named_parameters()) for m in models)
        assert set(got) == set(want)
        for name in want:
            assert torch.equal(got[name], want[name]), (rank, name)


@pytest.mark.parametrize("quant, message", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ checkpoint with bits 3: shoal reads 4 and 8-bit"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "GPTQ checkpoint with group_size 0"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv': shoal reads the GEMM layout only"),
    ({"quant_method": "awq", "bits": 8}, "AWQ checkpoint with bits 8"),
])
def test_a_config_it_cannot_read_is_refused(quant, message):
    with pytest.raises(ValueError, match=message):
        read_format({"quantization_config": quant})
    assert read_format({"quantization_config": {"quant_method": "fp8"}}) is None
    assert read_format({}) is None


def test_malformed_checkpoint_is_refused_at_start(copies, tmp_path):
    """bits 3 in a GPTQ config: one line, before any weight is read."""
    import shutil

    path = tmp_path / "bits3"
    shutil.copytree(copies("gptq-sym-g32")["packed"], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["bits"] = 3
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPTQ checkpoint with bits 3") as raised:
        LLM(str(path), dtype="float32", num_kv_blocks=64)
    assert "\n" not in str(raised.value)
    assert int4_checkpoint.read_format(json.loads((copies("gptq-sym-g32")["packed"] / "config.json").read_text()))


def test_lora_adapters_on_a_gptq_checkpoint_equal_peft_on_the_dequantised_weights(adapters, tmp_path):
    """Adapters are checked against the float shapes the packed weights stand for, and their
    deltas join the dequantised weights' products (base rows and adapter rows in one batch)."""
    from actors.worker.loader import checkpoint_shapes

    base, paths = adapters("llama")
    copies = int4_copies(base, tmp_path / "gptq", "gptq", sym=False, act_order=True)
    assert checkpoint_shapes(copies["packed"]) == checkpoint_shapes(copies["reference"])
    llm = LLM(str(copies["packed"]), dtype="float32", num_kv_blocks=64, max_loras=2,
              lora_modules=[f"{name}={path}" for name, path in paths.items()])
    try:
        prompts = prompts_of([5, 9, 12])
        loras = [None, "a", "b"]
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        for ids, lora, out in zip(prompts, loras, llm.generate(prompts, params, lora=loras)):
            assert out.outputs[0].token_ids == hf_greedy(copies["reference"], ids, 10, adapter=paths.get(lora)), lora
    finally:
        llm.shutdown()


# ------------------------------------------------------------- weights kept packed (SHOAL_INT4_KERNEL)

def interpreter_or_skip():
    from kernels import triton_programs
    if not triton_programs.available() or not triton_programs.interpreted():
        pytest.skip("needs Triton's interpreter (CUDA is here)")


@pytest.mark.parametrize("case", ["gptq-sym-g32", "awq-g64", "ct-asym-channel", "gptq-asym-actorder",
                                  "gptq-actorder-shared"])
def test_kept_packed_the_triton_kernel_gives_transformers_tokens(case, copies, monkeypatch):
    """SHOAL_INT4_KERNEL=1 (Triton's interpreter on CPU): the linear layers keep the packed
    weights, fused q/k/v and gate/up put side by side, and multiply through
    kernels/int4_linear.py; greedy tokens equal transformers' on the dequantised weights. Where
    act-order gives q, k and v different g_idx (a random one per module here; GPTQ's own are
    one permutation per input) the fused layer is dequantised instead."""
    interpreter_or_skip()
    monkeypatch.setenv("SHOAL_INT4_KERNEL", "1")
    paths = copies(case)
    llm = LLM(str(paths["packed"]), dtype="float32", num_kv_blocks=64)
    try:
        layer = llm.engine.executor.runner.model.model.layers[0]
        attention, mlp = layer.self_attn, layer.mlp
        assert attention.o_proj.int4 is not None and attention.o_proj.weight.numel() == 0
        fused_packed = case != "gptq-asym-actorder"  # its q/k/v and gate/up g_idx differ
        assert (attention.qkv_proj.int4 is not None) == fused_packed
        assert (mlp.gate_up_proj.int4 is not None) == fused_packed
        prompts = prompts_of([5, 17])
        for ids, out in zip(prompts, llm.generate(prompts, SHORT)):
            assert out.outputs[0].token_ids == hf_greedy(paths["reference"], ids, SHORT.max_tokens)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("case", ["gptq-actorder-shared", "awq-g64", "ct-asym-channel"])
def test_kept_packed_tensor_parallel_ranks_hold_their_slices(case, copies, monkeypatch):
    """tp=2, built in process with SHOAL_INT4_KERNEL=1: each rank's packed layers (column
    slices of fused q/k/v and gate/up, row-parallel input slices with their g_idx) stand for
    exactly the float slices it builds from the reference."""
    from actors.distributed.parallel import Parallel
    from actors.worker.loader import build_model
    from kernels.int4_linear import dequantize as dequantize_layout

    interpreter_or_skip()
    monkeypatch.setenv("SHOAL_INT4_KERNEL", "1")
    paths = copies(case)
    cfg = json.loads((paths["reference"] / "config.json").read_text())
    for rank in (0, 1):
        packed, reference = (build_model(paths[kind], cfg, torch.float32, torch.device("cpu"), 64,
                                         Parallel(tp_size=2, rank=rank)) for kind in ("packed", "reference"))
        want = dict(reference.named_modules())
        kept = 0
        for name, module in packed.named_modules():
            if getattr(module, "int4", None) is not None:
                assert torch.equal(dequantize_layout(**module.int4), want[name].weight), (rank, name)
                kept += 1
        assert kept == 4 * cfg["num_hidden_layers"], kept  # qkv, o, gate_up, down


def test_kept_packed_layers_never_hold_a_float_weight(copies, monkeypatch):
    """The weights that stay packed are built on the meta device (no float copy at load); a
    fused layer that can't stay packed (q/k/v with different act-order g_idx) gets memory and
    its dequantised weight."""
    from actors.worker.loader import build_model, packed_targets

    interpreter_or_skip()
    monkeypatch.setenv("SHOAL_INT4_KERNEL", "1")
    paths = copies("gptq-asym-actorder")
    cfg = json.loads((paths["packed"] / "config.json").read_text())
    allocated = []  # the shapes the loader gives memory (torch.empty(shape, dtype=, device=))
    empty = torch.empty

    def spy(*args, **kwargs):
        if kwargs.get("device") == torch.device("cpu") and args and isinstance(args[0], torch.Size):
            allocated.append(tuple(args[0]))
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", spy)
    model = build_model(paths["packed"], cfg, torch.float32, torch.device("cpu"), 64)
    monkeypatch.setattr(torch, "empty", empty)
    assert (cfg["vocab_size"], 64) in allocated  # (the spy sees the loader's: the embedding's is one)
    layer = model.model.layers[0]
    targets = packed_targets(model, paths["packed"], cfg, torch.device("cpu"))
    assert "model.layers.0.mlp.down_proj.weight" in targets and "model.layers.0.self_attn.qkv_proj.weight" in targets
    assert (64, 128) not in allocated  # down_proj [hidden, intermediate] never had float memory
    assert layer.mlp.down_proj.int4 is not None and layer.self_attn.qkv_proj.int4 is None
    reference = build_model(paths["reference"], cfg, torch.float32, torch.device("cpu"), 64)
    assert torch.equal(layer.self_attn.qkv_proj.weight, reference.model.layers[0].self_attn.qkv_proj.weight)
    assert not any(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("case, legacy", [("gptq-sym-g32", "quantize_config.json"), ("awq-g64", "quant_config.json")])
def test_a_legacy_settings_file_stands_for_quantization_config(case, legacy, copies, tmp_path):
    """Older AutoGPTQ / AutoAWQ releases keep their settings in quantize_config.json /
    quant_config.json (AutoAWQ's with its own key names and no quant_method) and none in
    config.json: the checkpoint loads as the same GPTQ / AWQ one, and `--quantization gptq` /
    `awq_marlin` (vLLM's spellings) are accepted for it."""
    import shutil

    paths = copies(case)
    dst = shutil.copytree(paths["packed"], tmp_path / "legacy")
    config = json.loads((dst / "config.json").read_text())
    q = config.pop("quantization_config")
    if q["quant_method"] == "awq":
        q = {"zero_point": True, "q_group_size": q["group_size"], "w_bit": q["bits"], "version": "GEMM"}
    (dst / legacy).write_text(json.dumps(q))
    (dst / "config.json").write_text(json.dumps(config))
    named = {"gptq": "gptq", "awq": "awq_marlin"}[CASES[case][1]]
    llm = LLM(str(dst), dtype="float32", num_kv_blocks=64, quantization=named)
    try:
        ids = prompts_of([9])[0]
        out = llm.generate([ids], SHORT)[0]
        assert out.outputs[0].token_ids == hf_greedy(paths["reference"], ids, SHORT.max_tokens)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("case, change, message", [
    ("gptq-sym-g32", {"bits": 8}, r"qweight .* holds \d+ input columns of 8-bit codes"),
    ("awq-g64", {"group_size": 32}, r"in \d+ group\(s\) of 32 \(config.json's group_size\), but its scales have"),
    ("awq-g64", {"group_size": 128}, r"group\(s\) of 128 \(config.json's group_size\), but its scales have"),
    ("ct-asym-channel", {"strategy": "group", "group_size": 16}, r"weight_packed .* group\(s\) of 16"),
])
def test_settings_that_do_not_fit_the_tensors_are_refused(case, change, message, copies, tmp_path):
    """bits or a group size in config.json that the packed tensors do not bear out: one line
    naming the tensor, not a model that reads the codes or the groups' scales wrongly (a group
    size too large loaded and ran, using half of the scales)."""
    import shutil

    path = tmp_path / "changed"
    shutil.copytree(copies(case)["packed"], path)
    config = json.loads((path / "config.json").read_text())
    q = config["quantization_config"]
    for group in (q.get("config_groups") or {}).values():
        group["weights"].update(change)
    if "config_groups" not in q:
        q.update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as raised:
        LLM(str(path), dtype="float32", num_kv_blocks=64)
    assert "\n" not in str(raised.value)


def test_shoal_serve_says_in_one_line_why_the_model_did_not_load(copies, tmp_path):
    """A checkpoint whose fault shows only as its weights load (a group size its scales do not
    bear out): Serve retries the replica, then `shoal serve` ends with the engine's reason in
    one line of its own (no traceback of its own), exit 1, and no Ray process left."""
    import shutil
    import subprocess
    import sys
    import time
    from pathlib import Path

    from serving import descendants, loopback_env, outliving

    path = tmp_path / "awq-g128"
    shutil.copytree(copies("awq-g64")["packed"], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["group_size"] = 128
    (path / "config.json").write_text(json.dumps(config))
    repo = Path(__file__).resolve().parents[1]
    log = tmp_path / "serve.log"
    with log.open("w") as sink:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "shoal"), "serve", "--model-path", str(path),
                                 "--host", "127.0.0.1", "--port", "8149", "--eager-decode"], cwd=repo,
                                env=loopback_env(PYTHONPATH=str(repo)), stdout=sink, stderr=subprocess.STDOUT)
        family, deadline = set(), time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            family |= descendants(proc.pid)  # Ray's processes, while they live
            time.sleep(0.5)
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    ours = [line for line in out.splitlines() if line.startswith("shoal serve: error:")]
    assert proc.wait() == 1 and len(ours) == 1, out[-3000:]
    assert re.search(r"failed to deploy: ValueError: .*qweight .* in \d+ group\(s\) of 128", ours[0]), ours
    assert not any(line.startswith("Traceback") for line in out.splitlines()), out[-3000:]
    assert family and not outliving(family), "shoal serve left processes behind"


def test_packed_tensors_without_their_settings_are_named(copies, tmp_path):
    """A GPTQ checkpoint whose config.json lost its quantization_config: the error says what the
    stray tensors are."""
    import shutil

    path = tmp_path / "no-config"
    shutil.copytree(copies("gptq-sym-g32")["packed"], path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unexpected weight .* \(GPTQ, AWQ, compressed-tensors\), but config.json "
                                         "names no quantization_config"):
        LLM(str(path), dtype="float32", num_kv_blocks=64)


def test_naming_another_format_is_refused(copies):
    """--quantization awq on a GPTQ checkpoint (or on a float one) fails at start in one line."""
    with pytest.raises(ValueError, match="--quantization awq is for awq checkpoints; this one .* 'gptq'"):
        LLM(str(copies("gptq-sym-g32")["packed"]), num_kv_blocks=16, quantization="awq")
    with pytest.raises(ValueError, match="--quantization gptq_marlin is for gptq checkpoints; this one is not quantized"):
        LLM(str(copies("gptq-sym-g32")["reference"]), num_kv_blocks=16, quantization="gptq_marlin")
