"""Cross attention: KV of the encoder output, written once per request, never shared."""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.kv.block_pool import Block
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.managers.base import NEVER, SingleTypeManager
from hybridkv.kv.request import KVRequest
from hybridkv.kv.spec import cdiv


class CrossAttentionManager(SingleTypeManager):
    @classmethod
    def find_longest_cache_hit(cls, managers: Sequence[SingleTypeManager],
                               block_hashes: Sequence[BlockHash], max_length: int,
                               alignment: int) -> list[list[Block]]:
        # Decoder prefixes say nothing about the encoder input: no prefix caching.
        return [[] for _ in managers]

    def hit_needs(self, num_blocks: int) -> tuple[int, int] | None:
        return None if num_blocks else (0, 0)

    def num_blocks_to_allocate(self, request: KVRequest, num_tokens: int,
                               num_new_computed_blocks: int) -> int:
        if request.request_id in self.req_blocks:
            return 0
        return cdiv(request.num_encoder_tokens, self.block_size)

    def quiet_limits(self, request: KVRequest, num_computed_tokens: int) -> tuple[int, int, int]:
        if request.request_id not in self.req_blocks:
            return 0, 0, 0
        return NEVER, NEVER, NEVER

    def cache_blocks(self, request: KVRequest, num_tokens: int) -> None:
        return  # encoder KV is per request
