"""Incremental detokenization: whole characters only, stop strings never shown in part."""
from actors.engine.detokenizer import IncrementalDetokenizer
from actors.worker.checkpoint_files import load_tokenizer


def stream(tokenizer, text, stop=(), include_stop=False):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], list(stop), include_stop=include_stop)
    pieces, matched = [], None
    for i, tok in enumerate(ids):
        matched = detok.add(tok)
        pieces.append(detok.release(final=matched is not None or i == len(ids) - 1))
        if matched:
            break
    return pieces, matched


def test_multibyte_characters_are_never_split(llama_ckpt):
    tok = load_tokenizer(llama_ckpt)
    text = "héllo 世界 🙂 done"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # the byte-level BPE splits these characters
    pieces, _ = stream(tok, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_is_held_back_then_cut(llama_ckpt):
    tok = load_tokenizer(llama_ckpt)
    pieces, matched = stream(tok, "the cat sat on the mat", stop=["on the"])
    assert matched == "on the"
    assert "".join(pieces) == "the cat sat "
    assert all("on" not in p for p in pieces)  # never a piece of the stop string


def test_partial_stop_prefix_is_released_when_it_does_not_match(llama_ckpt):
    tok = load_tokenizer(llama_ckpt)
    pieces, matched = stream(tok, "one two three", stop=["two four"])
    assert matched is None and "".join(pieces) == "one two three"


def test_include_stop_string(llama_ckpt):
    tok = load_tokenizer(llama_ckpt)
    pieces, matched = stream(tok, "alpha beta gamma", stop=["beta"], include_stop=True)
    assert matched == "beta" and "".join(pieces) == "alpha beta"


def cut_character_ids(tok) -> list[int]:
    """Token ids of whole characters, then one token that ends inside a multi-byte character."""
    ids = tok.encode("ok 世界", add_special_tokens=False)
    for n in range(1, len(ids)):
        if not tok.decode(ids[:n]).endswith("\ufffd") and tok.decode(ids[:n + 1]).endswith("\ufffd"):
            return ids[:n + 1]
    raise AssertionError("the test tokenizer merges these characters whole")


def test_a_cut_character_at_the_end_shows_as_decode_shows_it(llama_ckpt):
    tok = load_tokenizer(llama_ckpt)
    ids = cut_character_ids(tok)
    detok = IncrementalDetokenizer(tok, [], [])
    text = ""
    for i, t in enumerate(ids):
        detok.add(t)
        piece = detok.release(final=i == len(ids) - 1)
        assert i == len(ids) - 1 or "\ufffd" not in piece  # never shown while streaming
        text += piece
    assert text == tok.decode(ids) and text.endswith("\ufffd")


def test_engine_text_equals_decode_when_the_last_token_cuts_a_character(llama_ckpt):
    from actors.engine.llm import LLM
    from actors.sampling_params import SamplingParams

    tok = load_tokenizer(llama_ckpt)
    *prompt, cut = cut_character_ids(tok)
    llm = LLM(str(llama_ckpt), num_kv_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=1, logit_bias={cut: 100.0})  # forces it
    out = llm.generate(prompt, params)[0].outputs[0]
    assert out.token_ids == [cut]
    assert out.text == tok.decode([cut]) and out.text.endswith("\ufffd")


def test_decoder_equals_the_tokenizers_decode(llama_ckpt):
    """The Rust tokenizer's own decode, where the detokenizer uses it, gives what
    `tokenizer.decode` gives: special tokens kept or skipped, cut characters, any ids."""
    from actors.engine.detokenizer import decoder
    from actors.worker.checkpoint_files import resolve_model_path

    for tok in (load_tokenizer(llama_ckpt), load_tokenizer(resolve_model_path(None))):
        specials = [i for i in tok.all_special_ids if i is not None]
        cases = [tok.encode("héllo 世界 🙂", add_special_tokens=False), specials + [5, 6] + specials,
                 list(range(0, 300, 7)), cut_character_ids(tok), []]
        for skip in (True, False):
            decode = decoder(tok, skip)
            assert decode.func == tok._tokenizer.decode  # the fast path is the one under test
            for ids in cases:
                assert decode(ids) == tok.decode(ids, skip_special_tokens=skip)


def test_decoder_keeps_transformers_decode_where_it_cleans_up_spaces(llama_ckpt):
    from actors.engine.detokenizer import decoder

    tok = load_tokenizer(llama_ckpt)
    tok.clean_up_tokenization_spaces = True
    assert decoder(tok, True).func == tok.decode
