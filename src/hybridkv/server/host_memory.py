"""What a server holds in host memory outside the model and its KV arena, each with its cap:
the startup log names every holder, its limit and the flag that sets it, and /metrics shows
`hybridkv:host_cache_used` beside `hybridkv:host_cache_limit` (labels `holder`, `unit`), so
nothing grows with the number of requests or conversations without a stated bound (a server
that keeps prompts per process without one, as llama-server's prompt cache does, is what
users of long-lived servers run out of memory on).

The holders: the CPU and disk offload tiers (bytes), requests waiting to be scheduled, the
Responses API's stored responses, the KV events queue (batches), and q4 pages' key staging
(bytes, fixed at start). The device prefix cache lives in the KV arena, sized at start.
/metrics reads them through server/metrics.py's HostMemoryCollector.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridkv.kv.plan import format_bytes

# Requests queued at most (`--max-waiting`): each holds its prompt and body until scheduled.
DEFAULT_MAX_WAITING = 1024


@dataclass(frozen=True)
class HostHolder:
    name: str  # e.g. "kv_offload_cpu"
    unit: str  # "bytes", "requests", "responses", "batches"
    limit: int
    flag: str  # what sets the limit
    used: Callable[[], int]

    def describe(self) -> str:
        amount = format_bytes(self.limit) if self.unit == "bytes" else f"{self.limit} {self.unit}"
        return f"{self.name} <= {amount} ({self.flag})"


def host_holders(engine: Any, *, max_waiting: int, num_waiting: Callable[[], int],
                 responses: Any) -> list[HostHolder]:
    """The holders of a server over `engine` (an LLMEngine): its tiers, its waiting queue
    (`max_waiting`, and how many wait now), its Responses store, its KV events' queue and
    replay buffer, its q4 key staging."""
    holders: list[HostHolder] = []
    connector = getattr(engine, "connector", None)
    chain = getattr(connector, "chain", None)
    if chain is not None:
        for name, tier in zip(chain.names, chain.tiers, strict=True):
            capacity = getattr(tier, "capacity_bytes", None)
            if capacity is None or not hasattr(tier, "used_bytes"):
                continue  # a remote tier (Redis): its server holds the bytes and their bound
            holders.append(HostHolder(f"kv_offload_{name}", "bytes", int(capacity),
                                      f"--kv-offload-{name}", functools.partial(_used, tier)))
    holders.append(HostHolder("waiting_requests", "requests", max_waiting, "--max-waiting",
                              num_waiting))
    holders.append(HostHolder("stored_responses", "responses", int(responses.capacity),
                              "--max-stored-responses", lambda: len(responses)))
    events = getattr(engine, "kv_events", None)
    if events is not None:
        holders.append(HostHolder("kv_events_queue", "batches", int(events.max_queue),
                                  "--kv-events-queue",
                                  functools.partial(_count, events, "num_queued")))
        holders.append(HostHolder("kv_events_replay", "steps", int(events.buffer_steps),
                                  "fixed", functools.partial(_count, events, "num_buffered")))
    staging = getattr(getattr(engine, "runner", None), "key_staging", None) or {}
    staged = sum(t.numel() * t.element_size() for layers in staging.values()
                 for t in layers.values())
    if staged:
        holders.append(HostHolder("q4_key_staging", "bytes", staged,
                                  "--max-num-seqs x layers x 16 keys", lambda: staged))
    return holders


def _used(tier: Any) -> int:
    return int(tier.used_bytes)


def _count(owner: Any, name: str) -> int:
    return int(getattr(owner, name))


def describe(holders: list[HostHolder]) -> str:
    return "host memory outside the KV arena: " + "; ".join(h.describe() for h in holders)
