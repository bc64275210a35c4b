"""CPU tier: exact LRU order within a byte budget, checked in narrated scenarios and against
an LRU model under random operations."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hybridkv.connector.offload import CPUTier, make_key

KEYS = [make_key(b"fp", g, bytes([h])) for g in range(2) for h in range(3)]


def test_get_refreshes_recency_and_puts_evict_the_least_recent():
    tier = CPUTier(30)
    a, b, c, d = KEYS[:4]
    assert tier.put([(a, b"a" * 10), (b, b"b" * 10), (c, b"c" * 10)]) == [True] * 3
    assert tier.get([a]) == [b"a" * 10]  # a is now the most recent; b the least
    assert tier.put([(d, b"d" * 10)]) == [True]
    assert tier.exists([a, b, c, d]) == [True, False, True, True]
    assert tier.stats.evictions == 1
    tier.check_integrity()


def test_exists_is_a_question():
    tier = CPUTier(20)
    a, b, c = KEYS[:3]
    tier.put([(a, b"a" * 10), (b, b"b" * 10)])
    assert tier.exists([a]) == [True]  # does not refresh a: a stays the least recent
    tier.put([(c, b"c" * 10)])
    assert tier.exists([a, b, c]) == [False, True, True]
    assert tier.stats.lookups == 0


def test_an_entry_larger_than_the_budget_is_refused_and_evicts_nothing():
    tier = CPUTier(20)
    a, b = KEYS[:2]
    tier.put([(a, b"a" * 10)])
    assert tier.put([(b, b"b" * 21)]) == [False]
    assert tier.exists([a, b]) == [True, False]
    assert (tier.stats.refused, tier.stats.evictions) == (1, 0)


def test_overwrite_replaces_bytes_and_size():
    tier = CPUTier(20)
    a = KEYS[0]
    tier.put([(a, b"x" * 15)])
    tier.put([(a, b"y" * 5)])
    assert tier.get([a]) == [b"y" * 5]
    assert tier.used_bytes == 5


def test_a_budget_below_one_block_is_one_line():
    with pytest.raises(ValueError, match="smaller than one block") as e:
        CPUTier(1000, min_entry_bytes=4096)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError):
        CPUTier(0)


CAPACITY = 100
values = st.binary(max_size=40) | st.binary(min_size=CAPACITY - 5, max_size=CAPACITY + 5)


class CPUTierMachine(RuleBasedStateMachine):
    """The tier against an exact LRU model: every answer must match it, byte for byte."""

    def __init__(self) -> None:
        super().__init__()
        self.tier = CPUTier(CAPACITY)
        self.model: OrderedDict[bytes, bytes] = OrderedDict()  # least recent first
        self.stored = self.loaded = self.lookups = self.hits = self.refused = 0

    @rule(items=st.lists(st.tuples(st.sampled_from(KEYS), values), max_size=4))
    def put(self, items):
        got = self.tier.put(items)
        for (key, value), ok in zip(items, got, strict=True):
            assert ok == (len(value) <= CAPACITY)
            if not ok:
                self.refused += 1
                continue
            self.model.pop(key, None)
            while sum(map(len, self.model.values())) + len(value) > CAPACITY:
                self.model.popitem(last=False)
            self.model[key] = value
            self.stored += len(value)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def get(self, keys):
        got = self.tier.get(keys)
        for key, value in zip(keys, got, strict=True):
            assert value == self.model.get(key)
            self.lookups += 1
            if value is not None:
                self.model.move_to_end(key)
                self.hits += 1
                self.loaded += len(value)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def delete(self, keys):
        self.tier.delete(keys)
        for key in keys:
            self.model.pop(key, None)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def exists(self, keys):
        assert self.tier.exists(keys) == [k in self.model for k in keys]

    @invariant()
    def counters_add_up(self):
        self.tier.check_integrity()
        s = self.tier.stats
        assert (s.lookups, s.hits, s.bytes_loaded) == (self.lookups, self.hits, self.loaded)
        assert (s.bytes_stored, s.refused, s.errors, s.rejected) == (
            self.stored, self.refused, 0, 0)
        assert self.tier.used_bytes == sum(map(len, self.model.values())) <= CAPACITY


TestCPUTierMachine = CPUTierMachine.TestCase
TestCPUTierMachine.settings = settings(max_examples=75, stateful_step_count=30, deadline=None)


def test_buffers_of_dropped_entries_are_reused_never_live_ones():
    """An evicted or overwritten entry's bytearray comes back from take_spare (already
    mapped memory for the next copy-out); writing into it never changes a live entry."""
    tier = CPUTier(3 * 8)
    values = {bytes([i]): bytearray([i]) * 8 for i in range(5)}
    for key, value in values.items():
        tier.put([(key, value)])
    assert tier.take_spare(7) is None  # no buffer of that size was dropped
    spares = [tier.take_spare(8) for _ in range(2)]
    assert spares[0] is not None and spares[1] is not None and tier.take_spare(8) is None
    assert {id(s) for s in spares} == {id(values[b"\x00"]), id(values[b"\x01"])}
    for spare in spares:
        spare[:] = b"\xff" * 8  # the caller fills it for another key
    assert tier.get([b"\x02", b"\x03", b"\x04"]) == [bytearray([i]) * 8 for i in (2, 3, 4)]
    tier.put([(b"\x02", bytearray(b"z" * 8))])  # an overwrite drops the old buffer too
    assert tier.take_spare(8) is values[b"\x02"]
    tier.put([(b"\x05", memoryview(bytearray(8)))])  # evicts the LRU entry, b"\x03"
    assert tier.take_spare(8) is values[b"\x03"]
    tier.put([(b"\x05", bytearray(8))])  # a view may be shared: its buffer is never reused
    assert tier.take_spare(8) is None
    tier.check_integrity()
