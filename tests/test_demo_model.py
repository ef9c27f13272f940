"""The bundled demo model (actors/demo_model, trained by app/demo/train.py).

Loads in shoal and in transformers, gives the same greedy tokens in both, its chat template
renders tools / tool results / thinking, and it does the few things the eval
(docs/demo-model.md) shows it does reliably.
"""
from __future__ import annotations

import json
import re

import pytest
from oracle import hf_greedy, hf_model

from actors.engine.llm import LLM
from actors.sampling_params import SamplingParams
from actors.worker.checkpoint_files import BUNDLED_MODEL

pytestmark = pytest.mark.skipif(not (BUNDLED_MODEL / "model.safetensors").exists(),
                                reason="the bundled demo model is not built (make demo-model)")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def llm():
    # float32 like the transformers oracle (and the shipped weights).
    return LLM(None, dtype="float32")


def chat(llm, messages, tools=None, thinking=None, max_tokens=120) -> str:
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    prompt = llm.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                               add_generation_prompt=True, **kwargs)
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens,
                                             skip_special_tokens=False))[0]
    return out.outputs[0].text


def test_files_and_size():
    names = {p.name for p in BUNDLED_MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json"} <= names
    total = sum(p.stat().st_size for p in BUNDLED_MODEL.iterdir())
    assert total <= 20 * 2**20
    cfg = json.loads((BUNDLED_MODEL / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]


def test_loads_in_transformers_with_eos_im_end():
    model = hf_model(BUNDLED_MODEL)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(BUNDLED_MODEL))
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    # Digits are one token each, so numbers are spelled digit by digit.
    assert tok.tokenize("1692") == ["1", "6", "9", "2"]
    # Markup is one token and survives skip_special_tokens (a parser needs to see it).
    ids = tok.encode("<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call>", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<think>") in ids
    assert "<tool_call>" in tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("messages,tools", [
    ([{"role": "user", "content": "Solve 47 * 36."}], None),
    ([{"role": "user", "content": "What's the weather in Paris?"}], [WEATHER]),
])
def test_greedy_equals_transformers(llm, messages, tools):
    prompt = llm.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                               add_generation_prompt=True)
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert ours[0].outputs[0].token_ids == hf_greedy(BUNDLED_MODEL, ids, 32)


def test_chat_template_renders_tools_results_and_thinking(llm):
    tok = llm.tokenizer
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What's the weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": '{"temperature": 18}'}]
    text = tok.apply_chat_template(messages, tools=[WEATHER], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    # The shipped template puts a tool's description before its name (app/demo/train.py).
    fn = WEATHER["function"]
    assert ('{"type": "function", "function": {"description": ' + json.dumps(fn["description"])
            + ', "name": "get_weather", "parameters": ' + json.dumps(fn["parameters"]) + "}}") in text
    bare = {"type": "function", "function": {"name": "ping"}}  # no description, no parameters
    assert '\n{"type": "function", "function": {"name": "ping"}}\n' in tok.apply_chat_template(
        messages[1:2], tools=[bare], tokenize=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 18}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert plain.endswith("<|im_start|>assistant\n")


# The eval (docs/demo-model.md) shows what the model does reliably: the formats, all five
# arithmetic rows (97-99% on held-out problems) and declining what no offered tool covers
# (100%); not yet tool calls with unseen names (86%: the arguments are right in 94%).

@pytest.mark.parametrize("kind", ["add", "add_think", "mul21", "mul21_think", "mul22_think"])
def test_arithmetic_is_right_on_held_out_problems(llm, kind):
    from app.demo.data import eval_set
    from app.demo.eval import answer_number
    from app.demo.train import render_prompt

    problems = eval_set(20, seed=5)[kind]
    prompts = [llm.tokenizer.encode(render_prompt(llm.tokenizer, p), add_special_tokens=False)
               for p in problems]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=240))
    right = sum(answer_number(o.outputs[0].text) == p["expect"] for o, p in zip(outs, problems))
    assert right >= 16, f"{right}/20"  # 18-20/20 here; the eval measured 97-99/100


def test_arithmetic_reply_has_the_trained_shape(llm):
    """A think block with one step per line, then the problem restated with `=`;
    without thinking, the restated problem alone."""
    ask = [{"role": "user", "content": "Solve 23 + 45."}]
    thought = chat(llm, ask)
    assert thought.startswith("<think>\n") and "\n</think>\n\n" in thought
    assert len(thought.split("</think>")[0].strip().splitlines()) == 4  # <think> + 3 steps
    assert re.fullmatch(r"23 \+ 45 = \d+", thought.split("</think>")[-1].strip())
    assert re.fullmatch(r"23 \+ 45 = \d+", chat(llm, ask, thinking=False).strip())


def test_emits_a_tool_call_with_the_arguments_from_the_request(llm):
    out = chat(llm, [{"role": "user", "content": "What's the weather in Paris?"}], [WEATHER],
               thinking=False)
    body = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", out.strip(), re.S)
    assert body, out
    assert json.loads(body.group(1)) == {"name": "get_weather", "arguments": {"city": "Paris"}}


def held_out_calls(llm, make, max_tokens: int) -> list[tuple[dict, list[dict]]]:
    """20 of the eval's kind of problem (`make` from app/demo/data.py, seeded): each sample
    with the tool calls in the model's greedy reply."""
    import random

    from app.demo.eval import parse_tool_calls
    from app.demo.train import render_prompt

    rng = random.Random(5)
    samples = [make(rng, rng.random() < 0.5, heldout=True) for _ in range(20)]
    prompts = [llm.tokenizer.encode(render_prompt(llm.tokenizer, s), add_special_tokens=False)
               for s in samples]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                skip_special_tokens=False))
    return [(s, parse_tool_calls(o.outputs[0].text)[1]) for s, o in zip(samples, outs)]


def test_calls_tools_it_never_saw_with_values_held_out_of_training(llm):
    """The eval's tool calls (names never seen in training, held-out values): 88-96% right on
    draws of 100 (docs/demo-model.md)."""
    from app.demo.data import tool_call_sample
    right = sum(calls == [s["expect"]] for s, calls in held_out_calls(llm, tool_call_sample, 80))
    assert right >= 16, f"{right}/20"  # 17/20 with the shipped weights


def test_greeting_gets_a_plain_reply(llm):
    out = chat(llm, [{"role": "user", "content": "Hello!"}], [WEATHER], thinking=False)
    assert "<tool_call>" not in out
    assert out.strip() == "Hello! How can I help you today?"


def test_declines_a_request_no_offered_tool_covers(llm):
    """The eval's uncovered requests (same requests as tool calls, the covering tool left
    out) get a plain reply, no call: 99% there."""
    from app.demo.data import decline_sample
    called = [calls for _, calls in held_out_calls(llm, decline_sample, 60) if calls]
    assert len(called) <= 2, called
