"""Which LoRA adapters the engine knows (the registry) and which sit in its slots (the LRU).

Registered adapters are names with a path, checked once when registered; any number may be
registered. `--max-loras` slots hold adapter weights on every rank (allocated at start-up).
The scheduler takes a slot for a sequence's adapter when it admits the sequence: a resident
adapter keeps its slot; otherwise a free slot, else the least recently admitted adapter that
no running sequence uses gives its slot up, and the step carries "load adapter X into slot
k" to every rank (SchedulerOutput.lora_loads). With every slot in use by running sequences
the sequence waits, as it would for KV blocks.
"""
from __future__ import annotations

import itertools
import threading
from pathlib import Path

from actors.core.lora_slots import LoraRef
from actors.errors import UnknownAdapterError
from actors.models.lora_adapter import check_adapter


class LoraRegistry:
    """name -> LoraRef. Written by callers' threads (load/unload), read by the engine loop."""

    def __init__(self, base_shapes: dict[str, tuple], max_rank: int, moe: bool):
        self.base_shapes, self.max_rank, self.moe = base_shapes, max_rank, moe
        self._refs: dict[str, LoraRef] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def add(self, name: str, path: str) -> LoraRef:
        """Check the adapter, then register it; ValueError (one line) if it can't be served."""
        if not name:
            raise ValueError("an adapter needs a name")
        path = str(Path(path).expanduser().resolve())
        check_adapter(path, self.base_shapes, self.max_rank, self.moe)
        with self._lock:
            if name in self._refs:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            ref = self._refs[name] = LoraRef(name, next(self._ids), path)
        return ref

    def remove(self, name: str) -> LoraRef:
        """Unregister: new requests for it are refused; those in flight finish on it."""
        with self._lock:
            if name not in self._refs:
                raise UnknownAdapterError(f"The lora adapter '{name}' cannot be found.")
            return self._refs.pop(name)

    def get(self, name: str) -> LoraRef:
        ref = self._refs.get(name)
        if ref is None:
            raise UnknownAdapterError(f"The model `{name}` does not exist.")
        return ref

    def list(self) -> list[LoraRef]:
        with self._lock:
            return sorted(self._refs.values(), key=lambda r: r.name)
