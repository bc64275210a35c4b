"""KV cache events: what the caches announce about the blocks they can serve.

The block pool (medium "GPU": the engine's device cache, whatever the device) and the offload
tiers ("CPU", "STORAGE", "EXTERNAL") append these records to a list their owner drains; the
connector's `events.py` turns them into vLLM's wire format for routers and indexers.

Per group, an indexer that applies each group's hit rule (`SPEC_KINDS` names it) to the
hashes it was told are stored predicts the device hit exactly:

    stored   a block got its content hash: from now on it can serve a hit
    removed  a hashed block was evicted or dropped: it can serve no hit any more
    cleared  every block of the medium is gone (a prefix-cache reset)

A sliding-window group's blocks that leave a request's window stay cached (another request
whose hit ends within a window of them still uses them), so they are removed when evicted,
not when they leave the window; a state group stores only its checkpoints, never the live
state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.kv.hashing import BlockHash

MEDIUM_DEVICE = "GPU"  # vLLM's name for the engine's own cache
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "STORAGE"
MEDIUM_REMOTE = "EXTERNAL"  # a cache shared over the network (the Redis tier); SGLang's name

# hybridkv spec kind -> the `kv_cache_spec_kind` string events carry.
SPEC_KINDS = {"full": "full_attention", "sliding_window": "sliding_window",
              "chunked_local": "chunked_local_attention", "mamba": "mamba",
              "cross_attention": "cross_attention"}


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Consecutive blocks of one request in one group: block k's parent is block k-1, the
    first one's is `parent_hash` (None: it starts the sequence). `token_ids` holds
    `block_size` tokens per block. An offload tier's stores carry the hashes only (no
    tokens, no parent), as vLLM's offloading connector sends them."""

    group_id: int
    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str = MEDIUM_DEVICE


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    group_id: int
    block_hashes: tuple[BlockHash, ...]
    medium: str = MEDIUM_DEVICE


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    medium: str = MEDIUM_DEVICE


KVCacheEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


def stored_runs(group_id: int, indices: Sequence[int], group_hashes: Sequence[BlockHash],
                token_ids: Sequence[int], block_size: int,
                medium: str = MEDIUM_DEVICE) -> list[BlocksStored]:
    """One `BlocksStored` per run of consecutive block indices (a request's blocks k whose
    hash is `group_hashes[k]`). E.g. indices [2, 3, 5] -> runs [2, 3] (parent: block 1's
    hash) and [5] (parent: block 4's)."""
    out: list[BlocksStored] = []
    start = 0
    for end in range(1, len(indices) + 1):
        if end < len(indices) and indices[end] == indices[end - 1] + 1:
            continue
        first, last = indices[start], indices[end - 1]
        out.append(BlocksStored(
            group_id, tuple(group_hashes[first:last + 1]),
            group_hashes[first - 1] if first else None,
            tuple(token_ids[first * block_size:(last + 1) * block_size]), block_size, medium))
        start = end
    return out
