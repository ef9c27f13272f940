"""Tool-call formats by name, and the choice of one for a model.

`--tool-call-parser NAME` picks a format; without it (or with `auto`) the chat template
tells: the markup it teaches the model is the markup the model writes.
"""
from __future__ import annotations

from app.protocol.tool_parsers import (
    gemma, gemma4, glm45, harmony, hermes, json_calls, llama3_json, minimax_m2, mistral, qwen3_coder,
)
from app.protocol.tool_parsers.calls import ParsedCall, ToolFormat
from app.protocol.tool_parsers.scanner import ScanResult, ToolCallScanner

FORMATS: dict[str, ToolFormat] = {
    "hermes": hermes.FORMAT, "qwen": hermes.FORMAT, "qwen25": hermes.FORMAT,
    "qwen3": hermes.FORMAT, "minicpm": hermes.FORMAT,
    "llama3_json": llama3_json.FORMAT, "llama3": llama3_json.FORMAT, "llama": llama3_json.FORMAT,
    "mistral": mistral.FORMAT,
    "gemma": gemma.FORMAT, "pythonic": gemma.FORMAT, "gemma4": gemma4.FORMAT,
    "json": json_calls.FORMAT, "generic": json_calls.FORMAT,
    "harmony": harmony.FORMAT, "openai": harmony.FORMAT, "gpt_oss": harmony.FORMAT,
    "qwen3_coder": qwen3_coder.FORMAT, "qwen3_xml": qwen3_coder.FORMAT,
    "glm45": glm45.FORMAT, "glm47": glm45.FORMAT, "glm4_moe": glm45.FORMAT,
    "minimax_m2": minimax_m2.FORMAT, "minimax": minimax_m2.FORMAT,
}
JSON_FORMAT = json_calls.FORMAT

# Markup in a chat template -> the format its model writes (first match wins: the XML formats
# before hermes, whose `<tool_call>` they share). Gemma 4's `<|tool_call>` is none of the others'.
TEMPLATE_HINTS = (("<|channel|>", harmony.FORMAT), ("<|tool_call>", gemma4.FORMAT),
                  ("<minimax:tool_call>", minimax_m2.FORMAT),
                  ("<arg_key>", glm45.FORMAT), ("<function=", qwen3_coder.FORMAT), ("<tool_call>", hermes.FORMAT),
                  ("[TOOL_CALLS]", mistral.FORMAT), ("tool_code", gemma.FORMAT),
                  ("<|python_tag|>", llama3_json.FORMAT), ("ipython", llama3_json.FORMAT))


def parser_names() -> list[str]:
    return sorted(FORMATS) + ["auto"]


def tool_format(name: str | None, tokenizer=None) -> ToolFormat:
    """The named format, or (None / "auto") the one the tokenizer's chat template uses."""
    if name and name != "auto":
        key = name.lower().replace("-", "_")
        if key not in FORMATS:
            raise ValueError(f"unknown tool call parser {name!r}; "
                             f"choose from {', '.join(parser_names())}")
        return FORMATS[key]
    return detect(tokenizer)


def detect(tokenizer) -> ToolFormat:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates
        template = " ".join(str(t) for t in template.values())
    for hint, fmt in TEMPLATE_HINTS:
        if hint in template:
            return fmt
    return JSON_FORMAT


__all__ = ["FORMATS", "JSON_FORMAT", "ParsedCall", "ScanResult", "ToolCallScanner", "ToolFormat",
           "detect", "parser_names", "tool_format"]
