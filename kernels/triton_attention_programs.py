"""The Triton programs of kernels/triton_attention.py (which says what they compute). Imported
on first use, after the choice between Triton's compiler and its interpreter is made."""
import triton
import triton.language as tl


@triton.jit
def fp8_to_float(bits):
    """float8 e4m3 bytes (uint8) -> float32: the byte's exponent and mantissa are placed where a
    float16's go (exponent bias 15 instead of 7), which is exact, subnormals included, then
    scaled by 2^8. (NaN, 0x7f / 0xff, is never stored: writes saturate.)"""
    b = bits.to(tl.uint16)
    half = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, tables_ptr, seq, table_stride, kv_head, kv_stride_s,
                kv_stride_h, first, keys, sees, offs_d, d_ok, scale, k_scale, v_scale, BLOCK_SIZE: tl.constexpr,
                TILE: tl.constexpr, PRECISION: tl.constexpr, WINDOW: tl.constexpr,
                SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr):
    """Keys first..first+TILE (those below `keys`) of one sequence and KV head, folded into
    the rows' online softmax (m_i, l_i, acc); row r sees keys up to sees[r]. KV_FP8: the pool
    holds e4m3 bytes, read as stored * k_scale / v_scale in q's dtype."""
    offs_t = first + tl.arange(0, TILE)
    t_ok = offs_t < keys
    block = tl.load(tables_ptr + seq * table_stride + offs_t // BLOCK_SIZE, mask=t_ok, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + offs_t % BLOCK_SIZE
    k = tl.load(k_ptr + slot[None, :] * kv_stride_s + kv_head * kv_stride_h + offs_d[:, None],
                mask=t_ok[None, :] & d_ok[:, None], other=0)
    v = tl.load(v_ptr + slot[:, None] * kv_stride_s + kv_head * kv_stride_h + offs_d[None, :],
                mask=t_ok[:, None] & d_ok[None, :], other=0)
    if KV_FP8:
        k = (fp8_to_float(k) * k_scale).to(q.dtype)
        v = (fp8_to_float(v) * v_scale).to(q.dtype)
    s = tl.dot(q, k, input_precision=PRECISION) * scale
    if SOFTCAP > 0:  # tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both ends
        s = SOFTCAP * (1.0 - 2.0 / (tl.exp(2.0 * s / SOFTCAP) + 1.0))
    seen = (offs_t[None, :] <= sees[:, None]) & t_ok[None, :]
    if WINDOW > 0:
        seen = seen & (offs_t[None, :] > sees[:, None] - WINDOW)
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc

# Sizes that change from step to step are not specialised on (Triton would compile a variant
# for each of: equal to 1, a multiple of 16, anything else) so that no step compiles mid-run.
@triton.jit(do_not_specialize=["num_seqs"])
def attention(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, q_start_ptr, sinks_ptr, scale, num_seqs,
              q_stride_t, q_stride_h, kv_stride_s, kv_stride_h, o_stride_t, o_stride_h, table_stride,
              k_scale, v_scale,
              QPKV: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
              HEAD_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
              TILE: tl.constexpr, PRECISION: tl.constexpr, WINDOW: tl.constexpr,
              SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, KV_FP8: tl.constexpr):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    # The sequence whose query blocks hold q_block: sequence s's start at q_start[s] // BLOCK_Q + s.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(q_start_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q < q_len:
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_PAD)
        q_pos = local * BLOCK_Q + offs_m // QPKV  # the row's token, within the chunk
        head = kv_head * QPKV + offs_m % QPKV
        row_ok = (q_pos < q_len) & (offs_m < BLOCK_Q * QPKV)
        d_ok = offs_d < HEAD_DIM
        q_rows = (q_start + q_pos).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * q_stride_t + head[:, None] * q_stride_h + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - q_len
        sees = context + q_pos  # the last key each row sees
        keys = context + tl.minimum((local + 1) * BLOCK_Q, q_len)  # keys this block needs
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        if HAS_SINKS:  # the sink starts the online softmax as a key of weight e^0 and no value
            m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            l_i = l_i + 1.0
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        lo_key = 0
        if WINDOW > 0:  # the block's first row sees nothing before this tile
            lo_key = tl.maximum(context + local * BLOCK_Q - WINDOW + 1, 0) // TILE * TILE
        for first in range(lo_key, keys, TILE):
            m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, tables_ptr, seq, table_stride, kv_head,
                                        kv_stride_s, kv_stride_h, first, keys, sees, offs_d, d_ok, scale,
                                        k_scale, v_scale, BLOCK_SIZE, TILE, PRECISION, WINDOW, SOFTCAP, KV_FP8)
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + q_rows[:, None] * o_stride_t + head[:, None] * o_stride_h + offs_d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

@triton.jit(do_not_specialize=["keys_per_split"])
def decode_split(q_ptr, k_ptr, v_ptr, part_ptr, lse_ptr, tables_ptr, seq_lens_ptr, scale, keys_per_split,
                 q_stride_t, q_stride_h, kv_stride_s, kv_stride_h, table_stride, k_scale, v_scale,
                 QPKV: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HEAD_PAD: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
                 PRECISION: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                 SPLITS: tl.constexpr, KV_FP8: tl.constexpr):
    """One decode row (its token is row `seq` of q), one KV head with its query heads,
    one range of keys: the range's normalised output and log-sum-exp per query head."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    head = kv_head * QPKV + offs_m
    row_ok = offs_m < QPKV
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq.to(tl.int64) * q_stride_t + head[:, None] * q_stride_h + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    seq_len = tl.load(seq_lens_ptr + seq)
    sees = seq_len - 1  # the token's own key is the last it sees
    lo_key = split * keys_per_split
    hi_key = tl.minimum(lo_key + keys_per_split, seq_len)
    if WINDOW > 0:
        lo_key = tl.maximum(lo_key, tl.maximum(sees - WINDOW + 1, 0) // TILE * TILE)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    sees_rows = tl.zeros([BLOCK_M], tl.int32) + sees
    for first in range(lo_key, hi_key, TILE):
        m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, tables_ptr, seq, table_stride, kv_head,
                                    kv_stride_s, kv_stride_h, first, hi_key, sees_rows, offs_d, d_ok, scale,
                                    k_scale, v_scale, BLOCK_SIZE, TILE, PRECISION, WINDOW, SOFTCAP, KV_FP8)
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
    heads = tl.num_programs(1) * QPKV
    part = (seq * heads + head).to(tl.int64) * SPLITS + split  # [B, heads, SPLITS] order
    tl.store(lse_ptr + part, lse, mask=row_ok)
    tl.store(part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
