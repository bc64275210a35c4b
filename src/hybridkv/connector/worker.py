"""The offload connector's worker half: bytes between the arena and the tiers, off the step.

    before_forward(meta):  copy out the blocks the device evicted this step (the forward is
                           about to reuse them), then queue this step's loads
    after_forward(meta):   copy out the blocks this step filled (store policy "fill")
    background thread:     loads first (a request waits on them), then tier writes

Copying a block out is one copy into a fresh host buffer, done on the calling thread so the
bytes are taken before anything can overwrite the block; writing that buffer into the tiers
(a disk file, a remote store) is the slow part and runs on the thread. A load writes into
blocks that only its (waiting) request holds, so it can run while the model computes the
other requests; on CUDA it copies on a side stream.

Anything that fails in the thread is a failed load (the request recomputes) or a lost store;
the thread never dies and never leaves a request waiting.

Tier reads and the store check are batched (`TierChain.load_many` / `missing_many`): a remote
tier answers LOAD_BATCH blocks, or a step's stores, in one round trip.
"""

from __future__ import annotations

import itertools
import logging
import queue
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Sequence

import torch

from hybridkv.connector.base import (
    BlockCopy,
    ConnectorMeta,
    LoadDone,
    LoadJob,
    StoreDone,
)
from hybridkv.connector.canonical import CanonicalGroup, CanonicalKVCaches
from hybridkv.connector.offload.chain import TierChain
from hybridkv.connector.offload.store import Payload

logger = logging.getLogger(__name__)

_LOAD, _STORE, _STOP = 0, 1, 2  # queue priorities: loads before stores
LOAD_BATCH = 64  # blocks read from the tiers at once: one round trip, bounded memory
# A remote tier's payload is a view of the read-only bytes the client received; it is only
# ever the source of a copy into the arena, so torch's warning about it does not apply.
warnings.filterwarnings("ignore", message="The given buffer is not writable",
                        category=UserWarning, module=__name__)


class OffloadConnectorWorker:
    def __init__(self, caches: CanonicalKVCaches, chain: TierChain,
                 completions: queue.Queue[LoadDone | StoreDone]) -> None:
        self.groups: Sequence[CanonicalGroup] = caches.groups
        self.chain = chain
        self.completions = completions
        self.device = caches.groups[0].blocks.device if caches.groups else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        # Copied out, not yet in a tier: a load of such a key is served from here.
        self._pending: dict[bytes, bytearray] = {}
        # Read by the running load job's batch, not yet copied into the arena.
        self._fetched: dict[bytes, tuple[Payload | None, int]] = {}
        self._jobs: _Jobs = queue.PriorityQueue()
        self._seq = itertools.count()
        self._warned: set[str] = set()
        self._closed = False
        # The thread holds only a weak reference: dropping the engine frees its arena, and
        # the finalizer stops the thread (at exit too, after the work queued so far).
        self._thread = threading.Thread(target=_serve, args=(self._jobs, weakref.ref(self)),
                                        name="hybridkv-kv-offload", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._jobs, self._thread, chain)

    # ------------------------------------------------------------ the step's calls
    def before_forward(self, meta: ConnectorMeta) -> None:
        if self._closed:  # after close(): nothing moves, every load is a miss
            for job in meta.loads:
                self.completions.put(LoadDone(job.job_id, (-1,) * len(job.blocks), 0.0))
            self._drop(meta.store_before)
            return
        if meta.store_before:
            self._copy_out(meta.store_before)
        for job in meta.loads:
            self._jobs.put((_LOAD, next(self._seq), job))

    def _drop(self, copies: Sequence[BlockCopy]) -> None:
        if copies:
            self.completions.put(StoreDone(tuple(c.key for c in copies)))

    def after_forward(self, meta: ConnectorMeta, ok: bool) -> None:
        if ok and not self._closed:
            self._copy_out(meta.store_after)
        else:
            # The step failed: these blocks hold no valid KV. Nothing is stored.
            self._drop(meta.store_after)

    def _copy_out(self, copies: Sequence[BlockCopy]) -> None:
        if not copies:
            return
        items = []
        for copy in copies:
            group = self.groups[copy.group_id]
            page, slot = divmod(copy.block_id, group.blocks_per_page)
            buf = self.chain.buffer(group.block_bytes)
            torch.frombuffer(buf, dtype=torch.int8).copy_(group.blocks[page, slot])
            self._pending[copy.key] = buf
            items.append((copy.key, buf, copy.tiers))
        self._jobs.put((_STORE, next(self._seq), items))

    # ------------------------------------------------------------ the thread's jobs
    def _load(self, job: LoadJob) -> None:
        started = time.perf_counter()
        served: list[int] = []
        try:
            for start in range(0, len(job.blocks), LOAD_BATCH):
                copies = job.blocks[start:start + LOAD_BATCH]
                firsts = job.first_tier[start:start + LOAD_BATCH]
                self._fetch(copies, firsts)
                for copy, first in zip(copies, firsts, strict=True):
                    served.append(self._load_block(copy, first))
                self._fetched.clear()
            if self.stream is not None:
                self.stream.synchronize()
        except Exception as e:  # a fault must not leave the request waiting
            self._warn_once("load", e)
            served += [-1] * (len(job.blocks) - len(served))
            served = [-1] * len(served)  # which writes landed is unknown: none is trusted
            self._fetched.clear()
        self.completions.put(LoadDone(job.job_id, tuple(served),
                                      time.perf_counter() - started))

    def _fetch(self, copies: Sequence[BlockCopy], firsts: Sequence[int]) -> None:
        """Read a batch of blocks from the tiers (those not waiting in `_pending`)."""
        todo = [i for i, c in enumerate(copies) if c.key not in self._pending]
        if todo:
            found = self.chain.load_many([copies[i].key for i in todo],
                                         [firsts[i] for i in todo])
            self._fetched.update(zip((copies[i].key for i in todo), found, strict=True))

    def _load_block(self, copy: BlockCopy, first: int) -> int:
        group = self.groups[copy.group_id]
        data: Payload | None = self._pending.get(copy.key)
        tier = 0
        if data is None:
            data, tier = (self._fetched.pop(copy.key) if copy.key in self._fetched
                          else self.chain.load(copy.key, first))
        if data is None:
            return -1
        if len(data) != group.block_bytes:
            self._warn_once("size", ValueError(f"{len(data)} bytes for a block of "
                                               f"{group.block_bytes}"))
            return -1
        page, slot = divmod(copy.block_id, group.blocks_per_page)
        source = torch.frombuffer(data, dtype=torch.int8)
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                group.blocks[page, slot].copy_(source.pin_memory(), non_blocking=True)
        else:
            group.blocks[page, slot].copy_(source)
        return tier

    def _store(self, items: list[tuple[bytes, bytearray, tuple[int, ...] | None]]) -> None:
        try:
            missing = self.chain.missing_many([key for key, _, _ in items])
            into = [lacking if only is None else [t for t in lacking if t in only]
                    for lacking, (_, _, only) in zip(missing, items, strict=True)]
            self.chain.store_many([(key, buf) for key, buf, _ in items], into)
        except Exception as e:
            self._warn_once("store", e)
        finally:
            for key, _, _ in items:
                self._pending.pop(key, None)
            self.completions.put(StoreDone(tuple(key for key, _, _ in items)))

    def _warn_once(self, what: str, e: BaseException) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("KV offload %s failed: %s: %s (treated as a miss from now on)",
                           what, type(e).__name__, e)

    # ------------------------------------------------------------ lifetime
    def flush(self) -> None:
        """Wait until every queued load and store is done, the tiers' background writes
        included (a clean shutdown, benchmarks)."""
        self._jobs.join()
        self.chain.flush()

    def close(self) -> None:
        """Stop the thread once the loads and stores queued so far are done (the stop
        request sorts after them); a tier that hangs is not waited on past a minute."""
        self._closed = True
        self._finalizer()


_Jobs = queue.PriorityQueue[tuple[int, int, object]]


def _serve(jobs: _Jobs, worker_ref: weakref.ref[OffloadConnectorWorker]) -> None:
    while True:
        kind, _, job = jobs.get()
        try:
            if kind == _STOP:
                return
            worker = worker_ref()
            if worker is None:
                continue  # its engine is gone: nothing to load into, nobody to tell
            if kind == _LOAD:
                assert isinstance(job, LoadJob)
                worker._load(job)
            else:
                assert isinstance(job, list)
                worker._store(job)
            del worker
        finally:
            jobs.task_done()


def _stop(jobs: _Jobs, thread: threading.Thread, chain: TierChain) -> None:
    if thread.is_alive():
        jobs.put((_STOP, sys.maxsize, None))  # sorts after every job queued before it
        if thread is not threading.current_thread():
            thread.join(timeout=60)
    chain.close()  # the tiers' own writers: their queued stores, then their connections
