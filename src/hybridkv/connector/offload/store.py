"""The byte-level store interface every offload tier implements (CPU memory, disk, Redis).

A tier maps opaque keys to opaque byte strings. It knows nothing of blocks, groups, tensors or
layouts: the caller builds keys with `make_key` and serialises a block to bytes. That keeps a
remote tier a thin client and lets one test oracle (a dict) check every tier.

    key = [u16 len(layout fp) | layout fp | u32 group_id | block hash]

The layout fingerprint names the byte layout of a block (model, dtypes, block size, ...), so a
tier shared across runs never serves one model's bytes to another; the group id keeps the same
token prefix of two groups apart.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from hybridkv.kv.plan import parse_bytes

# What a tier stores: a block's bytes, as the connector copied them out (a bytearray: no
# second copy) or as read back (a view of the buffer a file was read into).
Payload = bytes | bytearray | memoryview

_KEY_PREFIX = struct.Struct(">H")
_GROUP = struct.Struct(">I")


def make_key(layout_fingerprint: bytes, group_id: int, block_hash: bytes) -> bytes:
    """The store key of one block. Length-prefixing the fingerprint keeps the encoding
    unambiguous (no fingerprint/hash split can collide with another)."""
    if len(layout_fingerprint) > 0xFFFF:
        raise ValueError(f"layout fingerprint is {len(layout_fingerprint)} bytes; "
                         f"at most 65535 fit a key")
    if not 0 <= group_id <= 0xFFFFFFFF:
        raise ValueError(f"group id {group_id} does not fit a key (0 .. 2**32 - 1)")
    return (_KEY_PREFIX.pack(len(layout_fingerprint)) + layout_fingerprint
            + _GROUP.pack(group_id) + block_hash)


def parse_key(key: bytes) -> tuple[bytes, int, bytes]:
    """`make_key`'s inverse: (layout fingerprint, group id, block hash)."""
    (fp_len,) = _KEY_PREFIX.unpack_from(key)
    fp_end = _KEY_PREFIX.size + fp_len
    (group_id,) = _GROUP.unpack_from(key, fp_end)
    return key[_KEY_PREFIX.size:fp_end], group_id, key[fp_end + _GROUP.size:]


@dataclass
class StoreStats:
    """Counters of one tier since it was built. `lookups`/`hits` count keys passed to `get`
    (`exists` is a question and counts nothing), so `lookups - hits` is the tier's misses."""

    lookups: int = 0
    hits: int = 0
    bytes_loaded: int = 0  # payload bytes returned by get
    bytes_stored: int = 0  # payload bytes of accepted puts
    evictions: int = 0  # entries dropped to make room for a put
    refused: int = 0  # puts larger than the whole budget
    rejected: int = 0  # corrupt or mismatched entries found, removed, never returned
    errors: int = 0  # operations that failed on a fault (I/O error, disk full, ...)
    connection_errors: int = 0  # remote tiers: faults of the connection (refused, timeout)
    dropped_stores: int = 0  # remote tiers: puts dropped (queue full, store unreachable)

    @property
    def misses(self) -> int:
        return self.lookups - self.hits


@runtime_checkable
class KVStore(Protocol):
    """A byte store with batch operations; every call takes or returns one item per key, in
    order. Contract, for every tier:

    - `get` returns exactly the bytes last put under that key, or None. A tier may lose any
      entry at any time (eviction, a fault, a corrupt file), so None is always a legal answer;
      bytes of another key or damaged bytes never are.
    - `exists` is a side-effect-free hint (no recency, no counters): a later `get` may still
      miss, and callers must treat that as a miss.
    - `put` takes the values over: the caller must not change them afterwards (so a tier
      may keep them without copying). It overwrites; it answers False where it stored
      nothing (larger than the budget, a fault). Faults never raise out of `get`/`put`/
      `delete`/`exists`: they are counted in `stats.errors` and behave as a miss or a
      refused put.
    - Not thread-safe: one owner calls a tier at a time.
    - A tier that can say which keys it dropped (evicted, deleted, found damaged) calls
      its `on_removed` attribute, when set, with each such key (KV events).
    """

    stats: StoreStats

    def exists(self, keys: Sequence[bytes]) -> list[bool]: ...

    def get(self, keys: Sequence[bytes]) -> list[Payload | None]: ...

    def put(self, items: Sequence[tuple[bytes, Payload]]) -> list[bool]: ...

    def delete(self, keys: Sequence[bytes]) -> None: ...


class FaultLog:
    """Counts faults into `stats.errors` and logs the first one of each kind. A full disk fails
    every store of every step; one line says so, the counter says how often."""

    def __init__(self, stats: StoreStats, logger: logging.Logger, where: str) -> None:
        self._stats = stats
        self._logger = logger
        self._where = where
        self._warned: set[str] = set()

    def record(self, kind: str, exc: BaseException) -> None:
        self._stats.errors += 1
        if kind not in self._warned:
            self._warned.add(kind)
            self._logger.warning("%s: %s (%s); treating it as a miss / refused store from now "
                                 "on, counted in stats.errors", self._where, kind, exc)


class TierSpec(NamedTuple):
    path: str
    capacity_bytes: int


def parse_tier_spec(spec: str, *, flag: str = "--kv-offload-disk") -> TierSpec:
    """`/mnt/kv:50GiB` -> TierSpec('/mnt/kv', 53687091200). The size follows the last colon,
    so a path may hold colons of its own."""
    path, sep, size = spec.rpartition(":")
    if not sep:
        raise ValueError(f"{flag} {spec!r} has no size: write it as DIR:SIZE, "
                         f"e.g. /mnt/kv:50GiB")
    if not path.strip():
        raise ValueError(f"{flag} {spec!r} has an empty path: write it as DIR:SIZE, "
                         f"e.g. /mnt/kv:50GiB")
    try:
        capacity = parse_bytes(size)
    except ValueError as e:
        raise ValueError(f"{flag} {spec!r}: {e}") from None
    if capacity <= 0:
        raise ValueError(f"{flag} {spec!r}: the size must be more than 0 bytes")
    return TierSpec(path, capacity)
