"""Adapters as the scheduler sees them: a registered adapter's reference, and the slots that
hold adapters on every rank (which adapter is in which slot, least recently used first)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class LoraRef:
    """A registered adapter. `id` is unique per registration, so re-registering a name with
    other weights never reuses the old weights' slot or cached KV blocks."""
    name: str
    id: int
    path: str

    @property
    def cache_key(self) -> tuple:
        return ("lora", self.name, self.id)


class LoraSlots:
    """The scheduler's view of the adapter slots (engine loop thread only)."""

    def __init__(self, num_slots: int):
        self.free = list(range(num_slots))
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recent first
        self.loads = 0  # adapters read into a slot since start (metrics)

    def acquire(self, ref: LoraRef, in_use: set[int]) -> tuple[int, bool] | None:
        """(slot, whether it must be loaded first), or None while every slot is in use."""
        if ref.id in self.resident:
            self.resident.move_to_end(ref.id)
            return self.resident[ref.id], False
        if self.free:
            slot = self.free.pop(0)
        else:
            victim = next((i for i in self.resident if i not in in_use), None)
            if victim is None:
                return None
            slot = self.resident.pop(victim)
        self.resident[ref.id] = slot
        self.loads += 1
        return slot, True

    def resident_ids(self) -> list[int]:
        return list(self.resident)
