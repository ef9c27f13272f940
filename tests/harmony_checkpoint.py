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

import pathlib

from checkpoints import special_tokenizer, with_tokenizer

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
    return special_tokenizer(SPECIAL_TOKENS, EOS, PAD, CHAT_TEMPLATE)


def make_harmony_checkpoint(path, arch: str = "gpt_oss", **overrides) -> pathlib.Path:
    """The `arch` checkpoint of tests/checkpoints.py with the harmony tokenizer and eos ids."""
    return with_tokenizer(path, arch, build_tokenizer(), EOS, PAD, GENERATION_EOS, **overrides)
