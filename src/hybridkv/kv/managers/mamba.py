"""Mamba / SSM / linear-attention state: one fixed-size state per request.

A request holds its live state block (plus speculative ones). A prefix hit needs a cached
state checkpoint taken exactly at the hit point; the hit's block list is then
`[null, ..., null, checkpoint]`, whose last entry the model runner copies into the live state.
The checkpoint is released once the request has computed past it.

Saving checkpoints needs the model runner to copy states, so `cache_blocks` registers
nothing yet: without saved checkpoints a state group allows only the empty hit.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.kv.block_pool import Block, BlockPool
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.managers.base import NEVER, SingleTypeManager
from hybridkv.kv.plan import KVCacheGroup
from hybridkv.kv.request import KVRequest
from hybridkv.kv.spec import MambaSpec


class MambaManager(SingleTypeManager):
    def __init__(self, group: KVCacheGroup, pool: BlockPool, hash_block_size: int) -> None:
        super().__init__(group, pool, hash_block_size)
        self.has_live_state: set[str] = set()

    @property
    def num_live_blocks(self) -> int:
        assert isinstance(self.spec, MambaSpec)
        return 1 + self.spec.num_speculative_blocks

    @classmethod
    def find_longest_cache_hit(cls, managers: Sequence[SingleTypeManager],
                               block_hashes: Sequence[BlockHash], max_length: int,
                               alignment: int) -> list[list[Block]]:
        first = managers[0]
        hashes, limit, align_blocks = first.hit_bounds(block_hashes, max_length, alignment)
        for end in range(limit // align_blocks * align_blocks, 0, -align_blocks):
            found = first._lookup(managers, hashes[end - 1])
            if found is not None:
                return [[m.null_block] * (end - 1) + [block]
                        for m, block in zip(managers, found, strict=True)]
        return [[] for _ in managers]

    def drop_skipped_blocks(self, request: KVRequest, num_computed_tokens: int) -> None:
        blocks = self.req_blocks.get(request.request_id)
        if not blocks or num_computed_tokens == 0:
            return
        # The checkpoint was copied into the live state in the step that consumed it.
        live = self.num_live_blocks
        null = self.null_block
        dropped = [b for b in blocks[:-live] if b is not null]
        if dropped:
            blocks[:-live] = [null] * (len(blocks) - live)
            self.pool.free(self.group_id, dropped)

    def num_blocks_to_allocate(self, request: KVRequest, num_tokens: int,
                               num_new_computed_blocks: int) -> int:
        # The live state is allocated once, after any hit blocks; it does not grow.
        return 0 if request.request_id in self.has_live_state else self.num_live_blocks

    def allocate(self, request: KVRequest, num_blocks: int) -> list[Block]:
        if num_blocks:
            self.has_live_state.add(request.request_id)
        return super().allocate(request, num_blocks)

    def free(self, request: KVRequest) -> None:
        self.has_live_state.discard(request.request_id)
        super().free(request)

    def quiet_limits(self, request: KVRequest, num_computed_tokens: int) -> tuple[int, int, int]:
        blocks = self.req_blocks.get(request.request_id)
        if request.request_id not in self.has_live_state or not blocks:
            return 0, 0, 0
        holds_checkpoint = any(b is not self.null_block for b in blocks[:-self.num_live_blocks])
        return NEVER, NEVER, 0 if holds_checkpoint else NEVER

    def cache_blocks(self, request: KVRequest, num_tokens: int) -> None:
        return  # checkpoints are saved by copy, not by registering the live state
