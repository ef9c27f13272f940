"""Loading shoal's Triton programs (kernels/*_programs.py) on first use.

Triton fixes interpreted or compiled at its own import (its standard library is jitted then),
so TRITON_INTERPRET must be set before the process imports Triton: the suite's conftest sets
it first thing on machines without CUDA, and the programs run on CPU tensors (numpy) there."""
from __future__ import annotations

import importlib
import importlib.util


def interpreted() -> bool:
    """Triton runs kernels on CPU tensors through its interpreter (TRITON_INTERPRET=1)."""
    from kernels.env import flag
    return flag("TRITON_INTERPRET", False)


def available() -> bool:
    return importlib.util.find_spec("triton") is not None


def load(name: str):
    """The module kernels.<name> of jitted programs, checking that Triton was imported in the
    mode TRITON_INTERPRET now asks for."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if interpreted() != isinstance(tl.standard.zeros, InterpretedFunction):
        raise RuntimeError("TRITON_INTERPRET was changed after Triton was imported; Triton reads it at "
                           "import, so set it before the process starts")
    return importlib.import_module(f"kernels.{name}")
