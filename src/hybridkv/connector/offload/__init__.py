"""KV offloading: byte-level storage tiers behind one interface (`KVStore`), torch-free.

    CPUTier   an LRU of byte strings in this process's memory, within a byte budget
    DiskTier  one checksummed file per key in a directory, LRU within a byte budget,
              warm on restart

Keys come from `make_key(layout fingerprint, group id, block hash)`; the tiers never parse them.
"""

from hybridkv.connector.offload.cpu_tier import CPUTier
from hybridkv.connector.offload.disk_tier import DiskTier
from hybridkv.connector.offload.store import (
    KVStore,
    StoreStats,
    TierSpec,
    make_key,
    parse_tier_spec,
)
from hybridkv.kv.plan import parse_bytes

__all__ = ["CPUTier", "DiskTier", "KVStore", "StoreStats", "TierSpec", "make_key",
           "parse_bytes", "parse_tier_spec"]
