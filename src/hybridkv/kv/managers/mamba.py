"""Mamba / SSM / linear-attention state: one fixed-size state per request.

A request holds its live state block (plus speculative ones). A prefix hit needs a state
checkpoint taken exactly at the hit point; the hit's block list is then
`[null, ..., null, checkpoint]`, whose last entry the model runner copies into the live
state. The checkpoint is released once the request has computed past it.

Checkpoints are saved at block-aligned positions: the last `checkpoint_tail` block
boundaries of the prompt (see `prompt_end_points`), the last `checkpoint_tail` block
boundaries its output has reached (older ones leave the cache as it decodes: the next turn
of a chat resends that output), the branch point (how far the request matched cached
blocks before its tokens diverged: the next request with that prefix hits there) and,
optionally, every `checkpoint_interval` blocks. A step whose tokens cross such a position
gets a block for it; the block is registered under the prefix hash at once (like attention
blocks, it is written in this very step) and held until the next step, so that nothing
reuses it before the model runner has written it.

Branch points come from the other groups' lookups (how far full-attention blocks matched).
A model with no full-attention group (pure Mamba; RecurrentGemma's sliding windows, whose
hits are bounded by the state's) has no such match: there the state groups remember the
hashes of the blocks recent requests computed (hashes only, `SEEN_CAPACITY` at most, least
recently seen forgotten first) and measure the match against those.

Speculative decoding: a step that scores drafts (it allocates beyond the request's known
tokens) takes one more block, a private checkpoint at the known tokens, never cached: the
model runner saves the state there and copies it back over the live state if a draft is
rejected. Like a checkpoint it is held until the next step. Where a cached checkpoint falls
at that very position, it serves instead. Checkpoints are thus always of known (accepted)
tokens.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import chain

from hybridkv.kv.block_pool import Block, BlockPool
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.managers.base import NEVER, SingleTypeManager
from hybridkv.kv.plan import KVCacheGroup
from hybridkv.kv.request import KVRequest
from hybridkv.kv.spec import MambaSpec

# Block hashes a state-only model remembers for branch points (~100 bytes each).
SEEN_CAPACITY = 1 << 16


class MambaManager(SingleTypeManager):
    def __init__(self, group: KVCacheGroup, pool: BlockPool, hash_block_size: int) -> None:
        super().__init__(group, pool, hash_block_size)
        self.has_live_state: set[str] = set()
        # No checkpoints until the prefix cache asks for them: without it nothing could hit
        # a checkpoint, so its block would be taken for nothing.
        self.save_checkpoints = False
        self.checkpoint_interval = 0  # in blocks; 0 = only prompt ends and branch points
        self.checkpoint_tail = 1  # block boundaries kept at a prompt's and an output's end
        self.checkpoint_branch_points = True
        self.branch_points: dict[str, int] = {}  # tokens matched before diverging
        # Where other requests' prompts leave this one's while it prefills (see
        # kv/shared_prompts.py): they hit a checkpoint there once admitted.
        self.shared_points: dict[str, set[int]] = {}
        # Hashes of blocks computed lately, when no other group tells where requests match
        # (None otherwise); per request, how many of its blocks are in there.
        self.seen: OrderedDict[BlockHash, None] | None = None
        self._seen_blocks: dict[str, int] = {}
        self._planned: dict[str, list[int]] = {}  # positions this allocation saves
        self._step_end: dict[str, int] = {}
        self._pending: dict[str, list[Block]] = {}  # checkpoint blocks being written
        assert isinstance(self.spec, MambaSpec)
        self.speculative = self.spec.num_drafting_blocks > 0
        self._drafting: set[str] = set()  # this allocation takes a private checkpoint
        self._handed_out: dict[str, list[tuple[int, Block]]] = {}
        # The latest `checkpoint_tail` of each decoding request's output, oldest first.
        self._output_checkpoints: dict[str, deque[Block]] = {}

    @property
    def num_live_blocks(self) -> int:
        assert isinstance(self.spec, MambaSpec)
        return 1 + self.spec.num_speculative_blocks

    def hit_needs(self, num_blocks: int) -> tuple[int, int] | None:
        return max(0, num_blocks - 1), num_blocks  # the checkpoint at the hit point

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
        # Last step's checkpoints are written now: release them to the cache.
        pending = self._pending.pop(request.request_id, None)
        if pending:
            self.pool.free(self.group_id, pending)
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

    def note_lookup(self, request: KVRequest, matched_tokens: int) -> None:
        if self.checkpoint_branch_points:
            if self.seen is not None:
                matched_tokens = max(matched_tokens, self._seen_prefix(request))
            self.branch_points[request.request_id] = matched_tokens

    @property
    def saves_branch_points(self) -> bool:
        return self.save_checkpoints and self.checkpoint_branch_points

    def want_checkpoint(self, request_id: str, position: int) -> None:
        if self.saves_branch_points:
            self.shared_points.setdefault(request_id, set()).add(position)

    def set_checkpoint_policy(self, *, interval: int, branch_points: bool, tail: int = 1,
                              remember_blocks: bool = False) -> None:
        self.save_checkpoints = True
        self.checkpoint_interval = interval
        self.checkpoint_tail = tail
        self.checkpoint_branch_points = branch_points
        self.seen = OrderedDict() if remember_blocks and branch_points else None

    def _seen_prefix(self, request: KVRequest) -> int:
        """Tokens of the request's longest block-aligned prefix seen before. A block hash
        covers its whole prefix, so the first unseen block ends the match."""
        assert self.seen is not None
        hashes, stride = request.block_hashes, self.stride
        n = 0
        while (n + 1) * stride <= len(hashes) and hashes[(n + 1) * stride - 1] in self.seen:
            n += 1
        return n * self.block_size

    def prompt_end_points(self, request: KVRequest) -> range:
        """The block boundaries in the prompt's last `checkpoint_tail` blocks' worth of
        tokens, its end included: a chat's next prompt parts from this one near its end.
        An edited last message parts where that message began; a resend with the answer's
        text after it can part at the prompt's last token (a word split at the prompt's end
        tokenizes differently joined to that text). With a tail of one block that is the
        prompt's end rounded down to a block, plus the boundary one block earlier for a
        prompt of whole blocks; an exact continuation resumes from the last one."""
        n, bs = request.num_prompt_tokens, self.block_size
        first = max(1, -(-(n - self.checkpoint_tail * bs) // bs))
        return range(first * bs, n // bs * bs + 1, bs)

    def _request_points(self, request: KVRequest) -> list[int]:
        """The positions this request saves wherever its steps cross them: its prompt's
        tail, its branch point and where waiting prompts leave it (block-aligned)."""
        bs = self.block_size
        return [*self.prompt_end_points(request),
                self.branch_points.get(request.request_id, 0) // bs * bs,
                *(p // bs * bs for p in self.shared_points.get(request.request_id, ()))]

    def checkpoint_positions(self, request: KVRequest, start: int, end: int) -> list[int]:
        """Block-aligned positions in (start, end] whose state this request should save
        (skipping prefixes already checkpointed)."""
        if not self.save_checkpoints:
            return []
        bs = self.block_size
        wanted = set(self._request_points(request))
        if self.checkpoint_interval:
            step = self.checkpoint_interval * bs
            wanted.update(range((start // step + 1) * step, end + 1, step))
        if start >= request.num_prompt_tokens and end // bs * bs > start:
            # The output's last block boundary, in steps of output alone (a resumed request
            # recomputing its prompt and output takes it at its next boundary), so that no
            # step crosses it and the prompt's end: the planner counts the blocks one step
            # can take (kv/spec.py).
            wanted.add(end // bs * bs)
        hashes = request.block_hashes
        return sorted(p for p in wanted if start < p <= end and p // bs <= len(hashes)
                      and hashes[p // bs * self.stride - 1] not in self.cached)

    def num_blocks_to_allocate(self, request: KVRequest, num_tokens: int,
                               num_new_computed_blocks: int) -> int:
        # The live state is allocated once, after any hit blocks; it does not grow. Steps
        # crossing a checkpoint position need one block per checkpoint.
        rid = request.request_id
        start = request.num_computed_tokens + num_new_computed_blocks * self.block_size
        end = min(num_tokens, request.num_tokens)
        planned = self._planned[rid] = self.checkpoint_positions(request, start, end)
        self._step_end[rid] = end
        live = 0 if rid in self.has_live_state else self.num_live_blocks
        # Drafts: the state at the known tokens is kept for the step (unless a checkpoint
        # there keeps it anyway).
        private = (self.speculative and num_tokens > request.num_tokens
                   and request.num_tokens not in planned)
        if private:
            self._drafting.add(rid)
        else:
            self._drafting.discard(rid)
        return live + len(planned) + private

    def allocate(self, request: KVRequest, new: list[Block]) -> list[Block]:
        rid = request.request_id
        positions = self._planned.pop(rid, [])
        private = new[-1:] if rid in self._drafting else []
        self._drafting.discard(rid)
        if not new:
            return []
        num_live = len(new) - len(positions) - len(private)
        live, checkpoints = new[:num_live], new[num_live:num_live + len(positions)]
        hashes, bs, stride = request.block_hashes, self.block_size, self.stride
        for position, block in zip(positions, checkpoints, strict=True):
            # A checkpoint spares recomputing its whole prefix. Announced (KV events) as the
            # group block ending at `position`: the only point a hit on it can end.
            index = position // bs - 1
            self.pool.cache(block, hashes[(index + 1) * stride - 1], value=position,
                            parent_hash=hashes[index * stride - 1] if index else None,
                            token_ids=request.token_ids[position - bs:position])
        if checkpoints:
            self._pending[rid] = checkpoints
            self._handed_out[rid] = list(zip(positions, checkpoints, strict=True))
            # A step of output alone whose last checkpoint is its end's block boundary:
            # the output's checkpoint (checkpoint_positions).
            if request.num_computed_tokens >= request.num_prompt_tokens and \
                    positions[-1] == self._step_end.get(rid, 0) // bs * bs:
                self._add_output_checkpoint(rid, checkpoints[-1])
        if private:
            self._pending.setdefault(rid, []).extend(private)
            self._handed_out.setdefault(rid, []).append((request.num_tokens, private[0]))
        if live:
            self.has_live_state.add(rid)
            self.req_blocks.setdefault(rid, []).extend(live)
        return live

    def _add_output_checkpoint(self, request_id: str, block: Block) -> None:
        """`block` is the request's newest output checkpoint. The next turn resends the
        output and resumes at the last of these its tokens still match; one older than the
        last `checkpoint_tail` spares less than they do, so it leaves the cache (unless a
        request is resuming from it: it then goes with the usual eviction)."""
        kept = self._output_checkpoints.setdefault(request_id, deque())
        if kept and kept[-1] is block:
            return
        kept.append(block)
        if len(kept) > self.checkpoint_tail:
            self.pool.evict_blocks(self.group_id, [kept.popleft()])

    def take_checkpoints(self, request_id: str) -> list[tuple[int, Block]]:
        return self._handed_out.pop(request_id, [])

    def holdings(self) -> Iterable[list[Block]]:
        return chain(self.req_blocks.values(), self._pending.values())

    def blocks_past(self, request_id: str, num_tokens: int) -> list[Block]:
        # Which checkpoints were written before a failed step is not tracked: all of the
        # request's state blocks go (a lost hit at worst, never a wrong state).
        return [*self.req_blocks.get(request_id, ()), *self._pending.get(request_id, ())]

    def free(self, request: KVRequest) -> None:
        rid = request.request_id
        self.has_live_state.discard(rid)
        self.branch_points.pop(rid, None)
        self.shared_points.pop(rid, None)
        self._seen_blocks.pop(rid, None)
        self._handed_out.pop(rid, None)
        self._planned.pop(rid, None)
        self._drafting.discard(rid)
        self._step_end.pop(rid, None)
        self._output_checkpoints.pop(rid, None)  # they stay cached: the next turn's hit
        pending = self._pending.pop(rid, None)
        if pending:
            self.pool.free(self.group_id, pending)
        super().free(request)

    def quiet_limits(self, request: KVRequest, num_computed_tokens: int) -> tuple[int, int, int]:
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if rid not in self.has_live_state or not blocks:
            return 0, 0, 0
        holds_checkpoint = any(b is not self.null_block for b in blocks[:-self.num_live_blocks])
        must_release = holds_checkpoint or rid in self._pending
        # The next position that may need a checkpoint block bounds the quiet steps.
        upcoming = self._next_checkpoint(request, self._step_end.get(rid, num_computed_tokens))
        return NEVER, upcoming - 1, num_computed_tokens if must_release else NEVER

    def _next_checkpoint(self, request: KVRequest, after: int) -> int:
        """The first candidate position beyond `after` (NEVER if none)."""
        if not self.save_checkpoints:
            return NEVER
        bs = self.block_size
        candidates = self._request_points(request)
        if self.checkpoint_interval:
            step = self.checkpoint_interval * bs
            candidates.append((after // step + 1) * step)
        # The output's next block boundary.
        if after >= request.num_prompt_tokens:
            candidates.append((after // bs + 1) * bs)
        return min((p for p in candidates if p > after), default=NEVER)

    def cache_blocks(self, request: KVRequest, num_tokens: int) -> None:
        # Checkpoints are saved by copy, not by registering the live state; only a model
        # without attention remembers which blocks were computed (for branch points).
        if self.seen is None:
            return
        rid, hashes, stride = request.request_id, request.block_hashes, self.stride
        done = self._seen_blocks.get(rid, 0)
        upto = min(num_tokens // self.block_size, len(hashes) // stride)
        for n in range(done + 1, upto + 1):
            self.seen[hashes[n * stride - 1]] = None
            self.seen.move_to_end(hashes[n * stride - 1])
        self._seen_blocks[rid] = max(done, upto)
        while len(self.seen) > SEEN_CAPACITY:
            self.seen.popitem(last=False)
