"""One log format for every process of a deployment (the CLI, Serve replicas, engine actors)."""
from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str | int = "INFO") -> None:
    """The root logger at `level` with FORMAT (a no-op where a handler is already set up)."""
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, format=FORMAT)
