"""Outputs are merged in one place (actors/outputs.py: Pending): a request's outputs folded
together equal one output carrying all of them, the prompt (sent once, on the first) kept,
and nothing its sender still holds is changed. EngineRequest and the context-length error
cross processes intact."""
from __future__ import annotations

import pickle

import pytest

from actors.engine.llm import LLM
from actors.outputs import CompletionOutput, Pending, RequestMetrics, RequestOutput, accumulate
from actors.request import ContextLengthError, EngineRequest, resolve_max_tokens
from actors.sampling_params import SamplingParams


def delta(ids=None, *outs, finished=False, **kw) -> RequestOutput:
    return RequestOutput("r", ids, list(outs), finished=finished, **kw)


def test_pending_merges_without_touching_what_was_sent():
    first = delta([1, 2, 3], CompletionOutput(0, "a", [5], logprobs=[{5: -0.1}]), prompt="hi",
                  prompt_logprobs=[None, {2: -1.0}, {3: -2.0}])
    second = delta(None, CompletionOutput(1, "x", [9]), CompletionOutput(0, "b", [6], logprobs=[{6: -0.2}]))
    last = delta(None, CompletionOutput(0, "", [], finish_reason="stop", stop_reason=7),
                 finished=True, metrics=RequestMetrics(0.1, 0.2, 0.3))
    pending = Pending()
    for d in (first, second, last):
        pending.add(d)
    assert pending.ended and not pending.empty
    out, error = pending.take()
    assert error is None and pending.empty
    assert (out.prompt_token_ids, out.prompt, out.finished) == ([1, 2, 3], "hi", True)
    assert out.prompt_logprobs == first.prompt_logprobs and out.metrics.e2e == 0.3
    assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in out.outputs] == \
        [(0, "ab", [5, 6], "stop"), (1, "x", [9], None)]
    assert out.outputs[0].logprobs == [{5: -0.1}, {6: -0.2}]
    assert first.outputs[0].text == "a" and len(first.outputs) == 1  # the sender's copy is as sent
    assert accumulate([first, second, last]).outputs[0].text == "ab"


def test_an_error_ends_the_pending_news():
    pending = Pending()
    pending.add(delta([1], CompletionOutput(0, "a", [5])))
    pending.add(RuntimeError("boom"))
    assert pending.ended
    out, error = pending.take()
    assert out.outputs[0].text == "a" and str(error) == "boom"


def test_requests_and_refusals_cross_processes_with_their_numbers():
    request = EngineRequest("r1", [1, 2], SamplingParams(max_tokens=3), priority=2, lora="a", whole=True)
    assert pickle.loads(pickle.dumps(request)) == request
    error = pickle.loads(pickle.dumps(ContextLengthError(64, 60, 10)))
    assert isinstance(error, ValueError) and (error.max_model_len, error.prompt_len, error.max_tokens) == (64, 60, 10)
    assert "maximum context length is 64 tokens" in str(error) and "70 tokens" in str(error)


def test_max_tokens_resolved_once_against_the_context():
    assert resolve_max_tokens(None, 10, 64) == 54
    assert resolve_max_tokens(None, 10, 64, default=16) == 16
    assert resolve_max_tokens(0, 64, 64) == 0  # prompt log-probs only
    for args in ((None, 64, 64), (5, 60, 64)):
        with pytest.raises(ContextLengthError):
            resolve_max_tokens(*args)


def test_the_first_output_carries_the_prompt_and_a_whole_request_comes_once(llama_ckpt):
    llm = LLM(str(llama_ckpt), num_kv_blocks=32)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=2)
    engine.add_request(EngineRequest("streamed", [1, 2, 3], params))
    engine.add_request(EngineRequest("whole", [1, 2, 3], params, whole=True))
    seen: dict[str, list[RequestOutput]] = {"streamed": [], "whole": []}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out)
    streamed, whole = seen["streamed"], seen["whole"]
    assert streamed[0].prompt_token_ids == [1, 2, 3] and all(o.prompt_token_ids is None for o in streamed[1:])
    assert len(whole) == 1 and whole[0].finished and whole[0].prompt_token_ids == [1, 2, 3]
    folded = accumulate(streamed)
    assert [o.token_ids for o in folded.outputs] == [o.token_ids for o in whole[0].outputs]
    assert all(len(o.token_ids) == 4 for o in whole[0].outputs)
