"""Which requests' prompts share a block-aligned prefix, by block hash.

When several requests with one long common prefix arrive together (a new system prompt,
N users at once), the first one prefills it and the others are admitted once it has (the
running requests take each step's token budget first). Attention groups then hit its
blocks, cached as they were computed; a state group (Mamba) hits only at a checkpoint,
and the first request's prompt end lies past where the others' prompts leave it. The
scheduler asks this index how far a waiting request's prompt matches a prompt being
prefilled (or, when a request is admitted, the other waiting prompts), and has the
prefilling request save a state checkpoint there.

A block hash covers its whole prefix, so a prompt that has block i's hash has every block
before it too: the longest match is found by bisection.
"""

from __future__ import annotations

from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.request import KVRequest


class SharedPrompts:
    """The full prompt blocks of the requests added (by hash), and who holds each."""

    def __init__(self) -> None:
        self._holders: dict[BlockHash, list[str]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self.version = 0  # changes whenever a request is added or removed

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._hashes

    def add(self, request: KVRequest) -> None:
        rid = request.request_id
        if rid in self._hashes:
            return
        full = request.num_prompt_tokens // request.hash_block_size
        hashes = request.block_hashes[:full]
        self._hashes[rid] = hashes
        self.version += 1
        for h in hashes:
            self._holders.setdefault(h, []).append(rid)

    def remove(self, request_id: str) -> None:
        if request_id not in self._hashes:
            return
        self.version += 1
        for h in self._hashes.pop(request_id):
            holders = self._holders[h]
            holders.remove(request_id)
            if not holders:
                del self._holders[h]

    def longest_match(self, request: KVRequest) -> int:
        """Tokens of the longest block-aligned prefix of `request`'s prompt that another
        added request's prompt has (0 if none). The last prompt token is left out: it is
        always computed, so nothing could spare it."""
        rid = request.request_id
        hashes = request.block_hashes
        lo, hi = 0, min((request.num_prompt_tokens - 1) // request.hash_block_size, len(hashes))
        while lo < hi:  # invariant: another prompt has the first lo blocks
            mid = (lo + hi + 1) // 2
            if any(r != rid for r in self._holders.get(hashes[mid - 1], ())):
                lo = mid
            else:
                hi = mid - 1
        return lo * request.hash_block_size

    def holders(self, request: KVRequest, num_tokens: int) -> list[str]:
        """The other added requests whose prompts have `request`'s first `num_tokens`
        (a whole number of blocks, > 0)."""
        block = request.block_hashes[num_tokens // request.hash_block_size - 1]
        return [r for r in self._holders.get(block, ()) if r != request.request_id]
