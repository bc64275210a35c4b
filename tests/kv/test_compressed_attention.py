"""DeepSeek-V4's kinds: compressed-attention entries and compressor states (block size 4).

    layer kind   sliding K=V window   entries (1 per rate tokens)   compressor state
    CSA          window               every one before the hit      checkpoint at the hit
    HCA          window               every one before the hit      nothing (empty buffer)
"""

import pytest

from hybridkv.kv.spec import CompressedAttentionSpec, CompressorStateSpec
from tests.kv.toy import (
    compressed,
    compressor_state,
    indexer,
    request,
    sliding,
    toy_manager,
)

PROMPT = list(range(100, 118))  # 18 tokens: 4 full blocks + 2 tokens


def test_a_block_of_entries_covers_entries_times_rate_tokens():
    # V4's CSA: a 512-wide K=V entry per 4 tokens; 16-token blocks hold 4 entries.
    csa = CompressedAttentionSpec(block_size=16, head_size=512, compress_rate=4)
    assert (csa.entries_per_block, csa.page_size_bytes) == (4, 4 * 512 * 2)
    assert csa.steady_blocks(131072) == csa.peak_blocks(131072, 2048) == 8192
    # An unfinished window is compressor state, not an entry yet.
    assert csa.ideal_bytes(1003) == 250 * 1024
    hca = CompressedAttentionSpec(block_size=128, head_size=512, compress_rate=128)
    assert (hca.entries_per_block, hca.page_size_bytes) == (1, 1024)
    assert hca.group_key() != csa.group_key()
    with pytest.raises(ValueError, match="multiple of it, got 16"):
        CompressedAttentionSpec(block_size=16, head_size=512, compress_rate=128)
    with pytest.raises(ValueError, match="compress_rate and num_kv_heads >= 1"):
        CompressedAttentionSpec(block_size=16, head_size=512, compress_rate=0)


def test_only_overlapping_compressor_states_take_checkpoints():
    csa = CompressorStateSpec(block_size=16, shapes=((3, 1024),), dtypes=("bf16",),
                              compress_rate=4, overlap=True)
    hca = CompressorStateSpec(block_size=128, shapes=((127, 512),), dtypes=("bf16",),
                              compress_rate=128)
    assert csa.checkpoint_blocks(131072, 2048, 0, 4) > 0
    assert hca.checkpoint_blocks(131072, 2048, 0, 4) == 0
    # One live state each, whatever the length.
    assert csa.steady_blocks(1 << 20) == hca.steady_blocks(1 << 20) == 1
    assert hca.ideal_bytes(1 << 20) == 127 * 512 * 2
    # The two hit rules never share a group.
    assert csa.group_key() != CompressorStateSpec(
        block_size=16, shapes=((3, 1024),), dtypes=("bf16",), compress_rate=4).group_key()
    with pytest.raises(ValueError, match="multiple of it, got 16"):
        CompressorStateSpec(block_size=16, shapes=((1,),), dtypes=("bf16",),
                            compress_rate=128)


def test_hca_hits_at_any_window_boundary_with_no_state():
    # Window 8, entries per 4 tokens, HCA's compressor state: the prompt's end takes no
    # checkpoint, and the next request's hit holds null blocks only in the state group (a
    # fresh live state: the buffer is empty at 16), all entries, and the window's blocks.
    m = toy_manager(sliding(8), compressed(4), compressor_state(4, overlap=False),
                    num_pages=40)
    a = request("a", PROMPT)
    new = m.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    assert new.block_ids() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11]]
    assert new.checkpoints == ()
    b = request("b", PROMPT + [5])
    hit = m.get_computed_blocks(b)
    assert hit.num_computed_tokens == 16
    assert hit.blocks.block_ids() == [[0, 0, 3, 4], [6, 7, 8, 9], [0, 0, 0, 0]]
    m.allocate_slots(b, b.num_tokens - 16, 16, hit.blocks)
    b.num_computed_tokens = b.num_tokens
    assert m.get_block_ids("b") == [[0, 0, 3, 4, 12], [6, 7, 8, 9, 13], [0, 0, 0, 0, 14]]
    # Evicting an early entry block ends every hit before it: each query may read it.
    m.free(a)
    m.free(b)
    assert m.pool.evict_blocks(1, [m.pool.groups[1].blocks[7]]) == 1
    c = request("c", PROMPT + [5])
    assert m.get_computed_blocks(c).num_computed_tokens == 4
    m.check_integrity()


def test_csa_hits_only_where_a_checkpoint_holds_the_overlap():
    # Entries per 2 tokens, the indexer's keys per 2, CSA's compressor state: the prompt's
    # end saves the state at 16 (block 17), and a hit there takes it; a request parting
    # from the prompt at 12 finds no checkpoint there and computes from 0, where HCA's rule
    # would hit 12.
    m = toy_manager(sliding(8), compressed(2), indexer(), compressor_state(2, overlap=True),
                    num_pages=40)
    a = request("a", PROMPT)
    new = m.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    assert new.block_ids() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15], [16]]
    assert new.checkpoints == ((3, 16, 17),)
    b = request("b", PROMPT + [5])
    hit = m.get_computed_blocks(b)
    assert hit.num_computed_tokens == 16
    assert hit.blocks.block_ids() == [[0, 0, 3, 4], [6, 7, 8, 9], [11, 12, 13, 14],
                                      [0, 0, 0, 17]]
    c = request("c", PROMPT[:12] + [7] * 5)
    assert m.get_computed_blocks(c).num_computed_tokens == 0
    m.check_integrity()
