"""Multi-LoRA serving in the engine: adapters mixed with the base model in one batch give
transformers + peft's outputs exactly (greedy tokens, prompt log-probs), at tp=1 and tp=2,
under LRU eviction, and never share prefix-cache blocks."""
from __future__ import annotations

import json

import pytest
import ray
import torch
from oracle import hf_greedy, hf_prompt_logprobs
from test_engine import assert_pool_free, prompts_of

from actors.core.lora_slots import LoraRef, LoraSlots
from actors.engine.llm import LLM
from actors.errors import UnknownAdapterError
from actors.models.lora_adapter import scaling
from actors.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=0)


def check_mixed_batch(base, paths: dict, max_loras: int = 2, **layout):
    """A batch mixing adapter a, adapter b and the base model equals transformers + peft."""
    llm = LLM(str(base), num_kv_blocks=64, block_size=4, max_num_batched_tokens=24, max_loras=max_loras,
              max_lora_rank=8, lora_modules=[f"{n}={p}" for n, p in paths.items()], **layout)
    try:
        prompts = prompts_of([5, 30, 13, 9, 7])
        loras = ["a", "b", None, "a", "b"]
        outs = llm.generate(prompts, GREEDY, lora=loras)
        for ids, out, name in zip(prompts, outs, loras):
            adapter = paths.get(name)
            assert out.outputs[0].token_ids == hf_greedy(base, ids, 10, adapter=adapter), name
            ours = [next(iter(d.values())) for d in out.prompt_logprobs[1:]]
            assert ours == pytest.approx(hf_prompt_logprobs(base, ids, adapter=adapter), abs=1e-4)
        assert_pool_free(llm)
        return outs, llm.engine.scheduler.loras.loads
    finally:
        llm.shutdown()


def test_llama_mixed_batch_matches_peft(adapters):
    base, paths = adapters("llama")
    outs, loads = check_mixed_batch(base, paths)
    assert loads == 2  # two slots: each adapter read once
    # The adapters really change the output (else the test above proves little).
    assert outs[0].outputs[0].token_ids != hf_greedy(base, prompts_of([5])[0], 10)


def test_speculative_rows_with_adapters_match_peft(adapters):
    """n-gram drafts on rows of adapters a and b and of the base model: each row's drafts are
    verified with its own adapter (a chunk's tokens keep their row's slot), so greedy output is
    transformers + peft's token for token."""
    base, paths = adapters("llama")
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(str(base), num_kv_blocks=96, block_size=4, max_loras=2, max_lora_rank=8, speculative_config=ngram,
              lora_modules=[f"{n}={p}" for n, p in paths.items()])
    llm.engine.scheduler.speculator.compared_steps = 10**9  # drafts whether or not they pay here
    try:
        prompts = [p * 2 for p in prompts_of([5, 7, 4, 6], seed=3)]  # repeated: lookups find matches
        loras = ["a", "b", None, "a"]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), lora=loras)
        for ids, out, name in zip(prompts, outs, loras, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(base, ids, 32, adapter=paths.get(name)), name
        stats = llm.engine.scheduler.speculator.stats()
        assert stats["drafts"] > 0 and stats["accepted_tokens"] > 0, stats
        assert_pool_free(llm)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_qwen3_mixed_batch_matches_peft(adapters):
    check_mixed_batch(*adapters("qwen3"))


def test_lru_eviction_with_one_slot_keeps_outputs_exact(adapters):
    """max_loras=1: a and b take turns in the one slot (b waits while a runs); the base
    model's rows never need a slot."""
    base, paths = adapters("llama")
    _, loads = check_mixed_batch(base, paths, max_loras=1)
    assert loads == 4  # a, b, a, b: each request's adapter evicted the other's


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_mixed_batch_matches_peft(adapters, arch):
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False)
    try:
        check_mixed_batch(*adapters(arch), tp_size=2, shard_cpus=0.5)
    finally:
        ray.shutdown()


def test_prefix_cache_never_shares_blocks_between_adapters(adapters):
    base, paths = adapters("llama")
    llm = LLM(str(base), num_kv_blocks=64, block_size=4, lora_modules=[f"a={paths['a']}"])
    try:
        ids = prompts_of([17])[0]
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        first = llm.generate([ids], params, lora="a")[0]
        again = llm.generate([ids], params, lora="a")[0]
        on_base = llm.generate([ids], params)[0]
        assert first.num_cached_tokens == 0 and again.num_cached_tokens == 16  # 4 full blocks
        assert on_base.num_cached_tokens == 0
        assert on_base.outputs[0].token_ids == hf_greedy(base, ids, 2)
    finally:
        llm.shutdown()


def test_adapter_registration_and_refusals(adapters, tmp_path):
    base, paths = adapters("llama")
    llm = LLM(str(base), num_kv_blocks=32, enable_lora=True, max_lora_rank=4)
    try:
        with pytest.raises(ValueError, match="over --max-lora-rank 4"):
            llm.add_lora("a", str(paths["a"]))  # rank 8
        llm.add_lora("b", str(paths["b"]))
        with pytest.raises(ValueError, match="already been loaded"):
            llm.add_lora("b", str(paths["b"]))
        with pytest.raises(UnknownAdapterError, match="does not exist"):
            llm.generate([[1, 2, 3]], lora="nope")
        dora = tmp_path / "dora"
        dora.mkdir()
        config = json.loads((paths["b"] / "adapter_config.json").read_text())
        (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
        (dora / "adapter_model.safetensors").write_bytes((paths["b"] / "adapter_model.safetensors").read_bytes())
        with pytest.raises(ValueError, match="use_dora"):
            llm.add_lora("d", str(dora))
        with pytest.raises(ValueError, match="not a PEFT adapter"):
            llm.add_lora("e", str(tmp_path))
        llm.engine.remove_lora("b")
        with pytest.raises(UnknownAdapterError):
            llm.generate([[1, 2, 3]], lora="b")
    finally:
        llm.shutdown()


def test_lora_off_refuses_adapters(llama_ckpt):
    llm = LLM(str(llama_ckpt), num_kv_blocks=16)
    try:
        with pytest.raises(UnknownAdapterError):
            llm.generate([[1, 2, 3]], lora="a")
        with pytest.raises(ValueError, match="--enable-lora"):
            llm.add_lora("a", "/nowhere")
    finally:
        llm.shutdown()


def test_scaling_follows_peft():
    assert scaling({"lora_alpha": 16}, "model.layers.0.self_attn.q_proj", 8) == 2.0
    assert scaling({"lora_alpha": 8, "use_rslora": True}, "x.q_proj", 4) == 4.0
    patterned = {"lora_alpha": 16, "alpha_pattern": {"v_proj": 4}}
    assert scaling(patterned, "model.layers.1.self_attn.v_proj", 4) == 1.0
    assert scaling(patterned, "model.layers.1.self_attn.q_proj", 4) == 4.0


def test_slots_evict_the_least_recent_adapter_not_in_use():
    slots = LoraSlots(2)
    a, b, c = (LoraRef(n, i, "/x") for i, n in enumerate("abc"))
    assert slots.acquire(a, set()) == (0, True)
    assert slots.acquire(b, set()) == (1, True)
    assert slots.acquire(a, set()) == (0, False)  # resident; now the most recent
    assert slots.acquire(c, {a.id, b.id}) is None  # every slot serves running sequences
    assert slots.acquire(c, {a.id}) == (1, True)  # b was least recent and idle
    assert slots.resident_ids() == [a.id, c.id]


def test_lora_delta_is_one_batched_computation():
    """The grouped delta equals the per-row reference, with base rows untouched."""
    from actors.models.layers import ColumnParallelLinear
    from actors.models.lora import LoraState, LoraWeights, lora_batch
    torch.manual_seed(0)
    linear = ColumnParallelLinear(6, 5, False)
    state = LoraState()
    w = LoraWeights(linear, [(0, 3), (3, 2)], 3, 2, state)  # two fused parts, 3 and 2 rows
    w.a.normal_()
    for b in w.b:
        b.normal_()
    x = torch.randn(7, 6)

    def reference(i, s):
        if s < 0:
            return torch.zeros(5)
        return torch.cat([x[i] @ w.a[s][:, :2] @ w.b[0][s], x[i] @ w.a[s][:, 2:] @ w.b[1][s]])
    for slots in ([2, -1, 0, 2, 2, -1, 0], [1, 0, 2, 1, 0, 2, 0]):  # with and without base rows
        state.batch = lora_batch(slots, 3, torch.float32, torch.device("cpu"))
        got = w.add_delta(x, torch.zeros(7, 5))
        torch.testing.assert_close(got, torch.stack([reference(i, s) for i, s in enumerate(slots)]))


def test_lora_options_from_the_command_line_and_environment():
    from app.cli.main import build_parser
    from app.config import load_config
    args = build_parser().parse_args(["serve", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}',
                                      "--max-loras", "4", "--max-lora-rank", "32"])
    config = load_config({k: getattr(args, k) for k in ("lora_modules", "max_loras", "max_lora_rank")})
    e = config.engine
    assert e.enable_lora and e.max_loras == 4 and e.max_lora_rank == 32
    assert e.lora_module_paths() == {"a": "/x", "b": "/y"}
    env = load_config({}, {"SHOAL_LORA_MODULES": "a=/x,b=/y", "SHOAL_ENABLE_LORA": "1"}).engine
    assert env.lora_module_paths() == {"a": "/x", "b": "/y"}
    with pytest.raises(ValueError, match="name=path"):
        load_config({"lora_modules": ["nopath"]})
