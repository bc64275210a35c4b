"""Property-based tests: random workloads against a brute-force oracle.

The oracle knows every request's tokens and recomputes from scratch what the manager must
guarantee: after every step the pool's books add up; a hit's blocks hold exactly the request's
tokens; the hybrid hit is valid for every group and no longer valid hit exists; blocks a layer
kind still needs are never dropped; nothing leaks once everything is freed.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hybridkv.kv.block_pool import BlockPool
from hybridkv.kv.manager import KVCacheManager
from hybridkv.kv.plan import KVCacheConfig, KVCacheGroup
from hybridkv.kv.request import KVRequest
from hybridkv.kv.spec import (
    ChunkedLocalAttentionSpec,
    CompressedAttentionSpec,
    CompressorStateSpec,
    FullAttentionSpec,
    IndexerKeySpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)

BS = 4
ATTN = dict(block_size=BS, num_kv_heads=1, head_size=1, dtype="fp32")
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
            [1, 2, 3, 4, 5, 6, 7, 8, 30, 31, 32, 33, 34, 35],
            [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60]]

specs_st = st.lists(
    st.one_of(
        st.just(FullAttentionSpec(**ATTN)),
        st.sampled_from([2, 5, 8, 13]).map(
            lambda w: SlidingWindowSpec(sliding_window=w, **ATTN)),
        # Chunks that are and are not multiples of the block size (Llama 4's 8192 on
        # blocks of 16 and, say, 20 on 16: a boundary inside a block).
        st.sampled_from([4, 6, 8, 10, 12]).map(
            lambda c: ChunkedLocalAttentionSpec(attention_chunk_size=c, **ATTN)),
        st.just(MambaSpec(block_size=BS, shapes=((8,),), dtypes=("fp32",))),
        st.sampled_from([1, 2, 4]).map(
            lambda rate: IndexerKeySpec(block_size=BS, head_size=1, compress_rate=rate)),
        # DeepSeek-V4's kinds: entries per 1, 2 or 4 tokens, and compressor states with
        # (CSA) and without (HCA) overlapping windows.
        st.sampled_from([1, 2, 4]).map(
            lambda rate: CompressedAttentionSpec(block_size=BS, head_size=1,
                                                 compress_rate=rate, dtype="fp32")),
        st.tuples(st.sampled_from([1, 2, 4]), st.booleans()).map(
            lambda r: CompressorStateSpec(block_size=BS, shapes=((8,),), dtypes=("fp32",),
                                          compress_rate=r[0], overlap=r[1])),
    ),
    min_size=1, max_size=4,
).filter(lambda specs: len({s.group_key() for s in specs}) == len(specs))


def valid_hit(spec: KVCacheSpec, cached: list[bool], end: int) -> bool:
    """Brute force: may a request reuse its first `end` blocks in a group of this spec?"""
    if isinstance(spec, (FullAttentionSpec, IndexerKeySpec, CompressedAttentionSpec)):
        return all(cached[:end])
    if isinstance(spec, CompressorStateSpec):
        # Recompute from `end` needs the last closed window's first halves where windows
        # overlap (the state at end), and nothing where they do not: the buffer is empty
        # at a window boundary, and every block boundary is one.
        assert (end * BS) % spec.compress_rate == 0
        if not spec.overlap:
            return True
        return end == 0 or cached[end - 1]
    if isinstance(spec, SlidingWindowSpec):
        needed = cdiv(spec.sliding_window - 1, BS)
        return all(cached[max(0, end - needed):end])
    if isinstance(spec, ChunkedLocalAttentionSpec):
        start = end * BS // spec.attention_chunk_size * spec.attention_chunk_size // BS
        return all(cached[start:end])
    if isinstance(spec, MambaSpec):
        return end == 0 or cached[end - 1]
    raise AssertionError(spec)


def first_needed_block(spec: KVCacheSpec, num_computed: int) -> int:
    """The first block the next token (at position num_computed) can attend to."""
    if isinstance(spec, SlidingWindowSpec):
        return max(0, num_computed - spec.sliding_window + 1) // BS
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return num_computed // spec.attention_chunk_size * spec.attention_chunk_size // BS
    return 0


class ManagerMachine(RuleBasedStateMachine):
    # Rules run and machines built, over the whole session (the long profile reports them).
    num_steps = 0
    num_runs = 0

    @initialize(specs=specs_st, num_pages=st.integers(6, 40),
                blocks_per_page=st.integers(1, 3), caching=st.booleans(),
                eviction=st.sampled_from(["value", "lru"]))
    def setup(self, specs, num_pages, blocks_per_page, caching, eviction):
        ManagerMachine.num_runs += 1
        groups = tuple(KVCacheGroup(i, s, (f"l{i}",), (32,), blocks_per_page)
                       for i, s in enumerate(specs))
        self.config = KVCacheConfig(groups, 32 * blocks_per_page, num_pages)
        self.manager = KVCacheManager(self.config, max_model_len=64, enable_caching=caching,
                                      eviction=eviction)
        self.caching = caching
        self.requests: dict[str, KVRequest] = {}
        self.prompt_done: dict[str, bool] = {}
        self.prefix_of: dict[bytes, tuple[int, ...]] = {}
        self.next_id = 0

    def _remember_hashes(self, req: KVRequest) -> None:
        for i, h in enumerate(req.block_hashes):
            prefix = tuple(req.token_ids[:(i + 1) * BS])
            assert self.prefix_of.setdefault(h, prefix) == prefix, "hash collision"

    def _oracle_hit(self, req: KVRequest) -> int:
        """The longest hit, in tokens, that every group allows."""
        if not self.caching:
            return 0
        max_blocks = (req.num_tokens - 1) // BS
        cached = [[h in gs.cached for h in req.block_hashes[:max_blocks]]
                  for gs in self.manager.pool.groups]
        for end in range(max_blocks, -1, -1):
            if all(valid_hit(g.spec, cached[g.group_id], end) for g in self.config.groups):
                return end * BS
        raise AssertionError("the empty hit is always valid")

    @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(1, 20),
          suffix=st.lists(st.integers(100, 104), max_size=10),
          chunk=st.integers(1, 40))
    def add_request(self, prefix, cut, suffix, chunk):
        ManagerMachine.num_steps += 1
        tokens = prefix[:cut] + suffix
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = KVRequest(rid, tokens, hash_block_size=BS)
        self._remember_hashes(req)
        hit = self.manager.get_computed_blocks(req)
        assert hit.num_computed_tokens == self._oracle_hit(req)
        for g, blocks in enumerate(hit.blocks.blocks):
            assert len(blocks) == hit.num_computed_tokens // BS
            for i, block in enumerate(blocks):
                if block.block_id:
                    assert block.group_id == g
                    assert self.prefix_of[block.block_hash] == tuple(tokens[:(i + 1) * BS])
        num_new = min(chunk, req.num_tokens - hit.num_computed_tokens)
        before = self.manager.get_block_ids(rid)
        new = self.manager.allocate_slots(req, num_new, hit.num_computed_tokens, hit.blocks)
        if new is None:
            assert self.manager.get_block_ids(rid) == before
            return
        req.num_computed_tokens = hit.num_computed_tokens + num_new
        self.requests[rid] = req
        self.prompt_done[rid] = req.num_computed_tokens == req.num_tokens

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), token=st.integers(100, 104), chunk=st.integers(1, 12))
    def step(self, data, token, chunk):
        ManagerMachine.num_steps += 1
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        req = self.requests[rid]
        if self.prompt_done[rid]:
            if req.num_tokens >= 60:
                return
            req.append_token_ids([token])
            self._remember_hashes(req)
            num_new = 1
        else:
            num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        if self.manager.allocate_slots(req, num_new) is None:
            # Recompute preemption, as the scheduler does.
            self.manager.free(req)
            del self.requests[rid]
            return
        req.num_computed_tokens += num_new
        self.prompt_done[rid] = req.num_computed_tokens == req.num_tokens

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data):
        ManagerMachine.num_steps += 1
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        self.manager.free(self.requests.pop(rid))

    @rule()
    def reset_cache(self):
        ManagerMachine.num_steps += 1
        assert self.manager.reset_prefix_cache() == (not self.requests)

    @invariant()
    def books_add_up(self):
        self.manager.check_integrity()

    @invariant()
    def needed_blocks_are_held(self):
        for rid, req in self.requests.items():
            for m, block_ids in zip(self.manager.managers, self.manager.get_block_ids(rid),
                                    strict=True):
                if isinstance(m.spec, MambaSpec):
                    assert block_ids[-1] != 0, "live state missing"
                    continue
                assert len(block_ids) >= cdiv(req.num_computed_tokens, BS)
                first = first_needed_block(m.spec, req.num_computed_tokens)
                assert all(block_ids[first:cdiv(req.num_computed_tokens, BS)]), \
                    f"{m.spec.kind} dropped a block it still needs"

    def teardown(self):
        if not hasattr(self, "manager"):
            return
        for req in self.requests.values():
            self.manager.free(req)
        assert all(gs.num_used == 0 for gs in self.manager.pool.groups), "leak"
        self.manager.check_integrity()
        assert self.manager.reset_prefix_cache()
        pool = self.manager.pool
        assert len(pool.free_pages) == self.config.num_large_pages - 1, "pages leaked"


TestManagerMachine = ManagerMachine.TestCase
# Fast by default; a profile with more examples (`--hypothesis-profile=long`, conftest.py)
# supplies its own counts.
_FAST = {"max_examples": 150, "stateful_step_count": 40}
TestManagerMachine.settings = settings(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    **({} if settings.default.max_examples > _FAST["max_examples"] else _FAST))


def test_memory_moves_to_the_group_that_needs_it():
    """Fill the arena with full-attention blocks, free them (they stay cached), then the
    sliding-window group can take every block of the arena."""
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=1, dtype="fp32")
    sliding = SlidingWindowSpec(sliding_window=8, **ATTN)
    # Full blocks are 64 bytes, sliding blocks 32: a 192-byte large page holds 3 or 6.
    groups = (KVCacheGroup(0, full, ("f",), (64,), 3), KVCacheGroup(1, sliding, ("s",), (32,), 6))
    pool = BlockPool(KVCacheConfig(groups, 192, 11))
    blocks = pool.take(0, 30)
    for i, block in enumerate(blocks):
        pool.cache(block, b"%d" % i)
    pool.free(0, reversed(blocks))
    assert pool.num_free_blocks(1) == 60
    assert pool.can_take([0, 60])
    assert len(pool.take(1, 60)) == 60
    assert not pool.groups[0].cached
    pool.check_integrity()
    assert pool.usage() == pool.group_usage(1) == 1.0  # 60 x 32 bytes = 10 pages of 192


class _Drawn:
    """Stands in for hypothesis' `data` when replaying a found example by hand."""

    def __init__(self, value: object) -> None:
        self.value = value

    def draw(self, strategy: object) -> object:
        return self.value


def test_value_eviction_regression_can_take_said_yes_then_take_raised_and_leaked():
    """The machine's minimal example: the last admission asked for Mamba 3 + attention 2
    blocks with one cached attention block touched. can_take's replay said yes, the Mamba
    take evicted attention pages the replay had counted on, the attention take raised, and
    4 Mamba + 1 attention blocks stayed used after every request was freed."""
    machine = ManagerMachine()
    machine.setup(specs=[MambaSpec(block_size=4, shapes=((8,),), dtypes=("fp32",)),
                         FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1,
                                           dtype="fp32")],
                  num_pages=12, blocks_per_page=2, caching=True, eviction="value")
    p20, p11 = PREFIXES[0], PREFIXES[2]
    steps = [
        lambda: machine.add_request(prefix=p20, cut=9, suffix=[100] * 7, chunk=16),
        lambda: machine.add_request(prefix=p11, cut=11, suffix=[100], chunk=12),
        lambda: machine.add_request(prefix=p11, cut=11, suffix=[100, 100], chunk=1),
        lambda: machine.add_request(prefix=p20, cut=1, suffix=[100] * 4, chunk=5),
        lambda: machine.finish(data=_Drawn("r0")),
        lambda: machine.finish(data=_Drawn("r1")),
        lambda: machine.add_request(prefix=p20, cut=9, suffix=[], chunk=5),
        lambda: machine.step(data=_Drawn("r4"), token=100, chunk=4),
        lambda: machine.add_request(prefix=p20, cut=13, suffix=[], chunk=5),
    ]
    for step in steps:
        step()
        machine.books_add_up()
        machine.needed_blocks_are_held()
    machine.teardown()
