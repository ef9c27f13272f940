"""Which quantized checkpoints shoal reads, judged from config.json alone (no torch: the `shoal
serve` driver asks before it starts Ray, so a checkpoint it cannot read fails there in one line,
not in an engine actor that Serve restarts). The formats' own readers check the details as the
weights load (int4_checkpoint, int8_checkpoint, fp8_checkpoint, mxfp4_checkpoint)."""
from __future__ import annotations

from actors.config import CHECKPOINT_FORMATS

# quantization_config.quant_method values whose weights load (None: a float checkpoint).
# fbgemm_fp8 (Meta's Llama 3.1 FP8 releases) and ModelOpt's FP8 are float8 weights with a scale
# per channel or tensor: the FP8 reader takes them as they are.
# gguf: a llama.cpp file's directory (actors/worker/gguf_checkpoint.py), dequantised as it loads.
READ_METHODS = (None, "fp8", "fbgemm_fp8", "modelopt", "compressed-tensors", "gptq", "awq", "mxfp4", "gguf")
INT8_FORMATS = ("int-quantized", "naive-quantized")  # actors/worker/int8_checkpoint.py
# compressed-tensors formats whose weights load (dense: float weights, a KV cache scheme only, say)
READ_COMPRESSED = ("dense", "float-quantized", "pack-quantized") + INT8_FORMATS


def settings(cfg: dict) -> dict:
    """config.json's quantization_config ({} for a float checkpoint); ValueError (one line) when
    it is not an object."""
    q = cfg.get("quantization_config")
    if q is None:
        return {}
    if not isinstance(q, dict):
        raise ValueError(f"config.json's quantization_config is a {type(q).__name__}, not an object "
                         "(a quantized checkpoint's settings, or absent for a float one)")
    return q


def config_groups(q: dict) -> list[dict]:
    """A compressed-tensors config's groups (ValueError, one line, when they are not objects)."""
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        raise ValueError("compressed-tensors quantization_config.config_groups must map group names to objects")
    return list(groups.values())


def compressed_formats(q: dict) -> set:
    """A compressed-tensors config's formats: its groups' own, else the top-level one."""
    return {g.get("format") or q.get("format") for g in config_groups(q)} or {q.get("format")}


def fp8_block(q: dict) -> tuple[int, int] | None:
    """The weights' scale block of a block-wise FP8 checkpoint: transformers' `weight_block_size`,
    or compressed-tensors' `block_structure` with strategy "block" (LLM Compressor's FP8_BLOCK);
    None: not block-wise. ValueError (one line) unless it is two positive whole numbers."""
    block = q.get("weight_block_size")
    name = "weight_block_size"
    if q.get("quant_method") == "compressed-tensors":
        for group in config_groups(q):
            weights = group.get("weights") or {}
            if isinstance(weights, dict) and weights.get("strategy") == "block":
                block, name = weights.get("block_structure"), "block_structure"
    if block is None:
        return None
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"FP8 checkpoint with {name} {block!r}: expected two positive sizes, e.g. [128, 128]")
    return block[0], block[1]


def check(cfg: dict, asked: str | None = None) -> None:
    """ValueError (one line) for a quantized checkpoint whose weights shoal cannot read (loading
    them as floats would give a model that runs and talks nonsense), or a --quantization that
    names another format than the checkpoint's (`asked`, one of CHECKPOINT_FORMATS)."""
    q = settings(cfg)
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
    if method in ("fp8", "compressed-tensors"):
        fp8_block(q)
    if asked in CHECKPOINT_FORMATS and method != CHECKPOINT_FORMATS[asked]:
        found = f"quantization_config says quant_method {method!r}" if method else "is not quantized"
        raise ValueError(f"--quantization {asked} is for {CHECKPOINT_FORMATS[asked]} checkpoints; this one {found}")
