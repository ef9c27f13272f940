"""Off-suite check: the packer of tests/checkpoints.py (pack_int4), and so the layouts
actors/worker/int4_checkpoint.py reads, against the writers' own code, where it installs
without a GPU: AutoAWQ's `WQLinear_GEMM.from_linear` (and its reader `dequantize_gemm`) and
compressed-tensors' `pack_to_int32`. Neither is a dependency of shoal; install them aside:

    pip install --no-deps --target /tmp/xcheck autoawq==0.2.9 compressed-tensors==0.20.0
    PYTHONPATH=/tmp/xcheck:<stubs for loguru and datasets> python tests/bench/check_int4_writers.py

(AutoAWQ imports `datasets` and compressed-tensors `loguru` at import; neither is used here, so
stand-in modules do.) GPTQ's writers (AutoGPTQ, GPTQModel) need their CUDA extensions built
to import; their packing loop is quoted in tests/test_int4_checkpoints.py instead.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for checkpoints.py
from checkpoints import pack_int4  # noqa: E402

from actors.worker.int4_checkpoint import Int4Format, dequantize  # noqa: E402


def check_awq(n=64, k=128, group=32):
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm

    from actors.worker.int4_checkpoint import awq_codes

    generator = torch.Generator().manual_seed(0)
    parts, reference = pack_int4("awq", torch.randn(n, k, generator=generator), sym=False, group_size=group)
    zeros = awq_codes(parts[".qzeros"])  # [G, N]
    linear = torch.nn.Linear(k, n, bias=False)
    linear.weight.data = reference.clone()  # from_linear rounds (w + z s) / s back to the codes
    written = WQLinear_GEMM.from_linear(linear, 4, group, scales=parts[".scales"], zeros=zeros)
    assert torch.equal(written.qweight, parts[".qweight"]), "AWQ qweight differs from AutoAWQ's"
    assert torch.equal(written.qzeros, parts[".qzeros"]), "AWQ qzeros differs from AutoAWQ's"
    theirs = dequantize_gemm(written.qweight, written.qzeros, written.scales, 4, group).float().t()  # fp16 math
    assert torch.allclose(theirs, reference, rtol=1e-3, atol=1e-4), "AutoAWQ reads other weights"
    assert torch.equal(dequantize(Int4Format("awq", 4, group, sym=False), parts), reference)
    print("AWQ: qweight and qzeros equal AutoAWQ's from_linear; its dequantize_gemm reads the same weights")


def check_compressed_tensors(n=64, k=128, group=32):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    from actors.worker.int4_checkpoint import unpack
    for sym, act_order in ((True, False), (False, True)):
        generator = torch.Generator().manual_seed(1)
        parts, reference = pack_int4("compressed-tensors", torch.randn(n, k, generator=generator), sym=sym,
                                     group_size=group, act_order=act_order, generator=generator)
        values = (unpack(parts[".weight_packed"], 4, 1) - 8).to(torch.int8)  # the signed int4 values
        assert torch.equal(pack_to_int32(values, 4), parts[".weight_packed"]), "weight_packed differs"
        assert torch.equal(unpack_from_int32(parts[".weight_packed"], 4, torch.Size([n, k])), values)
        if not sym:
            zeros = (unpack(parts[".weight_zero_point"], 4, 0) - 8).to(torch.int8)  # [N, G]
            assert torch.equal(pack_to_int32(zeros, 4, packed_dim=0), parts[".weight_zero_point"]), \
                "weight_zero_point differs"
    print("compressed-tensors: weight_packed and weight_zero_point equal pack_to_int32's")


if __name__ == "__main__":
    check_awq()
    check_compressed_tensors()
