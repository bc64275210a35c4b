"""Narrated scenarios on KVCacheManager with toy specs (block size 4)."""

import pytest

from hybridkv.kv.manager import KVCacheManager
from hybridkv.kv.plan import KVCacheConfig, KVCacheGroup
from hybridkv.kv.request import KVRequest
from hybridkv.kv.spec import FullAttentionSpec
from tests.kv.toy import (
    admit,
    chunked,
    cross,
    decode,
    full,
    indexer,
    mamba,
    request,
    sliding,
    toy_manager,
)

PROMPT = list(range(100, 118))  # 18 tokens: 4 full blocks + 2 tokens


def test_full_attention_second_request_hits_the_shared_prefix():
    m = toy_manager(full(), num_pages=20)
    a = request("a", PROMPT)
    assert admit(m, a) == 0
    assert m.get_block_ids("a") == [[1, 2, 3, 4, 5]]
    b = request("b", PROMPT[:12] + [1, 2, 3, 4, 5])
    # 3 shared blocks; the 4th differs at token 13.
    assert admit(m, b) == 12
    assert m.get_block_ids("b") == [[1, 2, 3, 6, 7]]
    assert [blk.ref_cnt for blk in m.pool.groups[0].blocks[1:4]] == [2, 2, 2]
    assert m.stats.num_hit_tokens == 12 and m.stats.num_queried_tokens == 35
    m.check_integrity()


def test_a_hit_never_covers_the_last_token():
    m = toy_manager(full(), num_pages=20)
    admit(m, request("a", PROMPT[:16]))
    # Same 16 tokens: the 4th block is cached but the last token must be recomputed.
    assert admit(m, request("b", PROMPT[:16])) == 12


def test_cache_salt_separates_otherwise_equal_prompts():
    m = toy_manager(full(), num_pages=20)
    admit(m, request("a", PROMPT, cache_salt="alice"))
    assert admit(m, request("b", PROMPT, cache_salt="bob")) == 0
    assert admit(m, request("c", PROMPT, cache_salt="alice")) == 16


def test_sliding_window_drops_blocks_out_of_the_window():
    m = toy_manager(sliding(8), num_pages=20)
    a = request("a", PROMPT)  # 18 tokens -> 5 blocks
    admit(m, a)
    assert m.get_block_ids("a") == [[1, 2, 3, 4, 5]]
    # Token 18 attends to positions 11..18: blocks 0 and 1 (positions 0..7) fall out.
    assert decode(m, a, 7)
    assert m.get_block_ids("a") == [[0, 0, 3, 4, 5]]
    m.check_integrity()


def test_sliding_window_hit_needs_only_the_window_before_the_hit_point():
    m = toy_manager(sliding(8), num_pages=20)
    admit(m, request("a", PROMPT))
    m.free(request("a", PROMPT))
    # Evict block 1 (positions 0..3): a full-attention hit would now be 0 tokens.
    assert m.pool.evict_blocks(0, [m.pool.groups[0].blocks[1]]) == 1
    # Window 8 needs ceil(7/4) = 2 blocks before the hit point: blocks 2, 3 -> hit 16.
    b = request("b", PROMPT + [1])
    assert admit(m, b) == 16
    assert m.get_block_ids("b")[0][:4] == [0, 0, 3, 4]
    m.check_integrity()


def test_chunked_local_hit_at_a_chunk_boundary_needs_no_block():
    m = toy_manager(chunked(8), num_pages=20)
    # Nothing is cached, yet in a model of only chunked layers tokens 16.. do not depend on
    # tokens 0..15 at all: the chunk boundary is a hit with no block.
    a = request("a", PROMPT)
    assert admit(m, a) == 16
    assert m.get_block_ids("a") == [[0, 0, 0, 0, 1]]
    for t in range(6):  # tokens 18..23 stay in chunk 16..23
        assert decode(m, a, t)
    assert m.get_block_ids("a") == [[0, 0, 0, 0, 1, 2]]
    assert decode(m, a, 6)  # token 24 starts a new chunk
    assert decode(m, a, 7)  # computed 25: blocks 4, 5 (tokens 16..23) fall out
    assert m.get_block_ids("a") == [[0, 0, 0, 0, 0, 0, 3]]
    m.check_integrity()


def test_chunked_local_within_a_chunk_needs_its_blocks():
    m = toy_manager(full(), chunked(8), num_pages=40)
    admit(m, request("a", PROMPT + [1, 2]))  # 20 tokens: 5 full blocks cached
    # Full allows 20; the chunked group at 20 needs its chunk's blocks from 16: block 4.
    b = request("b", PROMPT + [1, 2, 3, 4])
    assert admit(m, b) == 20
    assert m.get_block_ids("b")[1][:5] == [0, 0, 0, 0, 10]
    m.check_integrity()


def test_hybrid_hit_is_the_fixed_point_over_all_groups():
    # Full, sliding window 8 and chunk 8, blocks of 4 tokens.
    m = toy_manager(full(), sliding(8), chunked(8), num_pages=60)
    a = request("a", PROMPT)
    admit(m, a)
    # Chunked alone would let a skip tokens 0..15, but the other groups need them.
    assert m.get_block_ids("a") == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    b = request("b", PROMPT + [9, 9, 9])
    # Full allows 16 (a's 4 full blocks); sliding needs blocks 2, 3 before 16: cached;
    # chunked: 16 is a chunk boundary.
    assert admit(m, b) == 16
    assert m.get_block_ids("b") == [[1, 2, 3, 4, 16, 17], [0, 0, 8, 9, 18, 19],
                                    [0, 0, 0, 0, 20, 21]]
    assert m.stats.hit_tokens_per_group == [16, 16, 16]  # a's lookup added 0s
    m.check_integrity()


def test_hybrid_hit_lowers_when_one_group_lacks_its_window():
    m = toy_manager(full(), sliding(8), num_pages=40)
    admit(m, request("a", PROMPT))
    m.free(request("a", PROMPT))
    # Evict sliding-window block 3 (positions 12..15) only: a's sliding blocks are 6..10.
    assert m.get_block_ids("a") == [[], []]
    assert m.pool.evict_blocks(1, [m.pool.groups[1].blocks[9]]) == 1
    b = request("b", PROMPT + [5])
    # Full allows 16, sliding at 16 lacks block 3; at 12 it has blocks 1, 2 -> both 12.
    assert admit(m, b) == 12
    assert m.stats.hit_tokens_per_group == [16, 12]
    m.check_integrity()


def test_indexer_keys_hold_every_position_beside_a_sliding_window():
    # Sliding window 8 beside a lightning indexer's keys (the indexer may pick any earlier
    # position): the window drops blocks, the indexer group keeps them all, and a hit needs
    # every indexer block before it.
    m = toy_manager(sliding(8), indexer(), num_pages=60)
    a = request("a", PROMPT)
    admit(m, a)
    for token in range(7):
        assert decode(m, a, token)  # 25 tokens computed: the window reaches back to 18
    assert m.get_block_ids("a") == [[0, 0, 0, 0, 5, 11, 13], [6, 7, 8, 9, 10, 12, 14]]
    m.free(a)
    # Evict the indexer's block 1 (positions 4..7): the window alone would allow 24.
    assert m.pool.evict_blocks(1, [m.pool.groups[1].blocks[7]]) == 1
    b = request("b", PROMPT + list(range(7)) + [5] * 3)
    assert admit(m, b) == 4
    # Block 0 of each group is a's again; the evicted indexer block's large page went on to
    # hold one of b's window blocks.
    assert m.get_block_ids("b") == [[1, 7, 14, 13, 15, 16, 17], [6, 18, 19, 20, 21, 22, 23]]
    m.check_integrity()


def test_mamba_checkpoints_at_the_prompt_end_make_the_next_request_hit():
    m = toy_manager(full(), mamba(), num_pages=40)
    a = request("a", PROMPT)  # 18 tokens: the prompt ends in block 4, so checkpoint at 16
    admit_blocks = m.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    assert admit_blocks.block_ids() == [[1, 2, 3, 4, 5], [6]]  # one live state
    assert admit_blocks.checkpoints == ((1, 16, 7),)  # group 1 writes the state at 16
    b = request("b", PROMPT + [5])
    hit = m.get_computed_blocks(b)
    # The checkpoint is registered at once (written in the same step as it is handed out).
    assert hit.num_computed_tokens == 16
    assert hit.blocks.block_ids() == [[1, 2, 3, 4], [0, 0, 0, 7]]
    m.allocate_slots(b, b.num_tokens - 16, 16, hit.blocks)
    b.num_computed_tokens = b.num_tokens
    assert m.get_block_ids("b") == [[1, 2, 3, 4, 8], [0, 0, 0, 7, 9]]
    decode(m, b, 1)  # b copied the checkpoint into its live state: released
    assert m.get_block_ids("b")[1] == [0, 0, 0, 0, 9]
    assert m.pool.groups[1].blocks[7].ref_cnt == 1  # a holds it until its next step
    decode(m, a, 1)
    assert m.pool.groups[1].blocks[7].ref_cnt == 0  # cached, evictable
    m.check_integrity()


def test_mamba_prompt_of_whole_blocks_also_checkpoints_one_block_before_its_end():
    """A prompt of 16 tokens saves states at 16 and at 12. A next prompt that parts from it
    at its last token (a chat client resending it with the answer's text after it, which
    tokenized the last word differently) resumes at 12, not from the start; an exact
    continuation still resumes at 16."""
    m = toy_manager(full(), mamba(), num_pages=60)
    a = request("a", PROMPT[:16])
    new = m.allocate_slots(a, a.num_tokens)
    assert [position for _, position, _ in new.checkpoints] == [12, 16]
    a.num_computed_tokens = a.num_tokens
    parted = request("b", PROMPT[:15] + [7, 8, 9])
    assert m.get_computed_blocks(parted).num_computed_tokens == 12
    continued = request("c", PROMPT[:16] + [7, 8])
    assert m.get_computed_blocks(continued).num_computed_tokens == 16
    m.check_integrity()


def test_mamba_checkpoints_the_prompts_tail_where_an_edited_last_message_parts():
    """With a tail of 3 blocks, a prompt of 26 tokens saves states at 16, 20 and 24. A chat
    client that edits the last message (here from token 17 on) resumes at 16; with the
    tail of one block it would resume from the start."""
    for tail, expected in ((3, 16), (1, 0)):
        m = toy_manager(full(), mamba(), num_pages=60, checkpoint_tail=tail)
        prompt = list(range(1, 27))
        a = request("a", prompt)
        new = m.allocate_slots(a, a.num_tokens)
        a.num_computed_tokens = a.num_tokens
        assert [p for _, p, _ in new.checkpoints] == ([16, 20, 24] if tail == 3 else [24])
        edited = request("b", prompt[:17] + [9, 9, 9, 9, 9])
        assert m.get_computed_blocks(edited).num_computed_tokens == expected
        m.check_integrity()


def test_mamba_keeps_the_outputs_last_tail_checkpoints():
    """With a tail of 2 blocks the output keeps its last two block boundaries' states (24
    and 28 once it reached 30; 20 left the cache). A resend whose answer tokenizes
    differently from token 26 on resumes at 24."""
    m = toy_manager(full(), mamba(), num_pages=60, checkpoint_tail=2)
    a = request("a", PROMPT)  # 18 tokens: prompt checkpoints at 12 and 16
    admit(m, a)
    answer = [40 + i for i in range(12)]  # 18 -> 30: boundaries 20, 24, 28
    for token in answer:
        decode(m, a, token)
    m.free(a)
    assert sorted(b.value for b in m.pool.groups[1].cached.values()) == [12, 16, 24, 28]
    resend = request("b", PROMPT + answer[:8] + [7, 7, 7])
    assert m.get_computed_blocks(resend).num_computed_tokens == 24
    m.check_integrity()


def test_mamba_branch_point_checkpoint():
    m = toy_manager(full(), mamba(), num_pages=60)
    admit(m, request("a", PROMPT))  # checkpoint at 16
    # b shares 12 tokens with a, then differs; its prompt ends at 22 (checkpoint at 20).
    b = request("b", PROMPT[:12] + [1] * 10)
    hit = m.get_computed_blocks(b)
    assert hit.num_computed_tokens == 0  # no state at 12 yet, so no hit in the state group
    new = m.allocate_slots(b, b.num_tokens)
    # The full group matched 12 tokens: b saves its state there (the branch point).
    assert [position for _, position, _ in new.checkpoints] == [12, 20]
    c = request("c", PROMPT[:12] + [2] * 10)
    assert m.get_computed_blocks(c).num_computed_tokens == 12
    m.check_integrity()


def test_mamba_checkpoint_interval():
    m = toy_manager(full(), mamba(), num_pages=60)
    for manager in m.managers:
        manager.set_checkpoint_policy(interval=2, branch_points=True)  # every 8 tokens
    a = request("a", list(range(1, 30)))
    new = m.allocate_slots(a, a.num_tokens)
    assert [position for _, position, _ in new.checkpoints] == [8, 16, 24, 28]
    m.check_integrity()


def test_cross_attention_blocks_follow_the_encoder_length():
    m = toy_manager(full(), cross(10), num_pages=40)
    a = request("a", PROMPT[:5], num_encoder_tokens=10)
    admit(m, a)
    assert m.get_block_ids("a") == [[1, 2], [3, 4, 5]]
    for t in range(4):  # the 9th token needs a third decoder block, no encoder block
        decode(m, a, t)
    assert m.get_block_ids("a") == [[1, 2, 6], [3, 4, 5]]
    m.check_integrity()


def test_allocation_is_all_or_nothing():
    m = toy_manager(full(), sliding(8), num_pages=9)  # 8 usable pages
    a = request("a", PROMPT[:16])
    admit(m, a)  # 4 + 4 blocks: all 8 pages
    before = m.get_block_ids("a")
    b = request("b", [1, 2, 3])
    assert m.allocate_slots(b, 3) is None
    assert m.get_block_ids("b") == [[], []]
    assert m.get_block_ids("a") == before
    m.check_integrity()
    m.free(a)
    assert m.allocate_slots(b, 3) is not None
    m.check_integrity()


def test_preempted_request_recomputes_from_its_own_cached_blocks():
    m = toy_manager(full(), num_pages=20)
    a = request("a", PROMPT)
    admit(m, a)
    for t in range(3):
        decode(m, a, t)
    m.free(a)
    a.num_computed_tokens = 0
    assert admit(m, a) == 20  # 21 tokens: 5 full blocks cached
    m.check_integrity()


def test_lookahead_tokens_get_blocks_but_are_not_cached():
    m = toy_manager(full(), num_pages=20)
    a = request("a", PROMPT[:8])
    new = m.allocate_slots(a, 8, num_lookahead_tokens=4)
    assert new.block_ids() == [[1, 2, 3]]
    assert m.pool.groups[0].blocks[3].block_hash is None


def test_no_prefix_caching_never_hits_and_never_caches():
    m = toy_manager(full(), sliding(8), num_pages=40, enable_caching=False)
    admit(m, request("a", PROMPT))
    assert admit(m, request("b", PROMPT)) == 0
    assert not m.pool.groups[0].cached


def test_everything_freed_leaves_no_block_in_use():
    m = toy_manager(full(), sliding(8), chunked(8), num_pages=80)
    reqs = [request(str(i), PROMPT[: 8 + i]) for i in range(5)]
    for r in reqs:
        admit(m, r)
        decode(m, r, 1)
    for r in reqs:
        m.free(r)
    assert m.usage == 0.0
    assert all(gs.num_used == 0 for gs in m.pool.groups)
    m.check_integrity()


def test_bad_calls_are_refused():
    m = toy_manager(full(), num_pages=20)
    with pytest.raises(ValueError, match="num_new_tokens must be >= 1"):
        m.allocate_slots(request("a", PROMPT), 0)
    with pytest.raises(ValueError, match="hash_block_size must be >= 1"):
        KVRequest("x", [1], hash_block_size=0)


def test_groups_with_a_larger_block_size_use_every_kth_hash():
    # Group 0 has blocks of 4 tokens, group 1 of 8: hashes are per 4 tokens, hits align to 8.
    def spec(bs):
        return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="fp32")
    groups = (KVCacheGroup(0, spec(4), ("a",), (32,), 2),
              KVCacheGroup(1, spec(8), ("b",), (64,), 1))
    m = KVCacheManager(KVCacheConfig(groups, 64, 30), max_model_len=1024)
    assert m.config.hash_block_size == 4 and m.config.hit_alignment == 8
    admit(m, request("a", PROMPT))
    assert admit(m, request("b", PROMPT[:14] + [0, 0])) == 8
    m.check_integrity()


def test_groups_of_identical_specs_share_one_lookup():
    # Two full-attention groups (e.g. layers kept apart for their layout): one lookup answers
    # both, and a hit needs the block cached in each.
    def spec():
        return FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="fp32")
    groups = (KVCacheGroup(0, spec(), ("a",), (32,), 1), KVCacheGroup(1, spec(), ("b",), (32,), 1))
    m = KVCacheManager(KVCacheConfig(groups, 32, 40), max_model_len=1024)
    assert m.coordinator.lookups == [[0, 1]]
    admit(m, request("a", PROMPT))
    m.free(request("a", PROMPT))
    assert m.pool.evict_blocks(1, [m.pool.groups[1].blocks[8]]) == 1  # group 1's 3rd block
    assert admit(m, request("b", PROMPT)) == 8
    m.check_integrity()


@pytest.mark.parametrize("caching", [True, False])
def test_mamba_takes_checkpoint_blocks_only_with_prefix_caching(caching):
    m = toy_manager(full(), mamba(), num_pages=40, enable_caching=caching)
    for manager in m.managers:
        assert getattr(manager, "save_checkpoints", caching) == caching
    a = request("a", PROMPT)  # prompt end at 18: a checkpoint at 16 if caching is on
    new = m.allocate_slots(a, 10)  # chunked prefill: 10, then 8 tokens crossing 16
    a.num_computed_tokens = 10
    assert new.checkpoints == ()
    new = m.allocate_slots(a, 8)
    a.num_computed_tokens = 18
    if caching:
        assert new.checkpoints == ((1, 16, 7),)
        assert m.pool.num_used_blocks(1) == 2  # live state + the checkpoint being written
    else:
        assert new.checkpoints == ()  # nothing could ever hit it: no block, nothing to save
        assert m.pool.num_used_blocks(1) == 1  # the live state only
    for token in range(8):  # the output crosses 20 and 24
        decode(m, a, token)
    assert m.pool.num_used_blocks(1) == 1
    m.free(a)
    assert m.pool.num_used_blocks(1) == 0
    # The prompt end's checkpoint and the output's latest (24: the one at 20 left the cache).
    assert sorted(b.value for b in m.pool.groups[1].cached.values()) == (
        [16, 24] if caching else [])
    m.check_integrity()


def test_mamba_output_checkpoint_makes_the_next_turn_hit_after_the_answer():
    """A chat's next turn resends the prompt and the answer: it resumes from the answer's
    last block boundary, not from the prompt's end."""
    m = toy_manager(full(), mamba(), num_pages=60)
    a = request("a", PROMPT)  # 18 tokens
    admit(m, a)
    answer = [40 + i for i in range(9)]  # 18 -> 27 tokens computed: boundaries 20, 24
    for token in answer:
        decode(m, a, token)
    m.free(a)
    b = request("b", PROMPT + answer + [7, 7, 7])
    assert m.get_computed_blocks(b).num_computed_tokens == 24
    m.check_integrity()
