"""Online 8-bit weights (--quantization int8 | fp8 | w8a8_int8): each linear layer's weight with
one float32 scale per output column (symmetric: max |w| / 127 for int8, max |w| / 448 for float8
e4m3).

A decode step reads every weight once, so its time follows the weights' bytes: 8 bits are a
quarter of float32's (the CPU's compute dtype; bfloat16 on a CPU without bf16 matmuls computes
in float32 too) and half of bfloat16's.

Where each runs:
- CPU, both formats: weight-only, in csrc/int8_linear.cpp. Activations stay float32 (bfloat16
  ones as they are where the CPU has AVX512-BF16: `bf16_dot`), so the only error is the
  weights' rounding: outputs are those of float32 on the dequantised weights (`dequantize`) up
  to float32 rounding. The [N, K] weight is packed in [ceil(N / 16), K, 16]
  panels, 16 output columns of one k side by side, padding columns zero. Inside torch.compile
  the product is the opaque op `shoal::quantized_linear`.
- CUDA, fp8 on a GPU with FP8 matmuls (compute capability 8.9: Ada, Hopper and later): vLLM's
  dynamic FP8, each row of activations quantized to e4m3 with its own scale as it arrives, and
  `torch._scaled_mm` multiplies the two (row-wise scales). Weights stay [N, K] rows.
- CUDA otherwise (int8 anywhere, fp8 on older GPUs): weight-only, in a Triton kernel that widens
  the 8-bit weights to the activations' dtype in registers (kernels/triton_quantized_programs.py).

w8a8_int8 (SGLang's spelling): int8 weights as int8's, times int8 activations, each row
quantized as it arrives over its own scale (max |x_row| / 127, symmetric); out = (int32 dot) *
x_scale[row] * w_scale[col] (+ bias). The scale is kept as a row [1, N] (the shape the epilogue
broadcasts; it is also what tells this format from int8's rows on CUDA). The int8 x int8 ->
int32 product (`int8_sums`, `w8a8_cpu_kernel` says which) is on CPUs with AVX512-VNNI and no
AMX shoal's kernel (csrc/int8_linear.cpp `w8a8_sums`, vpdpbusd) on weights packed in panels
as they are quantized (below), so a tied head is in memory once; with AMX oneDNN's int8 linear
on a weight prepacked once at start (`prepack_w8a8`; in place of the weight), else
`torch._int_mm` (oneDNN's s8s8s32 gemm, which reorders the whole [N, K] weight on every call:
1.4x slower at a decode step's 32 rows); on CUDA `torch._int_mm`'s cuBLASLt on [N, K] rows
(rows padded past 16, K and N multiples of 8; not yet run on a GPU). int32 sums are exact, and the quantization and the
epilogue are per row and per element, so a row's output depends on that row alone, whatever M
or the thread count. Inside torch.compile only the product is opaque (`shoal::int8_sums`): the
quantization and the scaling compile with the ops around them.

Without VNNI / AMX (AVX2, AVX-512 before Cascade Lake) oneDNN's int8 products are slow or not
exact: its gemm shifts the activations to u8 and multiplies with vpmaddubsw, whose 16-bit sums
of two products saturate (255 * 127 * 2 > 32767; forced to AVX2 it got 3-5% of outputs wrong
on Gaussian data), and where `torch._int_mm` is exact there (torch 2.13 on the AVX2-only
Zen 3) it ran 30-50x slower than float32. So on such CPUs, as on VNNI ones, each weight is
packed as it is quantized for shoal's own kernel (csrc/int8_linear.cpp `w8a8_sums`: on AVX2,
|w| times x with w's sign, which cannot saturate), in panels of 16 columns by groups of 4 k's,
[ceil(N / 16), K / 4, 16, 4]. Where that kernel is missing (no compiler, a CPU without AVX2) or
K is not a multiple of 4: `torch._int_mm` where `int_mm_exact` finds it exact, else the weight
kept as two halves of |w| <= 64 stacked [2N, K] (255 * 64 * 2 fits), multiplied in one call and
summed: exact, at twice the multiplies and the weight bytes.

SHOAL_FP8_ACTIVATIONS=1 runs fp8 the dynamic way on CPU too (torch's CPU `_scaled_mm`: the same
arithmetic, 5-15x slower than float32 there), to measure on a CPU the quality a GPU gets.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from kernels import native, packed_weights, triton_programs
from kernels.env import flag

log = logging.getLogger("shoal.kernels")

PANEL = 16
QUANTIZATIONS = ("int8", "fp8", "w8a8_int8")
FP8 = torch.float8_e4m3fn
_LIMIT = {"int8": 127.0, "w8a8_int8": 127.0, "fp8": torch.finfo(FP8).max}  # 448
_warned = False


QUANTIZE_ROWS = 4096


def quantize(w: torch.Tensor, kind: str, panels: bool = True,
             scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, scale [N] float32) of an [N, K] weight in `kind`: int8 or float8 e4m3, either
    packed [ceil(N / 16), K, 16] for the CPU kernel or, without `panels`, [N, K] rows. scale:
    the rows' scales of an int8 checkpoint the weight came from (w = codes * scale), whose
    codes (-128 included) come back exactly; None: max |w| / 127 (or 448)."""
    w = w.detach()
    n, k = w.shape
    given = scale
    scale = torch.empty(n, dtype=torch.float32, device=w.device)
    q = torch.empty(n, k, dtype=FP8 if kind == "fp8" else torch.int8, device=w.device)
    # By blocks of rows: the float temporaries are a block's, not a whole weight's (an
    # embedding's 151,936 rows made ~1.6 GB of them at once).
    for i in range(0, n, QUANTIZE_ROWS):
        block = w[i:i + QUANTIZE_ROWS].float()
        if given is None:
            s = block.abs().amax(dim=1) / _LIMIT[kind]
            s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero row stays zero
        else:
            s = given[i:i + QUANTIZE_ROWS].to(w.device, torch.float32)
        scale[i:i + QUANTIZE_ROWS] = s
        scaled = block / s[:, None]
        if kind in ("int8", "w8a8_int8"):
            q[i:i + QUANTIZE_ROWS] = torch.round(scaled).clamp_(-128, 127)
        else:  # torch's cast rounds to the nearest e4m3 (ties to even); the scale keeps |q| <= 448
            q[i:i + QUANTIZE_ROWS] = scaled.clamp_(-_LIMIT[kind], _LIMIT[kind])
    if not panels:
        return q, scale
    return packed_weights.panels(q, PANEL), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The [N, K] float32 weight a quantized one (panels or rows) stands for: the reference it
    computes with."""
    if weight.dim() == 3:
        weight = weight.transpose(1, 2).reshape(-1, weight.shape[1])[:scale.numel()]
    elif weight.dim() == 4 or weight.shape[0] == 2 * scale.numel():  # w8a8_int8's panels or halves
        weight = w8a8_rows(weight, scale.numel())
    return weight.float() * scale.view(-1, 1)


@functools.cache
def bf16_dot() -> bool:
    """Whether the 8-bit kernel takes bfloat16 activations as they are here (AVX512-BF16)."""
    return torch.cpu._is_avx512_bf16_supported()


def _cpu_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                portable: bool = False) -> torch.Tensor:
    global _warned
    fp8 = packed.dtype == FP8
    op = native.int8_linear_op(fp8)
    keep_bf16 = op is not None and x.dtype == torch.bfloat16 and not portable and bf16_dot()
    flat = x.reshape(-1, x.shape[-1])
    flat = (flat if keep_bf16 else flat.float()).contiguous()
    if op is None:  # no compiler: correct, at float32's speed and a float32 copy per call
        if not _warned:
            log.warning("the 8-bit linear kernel is unavailable: the weights are dequantised on every call")
            _warned = True
        out = F.linear(flat, dequantize(packed, scale), bias)
    else:
        out = torch.empty((flat.shape[0], scale.numel()))  # float32 sums, whatever x's dtype
        op(out, flat, packed.view(torch.uint8) if fp8 else packed, scale,
           torch.empty(0) if bias is None else bias.float().contiguous(), portable)
    return out.view(*x.shape[:-1], scale.numel()).to(x.dtype)


def fp8_matmuls(device: torch.device) -> bool:
    """Whether fp8 runs with dynamic FP8 activations on `device`: a CUDA GPU of compute
    capability 8.9+ (FP8 matmuls), or a CPU with SHOAL_FP8_ACTIVATIONS=1."""
    if device.type == "cpu":
        return flag("SHOAL_FP8_ACTIVATIONS", False)
    return device.type == "cuda" and _capability(device.index or 0) >= (8, 9)


@functools.cache
def _capability(index: int) -> tuple[int, int]:  # asked on every fp8 call: once per GPU
    return torch.cuda.get_device_capability(index)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 activations: each row of [M, K] as e4m3 over its own scale (max |x| / 448),
    and the scales [M, 1] float32."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12) / _LIMIT["fp8"]
    return (xf / scale).clamp_(-_LIMIT["fp8"], _LIMIT["fp8"]).to(FP8), scale


def fp8_scaled_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T for fp8 rows W [N, K] through FP8 matmuls: activations quantized per row, both
    scales applied by `torch._scaled_mm` (row-wise scaling takes a bfloat16 output)."""
    flat = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_rows_fp8(flat)
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1),
                           out_dtype=torch.bfloat16)
    out = out.to(x.dtype) if bias is None else (out.float() + bias.float()).to(x.dtype)
    return out.view(*x.shape[:-1], scale.numel())


def triton_weight_only_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                              bias: torch.Tensor | None) -> torch.Tensor:
    """x @ (the dequantised rows W [N, K])^T (+ bias): the 8-bit weights widened to x's dtype in
    the Triton kernel's registers, float32 sums, the scale applied once per output."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = flat.shape
    n = scale.numel()
    out = flat.new_empty((m, n))
    if m:
        programs = triton_programs.load("triton_quantized_programs")
        block_m = 16 if m <= 16 else 64
        grid = (-(-m // block_m), -(-n // 64))
        programs.weight_only_matmul[grid](
            flat, weight.view(torch.uint8) if weight.dtype == FP8 else weight, scale, bias if bias is not None else scale, out, m, n, k,
            flat.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, FP8=weight.dtype == FP8,
            FLOAT32_DOT=flat.dtype == torch.float32 or triton_programs.interpreted())
    return out.view(*x.shape[:-1], n)


def _gpu_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    if weight.dtype == FP8 and fp8_matmuls(weight.device):
        return fp8_scaled_linear(x, weight, scale, bias)
    return triton_weight_only_linear(x, weight, scale, bias)


def quantize_rows_int8(x: torch.Tensor, shifted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic int8 activations: each row of [M, K] rounded to the nearest step of its own scale
    (max |x_row| / 127; an all-zero row gets scale 1 and stays zero), and the scales [M, 1].
    `shifted`: as uint8 q + 128, what oneDNN's int8 linear reads (`_packed_sums`)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(xf / scale).clamp_(-127, 127)
    return (q.add_(128).to(torch.uint8) if shifted else q.to(torch.int8)), scale


def _saturating_cases():
    """int8 pairs whose products saturate a u8 x s8 pair sum (module docstring), at a few row
    counts (oneDNN picks kernels by shape)."""
    for m in (1, 5, 33, 200):
        x = torch.full((m, 96), 127, dtype=torch.int8)
        x[:, 1::3] = -127
        w = torch.full((40, 96), 127, dtype=torch.int8)
        w[::2, ::2] = -127
        yield x, w


@functools.cache
def int_mm_exact() -> bool:
    """Whether `torch._int_mm` on CPU sums int8 x int8 exactly here."""
    return all(torch.equal(torch._int_mm(x, w.t()).long(), x.long() @ w.long().t()) for x, w in _saturating_cases())


@functools.cache
def packed_int8_exact() -> bool:
    """Whether oneDNN's prepacked int8 linear (`_packed_sums`) runs here and sums exactly."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")):
        return False
    try:
        for x, w in _saturating_cases():
            got = _packed_sums(_flip_sign_bits(x, torch.uint8), torch.ops.onednn.qlinear_prepack(w, [33, 96]), len(w))
            if not torch.equal(got, (x.long() @ w.long().t()).float()):
                return False
        return True
    except RuntimeError:  # a torch built without the op's oneDNN kernels
        return False


def prepack_w8a8(weight: torch.Tensor, rows: int) -> int:
    """Keep oneDNN's prepacked int8 layout of a w8a8_int8 weight's [N, K] rows
    (kernels/packed_weights.py), where `w8a8_cpu_kernel` picks that product. Returns the copy's
    bytes (0: none kept)."""
    if w8a8_cpu_kernel() != "onednn-packed":
        return 0
    packed = torch.ops.onednn.qlinear_prepack(weight.detach(), [rows, weight.shape[1]])
    packed_weights.keep(weight, packed)
    return weight.numel()


@functools.lru_cache(maxsize=64)
def _unit_scales(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(n), torch.zeros(n, dtype=torch.long)


def _packed_sums(xu: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """Shifted int8 rows (uint8 q + 128) times a prepacked int8 weight through oneDNN's u8 x s8
    linear (VNNI's instruction), whose zero point takes the shift back in int32; scales of 1, so
    the float32 result is the int32 sums converted, as `torch._int_mm(...).float()` gives them."""
    ones, zeros = _unit_scales(n)
    return torch.ops.onednn.qlinear_pointwise(xu, 1.0, 128, packed, ones, zeros, None, 1.0, 0, torch.float32,
                                              "none", [], "")


def _flip_sign_bits(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 q <-> uint8 q + 128: the same bytes with the top bit flipped."""
    return torch.bitwise_xor(q.view(torch.uint8), 128).view(dtype)


W8A8_LAYOUTS = ("rows", "halves", "panels")


W8A8_PANEL_KERNELS = ("vnni", "avx2")  # w8a8_cpu_kernel's kernels on panels


def w8a8_cpu_kernel() -> str:
    """The CPU product w8a8_int8 runs here (module docstring): `onednn-packed` (oneDNN's int8
    linear on weights prepacked at start: AMX, or VNNI without shoal's kernel; exact), `vnni` or
    `avx2` (shoal's kernel on panels), `onednn` (`torch._int_mm`, where exact) or `onednn-split`
    (the same on halves)."""
    from kernels.linear import ONEDNN  # (kernels.linear imports this module)

    packed = ONEDNN and int_mm_exact() and packed_int8_exact()
    if packed and torch.cpu._is_amx_tile_supported():
        return "onednn-packed"
    capability = torch.backends.cpu.get_cpu_capability()  # (ATEN_CPU_CAPABILITY holds it narrower)
    if capability in ("AVX2", "AVX512") and native.w8a8_sums_op() is not None:
        return "vnni" if capability == "AVX512" and torch.cpu._is_vnni_supported() else "avx2"
    return "onednn-packed" if packed else _int_mm_kernel()


def _int_mm_kernel() -> str:
    """`torch._int_mm` on rows where it is exact here, else on halves."""
    return "onednn" if int_mm_exact() else "onednn-split"


def w8a8_layout(shape: tuple[int, int], device: torch.device) -> str:
    """How a w8a8_int8 weight of `shape` [N, K] is kept on `device` for `int8_sums`: panels for
    shoal's kernel (K a multiple of 4), halves for a saturating gemm, else rows."""
    kernel = w8a8_cpu_kernel() if device.type == "cpu" else "cuda"
    if kernel in W8A8_PANEL_KERNELS and shape[1] % 4:
        kernel = _int_mm_kernel()
    return "panels" if kernel in W8A8_PANEL_KERNELS else "halves" if kernel == "onednn-split" else "rows"


def w8a8_weight(q: torch.Tensor, layout: str) -> torch.Tensor:
    """int8 rows [N, K] in a `layout` of W8A8_LAYOUTS: as they are, two halves of |w| <= 64
    stacked [2N, K] (for a saturating int8 gemm), or panels [ceil(N / 16), K / 4, 16, 4] (each
    group of 4 k's of one column is one int32's bytes, so they are int32 panels)."""
    if layout == "rows":
        return q.contiguous()
    if layout == "halves":
        half = torch.div(q, 2, rounding_mode="floor")  # q = (q - half) + half: both within [-64, 64]
        return torch.cat([q - half, half]).contiguous()
    return packed_weights.panels(q.contiguous().view(torch.int32), PANEL).view(torch.int8).view(-1, q.shape[1] // 4, PANEL, 4)


def w8a8_rows(weight: torch.Tensor, n: int) -> torch.Tensor:
    """The [N, K] int values (int16) of a w8a8_int8 weight, in any layout."""
    if weight.dim() == 4:  # [P, K / 4, 16, 4] -> [16 P, K]
        return weight.permute(0, 2, 1, 3).reshape(-1, weight.shape[1] * 4)[:n].short()
    return weight[:n].short() + weight[n:].short() if weight.shape[0] == 2 * n else weight.short()


@functools.cache
def _panel_path() -> int:
    """`native.w8a8_sums_op`'s path: the widest (VNNI where the CPU has it, `w8a8_cpu_kernel`)
    unless torch is held below AVX-512 (ATEN_CPU_CAPABILITY, fixed for the process)."""
    return 0 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 1


def int8_sums(xq: torch.Tensor, weight: torch.Tensor, n: int) -> torch.Tensor:
    """The exact int32 sums of int8 rows xq [M, K] (or, uint8, shifted by 128:
    quantize_rows_int8) times int8 rows W [N, K] (or its halves or panels: w8a8_weight), as
    float32 [M, N]: shoal's kernel on panels, oneDNN's prepacked int8 linear where the weight has
    a packed copy (`prepack_w8a8`), else `torch._int_mm` (oneDNN's s8s8s32 gemm on CPU, cuBLASLt
    on CUDA)."""
    m, k = xq.shape
    if weight.dim() == 4:
        if xq.dtype == torch.uint8:
            xq = _flip_sign_bits(xq, torch.int8)
        out = xq.new_empty((m, n), dtype=torch.float32)
        native.w8a8_sums_op()(out, xq.contiguous(), weight, _panel_path())
        return out
    packed = packed_weights.find(weight) if weight.device.type == "cpu" else None
    if packed is not None:
        return _packed_sums(xq if xq.dtype == torch.uint8 else _flip_sign_bits(xq, torch.uint8), packed, n)
    if xq.dtype == torch.uint8:
        xq = _flip_sign_bits(xq, torch.int8)
    if weight.device.type == "cuda":  # cuBLASLt's int8 gemm: more than 16 rows, K and N multiples of 8
        if k % 8 or n % 8:
            raise ValueError(f"w8a8_int8 on CUDA needs in / out features that are multiples of 8, got [{n}, {k}]")
        if m <= 16:  # zero rows, dropped after the product
            xq = F.pad(xq, (0, 0, 0, 17 - m))
    sums = torch._int_mm(xq, weight.t())[:m]
    if weight.shape[0] == 2 * n:
        sums = sums[:, :n] + sums[:, n:]
    return sums.float()


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T for int8 rows W [N, K] (or its halves) and scale [1, N]: x quantized per row, the
    exact int8 x int8 sums (`int8_sums`, inside torch.compile the opaque op `shoal::int8_sums`),
    then the two scales (and the bias) in float32. Compiled, the quantization and the scaling
    are inductor's, fused with the ops around them; the same arithmetic."""
    flat = x.reshape(-1, x.shape[-1])
    n = scale.shape[-1]
    # (shifted where oneDNN reads them: CPU rows or halves)
    xq, x_scale = quantize_rows_int8(flat, shifted=weight.device.type == "cpu" and weight.dim() == 2)
    sums = torch.ops.shoal.int8_sums(xq, weight, n) if torch.compiler.is_compiling() else int8_sums(xq, weight, n)
    out = sums.mul_(x_scale).mul_(scale)
    if bias is not None:
        out.add_(bias.float())
    return out.view(*x.shape[:-1], n).to(x.dtype)


_library = torch.library.Library("shoal", "FRAGMENT")
_library.define("quantized_linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias) -> Tensor")
_library.impl("quantized_linear", _cpu_linear, "CPU")


_library.define("int8_sums(Tensor xq, Tensor weight, int n) -> Tensor")
_library.impl("int8_sums", int8_sums, "CPU")
_library.impl("int8_sums", int8_sums, "CUDA")


@torch.library.register_fake("shoal::quantized_linear")
def _(x, packed, scale, bias):
    return x.new_empty((*x.shape[:-1], scale.shape[0]))


@torch.library.register_fake("shoal::int8_sums")
def _(xq, weight, n):
    return xq.new_empty((xq.shape[0], n), dtype=torch.float32)  # (the weight may be halves or panels)


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (the dequantised weight)^T (+ bias): CPU panels through the C++ kernel, CUDA rows
    through FP8 matmuls or the Triton kernel, w8a8_int8 (a [1, N] scale) through int8 matmuls
    (module docstring)."""
    if scale.dim() == 2:
        return w8a8_linear(x, weight, scale, bias)
    if weight.dim() == 2:
        return _gpu_linear(x, weight, scale, bias)
    if torch.compiler.is_compiling():
        return torch.ops.shoal.quantized_linear(x, weight, scale, bias)
    return _cpu_linear(x, weight, scale, bias)


def quantized_rows(ids: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the dequantised weight, in `dtype`: a quantized embedding's lookup."""
    if weight.dim() == 3:
        q = weight[ids // PANEL, :, ids % PANEL]
    elif weight.dim() == 4:  # w8a8_int8's panels
        flat = ids.reshape(-1)
        q = weight[flat // PANEL, :, flat % PANEL].reshape(*ids.shape, -1)
    elif weight.shape[0] == 2 * scale.numel():  # w8a8_int8's halves
        q = weight[ids].short() + weight[ids + scale.numel()]
    else:
        q = weight[ids]
    return (q.float() * scale.view(-1)[ids, None]).to(dtype)


def quantize_module(module, kind: str) -> None:
    """Replace a layer's float weight by its 8-bit one (panels for the CPU kernel, else rows) and
    scale (`weight_scale`; [1, N] for w8a8_int8), an int8 checkpoint's own codes and scales where
    the loader kept them (`checkpoint_scale`); `out_dtype` keeps the dtype an embedding's lookups
    return."""
    module.out_dtype = module.weight.dtype
    device = module.weight.device
    panels = device.type == "cpu" and kind in ("int8", "fp8") and not (kind == "fp8" and fp8_matmuls(device))
    known = getattr(module, "checkpoint_scale", None) if kind != "fp8" else None  # an int8 checkpoint's
    weight, scale = quantize(module.weight.data, kind, panels=panels, scale=known)
    if kind == "w8a8_int8":
        weight = w8a8_weight(weight, w8a8_layout(weight.shape, device))
        scale = scale.view(1, -1)
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    module.weight_scale = scale
