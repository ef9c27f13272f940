"""The output parsers a model needs, for wherever the server's flags are silent.

A checkpoint declares them in its config.json, next to the architecture they belong to:
    "reasoning_parser": "qwen3", "tool_call_parser": "hermes"
(the bundled demo model does). A checkpoint that declares nothing gets its family's
reasoning parser: Qwen3 and QwQ think in `<think>` blocks, DeepSeek-R1 distills (Qwen2 or
Llama by architecture, R1 by name) start inside one, Gemma 4 thinks in its `<|channel>`;
gpt-oss (and any checkpoint whose chat template writes harmony's channels) gets the harmony
parsers. Its tool calls are then read in the markup its chat template teaches
(app/protocol/tool_parsers). A flag always wins, and `--reasoning-parser none` turns the split
off.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from app.protocol.harmony import is_harmony_template
from app.protocol.reasoning import HARMONY, reasoning_parser_name
from app.protocol.tool_parsers import tool_format

log = logging.getLogger("shoal.api")

FIELDS = ("reasoning_parser", "tool_call_parser")
FAMILY_REASONING = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "glm4_moe": "qwen3",  # model_type -> parser
                    "glm4_moe_lite": "qwen3", "minimax_m2": "deepseek_r1",
                    "gemma4": "gemma4", "gemma4_text": "gemma4",
                    **dict.fromkeys(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"),
                                    "qwen3")}
NAME_REASONING = (("deepseek-r1", "deepseek_r1"), ("qwq", "qwen3"))  # in the checkpoint's name
HARMONY_PARSERS = {"reasoning_parser": HARMONY, "tool_call_parser": HARMONY}  # gpt-oss: both


def model_parsers(config: dict, name: str = "", chat_template: str = "") -> dict[str, str]:
    """What a checkpoint's config.json declares, else what its family (or, for harmony, its
    chat template) implies."""
    found = {f: config[f] for f in FIELDS if isinstance(config.get(f), str) and config[f]}
    if config.get("model_type") == "gpt_oss" or is_harmony_template(chat_template):
        return {**HARMONY_PARSERS, **found}
    if "reasoning_parser" not in found:
        names = f"{name} {config.get('_name_or_path', '')}".lower()
        family = FAMILY_REASONING.get(config.get("model_type", ""))
        by_name = next((parser for key, parser in NAME_REASONING if key in names), None)
        if by_name or family:
            found["reasoning_parser"] = by_name or family
    return found


def chat_template_text(model_dir: Path) -> str:
    """The checkpoint's chat template as written (chat_template.jinja, or in
    tokenizer_config.json); "" when it has none."""
    try:
        jinja = model_dir / "chat_template.jinja"
        if jinja.exists():
            return jinja.read_text()
        template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return ""
    if isinstance(template, list):  # several named templates
        return " ".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template if isinstance(template, str) else ""


def with_model_parsers(options, model_dir: Path | None):
    """`options` (any dataclass with FIELDS: ServerSettings, run-batch's BatchOptions) with
    each parser the flags left unset taken from the model; unchanged if nothing is known."""
    if model_dir is None:
        return options
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return options
    template = getattr(options, "chat_template", None) or chat_template_text(Path(model_dir))  # (--chat-template's)
    found = model_parsers(config, Path(model_dir).name, template)
    silent = {f: v for f, v in found.items()
              if getattr(options, f) is None and known(f, v)}
    if silent:
        log.info("output parsers from the model: %s",
                 ", ".join(f"{k}={v}" for k, v in sorted(silent.items())))
    return dataclasses.replace(options, **silent)


def known(field: str, name: str) -> bool:
    """A name this server has; an unknown one a checkpoint declares is skipped with a warning
    (a flag's unknown name fails at start-up instead)."""
    try:
        (reasoning_parser_name if field == "reasoning_parser" else tool_format)(name)
        return True
    except ValueError as exc:
        log.warning("ignoring the model's %s: %s", field, exc)
        return False
