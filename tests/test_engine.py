"""The engine against the oracle: greedy tokens and prompt log-probs equal transformers'.

Every test ends with the KV pool all free (the `llm` fixtures check it).
"""
import random

import pytest
import torch
from oracle import hf_greedy, hf_logits, hf_prompt_logprobs

from actors.engine.llm import LLM
from actors.request import EngineRequest
from actors.sampling_params import SamplingParams
from actors.worker.draft_model import DraftModel

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts_of(lengths, seed=0, vocab=500):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def assert_pool_free(llm: LLM):
    assert not llm.engine.has_unfinished()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    assert all(b.ref_count == 0 for b in llm.engine.blocks.blocks)
    draft = getattr(llm.engine.scheduler.speculator, "proposer", None)
    if isinstance(draft, DraftModel):  # the draft model's own pool, too
        assert not draft.cached and len(draft.free) == draft.runner.num_blocks


def assert_matches_hf(path, prompts, outputs, max_tokens=24):
    for ids, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(path, ids, max_tokens), f"prompt of {len(ids)} tokens"


ARCH_CASES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-rope-llama3": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "llama-sharded": ("llama", {"sharded": True}),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
}


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_greedy_and_prompt_logprobs_match_transformers(checkpoint_factory, case):
    arch, overrides = ARCH_CASES[case]
    path = checkpoint_factory(arch, **overrides)
    llm = LLM(str(path), block_size=8, num_kv_blocks=64)
    prompts = prompts_of([3, 17, 40, 1])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, params)
    assert_matches_hf(path, prompts, outs)
    for ids, out in zip(prompts, outs):
        ours = [next(iter(d.values())) for d in out.prompt_logprobs[1:]]
        assert out.prompt_logprobs[0] is None and len(ours) == len(ids) - 1
        assert ours == pytest.approx(hf_prompt_logprobs(path, ids), abs=1e-4)
    assert_pool_free(llm)


def test_staggered_arrivals_and_small_chunks(llama_ckpt):
    """Requests join while others decode; prefills are cut into 5-token chunks."""
    llm = LLM(str(llama_ckpt), block_size=4, num_kv_blocks=128, max_num_batched_tokens=5)
    prompts = prompts_of([30, 7, 19, 2, 45, 11], seed=1)
    pending = list(enumerate(prompts))
    done = {}
    deltas = {}
    step = 0
    while pending or llm.engine.has_unfinished():
        if pending and step % 3 == 0:
            i, ids = pending.pop(0)
            llm.engine.add_request(EngineRequest(f"r{i}", ids, GREEDY))
        for out in llm.engine.step():
            deltas.setdefault(out.request_id, []).extend(out.outputs[0].token_ids if out.outputs else [])
            if out.finished:
                done[out.request_id] = deltas[out.request_id]
        step += 1
    for i, ids in enumerate(prompts):
        assert done[f"r{i}"] == hf_greedy(llama_ckpt, ids, 24)
    assert_pool_free(llm)


def test_mixed_sampling_settings_share_a_batch(qwen3_ckpt):
    llm = LLM(str(qwen3_ckpt), num_kv_blocks=64)
    prompts = prompts_of([12, 9, 21, 5], seed=2)
    params = [GREEDY,
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True),
              GREEDY,
              SamplingParams(temperature=1.2, top_k=5, min_p=0.05, seed=3, max_tokens=24, ignore_eos=True)]
    outs = llm.generate(prompts, params)
    for i in (0, 2):
        assert outs[i].outputs[0].token_ids == hf_greedy(qwen3_ckpt, prompts[i], 24)
    assert_pool_free(llm)


def test_a_top_k_past_the_vocabulary_keeps_every_token(llama_ckpt):
    """Fuzzing sent top_k = 2**70: it must sample like no top_k, not overflow and kill the
    engine; a seed outside torch's 64 bits and an infinite temperature are refused by name."""
    llm = LLM(str(llama_ckpt), num_kv_blocks=64)
    ids = prompts_of([7])[0]
    huge, off = (SamplingParams(temperature=1.0, top_k=k, seed=5, max_tokens=8, ignore_eos=True)
                 for k in (2**70, 0))
    assert llm.generate([ids], huge)[0].outputs[0].token_ids == llm.generate([ids], off)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="seed must fit in 64 bits"):
        SamplingParams(seed=2**64)
    with pytest.raises(ValueError, match="temperature must be non-negative and finite"):
        SamplingParams(temperature=float("inf"))  # JSON's Infinity: -inf logits / inf are NaN
    assert_pool_free(llm)


def test_prefix_cache_hits_give_identical_output(llama_ckpt):
    llm = LLM(str(llama_ckpt), block_size=4, num_kv_blocks=64)
    shared = prompts_of([33], seed=3)[0]
    first = llm.generate([shared + [5, 6]], GREEDY)[0]
    second = llm.generate([shared + [7, 8, 9]], GREEDY)[0]
    assert second.num_cached_tokens == 32  # 8 full blocks of the shared prefix
    assert first.num_cached_tokens == 0
    assert second.outputs[0].token_ids == hf_greedy(llama_ckpt, shared + [7, 8, 9], 24)
    assert llm.engine.scheduler.hit_rate() > 0
    assert_pool_free(llm)


def test_prefix_caching_can_be_turned_off(llama_ckpt):
    llm = LLM(str(llama_ckpt), block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
    ids = prompts_of([33], seed=3)[0]
    llm.generate([ids], GREEDY)
    assert llm.generate([ids], GREEDY)[0].num_cached_tokens == 0
    assert_pool_free(llm)


def test_preemption_by_recompute_keeps_outputs_exact(llama_ckpt):
    """A pool far too small for the batch: sequences are preempted and recomputed."""
    llm = LLM(str(llama_ckpt), block_size=4, num_kv_blocks=24, max_num_batched_tokens=64)
    prompts = prompts_of([20, 25, 18, 30, 22], seed=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    assert_matches_hf(llama_ckpt, prompts, outs, max_tokens=40)
    assert_pool_free(llm)


def test_preemption_with_prompt_logprobs(llama_ckpt):
    llm = LLM(str(llama_ckpt), block_size=4, num_kv_blocks=16, max_num_batched_tokens=8)
    prompts = prompts_of([30, 28], seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                prompt_logprobs=2))
    assert llm.engine.scheduler.num_preemptions > 0
    for ids, out in zip(prompts, outs):
        assert len(out.prompt_logprobs) == len(ids)
        ours = [next(iter(d.values())) for d in out.prompt_logprobs[1:]]
        assert ours == pytest.approx(hf_prompt_logprobs(llama_ckpt, ids), abs=1e-4)
        assert all(len(d) >= 2 for d in out.prompt_logprobs[1:])
    assert_pool_free(llm)


def test_n_greater_than_one_shares_prompt_blocks(llama_ckpt):
    llm = LLM(str(llama_ckpt), block_size=4, num_kv_blocks=64)
    ids = prompts_of([26], seed=6)[0]
    greedy = llm.generate([ids], SamplingParams(n=3, temperature=0, max_tokens=16, ignore_eos=True))[0]
    ref = hf_greedy(llama_ckpt, ids, 16)
    assert [o.index for o in greedy.outputs] == [0, 1, 2]
    assert all(o.token_ids == ref for o in greedy.outputs)
    hits_before = llm.engine.scheduler.hit_tokens
    sampled = llm.generate([ids + [1]], SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=16,
                                                       ignore_eos=True))[0]
    assert llm.engine.scheduler.hit_tokens - hits_before >= 24  # the second sample reused the prompt
    assert sampled.outputs[0].token_ids != sampled.outputs[1].token_ids
    assert_pool_free(llm)


def test_seed_gives_same_text_whatever_the_batch(llama_ckpt):
    llm = LLM(str(llama_ckpt), num_kv_blocks=128)
    ids = prompts_of([10], seed=7)[0]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate([ids], seeded)[0].outputs[0].token_ids
    others = prompts_of([5, 15, 25], seed=8)
    noisy = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    together = llm.generate(others + [ids], [noisy] * 3 + [seeded])[-1].outputs[0].token_ids
    assert alone == together
    assert_pool_free(llm)


def test_logprobs_and_top_alternatives(llama_ckpt):
    llm = LLM(str(llama_ckpt), num_kv_blocks=64)
    ids = prompts_of([8], seed=9)[0]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3))[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 5
    full = ids + comp.token_ids
    ref = torch.log_softmax(hf_logits(llama_ckpt, full), dim=-1)
    for i, (tok, lps) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(ids) - 1 + i]
        assert next(iter(lps)) == tok and len(lps) == 3  # greedy: chosen is also the top-1
        for t, lp in lps.items():
            assert lp == pytest.approx(float(row[t]), abs=1e-4)
        assert set(lps) == set(row.topk(3).indices.tolist())


def test_stop_strings_never_leak(llama_ckpt):
    llm = LLM(str(llama_ckpt), num_kv_blocks=64)
    ids = prompts_of([6], seed=10)[0]
    free = llm.generate([ids], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    stop = free.text[10:14]
    assert stop
    cut = llm.generate([ids], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    out = cut.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:free.text.find(stop)]
    kept = llm.generate([ids], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                                              include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == free.text[:free.text.find(stop) + len(stop)]
    assert_pool_free(llm)


def test_stop_token_ids_min_tokens_and_length(llama_ckpt):
    llm = LLM(str(llama_ckpt), num_kv_blocks=64)
    ids = prompts_of([6], seed=10)[0]
    free = llm.generate([ids], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    stop_tok = free.token_ids[5]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                             stop_token_ids=[stop_tok]))[0].outputs[0]
    first = free.token_ids.index(stop_tok)
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == free.token_ids[:first + 1]
    late = llm.generate([ids], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                              stop_token_ids=[stop_tok], min_tokens=first + 2))[0].outputs[0]
    assert len(late.token_ids) >= first + 2 and stop_tok not in late.token_ids[:first + 2]
    short = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3
    zero = llm.generate([ids], SamplingParams(max_tokens=0))[0].outputs[0]
    assert zero.finish_reason == "length" and zero.token_ids == []
    assert_pool_free(llm)


def test_eos_stops_unless_ignored(llama_ckpt):
    llm = LLM(str(llama_ckpt), num_kv_blocks=64)
    eos = next(iter(llm.engine.eos_ids))
    ids = prompts_of([6], seed=12)[0]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100.0}))[0]
    assert out.outputs[0].token_ids == [eos] and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == ""
    ignored = llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                 logit_bias={eos: 100.0}))[0].outputs[0]
    assert ignored.token_ids == [eos] * 4 and ignored.finish_reason == "length"


def test_repetition_penalty_matches_transformers(llama_ckpt):
    from oracle import hf_model
    llm = LLM(str(llama_ckpt), num_kv_blocks=64)
    ids = prompts_of([12], seed=13)[0]
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                              repetition_penalty=1.5))[0].outputs[0].token_ids
    model = hf_model(llama_ckpt)
    x = torch.tensor([ids])
    ref = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=16,
                         repetition_penalty=1.5, eos_token_id=[], pad_token_id=0)[0, len(ids):].tolist()
    assert ours == ref


def test_presence_and_frequency_penalties_change_greedy_choices(llama_ckpt):
    llm = LLM(str(llama_ckpt), num_kv_blocks=64)
    ids = prompts_of([4], seed=14)[0]
    plain = llm.generate([ids], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    pen = llm.generate([ids], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                             frequency_penalty=2.0, presence_penalty=2.0))[0].outputs[0]
    assert len(set(pen.token_ids)) >= len(set(plain.token_ids))
    assert pen.token_ids != plain.token_ids or len(set(plain.token_ids)) == 40


def test_bfloat16_runs(llama_ckpt):
    llm = LLM(str(llama_ckpt), dtype="bfloat16", num_kv_blocks=32)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8
    assert_pool_free(llm)


def test_bad_requests_are_refused_with_numbers(llama_ckpt):
    llm = LLM(str(llama_ckpt), num_kv_blocks=8, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="64"):
        llm.add_request("a", list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="KV blocks"):
        llm.add_request("b", list(range(40)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="empty"):
        llm.add_request("c", [], SamplingParams())
    assert_pool_free(llm)


def test_unsupported_architecture_and_missing_model(tmp_path, llama_ckpt):
    import json
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(llama_ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["RwkvForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="supported: .*LlamaForCausalLM"):
        LLM(str(bad))
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache"):
        LLM("no-such-org/no-such-model")


def test_priority_policy_runs_urgent_first(llama_ckpt):
    llm = LLM(str(llama_ckpt), num_kv_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    order = []
    for i, prio in enumerate([5, 0, 3]):
        llm.engine.add_request(EngineRequest(f"p{i}", [1, 2, 3 + i], SamplingParams(max_tokens=2, ignore_eos=True),
                                             priority=prio))
    while llm.engine.has_unfinished():
        order += [o.request_id for o in llm.engine.step() if o.finished]
    assert order == ["p1", "p2", "p0"]


def test_prompt_logprobs_with_no_new_tokens(llama_ckpt):
    """Scoring calls (echo + logprobs + max_tokens=0) get the prompt's log-probs and no token."""
    llm = LLM(str(llama_ckpt), num_kv_blocks=64)
    ids = prompts_of([15], seed=15)[0]
    out = llm.generate([ids], SamplingParams(n=2, max_tokens=0, prompt_logprobs=0))[0]
    assert [o.token_ids for o in out.outputs] == [[], []]
    assert all(o.finish_reason == "length" for o in out.outputs)
    ours = [next(iter(d.values())) for d in out.prompt_logprobs[1:]]
    assert ours == pytest.approx(hf_prompt_logprobs(llama_ckpt, ids), abs=1e-4)
    assert_pool_free(llm)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_the_cpu_kv_pool_takes_memory_only_as_blocks_are_written(llama_ckpt):
    """A 256 MiB pool for a tiny model (issue 46): the process grows by the pages written, not
    by the pool; unwritten blocks read as zeros; outputs stay exact."""
    before = rss_bytes()
    llm = LLM(str(llama_ckpt), num_kv_blocks=32768, block_size=16)
    pool = llm.engine.executor.runner.kv_cache
    size = pool.numel() * pool.element_size()
    assert size >= 256 * 2**20
    grown = rss_bytes() - before
    assert grown < size / 8, (grown, size)
    prompts = prompts_of([40, 7], seed=4)
    assert_matches_hf(llama_ckpt, prompts, llm.generate(prompts, GREEDY))
    assert rss_bytes() - before < size / 8
    assert not pool[:, :, -16:].any()  # the last block: never handed out yet, still zeros
