"""The engine behind the server: one thread owns the `LLMEngine`, the event loop talks to it.

    event loop                              engine thread (the only caller of the engine)
    ----------                              ---------------------------------------------
    await add(rid, ids, params) --cmd-->    engine.add_request (ValueError -> the future)
    async for out in stream     <--batch--  engine.step() outputs, one call_soon_threadsafe
    abort(rid)                  --cmd-->    engine.abort_request (frees its blocks)

The thread steps while work exists and otherwise sleeps on its command queue; after a step
that ended a request it holds the next one briefly for that client's next request
(follow_up.py). If the engine
itself raises, the server turns unhealthy: every stream ends with `EngineDeadError` and new
requests are refused, so no client waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridkv.engine.engine import LLMEngine
from hybridkv.engine.outputs import RequestOutput
from hybridkv.sched.sampling import SamplingParams
from hybridkv.server.follow_up import FollowUpWait

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (it failed, or the server is shutting down)."""


class QueueFullError(RuntimeError):
    """More requests waiting than `max_waiting`: try again later."""


@dataclass
class EngineSnapshot:
    """What /metrics shows of the engine, copied by the engine thread after each step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    kv_usage_per_group: list[float] = field(default_factory=list)
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    hit_tokens_per_group: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    follow_up_holds: int = 0  # steps held for a client's next request (follow_up.py)
    follow_up_hits: int = 0  # ... that a request arrived within
    offload: dict[str, Any] | None = None  # LLMEngine.offload_stats(), with tiers


class RequestStream:
    """One request's outputs, in order, on the event loop; ends after a finished output."""

    def __init__(self, request_id: str, num_prompt_tokens: int, n: int = 1) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.n = n  # samples: the stream ends after n finished outputs (`index` 0..n-1)
        self.arrival = time.monotonic()
        self.finished = False  # the consumer has read the last output
        self.ended = False  # the last output (or a failure) was delivered, or it was aborted
        self._delivered = 0  # finished outputs put, and read
        self._read = 0
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self.ended = True
        elif item.finished:
            self._delivered += 1
            self.ended = self._delivered == self.n
        self._queue.put_nowait(item)

    @property
    def has_more(self) -> bool:
        """Whether the next output is already here (a reader may batch its writes)."""
        return not self._queue.empty()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.finished:
                self._read += 1
                self.finished = self._read == self.n
            yield item


# Observers the server hangs on the stream of outputs (metrics), called on the event loop.
OutputObserver = Callable[[RequestStream, RequestOutput], None]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, max_waiting: int | None = None,
                 on_output: OutputObserver | None = None,
                 on_scheduled: Callable[[float], None] | None = None,
                 follow_up: FollowUpWait | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.follow_up = follow_up if follow_up is not None else FollowUpWait()
        self.snapshot = EngineSnapshot()
        self.error: BaseException | None = None
        self._on_output = on_output
        self._on_scheduled = on_scheduled
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._num_pending_adds = 0  # sent to the thread, not yet in the scheduler
        self._unscheduled: dict[str, float] = {}  # engine thread: rid -> arrival
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._take_snapshot()

    # ------------------------------------------------------------ event loop side
    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="hybridkv-engine", daemon=True)
        self._thread.start()

    async def add(self, request_id: str, token_ids: Sequence[int], params: SamplingParams,
                  part_points: Sequence[int] = ()) -> RequestStream:
        """Queue a request; a bad one raises the engine's ValueError, a full queue
        QueueFullError, a dead engine EngineDeadError."""
        if not self.alive:
            raise EngineDeadError(self.dead_reason())
        if self.max_waiting is not None and \
                self.snapshot.num_waiting + self._num_pending_adds >= self.max_waiting:
            raise QueueFullError(f"{self.max_waiting} requests are already waiting")
        assert self._loop is not None
        stream = RequestStream(request_id, len(token_ids), params.n)
        done: asyncio.Future[None] = self._loop.create_future()
        self._streams[request_id] = stream
        self._num_pending_adds += 1
        self._commands.put(("add", request_id, list(token_ids), params, tuple(part_points),
                            done))
        try:
            await done
        except asyncio.CancelledError:  # the client left; the thread may still add it
            self.abort(request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finally:
            self._num_pending_adds -= 1
        return stream

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps; its result (or error)."""
        if not self.alive:
            raise EngineDeadError(self.dead_reason())
        assert self._loop is not None
        done: asyncio.Future[Any] = self._loop.create_future()
        self._commands.put(("call", fn, done))
        return await done

    def abort(self, request_id: str) -> None:
        """Drop a request (a client went away); its blocks are freed by the next command
        the thread reads, before its next step."""
        self._streams.pop(request_id, None)
        self._commands.put(("abort", request_id))

    def end_all(self, reason: str) -> None:
        """End every request now (the shutdown timeout passed): each stream gets
        `EngineDeadError(reason)`, which its response turns into a last error event; the
        engine frees their blocks."""
        for rid in list(self._streams):
            self._commands.put(("abort", rid))
        self._fail_all(EngineDeadError(reason))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_all(EngineDeadError("the server is shutting down"))
        self.engine.close()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if self._on_output is not None:
                self._on_output(stream, out)
            stream.put(out)
            if stream.ended:
                del self._streams[out.request_id]

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(error)

    def dead_reason(self) -> str:
        if self.error is not None:
            return f"the engine failed: {type(self.error).__name__}: {self.error}"
        return "the engine is not running"

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._read_commands(block=not self.engine.has_unfinished)
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished:
                    outputs = self.engine.step()
                    self._note_scheduled()
                    self._take_snapshot()
                    if outputs:
                        self._call_soon(self._deliver, outputs)
                        if self.engine.has_unfinished and any(o.finished for o in outputs):
                            self._hold_for_follow_up()
                else:
                    self._take_snapshot()
        except BaseException as e:  # the engine itself broke: no request can go on
            logger.exception("the engine loop failed; the server is now unhealthy")
            self.error = e
            self._call_soon(self._fail_all, EngineDeadError(self.dead_reason()))

    def _hold_for_follow_up(self) -> None:
        """Wait up to the follow-up timeout for a command (the client whose answer just
        ended coming back), so that a request arriving then joins the next step."""
        timeout = self.follow_up.timeout()
        if timeout is None:
            return
        try:
            command = self._commands.get(timeout=timeout)
        except queue.Empty:
            self.follow_up.record(False)
            return
        self.follow_up.record(command[0] == "add")
        self._apply(command)  # the rest are read before the next step

    def _read_commands(self, *, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple[Any, ...]) -> None:
        kind = command[0]
        if kind == "add":
            _, rid, token_ids, params, part_points, done = command
            try:
                self.engine.add_request(rid, token_ids, params, part_points=part_points)
            except ValueError as e:
                self._call_soon(_settle, done, e)
                return
            self._unscheduled[rid] = time.monotonic()
            self.snapshot.num_waiting += 1  # until the next snapshot: back-pressure sees it
            self._call_soon(_settle, done, None)
        elif kind == "call":
            _, fn, done = command
            try:
                result = fn(self.engine)
            except Exception as e:
                self._call_soon(_settle, done, e)
            else:
                self._call_soon(_settle_value, done, result)
        elif kind == "abort":
            self._unscheduled.pop(command[1], None)
            self.engine.abort_request(command[1])

    def _note_scheduled(self) -> None:
        if not self._unscheduled:
            return
        scheduler = self.engine.scheduler
        running = {r.request_id for r in scheduler.running}
        now = time.monotonic()
        for rid, arrival in list(self._unscheduled.items()):
            if rid in running or rid not in scheduler.requests:
                del self._unscheduled[rid]
                if self._on_scheduled is not None:
                    self._on_scheduled(now - arrival)

    def _take_snapshot(self) -> None:
        scheduler, kv = self.engine.scheduler, self.engine.kv_manager
        self.snapshot = EngineSnapshot(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + len(scheduler.loading),
            kv_usage=kv.usage, kv_usage_per_group=kv.usage_per_group(),
            prefix_queried_tokens=kv.stats.num_queried_tokens,
            prefix_hit_tokens=kv.stats.num_hit_tokens,
            hit_tokens_per_group=list(kv.stats.hit_tokens_per_group),
            num_preemptions=scheduler.num_preemptions,
            follow_up_holds=self.follow_up.holds, follow_up_hits=self.follow_up.hits,
            offload=self.engine.offload_stats())

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(fn, *args)


def _settle(done: asyncio.Future[None], error: BaseException | None) -> None:
    if done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)


def _settle_value(done: asyncio.Future[Any], value: Any) -> None:
    if not done.done():
        done.set_result(value)
