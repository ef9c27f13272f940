"""The Triton programs of kernels/triton_fused.py (which says what they compute). Imported on
first use, after the choice between Triton's compiler and its interpreter is made.

Each rounds to the tensors' dtype where the torch definition it replaces does (a bf16 product
is rounded before it is added, say), so only the order of a sum can differ from it."""
import triton
import triton.language as tl


@triton.jit
def rounded(x, DTYPE: tl.constexpr):
    """x (float32) rounded to DTYPE, kept in float32. Round to nearest even, as torch's casts
    do; written out for bf16, whose cast Triton's interpreter truncates."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def scaled(x, r, w, OFFSET: tl.constexpr, DTYPE: tl.constexpr):
    """x (float32) times its RMSNorm factor r and weight w (float32), rounded to DTYPE as
    transformers does: Llama's order w * round(x * r), or Gemma's round(x * r * (OFFSET + w))."""
    if OFFSET != 0.0:
        return rounded(x * r * (OFFSET + w), DTYPE)
    return rounded(w * rounded(x * r, DTYPE), DTYPE)


@triton.jit
def silu(x, DTYPE: tl.constexpr):
    """silu(x) (float32) rounded to DTYPE, as torch's F.silu on a DTYPE tensor."""
    return rounded(x / (1.0 + tl.exp(-x)), DTYPE)


@triton.jit
def clamped_swiglu(gate, up, alpha, limit, DTYPE: tl.constexpr):
    """gpt-oss's (up + 1) * gate * sigmoid(alpha * gate), gate clamped above and up on both
    sides at limit (float32 in, rounded to DTYPE where kernels/swiglu_moe.py's torch ops round)."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    sig = rounded(1.0 / (1.0 + tl.exp(-rounded(gate * alpha, DTYPE))), DTYPE)
    return rounded(rounded(up + 1.0, DTYPE) * rounded(gate * sig, DTYPE), DTYPE)


@triton.jit
def rms_norm(x_ptr, add_ptr, w_ptr, out_ptr, sum_ptr, n, x_stride, add_stride, out_stride, sum_stride, eps,
             HAS_ADD: tl.constexpr, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    """One row: out = RMSNorm(x), or with HAS_ADD, sum = x + add (rounded) and out = RMSNorm(sum)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + row * x_stride + offs, mask=ok, other=0.0)
    if HAS_ADD:
        x = rounded(x.to(tl.float32) + tl.load(add_ptr + row * add_stride + offs, mask=ok, other=0.0).to(tl.float32),
                    sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * sum_stride + offs, x, mask=ok)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    x = x.to(tl.float32)
    y = scaled(x, tl.rsqrt(tl.sum(x * x, 0) / n + eps), w, OFFSET, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + offs, y, mask=ok)


@triton.jit
def rotate(x1, x2, c1, c2, s1, s2, DTYPE: tl.constexpr):
    """Rotate-half rotary over the two halves of a head (float32 values of DTYPE numbers), each
    product rounded before the sum as torch's q * cos + rotate_half(q) * sin is."""
    r1 = rounded(rounded(x1 * c1, DTYPE) + rounded(-x2 * s1, DTYPE), DTYPE)
    r2 = rounded(rounded(x2 * c2, DTYPE) + rounded(x1 * s2, DTYPE), DTYPE)
    return r1, r2


@triton.jit
def qk_rope_write(qkv_ptr, q_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
                  qkv_stride, q_stride_t, q_stride_h, cache_stride_s, cache_stride_h, cos_stride, eps,
                  HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                  NORM: tl.constexpr, OFFSET: tl.constexpr):
    """One token, one head of the fused q/k/v projection's output: a query head (program 1 axis
    below HEADS) is normed (NORM), rotated and written to q; a KV head's key is normed, rotated
    and written to the pool at the token's slot, its value copied beside it."""
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dtype = q_ptr.dtype.element_ty
    offs = tl.arange(0, HALF_PAD)
    ok = offs < HALF
    is_q = head < HEADS
    col = head * 2 * HALF  # the head's first column in qkv (keys follow the query heads)
    x1 = tl.load(qkv_ptr + t * qkv_stride + col + offs, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(qkv_ptr + t * qkv_stride + col + HALF + offs, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        if is_q:
            w1 = tl.load(qw_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            w2 = tl.load(qw_ptr + HALF + offs, mask=ok, other=0.0).to(tl.float32)
        else:
            w1 = tl.load(kw_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            w2 = tl.load(kw_ptr + HALF + offs, mask=ok, other=0.0).to(tl.float32)
        r = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
        x1, x2 = scaled(x1, r, w1, OFFSET, dtype), scaled(x2, r, w2, OFFSET, dtype)
    c1 = rounded(tl.load(cos_ptr + t * cos_stride + offs, mask=ok, other=0.0).to(tl.float32), dtype)
    c2 = rounded(tl.load(cos_ptr + t * cos_stride + HALF + offs, mask=ok, other=0.0).to(tl.float32), dtype)
    s1 = rounded(tl.load(sin_ptr + t * cos_stride + offs, mask=ok, other=0.0).to(tl.float32), dtype)
    s2 = rounded(tl.load(sin_ptr + t * cos_stride + HALF + offs, mask=ok, other=0.0).to(tl.float32), dtype)
    r1, r2 = rotate(x1, x2, c1, c2, s1, s2, dtype)
    if is_q:
        out = q_ptr + t * q_stride_t + head * q_stride_h
        tl.store(out + offs, r1, mask=ok)
        tl.store(out + HALF + offs, r2, mask=ok)
    else:
        kv_head = head - HEADS
        slot = tl.load(slots_ptr + t).to(tl.int64)
        k_out = k_cache_ptr + slot * cache_stride_s + kv_head * cache_stride_h
        tl.store(k_out + offs, r1, mask=ok)
        tl.store(k_out + HALF + offs, r2, mask=ok)
        v_col = (HEADS + KV_HEADS + kv_head) * 2 * HALF
        v_out = v_cache_ptr + slot * cache_stride_s + kv_head * cache_stride_h
        v1 = tl.load(qkv_ptr + t * qkv_stride + v_col + offs, mask=ok, other=0.0)
        v2 = tl.load(qkv_ptr + t * qkv_stride + v_col + HALF + offs, mask=ok, other=0.0)
        tl.store(v_out + offs, v1, mask=ok)
        tl.store(v_out + HALF + offs, v2, mask=ok)


@triton.jit
def silu_and_mul(x_ptr, out_ptr, width, x_stride, out_stride, BLOCK: tl.constexpr):
    """out = round(silu(gate)) * up for one row's BLOCK columns; x holds [gate | up]."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < width
    gate = tl.load(x_ptr + row * x_stride + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + width + offs, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * out_stride + offs, rounded(silu(gate, dtype) * up, dtype), mask=ok)


@triton.jit
def expert_block(b, block_cum_ptr, counts_ptr, starts_ptr, num_experts, BM: tl.constexpr):
    """Program b's expert e (num_experts: none, the program has nothing to do), the sorted
    positions of its rows (start + offs) and which of them exist (ok)."""
    lo = 0
    hi = num_experts
    while lo < hi:  # the first expert whose blocks end past b
        mid = (lo + hi) // 2
        if tl.load(block_cum_ptr + mid) > b:
            hi = mid
        else:
            lo = mid + 1
    e = tl.minimum(lo, num_experts - 1)
    first = tl.load(block_cum_ptr + e - 1, mask=e > 0, other=0)
    offs = (b - first) * BM + tl.arange(0, BM)
    rows = tl.where(lo < num_experts, tl.load(counts_ptr + e), 0)
    return lo, tl.load(starts_ptr + e) + offs, offs < rows


@triton.jit(do_not_specialize=["num_experts", "top_k"])
def expert_gate_up(x_ptr, w_ptr, out_ptr, order_ptr, block_cum_ptr, counts_ptr, starts_ptr, num_experts, top_k,
                   hidden, width, x_stride, w_stride_e, w_stride_n, out_stride, bias_ptr, bias_stride_e, alpha,
                   limit, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
                   HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr):
    """One block of BM assignments of one expert, BN columns of its width: round(silu(x W_gate))
    x round(x W_up), rounded, into the sorted positions' rows of out. HAS_BIAS: the expert's
    gate and up biases are added first; SWIGLU: gpt-oss's clamped SwiGLU instead."""
    e, pos, ok = expert_block(tl.program_id(0), block_cum_ptr, counts_ptr, starts_ptr, num_experts, BM)
    if e < num_experts:
        token = (tl.load(order_ptr + pos, mask=ok, other=0) // top_k).to(tl.int64)
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_ok = offs_n < width
        w = w_ptr + e.to(tl.int64) * w_stride_e
        gate = tl.zeros([BM, BN], tl.float32)
        up = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, hidden, BK):
            offs_k = k0 + tl.arange(0, BK)
            k_ok = offs_k < hidden
            xs = tl.load(x_ptr + token[:, None] * x_stride + offs_k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            wk = k_ok[:, None] & n_ok[None, :]
            wg = tl.load(w + offs_n[None, :] * w_stride_n + offs_k[:, None], mask=wk, other=0.0)
            wu = tl.load(w + (width + offs_n)[None, :] * w_stride_n + offs_k[:, None], mask=wk, other=0.0)
            gate = tl.dot(xs, wg, gate, input_precision=PRECISION)
            up = tl.dot(xs, wu, up, input_precision=PRECISION)
        dtype = out_ptr.dtype.element_ty
        gate, up = rounded(gate, dtype), rounded(up, dtype)
        if HAS_BIAS:
            b = bias_ptr + e.to(tl.int64) * bias_stride_e
            gate = rounded(gate + tl.load(b + offs_n, mask=n_ok, other=0.0).to(tl.float32), dtype)
            up = rounded(up + tl.load(b + width + offs_n, mask=n_ok, other=0.0).to(tl.float32), dtype)
        if SWIGLU:
            act = clamped_swiglu(gate, up, alpha, limit, dtype)
        else:
            act = rounded(silu(gate, dtype) * up, dtype)
        tl.store(out_ptr + pos.to(tl.int64)[:, None] * out_stride + offs_n[None, :], act,
                 mask=ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_experts"])
def expert_down(h_ptr, w_ptr, out_ptr, order_ptr, weights_ptr, block_cum_ptr, counts_ptr, starts_ptr, num_experts,
                hidden, width, h_stride, w_stride_e, w_stride_n, out_stride, bias_ptr, bias_stride_e,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """One block of BM assignments of one expert, BN of the hidden columns: round(h W_down)
    (plus the expert's bias, rounded, with HAS_BIAS) times the assignment's routing weight
    (rounded), into the assignment's row of out."""
    e, pos, ok = expert_block(tl.program_id(0), block_cum_ptr, counts_ptr, starts_ptr, num_experts, BM)
    if e < num_experts:
        assign = tl.load(order_ptr + pos, mask=ok, other=0).to(tl.int64)
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_ok = offs_n < hidden
        w = w_ptr + e.to(tl.int64) * w_stride_e
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, width, BK):
            offs_k = k0 + tl.arange(0, BK)
            k_ok = offs_k < width
            hs = tl.load(h_ptr + pos.to(tl.int64)[:, None] * h_stride + offs_k[None, :],
                         mask=ok[:, None] & k_ok[None, :], other=0.0)
            wd = tl.load(w + offs_n[None, :] * w_stride_n + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                         other=0.0)
            acc = tl.dot(hs, wd, acc, input_precision=PRECISION)
        dtype = out_ptr.dtype.element_ty
        weight = rounded(tl.load(weights_ptr + assign, mask=ok, other=0.0).to(tl.float32), dtype)
        y = rounded(acc, dtype)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + e.to(tl.int64) * bias_stride_e + offs_n, mask=n_ok, other=0.0)
            y = rounded(y + bias.to(tl.float32)[None, :], dtype)
        y = rounded(y * weight[:, None], dtype)
        tl.store(out_ptr + assign[:, None] * out_stride + offs_n[None, :], y, mask=ok[:, None] & n_ok[None, :])
