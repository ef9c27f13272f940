"""The GPU engine path, as far as a CPU machine can check it: backend choice and its one
warning, the new options, KV sizing arithmetic, graph buckets and padding, and the flash and
CUDA-graph code paths run end to end on CPU against stand-ins that follow the libraries'
documented semantics (the real kernels are covered by tests/test_gpu.py, CUDA only)."""
from __future__ import annotations

import logging
import random

import pytest
import torch
from oracle import assert_equals_eager_and_hf, hf_greedy

from actors.config import EngineConfig
from actors.core.step import SchedulerOutput, StepRow
from actors.engine.llm import LLM
from actors.engine.metrics import DecodeProgress
from actors.sampling_params import SamplingParams
from actors.worker import kernel_choice, model_spec
from actors.worker import memory_profile as mp
from actors.worker.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from actors.worker.input_batch import InputBatch
from actors.worker.kernel_choice import graphs_off_reason
from kernels import flash_attention as fa
from kernels.attention import AttentionMetadata, paged_attention

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts_of(lengths, seed=0, vocab=500):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


# --------------------------------------------------------------------------- backend choice

def shoal_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("shoal")]


def test_cpu_start_logs_no_warning_unless_flash_is_asked_for(checkpoint_factory, caplog):
    path = checkpoint_factory("llama")
    with caplog.at_level(logging.INFO):
        llm = LLM(str(path), num_kv_blocks=32)
    assert shoal_warnings(caplog) == []
    assert (llm.engine.spec.attn_backend, llm.engine.spec.block_size) == ("native", 16)
    assert llm.engine.executor.runner.graphs is None and llm.engine.executor.runner.graph_replays == 0
    assert not [r for r in caplog.records if "CUDA graphs" in r.getMessage()]  # nothing about GPUs


def test_flash_asked_for_on_cpu_falls_back_once(checkpoint_factory, caplog):
    path = checkpoint_factory("llama")
    with caplog.at_level(logging.INFO):
        llm = LLM(str(path), num_kv_blocks=32, attn_backend="flash")
        out = llm.generate(prompts_of([5]), SamplingParams(temperature=0, max_tokens=4))
    assert shoal_warnings(caplog) == [
        "--attn-backend flash can't run here (it needs a CUDA device); using native"]
    assert llm.engine.spec.attn_backend == "native" and len(out[0].outputs[0].token_ids) == 4


def test_graph_options_do_nothing_on_cpu(checkpoint_factory):
    llm = LLM(str(checkpoint_factory("llama")), num_kv_blocks=16, eager_decode=True,
              cuda_graph_sizes=[1, 2], max_seq_len_to_capture=64)
    assert llm.engine.executor.runner.graphs is None and llm.engine.executor.runner.kv_cache.shape[2] == 16 * 16
    assert len(llm.generate(prompts_of([4]), GREEDY)[0].outputs[0].token_ids) == 24


@pytest.fixture
def fake_gpu(monkeypatch):
    """The kernel choice believes it runs on an Ampere GPU with flash-attn installed."""
    monkeypatch.setattr(kernel_choice, "device_type", lambda config: "cuda")
    monkeypatch.setattr(fa, "installed", lambda: "flash_attn")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    return monkeypatch


def resolve(**options):
    return kernel_choice.attention_backend(EngineConfig(**options), torch.bfloat16, 64)


def test_backend_choice_on_a_gpu(fake_gpu, caplog):
    assert resolve() == ("flash", "flash_attn")
    assert resolve(attn_backend="native") == ("native", None)
    assert resolve(block_size=512) == ("flash", "flash_attn")
    assert shoal_warnings(caplog) == []
    assert resolve(block_size=16) == ("triton", None)  # auto: quietly the Triton kernel
    assert shoal_warnings(caplog) == []
    assert resolve(attn_backend="flash", block_size=16) == ("native", None)
    assert shoal_warnings(caplog) == ["--attn-backend flash can't run here (flash_attn needs a block "
                                      "size that is a multiple of 256, not --block-size 16); using native"]
    fake_gpu.setattr(fa, "installed", lambda: "vllm_flash_attn")
    assert resolve(block_size=16) == ("flash", "vllm_flash_attn")


@pytest.mark.parametrize("capability, dtype, library, reason", [
    ((7, 5), torch.float16, "flash_attn", "it needs an Ampere or newer GPU (compute capability 8.0+, this one is 7.5)"),
    ((8, 0), torch.float32, "flash_attn", "it runs in float16 or bfloat16, not float32"),
    ((9, 0), torch.bfloat16, None, "neither vllm-flash-attn nor flash-attn is installed"),
    ((9, 0), torch.bfloat16, "vllm_flash_attn", None),
])
def test_flash_unavailable_reasons(capability, dtype, library, reason):
    assert fa.unavailable_reason("cuda", dtype, 128, library, capability) == reason
    assert fa.unavailable_reason("cpu", dtype, 128, library, capability) == "it needs a CUDA device"


def test_gpu_auto_dtype_is_bf16(fake_gpu):
    assert model_spec.gpu_auto_dtype({"dtype": "float32"}) == torch.bfloat16
    assert model_spec.gpu_auto_dtype({}) == torch.bfloat16
    assert model_spec.gpu_auto_dtype({"torch_dtype": "float16"}) == torch.float16
    fake_gpu.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert model_spec.gpu_auto_dtype({"dtype": "bfloat16"}) == torch.float16


def test_cpu_auto_dtype_stays_float32(checkpoint_factory):
    llm = LLM(str(checkpoint_factory("llama")), num_kv_blocks=8)
    assert llm.engine.spec.dtype == torch.float32


# --------------------------------------------------------------------------- options

def test_graph_options_parse():
    assert EngineConfig(cuda_graph_sizes="1, 2,8").cuda_graph_sizes == [1, 2, 8]
    assert EngineConfig(cuda_graph_sizes=64).cuda_graph_sizes == [64]
    with pytest.raises(ValueError, match="--cuda-graph-sizes takes batch sizes"):
        EngineConfig(cuda_graph_sizes="a,b")
    assert EngineConfig().gpu_memory_utilization == 0.9 and EngineConfig().max_seq_len_to_capture == 8192


def test_graph_buckets_follow_vllm():
    assert capture_sizes(None, 128) == [1, 2, 4] + list(range(8, 257, 8))[:16]  # up to 128
    assert capture_sizes(None, 512)[-1] == 512
    assert capture_sizes(None, 1024)[-1] == 512  # min(2 x max_num_seqs, 512)
    assert capture_sizes([20], 256) == [1, 2, 4, 8, 16]
    assert capture_sizes([3, 1, 64, 500], 256) == [1, 3, 64]
    assert capture_sizes([3], 2) == [1, 2]
    sizes = [1, 2, 4, 8, 16]
    assert [padded_size(b, sizes) for b in (1, 3, 5, 16, 17)] == [1, 4, 8, 16, None]


def test_pad_decode_pads_onto_the_spare_block():
    batch = InputBatch(max_rows=4, max_blocks=3, block_size=4, pad_block=11)
    step = SchedulerOutput([StepRow(20, [7], 5), StepRow(21, [8], 0)], 2, [0, 1], [(20, 0, [3, 9]), (21, 0, [4])])
    batch.update(step)
    p = batch.padded_decode(step, 4, width=3)
    assert p.input_ids.tolist() == [7, 8, 0, 0] and p.positions.tolist() == [5, 0, 0, 0]
    assert p.slots.tolist() == [9 * 4 + 1, 4 * 4, 44, 44]
    assert p.context_lens.tolist() == [6, 1, 1, 1]
    assert p.block_tables.tolist() == [[3, 9, 11], [4, 11, 11], [11, 11, 11], [11, 11, 11]]


def test_graphs_off_reasons():
    base = dict(device_type="cuda", eager_decode=False, world_size=1, lora=False, moe=False)
    assert graphs_off_reason(**base) is None
    assert graphs_off_reason(**{**base, "eager_decode": True}) == "--eager-decode"
    assert graphs_off_reason(**{**base, "world_size": 2}).startswith("tp x pp > 1")
    assert graphs_off_reason(**{**base, "lora": True}).startswith("LoRA")
    assert graphs_off_reason(**{**base, "moe": True}).startswith("mixture-of-experts")
    # On CPU the same rules decide whether decode steps are compiled (actors/worker/compiled_decode.py).
    assert graphs_off_reason(**{**base, "device_type": "cpu"}) is None
    assert graphs_off_reason(**{**base, "device_type": "cpu", "eager_decode": True}) == "--eager-decode"
    assert graphs_off_reason(**{**base, "device_type": "mps"}) == "mps device"


# --------------------------------------------------------------------------- memory sizing

def test_kv_budget_is_vllms_arithmetic():
    gib = mp.GiB
    p = mp.MemoryProfile(total=80 * gib, utilization=0.9, weights=14 * gib, activations=3 * gib,
                         non_torch=gib // 2, graphs=gib // 2)
    assert p.budget == 72 * gib and p.kv_bytes == 54 * gib
    block = 2 * 32 * 8 * 128 * 2 * 16  # k+v, 32 layers, 8 kv heads, d 128, bf16, 16 tokens: 2 MiB
    assert mp.kv_blocks(p, block, useful_blocks=10**9) == 54 * 512
    assert mp.kv_blocks(p, block, useful_blocks=1000) == 1000  # never more than can be used
    tight = mp.MemoryProfile(total=16 * gib, utilization=0.5, weights=7 * gib, activations=gib)
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache .*raise --gpu-memory-utilization"):
        mp.kv_blocks(tight, block, 10**9)


def test_free_memory_check_at_start():
    mp.check_free_at_start(free=75 * mp.GiB, total=80 * mp.GiB, utilization=0.9)
    with pytest.raises(ValueError, match=r"free memory on the device \(60.00/80.00 GiB\).*0.9"):
        mp.check_free_at_start(free=60 * mp.GiB, total=80 * mp.GiB, utilization=0.9)


def test_activation_estimate_and_profile_rows():
    # 8 tokens, hidden 4, intermediate 8, 2 heads / 1 kv head of 2, vocab 10, 3 rows, tp 1, 2 bytes
    per_token = (2 * 4 + 4 * 2 + 2 * 2 + 3 * 8) * 2
    assert mp.estimate_activation_bytes(4, 8, 2, 1, 2, 10, 8, 3, 1, 2) == 8 * per_token + 2 * 3 * 10 * 4
    ids, start, table = mp.profile_step_rows(tokens=32, max_model_len=100, block_size=16, pool_blocks=3)
    assert (len(ids), start, table) == (32, 68, [0, 1, 2, 0, 1, 2, 0])


def test_gpu_sizing_glue_runs_the_profiling_forwards(checkpoint_factory, monkeypatch, caplog):
    """gpu_kv_blocks end to end on a CPU runner, torch.cuda's memory counters replaced by
    fixed numbers: the profiling steps (a chunk at the end of the longest context, a decode at
    the largest graph size) run through the real model, and the arithmetic uses what they report."""
    llm = LLM(str(checkpoint_factory("llama")), num_kv_blocks=8, max_num_batched_tokens=64, max_num_seqs=8,
              max_seq_len_to_capture=128)
    r = llm.engine.executor.runner
    gib = mp.GiB
    for name, fn in {"synchronize": lambda: None, "empty_cache": lambda: None,
                     "reset_peak_memory_stats": lambda: None,
                     "memory_allocated": lambda: 2 * gib + (r.kv_cache.numel() * 4 if r.kv_cache is not None else 0),
                     "max_memory_allocated": lambda: 2 * gib + r.kv_cache.numel() * 4 + gib // 4,
                     "memory_reserved": lambda: 3 * gib,
                     "mem_get_info": lambda *a: (10 * gib, 16 * gib)}.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    r.free_at_start, r.total_memory = 15 * gib, 16 * gib
    r.bind_kv_cache(None)  # sizing happens before the pool exists
    ran = []
    monkeypatch.setattr(r.model, "forward", lambda *a, _f=r.model.forward: ran.append(len(a[0])) or _f(*a))
    with caplog.at_level(logging.INFO, logger="shoal.runner"):
        blocks = mp.gpu_kv_blocks(r, useful_blocks=10**9)
    assert ran == [64]  # the largest chunk (graphs are off on CPU: no decode profile)
    # 0.9 x 16 GiB - weights 2 - activations 0.25 - non-torch ((15 - 10) used - 3 by torch = 2)
    assert blocks == (int(0.9 * 16 * gib) - 2 * gib - gib // 4 - 2 * gib) // r.block_bytes()
    assert "GPU memory: 0.9 x 16.00 GiB = 14.40 GiB; weights 2.00, activations 0.25" in caplog.text
    assert mp.profile_decode(r) == gib // 4 and ran[-1] == 8  # 8 rows (--max-num-seqs) at 128 keys
    assert r.kv_cache is None  # scratch pools dropped


# --------------------------------------------------------------------------- flash, emulated

def _reference(q, k4, v4, table, keys: int, scale: float, window_size=(-1, 0), softcap=0.0):
    """Attention of q [n, h, d] over the first `keys` keys a block table names (bottom-right
    causal; flash's window_size[0] keys left of each query's own, -1: all; its softcap)."""
    bs = k4.shape[1]
    idx = torch.arange(keys)
    blocks = table.long()[idx // bs]
    k, v = k4[blocks, idx % bs], v4[blocks, idx % bs]  # [keys, kvh, d]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    n = q.shape[0]
    pos = torch.arange(n)[:, None] + keys - n
    visible = torch.arange(keys)[None, :] <= pos
    if window_size[0] >= 0:
        visible &= torch.arange(keys)[None, :] >= pos - window_size[0]
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v.float()).to(q.dtype)


def fake_varlen(*, q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                block_table, seqused_k=None, cu_seqlens_k=None, out=None, **window_and_softcap):
    """flash_attn_varlen_func with a paged cache, as both libraries document it."""
    assert causal and block_table.dtype == torch.int32 and (seqused_k is None) != (cu_seqlens_k is None)
    out = torch.empty_like(q) if out is None else out
    for b in range(block_table.shape[0]):
        lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        keys = int(seqused_k[b]) if seqused_k is not None else int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        assert hi - lo <= max_seqlen_q and keys <= max_seqlen_k
        out[lo:hi] = _reference(q[lo:hi], k, v, block_table[b], keys, softmax_scale, **window_and_softcap)
    return out


def fake_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, block_table, softmax_scale, causal,
                      **window_and_softcap):
    """flash-attn's flash_attn_with_kvcache with a paged cache: q [B, n, h, d]."""
    assert causal and k_cache.dim() == 4
    return torch.stack([_reference(q[b], k_cache, v_cache, block_table[b], int(cache_seqlens[b]),
                                   softmax_scale, **window_and_softcap) for b in range(q.shape[0])])


def test_load_reads_each_librarys_signature(monkeypatch):
    """Keywords only, so both libraries' argument orders work; the paged-key argument and `out`
    follow what the installed release takes."""
    import sys
    import types

    def new_varlen(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                   softmax_scale=None, causal=False, block_table=None, out=None):
        pass

    def old_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                   softmax_scale=None, causal=False, block_table=None):
        pass

    for name, varlen in (("vllm_flash_attn", new_varlen), ("flash_attn", old_varlen)):
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(
            flash_attn_varlen_func=varlen, flash_attn_with_kvcache=lambda *a, **k: None))
    fa.load.cache_clear()
    try:
        new, old = fa.load("vllm_flash_attn"), fa.load("flash_attn")
    finally:
        fa.load.cache_clear()
    assert (new.seqused_k, new.takes_out) == (True, True)
    assert (old.seqused_k, old.takes_out) == (False, False)


def test_installed_prefers_vllm_flash_attn(monkeypatch):
    import importlib.util
    present = {"flash_attn"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name in present else None)
    assert fa.installed() == "flash_attn"
    present.add("vllm_flash_attn")
    assert fa.installed() == "vllm_flash_attn"
    present.clear()
    assert fa.installed() is None


FAKE_OPS = {
    "vllm-flash-attn": fa.FlashOps("vllm_flash_attn", fake_varlen, fake_with_kvcache, True),
    "vllm-flash-attn (cu_seqlens_k)": fa.FlashOps("vllm_flash_attn", fake_varlen, fake_with_kvcache, False),
    "vllm-flash-attn (no out)": fa.FlashOps("vllm_flash_attn", fake_varlen, fake_with_kvcache, True, False),
    "flash-attn": fa.FlashOps("flash_attn", fake_varlen, fake_with_kvcache, False, False),
}


@pytest.mark.parametrize("ops", list(FAKE_OPS))
def test_flash_metadata_matches_the_native_path(ops):
    """A mixed step (2 decodes, then 2 chunks, one after a cached prefix) gives the native result."""
    torch.manual_seed(0)
    bs, h, kvh, d = 4, 4, 2, 8
    k_cache, v_cache = torch.randn(64, kvh, d), torch.randn(64, kvh, d)
    rows = [(1, 9, [3, 0, 7]), (1, 2, [5]), (5, 5, [1, 2]), (3, 11, [4, 6, 8])]  # (new, keys, table)
    q = torch.randn(sum(n for n, _, _ in rows), h, d)
    meta = fa.build_metadata([n for n, _, _ in rows], [k for _, k, _ in rows], [t for _, _, t in rows],
                             2, bs, "cpu", FAKE_OPS[ops])
    assert meta.block_tables.tolist() == [[3, 0, 7], [5, 0, 0], [1, 2, 0], [4, 6, 8]]
    assert (meta.max_seqlen_q, meta.max_seqlen_k, meta.cu_seqlens_q.tolist()) == (5, 11, [0, 1, 2, 7, 10])
    got = paged_attention(q, k_cache, v_cache, AttentionMetadata(torch.zeros(0), 2, bs, flash=meta), 0.3)
    start = 0
    for n, keys, table in rows:
        want = _reference(q[start:start + n], k_cache.view(16, bs, kvh, d), v_cache.view(16, bs, kvh, d),
                          torch.tensor(table), keys, 0.3)
        torch.testing.assert_close(got[start:start + n], want)
        start += n


def flash_llm(path, ops: str, **options) -> LLM:
    llm = LLM(str(path), **options)
    llm.engine.executor.runner.flash_ops = FAKE_OPS[ops]  # what model_spec picks on a GPU that has it
    return llm


@pytest.mark.parametrize("ops,arch", [("vllm-flash-attn", "qwen3"), ("flash-attn", "qwen3"),
                                      ("vllm-flash-attn", "gemma2"), ("flash-attn", "gemma2")])
def test_engine_with_emulated_flash_matches_transformers(checkpoint_factory, ops, arch):
    """Chunked prefill, decodes and prefix-cache hits through the flash metadata the runner
    builds; Gemma 2: its window and soft-cap passed as flash's window_size and softcap."""
    path = checkpoint_factory(arch)
    llm = flash_llm(path, ops, block_size=4, num_kv_blocks=96, max_num_batched_tokens=16)
    shared = prompts_of([12], seed=3)[0]
    prompts = prompts_of([3, 20]) + [shared + [1, 2], shared + [5]]
    outs = llm.generate(prompts, GREEDY)
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, ids, 24)
    assert llm.engine.scheduler.hit_tokens > 0


# --------------------------------------------------------------------------- CUDA graphs, emulated

def eager_capture(fn, pool):
    """A stand-in for capture_cuda_graph: 'replay' runs the captured function again on the
    static buffers, which is what a CUDA graph replays."""
    fn()
    return type("Replay", (), {"replay": staticmethod(fn)})(), pool


def with_emulated_graphs(llm: LLM, sizes, max_seq_len: int, flash_ops=None, triton: bool = False) -> DecodeGraphs:
    r = llm.engine.executor.runner
    r.bind_kv_cache(r.num_blocks + 1)  # the spare block the padding rows use
    r.batch = InputBatch(r.config.max_num_seqs, r.batch.tables.shape[1], r.block_size, pad_block=r.num_blocks)
    r.graphs = DecodeGraphs(r.model, sizes, r.batch, block_size=r.block_size, max_seq_len=max_seq_len,
                            hidden_size=r.args.hidden_size, dtype=r.dtype, device=r.device, flash_ops=flash_ops,
                            triton=triton, capture_fn=eager_capture)
    return r.graphs


def test_a_bucket_is_captured_when_it_recurs_and_a_failed_capture_stays_eager(checkpoint_factory, caplog):
    """Nothing is captured at start; a batch size's first two decode steps run eagerly, the third
    captures its bucket and replays it, and later steps of that bucket replay without capturing
    again. A bucket whose capture fails decodes eagerly, with the same tokens, and is not tried
    again."""
    path = checkpoint_factory("llama")
    options = dict(block_size=4, num_kv_blocks=128, max_num_seqs=8)
    graphed, eager = LLM(str(path), **options), LLM(str(path), **options)
    captured: list[int] = []

    def counting(fn, pool):
        captured.append(len(graphs.graphs))
        return eager_capture(fn, pool)

    graphs = with_emulated_graphs(graphed, [1, 2, 4, 8], max_seq_len=64)
    graphs.capture_fn = counting
    assert graphs.graphs == {} and not captured  # nothing at start
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    graphed.generate(prompts_of([5], seed=1), params)  # one decode step of batch 1
    assert graphs.graphs == {} and graphs.eager_steps == {1: 1}
    graphed.generate(prompts_of([5], seed=2), params)  # a second
    assert graphs.graphs == {} and graphs.eager_steps == {1: 2} and graphs.replays == 0
    one = prompts_of([5], seed=3)
    longer = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = graphed.generate(one, longer)  # the 3rd step captures bucket 1; 5 replays
    assert list(graphs.graphs) == [1] and len(captured) == 1 and graphs.replays == 5
    assert got[0].outputs[0].token_ids == eager.generate(one, longer)[0].outputs[0].token_ids
    graphed.generate(prompts_of([5], seed=4), longer)
    assert len(captured) == 1 and graphs.replays == 10  # replayed, not captured again

    def failing(fn, pool):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    graphs.capture_fn = failing
    three = prompts_of([4, 7, 9], seed=5)  # bucket 4
    with caplog.at_level(logging.WARNING, logger="shoal.runner"):
        got = graphed.generate(three, longer)
    assert graphs.failed == {4} and 4 not in graphs.graphs
    assert "CUDA graph of decode batch size 4 not captured (CUDA out of memory" in caplog.text
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in eager.generate(three, longer)]
    steps = graphs.replays
    graphed.generate(three, longer)
    assert graphs.failed == {4} and graphs.replays == steps  # not tried again: eager
    # an idle engine captures what is left, largest first, one bucket per idle call
    graphs.capture_fn = counting
    graphed.engine.executor.idle()
    assert sorted(graphs.graphs) == [1, 8]
    graphed.engine.executor.idle()
    assert sorted(graphs.graphs) == [1, 2, 8] and graphs.failed == {4}
    graphed.engine.executor.idle()  # nothing left to capture
    assert sorted(graphs.graphs) == [1, 2, 8] and len(captured) == 3


def test_a_capture_leaves_the_expert_load_window_as_it_was(checkpoint_factory):
    """The capture's forwards route padding rows: the recorded window (/stats, re-planning) is
    restored after it; the graphs' choice buffers are made once, at the largest bucket."""
    path = checkpoint_factory("qwen3_moe")
    llm = LLM(str(path), block_size=4, num_kv_blocks=64)
    r = llm.engine.executor.runner
    llm.generate(prompts_of([6, 3]), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    before = (r.experts.load.counts.clone(), r.experts.load.row)
    with r.experts.paused():
        llm.generate(prompts_of([4]), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        assert r.experts.load.row != before[1]  # (its forwards did record)
    assert torch.equal(r.experts.load.counts, before[0]) and r.experts.load.row == before[1]
    r.experts.hold_graph_rows(16, r.device)
    blocks = [b for _, b in r.experts.blocks]
    assert all(b.graph_ids.shape == (16, b.top_k) for b in blocks)


@pytest.mark.parametrize("ops", [None, "vllm-flash-attn", "flash-attn"])
def test_graph_decode_equals_eager(checkpoint_factory, ops):
    """Padded buckets, eager fallback for big batches and long contexts: the tokens and the
    log-probs equal an eager engine's (and transformers')."""
    path = checkpoint_factory("llama")
    options = dict(block_size=4, num_kv_blocks=128, max_num_seqs=8)
    prompts = prompts_of([3, 9, 30, 1, 5, 14])  # 6 rows: bucket 8; the 30-token one passes 40 keys
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    eager = flash_llm(path, ops, **options) if ops else LLM(str(path), **options)
    graphed = flash_llm(path, ops, **options) if ops else LLM(str(path), **options)
    graphs = with_emulated_graphs(graphed, [1, 2, 4, 8], max_seq_len=40,
                                  flash_ops=FAKE_OPS[ops] if ops else None)
    progress = DecodeProgress(graphed.engine)
    want, got = eager.generate(prompts, params), graphed.generate(prompts, params)
    assert graphs.replays > 0 and "graph=True" in progress.line()
    assert_equals_eager_and_hf(path, prompts, got, want, 16)
    assert "graph=False" in progress.line()  # nothing decoded since
