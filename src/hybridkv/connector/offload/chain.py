"""The offload tiers as one chain: fastest first (CPU memory, then disk, then a remote store).

    locate(keys)   -> per key, the first tier holding it (or -1)        a hint, no counters
    load(key)      -> (bytes, tier) from the first tier that has it; a hit below the
                      first tier is copied into the faster tiers (promotion)
    store(key, b)  -> write-through: every tier lacking the key gets it

Write-through keeps the slow tiers complete (a new process on the same disk directory finds
every block any earlier run stored), at the cost of writing each block once per tier; the
writes run on the connector's background thread, off the step's critical path.

The scheduler asks `locate` while the connector's thread loads and stores, so every call takes
the tier's lock (the tiers are single-owner; each has a lock of its own). Each call holds it
for one key's work, so a lookup never waits behind a long batch. A tier that says
`thread_safe` (the Redis tier) is called without the lock: a slow network never holds up the
local tiers. A tier that says `exists_thread_safe` (CPU and disk: `exists` reads an
in-memory index, one dict lookup a key) answers lookups without it: the scheduler never
waits on a disk write.

The `*_many` calls take a batch of keys and ask each tier once: a remote tier answers a
batch in one round trip.

KV events (`enable_events`): what each tier accepted and dropped is logged in `events`, from
whichever thread made the call (a deque: appends never wait); the engine's thread drains it
each step and publishes it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridkv.connector.offload.store import KVStore, Payload, StoreStats

TIER_NAMES = ("cpu", "disk", "remote")  # the tiers a user can configure, fastest first
STORED, REMOVED = 0, 1  # kinds of `TierChain.events` entries
TierEvent = tuple[int, int, bytes]  # (tier index, kind, store key)


@dataclass
class TierStats:
    """What one tier did for the engine: the store's own counters plus the connector's."""

    name: str
    store: StoreStats
    hit_tokens: int = 0  # prompt tokens whose reuse this tier made possible
    load_seconds: float = 0.0  # reading from this tier (the background thread's time)
    store_seconds: float = 0.0
    promotions: int = 0  # entries copied up into this tier after a hit below it

    def summary(self) -> dict[str, float | int | str]:
        s = self.store
        return {"tier": self.name, "lookups": s.lookups, "hits": s.hits,
                "hit_tokens": self.hit_tokens, "bytes_loaded": s.bytes_loaded,
                "bytes_stored": s.bytes_stored, "load_seconds": round(self.load_seconds, 6),
                "store_seconds": round(self.store_seconds, 6), "evictions": s.evictions,
                "rejected": s.rejected, "refused": s.refused, "errors": s.errors,
                "connection_errors": s.connection_errors, "dropped_stores": s.dropped_stores,
                "promotions": self.promotions}


@dataclass
class TierChain:
    names: tuple[str, ...]
    tiers: tuple[KVStore, ...]
    stats: tuple[TierStats, ...] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.names) != len(self.tiers) or not self.tiers:
            raise ValueError("a tier chain needs one name per tier, and at least one tier")
        self.stats = tuple(TierStats(n, t.stats) for n, t in zip(self.names, self.tiers,
                                                                 strict=True))
        # One lock per tier: a slow disk write never holds up the CPU tier (a block's
        # buffer for the next copy-out, a load's promotion).
        self._locks = tuple(threading.Lock() for _ in self.tiers)
        self._unlocked = contextlib.nullcontext()
        self.events: deque[TierEvent] | None = None

    def enable_events(self) -> None:
        """Log every key a tier accepts or drops in `events` from now on; the keys the
        tiers hold already (a warm disk directory) are logged as stored first."""
        events: deque[TierEvent] = deque()
        for index, tier in enumerate(self.tiers):
            with self._guard(index):
                live = getattr(tier, "live_keys", None) or getattr(tier, "keys", None)
                if live is not None:
                    events.extend((index, STORED, key) for key in live())
                if hasattr(tier, "on_removed"):  # not part of KVStore: optional
                    hook: Any = tier
                    hook.on_removed = functools.partial(self._removed, index)
        self.events = events

    def _removed(self, index: int, key: bytes) -> None:
        if self.events is not None:
            self.events.append((index, REMOVED, key))

    def take_events(self) -> list[TierEvent]:
        """The events logged since the last call, oldest first (any thread may log more
        meanwhile: those come next time)."""
        events, out = self.events, []
        if events is not None:
            with contextlib.suppress(IndexError):
                for _ in range(len(events)):
                    out.append(events.popleft())
        return out

    def _guard(self, index: int) -> contextlib.AbstractContextManager[object]:
        """The tier's lock for a single-owner tier; nothing for a thread-safe one."""
        if getattr(self.tiers[index], "thread_safe", False):
            return self._unlocked
        return self._locks[index]

    def _lookup_guard(self, index: int) -> contextlib.AbstractContextManager[object]:
        """The lock for an `exists` call: none where the tier's lookups may run beside its
        other calls."""
        if getattr(self.tiers[index], "exists_thread_safe", False):
            return self._unlocked
        return self._guard(index)

    def is_remote(self, index: int) -> bool:
        return bool(getattr(self.tiers[index], "remote", False))

    def locate(self, keys: Sequence[bytes]) -> list[int]:
        """Per key, the index of the first tier that says it holds it, else -1."""
        found = [-1] * len(keys)
        for index, tier in enumerate(self.tiers):
            todo = [i for i, f in enumerate(found) if f < 0]
            if not todo:
                break
            with self._lookup_guard(index):
                answers = tier.exists([keys[i] for i in todo])
            for i, present in zip(todo, answers, strict=True):
                if present:
                    found[i] = index
        return found

    def missing_many(self, keys: Sequence[bytes], *, ask_remote: bool = True
                     ) -> list[list[int]]:
        """Per key, the tiers that do not hold it (one question per tier). A remote tier is
        counted as lacking every key unless `ask_remote`: the engine's thread never waits
        on the network to decide what to copy out."""
        out: list[list[int]] = [[] for _ in keys]
        for index, tier in enumerate(self.tiers):
            if not ask_remote and self.is_remote(index):
                answers = [False] * len(keys)
            else:
                with self._lookup_guard(index):
                    answers = tier.exists(keys)
            for lacking, present in zip(out, answers, strict=True):
                if not present:
                    lacking.append(index)
        return out

    def missing(self, key: bytes) -> list[int]:
        """The tiers that do not hold `key`."""
        return self.missing_many([key])[0]

    def load(self, key: bytes, first: int = 0) -> tuple[Payload | None, int]:
        """The bytes under `key` from the first tier (from `first` on) that returns them, and
        that tier's index (-1: none). A hit below tier 0 is promoted into the tiers above."""
        for index in range(first, len(self.tiers)):
            started = time.perf_counter()
            with self._guard(index):
                [value] = self.tiers[index].get([key])
            self.stats[index].load_seconds += time.perf_counter() - started
            if value is not None:
                for upper in range(index):
                    self._put(upper, key, value)
                    self.stats[upper].promotions += 1
                return value, index
        return None, -1

    def load_many(self, keys: Sequence[bytes], first: Sequence[int]
                  ) -> list[tuple[Payload | None, int]]:
        """`load` for a batch: each tier is read once, for the keys not found above it
        (from each key's `first` tier on); hits below tier 0 are promoted."""
        out: list[tuple[Payload | None, int]] = [(None, -1)] * len(keys)
        for index in range(min(first, default=len(self.tiers)), len(self.tiers)):
            todo = [i for i, (value, _) in enumerate(out) if value is None and first[i] <= index]
            if not todo:
                continue
            started = time.perf_counter()
            with self._guard(index):
                values = self.tiers[index].get([keys[i] for i in todo])
            self.stats[index].load_seconds += time.perf_counter() - started
            found = [(keys[i], v) for i, v in zip(todo, values, strict=True) if v is not None]
            for i, value in zip(todo, values, strict=True):
                if value is not None:
                    out[i] = (value, index)
            for upper in range(index if found else 0):
                self._put_many(upper, found)
                self.stats[upper].promotions += len(found)
        return out

    def store_many(self, items: Sequence[tuple[bytes, Payload]],
                   tiers: Sequence[Sequence[int]]) -> None:
        """Put each item into its tiers (`missing_many`'s answer): one put per tier."""
        for index in range(len(self.tiers)):
            batch = [item for item, into in zip(items, tiers, strict=True) if index in into]
            if batch:
                self._put_many(index, batch)

    def _put_many(self, index: int, items: Sequence[tuple[bytes, Payload]]) -> None:
        started = time.perf_counter()
        events, tier = self.events, self.tiers[index]
        if events is None and getattr(tier, "thread_safe", False):
            tier.put(items)  # no lock to hold: one call (a remote tier's one round trip)
        else:
            # One key at a time (under the lock, a load waits for one write, not a batch's);
            # with events a put that evicts an entry stored earlier in the batch logs that
            # entry's store before its removal.
            for key, value in items:
                with self._guard(index):
                    stored = tier.put([(key, value)])[0]
                if stored and events is not None:
                    events.append((index, STORED, key))
        self.stats[index].store_seconds += time.perf_counter() - started

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait for tiers that write in the background (the remote tier's queue)."""
        for tier in self.tiers:
            flush = getattr(tier, "flush", None)
            if flush is not None:
                flush(timeout_s)

    def close(self) -> None:
        """Stop tiers that own threads or connections, after their queued writes."""
        for tier in self.tiers:
            close = getattr(tier, "close", None)
            if close is not None:
                close()

    def store(self, key: bytes, value: Payload, tiers: Sequence[int] | None = None) -> int:
        """Put `value` into the given tiers (default: all); returns how many accepted it."""
        accepted = 0
        for index in range(len(self.tiers)) if tiers is None else tiers:
            accepted += self._put(index, key, value)
        return accepted

    def _put(self, index: int, key: bytes, value: Payload) -> bool:
        started = time.perf_counter()
        with self._guard(index):
            [ok] = self.tiers[index].put([(key, value)])
        self.stats[index].store_seconds += time.perf_counter() - started
        if ok and self.events is not None:
            self.events.append((index, STORED, key))
        return ok

    def buffer(self, nbytes: int) -> bytearray:
        """A buffer to copy a block into before `store`: one the first tier no longer uses
        if it has one (already mapped: no page faults), else a new one."""
        take = getattr(self.tiers[0], "take_spare", None)
        if take is not None:
            with self._guard(0):
                spare: bytearray | None = take(nbytes)
            if spare is not None:
                return spare
        return bytearray(nbytes)

    def clear(self, index: int) -> None:
        """Drop everything one tier holds that this chain can name (benchmarks: a cold tier)."""
        tier = self.tiers[index]
        clear = getattr(tier, "clear", None)
        if clear is not None:  # a shared tier: only what this chain's namespace holds
            clear()  # (not announced as KV events: a benchmark's tool, not serving)
            return
        if not hasattr(tier, "keys"):
            raise NotImplementedError(f"the {self.names[index]} tier cannot list its keys")
        with self._guard(index):
            tier.delete(tier.keys())
