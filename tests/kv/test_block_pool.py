"""Narrated scenarios on the pool: exact block ids, eviction order, large pages moving."""

import pytest

from hybridkv.kv.block_pool import BlockPool, BlockRemoved, BlockStored
from tests.kv.toy import full, sliding, toy_config


def take_ids(pool, group, n):
    assert pool.can_take([n if g == group else 0 for g in range(len(pool.groups))])
    return pool.take(group, n)


def test_blocks_come_from_pages_in_order_and_null_is_block_zero():
    pool = BlockPool(toy_config(full(), num_pages=5))
    assert [b.block_id for b in pool.null_blocks] == [0]
    blocks = take_ids(pool, 0, 3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in blocks)
    pool.check_integrity()


def test_freed_cached_blocks_are_evicted_oldest_first_and_stay_hitable_until_then():
    pool = BlockPool(toy_config(full(), num_pages=5), enable_events=True)
    a = take_ids(pool, 0, 2)  # blocks 1, 2
    for i, block in enumerate(a):
        pool.cache(block, b"h%d" % i)
    pool.free(0, reversed(a))  # tail first: block 2 is evicted before block 1
    assert pool.get_cached_block(b"h0", 0) is a[0]
    b = take_ids(pool, 0, 2)  # the two never-used pages 3, 4 come before any eviction
    assert [x.block_id for x in b] == [3, 4]
    c = take_ids(pool, 0, 1)
    assert [x.block_id for x in c] == [2]  # the tail of the freed prefix goes first
    assert pool.get_cached_block(b"h1", 0) is None
    assert pool.get_cached_block(b"h0", 0) is a[0]
    assert not pool.can_take([2])  # only block 1 is left
    events = pool.take_events()
    assert events[-1] == BlockRemoved(0, (b"h1",))
    assert isinstance(events[0], BlockStored) and events[0].block_ids == (1,)
    pool.check_integrity()


def test_touching_a_cached_block_takes_it_out_of_the_lru():
    pool = BlockPool(toy_config(full(), num_pages=3))
    [block] = take_ids(pool, 0, 1)
    pool.cache(block, b"x")
    pool.free(0, [block])
    pool.touch([block])
    assert block.ref_cnt == 1 and not pool.groups[0].lru
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.check_integrity()


def test_an_uncached_freed_block_returns_its_page_to_the_arena():
    pool = BlockPool(toy_config(full(), sliding(8), num_pages=4))
    [block] = take_ids(pool, 0, 1)
    pool.free(0, [block])
    assert pool.free_pages == [3, 2, 1]  # page 1 is back; the next taker gets it again
    [other] = take_ids(pool, 1, 1)
    assert other.block_id == 1 and other.page is block.page
    pool.check_integrity()


def test_a_large_page_moves_between_groups_by_evicting_cached_blocks():
    # 3 usable pages of 2 blocks. Group 0 fills them all, caches and frees them.
    pool = BlockPool(toy_config(full(), sliding(8), num_pages=4, blocks_per_page=2))
    blocks = take_ids(pool, 0, 6)
    assert [b.block_id for b in blocks] == [2, 3, 4, 5, 6, 7]
    for i, block in enumerate(blocks):
        pool.cache(block, b"f%d" % i)
    pool.free(0, reversed(blocks))
    assert pool.num_free_blocks(1) == 6
    # Group 1 needs 3 blocks: it takes the two oldest unused pages of group 0 (page 3, freed
    # first, whole: blocks 6, 7; then page 2: block 4), evicting their cached blocks; page
    # 1's blocks stay cached.
    got = take_ids(pool, 1, 3)
    assert [b.block_id for b in got] == [6, 7, 4]
    assert pool.get_cached_block(b"f0", 0) is blocks[0]
    assert pool.get_cached_block(b"f5", 0) is None
    assert pool.groups[1].num_empty == 1  # the rest of the second page waits in its page
    pool.check_integrity()


def test_partly_used_pages_fill_before_new_pages_open():
    pool = BlockPool(toy_config(full(), num_pages=4, blocks_per_page=3))
    first = take_ids(pool, 0, 2)
    assert [b.block_id for b in first] == [3, 4]
    second = take_ids(pool, 0, 2)
    assert [b.block_id for b in second] == [5, 6]  # slot 5 of page 1 first, then page 2
    pool.check_integrity()


def test_can_take_is_all_or_nothing_across_groups_and_has_no_side_effects():
    pool = BlockPool(toy_config(full(), sliding(8), num_pages=4))
    assert pool.can_take([2, 1])
    assert not pool.can_take([2, 2])
    assert pool.free_pages == [3, 2, 1]
    pool.check_integrity()


def test_reset_prefix_cache_refuses_while_blocks_are_held():
    pool = BlockPool(toy_config(full(), num_pages=3))
    [block] = take_ids(pool, 0, 1)
    pool.cache(block, b"x")
    assert not pool.reset_prefix_cache()
    pool.free(0, [block])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"x", 0) is None
    assert sorted(pool.free_pages) == [1, 2]
    pool.check_integrity()


@pytest.mark.parametrize("eviction, survivor", [("lru", "attention"), ("value", "checkpoint")])
def test_value_eviction_keeps_an_expensive_checkpoint_over_cheap_attention(eviction, survivor):
    from tests.kv.toy import mamba

    pool = BlockPool(toy_config(full(), mamba(), num_pages=5), eviction=eviction)
    # Two state checkpoints of 1,000-token prefixes and two attention blocks of 16 tokens,
    # all cached and unused: the arena is full.
    checkpoints = take_ids(pool, 1, 2)
    for i, block in enumerate(checkpoints):
        pool.cache(block, b"c%d" % i, value=1000)
    pool.free(1, checkpoints)
    attention = take_ids(pool, 0, 2)
    pool.cache_run(0, attention, 0, 2, [b"a0", b"a1"], 1, block_size=16)
    pool.free(0, attention)
    take_ids(pool, 1, 1)  # the state group needs one more block
    if survivor == "checkpoint":  # value: an attention page (16 tokens) goes instead
        assert pool.get_cached_block(b"c0", 1) and pool.get_cached_block(b"c1", 1)
        assert pool.get_cached_block(b"a0", 0) is None
    else:  # lru: the state group evicts its own oldest checkpoint first
        assert pool.get_cached_block(b"c0", 1) is None
        assert pool.get_cached_block(b"a0", 0) and pool.get_cached_block(b"a1", 0)
    pool.check_integrity()


def test_unknown_eviction_policy():
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        BlockPool(toy_config(full(), num_pages=3), eviction="mru")


def test_pages_reclaimed_together_are_handed_out_oldest_first():
    """LRU reclaims as many unused pages of another group as a take needs in one go; they
    come out in the order one-page-at-a-time reclaiming gives (least recently used first)."""
    pool = BlockPool(toy_config(full(), full(), num_pages=6), enable_events=True)
    a = take_ids(pool, 0, 5)  # pages 1-5
    for i, block in enumerate(a):
        pool.cache(block, b"h%d" % i)
    pool.free(0, [a[3], a[1], a[4], a[0], a[2]])  # LRU order: pages 4, 2, 5, 1, 3
    pool.take_events()
    taken = take_ids(pool, 1, 4)
    assert [b.block_id for b in taken] == [4, 2, 5, 1]
    assert [e.block_hashes for e in pool.take_events()] == [(b"h3",), (b"h1",), (b"h4",),
                                                           (b"h0",)]
    assert pool.get_cached_block(b"h2", 0) is a[2]
    pool.check_integrity()


def test_a_dropped_pool_leaves_no_reference_cycles():
    """Pages hold no reference to their blocks and the books none to the pool, so a dropped
    pool (pages handed out, moved between groups, cached) is freed by reference counting
    alone: nothing for the cyclic garbage collector to find."""
    import gc
    import threading

    gc.collect()
    # That collection may free engines earlier tests in this process dropped; their offload
    # threads then stop, and a thread ending inside the window below would leave garbage of
    # its own there (seen once in CI). Let them end first.
    for thread in threading.enumerate():
        if thread.name.startswith("hybridkv-") and thread is not threading.current_thread():
            thread.join(timeout=5)
    gc.collect()
    gc.disable()
    try:
        pool = BlockPool(toy_config(full(), full(), num_pages=6))
        a = take_ids(pool, 0, 5)
        for i, block in enumerate(a):
            pool.cache(block, b"h%d" % i)
        pool.free(0, reversed(a))
        take_ids(pool, 1, 3)
        pool.check_integrity()
        del pool, a, block
        assert gc.collect() == 0
    finally:
        gc.enable()
