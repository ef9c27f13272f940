"""Demo-model training: it yields the cores to test runs (app/demo/yielding.py), and its
tokenizer reads the prompt's fixed text as a few tokens (app/demo/train.py)."""
import json
import random
import subprocess
import sys

from app.demo import data, train, yielding
from app.demo.eval import parse_tool_calls


def test_this_session_counts_and_a_dead_run_marker_is_dropped():
    assert yielding.tests_running()  # conftest marked this pytest session
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = yielding.MARKERS / str(dead.pid)
    stale.touch()
    assert yielding.tests_running()
    assert not stale.exists()


def test_the_prompts_fixed_text_is_a_token_a_piece_and_replies_keep_their_pieces():
    tok = train.build_tokenizer()
    pieces = [tok.convert_tokens_to_ids(p) for p in train.PROMPT_PIECES]
    assert len(set(pieces)) == len(pieces) and tok.unk_token_id not in pieces
    rng = random.Random(0)
    for thinking, template in ((False, train.CHAT_TEMPLATE), (True, train.CHAT_TEMPLATE),
                               (False, train.DESCRIPTION_FIRST_TEMPLATE)):
        tok.chat_template = template
        s = data.tool_call_sample(rng, thinking)
        text = train.render_prompt(tok, s)
        prompt = tok.encode(text, add_special_tokens=False)
        assert tok.decode(prompt) == text
        # The preamble and the schema's scaffolding match the template's rendering exactly
        # (description first, the scaffolding before a description is byte-level pieces),
        assert set(pieces[:5] + pieces[6:7]) | set(pieces[-2:]) <= set(prompt)
        assert (pieces[5] in prompt) == (template == train.CHAT_TEMPLATE)
        assert len(prompt) < 130  # ~300 before the pieces were tokens
        # and a name has the same tokens around it in the schema as in the call.
        reply = tok.encode(s["target"], add_special_tokens=False)
        [called] = parse_tool_calls(s["target"])[1]
        for name in (t["function"]["name"] for t in s["tools"]):
            around = tok.encode(f'{{"name": "{name}",', add_special_tokens=False)
            assert tok.convert_ids_to_tokens(around[:4]) == ['{"', "name", '":', 'Ġ"']
            # (description first, the `{"` before `name` is the description's `", "`)
            assert _contains(prompt, around if template == train.CHAT_TEMPLATE else around[1:])
            assert _contains(reply, around) == (name == called["name"])
        assert not set(pieces) & set(reply)
        assert tok.decode(reply) == s["target"]


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_training_runs_its_stages_resumes_and_tunes_a_base(tmp_path, monkeypatch, capsys):
    import torch
    monkeypatch.setattr(train, "tests_running", lambda: False)  # this test is the test run
    tiny = ["--eval-n", "0", "--tokens-per-batch", "256", "--threads", "1", "--save-minutes", "0"]
    out, state = tmp_path / "model", tmp_path / "train" / "state.pt"
    train.main(["--steps", "2", "--copy-steps", "1", "--mix-steps", "1", "--out", str(out),
                "--state", str(state), *tiny])
    assert (out / "model.safetensors").exists() and (tmp_path / "train" / "base").is_dir()
    saved = torch.load(state, weights_only=False)
    assert (saved["stage"], saved["stage_step"], saved["step"]) == ("mix", 1, 4)
    # A longer mixed stage continues the same run where it stopped.
    train.main(["--steps", "2", "--copy-steps", "1", "--mix-steps", "2", "--out", str(out),
                "--state", str(state), *tiny])
    assert "resumed at step 4 (mix stage)" in capsys.readouterr().out
    assert torch.load(state, weights_only=False)["step"] == 5
    # Tuning a finished model: the copy and mixed stages only, from its weights.
    tuned_state = tmp_path / "tune" / "state.pt"
    train.main(["--base", str(out), "--copy-steps", "1", "--mix-steps", "1",
                "--out", str(tmp_path / "tuned"), "--state", str(tuned_state), *tiny])
    saved = torch.load(tuned_state, weights_only=False)
    assert (saved["stage"], saved["step"]) == ("mix", 2)
    # The base stage reads schemas name first (OpenAI order), the tuned model description first.
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(tmp_path / "train" / "base").chat_template == train.CHAT_TEMPLATE
    for tuned in (out, tmp_path / "tuned"):
        assert AutoTokenizer.from_pretrained(tuned).chat_template == train.DESCRIPTION_FIRST_TEMPLATE


def test_copy_and_quote_samples_and_the_tuning_mixture_adds_up():
    rng = random.Random(0)
    for _ in range(50):
        s = data.copy_sample(rng, False)
        assert s["target"] == s["expect"] and s["messages"][-1]["content"].endswith("\n" + s["expect"])
    for _ in range(50):
        # Quoting: the request's words, in order, as a JSON list of strings.
        s = data.quote_sample(rng, False)
        words = json.loads(s["target"])
        assert s["target"] == s["expect"] and s["messages"][-1]["content"].endswith(": " + " ".join(words))
    # Spliced words are slices of the data's own words (`lav` + `ico`), never one of them.
    spliced = [data.spliced_word(rng) for _ in range(500)]
    assert not {w.lower() for w in spliced} & set(data.VALUE_WORDS)
    assert all(w.isalpha() and len(w) >= 4 for w in spliced)
    for mixture, share in ((data.COPY_MIXTURE, 0.5), (data.TUNE_MIXTURE, 0.2)):
        assert abs(sum(w for w, _, _ in mixture) - 1.0) < 1e-9
        samples = [data.sample(rng, mixture) for _ in range(2000)]
        kinds = [s["kind"] for s in samples]
        assert abs(kinds.count("copy") / len(kinds) - share / 2) < 0.03
        assert abs(kinds.count("quote") / len(kinds) - share / 2) < 0.03
        # Tool calls offer the needed tool with another one 80% of the time (base mixture: half).
        calls = [len(s["tools"]) for s in samples if s["kind"] == "tool_call"]
        assert abs(calls.count(2) / len(calls) - 0.8) < 0.08
        # 60% of them ask for an invented value (base mixture: 30%): none from the lists.
        values = [v for s in samples if s["kind"] == "tool_call" for v in s["copied"]]
        invented = [v for v in values if v.lower() not in data.VALUE_WORDS and v not in data.SYMBOLS
                    and v not in data.CURRENCIES and "@" not in v and ":" not in v and " " not in v]
        assert 0.4 < len(invented) / len(values) < 0.7
    calls = [len(s["tools"]) for s in (data.sample(rng) for _ in range(2000)) if s["kind"] == "tool_call"]
    assert abs(calls.count(2) / len(calls) - 0.5) < 0.08


def test_tuning_targets_spell_copied_values_as_the_request_does():
    """`Thailand` after a space is ` T`, `h`, `ail`, `an`, `d`; the tuning stages write it
    `T`, `h`, `ail`, `an`, `d` (canonical: `Th`, ...), the same text."""
    tok = train.build_tokenizer()
    rng = random.Random(3)
    spelled = 0
    for _ in range(400):
        s = data.sample(rng, data.TUNE_MIXTURE)
        if s["kind"] in ("tool_call", "quote"):
            request = s["messages"][-1]["content"]
            assert s["copied"] and all(f" {v}" in request for v in s["copied"])
        _, canonical = train.encode(tok, s)
        _, labels = train.encode(tok, s, request_spelling=True)
        assert tok.decode([t for t in labels if t >= 0]) == s["target"] + train.EOS
        spelled += labels != canonical
    assert spelled  # some values do split differently after a space
    target = data.call_text("pop_x", {"country": "Thailand"}) + train.EOS
    ids = train.encode_target(tok, target, ["Thailand"])
    request = tok.encode(" Thailand", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(request[:2]) == ["ĠT", "h"]
    assert _contains(ids, tok.encode(' "T', add_special_tokens=False) + request[1:])
    assert tok.decode(ids) == target
