"""The Triton program of kernels/int4_linear.py (which says what it computes). Imported on first
use, after the choice between Triton's compiler and its interpreter is made."""
import triton
import triton.language as tl

from kernels.triton_fused_programs import rounded  # x rounded to a dtype, bf16 rounded to nearest even


@triton.jit
def w4a16_matmul(x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, bias_ptr, out_ptr,
                 M, N, K, stride_xm, stride_om,
                 BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
                 DOT_F32: tl.constexpr):
    """out[BM, BN] tile = x @ W^T, W's [BK, BN] tiles dequantised in registers from the packed
    codes: w = (q - z[g_idx[k]]) * s[g_idx[k]], rounded to x's dtype, products summed in float32.
    DOT_F32: multiply in float32 (exactly the same products; Triton's interpreter multiplies
    bf16 tiles' raw bits in tl.dot, so it runs bf16 this way)."""
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok, col_ok = rows < M, cols < N
    zero_shift = ((cols % PER) * BITS)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        both = k_ok[:, None] & col_ok[None, :]
        words = tl.load(qweight_ptr + (ks // PER)[:, None] * N + cols[None, :], mask=both, other=0)
        q = (words >> ((ks % PER) * BITS)[:, None]) & MASK
        g = tl.load(g_idx_ptr + ks, mask=k_ok, other=0)
        zero_words = tl.load(qzeros_ptr + g[:, None] * (N // PER) + (cols // PER)[None, :], mask=both, other=0)
        z = ((zero_words >> zero_shift) & MASK) + ZERO_OFFSET
        s = tl.load(scales_ptr + g[:, None] * N + cols[None, :], mask=both, other=0.0).to(tl.float32)
        w = (q - z).to(tl.float32) * s
        if DOT_F32:  # the same products: x's values times w rounded to x's dtype, in float32
            acc = tl.dot(x.to(tl.float32), rounded(w, x.dtype), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], rounded(acc, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
