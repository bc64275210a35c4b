"""Eviction policies: `can_take` says yes exactly when the takes that follow succeed.

Random pool states (takes, caches, frees, touches in any order, any policy, 1-3 groups with
1-3 blocks per large page) and random demands, with random hit blocks touched first.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.kv.block_pool import Block, BlockPool
from hybridkv.kv.eviction import (
    LRUEviction,
    ValueEviction,
    answer_from_counts,
    make_eviction_policy,
)
from hybridkv.kv.plan import KVCacheConfig, KVCacheGroup
from tests.kv.toy import full, toy_config

LARGE_PAGE = 6  # bytes; a group with k blocks per page has blocks of 6 / k bytes


def random_config(num_groups: int, blocks_per_page: list[int], num_pages: int) -> KVCacheConfig:
    spec = full()
    groups = tuple(KVCacheGroup(g, spec, (f"l{g}",), (LARGE_PAGE // k,), k)
                   for g, k in enumerate(blocks_per_page[:num_groups]))
    return KVCacheConfig(groups, LARGE_PAGE, num_pages)


def snapshot(pool: BlockPool) -> object:
    """Everything a take or a question could change."""
    pages = [(p.index, p.group_id, p.num_used, p.num_hashed, [b.block_id for b in p.empty],
              [(b.group_id, b.block_id, b.ref_cnt, b.block_hash, b.value)
               for b in pool.blocks_of(p)])
             for p in pool.pages if p is not None]
    groups = [(list(gs.lru), sorted(gs.cached), list(gs.unused_pages), list(gs.open_pages),
               gs.num_empty, gs.num_used, gs.num_pages) for gs in pool.groups]
    return list(pool.free_pages), pages, groups, len(pool.events)


def build_state(data: st.DataObject, pool: BlockPool) -> list[list[Block]]:
    """Drive the pool through random operations; returns the references held per group."""
    held: list[list[Block]] = [[] for _ in pool.groups]
    num_groups = len(pool.groups)
    for step in range(data.draw(st.integers(0, 40), label="ops")):
        op = data.draw(st.sampled_from(["take", "take", "cache", "free", "free", "touch"]))
        g = data.draw(st.integers(0, num_groups - 1))
        if op == "take":
            n = data.draw(st.integers(1, 5))
            if n <= pool.num_free_blocks(g):
                held[g].extend(pool.take(g, n))
        elif op == "cache":
            fresh = [b for b in held[g] if b.block_hash is None]
            if fresh:
                block = data.draw(st.sampled_from(fresh))
                pool.cache(block, b"h%d" % step, value=data.draw(st.integers(0, 100)))
        elif op == "free" and held[g]:
            k = data.draw(st.integers(1, len(held[g])))
            freed, held[g] = held[g][:k], held[g][k:]
            pool.free(g, reversed(freed))
        elif op == "touch":
            cached = [b for b in pool.groups[g].lru.values()]
            if cached:
                block = data.draw(st.sampled_from(cached))
                pool.touch([block])
                held[g].append(block)
    pool.check_integrity()
    return held


@given(data=st.data(), num_groups=st.integers(1, 3),
       blocks_per_page=st.lists(st.sampled_from([1, 2, 3]), min_size=3, max_size=3),
       num_pages=st.integers(2, 9), eviction=st.sampled_from(["lru", "value"]))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_can_take_is_true_exactly_when_take_succeeds(data, num_groups, blocks_per_page,
                                                     num_pages, eviction):
    pool = BlockPool(random_config(num_groups, blocks_per_page, num_pages),
                     enable_events=True, eviction=eviction)
    held = build_state(data, pool)
    needs = data.draw(st.lists(st.integers(0, 8), min_size=num_groups, max_size=num_groups))
    # Hit blocks: cached ones nobody holds (they leave the LRU) and held ones (shared).
    hit = [data.draw(st.lists(st.sampled_from(list(gs.lru.values()) + held[g]), unique=True,
                              max_size=3))
           if gs.lru or held[g] else [] for g, gs in enumerate(pool.groups)]
    before = snapshot(pool)
    fits = pool.can_take(needs, hit)
    # The trial alone, also where counts or free pages settle the answer.
    by_trial = pool.policy.fits_by_trial(pool, needs, hit)
    counted = answer_from_counts(pool, needs, hit)
    assert snapshot(pool) == before, "can_take changed the pool"
    for blocks in hit:
        pool.touch(blocks)
    took = True
    for g, n in enumerate(needs):
        state = snapshot(pool)
        try:
            pool.take(g, n)
        except RuntimeError:
            assert snapshot(pool) == state, "a failed take changed the pool"
            took = False
            break
    assert fits == by_trial == took
    assert counted in (None, took)
    pool.check_integrity()


def test_take_all_gives_back_what_earlier_groups_took_when_a_later_group_fails():
    pool = BlockPool(toy_config(full(), full(), num_pages=4))
    with pytest.raises(RuntimeError, match="no block left"):
        pool.take_all([2, 2])  # group 0 gets pages 1 and 2, group 1 finds one page
    assert pool.num_used_blocks(0) == pool.num_used_blocks(1) == 0
    assert sorted(pool.free_pages) == [1, 2, 3]
    pool.check_integrity()


def test_policies_by_name():
    config = toy_config(full(), num_pages=3)
    assert isinstance(make_eviction_policy("lru", config), LRUEviction)
    assert isinstance(make_eviction_policy("value", config), ValueEviction)
    assert BlockPool(config, eviction=ValueEviction(config)).eviction == "value"
    with pytest.raises(ValueError, match="accepted: value, lru"):
        make_eviction_policy("fifo", config)
