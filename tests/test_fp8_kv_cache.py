"""--kv-cache-dtype fp8: the paged pool holds float8 e4m3 with one K and one V scale per layer
(kernels/kv_quant.py), and every attention path reads it.

Kernels: each path (the torch path, the C++ kernel on each vector path this CPU has, Triton
under its interpreter: one-launch and split-KV decode, with sinks, windows and soft-capping)
on an fp8 pool against the same path on a float32 pool holding the round-tripped values
(stored * scale): both read the same float32 numbers, so the results agree to float32 rounding
of the order of operations (atol 1e-6; measured 0 on the 2-core EPYC).

Engine: against the oracle, transformers float32 whose attention sees K/V round-tripped
through e4m3 with the same scales (after rotary; DeepSeek's latent and rotary key before the
up-projection): greedy tokens equal and prompt log-probs within 1e-4, with checkpoint scales,
prefix-cache hits and preemption; the pool really holds one byte an element. (CPU's compiled
decode over fp8 blocks: tests/test_compiled_decode.py, its compile job beside the others.)
"""
from __future__ import annotations

import contextlib
import os
import shutil

import pytest
import torch
from oracle import hf_greedy, hf_prompt_logprobs
from safetensors.torch import save_file
from test_engine import assert_pool_free, prompts_of
from test_kernels import mixed_step as kernels_step

from actors.config import EngineConfig
from actors.engine.llm import LLM
from actors.sampling_params import SamplingParams
from actors.worker import kernel_choice
from kernels import kv_quant, native, triton_programs
from kernels.attention import paged_attention

ATOL = 1e-6
CPU_PATHS = ["portable"] + {"AVX512": ["avx2", "best"], "AVX2": ["best"]}.get(
    torch.backends.cpu.get_cpu_capability(), [])


# --------------------------------------------------------------------------- the format

def test_quantize_rounds_to_e4m3_and_saturates():
    x = torch.tensor([0.0, 1.0, -1.0, 0.3, 447.0, 1000.0, -1e9, 2.0 ** -9, 17.0])
    q = kv_quant.quantize(x, 1.0)
    assert q.dtype == torch.float8_e4m3fn and q.element_size() == 1
    assert q.float().tolist() == [0.0, 1.0, -1.0, 0.3125, 448.0, 448.0, -448.0, 2.0 ** -9, 16.0]
    assert kv_quant.round_trip(torch.tensor([3.0, 900.0]), 2.0).tolist() == [3.0, 896.0]  # 448 x 2
    y = torch.randn(1000) * 5
    assert torch.equal(kv_quant.round_trip(kv_quant.round_trip(y, 0.7), 0.7), kv_quant.round_trip(y, 0.7))
    assert kv_quant.kv_cache_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_quant.kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16


def fp8_pools(k_cache, v_cache, k_scale, v_scale):
    """(fp8 K, fp8 V, float32 K, float32 V): the pools quantised, and what they hold as float."""
    k8, v8 = kv_quant.quantize(k_cache, k_scale), kv_quant.quantize(v_cache, v_scale)
    return k8, v8, kv_quant.dequantize(k8, k_scale, torch.float32), kv_quant.dequantize(v8, v_scale, torch.float32)


def mixed_step(chunks, heads, kv_heads, d, block_size, decode_lens=(40, 7), seed=0):
    """test_kernels' step (decode rows then prefill chunks over one scattered pool, as the model
    runner lays a step out) with K spread wider than V, so the scales matter; and its decode
    rows' context lengths and block tables."""
    q, k_cache, v_cache, meta = kernels_step(chunks, heads, kv_heads, d, block_size, decode_lens, seed)
    return q, k_cache * 4, v_cache, meta, meta.decode_context_lens, meta.decode_block_tables


def through_entry(q, k, v, meta, **kw):
    meta.short_chunks = None  # built per step: the fp8 and float calls each build their own
    return paged_attention(q, k, v, meta, 0.125, **kw)


CHUNKS = [(20, 0), (5, 37), (17, 50), (16, 100), (1, 3), (2, 290)]  # starts, continuations, short and long


@pytest.mark.parametrize("native_kernels", ["0", "1"], ids=["torch", "native"])
@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (9, 2.5, False), (None, None, True)],
                         ids=["plain", "window-softcap", "sinks"])
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 64), (4, 4, 24)], ids=["gqa-d64", "mha-d24"])
def test_cpu_paths_on_fp8_equal_float_on_round_tripped_kv(monkeypatch, native_kernels, window, softcap, sinks,
                                                          heads, kv_heads, d):
    """The attention entry point (decode rows, short continuation chunks through the decode
    kernel, long chunks and chunks that start their sequence through SDPA)."""
    monkeypatch.setenv("SHOAL_NATIVE_KERNELS", native_kernels)
    q, kc, vc, meta, _, _ = mixed_step(CHUNKS, heads, kv_heads, d, 16)
    k8, v8, kf, vf = fp8_pools(kc, vc, 0.37, 1.9)
    extra = dict(window=window, softcap=softcap, sinks=torch.randn(heads) if sinks else None)
    got = through_entry(q, k8, v8, meta, k_scale=0.37, v_scale=1.9, **extra)
    want = through_entry(q, kf, vf, meta, **extra)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    assert (got - through_entry(q, kc, vc, meta, **extra)).abs().max() > 1e-3  # the rounding is real


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("d", [16, 24, 64, 128])  # 24: AVX2's 8 lanes but not AVX-512's 16
def test_native_kernel_every_vector_path(path, d):
    """The C++ kernel held to each path this CPU can run, on decode rows of many lengths; an
    fp8 pool with float32 queries reads exactly the float32 numbers of the round-tripped pool."""
    op = native.paged_decode_attention_op(path)
    if op is None:
        pytest.skip("no native kernel here")
    lens = [1, 2, 15, 16, 17, 33, 100, 129, 257]
    q, kc, vc, meta, lens, tables = mixed_step([], 8, 2, d, 16, decode_lens=lens, seed=d)
    k8, v8, kf, vf = fp8_pools(kc, vc, 0.05, 3.0)
    sinks = torch.randn(8)
    got, want = torch.empty_like(q), torch.empty_like(q)
    ctx = meta.decode_context_lens
    op(got, q, k8, v8, tables, ctx, 16, 0.125, 0, 0.0, sinks, 0.05, 3.0)
    op(want, q, kf, vf, tables, ctx, 16, 0.125, 0, 0.0, sinks)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    # 16-bit queries over the fp8 pool: the float32 result, rounded once at the end
    got16 = torch.empty_like(q, dtype=torch.bfloat16)
    op(got16, q.bfloat16(), k8, v8, tables, ctx, 16, 0.125, 0, 0.0, sinks, 0.05, 3.0)
    op(want, q.bfloat16().float(), kf, vf, tables, ctx, 16, 0.125, 0, 0.0, sinks)
    torch.testing.assert_close(got16.float(), want, rtol=0, atol=2 ** -8 * want.abs().max().item())


def test_native_kernel_refuses_scales_on_a_float_pool_and_mixed_caches():
    op = native.paged_decode_attention_op()
    if op is None:
        pytest.skip("no native kernel here")
    q, kc, vc, meta, lens, tables = mixed_step([], 4, 2, 16, 4, decode_lens=[5])
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="k_scale / v_scale are for float8 caches only"):
        op(out, q, kc, vc, tables, meta.decode_context_lens, 4, 0.25, 0, 0.0, None, 2.0, 1.0)
    with pytest.raises(RuntimeError, match="one dtype"):
        op(out, q, kv_quant.quantize(kc, 1.0), vc, tables, meta.decode_context_lens, 4, 0.25)


@pytest.fixture
def interpreted():
    if not triton_programs.available():
        pytest.skip("Triton is not installed")
    if not triton_programs.interpreted():
        pytest.skip("Triton's interpreter is off (CUDA is here)")


def triton_step(monkeypatch, rows, split, heads, kv_heads, d, block_size, split_min_keys, device):
    """A Triton step of `rows` ((tokens, first position) each) on `device`: its queries, its
    metadata (split-KV forced with `split`), and fp8_pools' four pools (scales 0.37 and 1.9)."""
    from kernels import triton_attention as ta
    _, kc, vc, _, lens, tables = mixed_step([], heads, kv_heads, d, block_size, decode_lens=[s + n for n, s in rows])
    q = torch.randn(sum(n for n, _ in rows), heads, d, generator=torch.Generator().manual_seed(1))
    if split:
        monkeypatch.setattr(ta, "SPLIT_MIN_KEYS", split_min_keys)
    meta = ta.build_metadata([n for n, _ in rows], lens.clone(), tables, block_size, device)
    assert (meta.splits > 1) == split
    return q.to(device), meta, tuple(t.to(device) for t in fp8_pools(kc, vc, 0.37, 1.9))


@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (7, 2.5, True)], ids=["plain", "all"])
@pytest.mark.parametrize("split", [False, True], ids=["one-launch", "split-kv"])
def test_triton_kernels_on_fp8_equal_float_on_round_tripped_kv(interpreted, monkeypatch, window, softcap, sinks,
                                                               split):
    from kernels import triton_attention as ta
    heads = 4
    rows = [(1, 40), (1, 9)] if split else [(1, 9), (1, 40), (5, 0), (3, 11)]
    q, meta, (k8, v8, kf, vf) = triton_step(monkeypatch, rows, split, heads, 2, 16, 4, 8, "cpu")
    extra = dict(window=window, softcap=softcap, sinks=torch.randn(heads) if sinks else None)
    got = ta.paged_attention(q, k8, v8, meta, 0.25, k_scale=0.37, v_scale=1.9, **extra)
    want = ta.paged_attention(q, kf, vf, meta, 0.25, **extra)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [False, True], ids=["one-launch", "split-kv"])
def test_triton_kernels_compiled_on_cuda(monkeypatch, dtype, split):
    """The same comparison compiled on a GPU (not run on the CPU machines): bf16 queries read
    the round-tripped values rounded to bf16 on both sides."""
    from kernels import triton_attention as ta
    heads = 8
    rows = [(1, 700), (1, 90)] if split else [(1, 9), (1, 400), (37, 0), (5, 60)]
    q, meta, (k8, v8, kf, vf) = triton_step(monkeypatch, rows, split, heads, 2, 128, 16, 64, "cuda")
    q, sinks = q.to(dtype), torch.randn(heads, device="cuda")
    got = ta.paged_attention(q, k8, v8, meta, 0.1, sinks=sinks, k_scale=0.37, v_scale=1.9)
    want = ta.paged_attention(q, kf.to(dtype), vf.to(dtype), meta, 0.1, sinks=sinks)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL if dtype == torch.float32 else 1e-2)


def test_flash_attn_is_refused_and_auto_passes_it_over():
    with pytest.raises(ValueError, match="flash can't read an fp8 KV cache"):
        kernel_choice.attention_backend(EngineConfig(attn_backend="flash", kv_cache_dtype="fp8"),
                                        torch.bfloat16, 64, fp8_kv=True)
    assert kernel_choice.attention_backend(EngineConfig(device="cpu"), torch.float32, 64, fp8_kv=True) == \
        ("native", None)


def test_a_bad_value_is_refused_at_start(tmp_path):
    from app.config import ConfigError, load_config
    from test_option_aliases import from_cli
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, fp8, fp8_e4m3, got 'int8'"):
        EngineConfig(kv_cache_dtype="int8").validate()
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of"):
        load_config({}, environ={"SHOAL_KV_CACHE_DTYPE": "fp16"})
    with pytest.raises(SystemExit):
        from_cli(["--kv-cache-dtype", "e4m3"])
    # and every way of giving it arrives
    assert from_cli(["--kv-cache-dtype", "fp8"]).engine.kv_cache_dtype == "fp8"
    assert load_config({}, environ={"SHOAL_KV_CACHE_DTYPE": "fp8_e4m3"}).engine.kv_cache_dtype == "fp8_e4m3"
    (tmp_path / "c.yaml").write_text("kv_cache_dtype: fp8\n")
    assert load_config({"config": str(tmp_path / "c.yaml")}, environ={}).engine.kv_cache_dtype == "fp8"
    from app.serving.ray_llm_config import load_configs
    [config] = load_configs({"llm_configs": [{"engine_kwargs": {"kv_cache_dtype": "fp8"}}]})
    assert config.engine.kv_cache_dtype == "fp8"


# --------------------------------------------------------------------------- the engine

def with_kv_scales(src, dst, scales: dict[int, tuple[float, float]], names=("k_scale", "v_scale")):
    """A copy of checkpoint `src` with per-layer KV scale tensors beside its weights, named as
    LLM Compressor writes them (`model.layers.N.self_attn.k_scale`)."""
    shutil.copytree(src, dst)
    tensors = {}
    for layer, (k, v) in scales.items():
        tensors[f"model.layers.{layer}.self_attn.{names[0]}"] = torch.tensor(k)
        tensors[f"model.layers.{layer}.self_attn.{names[1]}"] = torch.tensor(v)
    save_file(tensors, str(dst / "kv_scales.safetensors"))
    return dst


@contextlib.contextmanager
def hf_round_trips_kv(scales: dict[int, tuple[float, float]] | None = None):
    """transformers' attention sees K/V as the fp8 pool gives them back (per layer scales,
    default 1.0): Llama, Qwen3 and gpt-oss K/V after rotary, DeepSeek's latent and rotary key."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds
    from transformers.models.gpt_oss import modeling_gpt_oss as go
    from transformers.models.llama import modeling_llama as ll
    from transformers.models.qwen3 import modeling_qwen3 as qw
    scales = scales or {}

    def wrap(attend):
        def attention(module, query, key, value, *args, **kwargs):
            ks, vs = scales.get(module.layer_idx, (1.0, 1.0))
            return attend(module, query, kv_quant.round_trip(key, ks), kv_quant.round_trip(value, vs), *args, **kwargs)
        return attention

    expand = ds.DeepseekV3Attention.expand_kv

    def expand_kv(self, kv_nope, k_rot):
        ks = scales.get(self.layer_idx, (1.0, 1.0))[0]
        return expand(self, kv_quant.round_trip(kv_nope, ks), kv_quant.round_trip(k_rot, ks))

    with pytest.MonkeyPatch.context() as m:
        for module in (ll, go, qw):
            m.setattr(module, "eager_attention_forward", wrap(module.eager_attention_forward))
        m.setattr(ds.DeepseekV3Attention, "expand_kv", expand_kv)
        yield


def check_against_round_tripped_hf(path, llm, prompts, max_tokens=16, scales=None, logprobs=True):
    """Greedy tokens equal the round-tripped oracle's, prompt log-probs within 1e-4 of its; and
    the rounding shows: the plain float oracle's log-probs differ by more than that."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            prompt_logprobs=0 if logprobs else None)
    outs = llm.generate(prompts, params)
    with hf_round_trips_kv(scales):
        want_tokens = [hf_greedy(path, ids, max_tokens) for ids in prompts]
        want_logprobs = [hf_prompt_logprobs(path, ids) for ids in prompts] if logprobs else []
    for ids, out, tokens in zip(prompts, outs, want_tokens):
        assert out.outputs[0].token_ids == tokens, f"prompt of {len(ids)} tokens"
    moved = 0.0
    for ids, out, want in zip(prompts, outs, want_logprobs):
        ours = [next(iter(d.values())) for d in out.prompt_logprobs[1:]]
        assert ours == pytest.approx(want, abs=1e-4)
        if want:
            moved = max(moved, max(abs(a - b) for a, b in zip(want, hf_prompt_logprobs(path, ids))))
    if logprobs:
        assert moved > 1e-4
    return outs


def pool_of(llm):
    return llm.engine.executor.runner.kv_cache


KV_SCALES = {0: (0.03125, 0.0078125), 1: (0.046875, 0.01171875)}  # exact in float32, as stored


@pytest.fixture(scope="module")
def llama_scaled(checkpoint_factory, tmp_path_factory):
    """A Llama checkpoint with LLM Compressor's per-layer KV scales (2 layers)."""
    path = with_kv_scales(checkpoint_factory("llama"), tmp_path_factory.mktemp("fp8kv") / "llama", KV_SCALES)
    return path, KV_SCALES


def test_llama_with_checkpoint_scales_equals_the_round_tripped_oracle(llama_scaled):
    path, scales = llama_scaled
    llm = LLM(str(path), kv_cache_dtype="fp8", block_size=4, num_kv_blocks=64, max_num_batched_tokens=32)
    attn = llm.engine.executor.runner.model.model.layers[1].self_attn
    assert (attn.k_scale, attn.v_scale) == scales[1]
    assert pool_of(llm).dtype == torch.float8_e4m3fn and pool_of(llm).element_size() == 1
    # chunked prefill (32-token steps), decodes batched with prefills
    check_against_round_tripped_hf(path, llm, prompts_of([3, 17, 40, 1], seed=2), scales=scales)
    assert_pool_free(llm)


def test_scales_of_one_without_them_and_the_older_names(checkpoint_factory, tmp_path):
    path = checkpoint_factory("llama")
    llm = LLM(str(path), kv_cache_dtype="fp8_e4m3", block_size=4, num_kv_blocks=32)
    assert all((b.self_attn.k_scale, b.self_attn.v_scale) == (1.0, 1.0) for b in llm.engine.executor.runner.model.model.layers)
    check_against_round_tripped_hf(path, llm, prompts_of([12, 5], seed=3))
    older = with_kv_scales(path, tmp_path / "older", {0: (0.375, 0.25)}, names=("k_proj.output_scale", "v_proj.output_scale"))
    attn = LLM(str(older), kv_cache_dtype="fp8", num_kv_blocks=8).engine.executor.runner.model.model.layers[0].self_attn
    assert (attn.k_scale, attn.v_scale) == (0.375, 0.25)


def test_prefix_cache_hits_and_preemption_with_fp8_blocks(llama_scaled):
    path, scales = llama_scaled
    llm = LLM(str(path), kv_cache_dtype="fp8", block_size=4, num_kv_blocks=64)
    shared = prompts_of([33], seed=3)[0]
    check_against_round_tripped_hf(path, llm, [shared + [5, 6]], scales=scales, logprobs=False)
    [hit] = check_against_round_tripped_hf(path, llm, [shared + [7, 8, 9]], scales=scales, logprobs=False)
    assert hit.num_cached_tokens == 32  # the shared prefix's 8 fp8 blocks read back as they were written
    assert_pool_free(llm)
    small = LLM(str(path), kv_cache_dtype="fp8", block_size=4, num_kv_blocks=24, max_num_batched_tokens=64)
    check_against_round_tripped_hf(path, small, prompts_of([20, 25, 18, 30, 22], seed=4), max_tokens=30,
                                   scales=scales, logprobs=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert_pool_free(small)


def test_the_same_memory_holds_four_times_the_float32_blocks(checkpoint_factory):
    path = checkpoint_factory("llama")
    f32 = LLM(str(path), kv_cache_memory=0.001, block_size=4)
    fp8 = LLM(str(path), kv_cache_memory=0.001, block_size=4, kv_cache_dtype="fp8")
    r32, r8 = f32.engine.executor.runner, fp8.engine.executor.runner
    assert pool_of(f32).dtype == torch.float32 and pool_of(fp8).element_size() == 1
    assert r32.block_bytes() == 4 * r8.block_bytes()  # sized at one byte an element
    assert fp8.engine.blocks.num_blocks == int(0.001 * 2**30) // r8.block_bytes() >= 4 * f32.engine.blocks.num_blocks
    assert pool_of(fp8).nbytes == r8.block_bytes() * (fp8.engine.blocks.num_blocks + (r8.kernels.decode != "eager"))


def test_triton_backend_engine_over_fp8_blocks(interpreted, checkpoint_factory):
    """The Triton backend (interpreted here) with an fp8 pool: its fused norm-rotary-write
    kernel writes float K/V, so the layer writes through write_kv instead."""
    path = checkpoint_factory("qwen3")
    llm = LLM(str(path), kv_cache_dtype="fp8", attn_backend="triton", block_size=4, num_kv_blocks=32)
    assert llm.engine.spec.attn_backend == "triton"
    check_against_round_tripped_hf(path, llm, prompts_of([7, 13], seed=7), max_tokens=8)
    assert_pool_free(llm)


def backend_options(backend, request) -> dict:
    if backend == "triton":
        request.getfixturevalue("interpreted")
    return {"attn_backend": backend}


@pytest.mark.parametrize("backend", ["native", "triton"])
def test_deepseek_latent_cache_in_fp8(checkpoint_factory, backend, request):
    path = checkpoint_factory("deepseek_v3", rope_interleave=False)
    llm = LLM(str(path), kv_cache_dtype="fp8", block_size=4, num_kv_blocks=32, **backend_options(backend, request))
    assert pool_of(llm).shape[1] == 1 and llm.engine.spec.attn_backend == backend  # MLA's one latent plane
    check_against_round_tripped_hf(path, llm, prompts_of([9, 21], seed=5), max_tokens=8)
    assert_pool_free(llm)


@pytest.mark.parametrize("backend", ["native", "triton"])
def test_gpt_oss_sinks_over_fp8_blocks(checkpoint_factory, backend, request):
    path = checkpoint_factory("gpt_oss")
    llm = LLM(str(path), kv_cache_dtype="fp8", block_size=4, num_kv_blocks=32, **backend_options(backend, request))
    assert llm.engine.spec.attn_backend == backend
    check_against_round_tripped_hf(path, llm, prompts_of([9, 21], seed=6), max_tokens=8)
    assert_pool_free(llm)


@pytest.mark.slow
def test_pipeline_parallel_stages_each_read_their_layers_scales(llama_scaled):
    """pp=2 (Ray actors, gloo): each stage holds its layers' fp8 blocks and their checkpoint
    scales (stage 1's first layer is the checkpoint's layer 1); what crosses stages is hidden
    states, so the outputs are one rank's."""
    import ray
    path, scales = llama_scaled
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False)
    try:
        llm = LLM(str(path), kv_cache_dtype="fp8", pp_size=2, shard_cpus=0.5, block_size=4, num_kv_blocks=64,
                  max_num_batched_tokens=24)
        try:
            check_against_round_tripped_hf(path, llm, prompts_of([5, 30, 13], seed=8), max_tokens=12, scales=scales)
            assert_pool_free(llm)
        finally:
            llm.shutdown()
    finally:
        ray.shutdown()


def test_a_draft_model_caches_in_fp8_too(checkpoint_factory, tmp_path):
    """Speculative decoding with a draft model: both pools hold fp8 (the draft's sized at one byte
    an element beside the target's), and greedy tokens stay the round-tripped oracle's."""
    from checkpoints import draft_copy
    path = checkpoint_factory("llama")
    draft = draft_copy(path, tmp_path / "draft", [0])
    llm = LLM(str(path), kv_cache_dtype="fp8", block_size=4, num_kv_blocks=48,
              speculative_config={"model": str(draft), "num_speculative_tokens": 3, "disable_by_batch_size": 64})
    proposer = llm.engine.scheduler.speculator.proposer
    proposer_pool = proposer.runner.kv_cache
    assert proposer_pool.dtype == torch.float8_e4m3fn and proposer_pool.element_size() == 1
    assert proposer.block_bytes() == proposer.runner.block_bytes()  # what rank 0 set aside for it
    llm.engine.scheduler.speculator.compared_steps = 10**9  # keep drafting (this test is not about speed)
    check_against_round_tripped_hf(path, llm, prompts_of([9, 20], seed=9), logprobs=False)
    assert llm.engine.scheduler.speculator.num_draft_tokens > 0
    assert_pool_free(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_on_cuda_with_graphs(checkpoint_factory, monkeypatch):
    """On a GPU (not run on the CPU machines): auto picks Triton (never flash-attn) for the fp8
    pool, CUDA graphs capture the quantising write, and float32 outputs are the round-tripped
    oracle's (log-probs within 1e-3: GPU against CPU float32 reductions, as tests/test_gpu.py)."""
    monkeypatch.delenv("SHOAL_EAGER_DECODE", raising=False)  # (the suite's: graphs are tested here)
    path = checkpoint_factory("llama")
    llm = LLM(str(path), device="cuda", dtype="float32", kv_cache_dtype="fp8", block_size=16, num_kv_blocks=64)
    assert llm.engine.spec.attn_backend == "triton" and llm.engine.executor.runner.kernels.decode == "cuda-graphs"
    prompts = prompts_of([3, 17, 40], seed=10)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0))
    with hf_round_trips_kv():
        for ids, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy(path, ids, 16)
            ours = [next(iter(d.values())) for d in out.prompt_logprobs[1:]]
            assert ours == pytest.approx(hf_prompt_logprobs(path, ids), abs=1e-3)
