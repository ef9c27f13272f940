"""kernels/linear.py: CPU linears through the AVX-512 panel kernel, the AVX512-BF16 pairs kernel
or oneDNN, row counts bucketed for oneDNN outside torch.compile.

The engine's compiled decode path against transformers (token for token, float32) is checked
in tests/test_compiled_decode.py; here, the layer itself.
"""
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from kernels import linear as linear_mod
from kernels import packed_weights
from kernels.linear import linear

pytestmark = pytest.mark.skipif(not linear_mod.ONEDNN, reason="torch without oneDNN (or SHOAL_ONEDNN_LINEAR=0)")


def close(a, b):
    # Another summation order: last-bit differences only (inputs ~N(0, 1), sums of 32-512 terms).
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [0, 1, 3, 32, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=g), torch.randn(200, 96, generator=g)
    b = torch.randn(200, generator=g) if bias else None
    close(torch.ops.shoal.cpu_linear(x, w, b), F.linear(x, w, b))


def test_batched_and_strided_inputs():
    w, b = torch.randn(40, 64), torch.randn(40)
    x3 = torch.randn(2, 5, 64)
    close(torch.ops.shoal.cpu_linear(x3, w, b), F.linear(x3, w, b))
    xt = torch.randn(64, 7).t()  # not contiguous
    close(torch.ops.shoal.cpu_linear(xt, w, b), F.linear(xt, w, b))


def test_eager_row_buckets():
    assert [linear_mod.eager_rows(n) for n in (0, 1, 3, 8, 9, 64, 65, 257, 300, 512, 2049)] == \
        [1, 1, 3, 8, 10, 64, 80, 320, 320, 512, 2560]
    sizes = {linear_mod.eager_rows(n) for n in range(1, 2049)}
    assert len(sizes) == 40 and all(n <= linear_mod.eager_rows(n) < 1.25 * n for n in range(1, 4097))


@pytest.mark.parametrize("shape", [(0, 24), (1, 24), (5, 24), (300, 24), (2, 7, 24)])
def test_eager_calls_pad_rows_to_buckets(monkeypatch, shape):
    """Outside torch.compile the call is oneDNN's on a padded copy (a kernel per bucket, not per
    row count); the padding never reaches the result."""
    seen = []
    op = linear_mod._LINEAR
    monkeypatch.setattr(linear_mod, "_LINEAR", lambda x, *rest: seen.append(x.shape[0]) or op(x, *rest))
    x, w, b = torch.randn(*shape), torch.randn(40, 24), torch.randn(40)
    out = linear(x, w, b)
    assert out.shape == (*shape[:-1], 40)
    close(out, F.linear(x, w, b))
    rows = x.reshape(-1, 24).shape[0]
    assert seen == [linear_mod.eager_rows(rows)]


@torch.inference_mode()
def test_compiled_calls_go_through_onednn_with_dynamic_shapes():
    """Inside torch.compile the op is opaque (shoal::cpu_linear); one graph, every size."""
    w, b = torch.randn(48, 32), torch.randn(48)
    f = lambda x: torch.relu(linear(x, w, b))  # noqa: E731
    compiled = torch.compile(f, dynamic=True, fullgraph=True)
    for rows in (2, 5, 64):
        x = torch.randn(rows, 32)
        assert torch.equal(compiled(x), torch.relu(torch.ops.shoal.cpu_linear(x, w, b)))
        close(compiled(x), f(x))


@torch.inference_mode()
def test_off_switch(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(linear_mod, "ONEDNN", False)
    w = torch.randn(16, 8)
    compiled = torch.compile(lambda x: linear(x, w), dynamic=True, fullgraph=True)
    x = torch.randn(4, 8)
    assert torch.equal(compiled(x), F.linear(x, w))
    torch._dynamo.reset()


PACKED_DTYPES = [torch.float32] + ([torch.bfloat16] if torch.bfloat16 in linear_mod._DTYPES else [])


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_prepacked_weights_serve_the_op_until_the_weight_changes_or_goes(dtype):
    """Compiled decode packs its weights once (panels, or oneDNN's blocked layout). The op then reads the
    packed copy; an in-place change to a weight kept plain (a new version) sends it back to the
    weight itself, and the entry goes with the weight."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(200, 96, generator=g).to(dtype), torch.randn(8, 96, generator=g).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    before = F.linear(x, w)
    kept, packed = linear_mod.prepack([w, w], 32, keep_plain=[w]), packed_weights.find(w)
    assert kept == packed.numel() * packed.element_size() >= w.numel() * w.element_size()  # each weight once
    torch.testing.assert_close(torch.ops.shoal.cpu_linear(x, w, None), before, **tol)
    w.data.mul_(2)  # .data: the same memory without a new version, so the packed copy is read
    torch.testing.assert_close(torch.ops.shoal.cpu_linear(x, w, None), before, **tol)
    w.mul_(2)  # a new version: the weight itself is read (4x what was packed)
    torch.testing.assert_close(torch.ops.shoal.cpu_linear(x, w, None), F.linear(x, w), **tol)
    key = packed_weights.key(w)
    del w
    assert key not in packed_weights._COPIES


def released(weight: torch.Tensor) -> bool:
    """Packing freed the weight's own memory (kernels/packed_weights.py release)."""
    return weight.numel() > 0 and weight.untyped_storage().nbytes() == 0


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_a_packed_weight_is_in_memory_once(dtype):
    """Packing frees the weight's own memory: the tensor keeps its shape (what compiled steps and
    the op's output need), the op reads the packed copy, eagerly and compiled, and anything that
    would read the freed values gets an error instead."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(200, 96, generator=g).to(dtype), torch.randn(8, 96, generator=g).to(dtype)
    view = torch.randn(4, 200, 96, generator=g).to(dtype)[1]  # a view into a larger buffer stays
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    before, before_view = F.linear(x, w), F.linear(x, view)
    extra = linear_mod.prepack([w, view], 32)
    packed = packed_weights.find(w)
    assert extra == 2 * packed.numel() * packed.element_size() - w.numel() * w.element_size()
    assert w.untyped_storage().nbytes() == 0 and released(w)
    assert w.shape == (200, 96) and w.stride() == (96, 1) and not released(view)
    torch.testing.assert_close(linear_mod.linear(x, w), before, **tol)
    torch.testing.assert_close(linear_mod.linear(x, view), before_view, **tol)
    compiled = torch.compile(lambda x, w: linear_mod.linear(x, w) * 2, dynamic=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, w), before * 2, **tol)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="not allocated|out of bounds"):
        F.linear(x, w)


COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
panel = pytest.mark.skipif(not (linear_mod.native.has_avx512() and COMPILER and linear_mod.native.enabled()),
                           reason="no AVX-512, no C++ compiler or SHOAL_NATIVE_KERNELS=0: float32 stays on oneDNN")


def test_the_panel_kernel_builds_wherever_it_can():
    """On an AVX-512 CPU with a compiler the panel kernel must build (a failed build is a
    failure here, not a skip of the tests below); elsewhere it is None."""
    op = linear_mod.native.panel_linear_op()
    if linear_mod.native.has_avx512() and COMPILER and linear_mod.native.enabled():
        assert op is not None, "a compiler and AVX-512 are here but the panel kernel did not build (see the warning)"
    else:
        assert op is None


@panel
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 32, 257])
@pytest.mark.parametrize("n", [64, 200, 8000])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_kernel_matches_f_linear(rows, n, bias):
    """Any row count (blocks of 6 and every remainder), outputs past the last full panel, bias."""
    g = torch.Generator().manual_seed(rows * n)
    x, w = torch.randn(rows, 96, generator=g), torch.randn(n, 96, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    out = torch.empty(rows, n)
    linear_mod.native.panel_linear_op()(out, x, linear_mod.pack_panels(w), b if bias else torch.empty(0))
    close(out, F.linear(x, w, b))


@panel
def test_panel_results_do_not_depend_on_the_batch():
    """One chain of sums per output: a row's result is the same bits in any batch."""
    w = torch.randn(300, 512)
    packed, op = linear_mod.pack_panels(w), linear_mod.native.panel_linear_op()
    x = torch.randn(33, 512)
    outs = []
    for rows in (1, 6, 7, 33):
        out = torch.empty(rows, 300)
        op(out, x[:rows], packed, torch.empty(0))
        outs.append(out[0])
    assert all(torch.equal(o, outs[0]) for o in outs)


BF16_DOT = torch.cpu._is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported()
pairs = pytest.mark.skipif(not (BF16_DOT and COMPILER and linear_mod.native.enabled()),
                           reason="no AVX512-BF16 (or AMX, where oneDNN is faster), no C++ compiler or "
                                  "SHOAL_NATIVE_KERNELS=0: bfloat16 stays on oneDNN")


def test_the_pairs_kernel_builds_wherever_it_can():
    """Where the CPU has AVX512-BF16 and no AMX, and a compiler is here, the bf16 kernel must
    build; elsewhere it is None (bf16 linears on oneDNN)."""
    op = linear_mod.native.bf16_linear_op()
    if BF16_DOT and COMPILER and linear_mod.native.enabled():
        assert op is not None, "AVX512-BF16 and a compiler are here but the pairs kernel did not build (see the warning)"
    else:
        assert op is None


def bf16_reference(x, w, b):
    """float64 sums of the bf16 products (+ bias), rounded to bf16 as the kernel rounds."""
    out = x.double() @ w.double().T + (0 if b is None else b.double())
    return out.float().bfloat16()


@pairs
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 13, 32])
@pytest.mark.parametrize("n,k", [(16, 96), (17, 96), (200, 77), (1000, 64), (5, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_pairs_kernel_matches_float64_rounded_to_bf16(rows, n, k, bias):
    """Any row count (tiles of 6 and every remainder), whole and partial tiles of 4 panels,
    columns past the last full panel, an odd K (its last pair half zero), bias: each output is
    float64's sum rounded to bf16, give or take the float32 sums' rounding (an ulp of bf16)."""
    g = torch.Generator().manual_seed(rows * n + k)
    x, w = torch.randn(rows, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    linear_mod.native.bf16_linear_op()(out, x, packed_weights.pairs(w),
                                       b if bias else torch.empty(0, dtype=torch.bfloat16))
    want = bf16_reference(x, w, b).float()
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(2.0 ** -20)
    assert ((out.float() - want).abs() <= ulp).all()


@pairs
def test_pairs_results_do_not_depend_on_the_batch():
    """One chain of sums per output: a row's result is the same bits in any batch."""
    w = torch.randn(300, 512).bfloat16()
    packed, op = packed_weights.pairs(w), linear_mod.native.bf16_linear_op()
    x = torch.randn(33, 512).bfloat16()
    outs = []
    for rows in (1, 6, 7, 33):
        out = torch.empty(rows, 300, dtype=torch.bfloat16)
        op(out, x[:rows], packed, torch.empty(0, dtype=torch.bfloat16))
        outs.append(out[0])
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_pair_rows_are_the_weights_rows():
    """An embedding tied to a head packed in pairs reads its rows back exactly (any N, odd K)."""
    for n, k in ((16, 8), (37, 9), (5, 1)):
        w = torch.randn(n, k).bfloat16()
        ids = torch.tensor([[0, n - 1], [n // 2, 0]])
        assert torch.equal(packed_weights.pair_rows(packed_weights.pairs(w), ids, k), w[ids])


@pairs
@torch.no_grad()
def test_bf16_weights_packed_take_the_pairs_kernel(monkeypatch):
    """Once packed, eager and compiled bf16 calls run the pairs kernel (eager ones without
    padding rows), and a tied embedding's lookups read the pairs once the weight is released."""
    w, b = torch.randn(130, 64).bfloat16(), torch.randn(130).bfloat16()
    extra = linear_mod.prepack([w], 32, embeddings=[w])
    assert released(w) and extra == (144 - 130) * 64 * 2  # in memory once (plus the last panel's padding)
    calls = []
    op = linear_mod._PAIRS_OP
    monkeypatch.setattr(linear_mod, "_PAIRS_OP", lambda out, x, *rest: calls.append(x.shape[0]) or op(out, x, *rest))
    plain = packed_weights.pair_rows(packed_weights.find(w), torch.arange(130), 64)  # the weight's values
    x = torch.randn(2, 5, 64).bfloat16()
    assert torch.equal(linear(x, w, b), bf16_reference(x.reshape(10, 64), plain, b).view(2, 5, 130))
    compiled = torch.compile(lambda x: linear(x, w, b), dynamic=True, fullgraph=True)
    x2 = torch.randn(3, 64).bfloat16()
    got = compiled(x2)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 130)
    assert calls == [10, 3]
    ids = torch.tensor([3, 129, 0])
    assert torch.equal(linear_mod.embedding(ids, w), plain[ids])
    torch._dynamo.reset()


@panel
@torch.no_grad()
def test_packed_weights_take_the_panel_kernel(monkeypatch):
    """Once packed (compiled decode packs its weights), eager and compiled calls run the panel
    kernel, eager ones without padding rows; a weight changed in place is not read stale."""
    w, b = torch.randn(130, 64), torch.randn(130)
    assert linear_mod.prepack([w], 32, keep_plain=[w]) == linear_mod.pack_panels(w).numel() * 4
    calls = []
    op = linear_mod._PANEL_OP
    monkeypatch.setattr(linear_mod, "_PANEL_OP", lambda out, x, *rest: calls.append(x.shape[0]) or op(out, x, *rest))
    x = torch.randn(2, 5, 64)
    close(linear(x, w, b), F.linear(x, w, b))
    compiled = torch.compile(lambda x: linear(x, w, b), dynamic=True, fullgraph=True)
    x2 = torch.randn(3, 64)
    close(compiled(x2), F.linear(x2, w, b))
    assert calls == [10, 3]
    calls.clear()
    w.mul_(2)  # in place: the packed copy is stale, so oneDNN takes the call on w itself
    close(linear(x, w, b), F.linear(x, w, b))
    assert calls == []
    torch._dynamo.reset()
