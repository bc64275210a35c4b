"""The disk tier against a dict under random puts, gets, deletes, restarts and damage to its
files (truncation, flipped bytes, two files' contents swapped). Whatever happens, a get returns
exactly the bytes last put under that key, or None; a damaged file is never served; the budget
holds; the counters add up."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv.connector.offload import DiskTier, make_key
from hybridkv.connector.offload.disk_tier import encode_header, file_name

FP = b"layout-1"
KEYS = [make_key(FP, g, bytes([h])) for g in range(2) for h in range(4)]
OVERHEAD = len(encode_header(FP, KEYS[0], b""))  # every key has the same length here
CAPACITY = 4 * (OVERHEAD + 100)
values = st.binary(max_size=150) | st.binary(min_size=CAPACITY - OVERHEAD - 3,
                                             max_size=CAPACITY - OVERHEAD + 3)


class DiskTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="hkv-disk-"))
        self.model: dict[bytes, bytes] = {}  # key -> bytes last put, while it may be served
        self.damaged: set[bytes] = set()  # keys whose file we broke: never served again
        self.swapped = False  # since the last restart; see `within_budget`
        self.num_damaged_files = 0
        self.rejected_before = 0  # by earlier instances on this directory
        self._start()

    def _start(self) -> None:
        if hasattr(self, "tier"):
            self.rejected_before += self.tier.stats.rejected
        self.tier = DiskTier(self.directory, CAPACITY, FP)
        self.lookups = self.hits = self.loaded = self.stored = self.refused = 0
        self.swapped = False

    def teardown(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def _path(self, key: bytes) -> Path:
        return self.directory / file_name(key)

    def _on_disk(self) -> list[bytes]:
        """Keys whose file is whole, so damaging it surely breaks it (swapping two broken files
        back, say, would mend them)."""
        return [k for k in KEYS if k not in self.damaged and self._path(k).exists()]

    # -- operations --------------------------------------------------------------------------

    @rule(items=st.lists(st.tuples(st.sampled_from(KEYS), values), max_size=3))
    def put(self, items):
        for (key, value), ok in zip(items, self.tier.put(items), strict=True):
            assert ok == (OVERHEAD + len(value) <= CAPACITY)  # no faults in this test
            if ok:
                self.model[key] = value
                self.damaged.discard(key)
                self.stored += len(value)
            else:
                self.refused += 1

    @rule(key=st.sampled_from(KEYS), value=st.binary(max_size=150))
    def put_then_get(self, key, value):
        self.put([(key, value)])
        self.get([key])
        assert self.tier.exists([key]) == [True]

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def get(self, keys):
        for key, value in zip(keys, self.tier.get(keys), strict=True):
            self.lookups += 1
            if key in self.damaged:
                assert value is None
                self.model.pop(key, None)
                self.damaged.discard(key)
            assert value is None or value == self.model.get(key)
            if value is not None:
                self.hits += 1
                self.loaded += len(value)
            # else: evicted, or just rejected; either way it stays a miss until put again.
            elif key in self.model:
                del self.model[key]

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def delete(self, keys):
        self.tier.delete(keys)
        for key in keys:
            self.model.pop(key, None)
            self.damaged.discard(key)
        assert self.tier.exists(keys) == [False] * len(keys)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def exists(self, keys):
        for key, there in zip(keys, self.tier.exists(keys), strict=True):
            if key not in self.model and key not in self.damaged:
                assert not there

    @rule()
    def restart(self):
        self._start()

    # -- damage ------------------------------------------------------------------------------

    def _damaged(self, key: bytes) -> None:
        self.damaged.add(key)
        self.model.pop(key, None)
        self.num_damaged_files += 1

    @precondition(lambda self: self._on_disk())
    @rule(data=st.data())
    def truncate(self, data):
        key = data.draw(st.sampled_from(self._on_disk()))
        raw = self._path(key).read_bytes()
        self._path(key).write_bytes(raw[:data.draw(st.integers(0, len(raw) - 1))])
        self._damaged(key)

    @precondition(lambda self: self._on_disk())
    @rule(data=st.data())
    def flip(self, data):
        key = data.draw(st.sampled_from(self._on_disk()))
        raw = bytearray(self._path(key).read_bytes())
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] ^= data.draw(st.integers(1, 255))
        self._path(key).write_bytes(bytes(raw))
        self._damaged(key)

    @precondition(lambda self: len(self._on_disk()) >= 2)
    @rule(data=st.data())
    def swap(self, data):
        a, b = data.draw(st.lists(st.sampled_from(self._on_disk()), min_size=2, max_size=2,
                                  unique=True))
        raw_a, raw_b = self._path(a).read_bytes(), self._path(b).read_bytes()
        self._path(a).write_bytes(raw_b)
        self._path(b).write_bytes(raw_a)
        self._damaged(a)
        self._damaged(b)
        self.swapped = True

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def within_budget(self):
        self.tier.check_integrity()
        on_disk = sum(p.stat().st_size for p in self.directory.glob("*.kv"))
        # The index counts each file at the size the tier wrote. Damage only shrinks files,
        # except a swap of two files of different sizes: until the tier reads them (or a
        # restart rescans), the directory may hold up to one entry more than the index says.
        slack = CAPACITY - OVERHEAD if self.swapped else 0
        assert on_disk <= self.tier.used_bytes + slack
        assert self.tier.used_bytes <= CAPACITY

    @invariant()
    def counters_add_up(self):
        s = self.tier.stats
        assert (s.lookups, s.hits, s.bytes_loaded) == (self.lookups, self.hits, self.loaded)
        assert (s.bytes_stored, s.refused, s.errors) == (self.stored, self.refused, 0)
        # Each damaged file is rejected at most once (a get or a restart's scan finds it).
        assert self.rejected_before + s.rejected <= self.num_damaged_files


TestDiskTierMachine = DiskTierMachine.TestCase
TestDiskTierMachine.settings = settings(max_examples=75, stateful_step_count=30, deadline=None)
