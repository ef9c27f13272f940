"""The model's own embedding pooling, read as sentence-transformers reads a checkpoint.

`modules.json` lists the modules applied after the transformer: a `Pooling` module, whose
folder's config.json sets `pooling_mode_*`, and a `Normalize` module (L2). Without
modules.json: last-token pooling, normalized (Qwen3-Embedding's shape, and what a decoder-only
model's last hidden state summarizes best).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from actors.pooling_params import PoolingParams

log = logging.getLogger("shoal.engine")

DEFAULT = PoolingParams(method="last", normalize=True)
MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}
APPLIED = ("Transformer", "Pooling", "Normalize")  # the module types embeddings reproduce


def read_pooling(path: Path) -> PoolingParams:
    """The checkpoint's pooling method and normalization. Raises ValueError for a pooling
    mode shoal does not compute (CLS, max, weighted mean, several at once)."""
    modules_file = path / "modules.json"
    if not modules_file.exists():
        return DEFAULT
    modules = json.loads(modules_file.read_text())
    kinds = {m["type"].rpartition(".")[2]: m for m in modules}
    skipped = sorted(k for k in kinds if k not in APPLIED)
    if skipped:
        log.warning("embeddings leave out the checkpoint's sentence-transformers modules %s", skipped)
    method = DEFAULT.method
    if "Pooling" in kinds:
        method = _pooling_method(path / kinds["Pooling"].get("path", "") / "config.json")
    return PoolingParams(method=method, normalize="Normalize" in kinds)


def _pooling_method(config_file: Path) -> str:
    config = json.loads(config_file.read_text())
    on = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    if len(on) != 1 or on[0] not in MODES:
        raise ValueError(f"{config_file}: pooling modes {on} are not supported; shoal pools with "
                         f"exactly one of {sorted(MODES)}")
    return MODES[on[0]]
