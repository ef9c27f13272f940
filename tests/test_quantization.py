"""Quantized weights: --quantization int8 (weight-only, quantized as the checkpoint loads) and
FP8 checkpoints (dequantised as they load).

The int8 kernel (kernels/csrc/int8_linear.cpp) against float64 on the dequantised weights, on
its AVX2 and portable paths; the engine token for token against transformers on a copy of the
checkpoint whose quantized weights are replaced by their dequantised values
(tests/checkpoints.py int8_reference_copy, fp8_copies): every dense family, compiled decode,
LoRA, and both FP8 layouts."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from checkpoints import fp8_copies, int8_reference_copy
from oracle import hf_greedy
from test_engine import GREEDY, assert_pool_free, prompts_of

from actors.config import EngineConfig
from actors.engine.llm import LLM
from kernels import native
from kernels.quantization import _int8_linear, dequantize_int8, quantize_int8

# Float32 rounding of sums of K products, relative to the sum of their magnitudes: the kernel
# measured <= 2.4e-7 (float32's own matmul 2.3e-7) on the 2-core Zen 3.
ROUNDING = 1e-6


@pytest.mark.parametrize("portable", [False, True])
def test_kernel_equals_float64_on_the_dequantised_weights(portable):
    if native.int8_linear_op() is None:
        pytest.fail("the int8 kernel did not build (a compiler is present on every machine we test on)")
    torch.manual_seed(0)
    for n, k in [(40, 72), (64, 64), (300, 1000)]:
        w = torch.randn(n, k)
        packed, scale = quantize_int8(w)
        ref = dequantize_int8(packed, scale)
        assert packed.dtype == torch.int8 and packed.shape == (-(-n // 16), k, 16)
        assert (ref - w).abs().max() <= scale.max() / 2 + 1e-6  # rounding to the nearest step
        bias = torch.randn(n)
        rows = {}
        for m in (1, 5, 6, 7, 33):
            x = torch.randn(m, k)
            for b in (None, bias):
                got = _int8_linear(x, packed, scale, b, portable)
                truth = F.linear(x.double(), ref.double(), None if b is None else b.double())
                size = F.linear(x.abs().double(), ref.abs().double()) + (0 if b is None else b.abs().double())
                assert ((got.double() - truth).abs() / size).max() < ROUNDING, (n, k, m)
            rows[m] = (x, got)
        # A row's result does not depend on the rows beside it.
        x1, got1 = rows[1]
        assert torch.equal(_int8_linear(torch.cat([x1, rows[33][0]]), packed, scale, bias, portable)[0], got1[0])


DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite", "glm4")


@pytest.mark.parametrize("arch", DENSE)
def test_greedy_equals_transformers_on_the_dequantised_weights(arch, checkpoint_factory, tmp_path):
    path = checkpoint_factory(arch, tie_word_embeddings=arch in ("qwen3", "gemma2", "gemma3"))
    reference = int8_reference_copy(path, tmp_path / "int8-reference")
    llm = LLM(str(path), quantization="int8", dtype="float32", num_kv_blocks=64)
    try:
        q_proj = llm.engine.executor.runner.model.model.layers[0].self_attn
        assert any(p.dtype == torch.int8 for p in q_proj.parameters())
        prompts = prompts_of([5, 17, 33])
        for ids, out in zip(prompts, llm.generate(prompts, GREEDY)):
            assert out.outputs[0].token_ids == hf_greedy(reference, ids, GREEDY.max_tokens)
        assert_pool_free(llm)
    finally:
        llm.shutdown()


def test_bad_quantization_is_refused():
    with pytest.raises(ValueError, match="--quantization must be one of int8, got 'int4'"):
        EngineConfig(quantization="int4").validate()


def test_compiled_decode_runs_int8_like_eager(checkpoint_factory, tmp_path):
    """Compiled decode (the default) calls the kernel as the opaque op shoal::int8_linear."""
    from test_compiled_decode import OPTIONS, compiled_llm

    from actors.sampling_params import SamplingParams
    from oracle import assert_equals_eager_and_hf

    path = checkpoint_factory("llama")
    reference = int8_reference_copy(path, tmp_path / "int8-reference")
    compiled = compiled_llm(path, quantization="int8", dtype="float32")
    eager = LLM(str(path), quantization="int8", dtype="float32", **OPTIONS)
    try:
        prompts = prompts_of([3, 9, 30, 1, 5, 14])
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
        before = compiled.engine.executor.runner.graph_replays
        got, want = compiled.generate(prompts, params), eager.generate(prompts, params)
        assert compiled.engine.executor.runner.graph_replays > before
        assert_equals_eager_and_hf(reference, prompts, got, want, 16)
    finally:
        compiled.shutdown()
        eager.shutdown()


def test_lora_on_int8_weights_equals_peft_on_the_dequantised_weights(adapters, tmp_path):
    """An adapter's delta joins the int8 product: transformers + peft on the dequantised copy
    give the same greedy tokens, base rows and adapter rows in one batch."""
    from actors.sampling_params import SamplingParams

    base, paths = adapters("llama")
    reference = int8_reference_copy(base, tmp_path / "int8-reference")
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


@pytest.mark.parametrize("layout", ["block", "channel"])
def test_fp8_checkpoints_load_as_their_dequantised_weights(layout, checkpoint_factory, tmp_path_factory):
    """A fine-grained FP8 checkpoint (transformers': block scales that do not divide the
    shapes) and a compressed-tensors one (channel scales, static input scales beside them)
    give transformers' greedy tokens on the float weights they stand for; with
    --quantization int8 on top, those of the int8 reference of that float checkpoint."""
    root = tmp_path_factory.mktemp("fp8")
    paths = fp8_copies(checkpoint_factory("llama"), root)
    reference = paths[f"reference-{layout}"]
    prompts = prompts_of([5, 17])
    for options, oracle in (({}, reference), ({"quantization": "int8"}, int8_reference_copy(reference, root / f"int8-{layout}"))):
        llm = LLM(str(paths[layout]), dtype="float32", num_kv_blocks=64, **options)
        try:
            for ids, out in zip(prompts, llm.generate(prompts, GREEDY)):
                assert out.outputs[0].token_ids == hf_greedy(oracle, ids, GREEDY.max_tokens), options
        finally:
            llm.shutdown()
