"""A tiny checkpoint that speaks Gemma 4's chat format: tests/checkpoints.py's Llama with a
tokenizer whose special tokens are Gemma 4's and a chat template that writes Gemma 4's markup,
so the server picks the gemma4 tool-call format from the template as it would for a real Gemma 4
checkpoint (Gemma 4's own architecture is checked in tests/test_model_families.py).

The template writes what Gemma 4's writes, in fewer words (tests only need the format): turns
`<|turn>ROLE\\n...<turn|>`, the assistant's role `model`, tools as `<|tool>declaration:...<tool|>`
in the system turn, calls as `<|tool_call>call:NAME{key:value,...}<tool_call|>` (keys sorted and
unquoted, strings between `<|"|>`, true / false, None as Python prints it), results as
`<|tool_response>response:NAME{value:...}<tool_response|>` in the same model turn, `<|think|>`
in the system turn when thinking is on, and, when it is off, a generation prompt that closes an
empty thinking channel: `<|turn>model\\n<|channel>thought\\n<channel|>`.
"""
from __future__ import annotations

import pathlib

from checkpoints import special_tokenizer, with_tokenizer

SPECIAL_TOKENS = ["<pad>", "<eos>", "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>",
                  "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                  "<tool_response|>", '<|"|>']
EOS, PAD = "<turn|>", "<pad>"
GENERATION_EOS = ["<eos>", "<turn|>", "<|tool_response>"]  # as Gemma 4's generation_config.json

CHAT_TEMPLATE = (
    "{%- macro arg(value) -%}"
    "{%- if value is string -%}{{- '<|\"|>' + value + '<|\"|>' -}}"
    "{%- elif value is boolean -%}{{- 'true' if value else 'false' -}}"
    "{%- elif value is mapping -%}{{- '{' -}}"
    "{%- for key, item in value | dictsort -%}{{- ',' if not loop.first -}}{{- key -}}:{{- arg(item) -}}"
    "{%- endfor -%}{{- '}' -}}"
    "{%- elif value is sequence -%}{{- '[' -}}"
    "{%- for item in value -%}{{- ',' if not loop.first -}}{{- arg(item) -}}{%- endfor -%}{{- ']' -}}"
    "{%- else -%}{{- value -}}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set thinking = enable_thinking is defined and enable_thinking -%}"
    "{%- set rest = messages -%}"
    "{%- if thinking or tools or (messages and messages[0].role == 'system') -%}"
    "{{- '<|turn>system\\n' -}}{%- if thinking -%}<|think|>{%- endif -%}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{{- messages[0].content -}}{%- set rest = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for tool in tools or [] -%}"
    "<|tool>declaration:{{- tool.function.name -}}"
    "{{- arg({'description': tool.function.description or '', 'parameters': tool.function.parameters or {}}) -}}"
    "<tool|>"
    "{%- endfor -%}"
    "{{- '<turn|>\\n' -}}"
    "{%- endif -%}"
    "{%- set ns = namespace(last='', call='') -%}"
    "{%- for message in rest -%}"
    "{%- if message.role == 'tool' -%}"
    "<|tool_response>response:{{- ns.call -}}{value:{{- arg(message.content) -}}}<tool_response|>"
    "{%- set ns.last = 'tool' -%}"
    "{%- else -%}"
    "{%- if ns.last != 'tool' -%}"
    "{{- '<|turn>' + ('model' if message.role == 'assistant' else message.role) + '\\n' -}}"
    "{%- endif -%}"
    "{%- for call in message.tool_calls or [] -%}"
    "<|tool_call>call:{{- call.function.name -}}{{- arg(call.function.arguments) -}}<tool_call|>"
    "{%- set ns.call = call.function.name -%}"
    "{%- endfor -%}"
    "{{- message.content or '' -}}"
    "{%- if message.tool_calls -%}{%- set ns.last = 'call' -%}"
    "{%- else -%}{{- '<turn|>\\n' -}}{%- set ns.last = '' -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{%- if ns.last != 'tool' -%}{{- '<|turn>model\\n' -}}{%- endif -%}"
    "{%- if not thinking -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}"
    "{%- endif -%}"
)


def build_tokenizer():
    """checkpoints.py's byte-level BPE, with Gemma 4's special tokens after the learned vocab."""
    return special_tokenizer(SPECIAL_TOKENS, EOS, PAD, CHAT_TEMPLATE)


def make_gemma4_checkpoint(path, arch: str = "llama", **overrides) -> pathlib.Path:
    """The `arch` checkpoint of tests/checkpoints.py with the Gemma 4 tokenizer and eos ids."""
    return with_tokenizer(path, arch, build_tokenizer(), EOS, PAD, GENERATION_EOS, **overrides)
