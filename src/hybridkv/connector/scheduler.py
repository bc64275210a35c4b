"""The offload connector's scheduler half: tier hits folded into the hybrid fixed point, and the
loads and stores each step performs. No torch: it decides, the worker half copies.

A tier hit extends the device hit. For every end point `e` past the device hit (a multiple of
every group's block size), each group says which of its blocks a hit at `e` needs
(`hit_needs`: all of them for full attention, the window for sliding window, the current chunk
for chunked attention, the checkpoint at `e` for a state group); the hit is the largest `e`
where every needed block is on the device or in a tier:

    full   [d d d d t t t t]        d on the device, t in a tier, . nowhere
    window [. . . . . . t t]        e = 8 blocks: full needs 0..8, the window 6..8,
    mamba  [. . . . . . . t]        mamba the checkpoint at 8

The blocks to load get free blocks now (all groups or none) and the device blocks the hit
counts on are held, so nothing evicts them while the loads run. When the loads are done the
loaded blocks join the device prefix cache under their hashes, and the request's ordinary
device lookup finds the whole hit: one code path, for every kind of group, decides what a
request reuses. A block that failed to load is simply not there, so the hit is shorter and
those tokens are recomputed.

Store policy:
    evict  a block is copied out when the device evicts it (or on a prefix-cache reset):
           only blocks leaving the device move, and the copy happens before the forward
           that overwrites them
    fill   a block is copied out after the forward that filled it (vLLM's offloading
           connector): every computed block moves once, even those never evicted

Whatever the policy, a tier that outlives the process (disk) gets every block after the
forward that filled it (write-through, in the background): a process that is killed, or an
engine that is dropped without `close()`, leaves its computed blocks on disk for the next
one. At most WRITE_THROUGH_BYTES of such copies wait for the disk at a time; a block past
that reaches the disk on eviction or at `close()`, as before.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from dataclasses import dataclass, field

from hybridkv.connector.base import BlockCopy, ConnectorMeta, LoadDone, LoadJob, StoreDone
from hybridkv.connector.offload.chain import STORED, TierChain
from hybridkv.connector.offload.store import make_key, parse_key
from hybridkv.kv.block_pool import Block, BlockStored
from hybridkv.kv.events import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_REMOTE,
    BlocksRemoved,
    BlocksStored,
    KVCacheEvent,
)
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.manager import KVCacheManager
from hybridkv.kv.request import KVRequest

logger = logging.getLogger(__name__)

STORE_POLICIES = ("evict", "fill")
DURABLE_TIERS = ("disk",)  # tiers that outlive the process: written through as blocks fill
WRITE_THROUGH_BYTES = 128 << 20  # write-through copies waiting for the disk, at most
MAX_LOAD_ROUNDS = 2  # per admission: a request whose loaded blocks got evicted again retries once
DEVICE = -2  # `source` of a block already in the device prefix cache
TIER_MEDIA = {"cpu": MEDIUM_CPU, "disk": MEDIUM_DISK, "remote": MEDIUM_REMOTE}  # KV events


@dataclass
class _Target:
    group_id: int
    block: Block
    block_hash: BlockHash
    value: int  # the prefix tokens a hit through it spares
    # For KV events (only when the pool publishes them): the parent block's hash and the
    # block's tokens.
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()


@dataclass
class _Load:
    request_id: str
    job_id: int
    started: float
    device_tokens: int  # the device hit when the load started
    tokens: int  # the hit the load makes possible
    targets: list[_Target]
    held: list[list[Block]]  # per group: device blocks the hit counts on, held meanwhile
    served: tuple[int, ...] = ()  # per target, the tier that served it (-1: failed)
    done: bool = False
    abandoned: bool = False  # timed out or its request finished: released when done


@dataclass
class ConnectorStats:
    loads_started: int = 0
    blocks_loaded: int = 0
    blocks_failed: int = 0  # missing, corrupt or timed out: recomputed instead
    load_timeouts: int = 0
    blocks_stored: int = 0  # copies queued for the tiers
    blocks_written_through: int = 0  # of those, copies for the durable tiers only
    write_through_skipped: int = 0  # filled blocks past the write-through budget
    no_room_for_load: int = 0  # tier hits given up because the device had no free blocks
    bytes_loaded: int = 0  # into the device, from any tier
    load_job_seconds: float = 0.0  # the worker's time on load jobs (tier reads + copies)
    tokens_by_tier: dict[str, int] = field(default_factory=dict)


class OffloadConnectorScheduler:
    def __init__(self, manager: KVCacheManager, chain: TierChain, layout_fingerprint: bytes,
                 *, store_policy: str = "evict", load_timeout_s: float = 30.0,
                 write_through_bytes: int = WRITE_THROUGH_BYTES) -> None:
        if store_policy not in STORE_POLICIES:
            raise ValueError(f"kv_offload_store must be one of {', '.join(STORE_POLICIES)}, "
                             f"got {store_policy!r}")
        if not manager.enable_caching:
            raise ValueError("KV offloading needs the prefix cache: set enable_prefix_caching "
                             "(a tier serves blocks by their content hash)")
        self.kv = manager
        self.pool = manager.pool
        self.managers = manager.managers
        self.chain = chain
        self.layout_fingerprint = layout_fingerprint
        self.store_policy = store_policy
        self.load_timeout_s = load_timeout_s
        self.alignment = manager.config.hit_alignment
        # The worker half reports here (from its thread); the scheduler drains it each step.
        self.completions: queue.Queue[LoadDone | StoreDone] = queue.Queue()
        self._inbox: list[LoadDone | StoreDone] = []
        self._loads: dict[str, _Load] = {}  # by request id
        self._jobs: dict[int, _Load] = {}  # in flight, by job id
        self._new_jobs: list[LoadJob] = []
        self._next_job = 0
        self._rounds: dict[str, int] = {}
        # Per request whose load was settled before its admission: (device tokens then,
        # slowest tier read), to say where its hit came from.
        self._served: dict[str, tuple[int, int]] = {}
        # Keys queued for the tiers, not yet done: (copies queued, the tiers they go to, None
        # for every tier). A block written through to the disk while it is still on the
        # device must still reach the CPU tier when the device evicts it before the disk
        # write is done.
        self._pending_store: dict[bytes, tuple[int, frozenset[int] | None]] = {}
        # Store policy "evict": the durable tiers, written through as blocks fill, and the
        # bytes of those copies not written yet (by key).
        self.write_through = (tuple(i for i, name in enumerate(chain.names)
                                    if name in DURABLE_TIERS)
                              if store_policy == "evict" else ())
        self.write_through_bytes = write_through_bytes
        self._writing_through: dict[bytes, int] = {}
        self._write_through_queued = 0
        self._store_before: list[BlockCopy] = []
        self.stats = ConnectorStats(tokens_by_tier={"device": 0, **{n: 0 for n in chain.names}})
        self._warned_timeout = False
        if store_policy == "evict":
            self.pool.eviction_log = []
        if store_policy == "fill" or self.write_through:
            self.pool.enable_events = True

    def key(self, group_id: int, block_hash: BlockHash) -> bytes:
        return make_key(self.layout_fingerprint, group_id, block_hash)

    # ------------------------------------------------------------ lookups and loads
    def start_load(self, request: KVRequest, device_tokens: int) -> bool:
        """If tiers hold more of `request`'s prompt than the device (`device_tokens`), take
        blocks for it, queue its loads and answer True: the request waits until
        `take_finished_loads` names it. False: nothing to load (or no room), go on."""
        rid = request.request_id
        if rid in self._loads or self._rounds.get(rid, 0) >= MAX_LOAD_ROUNDS:
            return False
        self._drain_evictions()
        max_end = (request.num_tokens - 1) // self.alignment * self.alignment
        if max_end <= device_tokens:
            return False
        plan = self._plan(request, device_tokens, max_end)
        if plan is None:
            return False
        end, loads, held = plan
        needs = [len(group_loads) for group_loads in loads]
        if not self.pool.can_take(needs, held):
            self.stats.no_room_for_load += 1
            return False
        for blocks in held:
            self.pool.touch(blocks)
        taken = self.pool.take_all(needs)
        self._drain_evictions()  # taking may have evicted blocks: they are stored first
        job_id, self._next_job = self._next_job, self._next_job + 1
        targets, copies, first = [], [], []
        announce = self.pool.kv_events is not None
        for g, (group_loads, blocks) in enumerate(zip(loads, taken, strict=True)):
            block_size, stride = self.managers[g].block_size, self.managers[g].stride
            for (index, block_hash, key, tier), block in zip(group_loads, blocks, strict=True):
                target = _Target(g, block, block_hash, (index + 1) * block_size)
                if announce:
                    target.parent_hash = (request.block_hashes[index * stride - 1]
                                          if index else None)
                    target.token_ids = tuple(
                        request.token_ids[index * block_size:(index + 1) * block_size])
                targets.append(target)
                copies.append(BlockCopy(g, block.block_id, key))
                first.append(max(tier, 0))
        load = _Load(rid, job_id, time.monotonic(), device_tokens, end, targets, held)
        self._loads[rid] = self._jobs[job_id] = load
        self._new_jobs.append(LoadJob(job_id, tuple(copies), tuple(first)))
        self._rounds[rid] = self._rounds.get(rid, 0) + 1
        self.stats.loads_started += 1
        return True

    def _plan(self, request: KVRequest, device_tokens: int, max_end: int
              ) -> tuple[int, list[list[tuple[int, BlockHash, bytes, int]]],
                         list[list[Block]]] | None:
        """The longest hit past `device_tokens` that device and tiers serve together:
        (its end in tokens, per group the blocks to load as (index, hash, key, first tier),
        per group the device blocks it counts on). None: no longer hit."""
        hashes = request.block_hashes
        sources: list[list[int]] = []  # per group, per block index: DEVICE, a tier, or -1
        prefix: list[list[int]] = []  # per group, available blocks among the first i
        asks: list[tuple[list[int], int, int]] = []  # (source, index, key) not on the device
        keys: list[bytes] = []
        for m in self.managers:
            num = max_end // m.block_size
            group_hashes = [hashes[(i + 1) * m.stride - 1] for i in range(num)]
            source = [DEVICE if h in m.cached else -1 for h in group_hashes]
            for i, s in enumerate(source):
                if s == -1:
                    asks.append((source, i, len(keys)))
                    keys.append(self.key(m.group_id, group_hashes[i]))
            sources.append(source)
        # Every group's blocks in one question per tier (one round trip to a remote tier).
        located = self.chain.locate(keys) if keys else []
        for source, i, k in asks:
            source[i] = 0 if keys[k] in self._pending_store else located[k]
        for source in sources:
            counts = [0]
            for s in source:
                counts.append(counts[-1] + (s != -1))
            prefix.append(counts)
        for end in range(max_end, device_tokens, -self.alignment):
            needs = [m.hit_needs(end // m.block_size) for m in self.managers]
            if all(need is not None and prefix[g][need[1]] - prefix[g][need[0]]
                   == need[1] - need[0] for g, need in enumerate(needs)):
                break
        else:
            return None
        loads: list[list[tuple[int, BlockHash, bytes, int]]] = []
        held: list[list[Block]] = []
        for g, (m, need) in enumerate(zip(self.managers, needs, strict=True)):
            assert need is not None
            group_loads, group_held = [], []
            for i in range(*need):
                block_hash = hashes[(i + 1) * m.stride - 1]
                if sources[g][i] == DEVICE:
                    group_held.append(m.cached[block_hash])
                else:
                    group_loads.append((i, block_hash, self.key(g, block_hash),
                                        sources[g][i]))
            loads.append(group_loads)
            held.append(group_held)
        if not any(loads):
            return None  # the device alone serves this much: its own lookup said less
        return end, loads, held

    def take_finished_loads(self) -> list[str]:
        """Requests whose loads completed (or failed, or timed out) since the last call: their
        loaded blocks are in the device prefix cache now; look them up again."""
        self._drain_evictions()
        finished = []
        self._inbox.extend(self._drain_queue())
        for message in self._inbox:
            if isinstance(message, StoreDone):
                for key in message.keys:
                    self._write_through_queued -= self._writing_through.pop(key, 0)
                    count, tiers = self._pending_store.pop(key, (0, None))
                    if count > 1:
                        self._pending_store[key] = (count - 1, tiers)
                continue
            load = self._jobs.pop(message.job_id)
            load.served = message.tiers
            self.stats.load_job_seconds += message.seconds
            self._register(load)
            if load.abandoned:
                self._release(load)
            else:
                load.done = True
                finished.append(load.request_id)
        self._inbox.clear()
        now = time.monotonic()
        for load in self._loads.values():
            if not load.done and not load.abandoned and now - load.started > self.load_timeout_s:
                self._abandon(load)
                self.stats.load_timeouts += 1
                self._rounds[load.request_id] = MAX_LOAD_ROUNDS  # a slow tier: no retry
                if not self._warned_timeout:
                    self._warned_timeout = True
                    logger.warning("a KV load took over %.1f s: its request recomputes those "
                                   "tokens instead (counted in load_timeouts)",
                                   self.load_timeout_s)
                finished.append(load.request_id)
        for rid in finished:
            load = self._loads[rid]
            if load.abandoned:
                del self._loads[rid]  # the job still owns its blocks until it ends
        return finished

    def _drain_queue(self) -> list[LoadDone | StoreDone]:
        out = []
        while True:
            try:
                out.append(self.completions.get_nowait())
            except queue.Empty:
                return out

    def wait(self, timeout: float) -> None:
        """Block until the worker half reports something (or `timeout` seconds): for a step
        with nothing to compute while loads run."""
        if not self._jobs:
            return
        with contextlib.suppress(queue.Empty):
            self._inbox.append(self.completions.get(timeout=timeout))

    @property
    def has_loads(self) -> bool:
        return bool(self._jobs)

    def _register(self, load: _Load) -> None:
        """Loaded blocks join the device prefix cache (a hash cached meanwhile by a block
        computed here keeps that one: the first block per hash wins)."""
        for target, tier in zip(load.targets, load.served, strict=True):
            if tier >= 0:
                self.pool.cache(target.block, target.block_hash, value=target.value,
                                parent_hash=target.parent_hash, token_ids=target.token_ids)
                self.stats.blocks_loaded += 1
                self.stats.bytes_loaded += self.kv.config.groups[target.group_id].block_bytes
            else:
                self.stats.blocks_failed += 1

    def _abandon(self, load: _Load) -> None:
        load.abandoned = True
        self._free_held(load)

    def _free_held(self, load: _Load) -> None:
        for g, blocks in enumerate(load.held):
            self.pool.free(g, reversed(blocks))
        load.held = [[] for _ in load.held]

    def _release(self, load: _Load) -> None:
        """Drop the load's references (its blocks stay cached and hit-able if loaded)."""
        self._free_held(load)
        by_group: dict[int, list[Block]] = {}
        for target in load.targets:
            by_group.setdefault(target.group_id, []).append(target.block)
        for g, blocks in by_group.items():
            self.pool.free(g, reversed(blocks))
        load.targets = []

    def _settle(self, load: _Load) -> None:
        """Drop a finished load's references (its loaded blocks stay cached, hit-able) and
        remember where its tokens came from, for the request's admission."""
        served = [t for t in load.served if t >= 0]
        if served:
            self._served[load.request_id] = (load.device_tokens, max(served))
        self._release(load)

    def request_admitted(self, request: KVRequest, hit_tokens: int) -> dict[str, int]:
        """The request got its blocks (a device hit of `hit_tokens`, loaded blocks
        included): drop the load's references and say where the hit came from."""
        rid = request.request_id
        self._rounds.pop(rid, None)
        load = self._loads.pop(rid, None)
        if load is not None:
            self._settle(load)
        by_tier = {"device": hit_tokens, **{name: 0 for name in self.chain.names}}
        served = self._served.pop(rid, None)
        if served is not None and hit_tokens > served[0]:
            # The tokens past the device hit count for the slowest tier the load read.
            device_tokens, tier = served
            by_tier["device"] = device_tokens
            by_tier[self.chain.names[tier]] = hit_tokens - device_tokens
            self.chain.stats[tier].hit_tokens += hit_tokens - device_tokens
        for name, tokens in by_tier.items():
            self.stats.tokens_by_tier[name] += tokens
        return by_tier

    def request_not_admitted(self, request: KVRequest) -> None:
        """Its blocks did not fit after all: drop the load's references (the loaded blocks
        stay cached; its admission looks them up again)."""
        load = self._loads.pop(request.request_id, None)
        if load is not None:
            self._settle(load)

    def release_done_loads(self) -> bool:
        """Drop the references of every finished load whose request waits for admission:
        memory is short, and blocks held for a request that cannot run yet must not block
        the others (nor make one look as if it could never fit). True if any were held."""
        done = [rid for rid, load in self._loads.items() if load.done]
        for rid in done:
            self._settle(self._loads.pop(rid))
        return bool(done)

    def request_finished(self, request: KVRequest) -> None:
        """Finished or aborted while loading, or before its admission used the load."""
        rid = request.request_id
        self._rounds.pop(rid, None)
        self._served.pop(rid, None)
        load = self._loads.pop(rid, None)
        if load is None:
            return
        if load.done:
            self._release(load)
        else:
            self._abandon(load)  # the job's blocks go when it ends

    def store_all_cached(self) -> None:
        """Queue every block in the device prefix cache for the tiers (store policy
        "evict" at shutdown: the device cache is about to go, as if evicted)."""
        if self.store_policy != "evict":
            return  # "fill" stored each block when it was filled
        self._queue_stores(self._store_before, [
            (g, block.block_id, block_hash) for g, books in enumerate(self.pool.groups)
            for block_hash, block in books.cached.items()])

    # ------------------------------------------------------------ stores
    def _drain_evictions(self) -> None:
        log = self.pool.eviction_log
        if not log:
            return
        self._queue_stores(self._store_before, list(log))
        log.clear()

    def _queue_stores(self, into: list[BlockCopy],
                      blocks: list[tuple[int, int, BlockHash]],
                      only: tuple[int, ...] | None = None) -> None:
        """Queue (group id, block id, hash) copies, but for blocks on their way or in every
        local tier already. A remote tier is not asked here (the engine's thread does not
        wait on the network): the connector's thread asks it before sending. `only`: the
        write-through to these tiers, within its byte budget."""
        todo: dict[bytes, tuple[int, int]] = {}
        for group_id, block_id, block_hash in blocks:
            key = self.key(group_id, block_hash)
            pending = self._pending_store.get(key)
            if pending is None or pending[1] is not None:
                todo.setdefault(key, (group_id, block_id))  # not on its way to every tier
        if not todo:
            return
        missing = self.chain.missing_many(list(todo), ask_remote=False)
        for (key, (group_id, block_id)), lacking in zip(todo.items(), missing, strict=True):
            if only is not None:
                lacking = [t for t in lacking if t in only]
            count, on_the_way = self._pending_store.get(key, (0, frozenset()))
            assert on_the_way is not None  # a copy to every tier left it out of `todo`
            lacking = [t for t in lacking if t not in on_the_way]
            if not lacking:
                continue
            if only is not None:
                nbytes = self.kv.config.groups[group_id].block_bytes
                if self._write_through_queued + nbytes > self.write_through_bytes:
                    self.stats.write_through_skipped += 1  # the disk is behind: on eviction
                    continue
                self._writing_through[key] = nbytes
                self._write_through_queued += nbytes
                self.stats.blocks_written_through += 1
            # Every lacking tier (None), unless part of them is already on its way.
            tiers = only if only is not None else (tuple(lacking) if on_the_way else None)
            self._pending_store[key] = (count + 1, None if tiers is None
                                        else on_the_way | frozenset(tiers))
            into.append(BlockCopy(group_id, block_id, key, tiers))
            self.stats.blocks_stored += 1

    def build_meta(self) -> ConnectorMeta:
        """The loads and stores of the step just scheduled."""
        self._drain_evictions()
        meta = ConnectorMeta(loads=self._new_jobs, store_before=self._store_before)
        self._new_jobs, self._store_before = [], []
        if self.store_policy == "fill":
            self._queue_stores(meta.store_after, self._filled())
        elif self.write_through:
            self._queue_stores(meta.store_after, self._filled(), only=self.write_through)
        return meta

    def _filled(self) -> list[tuple[int, int, BlockHash]]:
        """(group id, block id, hash) of the blocks cached since the last step."""
        filled = []
        for event in self.pool.take_events():
            if not isinstance(event, BlockStored):
                continue
            cached = self.pool.groups[event.group_id].cached
            for block_hash, block_id in zip(event.block_hashes, event.block_ids, strict=True):
                block = cached.get(block_hash)
                # Dropped again this step (its step was undone): nothing to store.
                if block is not None and block.block_id == block_id:
                    filled.append((event.group_id, block_id, block_hash))
        return filled

    # ------------------------------------------------------------ KV events
    def enable_kv_events(self) -> None:
        """Log the tiers' stores and removals for `take_kv_events` (what a warm tier holds
        already comes first)."""
        self.chain.enable_events()

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The tiers' stores and removals since the last call, as KV events with each tier's
        medium (CPU, STORAGE, EXTERNAL); consecutive ones of one tier, kind and group in one
        event. Stored events carry the hashes only (no tokens, no parent), as vLLM's
        offloading connector sends them: the device announced the tokens when it computed
        the block."""
        out: list[KVCacheEvent] = []
        run: tuple[int, int, int] | None = None  # (tier, kind, group) of `hashes`
        hashes: list[BlockHash] = []

        def close_run() -> None:
            if run is None or not hashes:
                return
            tier, kind, group = run
            medium = TIER_MEDIA.get(self.chain.names[tier], self.chain.names[tier].upper())
            if kind == STORED:
                out.append(BlocksStored(group, tuple(hashes), None, (),
                                        self.managers[group].block_size, medium))
            else:
                out.append(BlocksRemoved(group, tuple(hashes), medium))

        for tier, kind, key in self.chain.take_events():
            fingerprint, group, block_hash = parse_key(key)
            if fingerprint != self.layout_fingerprint or group >= len(self.managers):
                continue  # another layout's entry (a shared directory): not ours to announce
            if run != (tier, kind, group):
                close_run()
                run, hashes = (tier, kind, group), []
            hashes.append(block_hash)
        close_run()
        return out

    def stats_summary(self) -> dict[str, object]:
        s = self.stats
        return {"store_policy": self.store_policy, "loads_started": s.loads_started,
                "blocks_loaded": s.blocks_loaded, "blocks_failed": s.blocks_failed,
                "load_timeouts": s.load_timeouts, "blocks_stored": s.blocks_stored,
                "blocks_written_through": s.blocks_written_through,
                "write_through_skipped": s.write_through_skipped,
                "no_room_for_load": s.no_room_for_load, "bytes_loaded": s.bytes_loaded,
                "load_job_seconds": round(s.load_job_seconds, 6),
                "tokens_by_tier": dict(s.tokens_by_tier),
                "tiers": [t.summary() for t in self.chain.stats]}
