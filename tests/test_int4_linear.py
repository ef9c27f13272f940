"""The packed-integer matmul in Triton (kernels/int4_linear.py), run on CPU by Triton's
interpreter (TRITON_INTERPRET=1): each checkpoint layout (tests/checkpoints.py pack_int4:
GPTQ v1 / v2 with act-order, AWQ, compressed-tensors sym / asym / channel; 4 and 8 bits) brought
to the kernel's layout (actors/worker/int4_checkpoint.py to_kernel_layout) against x @ W^T on
the weight the checkpoint stands for, in float32 on the same inputs rounded as the kernel
rounds them, for fp16, bf16 and float32 activations and rows counts that are not the tile's."""
from __future__ import annotations

import pytest
import torch
from checkpoints import pack_int4

from actors.worker.int4_checkpoint import Int4Format, dequantize, to_kernel_layout
from kernels import int4_linear as k4
from kernels import triton_programs

pytestmark = pytest.mark.skipif(not triton_programs.available(), reason="Triton is not installed")

LAYOUTS = {
    "gptq-v1-actorder": (Int4Format("gptq", 4, 32, sym=False, zero_offset=1), dict(sym=False, act_order=True)),
    "gptq-v2-8bit-channel": (Int4Format("gptq", 8, -1, sym=True), dict(bits=8, group_size=-1, v2=True)),
    "awq-g32": (Int4Format("awq", 4, 32, sym=False), dict(sym=False)),
    "ct-sym-g32": (Int4Format("compressed-tensors", 4, 32, sym=True), dict(sym=True)),
    "ct-asym-actorder": (Int4Format("compressed-tensors", 4, 32, sym=False), dict(sym=False, act_order=True)),
    "ct-asym-channel-8bit": (Int4Format("compressed-tensors", 8, -1, sym=False), dict(bits=8, group_size=-1, sym=False)),
}


@pytest.fixture(autouse=True)
def interpreted():
    if not triton_programs.interpreted():
        pytest.skip("Triton's interpreter is off (CUDA is here)")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_layout_holds_the_same_weight(layout):
    fmt, options = LAYOUTS[layout]
    generator = torch.Generator().manual_seed(1)
    w = torch.randn(48, 96, generator=generator)
    parts, reference = pack_int4(fmt.method, w, generator=generator, **options)
    assert torch.equal(dequantize(fmt, parts), reference)
    assert torch.equal(k4.dequantize(**to_kernel_layout(fmt, parts)), reference)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kernel_equals_the_dequantised_product(layout, dtype):
    fmt, options = LAYOUTS[layout]
    generator = torch.Generator().manual_seed(2)
    n, k = 40, 96  # N not a multiple of the 32-column tile, K three tiles
    w = torch.randn(n, k, generator=generator)
    parts, reference = pack_int4(fmt.method, w, generator=generator, **options)
    packed = to_kernel_layout(fmt, parts)
    bias = torch.randn(n, generator=generator).to(dtype)
    for m in (1, 7, 33):
        x = torch.randn(m, k, generator=generator).to(dtype)
        for b in (None, bias):
            got = k4.int4_linear(x, **packed, bias=b)
            assert got.dtype == dtype and got.shape == (m, n)
            # the kernel rounds each dequantised weight to x's dtype and sums in float32
            truth = x.double() @ reference.to(dtype).double().t() + (0 if b is None else b.double())
            size = x.double().abs() @ reference.to(dtype).double().abs().t() + (0 if b is None else b.double().abs())
            err = ((got.double() - truth).abs() / size).max().item()
            assert err < (1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps), (m, err)


def test_rows_of_a_batch_are_independent_and_a_3d_input_keeps_its_shape():
    fmt, options = LAYOUTS["awq-g32"]
    generator = torch.Generator().manual_seed(3)
    parts, _ = pack_int4(fmt.method, torch.randn(32, 64, generator=generator), generator=generator, **options)
    packed = to_kernel_layout(fmt, parts)
    x = torch.randn(2, 9, 64, generator=generator).to(torch.float16)
    out = k4.int4_linear(x, **packed)
    assert out.shape == (2, 9, 32)
    assert torch.equal(k4.int4_linear(x[1, 4:5], **packed)[0], out[1, 4])
    assert k4.int4_linear(x[:0], **packed).shape == (0, 9, 32)
