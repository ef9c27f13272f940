"""Which quantized checkpoints shoal reads, judged from config.json alone (no torch: the `shoal
serve` driver asks before it starts Ray, so a checkpoint it cannot read fails there in one line,
not in an engine actor that Serve restarts). The formats' own readers check the details as the
weights load (int4_checkpoint, int8_checkpoint, fp8_checkpoint, mxfp4_checkpoint)."""
from __future__ import annotations

from actors.config import CHECKPOINT_FORMATS

# quantization_config.quant_method values whose weights load (None: a float checkpoint).
# fbgemm_fp8 (Meta's Llama 3.1 FP8 releases) and ModelOpt's FP8 are float8 weights with a scale
# per channel or tensor: the FP8 reader takes them as they are.
READ_METHODS = (None, "fp8", "fbgemm_fp8", "modelopt", "compressed-tensors", "gptq", "awq", "mxfp4")
INT8_FORMATS = ("int-quantized", "naive-quantized")  # actors/worker/int8_checkpoint.py
# compressed-tensors formats whose weights load (dense: float weights, a KV cache scheme only, say)
READ_COMPRESSED = ("dense", "float-quantized", "pack-quantized") + INT8_FORMATS


def compressed_formats(q: dict) -> set:
    """A compressed-tensors config's formats: its groups' own, else the top-level one."""
    groups = (q.get("config_groups") or {}).values()
    return {g.get("format") or q.get("format") for g in groups} or {q.get("format")}


def check(cfg: dict, asked: str | None = None) -> None:
    """ValueError (one line) for a quantized checkpoint whose weights shoal cannot read (loading
    them as floats would give a model that runs and talks nonsense), or a --quantization that
    names another format than the checkpoint's (`asked`, one of CHECKPOINT_FORMATS)."""
    q = cfg.get("quantization_config") or {}
    method = q.get("quant_method")
    if method not in READ_METHODS:
        raise ValueError(f"{method!r} checkpoints (config.json's quantization_config) are not supported; shoal reads "
                         f"{', '.join(m for m in READ_METHODS if m)} ones and float checkpoints")
    if method == "modelopt" and str(q.get("quant_algo", "FP8")).upper() != "FP8":
        raise ValueError(f"ModelOpt {q.get('quant_algo')} checkpoints are not supported; shoal reads ModelOpt's FP8")
    if method == "compressed-tensors":
        unread = sorted(str(f) for f in compressed_formats(q) - set(READ_COMPRESSED) - {None})
        if unread:
            raise ValueError(f"compressed-tensors format {', '.join(unread)} is not supported; shoal reads "
                             f"{', '.join(READ_COMPRESSED)}")
    if asked in CHECKPOINT_FORMATS and method != CHECKPOINT_FORMATS[asked]:
        raise ValueError(f"--quantization {asked} is for {CHECKPOINT_FORMATS[asked]} checkpoints; this one's "
                         f"quantization_config says quant_method {method!r}")
