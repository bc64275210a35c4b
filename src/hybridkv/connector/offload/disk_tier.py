"""Disk tier: one file per key in one directory, LRU within a byte budget, warm on restart.

    DIR/<xxh3-128 hex of key>.kv = one entry (entry.py): header | layout fp | key | payload

A put writes `.<name>.<pid>.tmp` and `os.replace`s it over the final name, so a reader (or a
restart after a crash) sees a whole file or none. No fsync: after a power loss a published file
may hold garbage, which the checksum turns into a miss - this is a cache, not a database.

Every read checks the whole header and the checksum; a file that fails (truncated, flipped
bytes, another key's file copied over it) is a miss, removed and counted in `stats.rejected`.

The index (name -> file size, least recently used first) lives in memory; it is the truth for
presence, so a miss costs no syscall. At start-up it is rebuilt by reading every file's header,
ordered by mtime (a hit touches the file's mtime so recency survives a restart). Only one
process may own a directory at a time.

Files of another layout fingerprint (another model, dtype or block size) are *kept* and
counted in the budget but never served, and are first in line for eviction: the budget bounds
the directory, while switching back to the other model soon still finds its blocks.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from hybridkv.connector.offload.entry import (
    HEADER,
    decode_header,
    encode_header,
    open_entry,
    unpack_fixed,
)
from hybridkv.connector.offload.store import FaultLog, Payload, StoreStats
from hybridkv.kv.plan import format_bytes

logger = logging.getLogger(__name__)

_NAME = re.compile(r"[0-9a-f]{32}\.kv")
_TMP = re.compile(r"\.[0-9a-f]{32}\.kv\.\d+\.tmp")

# errno -> the kind of fault we warn about once; anything else is a plain I/O error.
_FAULT_KINDS = {
    errno.ENOSPC: "disk full", errno.EDQUOT: "disk full",
    errno.EROFS: "directory not writable", errno.EACCES: "directory not writable",
    errno.EPERM: "directory not writable",
    errno.ENOENT: "directory missing", errno.ENOTDIR: "directory missing",
}


def file_name(key: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(key) + ".kv"


@dataclass(slots=True)
class _Entry:
    size: int  # file bytes, what the budget counts
    live: bool  # False: another layout's file, or a rejected file we could not remove
    key: bytes = b""  # the store key (KV events name the block it holds)


class DiskTier:
    # exists() reads the in-memory index alone (one dict lookup a key, atomic under the
    # GIL): the chain asks it without its lock, beside a put in progress.
    exists_thread_safe = True

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int,
                 layout_fingerprint: bytes, *, min_entry_bytes: int = 1) -> None:
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.layout_fingerprint = layout_fingerprint
        self.stats = StoreStats()
        self._faults = FaultLog(self.stats, logger, f"kv offload disk tier {self.directory}")
        self._index: OrderedDict[str, _Entry] = OrderedDict()
        self._used = 0
        self.on_removed: Callable[[bytes], None] | None = None  # KV events (store.py)
        # The smallest file one block makes (a key adds a few dozen bytes more).
        smallest = HEADER.size + len(layout_fingerprint) + max(min_entry_bytes, 1)
        if capacity_bytes < smallest:
            raise ValueError(f"disk offload budget of {format_bytes(capacity_bytes)} is smaller "
                             f"than one block's file ({format_bytes(smallest)})")
        self._check_directory()
        self._scan()

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return sum(e.live for e in self._index.values())

    # -- the store interface ------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        out = []
        for key in keys:
            entry = self._index.get(file_name(key))
            out.append(entry is not None and entry.live)
        return out

    def get(self, keys: Sequence[bytes]) -> list[Payload | None]:
        out: list[Payload | None] = []
        for key in keys:
            self.stats.lookups += 1
            value = self._load(key)
            if value is not None:
                self.stats.hits += 1
                self.stats.bytes_loaded += len(value)
            out.append(value)
        return out

    def put(self, items: Sequence[tuple[bytes, Payload]]) -> list[bool]:
        return [self._store(key, value) for key, value in items]

    def delete(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            name = file_name(key)
            if name in self._index:
                self._drop(name)

    def live_keys(self) -> list[bytes]:
        """The keys of every entry that can be served, least recently used first."""
        return [e.key for e in self._index.values() if e.live]

    def check_integrity(self) -> None:
        assert self._used == sum(e.size for e in self._index.values()), "used bytes drifted"
        assert self._used <= self.capacity_bytes, "over budget"

    # -- reads ----------------------------------------------------------------------------------

    def _load(self, key: bytes) -> Payload | None:
        name = file_name(key)
        entry = self._index.get(name)
        if entry is None or not entry.live:
            return None
        path = self.directory / name
        try:
            with open(path, "rb") as f:
                # Read into a writable buffer: the payload is handed out as a view of it,
                # without a second copy (and a connector can wrap it as a tensor).
                data = bytearray(os.fstat(f.fileno()).st_size)
                del data[f.readinto(data):]  # shorter if the file shrank meanwhile
        except OSError as e:
            self._fault(e)
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                self._forget(name)  # gone from disk: it no longer counts in the budget
            return None
        payload = self._verify(data, key)
        if payload is None:
            self.stats.rejected += 1
            self._drop(name)
            return None
        self._index.move_to_end(name)
        with contextlib.suppress(OSError):
            os.utime(path)  # recency for the next start-up's scan; best effort
        return payload

    def _verify(self, data: bytearray, key: bytes) -> Payload | None:
        return open_entry(data, key, self.layout_fingerprint)

    # -- writes ---------------------------------------------------------------------------------

    def _store(self, key: bytes, value: Payload) -> bool:
        name = file_name(key)
        header = encode_header(self.layout_fingerprint, key, value)
        size = len(header) + len(value)
        if size > self.capacity_bytes:
            self.stats.refused += 1
            return False
        old = self._index.get(name)
        grow = size - (old.size if old is not None else 0)
        if not self._make_room(grow, keep=name):
            return False
        tmp = self.directory / f".{name}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(value)
            os.replace(tmp, self.directory / name)
        except OSError as e:
            # A vanished directory is not recreated: whoever removed it (or unmounted the disk
            # under it) would not want the blocks to fill the parent filesystem instead.
            self._fault(e)
            self._unlink_quietly(tmp)
            return False  # the old file, if any, is untouched: os.replace did not happen
        self._index[name] = _Entry(size, live=True, key=key)
        self._index.move_to_end(name)
        self._used += grow
        self.stats.bytes_stored += len(value)
        return True

    def _make_room(self, grow: int, keep: str) -> bool:
        # Dead entries sit at the front of the index, so they go first.
        # E.g. used 90 of 100, grow 25 -> drop LRU entries until used <= 75.
        while self._used + grow > self.capacity_bytes:
            victim = next((name for name in self._index if name != keep), None)
            if victim is None or not self._remove(victim):
                return False  # cannot free space (read-only, ...): refuse the put
            self.stats.evictions += 1
        return True

    def _remove(self, name: str) -> bool:
        try:
            os.remove(self.directory / name)
        except FileNotFoundError:
            pass  # already gone; only the index remembered it
        except OSError as e:
            self._fault(e)
            return False
        self._forget(name)
        return True

    def _drop(self, name: str) -> None:
        """A deleted or rejected entry is never served again. If its file cannot be removed
        (read-only) it stays in the index as dead, still counted in the budget, first in line
        for eviction."""
        if not self._remove(name):
            entry = self._index[name]
            self._announce_removal(entry)
            entry.live = False
            self._index.move_to_end(name, last=False)

    def _forget(self, name: str) -> None:
        entry = self._index.pop(name, None)
        if entry is not None:
            self._used -= entry.size
            self._announce_removal(entry)

    def _announce_removal(self, entry: _Entry) -> None:
        if entry.live and self.on_removed is not None:
            self.on_removed(entry.key)

    def _fault(self, e: OSError) -> None:
        kind = _FAULT_KINDS.get(e.errno or 0, "I/O error")
        self._faults.record(kind, e)

    @staticmethod
    def _unlink_quietly(path: Path) -> None:
        with contextlib.suppress(OSError):
            os.remove(path)

    # -- start-up -------------------------------------------------------------------------------

    def _check_directory(self) -> None:
        where = f"disk offload directory {str(self.directory)!r}"
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"{where} is not a directory")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".probe.{os.getpid()}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"{where} is not writable: {e.strerror or e}") from None

    def _scan(self) -> None:
        # (live, mtime_ns, name, size, key)
        found: list[tuple[bool, int, str, int, bytes]] = []
        try:
            dir_entries = list(os.scandir(self.directory))
        except OSError as e:
            self._fault(e)
            return
        for item in dir_entries:
            if not item.is_file(follow_symlinks=False):
                continue
            if _TMP.fullmatch(item.name):
                # A put cut short by a crash; a whole file was never published under it.
                self._unlink_quietly(Path(item.path))
            elif _NAME.fullmatch(item.name):
                scanned = self._scan_file(item)
                if scanned is not None:
                    found.append(scanned)
            # Any other file is not ours: left alone and not counted.
        # Dead (other layout) first, then ours; each oldest first.
        for live, _, name, size, key in sorted(found):
            self._index[name] = _Entry(size, live, key)
            self._used += size
        # A smaller budget than last run's: trim now rather than over budget until a put.
        if self._used > self.capacity_bytes and self._index:
            keep = next(reversed(self._index))
            self._make_room(0, keep=keep)
            if self._used > self.capacity_bytes:
                self._remove(keep)

    def _scan_file(self, item: os.DirEntry[str]) -> tuple[bool, int, str, int, bytes] | None:
        try:
            st = item.stat(follow_symlinks=False)
            with open(item.path, "rb") as f:
                head = f.read(HEADER.size)
                fixed = unpack_fixed(head)
                if fixed is not None:
                    head += f.read(fixed[0] + fixed[1])  # the fingerprint and the key
                header = decode_header(head)
        except OSError as e:
            self._fault(e)
            return None
        # Only the header is checked here (reading 50 GiB at start-up would be slow); the
        # checksum is checked on each get.
        if (header is None or file_name(header.key) != item.name
                or header.entry_bytes != st.st_size):
            self.stats.rejected += 1
            self._unlink_quietly(Path(item.path))
            return None
        live = header.layout_fingerprint == self.layout_fingerprint
        return live, st.st_mtime_ns, item.name, st.st_size, header.key
