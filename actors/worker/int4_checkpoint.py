"""GPTQ, AWQ and compressed-tensors `pack-quantized` checkpoints (int4, or int8 where the format
allows it), read as float: each packed weight is dequantised as it loads, like FP8 checkpoints
(actors/worker/fp8_checkpoint.py), so the model holds its compute dtype and every family,
tp / pp sharding and --quantization int8 on top work as with a float checkpoint.

A linear layer's weight W [N, K] (N outputs, K inputs) is w = (q - z) * s, q an unsigned
`bits`-bit code, z and s the zero point and scale of the input column's group (groups of
`group_size` input columns; -1: one group, per output channel). Eight 4-bit codes (four 8-bit)
are packed in an int32, the first in the lowest bits. The layouts, as their writers write them:

- GPTQ (AutoGPTQ / GPTQModel / optimum, `quant_method: "gptq"`): `qweight` int32 [K / 8, N]
  packed along the input dim; `qzeros` int32 [G, N / 8] packed along the output dim; `scales`
  fp16 [G, N]; `g_idx` int32 [K], each input column's group (act-order, `desc_act`, makes it a
  permutation's, not k // group_size). The v1 format (`checkpoint_format` "gptq", the default)
  stores z - 1 (the code is masked to `bits` first, so a stored 0xF means 16), "gptq_v2" stores z.
- AWQ GEMM (AutoAWQ, `quant_method: "awq"`, `version: "gemm"`): `qweight` int32 [K, N / 8] and
  `qzeros` int32 [G, N / 8], both packed along the output dim in AWQ's order: the i-th nibble
  holds column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]; `scales` fp16 [G, N]; no g_idx.
- compressed-tensors `pack-quantized` (LLM Compressor's W4A16 / W8A16): `weight_packed` int32
  [N, K / 8] packed along the input dim; codes offset by 2 ** (bits - 1) (q - 8 is the signed
  value); `weight_scale` [N, G]; `weight_zero_point` (asymmetric only) int32 [N / 8, G] packed
  along the output dim the same way (older writers: int8 [N, G] unpacked); `weight_shape`
  [N, K]; `weight_g_idx` [K] with act-order.

Modules left in float (lm_head, `modules_to_not_convert`, compressed-tensors' `ignore`) are
found by their tensors: only a module with a packed weight is dequantised.

With SHOAL_INT4_KERNEL=1 (`keeps_packed`) the linear layers keep the weights packed instead:
`to_kernel_layout` brings each format to kernels/int4_linear.py's layout (GPTQ's), a
`PackedWeight` is sliced by the loader's rules as a float weight would be, and `join` puts a
fused layer's pieces (q/k/v, gate/up) side by side (actors/worker/loader.py _keep_packed).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from actors.worker.quantization_config import compressed_formats, settings

log = logging.getLogger("shoal.loader")

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed AWQ word holds column 8c + AWQ_ORDER[i]
AWQ_COLUMNS = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + j sits in nibble AWQ_COLUMNS[j]

# Each format's tensors of one module: the packed weight first, then what dequantises it.
PARTS = {"gptq": (".qweight", ".qzeros", ".scales", ".g_idx"),
         "awq": (".qweight", ".qzeros", ".scales"),
         "compressed-tensors": (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape",
                                ".weight_g_idx")}


@dataclass(frozen=True)
class Int4Format:
    method: str  # gptq | awq | compressed-tensors
    bits: int
    group_size: int  # -1: one group over the whole input dim (per output channel)
    sym: bool
    zero_offset: int = 0  # GPTQ v1 stores z - 1

    @property
    def parts(self) -> tuple[str, ...]:
        return PARTS[self.method]

    def weight_of(self, name: str) -> str | None:
        """The float weight a packed tensor stands for (`X.qweight` -> `X.weight`), else None."""
        packed = self.parts[0]
        return name.removesuffix(packed) + ".weight" if name.endswith(packed) else None

    def is_part(self, name: str) -> bool:
        return name.endswith(self.parts)

    def weight_shape(self, packed_shape: tuple) -> tuple[int, int]:
        """The float weight's [N, K] from its packed weight's shape (what LoRA adapters are
        checked against)."""
        per = 32 // self.bits
        if self.method == "gptq":
            return packed_shape[1], packed_shape[0] * per
        if self.method == "awq":
            return packed_shape[1] * per, packed_shape[0]
        return packed_shape[0], packed_shape[1] * per


def read_format(config: dict) -> Int4Format | None:
    """The checkpoint's packed-integer format from config.json's `quantization_config`, None
    when it has none of these; ValueError (one line) for one it can't read."""
    q = settings(config)
    method = q.get("quant_method")
    if method == "gptq":
        return _gptq(q)
    if method == "awq":
        return _awq(q)
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    return None


def _bits(method: str, bits, allowed: tuple[int, ...]) -> int:
    if bits not in allowed:
        raise ValueError(f"{method} checkpoint with bits {bits!r}: shoal reads "
                         f"{' and '.join(map(str, allowed))}-bit {method} weights only")
    return bits


def _group(method: str, group) -> int:
    if not isinstance(group, int) or not (group == -1 or group > 0):
        raise ValueError(f"{method} checkpoint with group_size {group!r}: expected a positive size or -1")
    return group


def _gptq(q: dict) -> Int4Format:
    bits = _bits("GPTQ", q.get("bits"), (4, 8))
    checkpoint_format = q.get("checkpoint_format") or ("marlin" if q.get("is_marlin_format") else "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r}: shoal reads gptq and gptq_v2")
    if q.get("pack_dtype", "int32") != "int32":  # (GPTQModel's words: int32 is what every reader packs)
        raise ValueError(f"GPTQ checkpoint with pack_dtype {q.get('pack_dtype')!r}: shoal reads codes packed in int32")
    fmt = Int4Format("gptq", bits, _group("GPTQ", q.get("group_size", 128)), bool(q.get("sym", True)),
                     zero_offset=1 if checkpoint_format == "gptq" else 0)
    _check_dynamic(q.get("dynamic"), fmt)
    return fmt


def _check_dynamic(dynamic, fmt: Int4Format) -> None:
    """GPTQModel's per-module overrides ({"-:regex": {}} leaves a module float, found by its
    tensors; "+:regex" or a bare regex overrides settings): ValueError (one line) for an override
    of bits, group size or sym, which shoal's one format for every packed module cannot follow."""
    for pattern, override in (dynamic or {}).items():
        if str(pattern).startswith("-:") or not isinstance(override, dict):
            continue
        theirs = (override.get("bits", fmt.bits), override.get("group_size", fmt.group_size),
                  bool(override.get("sym", fmt.sym)))
        if theirs != (fmt.bits, fmt.group_size, fmt.sym):
            raise ValueError(f"GPTQ checkpoint whose `dynamic` gives {pattern!r} bits/group_size/sym {theirs}: shoal "
                             f"reads one setting ({fmt.bits}, {fmt.group_size}, {fmt.sym}) for every packed module")


def _awq(q: dict) -> Int4Format:
    bits = _bits("AWQ", q.get("bits", q.get("w_bit")), (4,))
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r}: shoal reads the GEMM layout only")
    if not q.get("zero_point", True):
        raise ValueError("AWQ checkpoint with zero_point false: shoal reads AWQ's zero-point GEMM layout only")
    return Int4Format("awq", bits, _group("AWQ", q.get("group_size", q.get("q_group_size", 128))), sym=False)


# The weights' fields that decide how packed codes read (observer and the like do not)
PACKED_FIELDS = ("num_bits", "type", "strategy", "group_size", "symmetric")


def _compressed_tensors(q: dict) -> Int4Format | None:
    groups = list((q.get("config_groups") or {}).values())
    formats = compressed_formats(q)
    if "pack-quantized" not in formats:
        return None  # float-quantized is FP8 (fp8_checkpoint.py)
    if formats != {"pack-quantized"}:
        raise ValueError(f"compressed-tensors checkpoint mixing pack-quantized with {sorted(map(str, formats))} "
                         "layers: shoal reads one scheme for every quantized layer")
    schemes = {tuple(repr((g.get("weights") or {}).get(f)) for f in PACKED_FIELDS) for g in groups}
    if len(schemes) != 1:
        raise ValueError("compressed-tensors pack-quantized checkpoint with several weight schemes: "
                         "shoal reads one scheme for every quantized layer")
    weights = groups[0].get("weights") or {}
    bits = _bits("compressed-tensors pack-quantized", weights.get("num_bits"), (4, 8))
    if weights.get("type", "int") != "int":
        raise ValueError(f"compressed-tensors pack-quantized weights of type {weights.get('type')!r}: expected int")
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise ValueError(f"compressed-tensors pack-quantized strategy {strategy!r}: shoal reads group and channel")
    group = _group("compressed-tensors", weights.get("group_size")) if strategy == "group" else -1
    return Int4Format("compressed-tensors", bits, group, bool(weights.get("symmetric", True)))


def check_parts(fmt: Int4Format, module: str, shapes: dict[str, tuple]) -> None:
    """ValueError (one line, naming the module) unless one module's tensors ({suffix: shape})
    are what config.json's bits and group size make of one weight [N, K]: a wrong setting would
    otherwise read the codes or the groups' scales wrongly, or only some of them, and load a
    model that runs and talks nonsense."""
    per = 32 // fmt.bits
    packed = shapes[fmt.parts[0]]
    if fmt.method == "compressed-tensors":  # (K rounded up to whole words: weight_shape has the exact one)
        n, k = packed[0], packed[1] * per
        scales = shapes.get(".weight_scale", ())
        groups = scales[1] if len(scales) == 2 else 1
        g_idx = shapes.get(".weight_g_idx")
    elif fmt.method == "gptq":
        k, n = packed[0] * per, packed[1]
        scales = shapes.get(".scales", ())
        groups = scales[0] if len(scales) == 2 else 0
        g_idx = shapes.get(".g_idx")
    else:  # awq
        k, n = packed[0], packed[1] * per
        scales = shapes.get(".scales", ())
        groups = scales[0] if len(scales) == 2 else 0
        g_idx = None
    name = f"{module}{fmt.parts[0]}"
    columns = scales[0] if fmt.method == "compressed-tensors" else scales[1] if len(scales) == 2 else None
    if not scales or columns != n:
        raise ValueError(f"{name} {tuple(packed)} holds {n} output columns of {fmt.bits}-bit codes (config.json's "
                         f"bits), but its scales are {tuple(scales)}")
    if g_idx is not None:  # act-order: any group count, each column's group read from g_idx
        if tuple(g_idx) not in ((k,), (-(-k // per) * per,)):
            raise ValueError(f"{name} {tuple(packed)} holds {k} input columns of {fmt.bits}-bit codes, but its "
                             f"g_idx has {tuple(g_idx)}")
        return
    want = 1 if fmt.group_size == -1 else -(-k // fmt.group_size)
    if groups != want:
        raise ValueError(f"{name} {tuple(packed)} holds {k} input columns of {fmt.bits}-bit codes, in {want} "
                         f"group(s) of {fmt.group_size} (config.json's group_size), but its scales have {groups}")


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The codes (int32, 0 .. 2 ** bits - 1) of int32 words packed along `dim` (0 or 1), the
    first code of each word in its lowest bits."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32)
    if dim == 0:
        codes = (words[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
        return codes.reshape(words.shape[0] * per, words.shape[1])
    codes = (words[:, :, None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(words.shape[0], words.shape[1] * per)


def _groups(k: int, group_size: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    """Each input column's group: g_idx where the checkpoint has one (act-order), else k // size."""
    if g_idx is not None:
        return g_idx.long()
    return torch.arange(k) // (k if group_size == -1 else group_size)


def dequantize(fmt: Int4Format, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weight [N, K] of one module from its tensors ({suffix: tensor}, the
    packed weight's suffix required, the others where the checkpoint has them)."""
    if fmt.method == "gptq":
        return _dequantize_gptq(fmt, parts)
    if fmt.method == "awq":
        return _dequantize_awq(fmt, parts)
    return _dequantize_compressed(fmt, parts)


def _dequantize_gptq(fmt: Int4Format, parts: dict) -> torch.Tensor:
    q = unpack(parts[".qweight"], fmt.bits, 0)  # [K, N]
    k, n = q.shape
    scales = parts[".scales"].float()
    if ".qzeros" in parts:
        zeros = unpack(parts[".qzeros"], fmt.bits, 1)[:, :n] + fmt.zero_offset  # [G, N]
    else:  # a symmetric checkpoint written without zeros: the midpoint
        zeros = torch.full_like(scales, 1 << (fmt.bits - 1), dtype=torch.int32)
    g = _groups(k, fmt.group_size, parts.get(".g_idx"))
    return ((q - zeros[g]).float() * scales[g]).t()


def awq_codes(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's words [R, C / 8] -> the codes [R, C] in column order."""
    codes = unpack(packed, 4, 1)
    return codes.view(codes.shape[0], -1, 8)[:, :, list(AWQ_COLUMNS)].reshape(codes.shape[0], -1)


def _dequantize_awq(fmt: Int4Format, parts: dict) -> torch.Tensor:
    q, zeros = awq_codes(parts[".qweight"]), awq_codes(parts[".qzeros"])  # [K, N], [G, N]
    g = _groups(q.shape[0], fmt.group_size, None)
    return ((q - zeros[g]).float() * parts[".scales"].float()[g]).t()


def _dequantize_compressed(fmt: Int4Format, parts: dict) -> torch.Tensor:
    offset = 1 << (fmt.bits - 1)
    packed = parts[".weight_packed"]
    if ".weight_shape" in parts:
        n, k = (int(d) for d in parts[".weight_shape"].tolist())
    else:
        n, k = packed.shape[0], packed.shape[1] * (32 // fmt.bits)
    q = unpack(packed, fmt.bits, 1)[:, :k] - offset  # [N, K], signed
    scale = parts[".weight_scale"].float().reshape(n, -1)  # [N, G]
    zero = parts.get(".weight_zero_point")
    if zero is None or fmt.sym:
        zero = torch.zeros(scale.shape, dtype=torch.int32)
    elif zero.dtype == torch.int32:  # packed along the output dim
        zero = unpack(zero, fmt.bits, 0)[:n] - offset
    g = _groups(k, fmt.group_size, parts.get(".weight_g_idx"))
    return (q - zero.to(torch.int32).reshape(n, -1)[:, g]).float() * scale[:, g]


def pack(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """`unpack`'s inverse: codes [R, C] packed 32 // bits to an int32 along `dim`."""
    per = 32 // bits
    codes = codes.to(torch.int64) if dim == 1 else codes.to(torch.int64).t()
    words = (codes.reshape(codes.shape[0], -1, per) << torch.arange(0, 32, bits)).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return (words if dim == 1 else words.t()).contiguous()


def to_kernel_layout(fmt: Int4Format, parts: dict[str, torch.Tensor]) -> dict:
    """One module's tensors in kernels/int4_linear.py's layout (GPTQ's): qweight [K / per, N],
    qzeros [G, N / per], scales [G, N], g_idx [K], bits and zero_offset, the same weight."""
    if fmt.method == "gptq":
        k, n = parts[".qweight"].shape[0] * (32 // fmt.bits), parts[".qweight"].shape[1]
        scales = parts[".scales"]
        if ".qzeros" in parts:
            qzeros, offset = parts[".qzeros"], fmt.zero_offset
        else:
            qzeros, offset = pack(torch.full(scales.shape, 1 << (fmt.bits - 1)), fmt.bits, 1), 0
        g_idx = _groups(k, fmt.group_size, parts.get(".g_idx"))
        return dict(qweight=parts[".qweight"], qzeros=qzeros, scales=scales, g_idx=g_idx.to(torch.int32),
                    bits=fmt.bits, zero_offset=offset)
    if fmt.method == "awq":
        q = awq_codes(parts[".qweight"])  # [K, N]
        return dict(qweight=pack(q, fmt.bits, 0), qzeros=pack(awq_codes(parts[".qzeros"]), fmt.bits, 1),
                    scales=parts[".scales"], g_idx=_groups(q.shape[0], fmt.group_size, None).to(torch.int32),
                    bits=fmt.bits, zero_offset=0)
    offset = 1 << (fmt.bits - 1)
    packed = parts[".weight_packed"]
    n, k = (int(d) for d in parts[".weight_shape"].tolist()) if ".weight_shape" in parts else \
        (packed.shape[0], packed.shape[1] * (32 // fmt.bits))
    if (32 // fmt.bits) * packed.shape[1] != k:
        raise ValueError(f"compressed-tensors weight of {k} input columns is not a whole number of words")
    scale = parts[".weight_scale"].reshape(n, -1)
    zero = parts.get(".weight_zero_point")
    if zero is None or fmt.sym:
        zero = torch.full(scale.shape, offset, dtype=torch.int32)  # code 8 is the value 0
    elif zero.dtype == torch.int32:
        zero = unpack(zero, fmt.bits, 0)[:n]
    else:
        zero = zero.to(torch.int32).reshape(n, -1) + offset
    return dict(qweight=packed.t().contiguous(), qzeros=pack(zero.t(), fmt.bits, 1), scales=scale.t().contiguous(),
                g_idx=_groups(k, fmt.group_size, parts.get(".weight_g_idx")).to(torch.int32),
                bits=fmt.bits, zero_offset=0)


class PackedWeight:
    """A packed module's weight [N, K] in kernels/int4_linear.py's layout, sliced the way the
    loader's rules slice a float weight: `t[a:b]` (output rows) and `t[:, a:b]` (input columns)
    give the packed parts of that slice where it falls on whole int32 words, else the float
    slice (`dequantized`)."""

    def __init__(self, layout: dict):
        self.layout = layout

    @property
    def shape(self) -> tuple[int, int]:
        return self.layout["qweight"].shape[1], self.layout["g_idx"].numel()

    def dequantized(self) -> torch.Tensor:
        from kernels.int4_linear import dequantize as dequantize_layout
        return dequantize_layout(**self.layout)

    def __getitem__(self, key):
        rows, cols = key if isinstance(key, tuple) else (key, slice(None))
        n, k = self.shape
        r0, r1, _ = rows.indices(n)
        c0, c1, _ = cols.indices(k)
        per = 32 // self.layout["bits"]
        if any(i % per for i in (r0, r1, c0, c1)):  # not on word boundaries: float
            return self.dequantized()[r0:r1, c0:c1]
        t = self.layout
        return PackedWeight({**t, "qweight": t["qweight"][c0 // per:c1 // per, r0:r1],
                             "qzeros": t["qzeros"][:, r0 // per:r1 // per], "scales": t["scales"][:, r0:r1],
                             "g_idx": t["g_idx"][c0:c1]})


def join(pieces: list[tuple[int, PackedWeight]], rows: int, columns: int) -> dict | None:
    """One layout from the pieces (row offset, packed slice) the loader put into a fused
    parameter of [rows, columns], side by side along the output dim; None when they can't be
    one (gaps, another width, different bits or g_idx: act-order's differ between modules that
    do not share an input)."""
    pieces = sorted(pieces, key=lambda p: p[0])
    first = pieces[0][1].layout
    at = 0
    for offset, piece in pieces:
        t = piece.layout
        if offset != at or piece.shape[1] != columns or t["bits"] != first["bits"] or \
                t["zero_offset"] != first["zero_offset"] or t["scales"].shape[0] != first["scales"].shape[0] or \
                not torch.equal(t["g_idx"], first["g_idx"]):
            return None
        at += piece.shape[0]
    if at != rows:
        return None
    layouts = [p.layout for _, p in pieces]
    return {"qweight": torch.cat([t["qweight"] for t in layouts], 1), "qzeros": torch.cat([t["qzeros"] for t in layouts], 1),
            "scales": torch.cat([t["scales"] for t in layouts], 1), "g_idx": first["g_idx"],
            "bits": first["bits"], "zero_offset": first["zero_offset"]}


def keeps_packed(device: torch.device) -> bool:
    """Whether packed weights stay packed on `device` (multiplied by kernels/int4_linear.py):
    SHOAL_INT4_KERNEL=1 asks for it (off by default: the kernel has not run on a GPU yet); it
    runs on CUDA, and on CPU only through Triton's interpreter (the tests)."""
    from kernels import triton_programs
    from kernels.env import flag

    if not flag("SHOAL_INT4_KERNEL", False):
        return False
    if triton_programs.available() and (device.type == "cuda" or triton_programs.interpreted()):
        return True
    _warn_once(f"SHOAL_INT4_KERNEL=1: the int4 kernel runs on CUDA (or under Triton's interpreter), so on {device.type} "
               "the packed weights are dequantised as they load")
    return False


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)
