"""The fused Triton kernels (kernels/triton_fused.py) against the torch definitions they replace,
in float32 and bf16, on CPU through Triton's interpreter (or on CUDA where it is): RMSNorm with
and without the residual add (Llama's and Gemma's order), the q/k norm + rotary + KV write, and
SiLU x up. The engine runs them end to end in tests/test_triton_attention.py."""
from __future__ import annotations

import pytest
import torch

from kernels import triton_fused, triton_programs
from kernels.activation import silu_and_mul
from kernels.attention import write_kv
from kernels.norms import gemma_rms_norm, rms_norm
from kernels.rotary import apply_rotary, cos_sin_cache

pytestmark = pytest.mark.skipif(not triton_programs.available(), reason="Triton is not installed")


@pytest.fixture
def device():
    if torch.cuda.is_available():
        return "cuda"
    if not triton_programs.interpreted():
        pytest.skip("neither CUDA nor Triton's interpreter")
    return "cpu"


DTYPES = [torch.float32, torch.bfloat16]


def assert_rounding_close(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    """float32: within float32 rounding. bf16: every value equal or one bf16 step apart (the
    reduction's order can move a product across a rounding boundary), and nearly all equal."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        return
    g, w = got.float(), want.float()
    step = w.abs().clamp_min(1e-30) * 2.0 ** -7
    assert ((g - w).abs() <= step).all(), (g - w).abs().max()
    assert (g == w).float().mean() > 0.97


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 48])
def test_rms_norm(device, dtype, hidden):
    torch.manual_seed(0)
    x = (torch.randn(7, hidden) * 3).to(device, dtype)
    w = (torch.rand(hidden) + 0.5).to(device, dtype)
    assert_rounding_close(triton_fused.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), dtype)
    assert_rounding_close(triton_fused.rms_norm(x, w, 1e-6, offset=1.0), gemma_rms_norm(x, w, 1e-6, 1.0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(device, dtype):
    torch.manual_seed(1)
    x, add = (torch.randn(2, 5, 96) * 2).to(device, dtype), torch.randn(2, 5, 96).to(device, dtype)
    w = (torch.rand(96) + 0.5).to(device, dtype)
    normed, total = triton_fused.add_rms_norm(x, add, w, 1e-5)
    assert torch.equal(total, x + add)  # the residual stream is rounded exactly as torch's add
    assert_rounding_close(normed, rms_norm(x + add, w, 1e-5), dtype)
    assert triton_fused.rms_norm(x[:0], w, 1e-5).shape == (0, 5, 96)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (3, 1, 12), (2, 2, 32)])
@pytest.mark.parametrize("norm", [None, 0.0, 1.0], ids=["no-norm", "qwen3-norm", "gemma-norm"])
def test_qk_rope_write(device, dtype, heads, kv_heads, d, norm):
    """Against the torch path of actors/models/llama.py's Attention: per-head norm, rotary,
    then index_copy into the pool; slots scattered over a larger pool, the rest untouched."""
    torch.manual_seed(2)
    tokens, pool = 6, 40
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * d) * 2).to(device, dtype)
    cos_table, sin_table = cos_sin_cache(d, 10000.0, None, 64)
    positions = torch.tensor([0, 5, 6, 7, 31, 63])
    # the tables are in the model's dtype, as the model's buffers are once it is cast
    cos, sin = cos_table[positions].to(device, dtype), sin_table[positions].to(device, dtype)
    slots = torch.randperm(pool)[:tokens].to(device)
    qw, kw = (torch.rand(d) + 0.5).to(device, dtype), (torch.rand(d) + 0.5).to(device, dtype)
    k_cache, v_cache = torch.randn(pool, kv_heads, d).to(device, dtype), torch.randn(pool, kv_heads, d).to(device, dtype)
    k_want, v_want = k_cache.clone(), v_cache.clone()

    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
    q, k, v = q.reshape(tokens, heads, d), k.reshape(tokens, kv_heads, d), v.reshape(tokens, kv_heads, d)
    if norm is not None:
        norm_fn = (lambda x, w: rms_norm(x, w, 1e-6)) if norm == 0.0 else (lambda x, w: gemma_rms_norm(x, w, 1e-6, 1.0))
        q, k = norm_fn(q, qw), norm_fn(k, kw)
    q_want, k_rot = apply_rotary(q, k, cos, sin)
    write_kv(k_want, v_want, slots, k_rot, v)

    got = triton_fused.qk_rope_write(qkv, heads, kv_heads, cos, sin, slots, k_cache, v_cache,
                                     qw if norm is not None else None, kw if norm is not None else None,
                                     1e-6, norm or 0.0)
    assert_rounding_close(got, q_want, dtype)
    assert_rounding_close(k_cache, k_want, dtype)
    assert torch.equal(v_cache, v_want)  # values are copied, untouched slots stay as they were


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [40, 1500])
def test_silu_and_mul(device, dtype, width):
    torch.manual_seed(3)
    x = (torch.randn(3, 2 * width) * 4).to(device, dtype)
    assert_rounding_close(triton_fused.silu_and_mul(x), silu_and_mul(x), dtype)
    assert triton_fused.silu_and_mul(x[:0]).shape == (0, width)


@pytest.mark.parametrize("tokens,k,experts,hidden,width", [
    (7, 2, 5, 48, 24),  # an expert held elsewhere (-1), odd sizes
    (1, 2, 4, 32, 16),  # one decode row
    (300, 4, 6, 32, 80),  # >= 1024 assignments: blocks of 64 rows
])
def test_triton_moe_equals_the_torch_experts(device, tokens, k, experts, hidden, width):
    """kernels/triton_moe.py against kernels/moe.py's grouped_experts: choices of experts held
    elsewhere (-1) skipped, an expert no token chose, blocks that straddle experts. bf16 only on
    CUDA: the interpreter multiplies bf16 matrices as raw integers."""
    from kernels import triton_moe
    from kernels.moe import grouped_experts

    torch.manual_seed(4)
    for dtype in DTYPES if device == "cuda" else [torch.float32]:
        x = torch.randn(tokens, hidden).to(device, dtype)
        weights = torch.rand(tokens, k, device=device)
        ids = torch.randint(0, experts - 1, (tokens, k), device=device)  # the last expert: no token
        ids[0, -1] = -1
        gate_up = (torch.randn(experts, 2 * width, hidden) * 0.2).to(device, dtype)
        down = (torch.randn(experts, hidden, width) * 0.2).to(device, dtype)
        want = grouped_experts(x, weights, ids, gate_up, down)
        got = triton_moe.grouped_experts(x, weights, ids, gate_up, down)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # one float32 sum over a token's experts instead of rounded adds
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert triton_moe.grouped_experts(x[:0], weights[:0], ids[:0], gate_up, down).shape == (0, hidden)


@pytest.mark.parametrize("down_bias", [True, False], ids=["down-bias", "down-bias-elsewhere"])
def test_triton_moe_equals_gpt_oss_experts(device, down_bias):
    """kernels/triton_moe.py with gpt-oss's biases and clamped SwiGLU against
    kernels/swiglu_moe.py: an expert held elsewhere, one no token chose, gate and up values past
    the limit on both sides, and the down bias left to another rank (tensor parallel)."""
    from kernels import swiglu_moe, triton_moe

    torch.manual_seed(5)
    tokens, k, experts, hidden, width, alpha, limit = 9, 2, 5, 48, 24, 1.702, 1.5
    for dtype in DTYPES if device == "cuda" else [torch.float32]:
        x = torch.randn(tokens, hidden).to(device, dtype)
        weights = torch.rand(tokens, k, device=device).to(dtype)
        ids = torch.randint(0, experts - 1, (tokens, k), device=device)
        ids[0, -1] = -1
        gate_up, down = (torch.randn(experts, 2 * width, hidden) * 0.5).to(device, dtype), \
            (torch.randn(experts, hidden, width) * 0.5).to(device, dtype)
        gate_up_bias, bias = torch.randn(experts, 2 * width).to(device, dtype), torch.randn(experts, hidden).to(device, dtype)
        products = torch.nn.functional.linear(x, gate_up[0]).float()
        assert (products > limit).any() and (products < -limit).any()
        bias = bias if down_bias else None
        want = swiglu_moe.grouped_experts(x, weights, ids, gate_up, gate_up_bias, down, bias, alpha, limit)
        got = triton_moe.grouped_experts(x, weights, ids, gate_up, down, gate_up_bias, bias, (alpha, limit))
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # one float32 sum over a token's experts instead of rounded adds
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
