"""Block hashes: a chained, keyed content hash of full blocks.

hash(block i) = H(hash(block i-1) || token ids of block i || extra keys), with block -1's hash
(the root) derived from a seed. The chain makes a block's hash name its whole prefix, so two
requests share a block only if they share every token before it.

The seed is what keeps users apart: with a public root anyone who can send prompts could
compute, offline, the hash of another user's prefix and search for a block that collides
with it. So the seed is a per-process random value unless set; processes that must agree on
hashes (a shared cache tier, several engine processes) set the same secret seed, a long
random string or bytes (the fingerprint below lets anyone who sees it test guesses offline).

    algo    H          bits  cost per 16-token block (hash_cost_per_block; chain included)
    xxh3    xxh3-128   128   ~1.0 us: a secret root stops precomputed collisions, but xxh3
                             is not built to resist collision search on its own
    sha256  sha256     256   ~1.5 us: collision resistant; for a cache shared by mutually
                             untrusted users

A hasher's fingerprint is a short digest of (algorithm, seed): tiers put it in their layout
fingerprint so that processes hashing differently never match each other's blocks.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from collections.abc import Callable, Sequence

import xxhash

BlockHash = bytes

HASH_ALGOS = ("xxh3", "sha256")
_VERSION = b"hybridkv-block-hash-v2"


def _sha256_digest(data: bytes) -> BlockHash:
    return hashlib.sha256(data).digest()


def random_seed() -> bytes:
    """A fresh 32-byte random seed (each call differs)."""
    return os.urandom(32)


class BlockHasher:
    """Hashes blocks with one algorithm and one seed. Two hashers with equal (algorithm,
    seed) give equal hashes in any process."""

    __slots__ = ("algo", "root_hash", "fingerprint", "_digest")

    def __init__(self, seed: str | bytes, algo: str = "xxh3") -> None:
        if algo not in HASH_ALGOS:
            raise ValueError(f"unknown block hash algorithm {algo!r}; accepted: "
                             f"{', '.join(HASH_ALGOS)}")
        raw = seed.encode() if isinstance(seed, str) else bytes(seed)
        if not raw:
            raise ValueError("the block hash seed is empty; leave it unset for a random one")
        self.algo = algo
        # The key everything derives from; the seed itself is never stored.
        key = hashlib.sha256(_VERSION + b"\0" + algo.encode() + b"\0" + raw).digest()
        self.fingerprint = hashlib.sha256(b"fingerprint\0" + key).hexdigest()[:16]
        # The key enters through the root: every block's input starts with its parent's
        # hash, so no hash of any chain can be computed without it. (Passing it to xxh3 as
        # its seed as well costs 110 ns a block, +12%, for no hash anyone could compute.)
        self._digest: Callable[[bytes], BlockHash] = (
            xxhash.xxh3_128_digest if algo == "xxh3" else _sha256_digest)
        self.root_hash: BlockHash = self._digest(key + b"root")

    def hash_block(self, parent: BlockHash, token_ids: Sequence[int],
                   extra: bytes = b"") -> BlockHash:
        return self._digest(parent + struct.pack(f"<{len(token_ids)}I", *token_ids) + extra)

    def extend_block_hashes(self, block_hashes: list[BlockHash], token_ids: Sequence[int],
                            block_size: int, first_block_extra: bytes = b"") -> None:
        """Append the hashes of the full blocks of `token_ids` not hashed yet.

        `first_block_extra` (e.g. an encoded cache salt) enters the first block only; through
        the chain it reaches every later block.
        """
        start = len(block_hashes) * block_size
        parent = block_hashes[-1] if block_hashes else self.root_hash
        hash_block = self.hash_block
        while start + block_size <= len(token_ids):
            extra = first_block_extra if start == 0 else b""
            parent = hash_block(parent, token_ids[start:start + block_size], extra)
            block_hashes.append(parent)
            start += block_size

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockHasher) and other.fingerprint == self.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        return f"BlockHasher({self.algo}, fingerprint={self.fingerprint})"


_process_seed: bytes | None = None
_default_hashers: dict[str, BlockHasher] = {}


def make_block_hasher(seed: str | bytes | None = None, algo: str = "xxh3") -> BlockHasher:
    """The hasher for `seed`, or, with no seed, this process's own random one (the same
    object for every caller in the process, so requests and the manager agree)."""
    global _process_seed
    if seed is not None:
        return BlockHasher(seed, algo)
    hasher = _default_hashers.get(algo)
    if hasher is None:
        if _process_seed is None:
            _process_seed = random_seed()
        hasher = _default_hashers[algo] = BlockHasher(_process_seed, algo)
    return hasher


def hash_fingerprint(seed: str | bytes | None = None, algo: str = "xxh3") -> str:
    """16 hex digits naming (algorithm, seed); no seed: this process's random one."""
    return make_block_hasher(seed, algo).fingerprint


def encode_extra_keys(extra_keys: Sequence[object]) -> bytes:
    """Deterministic bytes for extra keys such as a cache salt or an adapter id."""
    parts = []
    for key in extra_keys:
        if isinstance(key, bytes):
            parts.append(b"b" + key)
        elif isinstance(key, str):
            parts.append(b"s" + key.encode())
        elif isinstance(key, int):
            parts.append(b"i" + str(key).encode())
        else:
            raise TypeError(f"extra hash keys must be bytes, str or int, got {type(key).__name__}")
    return b"\x00" + b"\x1f".join(parts) if parts else b""


def hash_cost_per_block(block_size: int = 16, num_blocks: int = 20_000,
                        repeat: int = 3) -> dict[str, float]:
    """Microseconds to hash one `block_size`-token block, per algorithm (best of `repeat`
    runs over a chain of `num_blocks` blocks). For `hybridkv bench kv` to print."""
    token_ids = [(i * 2654435761) % 32000 for i in range(block_size * num_blocks)]
    costs = {}
    for algo in HASH_ALGOS:
        hasher = BlockHasher(b"bench", algo)
        best = float("inf")
        for _ in range(repeat):
            hashes: list[BlockHash] = []
            start = time.perf_counter()
            hasher.extend_block_hashes(hashes, token_ids, block_size)
            best = min(best, time.perf_counter() - start)
        costs[algo] = best / num_blocks * 1e6
    return costs
