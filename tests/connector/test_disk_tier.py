"""Disk tier: checksummed files published atomically, LRU within a byte budget, a warm restart
from the directory; every damaged or misplaced file is a miss, removed and counted; faults
(directory gone, read-only, disk full) never raise, are counted, and warn once."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from hybridkv.connector.offload import DiskTier, make_key
from hybridkv.connector.offload.disk_tier import encode_header, file_name

FP = b"layout-1"
K = [make_key(FP, 0, bytes([h])) for h in range(8)]


def entry_bytes(key: bytes, payload_len: int, fp: bytes = FP) -> int:
    return len(encode_header(fp, key, b"")) + payload_len


def kv_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix == ".kv")


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# -- LRU and restart ----------------------------------------------------------------------------

def test_lru_within_the_budget_counts_whole_files(tmp_path: Path):
    tier = DiskTier(tmp_path, 3 * entry_bytes(K[0], 100), FP)
    assert tier.put([(K[0], b"a" * 100), (K[1], b"b" * 100), (K[2], b"c" * 100)]) == [True] * 3
    assert tier.get([K[0]]) == [b"a" * 100]  # K[1] is now the least recent
    assert tier.put([(K[3], b"d" * 100)]) == [True]
    assert tier.exists(K[:4]) == [True, False, True, True]
    assert len(kv_files(tmp_path)) == 3
    assert tier.used_bytes == 3 * entry_bytes(K[0], 100)
    assert tier.stats.evictions == 1
    tier.check_integrity()


def test_an_entry_larger_than_the_budget_is_refused(tmp_path: Path):
    tier = DiskTier(tmp_path, entry_bytes(K[0], 100), FP)
    tier.put([(K[0], b"a" * 100)])
    assert tier.put([(K[1], b"b" * 101)]) == [False]
    assert tier.get([K[0]]) == [b"a" * 100]
    assert (tier.stats.refused, tier.stats.evictions) == (1, 0)


def test_a_restart_reuses_the_directory_in_lru_order(tmp_path: Path):
    tier = DiskTier(tmp_path, 3 * entry_bytes(K[0], 10), FP)
    tier.put([(K[0], b"a" * 10), (K[1], b"b" * 10), (K[2], b"c" * 10)])
    # File times are coarse; set them so the order the restart must rebuild is unambiguous.
    for age, key in enumerate([K[1], K[0], K[2]]):
        os.utime(tmp_path / file_name(key), ns=(10**18 + age, 10**18 + age))
    again = DiskTier(tmp_path, 3 * entry_bytes(K[0], 10), FP)
    assert again.used_bytes == tier.used_bytes
    assert again.get([K[0], K[1], K[2]]) == [b"a" * 10, b"b" * 10, b"c" * 10]
    again.check_integrity()
    for age, key in enumerate([K[1], K[0], K[2]]):
        os.utime(tmp_path / file_name(key), ns=(10**18 + age, 10**18 + age))
    restarted = DiskTier(tmp_path, 3 * entry_bytes(K[0], 10), FP)
    restarted.put([(K[3], b"d" * 10)])  # K[1] was the oldest
    assert restarted.exists(K[:4]) == [True, False, True, True]


def test_a_restart_with_a_smaller_budget_trims_the_oldest(tmp_path: Path):
    DiskTier(tmp_path, 3 * entry_bytes(K[0], 10), FP).put(
        [(K[0], b"a" * 10), (K[1], b"b" * 10), (K[2], b"c" * 10)])
    for age, key in enumerate(K[:3]):
        os.utime(tmp_path / file_name(key), ns=(10**18 + age, 10**18 + age))
    small = DiskTier(tmp_path, 2 * entry_bytes(K[0], 10), FP)
    assert small.exists(K[:3]) == [False, True, True]
    assert len(kv_files(tmp_path)) == 2
    small.check_integrity()


def test_another_layouts_files_are_kept_but_counted_and_evicted_first(tmp_path: Path):
    other = [make_key(b"layout-2", 0, bytes([h])) for h in range(2)]
    size = entry_bytes(K[0], 10)
    DiskTier(tmp_path, 4 * size, b"layout-2").put([(k, b"o" * 10) for k in other])
    tier = DiskTier(tmp_path, 4 * size, FP)
    assert tier.used_bytes == 2 * size and len(tier) == 0
    assert tier.get(other) == [None, None]  # never served, and not removed for asking
    assert tier.stats.rejected == 0
    tier.put([(K[0], b"a" * 10), (K[1], b"b" * 10)])
    tier.get([K[0]])
    tier.put([(K[2], b"c" * 10)])  # the other layout's oldest file goes, not K[1]
    assert tier.exists(K[:3]) == [True, True, True]
    assert len(kv_files(tmp_path)) == 4
    back = DiskTier(tmp_path, 4 * size, b"layout-2")  # switching back finds what is left
    assert back.get(other).count(b"o" * 10) == 1


def test_leftover_temporary_files_are_removed_and_foreign_files_left_alone(tmp_path: Path):
    tmp = tmp_path / f".{file_name(K[0])}.123.tmp"
    tmp.write_bytes(b"half a block")
    notes = tmp_path / "README"
    notes.write_text("mine")
    tier = DiskTier(tmp_path, 1000, FP)
    assert not tmp.exists() and notes.read_text() == "mine"
    assert tier.used_bytes == 0


# -- damaged files ------------------------------------------------------------------------------

def _two_entries(tmp_path: Path) -> DiskTier:
    tier = DiskTier(tmp_path, 10_000, FP)
    tier.put([(K[0], b"a" * 100), (K[1], b"b" * 200)])
    return tier


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [
    pytest.param(_truncate, id="truncated"),
    pytest.param(lambda p: p.write_bytes(p.read_bytes()[:10]), id="cut-in-header"),
    pytest.param(lambda p: _flip(p, 0), id="magic"),
    pytest.param(lambda p: _flip(p, 10), id="fingerprint-length"),
    pytest.param(lambda p: _flip(p, 24), id="checksum"),
    pytest.param(lambda p: _flip(p, 40), id="fingerprint-or-key"),
    pytest.param(lambda p: _flip(p, -1), id="payload"),
    pytest.param(lambda p: p.write_bytes(encode_header(b"layout-2", K[0], b"a" * 100)
                                         + b"a" * 100), id="other-layout"),
    pytest.param(lambda p: p.write_bytes(p.read_bytes() + b"x"), id="trailing-bytes"),
])
def test_a_damaged_file_is_a_miss_removed_and_counted(tmp_path: Path, damage):
    tier = _two_entries(tmp_path)
    path = tmp_path / file_name(K[0])
    damage(path)
    assert tier.get([K[0], K[1]]) == [None, b"b" * 200]
    assert not path.exists()
    assert (tier.stats.rejected, tier.stats.errors, tier.stats.hits) == (1, 0, 1)
    assert tier.exists([K[0]]) == [False]
    tier.check_integrity()
    assert tier.used_bytes == entry_bytes(K[1], 200)


def test_swapped_files_are_both_misses(tmp_path: Path):
    tier = _two_entries(tmp_path)
    a, b = tmp_path / file_name(K[0]), tmp_path / file_name(K[1])
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    assert tier.get([K[0], K[1]]) == [None, None]
    assert tier.stats.rejected == 2 and kv_files(tmp_path) == []


def test_a_restart_drops_files_whose_header_is_damaged_or_misplaced(tmp_path: Path):
    tier = DiskTier(tmp_path, 10_000, FP)
    tier.put([(K[i], bytes([i]) * 50) for i in range(4)])
    _truncate(tmp_path / file_name(K[0]))
    data_1 = (tmp_path / file_name(K[1])).read_bytes()
    (tmp_path / file_name(K[1])).write_bytes((tmp_path / file_name(K[2])).read_bytes())
    (tmp_path / file_name(K[2])).write_bytes(data_1)
    _flip(tmp_path / file_name(K[3]), -1)  # a payload flip: only a read can see it
    again = DiskTier(tmp_path, 10_000, FP)
    assert again.stats.rejected == 3
    assert again.exists(K[:4]) == [False, False, False, True]
    assert again.get([K[3]]) == [None]
    assert again.stats.rejected == 4 and kv_files(tmp_path) == []


# -- faults -------------------------------------------------------------------------------------

def test_directory_deleted_mid_run(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    directory = tmp_path / "kv"
    tier = DiskTier(directory, 10_000, FP)
    tier.put([(K[0], b"a" * 10), (K[1], b"b" * 10)])
    for p in directory.iterdir():
        p.unlink()
    directory.rmdir()
    with caplog.at_level(logging.WARNING):
        assert tier.get([K[0], K[1]]) == [None, None]
        assert tier.put([(K[2], b"c" * 10), (K[3], b"d" * 10)]) == [False, False]
        tier.delete([K[2]])
    assert tier.stats.errors == 4
    assert tier.used_bytes == 0 and tier.exists(K[:2]) == [False, False]
    [warning] = warnings_of(caplog)
    assert "directory missing" in warning and "\n" not in warning


def test_directory_replaced_by_a_file(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    directory = tmp_path / "kv"
    tier = DiskTier(directory, 10_000, FP)
    tier.put([(K[0], b"a" * 10)])
    (directory / file_name(K[0])).unlink()
    directory.rmdir()
    directory.write_bytes(b"not a directory")
    with caplog.at_level(logging.WARNING):
        assert tier.get([K[0]]) == [None]
        assert tier.put([(K[1], b"b" * 10)] * 3) == [False] * 3
    assert tier.stats.errors == 4
    assert len(warnings_of(caplog)) == 1


def test_read_only_directory(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                             monkeypatch: pytest.MonkeyPatch):
    tier = DiskTier(tmp_path, 2 * entry_bytes(K[0], 10), FP)
    tier.put([(K[0], b"a" * 10), (K[1], b"b" * 10)])
    if os.geteuid() == 0:
        # chmod does not stop root: fail the calls a read-only mount fails.
        def read_only(*args: object, **kwargs: object) -> None:
            raise OSError(errno.EROFS, "Read-only file system")
        monkeypatch.setattr(os, "replace", read_only)
        monkeypatch.setattr(os, "remove", read_only)
    else:
        tmp_path.chmod(0o555)
    try:
        with caplog.at_level(logging.WARNING):
            # Full, and the eviction it needs fails: refused, nothing lost.
            assert tier.put([(K[2], b"c" * 10)] * 2) == [False, False]
            assert tier.get([K[0], K[1]]) == [b"a" * 10, b"b" * 10]
            tier.delete([K[0]])  # its file stays: never served again, still counted
            assert tier.get([K[0]]) == [None] and tier.exists([K[0]]) == [False]
    finally:
        tmp_path.chmod(0o755)
        monkeypatch.undo()
    assert tier.stats.errors == 3
    [warning] = warnings_of(caplog)
    assert "not writable" in warning
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []
    tier.check_integrity()
    assert tier.put([(K[2], b"c" * 10)]) == [True]  # writable again: the dead file goes first
    assert tier.exists(K[:3]) == [False, True, True]
    assert sorted(kv_files(tmp_path)) == sorted(tmp_path / file_name(k) for k in K[1:3])


def test_disk_full(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                   monkeypatch: pytest.MonkeyPatch):
    tier = DiskTier(tmp_path, 10_000, FP)
    tier.put([(K[0], b"a" * 10)])

    class FullFile:
        def __init__(self, path: str, mode: str) -> None:
            self._f = open(path, mode)  # noqa: SIM115 - closed in __exit__

        def __enter__(self) -> FullFile:
            return self

        def __exit__(self, *exc: object) -> None:
            self._f.close()

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def read(self, n: int = -1) -> bytes:
            return self._f.read(n)

        def readinto(self, buf: bytearray) -> int:
            return self._f.readinto(buf)

        def fileno(self) -> int:
            return self._f.fileno()

    import hybridkv.connector.offload.disk_tier as disk_tier
    monkeypatch.setattr(disk_tier, "open", FullFile, raising=False)
    with caplog.at_level(logging.WARNING):
        assert tier.put([(K[1], b"b" * 10), (K[0], b"z" * 10)]) == [False, False]
        assert tier.get([K[0], K[1]]) == [b"a" * 10, None]  # the old K[0] file is untouched
    assert tier.stats.errors == 2
    [warning] = warnings_of(caplog)
    assert "disk full" in warning
    assert sorted(p.name for p in tmp_path.iterdir()) == [file_name(K[0])]  # no .tmp left
    tier.check_integrity()


# -- configuration ------------------------------------------------------------------------------

def _one_line_error(*args: object, **kwargs: object) -> str:
    with pytest.raises(ValueError) as e:
        DiskTier(*args, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_configuration_is_one_line(tmp_path: Path):
    assert "smaller than one block" in _one_line_error(tmp_path, 4096, FP,
                                                        min_entry_bytes=1 << 20)
    assert "smaller than one block" in _one_line_error(tmp_path, 10, FP)
    plain = tmp_path / "file"
    plain.write_text("x")
    assert "not a directory" in _one_line_error(plain, 1 << 20, FP)
    assert "not writable" in _one_line_error(plain / "sub", 1 << 20, FP)


@pytest.mark.skipif(os.geteuid() == 0, reason="chmod does not stop root")
def test_an_unwritable_directory_is_one_line(tmp_path: Path):
    tmp_path.chmod(0o555)
    try:
        assert "not writable" in _one_line_error(tmp_path, 1 << 20, FP)
    finally:
        tmp_path.chmod(0o755)


def test_a_missing_directory_is_created(tmp_path: Path):
    tier = DiskTier(tmp_path / "a" / "b", 1 << 20, FP)
    assert tier.put([(K[0], b"x")]) == [True]
