"""The view of a request that the KV cache manager needs.

The engine's request extends `KVRequest`; the manager reads only these fields and never
mutates them (the scheduler advances `num_computed_tokens`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hybridkv.kv.hashing import BlockHash, BlockHasher, encode_extra_keys, make_block_hasher


class KVRequest:
    """Token ids with their block hashes kept up to date as tokens are appended."""

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], *,
                 hash_block_size: int, cache_salt: str | None = None,
                 num_encoder_tokens: int = 0, block_hasher: BlockHasher | None = None) -> None:
        if hash_block_size < 1:
            raise ValueError(f"hash_block_size must be >= 1, got {hash_block_size}")
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_encoder_tokens = num_encoder_tokens
        self.hash_block_size = hash_block_size
        self._salt = encode_extra_keys([cache_salt]) if cache_salt else b""
        # Must be the KV cache manager's (`KVCacheManager.block_hasher`); None: this
        # process's default, which a manager built without a hash seed uses too.
        self.block_hasher = block_hasher or make_block_hasher()
        self.block_hashes: list[BlockHash] = []
        self.block_hasher.extend_block_hashes(self.block_hashes, self.token_ids,
                                              hash_block_size, self._salt)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_token_ids(self, token_ids: Iterable[int]) -> None:
        self.token_ids.extend(token_ids)
        if len(self.token_ids) >= (len(self.block_hashes) + 1) * self.hash_block_size:
            self.block_hasher.extend_block_hashes(self.block_hashes, self.token_ids,
                                                  self.hash_block_size, self._salt)

    def __repr__(self) -> str:
        return (f"KVRequest({self.request_id!r}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens})")
