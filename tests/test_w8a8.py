"""--quantization w8a8_int8: int8 weights times int8 activations quantized per row as they
arrive (kernels/quantization.py w8a8_linear: shoal's VNNI or AVX2 kernel, oneDNN's int8 linear
with AMX, or `torch._int_mm`).

The product against an exact emulation (int64 dot of the quantized values, then the float32
scales), on every weight layout (rows; panels for shoal's kernel, on its VNNI, AVX2 and
portable paths, on values that saturate a u8 x s8 pair sum; halves); the kernel each CPU gets
(an AVX2-only CPU forced here with ONEDNN_MAX_CPU_ISA=AVX2 and ATEN_CPU_CAPABILITY=avx2 in a
subprocess); a row's output alone
and in any batch; the engine's greedy tokens against transformers on the dequantised weights with every
nn.Linear's input quantized the same way (teacher-forced, up to quantization flips: see FLIP),
eager (compiled: tests/test_compiled_decode.py)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checkpoints import quantized_reference_copy
from oracle import hf_logits, hf_model
from test_engine import GREEDY, assert_pool_free, prompts_of

from actors.engine.llm import LLM
from kernels import packed_weights
from kernels.linear import ONEDNN
from kernels.native import w8a8_sums_op
from kernels.quantization import (W8A8_LAYOUTS, dequantize, int_mm_exact, packed_int8_exact, quantize,
                                  quantize_module, quantize_rows_int8, quantized_rows, w8a8_cpu_kernel, w8a8_layout,
                                  w8a8_linear, w8a8_weight)

REPO = Path(__file__).resolve().parent.parent


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 as the format defines it, written out on its own: scale =
    max |x_row| / 127 in float32 (1 for an all-zero row), q = x / scale rounded half to even."""
    amax = x.float().abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, 1.0)
    return torch.round(x.float() / scale).to(torch.int64), scale


def exact(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor, bias) -> torch.Tensor:
    """The int64 dot of the quantized rows and weights, then x_scale, w_scale and the bias in
    float32, in that order (the int32 sum converted once: exact below 2^24, else rounded)."""
    xq, x_scale = quantize_rows_reference(x)
    out = (xq @ q.long().t()).float() * x_scale * w_scale.view(1, -1)
    return out if bias is None else out + bias


# Each layout's shape for [N, K] and its largest |value|.
LAYOUT_SHAPE = {"rows": lambda n, k: ((n, k), 127), "halves": lambda n, k: ((2 * n, k), 64),
                "panels": lambda n, k: ((-(-n // 16), k // 4, 16, 4), 127)}


@pytest.mark.parametrize("layout", W8A8_LAYOUTS)
def test_w8a8_product_equals_the_exact_emulation(layout):
    if layout == "panels" and w8a8_sums_op() is None:
        pytest.skip("shoal's native kernels do not build here")
    torch.manual_seed(0)
    for n, k in [(40, 72), (37, 1001), (64, 64), (5, 3), (300, 4864), (17, 4)]:
        if layout == "panels" and k % 4:
            continue  # (kept in halves or rows: w8a8_layout)
        w = torch.randn(n, k)
        q, w_scale = quantize(w, "w8a8_int8", panels=False)
        assert torch.equal(q, quantize(w, "int8", panels=False)[0])  # the same int8 weights as int8's
        weight = w8a8_weight(q, layout)
        shape, largest = LAYOUT_SHAPE[layout](n, k)
        assert weight.shape == shape and weight.dtype == torch.int8 and weight.abs().max() <= largest
        assert torch.equal(dequantize(weight, w_scale), dequantize(q, w_scale))
        bias = torch.randn(n)
        for m in (0, 1, 7, 33):
            x = torch.randn(m, k) * torch.rand(m, 1) * 10
            for b in (None, bias):
                got = w8a8_linear(x, weight, w_scale.view(1, -1), b)
                assert got.shape == (m, n) and got.dtype == torch.float32
                assert torch.equal(got, exact(x, q, w_scale, b))


@pytest.mark.skipif(w8a8_sums_op() is None, reason="shoal's native kernels do not build here")
@pytest.mark.parametrize("path", [0, 1, 2], ids=["widest", "avx2", "portable"])
def test_the_panel_kernel_sums_exactly(path):
    """csrc/int8_linear.cpp w8a8_sums, on the widest path the CPU has (AVX512-VNNI where it has
    it), its AVX2 path (where the CPU has it) and its portable loop: exact int32 sums at every
    row count around their blocks of 4 and tiles of 8 rows x 2 panels, on partial last panels
    and an odd panel count, and on +-127 values whose u8 x s8 pair sums saturate vpmaddubsw
    (255 * 127 * 2 > 32767), which |w| times x with w's sign keeps within 2 * 128 * 127 (VNNI's
    vpdpbusd sums in int32: w + 128 times x, less 128 x the row's sum); weights of -128 too (an
    int8 checkpoint's codes may hold it)."""
    g = torch.Generator().manual_seed(5)
    for n, k in [(40, 72), (16, 4), (33, 1000), (64, 8)]:
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        q[::2, :40] = 127
        q[1::2, :40] = -127
        q[1::3, :8] = -128
        panels = w8a8_weight(q, "panels")
        for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33):
            xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
            xq[:, :40] = torch.where(torch.arange(m)[:, None] % 2 == 0, 127, -127).to(torch.int8)
            xq[0, 40:48] = 0
            out = torch.full((m, n), float("nan"))
            w8a8_sums_op()(out, xq, panels, path)
            assert torch.equal(out, (xq.long() @ q.long().t()).float()), (n, k, m)
    with pytest.raises(RuntimeError, match="multiple of 4"):
        w8a8_sums_op()(torch.empty(1, 16), torch.zeros(1, 6, dtype=torch.int8), panels[:1], path)


def test_activations_quantize_per_row_to_the_nearest_step():
    torch.manual_seed(1)
    x = torch.randn(9, 200) * torch.tensor([0.01, 1, 100, 1e4, 1, 1, 1, 1, 1])[:, None]
    x[4] = 0  # an all-zero row: scale 1, zeros
    x[5, 17] = -50  # one large value sets the row's scale
    xq, scale = quantize_rows_int8(x)
    assert xq.dtype == torch.int8 and scale.shape == (9, 1)
    want_q, want_scale = quantize_rows_reference(x)
    assert torch.equal(xq.long(), want_q) and torch.equal(scale, want_scale)
    assert scale[4].item() == 1 and not xq[4].any()
    assert xq[5, 17].item() == -127 and (xq.abs().amax(dim=1) == 127).sum() == 8
    assert ((xq.float() * scale - x).abs() <= scale / 2 * (1 + 1e-6)).all()


def test_a_rows_output_does_not_depend_on_the_batch():
    torch.manual_seed(2)
    w, bias = torch.randn(130, 896), torch.randn(130)
    q, s = quantize(w, "w8a8_int8", panels=False)
    batch = torch.randn(40, 896)
    threads = torch.get_num_threads()
    try:
        for t in {1, threads}:
            torch.set_num_threads(t)
            full = w8a8_linear(batch, q, s.view(1, -1), bias)
            for i in (0, 17, 39):
                assert torch.equal(w8a8_linear(batch[i:i + 1], q, s.view(1, -1), bias)[0], full[i])
                assert torch.equal(w8a8_linear(batch[i:i + 8], q, s.view(1, -1), bias)[0], full[i])
    finally:
        torch.set_num_threads(threads)


def test_quantized_module_and_embedding_rows():
    """quantize_module keeps w8a8_int8's weight in this CPU's layout with a [1, N] scale; an
    embedding sharing it looks up the dequantised rows, in every layout."""
    torch.manual_seed(3)
    layer = torch.nn.Linear(48, 70)
    w = layer.weight.data.clone()
    quantize_module(layer, "w8a8_int8")
    layout = w8a8_layout((70, 48), torch.device("cpu"))
    assert layer.weight.shape == LAYOUT_SHAPE[layout](70, 48)[0] and layer.weight_scale.shape == (1, 70)
    q, s = quantize(w, "int8", panels=False)
    ids = torch.tensor([0, 5, 69, 5, 16])
    assert torch.equal(quantized_rows(ids, layer.weight, layer.weight_scale, torch.float32), dequantize(q, s)[ids])
    for other in W8A8_LAYOUTS:
        weight = w8a8_weight(q, other)
        assert torch.equal(quantized_rows(ids, weight, s.view(1, -1), torch.float32), dequantize(q, s)[ids])
        assert torch.equal(quantized_rows(ids.view(1, 5), weight, s.view(1, -1), torch.float32),
                           dequantize(q, s)[ids].view(1, 5, 48))


def test_each_cpu_gets_its_fastest_exact_kernel():
    """A CPU with AMX runs oneDNN's prepacked int8 linear; one with AVX512-VNNI and no AMX
    (Zen 4, Cascade / Ice Lake) shoal's VNNI kernel on panels (as fast as oneDNN's from 32 rows,
    faster below, and a tied head in memory once); one with neither (the AVX2-only Zen 3, where
    torch._int_mm is exact but ran 30-50x slower than float32) shoal's AVX2 kernel on panels."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    kernel = w8a8_cpu_kernel()
    if " amx_int8" in flags:
        assert int_mm_exact()
        assert kernel == ("onednn-packed" if ONEDNN and packed_int8_exact() else "vnni")
    elif " avx512_vnni" in flags and w8a8_sums_op() is not None:
        assert kernel == "vnni"
    elif " avx2" in flags and w8a8_sums_op() is not None:
        assert kernel == "avx2"
    assert w8a8_layout((8, 64), torch.device("cpu")) == (
        "panels" if kernel in ("vnni", "avx2") else "halves" if kernel == "onednn-split" else "rows")
    if kernel in ("vnni", "avx2"):  # a K that is not a multiple of 4 falls back
        assert w8a8_layout((8, 63), torch.device("cpu")) == ("rows" if int_mm_exact() else "halves")


AVX2_CHECK = """
import torch
from kernels.quantization import int_mm_exact, quantize, quantize_module, quantize_rows_int8, w8a8_cpu_kernel, w8a8_linear
from test_w8a8 import exact
torch.manual_seed(0)
w, x = torch.randn(96, 300), torch.randn(33, 300)
q, s = quantize(w, "int8", panels=False)
xq = quantize_rows_int8(x)[0]
wrong = torch._int_mm(xq, q.t()).long() != xq.long() @ q.long().t()
assert wrong.any() != int_mm_exact()
layer = torch.nn.Linear(300, 96)
layer.weight.data.copy_(w)
quantize_module(layer, "w8a8_int8")
got = w8a8_linear(x, layer.weight, layer.weight_scale, layer.bias.detach())
assert torch.equal(got, exact(x, q, s, layer.bias.detach()))
print(w8a8_cpu_kernel(), tuple(layer.weight.shape), "exact; torch._int_mm wrong in", wrong.sum().item())
"""


@pytest.mark.parametrize("isa", ["AVX2", "SSE41"])
@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "no-native"])
def test_a_cpu_without_vnni_gets_an_exact_kernel(isa, native):
    """torch held to AVX2 and oneDNN to AVX2 (as on the AVX2-only Zen 3) or SSE4.1: oneDNN's
    prepacked int8 linear is not taken (it saturates there); shoal's AVX2 kernel on panels is,
    or, without native kernels, torch._int_mm on rows where the probe finds it exact, else on
    halves. Each is exact."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa, "ATEN_CPU_CAPABILITY": "avx2", "SHOAL_NATIVE_KERNELS": native,
           "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    run = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    kernel, rest = run.stdout.split(" ", 1)
    shapes = {"avx2": "(6, 75, 16, 4)", "onednn": "(96, 300)", "onednn-split": "(192, 300)"}
    assert kernel in ({"avx2"} if native == "1" and w8a8_sums_op() is not None else {"onednn", "onednn-split"})
    assert rest.startswith(f"{shapes[kernel]} exact"), run.stdout


def linear_with_int8_activations(self, x):
    """nn.Linear.forward with its input quantized per row as w8a8_int8 does (dequantised); a
    layer marked `tp_parts` (row-parallel at tp > 1) quantizes each rank's share of the row
    over its own scale, as each rank sees only its share; `tp_parts` 0 (a LoRA adapter's
    matrices, which shoal multiplies in float) leaves it as it is."""
    if getattr(self, "tp_parts", 1) == 0:
        return F.linear(x, self.weight, self.bias)
    parts = [quantize_rows_reference(part) for part in x.reshape(-1, x.shape[-1]).chunk(getattr(self, "tp_parts", 1), 1)]
    flat = torch.cat([xq.float() * scale for xq, scale in parts], 1)
    return F.linear(flat.view_as(x).to(x.dtype), self.weight, self.bias)


# Why not token for token: transformers rounds its float32 matmuls, norms and attention in other
# orders than shoal (~1e-7 relative), and where an activation sits on a step boundary of its
# row's int8 quantization that rounding moves it by a whole step (1/127 of the row's largest):
# measured up to 0.03 in log p on these tiny models, enough to swap a near-tie and send greedy
# decoding down another path (it did for one Qwen3 prompt of six). So each generated token is
# checked against transformers' next-token log-probs given the same prefix (teacher-forced):
# transformers' most likely token, or within FLIP of it; and most positions exactly its top-1.
FLIP = 0.1


@contextlib.contextmanager
def int8_activations(reference, tp: int = 1, adapter=None, float_head: bool = False):
    """transformers on `reference` (with a PEFT `adapter`) with every linear layer's input
    quantized as w8a8_int8 at tensor-parallel size `tp` quantizes it (an adapter's own matrices
    take theirs in float, as shoal's do, and so do MoE routers and experts and MLA's kv_b_proj; `float_head`: the LM
    head too, as an int8 checkpoint leaves it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.Linear, "forward", linear_with_int8_activations)
        for name, module in hf_model(reference, adapter).named_modules():
            # float in shoal: adapters' matrices, MoE routers and experts (routed and shared)
            # (and MLA's kv_b_proj, absorbed into the attention and multiplied in float)
            if ".lora_" in name or ".experts." in name or ".shared_expert" in name or name.endswith("mlp.gate") \
                    or name.endswith("kv_b_proj") or (float_head and name == "lm_head"):
                mp.setattr(module, "tp_parts", 0, raising=False)
            elif name.endswith(("o_proj", "down_proj", "o_proj.base_layer", "down_proj.base_layer")):
                mp.setattr(module, "tp_parts", tp, raising=False)
        yield


def assert_greedy_up_to_flips(reference, prompts, outs, tp: int = 1, adapters=None,
                              float_head: bool = False) -> list[float]:
    """Each engine token is transformers' greedy choice on its prefix, or within FLIP of it in log
    p; returns the gaps (0 where it is the top-1). `tp`: the engine's tensor-parallel size;
    `adapters`: each prompt's PEFT adapter directory (None: the base model); `float_head`: the
    LM head multiplies float activations."""
    gaps = []
    for ids, out, adapter in zip(prompts, outs, adapters or [None] * len(prompts), strict=True):
        with int8_activations(reference, tp, adapter, float_head):
            tokens = out.outputs[0].token_ids
            logp = hf_logits(reference, ids + tokens, adapter).log_softmax(-1)[len(ids) - 1:-1]
            gaps += [(row.max() - row[t]).item() for row, t in zip(logp, tokens, strict=True)]
    assert max(gaps) < FLIP, max(gaps)
    assert sum(g == 0 for g in gaps) >= 0.9 * len(gaps), sorted(gaps)[-10:]
    return gaps


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_follows_transformers_with_int8_activations(arch, checkpoint_factory, tmp_path):
    path = checkpoint_factory(arch, tie_word_embeddings=arch == "qwen3")
    reference = quantized_reference_copy(path, tmp_path / "w8a8-reference", "w8a8_int8")
    llm = LLM(str(path), quantization="w8a8_int8", dtype="float32", num_kv_blocks=64)
    try:
        runner = llm.engine.executor.runner
        model = runner.model
        assert model.model.layers[0].self_attn.qkv_proj.weight_scale.shape[0] == 1
        assert model.model.embed_tokens.weight.dtype == torch.int8
        # Where oneDNN's int8 linear runs, every linear (the tied head too) reads its packed copy;
        # shoal's kernels read the weights themselves, packed in panels as they were quantized.
        assert runner.kernels.linear == f"w8a8_int8-{w8a8_cpu_kernel()}"
        assert runner.kernels.packs_weights == (w8a8_cpu_kernel() == "onednn-packed")
        layer = model.model.layers[0]
        for weight in (layer.self_attn.qkv_proj.weight, layer.mlp.down_proj.weight, model.lm_head.weight):
            assert (packed_weights.find(weight) is not None) == runner.kernels.packs_weights
            assert (weight.dim() == 4) == (w8a8_cpu_kernel() in ("vnni", "avx2"))
        if arch == "qwen3":  # tied: the lookup reads the head's int8 weight, in memory once
            assert model.model.embed_tokens.weight.data_ptr() == model.lm_head.weight.data_ptr()
        prompts = prompts_of([5, 17, 33])
        assert_greedy_up_to_flips(reference, prompts, llm.generate(prompts, GREEDY))
        assert_pool_free(llm)
    finally:
        llm.shutdown()


AVX2_ENGINE = """
import json, sys
from actors.engine.llm import LLM
from test_engine import GREEDY
llm = LLM(sys.argv[1], quantization="w8a8_int8", dtype="float32", num_kv_blocks=64, eager_decode=True)
outs = llm.generate(json.loads(sys.argv[2]), GREEDY)
print(json.dumps({"kernels": llm.engine.executor.runner.kernels.describe(),
                  "tokens": [o.outputs[0].token_ids for o in outs]}))
llm.shutdown()
"""


def test_an_avx2_only_cpu_serves_w8a8_int8(checkpoint_factory, tmp_path):
    """The engine as on the AVX2-only Zen 3 (torch's kernels held to AVX2, oneDNN's too): shoal's
    AVX2 kernel on panels, and greedy decoding follows transformers as on a VNNI CPU."""
    import json
    from types import SimpleNamespace

    path = checkpoint_factory("llama")
    reference = quantized_reference_copy(path, tmp_path / "w8a8-reference", "w8a8_int8")
    prompts = prompts_of([5, 17, 33])
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
           "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    run = subprocess.run([sys.executable, "-c", AVX2_ENGINE, str(path), json.dumps(prompts)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert "linear w8a8_int8-avx2" in got["kernels"] and "attention cpp-avx2" in got["kernels"], got
    outs = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=t)]) for t in got["tokens"]]
    assert [len(t) for t in got["tokens"]] == [GREEDY.max_tokens] * len(prompts)
    assert_greedy_up_to_flips(reference, prompts, outs)


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_moe_models_quantize_all_but_their_experts(arch, checkpoint_factory, tmp_path):
    """MoE families under w8a8_int8: attention and the LM head take int8 activations; the
    router and the experts (routed and shared) stay float, weights and activations. Greedy
    tokens follow transformers computing that, up to flips, and prompt log-probs (no path to
    diverge) are its own: with a shared expert's inputs quantized too they were 0.019 off (median)."""
    import statistics

    from oracle import hf_prompt_logprobs

    from actors.sampling_params import SamplingParams

    path = checkpoint_factory(arch)
    reference = quantized_reference_copy(path, tmp_path / "w8a8-reference", "w8a8_int8")
    llm = LLM(str(path), quantization="w8a8_int8", dtype="float32", num_kv_blocks=64)
    try:
        layer = llm.engine.executor.runner.model.model.layers[0]
        assert layer.self_attn.qkv_proj.weight.dtype == torch.int8
        assert all(p.dtype == torch.float32 for p in layer.mlp.parameters())
        prompts = prompts_of([5, 17, 33])
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=0))
        assert_greedy_up_to_flips(reference, prompts, outs)
        deltas = []
        with int8_activations(reference):
            for ids, out in zip(prompts, outs, strict=True):
                ours = [next(iter(d.values())) for d in out.prompt_logprobs[1:]]
                deltas += [abs(a - b) for a, b in zip(ours, hf_prompt_logprobs(reference, ids), strict=True)]
        assert statistics.median(deltas) < 1e-5, deltas
        assert_pool_free(llm)
    finally:
        llm.shutdown()


# Compiled decode over w8a8_int8 weights: tests/test_compiled_decode.py (its engine compiles beside
# that module's others).


def test_adapters_on_a_w8a8_int8_base_follow_peft_with_int8_activations(adapters, tmp_path):
    """w8a8_int8 under adapters: the base layers take int8 activations, the adapters' deltas
    float ones. transformers + peft on the dequantised checkpoint, its base layers' inputs
    quantized the same way, up to quantization flips (tests/test_w8a8.py)."""
    from actors.sampling_params import SamplingParams

    base, paths = adapters("llama")
    reference = quantized_reference_copy(base, tmp_path / "w8a8", "w8a8_int8")
    llm = LLM(str(base), num_kv_blocks=64, block_size=4, max_loras=2, max_lora_rank=8, quantization="w8a8_int8",
              dtype="float32", lora_modules=[f"{n}={p}" for n, p in paths.items()])
    try:
        prompts = prompts_of([5, 30, 13, 9, 7])
        loras = ["a", "b", None, "a", "b"]
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        outs = llm.generate(prompts, params, lora=loras)
        assert_greedy_up_to_flips(reference, prompts, outs, adapters=[paths.get(n) for n in loras])
        # The adapters really change the output (else the check above proves little).
        assert llm.generate(prompts[:1], params)[0].outputs[0].token_ids != outs[0].outputs[0].token_ids
        assert_pool_free(llm)
    finally:
        llm.shutdown()


def test_shoal_serve_takes_w8a8_int8():
    from test_option_aliases import from_cli

    assert from_cli(["--quantization", "w8a8_int8"]).engine.quantization == "w8a8_int8"
    with pytest.raises(SystemExit):  # argparse's choices
        from_cli(["--quantization", "w8a8"])


def test_the_opaque_op_under_torch_compile_equals_eager():
    """w8a8_linear traced by torch.compile (the quantization and scaling compiled, the product the
    opaque shoal::int8_sums, whose fake gives the [M, N] shape, also for the weight in halves or
    panels) computes what the eager call does, in every layout and prepacked."""
    from kernels.quantization import prepack_w8a8, quantized_linear

    torch.manual_seed(4)
    w, bias, x = torch.randn(40, 72), torch.randn(40), torch.randn(3, 5, 72)
    q, s = quantize(w, "w8a8_int8", panels=False)
    packed = w8a8_weight(q, "rows")
    assert prepack_w8a8(packed, 16) == (packed.numel() if w8a8_cpu_kernel() == "onednn-packed" else 0)
    compiled = torch.compile(quantized_linear, fullgraph=True, dynamic=False)
    want = exact(x.view(-1, 72), q, s, bias).view(3, 5, 40)
    layouts = [layout for layout in W8A8_LAYOUTS if layout != "panels" or w8a8_sums_op() is not None]
    for weight in [w8a8_weight(q, layout) for layout in layouts] + [packed]:
        got = compiled(x, weight, s.view(1, -1), bias)
        assert got.shape == (3, 5, 40)
        assert torch.equal(got, quantized_linear(x, weight, s.view(1, -1), bias))
        assert torch.equal(got, want)


@pytest.mark.skipif(not (int_mm_exact() and packed_int8_exact()), reason="no exact prepacked int8 linear here")
def test_the_prepacked_product_sums_exactly_at_every_row_count(monkeypatch):
    """oneDNN's prepacked int8 linear (u8 activations shifted by 128, its zero point taking the
    shift back; taken with AMX, taken here by force) gives the int32 sums exactly, at row counts
    on both sides of the packing's hint and on saturating values, and reads the packed copy
    until the weight changes in place."""
    from kernels import quantization
    from kernels.quantization import int8_sums, prepack_w8a8

    monkeypatch.setattr(quantization, "w8a8_cpu_kernel", lambda: "onednn-packed")
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (72, 200), dtype=torch.int8, generator=g)
    q[:, :40] = 127
    prepack_w8a8(q, 32)
    assert packed_weights.find(q) is not None
    for m in (1, 3, 17, 32, 100, 513):
        xq = torch.randint(-127, 128, (m, 200), dtype=torch.int8, generator=g)
        xq[:, :40] = torch.where(torch.arange(m)[:, None] % 2 == 0, 127, -127)
        assert torch.equal(int8_sums(xq, q, 72), (xq.long() @ q.long().t()).float())
    q.mul_(-1)  # a new version: the weight itself is read again
    assert packed_weights.find(q) is None
    assert torch.equal(int8_sums(xq, q, 72), (xq.long() @ q.long().t()).float())
