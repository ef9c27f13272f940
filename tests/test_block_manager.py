"""KV block pool: reference counts, prefix hits, LRU eviction of freed cached blocks."""
from actors.core.block_manager import BlockManager
from actors.core.sequence import Sequence
from actors.sampling_params import SamplingParams


def seq(tokens, rid="r"):
    return Sequence(rid, 0, list(tokens), len(tokens), SamplingParams())


def run(bm, s):
    """Allocate all of s, 'compute' it, register its full blocks."""
    hits = bm.cached_prefix(s)
    assert bm.can_allocate(s, s.num_tokens, hits)
    bm.allocate(s, s.num_tokens, hits)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)
    return hits


def test_shared_prefix_is_reused_with_reference_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(range(10), "a"), seq(list(range(8)) + [99, 98, 97], "b")
    run(bm, a)
    hits = run(bm, b)
    assert hits == a.block_table[:2]
    assert all(bm.blocks[i].ref_count == 2 for i in hits)
    bm.free_sequence(a)
    bm.free_sequence(b)
    assert bm.num_free_blocks == 8


def test_never_hits_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    run(bm, seq(range(8)))
    again = seq(range(8))
    assert len(bm.cached_prefix(again)) == 1  # the second block holds the last token


def test_freed_cached_blocks_are_evicted_least_recent_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    run(bm, a)
    bm.free_sequence(a)
    assert len(bm.cached) == 2
    b = seq([9, 9, 8, 8, 7])  # needs 3 blocks: the unhashed one first, then the oldest cached
    run(bm, b)
    assert len(bm.cached_prefix(seq([1, 2, 3, 4, 6]))) == 1  # the prefix's head survived
    bm.free_sequence(b)
    assert bm.num_free_blocks == 4


def test_prefix_caching_off_caches_nothing():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    run(bm, seq(range(12)))
    assert bm.cached == {} and bm.cached_prefix(seq(range(12))) == []


def test_blocks_are_shared_only_between_equal_cache_keys():
    bm = BlockManager(num_blocks=16, block_size=4)
    salted = Sequence("a", 0, list(range(10)), 10, SamplingParams(), cache_key=("salt", "x"))
    run(bm, salted)
    same = Sequence("b", 0, list(range(10)), 10, SamplingParams(), cache_key=("salt", "x"))
    other = Sequence("c", 0, list(range(10)), 10, SamplingParams(), cache_key=("salt", "y"))
    assert bm.cached_prefix(same) == salted.block_table[:2]
    assert bm.cached_prefix(other) == [] and bm.cached_prefix(seq(range(10))) == []
    run(bm, seq(range(10), "unkeyed"))
    assert len(bm.cached_prefix(seq(range(10), "again"))) == 2  # no key shares with no key


def test_blocks_before_every_layers_window_are_given_back_and_stay_cached():
    """Window 6, blocks of 4: after 13 computed tokens the next one (position 13) sees 8..13,
    so blocks 0 and 1 (positions 0..7) go back to the pool, hashed; the ids stay in the table."""
    bm = BlockManager(num_blocks=8, block_size=4, sliding_window=6)
    a = seq(range(13), "a")
    run(bm, a)
    table = list(a.block_table)
    assert bm.release_outside_window(a) == 2 and a.block_table == table and a.num_released_blocks == 2
    assert bm.num_free_blocks == 8 - 2 and bm.release_outside_window(a) == 0  # once
    assert bm.cached_prefix(seq(range(13), "b")) == table[:3]  # still prefix-cache hits
    bm.free_sequence(a)  # only the blocks it still holds
    assert bm.num_free_blocks == 8 and all(b.ref_count == 0 for b in bm.blocks)
    assert BlockManager(num_blocks=8, block_size=4).release_outside_window(seq(range(13))) == 0
