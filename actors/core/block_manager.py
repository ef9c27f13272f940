"""KV block pool: allocation, reference counts and the prefix cache.

A full block's hash chains its parent's hash and its own tokens, so equal hashes mean equal
prefixes. The first block's parent is the sequence's `cache_key` (empty: None), so sequences
with different keys never share blocks. Freed blocks keep their hash and sit in an LRU free
queue: a later request with the same prefix takes them back; allocation evicts from the least
recently freed end.

With a sliding window on every layer (Mistral, Phi-3-mini), the leading blocks of a sequence
that no later token can see are given back as it grows: a long generation holds about a
window's worth of blocks, not its whole context.
"""
from __future__ import annotations

from collections import OrderedDict

from actors.core.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


def block_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


def root_hash(seq: Sequence) -> int | None:
    """The parent of a sequence's first block: its cache key (salt, adapter), mixed into the whole chain."""
    return hash(("cache_key", seq.cache_key)) if seq.cache_key else None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # the widest layer's window, when every layer has one
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def outgrows_pool(self, seq: Sequence) -> bool:
        """Its tokens need more blocks at once than the whole pool has. Under a sliding window on
        every layer a sequence holds a window's worth: its blocks, a partial one at each end."""
        held = self.blocks_needed(seq.num_tokens) - seq.num_released_blocks
        if self.sliding_window is not None:
            held = min(held, self.blocks_needed(self.sliding_window) + 2)
        return held > self.num_blocks

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of seq (full blocks, never its last token)."""
        if not self.enable_prefix_caching or seq.needs_every_prompt_token:
            return []
        hits, parent = [], root_hash(seq)
        for start in range(0, seq.num_tokens - 1 - self.block_size + 1, self.block_size):
            tokens = tuple(seq.token_ids[start:start + self.block_size])
            h = block_hash(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def can_allocate(self, seq: Sequence, num_tokens: int, hits: list[int]) -> bool:
        """Can seq grow to num_tokens, taking `hits` (its cached prefix) first?"""
        new = self.blocks_needed(num_tokens) - len(seq.block_table) - len(hits)
        reclaimed = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # hits sitting in the free queue
        return new <= self.num_free_blocks - reclaimed

    def allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> None:
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        if hits:
            seq.num_hashed_blocks = len(hits)
        while len(seq.block_table) < self.blocks_needed(num_tokens):
            seq.block_table.append(self._take_free())

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]  # evict the least recently freed cached block
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def free_sequence(self, seq: Sequence) -> None:
        # Free the tail first so the LRU queue evicts a prefix's last blocks before its first.
        for block_id in reversed(seq.block_table[seq.num_released_blocks:]):
            self._unref(block_id)
        seq.block_table = []
        seq.num_hashed_blocks = seq.num_released_blocks = 0

    def release_outside_window(self, seq: Sequence) -> int:
        """Give back the leading blocks wholly before the window of every token still to come
        (the next one, at position num_computed_tokens, sees keys after num_computed_tokens -
        window). Their ids stay in the block table, so the ranks' tables need no update: every
        backend masks those keys (a reused block's other contents are never weighted), and the
        blocks keep their hashes, prefix-cache hits for other requests. Returns how many."""
        if self.sliding_window is None:
            return 0
        dead = max(0, seq.num_computed_tokens - self.sliding_window + 1) // self.block_size
        released = seq.block_table[seq.num_released_blocks:dead]
        for block_id in released:
            self._unref(block_id)
        seq.num_released_blocks += len(released)
        return len(released)

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.hash is None:
                self.free.move_to_end(block_id, last=False)  # unhashed: reuse first

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full of computed tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        parent = self.blocks[seq.block_table[seq.num_hashed_blocks - 1]].hash if seq.num_hashed_blocks \
            else root_hash(seq)
        for i in range(seq.num_hashed_blocks, full):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = block_hash(parent, tokens)
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = h, tokens
            self.cached.setdefault(h, block.block_id)
            parent = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks
