"""One module picks a rank's kernels at start (actors/worker/kernel_choice.py) and says so in
one line; the linear path it picks holds whatever the decode mode, adapters or MoE."""
from __future__ import annotations

import logging

import pytest
import torch

from actors.engine.llm import LLM
from actors.models.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from actors.sampling_params import SamplingParams
from actors.worker.kernel_choice import KernelChoice, linear_kernel
from kernels import linear, native, packed_weights
from kernels.quantization import bf16_dot, int_mm_exact, packed_int8_exact
from oracle import hf_greedy
from test_linear import released


def kernel_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "kernels: " in r.getMessage()]


def test_one_line_names_every_choice(checkpoint_factory, caplog):
    with caplog.at_level(logging.INFO, logger="shoal.runner"):
        llm = LLM(str(checkpoint_factory("llama")), num_kv_blocks=16, eager_decode=True)
    choice = llm.engine.executor.runner.kernels
    assert kernel_lines(caplog) == [f"rank 0 {choice.describe()}"]
    isa = {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability(), "portable")
    assert choice.attention == (f"cpp-{isa}" if native.paged_decode_attention_op() else "torch")
    assert choice.linear == linear_kernel(torch.float32, torch.device("cpu"))
    assert (choice.decode, choice.decode_off) == ("eager", "--eager-decode")
    assert choice.describe().endswith("decode eager (--eager-decode)")


def test_the_rules_for_linear_and_decode():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert linear_kernel(torch.float32, cuda) == "torch"  # cuBLAS
    want = "torch" if not linear.supported(torch.float32) else \
        "panel" if native.panel_linear_op() is not None else "onednn"
    assert linear_kernel(torch.float32, cpu) == want
    assert linear_kernel(torch.float16, cpu) == ("onednn" if linear.supported(torch.float16) else "torch")
    assert linear_kernel(torch.bfloat16, cpu) == (
        "torch" if not linear.supported(torch.bfloat16) else
        "bf16-pairs" if native.bf16_linear_op() is not None else "onednn")
    wide = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    built = native.int8_linear_op() is not None  # (else no C++ compiler, or SHOAL_NATIVE_KERNELS=0)
    assert linear_kernel(torch.float32, cpu, "int8") == (
        "int8-dequantised" if not built else "int8-avx2" if wide else "int8-portable")
    assert linear_kernel(torch.bfloat16, cpu, "fp8") == (
        "fp8-dequantised" if not built else
        "fp8-avx512-bf16" if wide and bf16_dot() else "fp8-avx2" if wide else "fp8-portable")
    packed = linear.ONEDNN and int_mm_exact() and packed_int8_exact()
    vnni = torch.backends.cpu.get_cpu_capability() == "AVX512" and torch.cpu._is_vnni_supported()
    panels = wide and native.w8a8_sums_op() is not None
    assert linear_kernel(torch.float32, cpu, "w8a8_int8") == (
        "w8a8_int8-onednn-packed" if packed and torch.cpu._is_amx_tile_supported() else
        ("w8a8_int8-vnni" if vnni else "w8a8_int8-avx2") if panels else
        "w8a8_int8-onednn-packed" if packed else "w8a8_int8-onednn" if int_mm_exact() else "w8a8_int8-onednn-split")
    assert linear_kernel(torch.float32, cuda, "w8a8_int8") == "w8a8_int8-cublas"
    assert KernelChoice("torch", "onednn", "compiled").packs_weights
    assert KernelChoice("torch", "bf16-pairs", "compiled").packs_weights
    assert KernelChoice("torch", "w8a8_int8-onednn-packed", "compiled").packs_weights
    assert not KernelChoice("torch", "w8a8_int8-onednn", "compiled").packs_weights
    assert not KernelChoice("torch", "torch", "cuda-graphs").packs_weights


def test_eager_decode_and_lora_keep_the_packed_linear_path(checkpoint_factory, adapters):
    """The panel kernel / oneDNN's packed weights used to come only with compiled decode: an
    eager engine, an engine with adapters (eager by rule) ran every linear unpacked."""
    base, paths = adapters("llama")
    for options in ({"eager_decode": True}, {"lora_modules": [f"a={paths['a']}"]}):
        llm = LLM(str(base), num_kv_blocks=16, **options)
        runner = llm.engine.executor.runner
        assert runner.kernels.decode == "eager"
        weights = [m.weight for m in runner.model.modules()
                   if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))]
        assert all((packed_weights.find(w) is not None) == runner.kernels.packs_weights for w in weights)
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4


def test_an_engine_built_under_inference_mode_packs_its_weights(checkpoint_factory):
    """Weights made under torch.inference_mode() keep no version counter; packing them must not
    need one (a benchmark built its engine there)."""
    with torch.inference_mode():
        llm = LLM(str(checkpoint_factory("llama")), num_kv_blocks=16, eager_decode=True)
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    runner = llm.engine.executor.runner
    if runner.kernels.packs_weights:
        assert packed_weights.find(runner.model.model.layers[0].mlp.down_proj.weight) is not None


def test_packed_weights_are_in_memory_once(checkpoint_factory):
    """Packing frees each linear weight's own layout: only the packed copy stays. A head tied
    to the embedding is freed too where its copy is panels (float32 with the panel kernel) or
    pairs (bfloat16 with the pairs kernel), whose rows the lookup reads; oneDNN's layouts are
    opaque, so there the embedding keeps its rows. Greedy output stays transformers' (float32),
    eager, and compiled with the tied head."""
    from test_compiled_decode import compiled_llm

    for tied in (False, True):
        path = checkpoint_factory("llama", tie_word_embeddings=tied)
        for dtype in ("bfloat16", "float32"):
            llm = LLM(str(path), num_kv_blocks=16, eager_decode=True, dtype=dtype)
            runner = llm.engine.executor.runner
            if not runner.kernels.packs_weights:
                pytest.skip(f"linear {runner.kernels.linear} packs no weights here")
            model = runner.model
            panels = packed_weights.find(model.lm_head.weight).dim() == 3
            assert panels == (runner.kernels.linear in ("panel", "bf16-pairs"))  # (float32 computed on a CPU without bf16 matmuls)
            for m in model.modules():
                if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)):
                    assert packed_weights.find(m.weight) is not None
                    assert released(m.weight) == (m.weight is not model.model.embed_tokens.weight or panels)
            assert released(model.model.embed_tokens.weight) == (tied and panels)
            assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
            if dtype == "bfloat16":
                llm.shutdown()
        prompt = [1, 5, 9, 2, 7]
        outs = [llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
        llm.shutdown()
        if tied:  # (compiled decode of an untied head: tests/test_compiled_decode.py)
            compiled = compiled_llm(path, dtype="float32")
            try:
                assert released(compiled.engine.executor.runner.model.model.embed_tokens.weight) == panels
                outs.append(compiled.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
            finally:
                compiled.shutdown()
        for o in outs:
            assert o[0].outputs[0].token_ids == hf_greedy(path, prompt, 8)
