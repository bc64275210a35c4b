"""The common part of per-kind managers: one group's blocks for every request.

A request's block list has one entry per block of token positions, from position 0; blocks a
layer kind no longer needs (out of a sliding window, before the current chunk) are freed and
replaced by the group's null block, so an entry's index keeps its meaning:

    sliding window 32, block 16, 80 tokens computed:  [null, null, b7, b9, b4]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

from hybridkv.kv.block_pool import Block, BlockPool
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.plan import KVCacheGroup
from hybridkv.kv.request import KVRequest
from hybridkv.kv.spec import cdiv

NEVER = 1 << 62  # a token count no request reaches


class SingleTypeManager:
    """Hits, block counts, drops, allocation and caching for the layers of one group."""

    # True when every prefix of a valid hit is a valid hit (full attention): the coordinator
    # then computes the hit once and only trims it afterwards.
    hit_is_monotone: ClassVar[bool] = False

    def __init__(self, group: KVCacheGroup, pool: BlockPool, hash_block_size: int) -> None:
        if group.block_size % hash_block_size:
            raise ValueError(f"group block size {group.block_size} is not a multiple of the "
                             f"hash block size {hash_block_size}")
        self.group = group
        self.group_id = group.group_id
        self.spec = group.spec
        self.block_size = group.block_size
        self.pool = pool
        self.cached = pool.groups[group.group_id].cached
        self.null_block = pool.null_blocks[group.group_id]
        # A group block spans `stride` hash blocks; its hash is the last one's (the chain
        # makes it name the whole prefix).
        self.stride = group.block_size // hash_block_size
        self.req_blocks: dict[str, list[Block]] = {}
        self.num_cached: dict[str, int] = {}
        # Leading blocks already dropped (all null), so freeing can skip them.
        self.num_dropped: dict[str, int] = {}

    def hit_key(self) -> tuple[object, ...]:
        """Groups with equal keys answer hit lookups identically and share one lookup."""
        return (type(self), self.spec.group_key(), self.stride)

    def group_hashes(self, block_hashes: Sequence[BlockHash]) -> Sequence[BlockHash]:
        return block_hashes if self.stride == 1 else block_hashes[self.stride - 1::self.stride]

    def hit_bounds(self, block_hashes: Sequence[BlockHash], max_length: int, alignment: int
                   ) -> tuple[Sequence[BlockHash], int, int]:
        """This group's block hashes, the most blocks a hit may span, and the alignment in
        blocks: what every lookup starts from."""
        hashes = self.group_hashes(block_hashes)
        return (hashes, min(max_length // self.block_size, len(hashes)),
                alignment // self.block_size)

    @classmethod
    def find_longest_cache_hit(cls, managers: Sequence[SingleTypeManager],
                               block_hashes: Sequence[BlockHash], max_length: int,
                               alignment: int) -> list[list[Block]]:
        """The longest hit, in whole blocks, not beyond `max_length` tokens and ending on a
        multiple of `alignment` tokens, valid for every manager given (all of one spec).
        Returns each manager's blocks (null where the kind needs nothing)."""
        raise NotImplementedError

    def hit_needs(self, num_blocks: int) -> tuple[int, int] | None:
        """The blocks [start, end) a hit ending after block `num_blocks` must have cached (the
        rest of the hit is null blocks); None: this kind never hits. The same rule as
        `find_longest_cache_hit`, asked per end point by connectors that offer blocks of
        other tiers. Full attention: all of them."""
        return 0, num_blocks

    def _lookup(self, managers: Sequence[SingleTypeManager], block_hash: BlockHash
                ) -> list[Block] | None:
        found = []
        for m in managers:
            block = m.cached.get(block_hash)
            if block is None:
                return None
            found.append(block)
        return found

    # ---------------------------------------------------------------- allocation
    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no future token of this kind attends to."""
        return 0

    def drop_skipped_blocks(self, request: KVRequest, num_computed_tokens: int) -> None:
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        num_skipped = min(self.num_skipped_tokens(num_computed_tokens) // self.block_size,
                          len(blocks))
        null = self.null_block
        dropped = []
        # Walk back from the last skipped block; earlier ones were dropped by earlier calls.
        for i in range(num_skipped - 1, -1, -1):
            if blocks[i] is null:
                break
            dropped.append(blocks[i])
            blocks[i] = null
        if dropped:
            self.pool.free(self.group_id, dropped)
        self.num_dropped[request.request_id] = num_skipped

    def num_blocks_to_allocate(self, request: KVRequest, num_tokens: int,
                               num_new_computed_blocks: int) -> int:
        blocks = self.req_blocks.get(request.request_id)
        have = len(blocks) if blocks else 0
        return max(0, cdiv(num_tokens, self.block_size) - have - num_new_computed_blocks)

    def save_computed_blocks(self, request: KVRequest, blocks: list[Block]) -> None:
        """Adopt prefix-hit blocks (already touched) at the start of a new request."""
        rid = request.request_id
        assert rid not in self.req_blocks, f"request {rid} already holds blocks"
        self.req_blocks[rid] = list(blocks)
        self.num_cached[rid] = len(blocks)

    def allocate(self, request: KVRequest, new: list[Block]) -> list[Block]:
        """Add blocks just taken from the pool (as `num_blocks_to_allocate` asked) to the
        request; returns those the model runner writes into. Cannot fail."""
        if not new:
            return new
        blocks = self.req_blocks.get(request.request_id)
        if blocks is None:
            self.req_blocks[request.request_id] = list(new)
        else:
            blocks.extend(new)
        return new

    def cache_blocks(self, request: KVRequest, num_tokens: int) -> None:
        """Register the request's blocks that `num_tokens` computed tokens fill completely."""
        rid = request.request_id
        num_full = num_tokens // self.block_size
        start = self.num_cached.get(rid, 0)
        if num_full <= start:
            return
        self.pool.cache_run(self.group_id, self.req_blocks[rid], start, num_full,
                            request.block_hashes, self.stride, block_size=self.block_size,
                            token_ids=request.token_ids)
        self.num_cached[rid] = num_full

    def free(self, request: KVRequest) -> None:
        blocks = self.req_blocks.pop(request.request_id, None)
        self.num_cached.pop(request.request_id, None)
        num_dropped = self.num_dropped.pop(request.request_id, 0)
        if blocks:
            # Last block first: the tail of a prefix is evicted before its head.
            self.pool.free(self.group_id, reversed(blocks[num_dropped:]))

    def blocks_past(self, request_id: str, num_tokens: int) -> list[Block]:
        """The request's blocks holding any token at or after `num_tokens`."""
        return list(self.req_blocks.get(request_id, ())[num_tokens // self.block_size:])

    def quiet_limits(self, request: KVRequest, num_computed_tokens: int) -> tuple[int, int, int]:
        """Bounds under which a later call has nothing to do for this group:
        (most tokens the blocks cover, most tokens to cache without a new full block,
        most computed tokens before another block falls out of use). Exact where cheap,
        never too large."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return 0, 0, 0
        cached_limit = (self.num_cached.get(rid, 0) + 1) * self.block_size - 1
        return len(blocks) * self.block_size, cached_limit, self.next_drop(num_computed_tokens) - 1

    def next_drop(self, num_computed_tokens: int) -> int:
        """The fewest computed tokens at which `drop_skipped_blocks` could drop more."""
        return NEVER

    def note_lookup(self, request: KVRequest, matched_tokens: int) -> None:
        """A lookup found the request's tokens cached up to `matched_tokens` in some group
        (its branch point). State kinds save a checkpoint there."""

    @property
    def saves_branch_points(self) -> bool:
        """Whether this kind saves checkpoints at branch points (state kinds, when on)."""
        return False

    def want_checkpoint(self, request_id: str, position: int) -> None:
        """Another request's prompt leaves this one's at `position` (tokens): state kinds
        save a checkpoint there when this request computes past it."""

    def set_checkpoint_policy(self, *, interval: int, branch_points: bool, tail: int = 1,
                              remember_blocks: bool = False) -> None:
        """Turn state checkpoints on (the prefix cache is on): at the last `tail` block
        boundaries of prompts and outputs, every `interval` blocks too (0: never), and at
        branch points or not (state kinds only).
        `remember_blocks`: no full-attention group finds branch points, so the state groups
        keep the hashes of computed blocks to find them."""

    def take_checkpoints(self, request_id: str) -> list[tuple[int, Block]]:
        """State checkpoints (position, block) the last allocation asked the runner to
        write; only state kinds have any."""
        return []

    def holdings(self) -> Iterable[list[Block]]:
        """Every list of blocks this manager holds a reference on."""
        return self.req_blocks.values()

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]
