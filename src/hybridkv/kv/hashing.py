"""Block hashes: a chained content hash of full blocks, stable across processes.

hash(block i) = H(hash(block i-1) || token ids of block i || extra keys), with block -1's hash
a fixed seed. The chain makes a block's hash name its whole prefix, so two requests share a
block only if they share every token before it. H is xxh3-128: measured on this machine class
at 0.8 us per 16-token block against 2.0 us for sha256 (`hashlib`); 128 bits keep accidental
collisions out of reach for any cache size we will see.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

BlockHash = bytes

# The parent of the first block; changing it invalidates every stored hash.
ROOT_HASH: BlockHash = xxhash.xxh3_128_digest(b"hybridkv-block-hash-v1")


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


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    return xxhash.xxh3_128_digest(
        parent + struct.pack(f"<{len(token_ids)}I", *token_ids) + extra)


def extend_block_hashes(block_hashes: list[BlockHash], token_ids: Sequence[int],
                        block_size: int, first_block_extra: bytes = b"") -> None:
    """Append the hashes of the full blocks of `token_ids` not hashed yet.

    `first_block_extra` (e.g. an encoded cache salt) enters the first block only; through the
    chain it reaches every later block.
    """
    start = len(block_hashes) * block_size
    parent = block_hashes[-1] if block_hashes else ROOT_HASH
    while start + block_size <= len(token_ids):
        extra = first_block_extra if start == 0 else b""
        parent = hash_block(parent, token_ids[start:start + block_size], extra)
        block_hashes.append(parent)
        start += block_size
