"""K-only attention pages (values derived from the keys' projection): half the bytes, the
same manager policy, and they share a group with K/V layers of their kind (per-layer pages)."""

import pytest

from hybridkv.kv.plan import plan_kv_cache, to_full_attention
from hybridkv.kv.spec import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

ATTN = dict(block_size=16, num_kv_heads=2, head_size=512, dtype="bf16")


def test_a_k_only_page_holds_one_tensor_per_token():
    # 16 tokens x 2 heads x 512 x 2 bytes = 32 KiB, half a K/V page.
    k_only = FullAttentionSpec(keys_only=True, **ATTN)
    assert k_only.page_size_bytes == 32 * 1024
    assert FullAttentionSpec(**ATTN).page_size_bytes == 64 * 1024
    assert k_only.ideal_bytes(1000) == 1000 * 2 * 512 * 2
    assert k_only.group_key() == FullAttentionSpec(**ATTN).group_key()


def test_no_hybrid_keeps_k_only_and_mla_rejects_it():
    swa = SlidingWindowSpec(sliding_window=64, keys_only=True, **ATTN)
    assert to_full_attention(swa) == FullAttentionSpec(sliding_window=64, keys_only=True, **ATTN)
    with pytest.raises(ValueError, match="keys_only does not apply"):
        MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, keys_only=True)


def test_k_only_and_k_v_layers_of_one_kind_share_a_group_with_their_own_pages():
    # Gemma 4 under --no-hybrid: sliding layers (K/V, 256 wide) become full attention and
    # join the K-only full layers (512 wide) in one group.
    small = dict(block_size=16, num_kv_heads=2, head_size=256, dtype="bf16")
    specs = {"swa.0": SlidingWindowSpec(sliding_window=64, **small),
             "full.0": FullAttentionSpec(keys_only=True, **ATTN),
             "swa.1": SlidingWindowSpec(sliding_window=64, **small)}
    plan = plan_kv_cache(specs, 64 << 20, max_model_len=1024, max_num_batched_tokens=64,
                         hybrid=False)
    (group,) = plan.config.groups
    assert group.layer_page_bytes == (32 * 1024, 32 * 1024, 32 * 1024)
    assert [s.keys_only for s in group.layer_specs] == [False, True, False]
    assert plan.ideal_bytes_per_token == 3 * 2 * 512 * 2
