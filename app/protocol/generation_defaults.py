"""The sampling defaults a checkpoint ships in generation_config.json, as vLLM applies them
(--generation-config auto): a request that leaves temperature, top_p, top_k, min_p or
repetition_penalty unset gets the model's value instead of the server's."""
from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("shoal.api")

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
CHOICES = ("auto", "vllm")  # the model's defaults, or none (vLLM's own)


def model_sampling_defaults(model_dir: Path | None, mode: str = "auto") -> dict:
    if mode == "vllm" or model_dir is None:
        return {}
    try:
        config = json.loads((Path(model_dir) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    defaults = {f: config[f] for f in FIELDS if config.get(f) is not None}
    if defaults:
        log.info("sampling defaults from the model's generation_config.json: %s",
                 ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults


def with_model_defaults(body, defaults: dict):
    """The request with the model's defaults in the sampling fields it left unset."""
    unset = {f: v for f, v in defaults.items() if f in type(body).model_fields and getattr(body, f) is None}
    return body.model_copy(update=unset) if unset else body
