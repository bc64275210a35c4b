"""Remote tier: blocks in a Redis (or Valkey) server that several engine processes share.

    redis key   hybridkv:<layout fp hex>:<xxh3-128 hex of the store key>
    value       one entry (entry.py): header | layout fp | key | payload, checked on read

The namespace comes from the layout fingerprint (model, weights, hash seed, block layout), so
models and layouts never read each other's blocks; the full key inside the value guards the
hash. A value that fails the check (garbage, another key's entry, cut short) is a miss,
counted in `stats.rejected` and deleted. Values are parsed with struct only, never unpickled.

Every batch is one pipeline: one round trip for the exists / get of a whole request's blocks
and one per batch of stores. Every call has a timeout. Stores are asynchronous and bounded:

    put(items) --> queue (byte cap) --> writer thread --> SET [EX ttl] pipeline
                   full, or Redis down: the store is dropped and counted (dropped_stores);
                   the engine never waits on Redis to store

Faults (connection refused or reset, a timeout, a bad password) trip a breaker: the tier
answers "miss" at once, without the network, and the writer thread probes Redis with
exponential back-off (0.5 s doubling to 10 s) until it answers; then the tier is back by
itself. One warning when the tier goes down, one line when it comes back; every fault is
counted in `connection_errors`. Redis evicting under `maxmemory` is not a fault: a miss.

Thread-safe (`thread_safe = True`): the scheduler's lookups, the connector thread's loads and
stores and the writer thread share one connection pool; the tier chain calls it without its
lock, so a slow Redis never holds up a lookup in a local tier.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import xxhash

from hybridkv.connector.offload.entry import encode_header, open_entry
from hybridkv.connector.offload.store import Payload, StoreStats

logger = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss")
PASSWORD_ENV = "HYBRIDKV_KV_REMOTE_PASSWORD"  # used when the URL carries no password
SEED_KEY = b"hybridkv:block-hash-seed"
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 10.0
STABLE_S = 10.0  # up this long after a recovery: the back-off starts again from its minimum
WRITE_BATCH_BYTES = 32 << 20  # one SET pipeline carries at most this much (one large value
                              # goes alone)
T = TypeVar("T")


@dataclass(frozen=True)
class RemoteSpec:
    """Where the remote tier lives. The password is kept out of repr and `where`."""

    scheme: str
    host: str
    port: int
    db: int
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def where(self) -> str:
        """The URL without credentials: what logs and errors show."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/{self.db}"


def parse_remote_url(url: object, *, flag: str = "kv_remote",
                     environ: dict[str, str] | None = None) -> RemoteSpec:
    """`redis://[[user]:password@]host[:port][/db]` (or `rediss://` for TLS) -> RemoteSpec.
    Without a password in the URL, $HYBRIDKV_KV_REMOTE_PASSWORD is used when set. Errors
    never echo the URL (it may hold a password)."""
    usage = "write it as redis://HOST:PORT/DB (or rediss:// for TLS)"
    if not isinstance(url, str) or not url:
        raise ValueError(f"{flag} must be a URL string, {usage}; got {type(url).__name__}")
    try:
        parts = urlsplit(url)
        port = parts.port or 6379
    except ValueError as e:
        raise ValueError(f"{flag}: not a valid URL ({e}); {usage}") from None
    if parts.scheme not in SCHEMES:
        raise ValueError(f"{flag}: scheme {parts.scheme!r} is not supported; accepted: "
                         f"{', '.join(s + '://' for s in SCHEMES)}")
    if not parts.hostname:
        raise ValueError(f"{flag}: the URL names no host; {usage}")
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ValueError(f"{flag}: the database must be a number (redis://HOST:PORT/0), got "
                         f"{path!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"{flag}: the URL takes no query or fragment; {usage}")
    environ = dict(os.environ) if environ is None else environ
    password = unquote(parts.password) if parts.password else environ.get(PASSWORD_ENV) or None
    return RemoteSpec(parts.scheme, parts.hostname, port, int(path or 0),
                      unquote(parts.username) if parts.username else None, password)


def make_client(spec: RemoteSpec, timeout_s: float) -> Any:
    """A redis-py client over a pool of connections, with `timeout_s` on every connect and
    every reply and no retries of its own (the tier's breaker decides when to try again)."""
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:
        raise ValueError("kv_remote needs the redis client: pip install 'hybridkv[remote]'"
                         ) from None

    options: dict[str, Any] = dict(
        host=spec.host, port=spec.port, db=spec.db, username=spec.username,
        password=spec.password, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0), max_connections=16, client_name="hybridkv",
        # Blocks are 10 KiB - 1 MiB values: reading replies in 1 MiB chunks instead of 64 KiB
        # takes a 384 KiB block in one recv, not six (0.22 -> 0.37 GB/s on a loaded VM).
        socket_read_size=1 << 20)
    if spec.scheme == "rediss":
        options["ssl"] = True
    return redis.Redis(**options)


def _faults() -> tuple[type[BaseException], ...]:
    """What trips the breaker: the connection failed, timed out or was refused (a bad
    password is a ConnectionError subclass in redis-py)."""
    import redis

    return (redis.ConnectionError, redis.TimeoutError, OSError)


def shared_hash_seed(spec: RemoteSpec, proposed: str, *, timeout_s: float) -> str | None:
    """The block hash seed every process on this Redis uses: the one stored there, or
    `proposed` stored now if there is none (SET NX: two processes starting together agree).
    None if Redis does not answer."""
    import redis

    client = make_client(spec, timeout_s)
    try:
        client.set(SEED_KEY, proposed.encode(), nx=True)
        value = client.get(SEED_KEY)
    except _faults():
        return None
    except redis.ResponseError as e:
        refused = _refused_database(spec, e, timeout_s)
        if refused is None:
            raise
        raise refused from None
    finally:
        client.close()
    return value.decode() if value else None


def _refused_database(spec: RemoteSpec, e: Exception, timeout_s: float) -> ValueError | None:
    """The one-line error for a database number the server does not have (its SELECT, on
    every new connection, answers "DB index is out of range"); None for any other error."""
    if "DB index" not in str(e):
        return None
    count = _database_count(spec, timeout_s)
    accepted = (f"0 to {count - 1} on this server" if count is not None
                else "0 to the server's `databases` setting minus 1 (0-15 by default)")
    host = f"[{spec.host}]" if ":" in spec.host else spec.host
    return ValueError(f"kv_remote {spec.where}: the server has no database {spec.db} "
                      f"({e}); accepted: a database number from {accepted}, e.g. "
                      f"{spec.scheme}://{host}:{spec.port}/0")


def _database_count(spec: RemoteSpec, timeout_s: float) -> int | None:
    """The server's `databases` setting, asked on database 0; None if it will not say."""
    client = make_client(RemoteSpec(spec.scheme, spec.host, spec.port, 0, spec.username,
                                    spec.password), timeout_s)
    try:
        return int(client.config_get("databases")["databases"])
    except Exception:  # CONFIG renamed or refused (a managed Redis): the default is said
        return None
    finally:
        client.close()


# ---------------------------------------------------------------- the tier


class RedisTier:
    remote = True  # the chain's "is it on this machine" question: no
    thread_safe = True  # see the module docstring

    def __init__(self, spec: RemoteSpec, layout_fingerprint: bytes, *,
                 timeout_s: float = 1.0, ttl_s: int | None = None,
                 queue_bytes: int = 256 << 20, hash_seed: str | None = None) -> None:
        self.spec = spec
        self.layout_fingerprint = layout_fingerprint
        self.namespace = b"hybridkv:" + layout_fingerprint.hex().encode() + b":"
        self.ttl_s = ttl_s
        self.stats = StoreStats()
        self.on_removed: Callable[[bytes], None] | None = None  # KV events (store.py)
        self._link = _Link(spec, timeout_s, queue_bytes, self.stats, hash_seed)
        self._thread = threading.Thread(target=self._link.serve, daemon=True,
                                        name="hybridkv-kv-remote")
        self._link.probe(first=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._link.close, self._thread, 0.0)

    # -- keys and values -------------------------------------------------------------------

    def redis_key(self, key: bytes) -> bytes:
        return self.namespace + xxhash.xxh3_128_hexdigest(key).encode()

    def encode(self, key: bytes, payload: Payload) -> bytes:
        return b"".join((encode_header(self.layout_fingerprint, key, payload), payload))

    @property
    def connected(self) -> bool:
        return self._link.up

    # -- the store interface ----------------------------------------------------------------

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        names = [self.redis_key(k) for k in keys]
        out = [self._link.queued(n) is not None for n in names]
        ask = [i for i, found in enumerate(out) if not found]
        if ask:
            def run(pipe: Any) -> None:
                for i in ask:
                    pipe.exists(names[i])

            replies = self._link.pipeline(run)
            if replies is not None:
                for i, reply in zip(ask, replies, strict=True):
                    out[i] = reply is True or (isinstance(reply, int) and reply > 0)
        return out

    def get(self, keys: Sequence[bytes]) -> list[Payload | None]:
        names = [self.redis_key(k) for k in keys]
        values: list[Any] = [self._link.queued(n) for n in names]
        ask = [i for i, v in enumerate(values) if v is None]
        if ask:
            def run(pipe: Any) -> None:
                for i in ask:
                    if self.ttl_s is None:
                        pipe.get(names[i])
                    else:
                        pipe.getex(names[i], ex=self.ttl_s)  # a hit keeps the block longer

            replies = self._link.pipeline(run)
            for i, reply in zip(ask, replies or [None] * len(ask), strict=True):
                values[i] = reply if isinstance(reply, bytes) else None
        out: list[Payload | None] = []
        rejected = []
        hits = loaded = 0
        for key, name, value in zip(keys, names, values, strict=True):
            payload = None if value is None else open_entry(value, key, self.layout_fingerprint)
            if value is not None and payload is None:
                rejected.append(name)
                if self.on_removed is not None:
                    self.on_removed(key)
            elif payload is not None:
                hits += 1
                loaded += len(payload)
            out.append(payload)
        with self._link.cond:
            self.stats.lookups += len(keys)
            self.stats.hits += hits
            self.stats.bytes_loaded += loaded
            self.stats.rejected += len(rejected)
        if rejected:
            # Never served again; stored afresh by the next process that computes them.
            self._link.pipeline(lambda pipe: [pipe.unlink(n) for n in rejected])
        return out

    def put(self, items: Sequence[tuple[bytes, Payload]]) -> list[bool]:
        return [self._link.enqueue(self.redis_key(key), self.encode(key, value), len(value),
                                   self.ttl_s) for key, value in items]

    def delete(self, keys: Sequence[bytes]) -> None:
        names = [self.redis_key(k) for k in keys]
        self._link.unqueue(names)
        if names:
            self._link.pipeline(lambda pipe: [pipe.unlink(n) for n in names])
        if self.on_removed is not None:
            for key in keys:
                self.on_removed(key)

    # -- lifetime and tools -----------------------------------------------------------------

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every queued store is written (or dropped); False on timeout."""
        return self._link.wait_idle(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued (if Redis answers, within `timeout_s`), stop the thread,
        drop the connections."""
        self._finalizer.detach()
        self._link.close(self._thread, timeout_s)

    def clear(self) -> int:
        """Delete every block of this tier's namespace (benchmarks: a cold tier); returns how
        many. Other layouts' blocks are left alone."""
        self.flush()

        def scan() -> list[bytes]:
            return list(self._link.client.scan_iter(match=self.namespace + b"*", count=1000))

        names = self._link.call(scan) or []
        if names:
            self._link.pipeline(lambda pipe: [pipe.unlink(n) for n in names])
        return len(names)


class _Link:
    """The connection pool, its health (the breaker) and the store queue: what the tier and
    its writer thread share. The thread holds this, never the tier, so dropping the engine
    stops it."""

    def __init__(self, spec: RemoteSpec, timeout_s: float, queue_bytes: int,
                 stats: StoreStats, hash_seed: str | None) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self.client = make_client(spec, timeout_s)
        self.stats = stats
        self.hash_seed = hash_seed
        self.cond = threading.Condition()
        self.up = False
        self.retry_at = 0.0
        self.backoff = BACKOFF_MIN_S
        self.up_since = 0.0
        self.queue_bytes = queue_bytes
        # redis key -> (value, payload bytes, ttl); oldest first. A key put again while
        # queued replaces its value.
        self.queue: OrderedDict[bytes, tuple[bytes, int, int | None]] = OrderedDict()
        self.queued_bytes = 0
        # The batch being written: still served from here until Redis has it; a delete
        # meanwhile is repeated after the write lands.
        self.inflight: dict[bytes, bytes] = {}
        self.deleted_inflight: set[bytes] = set()
        self.writing = False
        self.closing = False
        self._warned: set[str] = set()

    # -- calls -------------------------------------------------------------------------------

    def call(self, fn: Callable[[], T]) -> T | None:
        """`fn()` unless the tier is down; None if it is or the call faults (counted)."""
        if not self.up:
            return None
        try:
            return fn()
        except _faults() as e:
            self.trip(e)
            return None

    def pipeline(self, build: Callable[[Any], object]) -> list[Any] | None:
        """One round trip: the commands `build` queues on a pipeline, their replies (an
        exception object in place of a command's failure), or None if the tier is down."""
        def run() -> list[Any]:
            with self.client.pipeline(transaction=False) as pipe:
                build(pipe)
                return list(pipe.execute(raise_on_error=False))

        replies = self.call(run)
        if replies is not None:
            for reply in replies:
                if isinstance(reply, Exception):
                    self._command_error(reply)
        return replies

    def _command_error(self, e: Exception) -> None:
        """A command refused: a miss or a dropped store, not a reason to stop using Redis.
        "OOM" (maxmemory reached and nothing left to evict: noeviction, or client buffers
        alone past it) is a full store, counted in `refused` by the write; anything else is
        an error."""
        from redis.exceptions import OutOfMemoryError

        if not isinstance(e, OutOfMemoryError):
            with self.cond:
                self.stats.errors += 1
        self._warn_once(f"command:{type(e).__name__}", "the remote KV tier at %s refused a "
                        "command: %s", self.spec.where, e)

    # -- health ------------------------------------------------------------------------------

    def trip(self, e: BaseException) -> None:
        with self.cond:
            self.stats.connection_errors += 1
            self.stats.errors += 1
            if not self.up:
                return
            self.up = False
            if time.monotonic() - self.up_since >= STABLE_S:
                self.backoff = BACKOFF_MIN_S
            self.retry_at = time.monotonic() + self.backoff
            dropped = len(self.queue)
            self.stats.dropped_stores += dropped
            self.queue.clear()
            self.queued_bytes = 0
            self.cond.notify_all()
        with contextlib.suppress(Exception):
            self.client.connection_pool.disconnect()  # every pooled connection is suspect
        logger.warning("remote KV tier at %s is unreachable (%s: %s): requests recompute "
                       "instead; retrying in the background with back-off from %.1f s",
                       self.spec.where, type(e).__name__, e, self.backoff)

    def probe(self, *, first: bool = False) -> bool:
        """PING; on an answer the tier is up (and the shared hash seed is put back if a
        restarted Redis lost it)."""
        import redis

        try:
            self.client.ping()
            self._publish_seed()
        except redis.ResponseError as e:
            refused = _refused_database(self.spec, e, self.timeout_s) if first else None
            if refused is None:
                raise
            raise refused from None
        except _faults() as e:  # (before any other RedisError: they subclass it)
            with self.cond:
                self.stats.connection_errors += 1
                self.stats.errors += 1
                self.retry_at = time.monotonic() + self.backoff
                self.backoff = min(self.backoff * 2, BACKOFF_MAX_S)
            with contextlib.suppress(Exception):
                self.client.connection_pool.disconnect()
            if first:
                logger.warning("remote KV tier at %s is unreachable at start (%s: %s): the "
                               "engine runs without it and retries in the background with "
                               "back-off", self.spec.where, type(e).__name__, e)
            return False
        with self.cond:
            self.up = True
            self.up_since = time.monotonic()
            self.cond.notify_all()
        if not first:
            logger.warning("remote KV tier at %s is back", self.spec.where)
        return True

    def _publish_seed(self) -> None:
        """Processes on one Redis hash blocks with the seed kept there; one whose seed came
        from there (or was proposed when it was down) writes it back if Redis lost it, so
        processes started later agree with it."""
        if self.hash_seed is None:
            return
        import redis

        try:
            self.client.set(SEED_KEY, self.hash_seed.encode(), nx=True)
            stored = self.client.get(SEED_KEY)
        except _faults():
            raise
        except redis.RedisError as e:  # e.g. a read-only replica: blocks still load
            self._warn_once("seed-write", "remote KV tier at %s: cannot check the shared "
                            "hash seed (%s)", self.spec.where, e)
            return
        if stored is not None and stored.decode() != self.hash_seed:
            self._seed_differs()

    def _seed_differs(self) -> None:
        self._warn_once("seed", "remote KV tier at %s: this process hashes blocks with "
                        "another seed than the one stored there (Redis was unreachable at its "
                        "start, or lost the seed while another process started), so it "
                        "shares no blocks with other processes; set block_hash_seed (or "
                        "$HYBRIDKV_BLOCK_HASH_SEED) on every replica to make them agree "
                        "whatever happens", self.spec.where)

    # -- the store queue ---------------------------------------------------------------------

    def queued(self, name: bytes) -> bytes | None:
        with self.cond:
            item = self.queue.get(name)
            return self.inflight.get(name) if item is None else item[0]

    def enqueue(self, name: bytes, value: bytes, payload_len: int, ttl: int | None) -> bool:
        with self.cond:
            old = self.queue.pop(name, None)
            if old is not None:
                self.queued_bytes -= len(old[0])
            if not self.up or self.closing or \
                    self.queued_bytes + len(value) > self.queue_bytes:
                self.stats.dropped_stores += 1
                return False
            self.queue[name] = (value, payload_len, ttl)
            self.queued_bytes += len(value)
            self.cond.notify_all()
        return True

    def unqueue(self, names: Sequence[bytes]) -> None:
        with self.cond:
            for name in names:
                old = self.queue.pop(name, None)
                if old is not None:
                    self.queued_bytes -= len(old[0])
                if self.inflight.pop(name, None) is not None:
                    self.deleted_inflight.add(name)

    def _take_batch(self) -> list[tuple[bytes, bytes, int, int | None]]:
        batch: list[tuple[bytes, bytes, int, int | None]] = []
        size = 0
        while self.queue and (not batch or size + len(next(iter(self.queue.values()))[0])
                              <= WRITE_BATCH_BYTES):
            name, (value, payload_len, ttl) = self.queue.popitem(last=False)
            self.queued_bytes -= len(value)
            size += len(value)
            batch.append((name, value, payload_len, ttl))
            self.inflight[name] = value
        return batch

    def _write(self, batch: list[tuple[bytes, bytes, int, int | None]]) -> None:
        seed = self.hash_seed

        def build(pipe: Any) -> None:
            if seed is not None:
                # A Redis restarted (or one that evicted the seed) between two of our calls
                # looks like any other: every batch of stores puts the seed back if it is
                # gone, for the processes that start later. Same round trip.
                pipe.set(SEED_KEY, seed.encode(), nx=True)
                pipe.get(SEED_KEY)
            for name, value, _, ttl in batch:
                pipe.set(name, value, ex=ttl)

        replies = self.pipeline(build)
        if replies is not None and seed is not None:
            stored, replies = replies[1], replies[2:]
            if isinstance(stored, bytes) and stored.decode() != seed:
                self._seed_differs()
        with self.cond:
            if replies is None:
                self.stats.dropped_stores += len(batch)
                return
            for (_, _, payload_len, _), reply in zip(batch, replies, strict=True):
                if isinstance(reply, Exception):
                    self.stats.refused += 1
                else:
                    self.stats.bytes_stored += payload_len

    # -- the writer thread -------------------------------------------------------------------

    def serve(self) -> None:
        """Write queued stores while Redis is up; probe it with back-off while it is down."""
        batch: list[tuple[bytes, bytes, int, int | None]]
        while True:
            with self.cond:
                while True:
                    if self.closing and (not self.queue or not self.up):
                        return
                    if self.up and self.queue:
                        batch = self._take_batch()
                        self.writing = True
                        break
                    if not self.up and time.monotonic() >= self.retry_at:
                        batch = []
                        break
                    wait = None if self.up else max(self.retry_at - time.monotonic(), 0.0)
                    self.cond.wait(timeout=wait)
            if batch:
                try:
                    self._write(batch)
                finally:
                    with self.cond:
                        self.inflight.clear()
                        deleted, self.deleted_inflight = list(self.deleted_inflight), set()
                    if deleted:
                        self._unlink(deleted)
                    with self.cond:
                        self.writing = False
                        self.cond.notify_all()
            else:
                self.probe()

    def _unlink(self, names: list[bytes]) -> None:
        self.pipeline(lambda pipe: [pipe.unlink(n) for n in names])

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.queue or self.writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(timeout=left)
        return True

    def close(self, thread: threading.Thread, timeout_s: float) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        if thread is not threading.current_thread():
            thread.join(timeout=timeout_s)
        with contextlib.suppress(Exception):
            self.client.close()

    def _warn_once(self, kind: str, message: str, *args: object) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message, *args)
