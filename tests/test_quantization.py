"""Quantized weights: --quantization int8 / fp8 (quantized as the checkpoint loads) and FP8
checkpoints (dequantised as they load).

The CPU kernel (kernels/csrc/int8_linear.cpp) against float64 on the dequantised weights, int8
and e4m3, on its AVX2 and portable paths and with bf16 activations (AVX512-BF16); the GPU paths' arithmetic on CPU (the Triton
weight-only kernel under Triton's interpreter, dynamic FP8 through torch._scaled_mm); the engine
token for token against transformers on a copy of the checkpoint whose quantized weights are
replaced by their dequantised values (tests/checkpoints.py quantized_reference_copy,
fp8_copies): every dense family for int8, three for fp8, DeepSeek (MLA), gpt-oss and Qwen3-MoE
(their experts float), LoRA, and both FP8 checkpoint layouts. (Compiled decode over 8-bit
weights: tests/test_compiled_decode.py, its compile jobs beside the others.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from checkpoints import fp8_channel_copy, fp8_copies, quantized_reference_copy
from oracle import hf_greedy
from test_engine import GREEDY, assert_pool_free, prompts_of

from actors.config import EngineConfig
from actors.engine.llm import LLM
from kernels import native
from kernels.quantization import (FP8, _cpu_linear, bf16_dot, dequantize, fp8_scaled_linear, quantize,
                                  quantize_rows_fp8, triton_weight_only_linear)

# Float32 rounding of sums of K products, relative to the sum of their magnitudes: the kernel
# measured <= 2.4e-7 (float32's own matmul 2.3e-7) on the 2-core Zen 3.
ROUNDING = 1e-6


def assert_rounding_close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias, bound: float):
    """|got - x @ weight^T (+ bias)| in float64, relative to the sum of the products' magnitudes,
    below `bound`."""
    truth = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    size = F.linear(x.abs().double(), weight.abs().double()) + (0 if bias is None else bias.abs().double())
    assert ((got.double() - truth).abs() / size).max() < bound


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("portable", [False, True])
def test_kernel_equals_float64_on_the_dequantised_weights(kind, portable):
    if native.int8_linear_op() is None:
        pytest.fail("the 8-bit kernel did not build (a compiler is present on every machine we test on)")
    torch.manual_seed(0)
    for n, k in [(40, 72), (64, 64), (300, 1000)]:
        w = torch.randn(n, k)
        packed, scale = quantize(w, kind)
        ref = dequantize(packed, scale)
        assert packed.dtype == {"int8": torch.int8, "fp8": FP8}[kind] and packed.shape == (-(-n // 16), k, 16)
        if kind == "int8":
            assert (ref - w).abs().max() <= scale.max() / 2 + 1e-6  # rounding to the nearest step
        else:  # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value (subnormals: of 2^-6 * scale)
            assert ((ref - w).abs() <= torch.maximum(w.abs() / 16, scale[:, None] * 2.0**-10) * 1.0001).all()
        assert torch.equal(dequantize(*quantize(w, kind, panels=False)), ref)  # the GPU's rows, same values
        bias = torch.randn(n)
        rows = {}
        for m in (1, 5, 6, 7, 33):
            x = torch.randn(m, k)
            for b in (None, bias):
                got = _cpu_linear(x, packed, scale, b, portable)
                assert_rounding_close(got, x, ref, b, ROUNDING)
            rows[m] = (x, got)
        # A row's result does not depend on the rows beside it.
        x1, got1 = rows[1]
        assert torch.equal(_cpu_linear(torch.cat([x1, rows[33][0]]), packed, scale, bias, portable)[0], got1[0])


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_bfloat16_activations_equal_float64_on_the_dequantised_weights(kind):
    """On a CPU with AVX512-BF16 bf16 activations enter the kernel as they are (vdpbf16ps over
    k pairs): the float32 sums are float64's up to rounding, for odd K and row counts on both
    sides of a register block, a row's sums do not depend on the rows beside it, and a bf16
    model's linear (`_cpu_linear`) takes this path and rounds the sums to bf16."""
    if not bf16_dot():
        pytest.skip("this CPU has no AVX512-BF16 (an AVX2 or older AVX-512 machine)")
    torch.manual_seed(0)
    op = native.int8_linear_op(kind == "fp8")
    for n, k in [(40, 72), (300, 1000), (37, 77), (5, 1)]:
        packed, scale = quantize(torch.randn(n, k), kind)
        ref, bias = dequantize(packed, scale), torch.randn(n)
        weights = packed.view(torch.uint8) if kind == "fp8" else packed
        rows = {}
        for m in (1, 7, 8, 9, 33):
            x = torch.randn(m, k).bfloat16()
            for b in (None, bias):
                sums = torch.empty(m, n)
                op(sums, x, weights, scale, torch.empty(0) if b is None else b, False)
                assert_rounding_close(sums, x.float(), ref, b, ROUNDING)
            assert torch.equal(_cpu_linear(x, packed, scale, bias), sums.bfloat16())
            rows[m] = (x, sums)
        x1, sums1 = rows[1]
        both = torch.empty(34, n)
        op(both, torch.cat([x1, rows[33][0]]), weights, scale, bias, False)
        assert torch.equal(both[0], sums1[0])


def test_fp8_kernel_reads_every_e4m3_value():
    """Each of the 254 finite e4m3 codes (subnormals included), as the CPU kernel's AVX2 and
    portable paths and the Triton kernel widen them, equals torch's own float8 conversion: a
    one-hot input row picks out each."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]
    weight = finite.view(FP8)[:, None].repeat(1, 16).contiguous()  # [254, 16]: each row one code
    n = weight.shape[0]
    panels = torch.zeros(-(-n // 16) * 16, 16, dtype=torch.uint8)
    panels[:n] = weight.view(torch.uint8)
    packed = panels.view(FP8).view(-1, 16, 16).transpose(1, 2).contiguous()
    scale = torch.ones(n)
    x = torch.eye(16)[:1]
    for portable in (False, True):
        assert torch.equal(_cpu_linear(x, packed, scale, None, portable)[0], weight[:, 0].float())
    if bf16_dot():  # widened, then rounded to bf16 for vdpbf16ps: exact too
        assert torch.equal(_cpu_linear(x.bfloat16(), packed, scale, None)[0], weight[:, 0].bfloat16())
    assert torch.equal(triton_weight_only_linear(x, weight, scale, None)[0], weight[:, 0].float())  # CUDA's path


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_weight_only_kernel_equals_the_dequantised_weights(kind, dtype):
    """The Triton kernel of CUDA's 8-bit path, under Triton's interpreter on [N, K] rows:
    float32 sums of the widened weights, so within the activations' own rounding."""
    torch.manual_seed(1)
    for n, k, m in [(40, 72, 3), (130, 200, 17), (64, 64, 70)]:
        w = torch.randn(n, k)
        rows, scale = quantize(w, kind, panels=False)
        x, bias = torch.randn(m, k).to(dtype), torch.randn(n).to(dtype)
        got = triton_weight_only_linear(x, rows, scale, bias)
        assert got.dtype == dtype and got.shape == (m, n)
        bound = ROUNDING if dtype == torch.float32 else 2.0**-8  # bfloat16's output rounding
        assert_rounding_close(got.float(), x.float(), dequantize(rows, scale), bias.float(), bound)


def test_dynamic_fp8_matmul_equals_its_float_emulation():
    """CUDA's fp8 path on GPUs with FP8 matmuls (compute capability 8.9+), run on CPU (torch's
    CPU `_scaled_mm` computes the same product): each activation row quantized to e4m3 over its
    own scale, times the fp8 weight rows, both scales applied; equal to the same quantized values
    multiplied in float64, up to the bfloat16 output's rounding. Against the float weights and
    activations it is within e4m3's precision."""
    torch.manual_seed(2)
    for n, k, m in [(48, 64, 1), (160, 256, 9)]:
        w, x, bias = torch.randn(n, k), torch.randn(m, k), torch.randn(n)
        rows, scale = quantize(w, "fp8", panels=False)
        got = fp8_scaled_linear(x, rows, scale, bias)
        xq, x_scale = quantize_rows_fp8(x)
        assert xq.dtype == FP8 and x_scale.shape == (m, 1)
        assert_rounding_close(got, xq.float() * x_scale, dequantize(rows, scale), bias, 2.0**-8)
        assert_rounding_close(got, x, w, bias, 2 * 2.0**-4)  # both operands within half an e4m3 step


DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite", "glm4", "cohere",
         "starcoder2", "opt", "gpt2", "nemotron", "phi", "gpt_neox", "gptj", "olmo")


@pytest.mark.parametrize("kind,arch", [("int8", arch) for arch in DENSE]
                         + [("fp8", "llama"), ("fp8", "qwen3"), ("fp8", "gemma3")]
                         + [("int8", "deepseek_v3"), ("fp8", "deepseek_v2"), ("int8", "gpt_oss"), ("fp8", "qwen3_moe"),
                            ("int8", "glm4_moe"), ("fp8", "minimax_m2"), ("int8", "olmoe"), ("int8", "qwen3_5"),
                            ("fp8", "qwen3_5_moe"), ("int8", "qwen3_next"),
                            ("int8", "gemma4"), ("int8", "lfm2"),
                            ("int8", "granitemoehybrid"), ("int8", "nemotron_h")])
def test_greedy_equals_transformers_on_the_dequantised_weights(kind, arch, checkpoint_factory, tmp_path):
    path = checkpoint_factory(arch, tie_word_embeddings=arch in ("qwen3", "gemma2", "gemma3"))
    reference = quantized_reference_copy(path, tmp_path / f"{kind}-reference", kind)
    llm = LLM(str(path), quantization=kind, dtype="float32", num_kv_blocks=64)
    try:
        model = llm.engine.executor.runner.model
        q_proj = model.model.layers[0].self_attn
        assert any(p.dtype == {"int8": torch.int8, "fp8": FP8}[kind] for p in q_proj.parameters())
        assert (model.model.embed_tokens.weight.dtype == torch.int8) == (kind == "int8")  # fp8: float, as vLLM's
        prompts = prompts_of([5, 17, 33])
        for ids, out in zip(prompts, llm.generate(prompts, GREEDY)):
            assert out.outputs[0].token_ids == hf_greedy(reference, ids, GREEDY.max_tokens)
        assert_pool_free(llm)
    finally:
        llm.shutdown()


def test_each_layer_is_quantized_as_soon_as_its_weight_is_read(checkpoint_factory, monkeypatch):
    """The loader hands a weight to the quantizer once its last rows are read (q, k and v make
    one fused weight), so the float model is never whole in memory: each quantization comes
    before the next layer's tensors are read. A weight row no tensor fills (none here) would be
    zeroed before it is quantized; the output still equals transformers' on the dequantised
    weights (test above)."""
    from actors.worker import loader

    path = checkpoint_factory("llama")
    reads, events = [], []
    original_read, original_quantize = loader.checkpoint_tensors, loader.quantize_module

    def reading(*args, **kwargs):
        for name, tensor in original_read(*args, **kwargs):
            reads.append(name)
            yield name, tensor

    def quantizing(module, kind):
        events.append((len(reads), reads[-1] if reads else None))
        return original_quantize(module, kind)

    monkeypatch.setattr(loader, "checkpoint_tensors", reading)
    monkeypatch.setattr(loader, "quantize_module", quantizing)
    LLM(str(path), quantization="int8", block_size=4, num_kv_blocks=16, max_num_seqs=2)
    layers = {name.split(".")[2] for name in reads if name.startswith("model.layers.")}
    assert len(events) == 4 * len(layers) + 2  # qkv, o, gate/up, down per layer; the head; the embedding
    for count, last in events:
        assert count < len(reads) or last == reads[-1]  # quantized while reading, the last one at the end
    # each layer's four are quantized before any tensor of a later layer is read
    for count, last in events:
        if last and last.startswith("model.layers."):
            layer = int(last.split(".")[2])
            assert not any(n.startswith(f"model.layers.{layer + 1}.") for n in reads[:count])


def test_bad_quantization_is_refused():
    with pytest.raises(ValueError, match="--quantization must be one of int8, fp8, w8a8_int8, gptq, .*, got 'int4'"):
        EngineConfig(quantization="int4").validate()


def test_lora_on_int8_weights_equals_peft_on_the_dequantised_weights(adapters, tmp_path):
    """An adapter's delta joins the int8 product: transformers + peft on the dequantised copy
    give the same greedy tokens, base rows and adapter rows in one batch."""
    from actors.sampling_params import SamplingParams

    base, paths = adapters("llama")
    reference = quantized_reference_copy(base, tmp_path / "int8-reference")
    llm = LLM(str(base), quantization="int8", dtype="float32", num_kv_blocks=64, max_loras=2,
              lora_modules=[f"{name}={path}" for name, path in paths.items()])
    try:
        prompts = prompts_of([5, 9, 12])
        loras = [None, "a", "b"]
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        outs = llm.generate(prompts, params, lora=loras)
        for ids, lora, out in zip(prompts, loras, outs):
            want = hf_greedy(reference, ids, 10, adapter=paths.get(lora))
            assert out.outputs[0].token_ids == want, lora
    finally:
        llm.shutdown()


def test_an_fp8_scale_that_fits_neither_blocks_nor_channels_is_refused():
    """A block size in config.json that the scales do not bear out (or a scale per nothing):
    one line naming the weight, not a reshape error, nor weights scaled by the wrong block."""
    from actors.worker.fp8_checkpoint import dequantize

    weight = torch.zeros(96, 80).to(torch.float8_e4m3fn)
    assert dequantize(weight, torch.ones(2, 2), (48, 48)).shape == (96, 80)  # ceil(80 / 48) = 2
    with pytest.raises(ValueError, match=r"'w' \(96, 80\) has a scale of \(2, 2\), not one per block of 32 x 32"):
        dequantize(weight, torch.ones(2, 2), (32, 32), "'w'")
    with pytest.raises(ValueError, match=r"has 7 scales: expected one, or one per output channel"):
        dequantize(weight, torch.ones(7, 1), None)
    assert torch.equal(dequantize(weight, torch.ones(96, 1), None), weight.float())


@pytest.mark.parametrize("layout", ["block", "ct-block", "channel"])
def test_fp8_checkpoints_load_as_their_dequantised_weights(layout, checkpoint_factory, tmp_path_factory):
    """A fine-grained FP8 checkpoint (transformers': block scales that do not divide the
    shapes), the same blocks as compressed-tensors writes them (FP8_BLOCK) and a
    compressed-tensors one with channel scales (static input scales beside them)
    give transformers' greedy tokens on the float weights they stand for; with
    --quantization int8 on top, those of the int8 reference of that float checkpoint."""
    root = tmp_path_factory.mktemp("fp8")
    paths = fp8_copies(checkpoint_factory("llama"), root)
    reference = paths[f"reference-{layout.removeprefix('ct-')}"]
    prompts = prompts_of([5, 17])
    for options, oracle in (({}, reference), ({"quantization": "int8"}, quantized_reference_copy(reference, root / f"int8-{layout}"))):
        llm = LLM(str(paths[layout]), dtype="float32", num_kv_blocks=64, **options)
        try:
            for ids, out in zip(prompts, llm.generate(prompts, GREEDY)):
                assert out.outputs[0].token_ids == hf_greedy(oracle, ids, GREEDY.max_tokens), options
        finally:
            llm.shutdown()


NAIVE_FP8 = {"quant_method": "compressed-tensors", "format": "naive-quantized", "quantization_status": "frozen",
             "config_groups": {"group_0": {"targets": ["Linear"],
                                           "weights": {"num_bits": 8, "strategy": "channel", "type": "float"},
                                           "input_activations": {"num_bits": 8, "strategy": "tensor",
                                                                 "type": "float"}}},
             "ignore": ["lm_head"]}


@pytest.mark.parametrize("name,quant,key,suffixes", [
    ("fbgemm", {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
     "quantization_config", None),
    ("modelopt", {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": None,
                  "exclude_modules": ["lm_head"]}, "quantization_config", None),
    ("naive", NAIVE_FP8, "quantization_config", None),
    ("compression-config", NAIVE_FP8, "compression_config", None),
    ("mistral", {"activation_scheme": "static", "dequantize": False, "modules_to_not_convert": ["lm_head"],
                 "quant_method": "fp8", "weight_block_size": None}, "quantization_config",
     {".weight_scale": ".weight_scale_inv", ".input_scale": ".activation_scale"}),
])
def test_other_writers_fp8_checkpoints_load(name, quant, key, suffixes, checkpoint_factory, tmp_path_factory):
    """Meta's fbgemm_fp8, NVIDIA ModelOpt's FP8, the first LLM Compressor releases (float8 weights
    as `naive-quantized`, some under `compression_config`) and Mistral's (transformers' FP8 per
    tensor or channel: `weight_scale_inv`, a static `activation_scale`) store float8 weights with
    per-channel (or per-tensor) scales: transformers' greedy tokens on the weights they stand for."""
    root = tmp_path_factory.mktemp("fp8-writers")
    paths = fp8_copies(checkpoint_factory("llama"), root)
    path = fp8_channel_copy(paths, root / name, quant, key, suffixes)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    try:
        prompts = prompts_of([6, 13])
        for ids, out in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
            assert out.outputs[0].token_ids == hf_greedy(paths["reference-channel"], ids, GREEDY.max_tokens)
    finally:
        llm.shutdown()
