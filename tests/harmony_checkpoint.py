"""A tiny checkpoint that speaks harmony (gpt-oss's chat format): tests/checkpoints.py's gpt-oss
(or another architecture) with a tokenizer whose special tokens are harmony's and a harmony chat template, and eos ids
as gpt-oss ships them (config.json: <|return|>; generation_config.json: <|return|>,
<|endoftext|>, <|call|>).

The template writes the layout gpt-oss's template writes (system message with the reasoning
effort, developer message with instructions and tools, calls as commentary messages to
functions.NAME, tool results from functions.NAME, a call turn's analysis from `thinking` or
its content, refusing both; an answer without content fails), in fewer words: tests only need
the format.
"""
from __future__ import annotations

import json
import pathlib

from checkpoints import BPE_VOCAB, _corpus, make_checkpoint

SPECIAL_TOKENS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                  "<|constrain|>", "<|return|>", "<|call|>"]
EOS, PAD = "<|return|>", "<|endoftext|>"
GENERATION_EOS = ["<|return|>", "<|endoftext|>", "<|call|>"]

CHAT_TEMPLATE = (
    "{%- set effort = reasoning_effort if reasoning_effort is defined else 'medium' -%}"
    "<|start|>system<|message|>Reasoning: {{ effort }}\n\n"
    "# Valid channels: analysis, commentary, final."
    "{%- if tools %} Calls to these tools go to the commentary channel: 'functions'.{% endif -%}"
    "<|end|>"
    "{%- set rest = messages -%}"
    "{%- set instructions = '' -%}"
    "{%- if messages and messages[0].role in ['system', 'developer'] -%}"
    "{%- set instructions = messages[0].content -%}{%- set rest = messages[1:] -%}"
    "{%- endif -%}"
    "{%- if instructions or tools -%}<|start|>developer<|message|>"
    "{%- if instructions %}# Instructions\n\n{{ instructions }}{% endif %}"
    "{% if tools %}{% if instructions %}\n\n{% endif %}# Tools\n\nnamespace functions {\n"
    "{% for tool in tools %}\n// {{ tool.function.description or '' }}\n"
    "type {{ tool.function.name }} = (_: {{ (tool.function.parameters or {}) | tojson }}) => any;\n"
    "{% endfor %}\n} // namespace functions{% endif %}"
    "<|end|>{%- endif -%}"
    "{%- set last = namespace(call='') -%}"
    "{%- for message in rest -%}"
    "{%- if message.role == 'assistant' and message.tool_calls -%}"
    "{%- if message.content and message.thinking -%}"
    "{{ raise_exception('a call turn with both content and thinking') }}"
    "{%- endif -%}"
    "{%- if message.thinking or message.content -%}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking or message.content }}<|end|>"
    "{%- endif -%}"
    "{%- for call in message.tool_calls -%}"
    "<|start|>assistant to=functions.{{ call.function.name }}<|channel|>commentary json<|message|>"
    "{{ call.function.arguments | tojson }}<|call|>"
    "{%- set last.call = call.function.name -%}"
    "{%- endfor -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'tool' -%}"
    "<|start|>functions.{{ last.call }} to=assistant<|channel|>commentary<|message|>"
    "{{ message.content }}<|end|>"
    "{%- else -%}"
    "<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)


def build_tokenizer():
    """checkpoints.py's byte-level BPE, with harmony's special tokens after the learned vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, clean_up_tokenization_spaces=False,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOS, PAD)])
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def make_harmony_checkpoint(path, arch: str = "gpt_oss", **overrides) -> pathlib.Path:
    """The `arch` checkpoint of tests/checkpoints.py with the harmony tokenizer and eos ids."""
    tok = build_tokenizer()
    path = make_checkpoint(path, arch, vocab_size=len(tok), **overrides)
    for stale in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "chat_template.jinja"):
        (path / stale).unlink(missing_ok=True)
    tok.model_max_length = overrides.get("max_position_embeddings", 512)
    tok.save_pretrained(path)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    _update_json(path / "config.json", eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    _update_json(path / "generation_config.json", eos_token_id=[ids[t] for t in GENERATION_EOS],
                 pad_token_id=ids[PAD])
    return path


def _update_json(file: pathlib.Path, **fields) -> None:
    file.write_text(json.dumps({**json.loads(file.read_text()), **fields}, indent=2))
