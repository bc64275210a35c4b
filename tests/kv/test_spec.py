import pytest

from hybridkv.kv.spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlySpec,
    FullAttentionSpec,
    IndexerKeySpec,
    MambaSpec,
    MLAAttentionSpec,
    MLASlidingWindowSpec,
    SlidingWindowSpec,
    dtype_size,
    merge_specs,
)

ATTN = dict(block_size=16, num_kv_heads=8, head_size=128, dtype="bf16")


def test_attention_page_is_k_and_v_of_every_token_in_a_block():
    # 16 tokens x (K, V) x 8 heads x 128 x 2 bytes = 64 KiB
    assert FullAttentionSpec(**ATTN).page_size_bytes == 64 * 1024
    assert SlidingWindowSpec(sliding_window=512, **ATTN).page_size_bytes == 64 * 1024


def test_mla_stores_one_latent_instead_of_k_and_v():
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype="bf16")
    assert spec.page_size_bytes == 16 * 576 * 2


def test_sliding_mla_pages_are_latents_with_a_window():
    spec = MLASlidingWindowSpec(sliding_window=512, block_size=16, num_kv_heads=1,
                                head_size=1088, dtype="bf16")
    assert spec.page_size_bytes == 16 * 1088 * 2
    assert spec.steady_blocks(10_000) == 32 + 1
    with pytest.raises(ValueError, match="pages hold latents; keys_only does not apply"):
        MLASlidingWindowSpec(sliding_window=8, keys_only=True, block_size=16,
                             num_kv_heads=1, head_size=8)


def test_indexer_keys_have_their_own_page_and_dtype():
    # DeepSeek-V3.2's indexer: one 128-wide key per token; fp8 keys are 1 byte each
    # whatever the attention pages hold.
    spec = IndexerKeySpec(block_size=64, head_size=128, dtype="fp8")
    assert (spec.page_size_bytes, spec.page_dtype) == (64 * 128, "fp8")
    assert spec.peak_blocks(max_model_len=1000, max_num_batched_tokens=64) == 16
    assert spec.steady_blocks(1000) == 16 and spec.ideal_bytes(1000) == 1000 * 128
    # Compressed per 4 tokens: a block of 64 tokens holds 16 entries; an unfinished window
    # is no entry yet.
    compressed = IndexerKeySpec(block_size=64, head_size=128, dtype="bf16", compress_rate=4)
    assert compressed.page_size_bytes == 16 * 128 * 2
    assert compressed.ideal_bytes(1003) == 250 * 256
    assert compressed.group_key() != spec.group_key()
    with pytest.raises(ValueError, match="multiple of it, got 6"):
        IndexerKeySpec(block_size=6, head_size=8, compress_rate=4)
    with pytest.raises(ValueError, match="head_size >= 1"):
        IndexerKeySpec(block_size=16, head_size=0)


def test_peak_blocks_per_kind():
    full = FullAttentionSpec(**ATTN)
    assert full.peak_blocks(1000, 512) == 63  # ceil(1000 / 16)
    swa = SlidingWindowSpec(sliding_window=128, **ATTN)
    # window - 1 + batched tokens = 639 tokens -> 40 blocks, + 1 for a misaligned window
    assert swa.peak_blocks(131072, 512) == 41
    assert swa.peak_blocks(100, 512) == 8  # capped by max_model_len: ceil(100/16) + 1
    chunked = ChunkedLocalAttentionSpec(attention_chunk_size=8192, **ATTN)
    assert chunked.peak_blocks(131072, 512) == (8192 + 512) // 16 + 1
    cross = CrossAttentionSpec(max_encoder_len=1500, **ATTN)
    assert cross.peak_blocks(10, 10) == 94
    assert EncoderOnlySpec(block_size=16).peak_blocks(100, 100) == 0


def test_steady_state_needs_only_the_window():
    swa = SlidingWindowSpec(sliding_window=1024, **ATTN)
    assert swa.steady_blocks(131072) == 64 + 1
    assert swa.ideal_bytes(131072) == 1024 * swa.bytes_per_token
    chunked = ChunkedLocalAttentionSpec(attention_chunk_size=8192, **ATTN)
    assert chunked.steady_blocks(131072) == 512
    assert chunked.steady_blocks(100) == 7


def test_mamba_state_is_one_block_whatever_the_length():
    spec = MambaSpec(block_size=16, shapes=((10240, 3), (128, 64, 128)),
                     dtypes=("bf16", "float32"))
    assert spec.page_size_bytes == 10240 * 3 * 2 + 128 * 64 * 128 * 4
    assert spec.peak_blocks(131072, 8192) == 1
    assert MambaSpec(block_size=16, shapes=((4,),), dtypes=("bf16",),
                     num_speculative_blocks=2).steady_blocks(99) == 3
    with pytest.raises(ValueError, match="one dtype per state shape"):
        MambaSpec(block_size=16, shapes=((4,), (5,)), dtypes=("bf16",))


def test_merge_accepts_layers_of_one_kind_with_different_sizes():
    a = FullAttentionSpec(**ATTN)
    b = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="fp32")
    assert merge_specs(["a", "b"], [a, b]) is a


def test_merge_refuses_different_windows_with_a_clear_error():
    a = SlidingWindowSpec(sliding_window=512, **ATTN)
    b = SlidingWindowSpec(sliding_window=4096, **ATTN)
    with pytest.raises(ValueError, match="cannot put layer 'b'.*KV cache specs differ"):
        merge_specs(["a", "b"], [a, b])
    with pytest.raises(ValueError, match="cannot put layer"):
        merge_specs(["a", "f"], [a, FullAttentionSpec(**ATTN)])


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        dtype_size("int3")
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        FullAttentionSpec(block_size=0, num_kv_heads=1, head_size=8)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        SlidingWindowSpec(sliding_window=0, **ATTN)
