"""Building the KV offload tiers for an engine: the tier chain, its keys' layout fingerprint,
and the shared hash seed a disk tier needs to be useful to a later process.

The layout fingerprint names everything that decides what a block's bytes mean: the model
(its config and weights, hashed), the block hash algorithm and seed, the hash block size, and
every group's spec, block size, layers and page layout. Another model, dtype, block size or
seed gives other keys, so a tier can never serve it a block it cannot use.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import xxhash

from hybridkv.config import EngineConfig
from hybridkv.connector.offload.chain import TierChain
from hybridkv.connector.offload.cpu_tier import CPUTier
from hybridkv.connector.offload.disk_tier import DiskTier
from hybridkv.connector.offload.store import KVStore, parse_tier_spec
from hybridkv.kv.plan import KVCacheConfig

SEED_FILE = "hybridkv-hash-seed"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def model_identity(model_dir: str) -> bytes:
    """xxh3-128 of the model's config and weight files (their bytes, streamed): two
    checkpoints of one architecture (a fine-tune) never share blocks."""
    h = xxhash.xxh3_128()
    root = Path(model_dir)
    for path in sorted(root.iterdir()):
        if path.name == "config.json" or path.suffix in _WEIGHT_SUFFIXES:
            h.update(path.name.encode() + b"\0")
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
    return h.digest()


def layout_fingerprint(model_id: bytes, config: KVCacheConfig, hash_fingerprint: str) -> bytes:
    h = xxhash.xxh3_128()
    h.update(model_id)
    h.update(f"{hash_fingerprint}|{config.hash_block_size}".encode())
    for g in config.groups:
        h.update(repr((g.group_id, g.spec, g.block_size, g.block_bytes, g.layer_names,
                       g.layer_page_bytes, g.shared_layers)).encode())
    return b"hkv1" + h.digest()


def disk_hash_seed(directory: str) -> str:
    """The block hash seed kept in a disk tier's directory (created on first use, readable
    by its owner only): processes sharing the directory hash alike, so its blocks hit."""
    path = Path(directory) / SEED_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    except OSError as e:
        raise ValueError(f"kv_offload_disk: cannot read {path}: {e.strerror or e}") from None
    seed = secrets.token_hex(32)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()  # another process made it just now
    except OSError as e:
        raise ValueError(f"kv_offload_disk: directory {str(path.parent)!r} is not writable: "
                         f"{e.strerror or e}") from None
    with os.fdopen(fd, "w") as f:
        f.write(seed)
    return seed


def build_tier_chain(config: EngineConfig, kv_config: KVCacheConfig,
                     fingerprint: bytes) -> TierChain:
    """The configured tiers, fastest first; a budget below one block or an unusable
    directory is a one-line error."""
    block_bytes = max(g.block_bytes for g in kv_config.groups)
    names: list[str] = []
    tiers: list[KVStore] = []
    if config.kv_offload_cpu is not None:
        names.append("cpu")
        tiers.append(CPUTier(int(config.kv_offload_cpu), min_entry_bytes=block_bytes))
    if config.kv_offload_disk is not None:
        spec = parse_tier_spec(config.kv_offload_disk, flag="kv_offload_disk")
        names.append("disk")
        tiers.append(DiskTier(spec.path, spec.capacity_bytes, fingerprint,
                              min_entry_bytes=block_bytes))
    return TierChain(tuple(names), tuple(tiers))
