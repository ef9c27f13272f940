"""Harmony (gpt-oss; vLLM's `openai` parser): a call is a message to `functions.NAME` on the
commentary channel. The whole output is read by channel (app/protocol/harmony.py), so this
format only names the parser and spells forced calls."""
from __future__ import annotations

from app.protocol.tool_parsers.calls import ToolFormat

CALL_HEADER = "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"



def parse_block(block: str) -> None:
    return None  # never called: a harmony plan reads calls with HarmonyScanner, not by blocks


FORMAT = ToolFormat("harmony", (CALL_HEADER,), "<|call|>", parse_block, channels=True,
                    call_begin=CALL_HEADER, call_end="<|call|>", separator="<|start|>assistant",
                    quote_name=False)
