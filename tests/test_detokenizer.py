"""Incremental detokenization: whole characters only, stop strings never shown in part."""
from actors.detokenizer import IncrementalDetokenizer
from actors.loader import load_tokenizer


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
