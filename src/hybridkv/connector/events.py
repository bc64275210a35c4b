"""KV events in vLLM's wire format, for routers and indexers (llm-d, Dynamo, vllm-router).

A ZMQ PUB socket sends one multipart message per engine step that changed the caches:

    [topic, sequence number (8 bytes, big-endian), payload]
    payload = msgpack [ts, [event, ...], data_parallel_rank]          (vLLM's EventBatch)
    event   = msgpack map, tag first:
      {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | nil,
       "token_ids": [...], "block_size": n, "lora_id": nil, "medium": "GPU",
       "lora_name": nil, "group_idx": g, "kv_cache_spec_kind": "sliding_window",
       "kv_cache_spec_sliding_window": 512}        (the window only for sliding groups)
      {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": "GPU", "group_idx": g}
      {"type": "AllBlocksCleared"}

This is how vLLM's msgspec structs encode (`EventBatch` array-like, events tagged maps with
`omit_defaults`: required fields always present, optional ones only when set). A block hash
`h` is the low 64 bits of hybridkv's block hash as an unsigned integer (vLLM's default form);
docs/deployment.md says how an indexer computes it from token ids.

A ROUTER socket (the replay endpoint) answers `[identity, b"", start sequence (8 bytes BE)]`
with `[identity, b"", seq, payload]` for each buffered batch from `start` on, then
`[identity, b"", -1 (8 bytes BE, signed), b""]`.

Publishing never blocks the engine step: batches wait in a bounded queue for the publisher
thread; when it is full a batch is dropped and counted (its sequence number is skipped, so a
subscriber sees the gap).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.kv.events import SPEC_KINDS, AllBlocksCleared, BlocksStored, KVCacheEvent
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.plan import KVCacheConfig

logger = logging.getLogger(__name__)

DEFAULT_TOPIC = "kv-events"
DEFAULT_QUEUE = 10_000  # batches waiting for the publisher thread at most
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_TCP = re.compile(r"tcp://(?P<host>\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.:-]+):(?P<port>\d+)")


def check_endpoint(endpoint: object, flag: str = "kv_events_endpoint") -> str:
    """A ZMQ endpoint string (tcp://HOST:PORT, ipc://PATH, inproc://NAME), or ValueError
    with one line saying what is accepted."""
    if isinstance(endpoint, str):
        m = _TCP.fullmatch(endpoint)
        if m is not None and 0 < int(m["port"]) < 65536:
            return endpoint
        if re.fullmatch(r"(ipc|inproc)://\S+", endpoint):
            return endpoint
    raise ValueError(f"{flag} {endpoint!r} is not a ZMQ endpoint; accepted: tcp://HOST:PORT "
                     f"(tcp://*:PORT binds on every interface), ipc://PATH, inproc://NAME")


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host (`*`, `::`), ipc:// and inproc:// always bind. Another
    tcp://HOST:PORT binds where it can (a local address whose port is free: subscribers
    connect to it, the usual layout) and connects where it cannot (a subscriber bound it, as
    vLLM's publisher expects there, or HOST is another machine)."""
    return ("*" in endpoint or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


def offset_endpoint(endpoint: str, offset: int) -> str:
    """The endpoint of replica `offset`: the port plus the offset (vLLM's layout for its
    data-parallel ranks); ipc/inproc names get a `_dpN` suffix."""
    if offset == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + offset}"
    return f"{endpoint}_dp{offset}"


def external_hash(block_hash: BlockHash) -> int:
    """The hash a subscriber sees: the low 64 bits of the block hash, unsigned."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True)
class GroupInfo:
    kind: str  # vLLM's kv_cache_spec_kind
    sliding_window: int | None


def group_infos(config: KVCacheConfig) -> tuple[GroupInfo, ...]:
    out = []
    for g in config.groups:
        kind = g.spec.kind
        window = getattr(g.spec, "sliding_window", None) if kind == "sliding_window" else None
        out.append(GroupInfo(SPEC_KINDS.get(kind, kind), window))
    return tuple(out)


def event_to_wire(event: KVCacheEvent, groups: Sequence[GroupInfo]) -> dict[str, Any]:
    """One event as vLLM's struct encodes it (a tagged map)."""
    if isinstance(event, BlocksStored):
        info = groups[event.group_id]
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [external_hash(h) for h in event.block_hashes],
            "parent_block_hash": (external_hash(event.parent_hash)
                                  if event.parent_hash is not None else None),
            "token_ids": list(event.token_ids), "block_size": event.block_size,
            "lora_id": None, "medium": event.medium, "lora_name": None,
            "group_idx": event.group_id, "kv_cache_spec_kind": info.kind}
        if info.sliding_window is not None:
            out["kv_cache_spec_sliding_window"] = info.sliding_window
        return out
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    return {"type": "BlockRemoved",
            "block_hashes": [external_hash(h) for h in event.block_hashes],
            "medium": event.medium, "group_idx": event.group_id}


def encode_batch(ts: float, events: Sequence[KVCacheEvent], groups: Sequence[GroupInfo],
                 data_parallel_rank: int | None) -> bytes:
    import msgpack  # type: ignore[import-untyped]

    payload: bytes = msgpack.packb(
        [ts, [event_to_wire(e, groups) for e in events], data_parallel_rank])
    return payload


class KVEventPublisher:
    """A PUB socket (and optionally a replay ROUTER socket) fed by a thread from a bounded
    queue. `publish` is called by the engine each step and returns at once.

    `port_offset` moves the endpoints (replica i of `--data-parallel-size` binds PORT + i);
    `data_parallel_rank` is what the batches say, the rank among the engines behind one
    server's URL, which is 0 for every hybridkv server."""

    def __init__(self, endpoint: str, *, groups: Sequence[GroupInfo],
                 topic: str = DEFAULT_TOPIC, replay_endpoint: str | None = None,
                 port_offset: int = 0, data_parallel_rank: int = 0,
                 max_queue: int = DEFAULT_QUEUE, buffer_steps: int = 10_000,
                 hwm: int = 100_000) -> None:
        try:
            import zmq
        except ImportError as e:
            raise RuntimeError("KV events need pyzmq and msgpack: pip install "
                               "'hybridkv[events]'") from e
        self.endpoint = offset_endpoint(check_endpoint(endpoint), port_offset)
        self.replay_endpoint = (
            offset_endpoint(check_endpoint(replay_endpoint, "kv_events_replay_endpoint"),
                            port_offset) if replay_endpoint is not None else None)
        self.groups = tuple(groups)
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self.num_published = 0  # batches sent
        self.num_dropped = 0  # batches dropped because the queue was full
        self.num_dropped_events = 0
        self._queue: queue.Queue[tuple[int, float, list[KVCacheEvent]] | None] = \
            queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.max_queue, self.buffer_steps = max_queue, buffer_steps  # host memory's bounds
        self.next_seq = 0
        self._ctx: Any = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: Any = None
        try:
            if binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                try:
                    self._pub.bind(self.endpoint)
                except zmq.ZMQError:
                    self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            where = (self.endpoint if self._replay is None else self.replay_endpoint)
            raise ValueError(f"KV events: cannot {'bind' if binds(str(where)) else 'use'} "
                             f"{where}: {e}") from None
        self._running = True
        self._thread = threading.Thread(target=self._run, name="hybridkv-kv-events",
                                        daemon=True)
        self._thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one batch (one step's events); drop and count it if the queue is full."""
        if not events or not self._running:
            return
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            self.num_dropped_events += len(events)

    @property
    def num_queued(self) -> int:
        return self._queue.qsize()

    @property
    def num_buffered(self) -> int:
        """Steps of events kept for replay requests (at most `buffer_steps`)."""
        return len(self._buffer)

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if item is None:
                return
            seq, ts, events = item
            try:
                payload = encode_batch(ts, events, self.groups, self.data_parallel_rank)
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.num_published += 1
            except Exception:  # a bad batch must not stop the stream
                logger.exception("KV events: batch %d could not be sent", seq)

    def _serve_replay(self) -> None:
        replay = self._replay
        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("KV events: a replay request of %d frames ignored (expected "
                               "[identity, b'', start sequence])", len(frames))
                continue
            identity, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
            replay.send_multipart((identity, b"", END_SEQ, b""))

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for up to `timeout` seconds), then close the sockets."""
        if not self._running:
            return
        self._running = False
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=100)
        if self._replay is not None:
            self._replay.close(linger=0)
