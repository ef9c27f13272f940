"""The Triton program of kernels/quantization.py's weight-only path on CUDA: 8-bit weight rows
(int8 or float8 e4m3) times activations. Imported on first use, after the choice between
Triton's compiler and its interpreter is made."""
import triton
import triton.language as tl


@triton.jit
def e4m3_to_float32(bits):
    """float8 e4m3 codes (uint8) as float32: sign, exponent and mantissa shifted into a float16's
    fields read as the value / 256 (subnormals included), times 256. Exact; NaN codes excluded."""
    h = bits.to(tl.uint16)
    half = ((h & 0x80) << 8) | ((h & 0x7F) << 7)
    return half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def weight_only_matmul(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, FP8: tl.constexpr, FLOAT32_DOT: tl.constexpr):
    """out[M, N] = (x[M, K] @ W[N, K]^T) * scale[N] (+ bias[N]), W int8 or (FP8) e4m3 bytes. Each block of weights is widened
    to x's dtype (exact: int8 and e4m3 values are all bfloat16 and float16 values) for the
    tensor cores; the sums are float32 and the scale multiplies each finished sum once."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :],
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + k[:, None],
                    mask=(cols[None, :] < N) & (k[:, None] < K), other=0)
        if FP8:  # e4m3 bytes, widened by hand (Triton's float8e4nv needs compute capability 8.9)
            w = e4m3_to_float32(w)
        if FLOAT32_DOT:  # float32 activations (no TF32 rounding), or Triton's interpreter: its
            # bfloat16 dot is not one. 16-bit products are exact in float32, so the sums are the same.
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(tl.float32).to(x.dtype))
    acc *= tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))
