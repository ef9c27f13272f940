"""Which quantized checkpoints shoal reads, judged from config.json alone (no torch: the `shoal
serve` driver asks before it starts Ray, so a checkpoint it cannot read fails there in one line,
not in an engine actor that Serve restarts). The formats' own readers check the details as the
weights load (int4_checkpoint, int8_checkpoint, fp8_checkpoint, mxfp4_checkpoint, nvfp4_checkpoint)."""
from __future__ import annotations

from actors.config import CHECKPOINT_FORMATS

# quantization_config.quant_method values whose weights load (None: a float checkpoint).
# fbgemm_fp8 (Meta's Llama 3.1 FP8 releases) and ModelOpt's FP8 are float8 weights with a scale
# per channel or tensor: the FP8 reader takes them as they are.
# gguf: a llama.cpp file's directory (actors/worker/gguf_checkpoint.py), dequantised as it loads.
READ_METHODS = (None, "fp8", "fbgemm_fp8", "modelopt", "compressed-tensors", "gptq", "awq", "mxfp4", "gguf")
INT8_FORMATS = ("int-quantized", "naive-quantized")  # actors/worker/int8_checkpoint.py
# compressed-tensors formats whose weights load (dense: float weights, a KV cache scheme only, say)
NVFP4_FORMAT = "nvfp4-pack-quantized"  # actors/worker/nvfp4_checkpoint.py
READ_COMPRESSED = ("dense", "float-quantized", "pack-quantized", NVFP4_FORMAT) + INT8_FORMATS
# ModelOpt quant_algo values whose weights load: FP8 (the FP8 reader), NVFP4 and its weight-only
# twin (the same tensors without input_scale)
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
MODELOPT_ALGOS = ("FP8",) + NVFP4_ALGOS
NVFP4_GROUP = 16


def settings(cfg: dict) -> dict:
    """config.json's quantization_config ({} for a float checkpoint), its quant_method lower-cased
    as vLLM reads it ("GPTQ" is "gptq"); early compressed-tensors releases name it
    `compression_config` (vLLM reads that too). ValueError (one line) when it is not an object."""
    q = cfg.get("quantization_config")
    if q is None:
        q = cfg.get("compression_config")
    if q is None:
        return {}
    if not isinstance(q, dict):
        raise ValueError(f"config.json's quantization_config is a {type(q).__name__}, not an object "
                         "(a quantized checkpoint's settings, or absent for a float one)")
    method = q.get("quant_method")
    return {**q, "quant_method": method.lower()} if isinstance(method, str) and method != method.lower() else q


def config_groups(q: dict) -> list[dict]:
    """A compressed-tensors config's groups (ValueError, one line, when they are not objects)."""
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        raise ValueError("compressed-tensors quantization_config.config_groups must map group names to objects")
    return list(groups.values())


def compressed_formats(q: dict) -> set:
    """A compressed-tensors config's formats: its groups' own, else the top-level one."""
    return {g.get("format") or q.get("format") for g in config_groups(q)} or {q.get("format")}


def modelopt_algo(q: dict) -> str:
    """A ModelOpt config's quant_algo, upper-cased as vLLM reads it (FP8 where it names none)."""
    return str(q.get("quant_algo", "FP8")).upper()


def check_nvfp4(q: dict) -> None:
    """ValueError (one line) for an NVFP4 config whose weights are not e2m1 codes in groups of
    16 (the scales' shapes are checked again as each weight loads), or one that mixes NVFP4
    with integer layers (whose `weight_packed` would read alike)."""
    if q.get("quant_method") == "compressed-tensors":
        mixed = sorted(str(f) for f in compressed_formats(q) if f in INT8_FORMATS + ("pack-quantized",))
        if mixed:
            raise ValueError(f"compressed-tensors checkpoint mixing {NVFP4_FORMAT} with {', '.join(mixed)} layers: "
                             "shoal reads NVFP4 beside float and FP8 layers only")
        for group in config_groups(q):
            if (group.get("format") or q.get("format")) != NVFP4_FORMAT:
                continue
            w = group.get("weights") or {}
            if (w.get("num_bits"), w.get("type"), w.get("group_size"), w.get("symmetric", True)) != \
                    (4, "float", NVFP4_GROUP, True):
                raise ValueError(f"{NVFP4_FORMAT} weights of {w.get('num_bits')} bits, type {w.get('type')!r}, "
                                 f"group_size {w.get('group_size')!r}: shoal reads NVFP4's symmetric 4-bit floats "
                                 f"in groups of {NVFP4_GROUP}")
        return
    sizes = [q.get("group_size")] + [(g.get("weights") or {}).get("group_size") for g in config_groups(q)]
    for size in sizes:
        if size is not None and size != NVFP4_GROUP:
            raise ValueError(f"ModelOpt {modelopt_algo(q)} checkpoint with group_size {size!r}: shoal reads NVFP4's "
                             f"groups of {NVFP4_GROUP}")


def check_compressed(q: dict) -> None:
    """ValueError (one line) for a compressed-tensors config whose tensors are not stored as shoal
    reads them: a quantization format it has no reader for, weights compressed for sparsity (a
    2:4 bitmask: `sparsity_config.format` other than dense) or rotated by a transform
    (`transform_config`, SpinQuant / QuIP: the model would need the rotations applied as it runs)."""
    unread = sorted(str(f) for f in compressed_formats(q) - set(READ_COMPRESSED) - {None})
    if unread:
        raise ValueError(f"compressed-tensors format {', '.join(unread)} is not supported; shoal reads "
                         f"{', '.join(READ_COMPRESSED)}")
    sparsity = q.get("sparsity_config") or {}
    if not isinstance(sparsity, dict) or sparsity.get("format", "dense") != "dense":
        fmt = sparsity.get("format") if isinstance(sparsity, dict) else sparsity
        raise ValueError(f"compressed-tensors checkpoint with sparsity_config format {fmt!r}: shoal reads dense "
                         "weights only (not sparse-compressed ones)")
    if q.get("transform_config"):
        raise ValueError("compressed-tensors checkpoint with a transform_config (SpinQuant / QuIP rotations): "
                         "shoal does not apply transforms, so its weights would compute nonsense")


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
    if method == "modelopt" and modelopt_algo(q) not in MODELOPT_ALGOS:
        raise ValueError(f"ModelOpt {q.get('quant_algo')} checkpoints are not supported; shoal reads ModelOpt's "
                         f"{', '.join(MODELOPT_ALGOS)}")
    if method == "compressed-tensors":
        check_compressed(q)
    if method in ("fp8", "compressed-tensors"):
        fp8_block(q)
    if (method == "modelopt" and modelopt_algo(q) in NVFP4_ALGOS) or \
            (method == "compressed-tensors" and NVFP4_FORMAT in compressed_formats(q)):
        check_nvfp4(q)
    if asked in CHECKPOINT_FORMATS and method != CHECKPOINT_FORMATS[asked]:
        found = f"quantization_config says quant_method {method!r}" if method else "is not quantized"
        raise ValueError(f"--quantization {asked} is for {CHECKPOINT_FORMATS[asked]} checkpoints; this one {found}")
    if asked == "modelopt_fp4" and modelopt_algo(q) not in NVFP4_ALGOS:  # (vLLM's name for ModelOpt's NVFP4)
        raise ValueError(f"--quantization modelopt_fp4 is for ModelOpt NVFP4 checkpoints; this one's quant_algo is "
                         f"{q.get('quant_algo', 'FP8')!r}")
