"""The offline `LLM` in vLLM's forms: prompt dicts ({"prompt"} / {"prompt_token_ids"}), `chat`
through the model's own template against transformers, and a call that cannot be served
leaving nothing queued behind it."""
import pytest
from oracle import hf_greedy
from test_engine import assert_pool_free, prompts_of

from actors.engine.llm import LLM
from actors.request import ContextLengthError
from actors.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_ckpt):
    engine = LLM(str(llama_ckpt), block_size=4, num_kv_blocks=64, max_model_len=64)
    yield engine
    assert_pool_free(engine)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_prompt_dicts_equal_their_plain_forms(llm):
    ids, text = prompts_of([9])[0], "the cat sat on"
    plain = tokens(llm.generate([ids, text], GREEDY))
    assert tokens(llm.generate([{"prompt_token_ids": ids}, {"prompt": text}], GREEDY)) == plain
    assert tokens(llm.generate({"prompt_token_ids": ids}, GREEDY)) == plain[:1]  # one dict alone
    both = llm.generate({"prompt": "shown text", "prompt_token_ids": ids}, GREEDY)[0]
    assert (both.prompt_token_ids, both.prompt, tokens([both])) == (ids, "shown text", plain[:1])
    assert plain[0] != plain[1]  # (two different prompts: the pairing above means something)


def test_chat_renders_the_template_and_equals_transformers(llm, llama_ckpt):
    tok = llm.get_tokenizer()
    talk = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    ids = tok.apply_chat_template(talk, add_generation_prompt=True, tokenize=True, return_dict=False)
    out = llm.chat(talk, GREEDY)
    assert len(out) == 1 and out[0].prompt_token_ids == list(ids)
    assert tokens(out) == [hf_greedy(llama_ckpt, list(ids), 8)]
    # several conversations; continuing the last message instead of opening a new turn
    other = [{"role": "user", "content": "bye"}]
    assert tokens(llm.chat([talk, other], GREEDY))[0] == tokens(out)[0]
    cont = llm.chat(talk + [{"role": "assistant", "content": "Hi"}], GREEDY, add_generation_prompt=False,
                    continue_final_message=True)[0]
    assert tok.decode(cont.prompt_token_ids).rstrip().endswith("Hi")
    own = llm.chat(other, GREEDY, chat_template="{% for m in messages %}<{{ m.content }}>{% endfor %}")[0]
    assert own.prompt_token_ids == tok.encode("<bye>", add_special_tokens=False)
    with pytest.raises(ValueError, match="can't both"):
        llm.chat(other, GREEDY, continue_final_message=True)


@pytest.mark.parametrize("prompts, params, error, match", [
    ([{"text": "hi"}], GREEDY, TypeError, "prompt_token_ids"),
    ([{}], GREEDY, TypeError, "prompt_token_ids"),
    ([3.5], GREEDY, TypeError, "float"),
    ([[1, "a"]], GREEDY, TypeError, "list"),
    ([{"prompt": 5}], GREEDY, TypeError, "text"),
    (["a", "b"], [GREEDY], ValueError, "2 prompts but 1 sampling_params"),
])
def test_prompts_it_cannot_read_are_refused_before_any_is_queued(llm, prompts, params, error, match):
    with pytest.raises(error, match=match):
        llm.generate(["first", *prompts] if isinstance(params, SamplingParams) else prompts, params)
    assert not llm.engine.has_unfinished()


def test_a_prompt_refused_by_the_engine_leaves_the_others_unqueued(llm):
    fine, too_long = prompts_of([5])[0], prompts_of([70])[0]
    with pytest.raises(ContextLengthError):
        llm.generate([fine, too_long], GREEDY)
    assert not llm.engine.has_unfinished() and not llm._pending
    again = llm.generate([fine], GREEDY)  # the next call returns its own prompt only
    assert len(again) == 1 and again[0].prompt_token_ids == fine


def test_vllm_option_names_build_the_same_engine(llama_ckpt):
    llm = LLM(model=str(llama_ckpt), enforce_eager=True, tensor_parallel_size=1, dtype="fp32",
              disable_radix_cache=True, num_gpu_blocks_override=32, block_size=4,
              # what vLLM scripts pass along, for what shoal always does
              trust_remote_code=True, enable_chunked_prefill=True, swap_space=4, tokenizer=str(llama_ckpt))
    c = llm.config
    assert (c.model_path, c.eager_decode, c.tp_size, c.dtype, c.enable_prefix_caching, c.num_kv_blocks) == \
        (str(llama_ckpt), True, 1, "float32", False, 32)
    ids = prompts_of([6])[0]
    assert tokens(llm.generate([ids], GREEDY)) == [hf_greedy(llama_ckpt, ids, 8)]
    with pytest.raises(TypeError, match="'model' and 'model_path' both set the option model_path"):
        LLM(str(llama_ckpt), model=str(llama_ckpt))
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(str(llama_ckpt), no_such_option=1)


def test_a_request_failing_mid_run_leaves_the_engine_usable(llm):
    """A request whose post-processing raises fails the call (as in vLLM); the call's other
    requests end with it, and the next call gets its own outputs only, the pool all free."""
    from actors.errors import RequestFailedError

    for rid, ids in zip("abc", prompts_of([4, 6, 8], seed=9)):
        llm.add_request(rid, ids, GREEDY)

    def broken(token, check_stop=True):
        raise KeyError("a bug in one request's handling")
    llm.engine.requests["b"].detoks[0].add = broken
    with pytest.raises(RequestFailedError, match="KeyError"):
        llm.run()
    assert not llm.engine.has_unfinished() and not llm._pending
    again = llm.generate(["later"], GREEDY)
    assert len(again) == 1 and again[0].prompt == "later"
    assert_pool_free(llm)


def test_an_interrupted_call_leaves_the_engine_usable(llm, monkeypatch):
    steps, step = 0, llm.engine.step

    def interrupted():
        nonlocal steps
        steps += 1
        if steps == 2:
            raise KeyboardInterrupt
        return step()
    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts_of([5, 7], seed=4), GREEDY)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished() and not llm._pending
    assert len(llm.generate([[3, 4, 5]], GREEDY)) == 1
    assert_pool_free(llm)


@pytest.mark.parametrize("prompts, params, match", [
    (3.5, GREEDY, "got float"),
    (None, GREEDY, "got NoneType"),
    ([{"prompt_token_ids": "hello"}], GREEDY, "must be a list of token ids"),
    ([[1.0, 2.0]], GREEDY, "other than ints"),
    (["a", "b"], (GREEDY, {"temperature": 0}), "got dict"),
    ("hi", {"temperature": 0}, "got dict"),
])
def test_argument_types_it_cannot_read_are_named(llm, prompts, params, match):
    with pytest.raises(TypeError, match=match):
        llm.generate(prompts, params)
    assert not llm.engine.has_unfinished()


def test_a_tuple_of_sampling_params_is_one_per_prompt(llm):
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = llm.generate(["a", "b"], (GREEDY, short))
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 2]


def test_chat_refuses_a_part_that_is_not_text(llm):
    talk = [{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                         {"type": "image_url", "image_url": {"url": "http://127.0.0.1/a.png"}}]}]
    with pytest.raises(ValueError, match="message 0, content part 1: parts of type 'image_url' are not supported"):
        llm.chat(talk, GREEDY)
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    assert len(llm.chat(text_parts, GREEDY)) == 1
