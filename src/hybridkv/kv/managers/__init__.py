"""One manager class per KV cache spec kind."""

from __future__ import annotations

from hybridkv.kv.managers.base import SingleTypeManager
from hybridkv.kv.managers.chunked_local import ChunkedLocalManager
from hybridkv.kv.managers.compressed import CompressedAttentionManager
from hybridkv.kv.managers.compressor_state import CompressorStateManager
from hybridkv.kv.managers.cross_attention import CrossAttentionManager
from hybridkv.kv.managers.full import FullAttentionManager
from hybridkv.kv.managers.indexer_key import IndexerKeyManager
from hybridkv.kv.managers.mamba import MambaManager
from hybridkv.kv.managers.sliding_window import SlidingWindowManager

MANAGER_BY_KIND: dict[str, type[SingleTypeManager]] = {
    "full": FullAttentionManager,
    "sliding_window": SlidingWindowManager,
    "chunked_local": ChunkedLocalManager,
    "mamba": MambaManager,
    "cross_attention": CrossAttentionManager,
    "indexer_key": IndexerKeyManager,
    "compressed": CompressedAttentionManager,
    "compressor_state": CompressorStateManager,
}


def manager_class(kind: str) -> type[SingleTypeManager]:
    try:
        return MANAGER_BY_KIND[kind]
    except KeyError:
        raise ValueError(f"no KV cache manager for spec kind {kind!r}; supported: "
                         f"{', '.join(MANAGER_BY_KIND)}") from None


__all__ = ["MANAGER_BY_KIND", "SingleTypeManager", "manager_class"]
