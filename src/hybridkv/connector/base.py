"""The KV connector API: a scheduler half and a worker half, and what passes between them.

    scheduler half (no torch)                        worker half (owns the arena)
    ---------------------------------------------    ---------------------------------------
    start_load(request, device_hit) -> waits?        register(canonical caches)
    take_finished_loads() -> request ids             before_forward(meta): copy out blocks
    request_admitted(request, hit) -> tokens/tier        evicted this step, start loads
    request_finished(request)                        after_forward(meta, ok): copy out
    build_meta() -> ConnectorMeta  ----------------->    blocks filled this step
                   <-------------- completions (a queue): loads and stores done

The scheduler half decides everything (which blocks, which keys); the worker half only copies
bytes between the arena and the tiers, on a background thread, and reports back. A request
whose prefix a tier holds waits (holding its blocks) until its loads completed, while the
others keep computing; a failed load is a shorter hit, recomputed, never wrong output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class BlockCopy:
    """One block moving between the arena and the tiers."""

    group_id: int
    block_id: int
    key: bytes  # the tiers' key (`make_key`)
    tiers: tuple[int, ...] | None = None  # the only tiers to write it to; None: every tier


@dataclass(frozen=True)
class LoadJob:
    job_id: int
    blocks: tuple[BlockCopy, ...]
    first_tier: tuple[int, ...]  # per block, the first tier that said it holds it


@dataclass
class ConnectorMeta:
    """What the worker half does in one step."""

    loads: list[LoadJob] = field(default_factory=list)
    # Blocks evicted from the device this step: copied out before the forward reuses them.
    store_before: list[BlockCopy] = field(default_factory=list)
    # Blocks filled this step: copied out after the forward has written them.
    store_after: list[BlockCopy] = field(default_factory=list)

    @property
    def has_work(self) -> bool:
        return bool(self.loads or self.store_before or self.store_after)


@dataclass(frozen=True)
class LoadDone:
    job_id: int
    tiers: tuple[int, ...]  # per block, the tier that served it (-1: failed)
    seconds: float


@dataclass(frozen=True)
class StoreDone:
    keys: tuple[bytes, ...]


class ConnectorWorker(Protocol):
    def before_forward(self, meta: ConnectorMeta) -> None: ...

    def after_forward(self, meta: ConnectorMeta, ok: bool) -> None: ...

    def close(self) -> None: ...
