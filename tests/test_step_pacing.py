"""--itl-target-ms: while streams decode, prompt chunks are sized to keep steps short
(actors/core/step_times.py), and outputs stay those of transformers."""
import random
from types import SimpleNamespace

import pytest
from oracle import hf_greedy

from actors.config import EngineConfig
from actors.core.step_times import MIN_PREFILL_TOKENS, DecodeTimes, PrefillPacer
from actors.engine.llm import LLM
from actors.request import EngineRequest
from actors.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def rows(*tokens):
    """A step's ScheduledSeqs: one per row, with that many tokens."""
    return [SimpleNamespace(num_tokens=n, draft=[]) for n in tokens]


def test_the_pacer_learns_a_prompt_tokens_cost_and_leaves_the_decodes_their_time():
    pacer = PrefillPacer(target_s=0.075, max_tokens=2048)
    assert pacer.prefill_budget(decoding=8) == 2048  # no prompt token timed yet
    pacer.observe(rows(1024, 1024), 0.5)  # prompts only: 0.5 s for 2048 tokens
    rate = 0.5 / 2048
    assert pacer.token_seconds == pytest.approx(rate)
    assert pacer.prefill_budget(decoding=0) == 2048  # nobody waits between tokens
    for _ in range(20):
        pacer.observe(rows(*[1] * 8), 0.025)  # plain decode steps of 8 rows
    # 75 - 25 ms left for prompt tokens at 0.244 ms each
    assert pacer.prefill_budget(decoding=8) == int(0.050 / rate)
    # Mixed steps: 8 decodes (25 ms, known) and 100 prompt tokens (24.4 ms at the rate) in 60 ms:
    # 10.6 ms more than the parts, which the rate does not take.
    for _ in range(40):
        pacer.observe(rows(*[1] * 8, 100), 0.060)
    assert pacer.token_seconds == pytest.approx(rate)
    assert pacer.mixed_overhead == pytest.approx(0.060 - 0.025 - 100 * rate, rel=1e-3)
    assert pacer.prefill_budget(decoding=8) == int((0.075 - 0.025 - pacer.mixed_overhead) / rate)
    # Decodes alone over the target: prompts still get half the decodes' time.
    for _ in range(20):
        pacer.observe(rows(*[1] * 64), 0.200)
    assert pacer.prefill_budget(decoding=64) == int(0.100 / rate)
    # The host's time between steps is a stream's wait too: it comes out of the prompts' room.
    for _ in range(40):
        pacer.observe(rows(*[1] * 8), 0.025, between=0.010)
    assert pacer.between == pytest.approx(0.010, rel=1e-3)
    assert pacer.prefill_budget(decoding=8) == int(
        (0.075 - 0.025 - pacer.between - pacer.mixed_overhead) / pacer.token_seconds)
    # However dear a prompt token looks, one block's worth goes through.
    pacer.token_seconds = 10.0
    assert pacer.prefill_budget(decoding=64) == MIN_PREFILL_TOKENS


def test_without_a_rate_the_first_mixed_step_sets_it():
    pacer = PrefillPacer(target_s=0.075, max_tokens=2048)
    for _ in range(5):
        pacer.observe(rows(*[1] * 8), 0.025)
    pacer.observe(rows(*[1] * 8, 100), 0.045)  # 20 ms for 100 prompt tokens
    assert pacer.token_seconds == pytest.approx(0.0002) and pacer.mixed_overhead == 0.0


def test_mixed_steps_land_on_the_target_though_they_cost_more_than_their_parts():
    """A machine where a mixed step costs its decodes, a fixed 12 ms (an eager step where plain
    decodes run compiled) and its prompt tokens at 1.3x the rate of a prompts-only chunk, with a
    burst's prompts-only chunk every 10 steps: after a few steps, every mixed step takes the
    target within 3%. One rate learned from both kinds of step overshot after each chunk."""
    pacer = PrefillPacer(target_s=0.075, max_tokens=2048)
    rate = 0.33e-3
    decode = 0.035  # 40 decoding rows
    for _ in range(5):
        pacer.observe(rows(*[1] * 40), decode)
    times = []
    for step in range(80):
        if step % 10 == 0:
            pacer.observe(rows(2048), 2048 * rate)
            continue
        tokens = pacer.prefill_budget(decoding=40)
        seconds = decode + 0.012 + 1.3 * rate * tokens
        pacer.observe(rows(*[1] * 40, tokens), seconds)
        times.append(seconds)
    assert all(abs(t - 0.075) <= 0.03 * 0.075 for t in times[20:]), [round(t * 1e3, 1) for t in times]


def test_without_a_target_every_step_keeps_the_full_budget():
    pacer = PrefillPacer(target_s=0.0, max_tokens=512)
    pacer.observe(rows(512), 1.0)
    pacer.observe(rows(*[1] * 4), 0.5)
    assert pacer.token_seconds is None and pacer.prefill_budget(decoding=4) == 512


def test_prompt_tokens_fill_the_rows_a_compiled_step_pads_to():
    """Where a step's rows are padded to a bucket (the compiled step's: 2, 4, 8, then multiples
    of 8 to 32, then of 32), the budget grows to the bucket's edge; never past the step's
    token budget, and not at all where nothing pads."""
    from actors.worker.compiled_decode import bucket_sizes
    from actors.worker.cuda_graphs import capture_sizes, padded_size

    sizes = bucket_sizes(capture_sizes(None, 32))
    padded = lambda rows: padded_size(rows, sizes) or rows  # noqa: E731 (the runner's padded_rows)
    plain, filled = PrefillPacer(0.075, 2048), PrefillPacer(0.075, 2048, padded)
    tiny = PrefillPacer(0.075, 40, padded)
    for pacer in (plain, filled, tiny):
        pacer.observe(rows(64), 0.32)  # 5 ms a prompt token
        for batch in (2, 19, 32):
            for _ in range(10):
                pacer.observe(rows(*[1] * batch), 0.150)  # decodes past the target: half their time
    for decoding in (2, 19, 32):
        assert plain.prefill_budget(decoding) == MIN_PREFILL_TOKENS  # 75 ms at 5 ms a token: 15, at least 16
        budget = filled.prefill_budget(decoding)
        assert padded(decoding + budget) == decoding + budget  # on a bucket's edge
        assert budget == {2: 22, 19: 45, 32: 32}[decoding]  # 24, 64 and 64 rows
        assert tiny.prefill_budget(decoding) == min(40, budget)
    assert sizes[:6] == [2, 4, 8, 16, 24, 32] and sizes[6] == 64
    assert padded(10_000) == 10_000  # past the last bucket: eager, nothing padded


def test_decode_times_fall_back_to_the_nearest_batch():
    times = DecodeTimes()
    assert times.estimate(4) is None
    times.record(8, 0.010)
    times.record(2, 0.004)
    assert times.estimate(8) == 0.010 and 8 in times and 4 not in times
    assert times.estimate(4) == 0.010  # the nearest larger batch: an upper bound
    assert times.estimate(16) == pytest.approx(0.020)  # the largest one seen, scaled by rows


def test_the_default_target_is_for_cpu_only():
    assert EngineConfig().itl_target_seconds("cpu") == 0.075
    assert EngineConfig().itl_target_seconds("cuda") == 0.0
    assert EngineConfig(itl_target_ms=0).itl_target_seconds("cpu") == 0.0
    assert EngineConfig(itl_target_ms=40).itl_target_seconds("cuda") == 0.040
    with pytest.raises(ValueError, match="--itl-target-ms"):
        EngineConfig(itl_target_ms=-1).validate()


def test_offline_runs_are_not_paced_unless_asked(llama_ckpt):
    """`LLM` and `shoal run-batch` (which passes every EngineConfig field, the unset target as
    None) run whole requests: nobody reads a token between steps, so prompts are not cut up."""
    assert LLM(str(llama_ckpt), num_kv_blocks=64).engine.scheduler.pacer.target == 0.0
    assert LLM(str(llama_ckpt), num_kv_blocks=64, itl_target_ms=None).engine.scheduler.pacer.target == 0.0
    assert LLM(str(llama_ckpt), num_kv_blocks=64, itl_target_ms=40).engine.scheduler.pacer.target == 0.040


def run_with_a_long_prompt_arriving(llm: LLM, streams: list, long_prompt: list):
    """Streams decode; the long prompt arrives after 3 steps. Returns (outputs by request id,
    the steps from its arrival to its first token, each stream's tokens over those steps)."""
    for i, ids in enumerate(streams):
        llm.engine.add_request(EngineRequest(f"s{i}", ids, GREEDY))
    tokens, step, arrived, first, during = {}, 0, None, None, None
    while llm.engine.has_unfinished():
        if step == 3:
            llm.engine.add_request(EngineRequest("long", long_prompt, GREEDY))
            arrived = step
            during = {f"s{i}": len(tokens[f"s{i}"]) for i in range(len(streams))}
        for out in llm.engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        step += 1
        if first is None and tokens.get("long"):
            first = step - arrived
            during = {rid: len(tokens[rid]) - n for rid, n in during.items()}
    return tokens, first, during


@pytest.mark.parametrize("target_ms", [50, 0])
def test_a_long_prompt_arriving_is_spread_over_steps_that_keep_every_stream_moving(llama_ckpt, target_ms):
    llm = LLM(str(llama_ckpt), block_size=8, num_kv_blocks=256, itl_target_ms=target_ms)
    # Pin what steps cost, so the chunk sizes do not depend on this machine's speed: 4 decoding
    # rows take 10 ms, a prompt token 1 ms, so a 50 ms step has room for 40 prompt tokens.
    pacer = llm.engine.scheduler.pacer
    pacer.observe = lambda *step: None
    pacer.decodes.record(4, 0.010)
    pacer.token_seconds = 0.001
    rng = random.Random(3)
    streams = [[rng.randrange(500) for _ in range(n)] for n in (5, 9, 3, 12)]
    long_prompt = [rng.randrange(500) for _ in range(300)]
    tokens, steps, during = run_with_a_long_prompt_arriving(llm, streams, long_prompt)
    if target_ms:
        assert steps == -(-300 // 40)  # 40 prompt tokens a step
        assert during == {f"s{i}": steps for i in range(4)}  # a token for every stream at every step
    else:
        assert steps == 1 and during == {f"s{i}": 1 for i in range(4)}  # the whole prompt in one step
    for i, ids in enumerate(streams):
        assert tokens[f"s{i}"] == hf_greedy(llama_ckpt, ids, 24)
    assert tokens["long"] == hf_greedy(llama_ckpt, long_prompt, 24)
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_the_engine_times_its_steps_for_the_pacer(llama_ckpt):
    """Unpinned: a served engine learns a prompt token's cost and plain decode steps' times."""
    llm = LLM(str(llama_ckpt), block_size=8, num_kv_blocks=256, itl_target_ms=75)
    rng = random.Random(4)
    for i in range(4):
        llm.engine.add_request(EngineRequest(f"r{i}", [rng.randrange(500) for _ in range(40)], GREEDY))
    while llm.engine.has_unfinished():
        llm.engine.step()
    pacer = llm.engine.scheduler.pacer
    assert pacer.token_seconds is not None and pacer.token_seconds > 0
    assert 4 in pacer.decodes and 0 < pacer.decodes.estimate(4) < 1.0
    assert 0 < pacer.between < 1.0  # the host's time between two steps while requests ran
