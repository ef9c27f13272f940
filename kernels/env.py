"""On/off switches from the environment, one spelling everywhere (SHOAL_NATIVE_KERNELS=0, ...)."""
from __future__ import annotations

import os

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def truthy(text: str) -> bool | None:
    """True / False for the usual spellings (1/0, true/false, yes/no, on/off), else None."""
    text = text.strip().lower()
    return True if text in TRUE else False if text in FALSE else None


def flag(name: str, default: bool) -> bool:
    """The variable as a switch; unset or unreadable: `default`."""
    value = truthy(os.environ.get(name, ""))
    return default if value is None else value
