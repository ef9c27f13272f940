"""Load a checkpoint's weights into the model (finding it and reading its config and tokenizer:
actors/worker/checkpoint_files.py)."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from actors.models import model_class
from actors.models.args import ModelArgs
from actors.models.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from actors.models.llama import rope_tables
from actors.worker import (fp8_checkpoint, int4_checkpoint, int8_checkpoint, mxfp4_checkpoint, nvfp4_checkpoint,
                           quantization_config)
from actors.worker.checkpoint_files import read_config
from actors.worker.progress import progress_bar
from actors.worker.weight_files import open_weights, weight_files
from kernels.quantization import quantize_module

log = logging.getLogger("shoal.loader")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, cfg: dict) -> torch.dtype:
    if dtype == "auto":
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def check_quantization(cfg: dict, asked: str | None = None) -> None:
    """ValueError (one line) for a quantized checkpoint shoal cannot read (quantization_config.py),
    or one whose GPTQ / AWQ / int8 settings it cannot run, before any weight is loaded."""
    quantization_config.check(cfg, asked)
    int4_checkpoint.read_format(cfg)
    int8_checkpoint.scheme(cfg)


def build_model(path: Path, cfg: dict, dtype: torch.dtype, device: torch.device,
                max_positions: int, parallel=None, weight_dtype: torch.dtype | None = None,
                read_weights: bool = True, quantization: str | None = None,
                checkpoint_layers_only: bool = False) -> nn.Module:
    """This rank's shard of the model, with only its slices of the weights read from disk.

    weight_dtype: round every weight to it on the way in (a 16-bit model computed in float32).
    read_weights=False leaves them unread (the decode compile job traces shapes only).
    quantization: "int8", "fp8" or "w8a8_int8" turns the linear layers' weights to 8 bits once read
    (kernels/quantization.py); checkpoint_layers_only: only the layers an int8 checkpoint holds
    in int8 (actors/worker/int8_checkpoint.py), not the head, the embedding or its `ignore`s."""
    args = ModelArgs.from_hf(cfg)
    cls = model_class(args.architecture)
    # Built on the meta device in the target dtype, then given memory on the target device
    # once: each weight is read from disk straight into its place (no float32 copy first).
    with torch.device("meta"):
        model = cls(args, max_positions, parallel)
    # to_empty's empty_like on meta tensors runs torch's Python reference, which imports sympy
    # (a second of start-up): torch.empty of each shape does the same in C++. Weights that will
    # stay packed (SHOAL_INT4_KERNEL) stay on the meta device: no float copy of them is made.
    model = model.to(dtype)
    kept = packed_targets(model, path, cfg, device) if read_weights else set()
    kept = {id(p) for name, p in model.named_parameters() if name in kept}
    model = model._apply(lambda t: t if id(t) in kept else torch.empty(t.shape, dtype=t.dtype, device=device))
    model.tie_weights()  # each module got a tensor of its own above: tie again
    # Rotary tables are not weights: compute them for real after leaving the meta device.
    for name, (cos, sin) in rope_tables(args, max_positions).items():
        setattr(model, f"{name}_cos", cos.to(device, dtype))
        setattr(model, f"{name}_sin", sin.to(device, dtype))
    model.weight_dtype = weight_dtype  # experts re-read later (load_selected) are rounded alike
    quantizer = LayerQuantizer(model, quantization, int8_targets(model, path) if checkpoint_layers_only else None) \
        if quantization else None
    if read_weights:
        load_weights(model, path, weight_dtype, quantizer)
        load_kv_scales(model, path)
    if quantizer:
        quantizer.finish()
    return model.eval()


class LayerQuantizer:
    """Turns every linear layer to `kind` (int8, fp8 or w8a8_int8), and for the int8 formats the
    LM head and the embedding too (a tied head and embedding share one copy; w8a8_int8's head
    multiplies int8 activations as its other layers do); fp8 leaves those two float, as vLLM's
    does. Experts of MoE models stay float. only: the weights (parameter names) to quantize,
    None: all of those. An int8 checkpoint's layers keep its codes (`checkpoint_scale`).

    The loader hands it each weight once all its rows are read (`loaded`), so the float model
    is never whole in memory: a 0.5B float32 checkpoint quantized to w8a8_int8 peaked at twice
    its float weights before (docs/benchmarks.md). `finish` takes the rest."""

    def __init__(self, model: nn.Module, kind: str, only: set[str] | None = None):
        head = kind in ("int8", "w8a8_int8")
        layers = (ColumnParallelLinear, RowParallelLinear) + ((ParallelLMHead, VocabParallelEmbedding) if head else ())
        self.kind = kind
        self.modules: dict[int, list[nn.Module]] = {}  # a float weight's id -> the layers that share it
        for name, module in model.named_modules():
            if only is not None and f"{name}.weight" not in only:
                continue
            if isinstance(module, layers) and not module.weight.is_meta:  # (meta: kept packed as int4)
                self.modules.setdefault(id(module.weight), []).append(module)

    def takes(self, weight: torch.Tensor) -> bool:
        return id(weight) in self.modules

    def loaded(self, weight: torch.Tensor) -> bool:
        """`weight` is read whole: quantize its layers now. False: it is not one to quantize."""
        modules = self.modules.pop(id(weight), None)
        if modules is None:
            return False
        first, *tied = modules
        quantize_module(first, self.kind)
        for module in tied:
            module.out_dtype = module.weight.dtype
            module.weight, module.weight_scale = first.weight, first.weight_scale
        return True

    def finish(self) -> None:
        for modules in list(self.modules.values()):
            self.loaded(modules[0].weight)


def checkpoint_shapes(path: Path) -> dict[str, tuple]:
    """Every weight's shape (from the files' headers): what adapters are checked against. A
    packed int4 weight counts as the float weight it stands for."""
    shapes = {}
    config = read_config(path)
    int4, nvfp4 = int4_checkpoint.read_format(config), nvfp4_checkpoint.read_layout(config)
    names = _tensor_files(weight_files(path)) if nvfp4 else {}
    for file in weight_files(path):
        with open_weights(file) as f:
            for name in f.keys():
                shape = tuple(f.get_slice(name).get_shape())
                if int4 and int4.is_part(name):  # a packed weight: the float one it stands for
                    if not int4.weight_of(name):
                        continue
                    name, shape = int4.weight_of(name), int4.weight_shape(shape)
                elif nvfp4 and nvfp4.module_of(name, names):  # two e2m1 codes a byte
                    if not nvfp4.weight_of(name, names):
                        continue
                    name, shape = nvfp4.weight_of(name, names), (shape[0], shape[1] * 2)
                shapes[name] = shape
    return shapes


def packed_targets(model: nn.Module, path: Path, cfg: dict, device: torch.device) -> set[str]:
    """The linear layers' weights that a packed checkpoint's weights go to whole, where they
    stay packed on `device` (int4_checkpoint.keeps_packed): built on the meta device, they get
    memory only if they end up float after all (_keep_packed)."""
    fmt = int4_checkpoint.read_format(cfg)
    if fmt is None or not int4_checkpoint.keeps_packed(device):
        return set()
    modules = dict(model.named_modules())
    targets = set()
    for file in weight_files(path):
        with open_weights(file) as f:
            weights = [fmt.weight_of(name) for name in f.keys()]
        for rule in (r for weight in weights if weight for r in _rules(model.weight_rule(weight))):
            target, dim = rule[0], rule[2]
            owner = modules.get(target.rpartition(".")[0])
            if len(rule) == 5 and not callable(dim) and isinstance(owner, (ColumnParallelLinear, RowParallelLinear)):
                targets.add(target)
    return targets


def int8_targets(model: nn.Module, path: Path) -> set[str]:
    """The linear layers' weights an int8 checkpoint's int8 tensors go to (read from the files'
    headers, so the decode compile job, which reads no weights, quantizes the same layers)."""
    modules = dict(model.named_modules())
    targets = set()
    for file in weight_files(path):
        with open_weights(file) as f:
            names = [n for n in f.keys() if n.endswith(".weight") and f.get_slice(n).get_dtype() == "I8"]
        for rule in (r for name in names for r in _rules(model.weight_rule(name))):
            owner = modules.get(rule[0].rpartition(".")[0])
            if isinstance(owner, (ColumnParallelLinear, RowParallelLinear)):
                targets.add(rule[0])
    return targets


def load_weights(model: nn.Module, path: Path, weight_dtype: torch.dtype | None = None,
                 quantizer: LayerQuantizer | None = None) -> None:
    """quantizer: given each weight as soon as all its rows are read."""
    params = dict(model.named_parameters())
    # Rows no checkpoint tensor fills (vocab padding under tensor parallelism) must be zero. A
    # weight to quantize is zeroed where unread at the end instead: zeroing it first would
    # bring the whole float model into memory at once.
    for param in params.values():
        if not (quantizer and quantizer.takes(param)):
            param.data.zero_()
    loaded: set[str] = set()
    rows_read: dict[str, list] = {}  # param -> the (first row, rows) copied so far
    quantized: set[str] = set()  # params whose float copy is gone (a later duplicate is skipped)
    files = weight_files(path)
    device = next((p.device for p in params.values() if not p.is_meta), torch.device("cpu"))
    # param -> [(row offset, PackedWeight or float slice)]: what is put together at the end
    packed = {} if int4_checkpoint.keeps_packed(device) else None
    scales = {}  # param -> [(row offset, the rows' int8 checkpoint scales)]
    # By tensor, not by file: a single-file checkpoint shows progress too.
    bar = progress_bar("loading weights", total=count_tensors(files), unit="tensor")
    try:
        for name, tensor_slice in checkpoint_tensors(path, files, packed=packed is not None):
            for rule in _rules(model.weight_rule(name)) if tensor_slice is not None else ():
                if rule[0] in quantized:
                    continue
                target = _load_slice(params, rule, tensor_slice, name, weight_dtype, packed, scales, rows_read)
                loaded.add(target)
                if quantizer and sum(n for _, n in rows_read.get(target, ())) == params[target].shape[0]:
                    if target in scales:  # an int8 checkpoint's rows: their scales first
                        _keep_row_scales(model, params, {target: scales.pop(target)})
                    if quantizer.loaded(params[target]):
                        quantized.add(target)
                        params[target] = None  # the float copy goes now
            bar.update(1)
    finally:
        bar.close()
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {', '.join(sorted(missing)[:5])}")
    for target, param in params.items():
        if param is not None and quantizer and quantizer.takes(param):
            unread = torch.ones(param.shape[0], dtype=torch.bool)
            for first, n in rows_read.get(target, ()):
                unread[first:first + n] = False
            param.data[unread.to(param.device)] = 0
    if packed:
        _keep_packed(model, params, packed, weight_dtype, device)
    _keep_row_scales(model, params, scales)


def _keep_row_scales(model: nn.Module, params: dict, scales: dict) -> None:
    """A linear layer whose every weight row came from an int8 checkpoint keeps those rows'
    scales as `checkpoint_scale` [rows], for its quantization to take the codes back exactly."""
    for target, pieces in scales.items():
        module_name, _, attr = target.rpartition(".")
        rows = params[target].shape[0]
        if attr != "weight" or sum(len(s) for _, s in pieces) != rows:
            continue
        scale = torch.empty(rows)
        for offset, s in pieces:
            scale[offset:offset + len(s)] = s
        model.get_submodule(module_name).checkpoint_scale = scale


def _keep_packed(model: nn.Module, params: dict, packed: dict, weight_dtype: torch.dtype | None,
                 device: torch.device) -> None:
    """Each linear layer whose weight came whole from packed pieces keeps them, in one layout
    (`module.int4`, kernels/int4_linear.py), and holds no float weight; any other target of a
    piece gets memory if it has none and the pieces dequantised (act-order g_idx that differ
    inside a fused layer, a slice off the packed words, say)."""
    for target, pieces in packed.items():
        param = params[target]
        module_name, _, attr = target.rpartition(".")
        module = model.get_submodule(module_name)
        layout = None
        if all(isinstance(p, int4_checkpoint.PackedWeight) for _, p in pieces) and \
                isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and attr == "weight":
            layout = int4_checkpoint.join(pieces, *param.shape)
        if layout is not None:
            module.int4 = {key: v.to(device).contiguous() if isinstance(v, torch.Tensor) else v
                           for key, v in layout.items()}
            module.weight = nn.Parameter(torch.empty(0, dtype=param.dtype, device=device), requires_grad=False)
            continue
        if param.is_meta:
            param = nn.Parameter(torch.zeros(param.shape, dtype=param.dtype, device=device), requires_grad=False)
            setattr(module, attr, param)
        for offset, piece in pieces:
            src = piece.dequantized() if isinstance(piece, int4_checkpoint.PackedWeight) else piece
            _copy_rows(param, offset, src, weight_dtype)


def checkpoint_kv_scales(path: Path) -> dict[int, dict[str, float]]:
    """The checkpoint's KV cache scales by layer (fp8_checkpoint.kv_scales; {} without any)."""
    found = {}
    for file in weight_files(path):
        with open_weights(file) as f:
            names = [n for n in f.keys() if n.endswith("_scale")]
            found.update(fp8_checkpoint.kv_scales((n, lambda n=n: f.get_tensor(n)) for n in names))
    return found


def load_kv_scales(model: nn.Module, path: Path) -> None:
    """This rank's layers' KV cache scales from the checkpoint: the attention layers' k_scale /
    v_scale (1.0 where the checkpoint has none), which an fp8 KV pool reads with; a float pool
    ignores them. (Also called by the decode compile job, which reads no weights.)"""
    found = checkpoint_kv_scales(path)
    first = getattr(model, "first_layer", 0)
    for i, layer in enumerate(model.model.layers):
        scales = found.get(first + i, {})
        attn = layer.self_attn
        attn.k_scale, attn.v_scale = scales.get("k", 1.0), scales.get("v", 1.0)


def checkpoint_tensors(path: Path, files: list[Path], packed: bool = False):
    """(name, its lazily sliced tensor) for every tensor of the checkpoint, file by file; a
    float8 weight comes dequantised with its scale (actors/worker/fp8_checkpoint.py), an MXFP4
    one (`W_blocks`) as W, dequantised expert by expert as it is sliced
    (actors/worker/mxfp4_checkpoint.py), a GPTQ / AWQ / compressed-tensors packed one (`X.qweight`,
    `X.weight_packed`) as the float `X.weight` (actors/worker/int4_checkpoint.py), an NVFP4 one
    likewise, dequantised when sliced (actors/worker/nvfp4_checkpoint.py), and the
    scales, zero points and group indices themselves come as (name, None). packed: a packed
    weight comes as an int4_checkpoint.PackedWeight instead (kept packed on the GPU)."""
    where = _tensor_files(files)
    config = read_config(path)
    block, mxfp4 = fp8_checkpoint.block_size(config), mxfp4_checkpoint.is_mxfp4(config)
    int4, int8 = int4_checkpoint.read_format(config), int8_checkpoint.scheme(config)
    nvfp4 = nvfp4_checkpoint.read_layout(config)
    for file in files:
        with open_weights(file) as f:
            for name in f.keys():
                tensor_slice = f.get_slice(name)
                if int8 and int8_checkpoint.is_part(name):
                    tensor_slice = None
                elif int8 and tensor_slice.get_dtype() == "I8" and name.endswith(".weight"):
                    tensor_slice = int8_checkpoint.Int8Weight(lambda n=name: _tensor(n, where),
                                                              lambda n=name: _tensor(n + "_scale", where))
                elif int4 and int4.is_part(name):
                    weight = int4.weight_of(name)
                    tensor_slice = None if weight is None else _Int4Weight(int4, weight, where, packed)
                    name = weight or name
                elif mxfp4 and name.endswith(mxfp4_checkpoint.SCALES):
                    tensor_slice = None
                elif mxfp4 and name.endswith(mxfp4_checkpoint.BLOCKS):
                    name = name.removesuffix(mxfp4_checkpoint.BLOCKS)
                    scales = _tensor(name + mxfp4_checkpoint.SCALES, where)
                    tensor_slice = mxfp4_checkpoint.Dequantized(tensor_slice, scales)
                elif nvfp4 and nvfp4.module_of(name, where):  # (before FP8's: its group scales are float8)
                    weight = nvfp4.weight_of(name, where)
                    module = (weight or "").removesuffix(".weight")
                    tensor_slice = _Lazy(lambda m=module: _nvfp4_weight(nvfp4, m, where)) if weight else None
                    name = weight or name
                elif tensor_slice.get_dtype() in fp8_checkpoint.FP8_DTYPES:
                    tensor_slice = fp8_checkpoint.dequantize(f.get_tensor(name), _scale_of(name, where), block, name)
                elif fp8_checkpoint.is_scale(name):
                    tensor_slice = None
                yield name, tensor_slice


def _tensor_files(files: list[Path]) -> dict[str, Path]:
    """Each tensor's file (read from the files' headers)."""
    where = {}
    for file in files:
        with open_weights(file) as f:
            where.update(dict.fromkeys(f.keys(), file))
    return where


def _nvfp4_weight(layout, module: str, where: dict) -> torch.Tensor:
    packed, scale, tensor_wide = (_tensor(module + part, where) for part in (layout.packed, ".weight_scale",
                                                                               layout.global_scale))
    return nvfp4_checkpoint.dequantize(layout, packed, scale, tensor_wide, repr(module + layout.packed))


class _Lazy:
    """A weight computed (read and dequantised) only when a rule slices it: a pipeline stage
    skips the other stages' layers unread."""

    def __init__(self, compute):
        self.compute, self.tensor = compute, None

    def __getitem__(self, key):
        if self.tensor is None:
            self.tensor = self.compute()
        return self.tensor[key]


def _tensor(name: str, where: dict) -> torch.Tensor:
    if name not in where:
        raise ValueError(f"the checkpoint lacks {name!r}")
    with open_weights(where[name]) as f:
        return f.get_tensor(name)


class _Int4Weight:
    """One packed module's weight, read (with its scales, zeros and g_idx) and dequantised to
    float32 only when a rule slices it: a pipeline stage skips the other stages' layers
    unread. packed: sliced as a PackedWeight in the kernel's layout instead."""

    def __init__(self, fmt, weight: str, where: dict, packed: bool):
        self.fmt, self.prefix, self.where, self.packed = fmt, weight.removesuffix(".weight"), where, packed
        self.tensor = None

    def read(self):
        if self.tensor is None:
            fmt, prefix = self.fmt, self.prefix
            parts = {part: _tensor(prefix + part, self.where) for part in fmt.parts if prefix + part in self.where}
            if len(parts) == 1:
                raise ValueError(f"the packed weight {prefix + fmt.parts[0]!r} has no scales in the checkpoint")
            int4_checkpoint.check_parts(fmt, prefix, {part: tuple(t.shape) for part, t in parts.items()})
            self.tensor = int4_checkpoint.PackedWeight(int4_checkpoint.to_kernel_layout(fmt, parts)) \
                if self.packed else int4_checkpoint.dequantize(fmt, parts)
        return self.tensor

    def __getitem__(self, key):
        return self.read()[key]


def _scale_of(name: str, where: dict) -> torch.Tensor:
    for scale in (f"{name}_scale_inv", f"{name}_scale"):
        if scale in where:
            with open_weights(where[scale]) as f:
                return f.get_tensor(scale)
    raise ValueError(f"the float8 weight {name!r} has no {name}_scale or {name}_scale_inv in the checkpoint")


def count_tensors(files: list[Path]) -> int:
    """Tensors in the checkpoint (reads only the files' headers)."""
    total = 0
    for file in files:
        with open_weights(file) as f:
            total += len(f.keys())
    return total


def load_selected(model: nn.Module, path: Path, rule) -> int:
    """Read only the tensors `rule(name)` maps (a weight_rule; None skips): e.g. the experts
    a re-planned placement moves onto this rank. Returns how many were read."""
    params = dict(model.named_parameters())
    read = 0
    for name, tensor_slice in checkpoint_tensors(path, weight_files(path)):
        targets = _rules(rule(name)) if tensor_slice is not None else []
        for target in targets:
            _load_slice(params, target, tensor_slice, name, getattr(model, "weight_dtype", None))
        read += bool(targets)
    return read


def _rules(rule) -> list:
    """A weight_rule's answer as a list: none, one, or one per part of a fused tensor."""
    return [] if rule is None else rule if isinstance(rule, list) else [rule]


def _load_slice(params: dict, rule, tensor_slice, name: str, weight_dtype: torch.dtype | None = None,
                packed: dict | None = None, scales: dict | None = None, rows_read: dict | None = None) -> str:
    """Copy this rank's slice of one checkpoint tensor into (a row range of) its parameter.

    An optional sixth rule field picks one expert slot of a stacked [slots, ...] parameter.
    `dim` may be a function of the lazily sliced tensor that returns the part this rank needs,
    already in the parameter's layout (gpt-oss's stacked, transposed experts).
    """
    target, offset, dim, start, size, *slot = rule
    if target not in params:
        packed_part = any(name.endswith(parts) for parts in int4_checkpoint.PARTS.values())
        raise ValueError(f"unexpected weight {name!r} in checkpoint" + (
            ": a quantized checkpoint's tensor (GPTQ, AWQ, compressed-tensors), but config.json names no "
            "quantization_config"
            if packed_part else ""))
    if isinstance(tensor_slice, _Int4Weight):
        tensor_slice = tensor_slice.read()
    if isinstance(tensor_slice, int4_checkpoint.PackedWeight) and (callable(dim) or slot or packed is None):
        tensor_slice = tensor_slice.dequantized()  # stacked experts and the like: float
    if callable(dim):
        src = dim(tensor_slice)
    elif dim is None:
        src = tensor_slice[:]
    elif dim == 0:
        src = tensor_slice[start:start + size]
    else:
        src = tensor_slice[:, start:start + size]
    if isinstance(src, torch.Tensor) and params[target].is_floating_point() and not src.is_floating_point():
        raise ValueError(f"{name!r} holds {src.dtype} integers, not weights: its quantization (config.json's "
                         "quantization_config) is not one shoal reads")
    if scales is not None and isinstance(tensor_slice, int8_checkpoint.Int8Weight) and not slot and not callable(dim):
        scales.setdefault(target, []).append((offset, tensor_slice.row_scales(dim, start, size)))
    if packed is not None and not slot and (isinstance(src, int4_checkpoint.PackedWeight) or params[target].is_meta):
        packed.setdefault(target, []).append((offset, src))  # put together once every piece is read
        return target
    _copy_rows(params[target][slot[0]] if slot else params[target], offset, src, weight_dtype)
    if rows_read is not None and not slot:
        rows_read.setdefault(target, []).append((offset, src.shape[0]))
    return target


def _copy_rows(param: torch.Tensor, offset: int, src: torch.Tensor, weight_dtype: torch.dtype | None) -> None:
    if weight_dtype is not None:
        src = src.to(weight_dtype)  # copy_ widens it back exactly
    with torch.no_grad():
        param[offset:offset + src.shape[0]].copy_(src)
