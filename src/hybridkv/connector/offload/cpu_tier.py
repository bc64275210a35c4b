"""CPU tier: an LRU of byte strings within a byte budget, in this process's memory.

    _entries (OrderedDict, least recently used first):
        k3 -> 2 MiB | k1 -> 2 MiB | k7 -> 2 MiB      used = 6 MiB <= capacity
    get(k3) moves k3 to the end; put(k9) drops k3 then k1 ... until k9 fits.

The budget counts payload bytes only: keys and dict overhead are small next to a block.

Buffers of dropped entries are kept for reuse (`take_spare`), a few per size: a connector
copying a block out into a fresh buffer pays a page fault per 4 KiB page the first time the
memory is touched (3-30x the copy itself); a recycled buffer is already mapped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from hybridkv.connector.offload.store import Payload, StoreStats
from hybridkv.kv.plan import format_bytes


class CPUTier:
    # exists() reads the in-memory index alone (one dict lookup a key, atomic under the
    # GIL): the chain asks it without its lock, beside a put in progress.
    exists_thread_safe = True

    def __init__(self, capacity_bytes: int, *, min_entry_bytes: int = 1) -> None:
        if capacity_bytes < max(min_entry_bytes, 1):
            raise ValueError(f"CPU offload budget of {format_bytes(capacity_bytes)} is smaller "
                             f"than one block ({format_bytes(min_entry_bytes)})")
        self.capacity_bytes = capacity_bytes
        self.stats = StoreStats()
        self._entries: OrderedDict[bytes, Payload] = OrderedDict()
        self._used = 0
        self._spare: dict[int, list[bytearray]] = {}
        self.on_removed: Callable[[bytes], None] | None = None  # KV events (store.py)

    MAX_SPARE = 64  # per buffer size: a step's worth of stores

    def take_spare(self, nbytes: int) -> bytearray | None:
        """A buffer of `nbytes` that a dropped entry no longer uses (contents undefined), to
        fill and put back under a new key; None if there is none."""
        spare = self._spare.get(nbytes)
        return spare.pop() if spare else None

    def _recycle(self, value: Payload) -> None:
        # Only bytearrays the tier was handed: views and bytes may be shared with others.
        if type(value) is bytearray:
            spare = self._spare.setdefault(len(value), [])
            if len(spare) < self.MAX_SPARE:
                spare.append(value)

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._entries)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return [key in self._entries for key in keys]

    def get(self, keys: Sequence[bytes]) -> list[Payload | None]:
        out: list[Payload | None] = []
        for key in keys:
            self.stats.lookups += 1
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                self.stats.bytes_loaded += len(value)
            out.append(value)
        return out

    def put(self, items: Sequence[tuple[bytes, Payload]]) -> list[bool]:
        return [self._put_one(key, value) for key, value in items]

    def _put_one(self, key: bytes, value: Payload) -> bool:
        if len(value) > self.capacity_bytes:
            # Refused before touching anything: evicting the whole tier for an entry that
            # can never fit would only lose what is there.
            self.stats.refused += 1
            return False
        # A put takes the value over (the KVStore contract): a block's bytes are stored as
        # given, without a second copy.
        old = self._entries.pop(key, None)
        if old is not None:
            self._used -= len(old)
            if old is not value:
                self._recycle(old)
        while self._used + len(value) > self.capacity_bytes:
            dropped_key, dropped = self._entries.popitem(last=False)
            self._used -= len(dropped)
            self.stats.evictions += 1
            self._recycle(dropped)
            if self.on_removed is not None:
                self.on_removed(dropped_key)
        self._entries[key] = value
        self._used += len(value)
        self.stats.bytes_stored += len(value)
        return True

    def keys(self) -> list[bytes]:
        return list(self._entries)

    def delete(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= len(old)
                if self.on_removed is not None:
                    self.on_removed(key)

    def check_integrity(self) -> None:
        assert self._used == sum(len(v) for v in self._entries.values()), "used bytes drifted"
        assert self._used <= self.capacity_bytes, "over budget"
