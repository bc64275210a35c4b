"""Which requests' prompts share a block-aligned prefix, by block hash.

When several requests with one long common prefix arrive together (a new system prompt,
N users at once), the prefix cache cannot help the ones admitted while the first is still
prefilling it: they would compute the same prefix again, side by side. The scheduler asks
this index how far a waiting request's prompt matches a prompt being prefilled, and holds
the waiting request until that prefix is computed (then it hits the cache). A state layer
(Mamba) can only hit at a checkpoint, so the prefilling request is asked to save one where
the other's prompt leaves the shared prefix.

A block hash covers its whole prefix, so a prompt that has block i's hash has every block
before it too: the longest match is found by bisection.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.request import KVRequest


class SharedPrompts:
    """The full prompt blocks of the requests added (by hash), and who holds each."""

    def __init__(self) -> None:
        self._holders: dict[BlockHash, list[str]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}

    def __len__(self) -> int:
        return len(self._hashes)

    def add(self, request: KVRequest) -> None:
        rid = request.request_id
        if rid in self._hashes:
            return
        full = request.num_prompt_tokens // request.hash_block_size
        hashes = request.block_hashes[:full]
        self._hashes[rid] = hashes
        for h in hashes:
            self._holders.setdefault(h, []).append(rid)

    def remove(self, request_id: str) -> None:
        for h in self._hashes.pop(request_id, ()):
            holders = self._holders[h]
            holders.remove(request_id)
            if not holders:
                del self._holders[h]

    def longest_match(self, request: KVRequest, accept: Callable[[str], bool]
                      ) -> tuple[int, list[str]]:
        """(tokens, holders): the longest block-aligned prefix of `request`'s prompt that
        the prompt of another request `accept` takes also has, and those requests
        ((0, []) where none does). The last prompt token is left out: it is always
        computed, so no wait could spare it."""
        rid = request.request_id
        full = (request.num_prompt_tokens - 1) // request.hash_block_size
        hashes = request.block_hashes

        def holders(n: int) -> list[str]:
            return [r for r in self._holders.get(hashes[n - 1], ()) if r != rid and accept(r)]

        lo, hi = 0, min(full, len(hashes))  # holders(lo) non-empty (or lo = 0)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if holders(mid):
                lo = mid
            else:
                hi = mid - 1
        return (lo * request.hash_block_size, holders(lo)) if lo else (0, [])
