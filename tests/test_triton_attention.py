"""The Triton paged-attention kernel (kernels/triton_attention.py), run on CPU by Triton's
interpreter (TRITON_INTERPRET=1): against the torch path on mixed steps of every shape the
engine makes (block sizes that are not its tile's, MHA / GQA / MQA and a group of 7, head
sizes that are not powers of two, ragged contexts, chunks that continue a cached prefix, a
context ending exactly on a block boundary), split-KV decode steps against the dense
definition, and end to end in the engine against transformers, eager, split and through the
CUDA-graph path (emulated)."""
from __future__ import annotations

import logging
import random

import pytest
import torch
from oracle import assert_equals_eager_and_hf, hf_greedy
from test_gpu_path import with_emulated_graphs

from actors.config import EngineConfig
from actors.engine.llm import LLM
from actors.sampling_params import SamplingParams
from actors.worker import kernel_choice
from kernels import triton_attention as ta
from kernels import triton_programs
from kernels.attention import AttentionMetadata, paged_attention

pytestmark = pytest.mark.skipif(not triton_programs.available(), reason="Triton is not installed")


@pytest.fixture
def interpreted():
    """conftest turns the interpreter on where there is no CUDA (before Triton is imported)."""
    if not triton_programs.interpreted():
        pytest.skip("Triton's interpreter is off (CUDA is here: tests/test_gpu.py runs the kernel)")


def torch_reference(q, k_cache, v_cache, rows, tables, block_size, scale, monkeypatch):
    """The same step through the torch path (decodes first, then chunks)."""
    nd = sum(n == 1 for n, _ in rows)
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(q), dtype=torch.long), num_decode_tokens=nd,
                             block_size=block_size)
    meta.decode_block_tables = tables[:nd]
    meta.decode_context_lens = torch.tensor([s + n for n, s in rows[:nd]], dtype=torch.int32)
    chunks, offset = [], nd
    for n, start in rows[nd:]:
        chunks.append((offset, n, start))
        offset += n
    meta.prefill_chunks, meta.prefill_block_tables = chunks or None, tables[nd:]
    with monkeypatch.context() as m:
        m.setenv("SHOAL_NATIVE_KERNELS", "0")
        return paged_attention(q, k_cache, v_cache, meta, scale)


# (new tokens, context before the step): decodes first (one short, one long), then chunks
# that start their sequence and chunks that continue one (a prefix-cache hit, chunked prefill)
STEPS = {
    "mixed": [(1, 9), (1, 129), (1, 0), (5, 0), (3, 11), (9, 40)],
    "block-boundary": [(1, 15), (1, 31), (16, 0), (4, 12)],  # contexts ending on 16 and 32 keys
}


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2), (4, 1), (14, 2)], ids=["mha", "gqa4", "mqa", "gqa7"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("step", list(STEPS))
def test_kernel_matches_the_torch_path(interpreted, monkeypatch, heads, kv_heads, block_size, step):
    rows = STEPS[step]
    d = {1: 16, 4: 80, 16: 64}[block_size]  # 80: a head size the kernel pads to 128
    rng = random.Random(block_size * heads)
    torch.manual_seed(block_size + heads)
    blocks = sum(-(-(s + n) // block_size) for n, s in rows) + 3
    k_cache = torch.randn(blocks * block_size, kv_heads, d)
    v_cache = torch.randn(blocks * block_size, kv_heads, d)
    free = list(range(blocks))
    rng.shuffle(free)
    tables_list = [[free.pop() for _ in range(-(-(s + n) // block_size))] for n, s in rows]
    tables = torch.zeros(len(rows), max(map(len, tables_list)), dtype=torch.long)
    for i, t in enumerate(tables_list):
        tables[i, :len(t)] = torch.tensor(t)
    q = torch.randn(sum(n for n, _ in rows), heads, d)
    scale = d ** -0.5
    meta = ta.build_metadata([n for n, _ in rows], torch.tensor([s + n for n, s in rows]), tables,
                             block_size, "cpu")
    got = ta.paged_attention(q, k_cache, v_cache, meta, scale)
    want = torch_reference(q, k_cache, v_cache, rows, tables, block_size, scale, monkeypatch)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("window,softcap", [(5, None), (40, None), (None, 3.0), (7, 2.5)])
def test_sliding_window_and_softcap(interpreted, window, softcap):
    """Windows shorter than a tile and longer (tiles before the window skipped) and Gemma 2's
    soft-capping, over the dense definition (tests/test_kernels.py), decodes and chunks."""
    from test_kernels import dense_reference, mixed_step

    chunks = [(20, 0), (5, 37), (17, 50), (3, 0), (16, 100)]
    q, kc, vc, meta = mixed_step(chunks, 8, 2, 64, 16, decode_lens=(40, 7, 90))
    lens = meta.decode_context_lens.tolist() + [start + n for n, start in chunks]
    tables = torch.cat([meta.decode_block_tables, meta.prefill_block_tables])
    tmeta = ta.build_metadata([1] * meta.num_decode_tokens + [n for n, _ in chunks], torch.tensor(lens), tables,
                              16, "cpu")
    got = ta.paged_attention(q, kc, vc, tmeta, 0.125, window, softcap)
    torch.testing.assert_close(got, dense_reference(q, kc, vc, meta, 0.125, window, softcap), rtol=0, atol=2e-5)


@pytest.mark.parametrize("window,softcap", [(None, None), (300, None), (None, 3.0)])
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 64), (4, 4, 80)], ids=["gqa4", "mha-pad"])
def test_split_kv_decode_matches_the_dense_definition(interpreted, window, softcap, heads, kv_heads, d):
    """A decode-only step of few long rows splits its keys (flash-decoding): ranges that end
    mid-block and mid-tile, a row shorter than the later ranges (they weigh nothing), windows
    that start inside a range."""
    from test_kernels import dense_reference, mixed_step

    lens = (1100, 37, 1537)
    q, kc, vc, meta = mixed_step([], heads, kv_heads, d, 16, decode_lens=lens)
    tmeta = ta.build_metadata([1] * 3, torch.tensor(lens), meta.decode_block_tables, 16, "cpu")
    assert tmeta.splits == 3 and tmeta.keys_per_split == 544
    got = ta.paged_attention(q, kc, vc, tmeta, d ** -0.5, window, softcap)
    torch.testing.assert_close(got, dense_reference(q, kc, vc, meta, d ** -0.5, window, softcap), rtol=0, atol=2e-5)


@pytest.mark.parametrize("window", [None, 7])
def test_attention_sinks(interpreted, window):
    """gpt-oss's sinks (one more logit per head, of no value) over the dense definition: the
    one-launch kernel on decodes and chunks, and split-KV decode, where they join the ranges'
    combination once."""
    from test_kernels import dense_reference, mixed_step

    sinks = torch.linspace(0.0, 4.0, 8)
    chunks = [(20, 0), (5, 37), (3, 0)]
    q, kc, vc, meta = mixed_step(chunks, 8, 2, 64, 16, decode_lens=(40, 7))
    lens = meta.decode_context_lens.tolist() + [start + n for n, start in chunks]
    tables = torch.cat([meta.decode_block_tables, meta.prefill_block_tables])
    tmeta = ta.build_metadata([1] * meta.num_decode_tokens + [n for n, _ in chunks], torch.tensor(lens), tables,
                              16, "cpu")
    want = dense_reference(q, kc, vc, meta, 0.125, window, sinks=sinks)
    assert (want - dense_reference(q, kc, vc, meta, 0.125, window)).abs().max() > 1e-2
    torch.testing.assert_close(ta.paged_attention(q, kc, vc, tmeta, 0.125, window, sinks=sinks), want,
                               rtol=0, atol=2e-5)
    lens = (1100, 37)
    q, kc, vc, meta = mixed_step([], 8, 2, 64, 16, decode_lens=lens)
    tmeta = ta.build_metadata([1] * 2, torch.tensor(lens), meta.decode_block_tables, 16, "cpu")
    assert tmeta.splits == 2
    torch.testing.assert_close(ta.paged_attention(q, kc, vc, tmeta, 0.125, window, sinks=sinks),
                               dense_reference(q, kc, vc, meta, 0.125, window, sinks=sinks), rtol=0, atol=2e-5)


def test_which_steps_split_their_keys():
    assert ta.key_splits([1] * 8, 16384) == (8, 2048)  # few long rows: SPLIT_ROWS // 8 ranges
    assert ta.key_splits([1] * 2, 1100) == (2, 576)  # ranges of >= SPLIT_MIN_KEYS, TILE-aligned
    assert ta.key_splits([1] * 2, 1000) == (1, 0)  # too short to split
    assert ta.key_splits([1] * 64, 16384) == (1, 0)  # enough rows to fill the GPU
    assert ta.key_splits([1, 5], 16384) == (1, 0)  # a prefill chunk: the one-launch kernel


@pytest.mark.parametrize("tile", [16, 64])
def test_decode_steps_with_other_launch_tiles(interpreted, monkeypatch, tile):
    """A decode-only step takes its head size's launch (DECODE); other tiles give the torch
    path's result, contexts shorter and longer than the tile, on block boundaries and off."""
    from test_kernels import dense_reference, mixed_step

    q, kc, vc, meta = mixed_step([], 8, 2, 64, 16, decode_lens=(3, 64, 130, 200, 16))
    monkeypatch.setitem(ta.DECODE, 64, ta.Launch(tile=tile, num_warps=8, num_stages=2))
    tmeta = ta.build_metadata([1] * 5, meta.decode_context_lens, meta.decode_block_tables, 16, "cpu")
    got = ta.paged_attention(q, kc, vc, tmeta, 0.125)
    torch.testing.assert_close(got, dense_reference(q, kc, vc, meta, 0.125), rtol=0, atol=2e-5)


def test_a_step_through_the_attention_entry_point(interpreted):
    """kernels.attention.paged_attention hands a step with triton metadata to the kernel."""
    q, k, v = torch.randn(3, 4, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    meta = ta.build_metadata([1, 2], torch.tensor([5, 2]), torch.tensor([[0, 1], [1, 0]]), 4, "cpu")
    out = paged_attention(q, k, v, AttentionMetadata(torch.zeros(3, dtype=torch.long), 1, 4, triton=meta), 0.25)
    torch.testing.assert_close(out, ta.paged_attention(q, k, v, meta, 0.25))


@pytest.mark.parametrize("split_min_keys", [ta.SPLIT_MIN_KEYS, 8], ids=["default", "split-kv-decode"])
def test_engine_with_triton_attention_matches_transformers(interpreted, checkpoint_factory, caplog, monkeypatch,
                                                           split_min_keys):
    """Chunked prefill, decodes and a prefix-cache hit through the metadata the runner builds;
    and with split-KV decode steps down to 8-key ranges, which these short prompts reach.
    (Without the suite's SHOAL_EAGER_DECODE: the interpreter itself keeps decode eager.)"""
    monkeypatch.delenv("SHOAL_EAGER_DECODE", raising=False)
    monkeypatch.setattr(ta, "SPLIT_MIN_KEYS", split_min_keys)
    if split_min_keys == 8:  # the split path is what this run is for; interpreted, fused kernels cost 3x
        monkeypatch.setenv("SHOAL_FUSED_KERNELS", "0")
    splits, build = [], ta.build_metadata

    def recorded(*args):
        meta = build(*args)
        splits.append(meta.splits)
        return meta
    monkeypatch.setattr(ta, "build_metadata", recorded)
    path = checkpoint_factory("qwen3")
    with caplog.at_level(logging.INFO, logger="shoal.runner"):
        llm = LLM(str(path), attn_backend="triton", block_size=4, num_kv_blocks=96, max_num_batched_tokens=16)
    assert llm.engine.spec.attn_backend == "triton"
    assert "attention triton-interpreted" in caplog.text and "decode eager (Triton interpreted on CPU)" in caplog.text
    shared = [random.Random(3).randrange(500) for _ in range(12)]
    prompts = [[7, 1, 2], list(range(40, 60)), shared + [1, 2], shared + [5]]
    tokens = 16 if split_min_keys == 8 else 6  # (the split run needs decode-only steps past 16 keys)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, ids, tokens)
    assert llm.engine.scheduler.hit_tokens > 0
    assert (max(splits) > 1) == (split_min_keys == 8)


def graphed_triton_matches_hf(path, prompts, **options) -> LLM:
    """An engine on the Triton backend whose decode steps go through the CUDA-graph path
    (emulated): 6 greedy tokens of each prompt equal transformers', some from graph replays."""
    llm = LLM(str(path), attn_backend="triton", block_size=4, **options)
    graphs = with_emulated_graphs(llm, [1, 2, 4, 8], max_seq_len=40, triton=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert graphs.replays > 0
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, ids, 6)
    return llm


@pytest.mark.slow  # ~10 s interpreted; the kernels are tested on their own in a few seconds
def test_gpt_oss_on_the_triton_backend_matches_transformers(interpreted, checkpoint_factory):
    """gpt-oss on the Triton backend: its sinks through the attention kernel, its q/k rotary
    through the fused kernel, its experts (biases, clamped SwiGLU) through kernels/triton_moe.py,
    eagerly in prefill steps and through the graph path (emulated) in decodes."""
    graphed_triton_matches_hf(checkpoint_factory("gpt_oss"), [[7, 1, 2], list(range(40, 62))],
                              num_kv_blocks=64, max_num_batched_tokens=16)


@pytest.mark.slow  # ~10 s interpreted
@pytest.mark.parametrize("arch", ["glm4_moe", "minimax_m2"])
def test_sigmoid_routed_moe_on_the_triton_backend_matches_transformers(interpreted, checkpoint_factory, arch):
    """GLM-4.5 (grouped sigmoid routing, shared experts, a dense first layer, per-head q/k norms)
    and MiniMax-M2 (all-heads q/k norms): half the head rotated, so q/k take the unfused path,
    their experts through kernels/triton_moe.py, decodes through the graph path (emulated)."""
    graphed_triton_matches_hf(checkpoint_factory(arch), [[7, 1, 2], list(range(40, 62))],
                              num_kv_blocks=64, max_num_batched_tokens=16)


def test_graph_decode_with_triton_metadata_equals_eager(interpreted, checkpoint_factory, monkeypatch):
    """The CUDA-graph path's static buffers feed the kernel (graphs emulated on CPU). The fused
    kernels stay off (3x the interpreter's time): the MoE test below runs them through graphs."""
    monkeypatch.setenv("SHOAL_FUSED_KERNELS", "0")
    path = checkpoint_factory("llama")
    options = dict(attn_backend="triton", block_size=4, num_kv_blocks=128, max_num_seqs=8)
    prompts = [[3, 1, 4], list(range(9)), list(range(100, 130))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    eager, graphed = LLM(str(path), **options), LLM(str(path), **options)
    graphs = with_emulated_graphs(graphed, [1, 2, 4, 8], max_seq_len=40, triton=True)
    want, got = eager.generate(prompts, params), graphed.generate(prompts, params)
    assert graphs.replays > 0
    assert_equals_eager_and_hf(path, prompts, got, want, 8)


def test_moe_through_the_fused_kernels_and_graphs(interpreted, checkpoint_factory):
    """A MoE model on the Triton backend: its experts through kernels/triton_moe.py (what lets
    its decode steps be CUDA graphs), eagerly in its prefill steps and through the graph path
    (emulated) in its decodes, equal to transformers. A replay's routed load is recorded for its
    real rows only."""
    llm = graphed_triton_matches_hf(checkpoint_factory("qwen3_moe"), [[3, 1, 4], list(range(100, 121))],
                                    num_kv_blocks=128, max_num_seqs=8)
    r = llm.engine.executor.runner

    _, block = r.experts.blocks[0]
    before = torch.tensor(r.experts.load.totals()[0])
    block.graph_ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])  # as a capture of 4 rows leaves it
    with torch.inference_mode():  # as in the runner's forward
        r.experts.record_graph_rows(2)
    assert (torch.tensor(r.experts.load.totals()[0]) - before).tolist() == [1, 1, 1, 1, 0, 0, 0, 0]


def test_moe_decode_graphs_need_the_fused_path(monkeypatch):
    """On a GPU a MoE model's decode steps are graphs on the Triton backend only."""
    from types import SimpleNamespace

    monkeypatch.delenv("SHOAL_EAGER_DECODE", raising=False)
    args = SimpleNamespace(moe=object(), norms="pre", norm_kind="rms", residual_scale=1.0, linear_attn=None,
                           gemma4=None)  # ModelArgs. fields
    cuda = torch.device("cuda")
    for backend, graphs in (("triton", True), ("native", False)):
        spec = SimpleNamespace(args=args, attn_backend=backend, dtype=torch.bfloat16, quantization=None)
        choice = kernel_choice.choose(EngineConfig(), spec, cuda, world_size=1, lora=False)
        assert (choice.decode == "cuda-graphs") == graphs, choice


def test_backend_choice(monkeypatch, caplog):
    def resolve(**options):
        return kernel_choice.attention_backend(EngineConfig(**options), torch.bfloat16, 64)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve() == ("native", None)  # on CPU auto is the C++ kernels, interpreter or not
    assert resolve(attn_backend="triton") == ("triton", None)
    monkeypatch.delenv("TRITON_INTERPRET")
    with caplog.at_level(logging.WARNING):
        assert resolve(attn_backend="triton") == ("native", None)
    assert "--attn-backend triton can't run here (it needs a CUDA device" in caplog.text
    monkeypatch.setattr(kernel_choice, "device_type", lambda config: "cuda")  # a GPU without flash
    monkeypatch.setattr(kernel_choice.flash_attention, "installed", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert resolve() == ("triton", None)
    assert resolve(attn_backend="native") == ("native", None)
    # a GPU with flash: a model with attention sinks (gpt-oss) gets Triton, flash has no sinks
    monkeypatch.setattr(kernel_choice.flash_attention, "installed", lambda: "vllm_flash_attn")
    monkeypatch.setattr(kernel_choice, "flash_unavailable", lambda *a: None)
    assert resolve() == ("flash", "vllm_flash_attn")
    assert kernel_choice.attention_backend(EngineConfig(), torch.bfloat16, 64, sinks=True) == ("triton", None)
    with caplog.at_level(logging.WARNING):
        assert kernel_choice.attention_backend(EngineConfig(attn_backend="flash"), torch.bfloat16, 64,
                                               sinks=True) == ("native", None)
    assert "--attn-backend flash can't run here (attention sinks (gpt-oss) are not in its API)" in caplog.text


def test_a_layer_without_rotary_through_the_fused_kernel(interpreted, checkpoint_factory):
    """SmolLM3's NoPE layer rotates by angle 0 in the fused norm-rotary-KV-write kernel (cos 1,
    sin 0): greedy tokens equal transformers' on the Triton backend, graph path included."""
    path = checkpoint_factory("smollm3")
    llm = graphed_triton_matches_hf(path, [[7, 1, 2], list(range(40, 60))], num_kv_blocks=64)
    assert llm.engine.executor.runner.model.model.layers[1].self_attn.nope
    assert llm.engine.executor.runner.model.model.layers[1].self_attn.fusable
