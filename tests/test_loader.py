"""shoal's weight loader: each weight goes from disk straight into its place, in the target
dtype on the target device (no float32 model is ever materialized first)."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from actors.worker.checkpoint_files import read_config
from actors.worker.loader import build_model


class Allocations(TorchDispatchMode):
    """Dtypes of the real (non-meta) tensors that `empty*` ops allocate."""

    def __init__(self):
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if "empty" in func.__name__ and isinstance(out, torch.Tensor) and out.device.type != "meta" \
                and out.is_floating_point():
            self.dtypes.add(out.dtype)
        return out


def test_bfloat16_weights_are_allocated_in_bfloat16(llama_ckpt):
    cfg = read_config(llama_ckpt)  # the checkpoint itself is float32
    with Allocations() as seen:
        model = build_model(llama_ckpt, cfg, torch.bfloat16, torch.device("cpu"), 64)
    assert seen.dtypes == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope_cos.dtype == torch.bfloat16
