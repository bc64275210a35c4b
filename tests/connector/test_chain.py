"""The tier chain: locate answers with the fastest tier holding a key, a load from a slower
tier promotes the bytes into the faster ones, a store writes through to every tier lacking the
key, and a tier losing an entry only makes a load fall through. Checked in narrated scenarios
on a CPU + disk chain and against a dict under random operations: a load returns exactly the
bytes last stored under that key, or None, never another key's."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hybridkv.connector.offload import CPUTier, DiskTier, make_key
from hybridkv.connector.offload.chain import TierChain
from hybridkv.connector.offload.disk_tier import encode_header, file_name

FP = b"layout-chain"
K = [make_key(FP, g, bytes([h])) for g in range(2) for h in range(4)]
FILE_OVERHEAD = len(encode_header(FP, K[0], b""))  # every key of K has the same length


def chain_of(directory: Path, *, cpu_bytes: int = 1000, disk_entries: int = 8,
             entry_bytes: int = 10) -> TierChain:
    disk = DiskTier(directory, disk_entries * (FILE_OVERHEAD + entry_bytes), FP)
    return TierChain(("cpu", "disk"), (CPUTier(cpu_bytes), disk))


def test_locate_names_the_first_tier_holding_each_key(tmp_path: Path):
    chain = chain_of(tmp_path)
    cpu, disk = chain.tiers
    cpu.put([(K[0], b"a" * 10)])
    disk.put([(K[0], b"a" * 10), (K[1], b"b" * 10)])
    assert chain.locate([K[0], K[1], K[2]]) == [0, 1, -1]
    assert chain.locate([]) == []
    # A question: no tier counted a lookup, nothing was promoted.
    assert [t.stats.lookups for t in chain.tiers] == [0, 0]
    assert cpu.exists([K[1]]) == [False]


def test_a_load_from_the_second_tier_promotes_into_the_first(tmp_path: Path):
    chain = chain_of(tmp_path)
    cpu, disk = chain.tiers
    disk.put([(K[1], b"b" * 10)])
    assert chain.load(K[1]) == (b"b" * 10, 1)
    assert cpu.exists([K[1]]) == [True]
    assert chain.stats[0].promotions == 1 and chain.stats[1].promotions == 0
    # The next load is served by the CPU tier, and the disk is not asked.
    assert chain.load(K[1]) == (b"b" * 10, 0)
    assert (cpu.stats.hits, disk.stats.lookups) == (1, 1)
    assert chain.locate([K[1]]) == [0]


def test_a_load_may_start_below_the_first_tier(tmp_path: Path):
    # The scheduler's locate said "disk": the worker starts there, and still promotes.
    chain = chain_of(tmp_path)
    cpu, disk = chain.tiers
    disk.put([(K[2], b"c" * 10)])
    assert chain.load(K[2], first=1) == (b"c" * 10, 1)
    assert cpu.stats.lookups == 0 and cpu.exists([K[2]]) == [True]


def test_a_store_writes_through_to_the_tiers_missing_the_key(tmp_path: Path):
    chain = chain_of(tmp_path)
    cpu, disk = chain.tiers
    assert chain.store(K[0], b"a" * 10) == 2
    assert cpu.get([K[0]]) == disk.get([K[0]]) == [b"a" * 10]
    # Only the CPU tier lost it: `missing` says so and the store fills just that tier.
    cpu.delete([K[0]])
    assert chain.missing(K[0]) == [0]
    stored_before = disk.stats.bytes_stored
    assert chain.store(K[0], b"a" * 10, chain.missing(K[0])) == 1
    assert disk.stats.bytes_stored == stored_before
    assert chain.missing(K[0]) == []
    assert chain.locate([K[0]]) == [0]


def test_a_tier_losing_an_entry_makes_the_load_fall_through(tmp_path: Path):
    chain = chain_of(tmp_path)
    cpu, disk = chain.tiers
    chain.store(K[3], b"d" * 10)
    cpu.delete([K[3]])
    assert chain.load(K[3]) == (b"d" * 10, 1)  # from the disk, and promoted again
    assert cpu.exists([K[3]]) == [True]
    # locate said "cpu" but the CPU tier evicted it meanwhile: still served, by the disk.
    assert chain.locate([K[3]]) == [0]
    cpu.delete([K[3]])
    assert chain.load(K[3], first=0) == (b"d" * 10, 1)
    # Gone from both: a miss, never an error.
    cpu.delete([K[3]])
    disk.delete([K[3]])
    assert chain.load(K[3]) == (None, -1)
    assert chain.locate([K[3]]) == [-1]


def test_a_damaged_disk_file_falls_through_to_a_miss_never_other_bytes(tmp_path: Path):
    chain = chain_of(tmp_path)
    cpu, disk = chain.tiers
    chain.store(K[0], b"a" * 10)
    chain.store(K[1], b"b" * 10)
    cpu.delete([K[0], K[1]])
    # K[1]'s file copied over K[0]'s: the disk tier refuses it (it names another key).
    shutil.copyfile(tmp_path / file_name(K[1]), tmp_path / file_name(K[0]))
    assert chain.load(K[0]) == (None, -1)
    assert disk.stats.rejected == 1
    assert cpu.exists([K[0]]) == [False]  # nothing promoted
    assert chain.load(K[1]) == (b"b" * 10, 1)


def test_promotion_into_a_full_first_tier_evicts_its_least_recent(tmp_path: Path):
    chain = chain_of(tmp_path, cpu_bytes=20)
    cpu, disk = chain.tiers
    for key, value in zip(K[:3], (b"a", b"b", b"c"), strict=True):
        chain.store(key, value * 10)
    # The CPU tier holds 2 entries: K[0] was evicted by K[2]; the disk holds all three.
    assert chain.locate(K[:3]) == [1, 0, 0]
    assert chain.load(K[0]) == (b"a" * 10, 1)
    assert chain.locate(K[:3]) == [0, 1, 0]  # K[1] was the least recent
    assert cpu.stats.evictions == 2
    cpu.check_integrity()
    disk.check_integrity()


def test_a_chain_needs_one_name_per_tier():
    with pytest.raises(ValueError, match="one name per tier"):
        TierChain(("cpu",), ())
    with pytest.raises(ValueError, match="one name per tier"):
        TierChain(("cpu", "disk"), (CPUTier(10),))


def test_clear_drops_one_tier_only(tmp_path: Path):
    chain = chain_of(tmp_path)
    chain.store(K[0], b"a" * 10)
    chain.clear(0)
    assert chain.locate([K[0]]) == [1]
    assert chain.load(K[0]) == (b"a" * 10, 1)


class ChainMachine(RuleBasedStateMachine):
    """A CPU + disk chain with small budgets (both evict) against a dict of what was stored
    last. Tiers also lose entries on purpose and disk files get damaged."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="hkv-chain-"))
        # The CPU tier holds ~2 entries, the disk ~4: both evict under 8 keys.
        self.chain = chain_of(self.directory, cpu_bytes=2 * 12, disk_entries=4,
                              entry_bytes=12)
        self.model: dict[bytes, bytes] = {}

    def teardown(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    @rule(key=st.sampled_from(K), value=st.binary(min_size=1, max_size=12))
    def store(self, key: bytes, value: bytes) -> None:
        # The chain's `store` overwrites in every tier given (default: all): the worker
        # passes only the tiers missing the key, whose bytes for a key never change there.
        self.chain.store(key, bytearray(value))
        self.model[key] = value

    @rule(key=st.sampled_from(K), first=st.sampled_from([0, 1]))
    def load(self, key: bytes, first: int) -> None:
        value, tier = self.chain.load(key, first)
        if value is None:
            assert tier == -1
            return
        assert tier >= first
        assert key in self.model, "bytes for a key never stored"
        assert bytes(value) == self.model[key], "another key's (or stale) bytes"

    @rule(key=st.sampled_from(K), tier=st.sampled_from([0, 1]))
    def lose(self, key: bytes, tier: int) -> None:
        self.chain.tiers[tier].delete([key])

    @rule(key=st.sampled_from(K), other=st.sampled_from(K))
    def damage(self, key: bytes, other: bytes) -> None:
        path = self.directory / file_name(key)
        if not path.exists():
            return
        if other != key and (self.directory / file_name(other)).exists():
            shutil.copyfile(self.directory / file_name(other), path)
        else:
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))

    @invariant()
    def located_keys_were_stored(self) -> None:
        for key, tier in zip(K, self.chain.locate(K), strict=True):
            assert tier == -1 or key in self.model

    @invariant()
    def budgets_hold(self) -> None:
        for tier in self.chain.tiers:
            tier.check_integrity()  # type: ignore[attr-defined]


ChainMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30,
                                          deadline=None)
test_chain_against_a_dict = ChainMachine.TestCase
