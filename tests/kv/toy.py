"""Toy KV cache configs for narrated tests: tiny blocks, a handful of large pages."""

from hybridkv.kv.manager import KVCacheManager
from hybridkv.kv.plan import KVCacheConfig, KVCacheGroup
from hybridkv.kv.request import KVRequest
from hybridkv.kv.spec import (
    ChunkedLocalAttentionSpec,
    CompressedAttentionSpec,
    CompressorStateSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    IndexerKeySpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

BLOCK = 4  # tokens per block in every toy
_ATTN = dict(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype="fp32")  # page: 32 bytes


def full() -> KVCacheSpec:
    return FullAttentionSpec(**_ATTN)


def sliding(window: int) -> KVCacheSpec:
    return SlidingWindowSpec(sliding_window=window, **_ATTN)


def chunked(chunk: int) -> KVCacheSpec:
    return ChunkedLocalAttentionSpec(attention_chunk_size=chunk, **_ATTN)


def mamba() -> KVCacheSpec:
    return MambaSpec(block_size=BLOCK, shapes=((8,),), dtypes=("fp32",))  # 32 bytes


def cross(encoder_len: int) -> KVCacheSpec:
    return CrossAttentionSpec(max_encoder_len=encoder_len, **_ATTN)


def indexer() -> KVCacheSpec:
    return IndexerKeySpec(block_size=BLOCK, head_size=2, dtype="fp32")  # 32 bytes


def compressed(rate: int) -> KVCacheSpec:
    """Entries of 8 / rate fp32 values, one per `rate` tokens: 32 bytes a block."""
    return CompressedAttentionSpec(block_size=BLOCK, head_size=2 * rate,
                                   compress_rate=rate, dtype="fp32")


def compressor_state(rate: int, *, overlap: bool) -> KVCacheSpec:
    return CompressorStateSpec(block_size=BLOCK, shapes=((8,),), dtypes=("fp32",),
                               compress_rate=rate, overlap=overlap)  # 32 bytes


def toy_config(*specs: KVCacheSpec, num_pages: int, blocks_per_page: int = 1) -> KVCacheConfig:
    """One layer per group, every block 32 bytes, `blocks_per_page` blocks per large page."""
    groups = tuple(
        KVCacheGroup(group_id=i, spec=spec, layer_names=(f"layer{i}",),
                     layer_page_bytes=(spec.page_size_bytes,),
                     blocks_per_large_page=blocks_per_page)
        for i, spec in enumerate(specs))
    return KVCacheConfig(groups=groups, large_page_bytes=32 * blocks_per_page,
                         num_large_pages=num_pages)


def toy_manager(*specs: KVCacheSpec, num_pages: int, blocks_per_page: int = 1,
                enable_caching: bool = True, max_model_len: int = 1024,
                checkpoint_tail: int = 1) -> KVCacheManager:
    # Toy prompts are a few blocks of 4 tokens: state groups keep one block of a prompt's
    # and an output's tail unless a test asks for more.
    return KVCacheManager(toy_config(*specs, num_pages=num_pages,
                                     blocks_per_page=blocks_per_page),
                          max_model_len=max_model_len, enable_caching=enable_caching,
                          enable_events=True, checkpoint_tail=checkpoint_tail)


def request(rid: str, tokens: list[int], **kw: object) -> KVRequest:
    return KVRequest(rid, tokens, hash_block_size=BLOCK, **kw)  # type: ignore[arg-type]


def admit(manager: KVCacheManager, req: KVRequest) -> int:
    """Look up, allocate the whole prompt, mark it computed. Returns the hit tokens."""
    hit = manager.get_computed_blocks(req)
    new = manager.allocate_slots(req, req.num_tokens - hit.num_computed_tokens,
                                 hit.num_computed_tokens, hit.blocks)
    assert new is not None, f"{req.request_id} did not fit"
    req.num_computed_tokens = req.num_tokens
    return hit.num_computed_tokens


def decode(manager: KVCacheManager, req: KVRequest, token: int) -> bool:
    req.append_token_ids([token])
    ok = manager.allocate_slots(req, 1) is not None
    if ok:
        req.num_computed_tokens += 1
    return ok
