"""The native paged decode-attention kernel (kernels/csrc) against the torch path and SDPA.

The kernel is built (or loaded from the cache) by the first test that needs it.
"""
import logging
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import native
from kernels.attention import AttentionMetadata, paged_attention

REPO = Path(__file__).resolve().parents[1]


# The attention kernel's paths this CPU can execute, widest first (kernels/native.py): every
# test of `op` runs on each, so an AVX-512 machine also tests the AVX2 path the EPYCs take.
CPU_PATHS = {"AVX512": ["best", "avx2"], "AVX2": ["best"]}.get(torch.backends.cpu.get_cpu_capability(), [])


@pytest.fixture(scope="module", params=CPU_PATHS or ["portable"])
def op(request):
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the engine uses the torch path")
    kernel = native.paged_decode_attention_op(request.param)
    assert kernel is not None, "a compiler is here but the native kernel did not build (see the warning)"
    return kernel


def make_case(lens, heads, kv_heads, d, block_size, dtype=torch.float32, pad=0, seed=0):
    """A pool with each row's blocks scattered through it, block tables padded with `pad`."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    used = [-(-n // block_size) for n in lens]
    num_blocks = sum(used) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    width = max(used) + 2  # at least two padding entries per row
    tables = torch.full((len(lens), width), pad, dtype=torch.long)
    for row, k in enumerate(used):
        tables[row, :k] = torch.tensor([ids.pop() for _ in range(k)])
    slots = num_blocks * block_size
    k_cache = torch.randn(slots, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(slots, kv_heads, d, generator=g).to(dtype)
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def sdpa_reference(q, k_cache, v_cache, tables, lens, block_size, scale):
    """Row by row: gather exactly the row's keys, then F.scaled_dot_product_attention (fp32)."""
    out = []
    for b, n in enumerate(lens.tolist()):
        t = torch.arange(n)
        slots = tables[b, t // block_size] * block_size + t % block_size
        k, v = k_cache[slots].float().transpose(0, 1), v_cache[slots].float().transpose(0, 1)
        group = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        out.append(F.scaled_dot_product_attention(q[b].float()[:, None], k, v, scale=scale)[:, 0])
    return torch.stack(out)


def decode_meta(tables, lens, block_size):
    """Decode-only metadata as actors/worker/model_runner.py fills it."""
    keys = torch.arange(tables.shape[1] * block_size)
    mask = (keys[None, :] < lens[:, None])[:, None, None, :]
    return AttentionMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.long),
                             num_decode_tokens=len(lens), block_size=block_size,
                             decode_block_tables=tables, decode_context_lens=lens, decode_mask=mask)


def torch_path(q, k_cache, v_cache, meta, scale, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv("SHOAL_NATIVE_KERNELS", "0")
        return paged_attention(q, k_cache, v_cache, meta, scale)


MIXED_LENS = [1, 2, 3, 15, 16, 17, 33, 64, 100, 129, 255, 256, 257, 299, 300]


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2), (4, 1)], ids=["mha", "gqa4", "mqa"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_native_matches_torch_path_and_sdpa(op, monkeypatch, heads, kv_heads, block_size, d):
    lens = MIXED_LENS + [random.Random(d + block_size).randint(1, 300) for _ in range(5)]
    q, kc, vc, tables, lens_t = make_case(lens, heads, kv_heads, d, block_size, seed=d * block_size)
    scale = d ** -0.5
    meta = decode_meta(tables, lens_t, block_size)
    native_out = paged_attention(q, kc, vc, meta, scale)  # native (the default)
    torch_out = torch_path(q, kc, vc, meta, scale, monkeypatch)
    ref = sdpa_reference(q, kc, vc, tables, lens_t, block_size, scale)
    torch.testing.assert_close(native_out, torch_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(native_out, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 2, 3, 5])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (12, 6), (8, 2)])
def test_small_batches_split_kv_heads(op, batch, heads, kv_heads):
    """Few rows: the kernel splits each row's kv heads over tasks; same answer."""
    lens = [300, 1, 77, 16, 250][:batch]
    q, kc, vc, tables, lens_t = make_case(lens, heads, kv_heads, 64, 16, seed=batch)
    out = torch.empty_like(q)
    op(out, q, kc, vc, tables, lens_t, 16, 0.125)
    torch.testing.assert_close(out, sdpa_reference(q, kc, vc, tables, lens_t, 16, 0.125), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("block_size", [1, 6, 8, 16, 32])
@pytest.mark.parametrize("d", [24, 64])
def test_vector_and_portable_paths_agree(op, dtype, atol, block_size, d):
    """The vector path this CPU takes (AVX-512: 16 keys a step, for head_dim a multiple of 16;
    AVX2: 8 keys a step and V rows 4 at a time, for head_dim a multiple of 8; both with a vector
    exp) and the portable loop give the same attention, both within float32 rounding of SDPA.
    Block sizes that are not multiples of the lane count exercise the masked tails."""
    lens = MIXED_LENS + [31, 47]
    q, kc, vc, tables, lens_t = make_case(lens, 8, 2, d, block_size, dtype=dtype, seed=block_size)
    out = torch.empty_like(q)
    op(out, q, kc, vc, tables, lens_t, block_size, 0.125)
    for narrower in ("avx2", "portable"):  # (the AVX2 path is the portable loop on CPUs without it)
        ref_out = torch.empty_like(q)
        native.paged_decode_attention_op(narrower)(ref_out, q, kc, vc, tables, lens_t, block_size, 0.125)
        torch.testing.assert_close(out.float(), ref_out.float(), rtol=0, atol=1e-5 if dtype == torch.float32 else atol)
    ref = sdpa_reference(q, kc, vc, tables, lens_t, block_size, 0.125)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=atol)


def test_scores_far_apart_stay_finite(op):
    """Scores hundreds apart (exp underflows for all but the top key): no NaN, the top key's V."""
    q, kc, vc, tables, lens = make_case([40, 300], 4, 4, 64, 16, seed=5)
    q = q * 100
    out = torch.empty_like(q)
    op(out, q, kc, vc, tables, lens, 16, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, sdpa_reference(q, kc, vc, tables, lens, 16, 1.0), rtol=0, atol=1e-4)


def test_padding_entries_are_never_read(op):
    """Entries past a row's last block (here -1, which would fault) are ignored."""
    q, kc, vc, tables, lens = make_case([5, 40, 17], 8, 2, 64, 4, pad=-1)
    out = torch.empty_like(q)
    op(out, q, kc, vc, tables, lens, 4, 0.125)
    torch.testing.assert_close(out, sdpa_reference(q, kc, vc, tables, lens, 4, 0.125), rtol=0, atol=1e-5)


def test_strided_q_and_out(op):
    """q as the model hands it over: a view into the fused qkv output (rows not contiguous)."""
    _, kc, vc, tables, lens = make_case([9, 120, 31], 8, 2, 64, 16)
    qkv = torch.randn(3, 8 + 2 * 2, 64)
    q = qkv[:, :8]
    out_full = torch.zeros(3, 10, 64)
    out = out_full[:, 1:9]
    op(out, q, kc, vc, tables, lens, 16, 0.125)
    torch.testing.assert_close(out, sdpa_reference(q, kc, vc, tables, lens, 16, 0.125), rtol=0, atol=1e-5)
    assert out_full[:, 0].abs().sum() == 0 and out_full[:, 9].abs().sum() == 0


def test_kv_cache_views_of_the_engine_pool(op):
    """k_cache / v_cache as the engine passes them: kv_cache[layer, 0] and kv_cache[layer, 1]."""
    q, kc, vc, tables, lens = make_case([30, 200], 8, 4, 32, 8)
    pool = torch.zeros(3, 2, *kc.shape)
    pool[1, 0], pool[1, 1] = kc, vc
    out = torch.empty_like(q)
    op(out, q, pool[1, 0], pool[1, 1], tables, lens, 8, 0.2)
    torch.testing.assert_close(out, sdpa_reference(q, kc, vc, tables, lens, 8, 0.2), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 1.6e-2), (torch.float16, 2e-3)])
def test_half_precision_accumulates_in_float32(op, dtype, atol):
    lens = MIXED_LENS
    q, kc, vc, tables, lens_t = make_case(lens, 8, 2, 64, 16, dtype=dtype)
    out = torch.empty_like(q)
    op(out, q, kc, vc, tables, lens_t, 16, 0.125)
    assert out.dtype == dtype
    ref = sdpa_reference(q, kc, vc, tables, lens_t, 16, 0.125)  # fp32 on the same 16-bit inputs
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=atol)
    # and through paged_attention, which takes the native path for 16-bit caches too
    got = paged_attention(q, kc, vc, decode_meta(tables, lens_t, 16), 0.125)
    torch.testing.assert_close(got.float(), ref, rtol=0, atol=atol)


def test_bad_inputs_raise(op):
    q, kc, vc, tables, lens = make_case([20, 7], 8, 2, 64, 4)
    out = torch.empty_like(q)
    bad = tables.clone()
    bad[0, 1] = kc.shape[0]  # a block id past the pool
    with pytest.raises(RuntimeError, match="out of range"):
        op(out, q, kc, vc, bad, lens, 4, 0.125)
    with pytest.raises(RuntimeError, match="exceeds the block table"):
        op(out, q, kc, vc, tables[:, :2], lens, 4, 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        op(out, q.double(), kc, vc, tables, lens, 4, 0.125)
    with pytest.raises(RuntimeError, match="int32"):
        op(out, q, kc, vc, tables, lens.long(), 4, 0.125)


def test_env_var_forces_the_torch_path(monkeypatch):
    """SHOAL_NATIVE_KERNELS=0: no build, no native call, same numbers from the torch path."""
    monkeypatch.setenv("SHOAL_NATIVE_KERNELS", "0")
    monkeypatch.setattr(native, "_load", lambda *a: pytest.fail("native kernel used despite the env var"))
    assert native.paged_decode_attention_op() is None
    q, kc, vc, tables, lens = make_case([1, 50, 300], 8, 2, 64, 16)
    out = paged_attention(q, kc, vc, decode_meta(tables, lens, 16), 0.125)
    torch.testing.assert_close(out, sdpa_reference(q, kc, vc, tables, lens, 16, 0.125), rtol=0, atol=1e-5)


def test_failed_build_warns_once_and_falls_back(tmp_path, monkeypatch, caplog):
    (tmp_path / "broken.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(native, "_CSRC", tmp_path)
    monkeypatch.setattr(native, "_libraries", {})
    monkeypatch.setenv("SHOAL_KERNEL_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="shoal.kernels"):
        assert native._load("broken", ["broken.cpp"]) is False
        assert native._load("broken", ["broken.cpp"]) is False  # cached: no second build
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "torch path" in warnings[0].getMessage()


def test_importing_kernels_builds_nothing(tmp_path):
    code = textwrap.dedent("""
        import sys
        import kernels, kernels.attention, kernels.native
        assert not kernels.native._libraries
        assert "torch.utils.cpp_extension" not in sys.modules
    """)
    env = dict(os.environ, SHOAL_KERNEL_CACHE=str(tmp_path / "cache"))
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, timeout=120)
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_concurrent_first_builds_share_one_build(tmp_path):
    """Two processes building into an empty cache at once (with a stale torch lock file left
    by a killed build) both get a working kernel; a third reuses the build."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: nothing to build")
    cache = tmp_path / "cache"
    code = textwrap.dedent("""
        import time, torch
        from kernels import native
        from kernels.attention import paged_attention
        op = native.paged_decode_attention_op()
        assert op is not None
        q = torch.randn(2, 4, 16); k = torch.randn(8, 2, 16); v = torch.randn(8, 2, 16)
        out = torch.empty_like(q)
        op(out, q, k, v, torch.tensor([[0, 1], [1, 0]]), torch.tensor([5, 8], dtype=torch.int32), 4, 0.25)
        print(f"{native.last_build_seconds:.2f}")
    """)
    env = dict(os.environ, SHOAL_KERNEL_CACHE=str(cache))
    env.pop("SHOAL_NATIVE_KERNELS", None)
    # The build folder's name is a hash of the inputs: find it, and leave a stale torch lock there.
    probe = "from kernels import native; print(native.build_dir('paged_attention', ['paged_attention.cpp']))"
    build_dir = Path(subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, check=True,
                                    capture_output=True, text=True, timeout=120).stdout.strip())
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    assert len(list(build_dir.glob("*.so"))) == 1
    again = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True,
                           capture_output=True, text=True, timeout=300)
    assert float(again.stdout.strip()) < 5  # a cache hit: no compiler, no ninja


def test_engine_uses_native_kernel(checkpoint_factory, op):
    """Greedy decoding through the engine with the native kernel equals transformers."""
    from oracle import hf_greedy

    from actors.engine.llm import LLM
    from actors.sampling_params import SamplingParams

    path = checkpoint_factory("llama")
    calls = []
    real = native.paged_decode_attention_op

    def counting():
        calls.append(1)
        return real()

    prompts = [[5, 17, 3], list(range(40, 80)), [9]]
    llm = LLM(str(path), block_size=4, num_kv_blocks=64)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(native, "paged_decode_attention_op", counting)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert calls, "the decode steps did not go through the native kernel"
    for ids, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(path, ids, 16)


def test_engine_held_to_the_portable_path(checkpoint_factory, op, monkeypatch, caplog):
    """SHOAL_CPU_ATTENTION=portable: the engine reports and takes the portable loop, and its
    greedy tokens still equal transformers; an unknown value stops the start with its name."""
    import logging

    from oracle import hf_greedy

    from actors.engine.llm import LLM
    from actors.sampling_params import SamplingParams

    path = checkpoint_factory("llama")
    monkeypatch.setenv("SHOAL_CPU_ATTENTION", "portable")
    assert native.paged_decode_attention_op() == torch.ops.shoal.paged_decode_attention_portable.default
    with caplog.at_level(logging.INFO, logger="shoal.runner"):
        llm = LLM(str(path), block_size=4, num_kv_blocks=64)
    assert "attention cpp-portable" in caplog.text
    prompts = [[5, 17, 3], list(range(40, 60))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for ids, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(path, ids, 8)
    monkeypatch.setenv("SHOAL_CPU_ATTENTION", "avx9")
    with pytest.raises(ValueError, match="SHOAL_CPU_ATTENTION must be one of best, avx2, portable"):
        LLM(str(path), block_size=4, num_kv_blocks=64)


def mixed_step(chunks, heads, kv_heads, d, block_size, decode_lens=(40, 7), seed=0):
    """A step of decode rows then prefill chunks ((tokens, first position) each) over one pool,
    laid out as actors/worker/model_runner.py lays it out; every key the step reads is in the pool."""
    lens = list(decode_lens) + [start + n for n, start in chunks]
    q_rows, kc, vc, tables, _ = make_case(lens, heads, kv_heads, d, block_size, seed=seed)
    nd = len(decode_lens)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(nd + sum(n for n, _ in chunks), heads, d, generator=g)
    row, spans = nd, []
    for n, start in chunks:
        spans.append((row, n, start))
        row += n
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(q), dtype=torch.long), num_decode_tokens=nd,
                             block_size=block_size, decode_block_tables=tables[:nd],
                             decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32),
                             prefill_chunks=spans, prefill_block_tables=tables[nd:])
    return q, kc, vc, meta


@pytest.mark.parametrize("chunks", [
    [(5, 37), (16, 100), (1, 3), (9, 64)],  # all short continuations: one contiguous kernel call
    [(20, 0), (5, 37), (17, 50), (16, 100), (1, 3), (40, 16), (2, 290)],  # short ones between others
], ids=["contiguous", "interleaved"])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2)], ids=["mha", "gqa4"])
def test_short_prefill_chunks_through_the_decode_kernel(op, monkeypatch, chunks, heads, kv_heads):
    """Continuation chunks of up to SHORT_CHUNK tokens (prefix-cache hits) run as decode rows, a
    row per token; the rest as before. Same numbers as the torch path, chunk by chunk."""
    from kernels.attention import SHORT_CHUNK

    q, kc, vc, meta = mixed_step(chunks, heads, kv_heads, 64, 16)
    native_out = paged_attention(q, kc, vc, meta, 0.125)
    long_chunks = [i for i, (n, start) in enumerate(chunks) if start == 0 or n > SHORT_CHUNK]
    assert meta.short_chunks.rest == long_chunks
    meta.short_chunks = None
    torch.testing.assert_close(native_out, torch_path(q, kc, vc, meta, 0.125, monkeypatch), rtol=0, atol=1e-5)


def dense_reference(q, k_cache, v_cache, meta, scale, window=None, softcap=None, sinks=None):
    """Token by token in float64, straight from the definitions: a query at position p sees
    keys max(0, p - window + 1) .. p; scores soft-capped to softcap * tanh(s / softcap); a
    head's sink is one more logit in its softmax, whose weight goes nowhere."""
    rows = [(i, tables_row, n - 1) for i, (tables_row, n) in
            enumerate(zip(meta.decode_block_tables, meta.decode_context_lens.tolist()))]
    for j, (row, n, start) in enumerate(meta.prefill_chunks or []):
        rows += [(row + i, meta.prefill_block_tables[j], start + i) for i in range(n)]
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for row, table, pos in rows:
        t = torch.arange(max(0, pos - window + 1) if window else 0, pos + 1)
        slots = table[t // meta.block_size] * meta.block_size + t % meta.block_size
        k = k_cache[slots].double().repeat_interleave(group, 1)  # [keys, heads, d]
        v = v_cache[slots].double().repeat_interleave(group, 1)
        s = torch.einsum("hd,khd->hk", q[row].double(), k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if sinks is not None:
            s = torch.cat((s, sinks.double()[:, None]), -1)
        p = s.softmax(-1)[:, :k.shape[0]]
        out[row] = torch.einsum("hk,khd->hd", p, v).to(q.dtype)
    return out


def assert_every_cpu_path(monkeypatch, q, kc, vc, meta, want, window=None, softcap=None, sinks=None):
    """paged_attention with the native kernel, then with the torch path (short chunks through
    SDPA), then the kernel's portable decode loop alone, each equal to `want`; returns (the
    portable op, its output, the decode rows) for further checks."""
    torch.testing.assert_close(paged_attention(q, kc, vc, meta, 0.125, window=window, softcap=softcap, sinks=sinks),
                               want, rtol=0, atol=2e-5)
    meta.short_chunks = None
    with monkeypatch.context() as m:
        m.setenv("SHOAL_NATIVE_KERNELS", "0")
        got = paged_attention(q, kc, vc, meta, 0.125, window=window, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    nd = meta.num_decode_tokens
    portable = torch.ops.shoal.paged_decode_attention_portable.default
    out = torch.empty_like(q[:nd])
    portable(out, q[:nd], kc, vc, meta.decode_block_tables, meta.decode_context_lens, 16, 0.125, window or 0,
             softcap or 0.0, *(() if sinks is None else (sinks,)))
    torch.testing.assert_close(out, want[:nd], rtol=0, atol=2e-5)
    return portable, out, nd


@pytest.mark.parametrize("window,softcap", [(5, None), (20, None), (None, 3.0), (7, 2.5)])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2)], ids=["mha", "gqa4"])
def test_sliding_window_and_softcap_on_every_cpu_path(op, monkeypatch, window, softcap, heads, kv_heads):
    """Mistral's / Gemma's windows and Gemma 2's score soft-capping: the native kernel (its
    vector path and its portable loop) and the torch path equal the definition, over decode rows
    and chunks longer and shorter than the window, starting their sequence or continuing it."""
    chunks = [(20, 0), (5, 37), (17, 50), (3, 0), (16, 100), (2, 290)]
    q, kc, vc, meta = mixed_step(chunks, heads, kv_heads, 64, 16, decode_lens=(40, 7, 3))
    want = dense_reference(q, kc, vc, meta, 0.125, window, softcap)
    assert_every_cpu_path(monkeypatch, q, kc, vc, meta, want, window=window, softcap=softcap)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2)], ids=["mha", "gqa4"])
def test_attention_sinks_on_every_cpu_path(op, monkeypatch, window, heads, kv_heads):
    """gpt-oss's sinks: the native kernel (its vector path and its portable loop) and the torch
    path (SDPA's chunk path, the decode rows' gather) equal the definition, with and without a
    window; the sinks are large enough that leaving them out changes every row."""
    chunks = [(20, 0), (5, 37), (17, 50), (3, 0), (16, 100), (2, 290)]
    q, kc, vc, meta = mixed_step(chunks, heads, kv_heads, 64, 16, decode_lens=(40, 7, 3))
    sinks = torch.linspace(0.0, 4.0, heads)
    want = dense_reference(q, kc, vc, meta, 0.125, window, sinks=sinks)
    assert (want - dense_reference(q, kc, vc, meta, 0.125, window)).abs().amax(dim=(1, 2)).min() > 1e-3
    portable, out, nd = assert_every_cpu_path(monkeypatch, q, kc, vc, meta, want, window=window, sinks=sinks)
    with pytest.raises(RuntimeError, match="sinks must be a contiguous CPU float32"):
        portable(out, q[:nd], kc, vc, meta.decode_block_tables, meta.decode_context_lens, 16, 0.125, 0, 0.0,
                 sinks[:4])
