"""Grammar-constrained decoding in the engine: the spec as plain data, the compile cache, the
bitmask kernel, and constrained rows sharing a batch with free ones."""
from __future__ import annotations

import json
import pickle
import re

import jsonschema
import pytest
import torch

from actors.core.structured import bitmask_width
from actors.engine.llm import LLM
from actors.sampling_params import SamplingParams, StructuredOutput
from kernels.sampling import SamplingBatch, apply_token_bitmask, sample

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 6},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"]}


@pytest.fixture(scope="module")
def llm(llama_ckpt):
    return LLM(str(llama_ckpt), block_size=4, num_kv_blocks=256)


def texts(outputs) -> list[str]:
    return [o.text for out in outputs for o in out.outputs]


def test_spec_is_plain_picklable_hashable_data():
    so = StructuredOutput.json_schema(SCHEMA)
    params = SamplingParams(structured=so)
    assert pickle.loads(pickle.dumps(params)).structured == so  # crosses Ray as-is
    assert hash(so) == hash(StructuredOutput.json_schema(dict(reversed(SCHEMA.items()))))
    with pytest.raises(ValueError, match="kind"):
        StructuredOutput("xml", "<a/>")


def test_compile_cache_and_refusals(llm):
    grammars = llm.engine.grammars
    so = StructuredOutput("regex", "[ab]{3}")
    assert grammars.compile(so) is grammars.compile(StructuredOutput("regex", "[ab]{3}"))
    for bad in (StructuredOutput("regex", "("), StructuredOutput("json", "{not json"),
                StructuredOutput("choice", "[]"), StructuredOutput("grammar", "root ::= ")):
        with pytest.raises(ValueError, match=f"invalid {bad.kind} constraint") as info:
            grammars.compile(bad)
        assert ".cc:" not in str(info.value)  # no C++ source locations for clients


def test_bitmask_kernel_masks_only_its_rows():
    torch.manual_seed(0)
    vocab, rows = 70, [0, 2]
    allowed = torch.rand(3, vocab) < 0.3
    packed = torch.zeros(3, bitmask_width(vocab), dtype=torch.int32)
    for r in range(3):
        for t in allowed[r].nonzero().flatten().tolist():
            packed[r, t // 32] |= (1 << (t % 32)) if t % 32 < 31 else -(1 << 31)
    logits = torch.randn(3, vocab)
    out = apply_token_bitmask(logits, packed, rows)
    assert torch.equal(torch.isinf(out[rows]), ~allowed[rows])
    assert torch.equal(out[1], logits[1]) and not torch.isinf(logits).any()  # input untouched
    batch = SamplingBatch(temperature=torch.ones(3), allowed=packed, allowed_rows=rows)
    chosen = sample(logits, batch)
    assert allowed[0, chosen[0]] and allowed[2, chosen[2]]


def test_constrained_rows_share_a_batch_with_free_rows(llm):
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = texts(llm.generate(["The quick brown fox", "Once upon a time"], free))
    specs = [StructuredOutput.json_schema(SCHEMA), StructuredOutput("regex", r"[0-9]{3}-[a-z]{2}"),
             StructuredOutput.choice(["yes", "no", "maybe"]),
             StructuredOutput("grammar", 'root ::= "(" [a-c]+ ")"')]
    kinds = [SamplingParams(temperature=1.0, seed=i, max_tokens=80, structured=so)
             for i, so in enumerate(specs)]
    outs = llm.generate(["The quick brown fox", "Hello", "Hello", "Hello", "Hello", "Once upon a time"],
                        [free] + kinds + [free])
    got = texts(outs)
    assert [got[0], got[5]] == alone  # free rows are untouched by their neighbours' masks
    jsonschema.validate(json.loads(got[1]), SCHEMA)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", got[2])
    assert got[3] in ("yes", "no", "maybe")
    assert re.fullmatch(r"\([a-c]+\)", got[4])
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[1:5])


def test_grammar_ends_output_despite_min_tokens_and_ignore_eos(llm):
    so = StructuredOutput.choice(["yes", "no"])
    for extra in ({"min_tokens": 10}, {"ignore_eos": True}):
        params = SamplingParams(temperature=1.0, max_tokens=30, structured=so, **extra)
        out = llm.generate("Hi", params)[0]
        assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"


def test_each_sample_has_its_own_matcher_and_survives_preemption(llama_ckpt):
    llm = LLM(str(llama_ckpt), block_size=4, num_kv_blocks=24, max_num_batched_tokens=64)
    so = StructuredOutput("regex", r"[a-z]{10,14}")
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=40, structured=so)
    outs = llm.generate(["The quick brown fox jumps over the lazy dog"] * 4, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert all(re.fullmatch(r"[a-z]{10,14}", t) for t in texts(outs))
