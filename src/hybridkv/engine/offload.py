"""Building the KV offload tiers for an engine: the tier chain, its keys' layout fingerprint,
and the shared hash seed a disk tier needs to be useful to a later process (and a remote tier
to other replicas).

The layout fingerprint names everything that decides what a block's bytes mean: the model
(its config and weights, hashed), the block hash algorithm and seed, the hash block size, and
every group's spec, block size, layers and page layout. Another model, dtype, block size or
seed gives other keys, so a tier can never serve it a block it cannot use.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from pathlib import Path

import xxhash

from hybridkv.config import EngineConfig
from hybridkv.connector.offload.chain import TierChain
from hybridkv.connector.offload.cpu_tier import CPUTier
from hybridkv.connector.offload.disk_tier import DiskTier
from hybridkv.connector.offload.redis_tier import RedisTier, parse_remote_url, shared_hash_seed
from hybridkv.connector.offload.store import KVStore, parse_tier_spec
from hybridkv.kv.plan import KVCacheConfig, format_bytes

logger = logging.getLogger(__name__)

SEED_FILE = "hybridkv-hash-seed"
SEED_CONTENT = ("one line of text, the block hash seed this directory's blocks were hashed "
                "with (64 hex digits when hybridkv made it; remove the file to start afresh: "
                "the blocks stored so far stop hitting)")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def model_identity(model_dir: str) -> bytes:
    """xxh3-128 of the model's config and weight files (their bytes, streamed), or of the
    GGUF file the model is: two checkpoints of one architecture (a fine-tune) never share
    blocks."""
    h = xxhash.xxh3_128()
    root = Path(model_dir)
    files = [root] if root.is_file() else sorted(root.iterdir())
    for path in files:
        if path.name == "config.json" or path.suffix in (*_WEIGHT_SUFFIXES, ".gguf"):
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


def _read_seed(path: Path, *, wait_s: float = 0.0) -> str:
    """The seed in an existing seed file. `wait_s`: another process created it just now and
    may not have written it yet, so an empty file is read again until then."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            seed = path.read_bytes().decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ValueError(f"kv_offload_disk: hash seed file {path} is not UTF-8 text; it "
                             f"should hold {SEED_CONTENT}") from None
        if seed or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    if not seed:
        raise ValueError(f"kv_offload_disk: hash seed file {path} is empty; it should hold "
                         f"{SEED_CONTENT}")
    return seed


def disk_hash_seed(directory: str) -> str:
    """The block hash seed kept in a disk tier's directory (created on first use, readable
    by its owner only): processes sharing the directory hash alike, so its blocks hit."""
    path = Path(directory) / SEED_FILE
    try:
        return _read_seed(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise ValueError(f"kv_offload_disk: cannot read {path}: {e.strerror or e}") from None
    seed = secrets.token_hex(32)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read_seed(path, wait_s=2.0)  # another process made it just now
    except OSError as e:
        raise ValueError(f"kv_offload_disk: directory {str(path.parent)!r} is not writable: "
                         f"{e.strerror or e}") from None
    with os.fdopen(fd, "w") as f:
        f.write(seed)
    return seed


def block_hash_seed(config: EngineConfig) -> tuple[str | None, str | None]:
    """(the seed the block hasher uses, the seed a remote tier keeps in Redis). Processes must
    hash alike to share a tier, so without a configured `block_hash_seed`:

        a remote tier   the seed stored in Redis (created there by the first process: SET
                        NX); if Redis is down at start, the disk tier's seed or a new one,
                        which the remote tier writes to Redis when it answers (and warns if
                        Redis holds another one by then: this process then shares nothing)
        a disk tier     the seed file in its directory
        neither         None: a random seed per process

    A configured seed is the user's secret: used as is, never written anywhere."""
    if config.block_hash_seed is not None:
        return config.block_hash_seed, None
    local = (disk_hash_seed(parse_tier_spec(config.kv_offload_disk, flag="kv_offload_disk")
                            .path) if config.kv_offload_disk is not None else None)
    if config.kv_remote is None:
        return local, None
    spec = parse_remote_url(config.kv_remote)
    proposed = local or secrets.token_hex(32)
    shared = shared_hash_seed(spec, proposed, timeout_s=float(config.kv_remote_timeout_s))
    if shared is None:
        logger.warning("remote KV tier at %s does not answer: block hashes use a seed of this "
                       "process's own until it does (set block_hash_seed to share blocks with "
                       "other replicas whatever happens)", spec.where)
        shared = proposed
    return shared, shared


def host_available_memory() -> int | None:
    """What the kernel reports as available (free + reclaimable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_cpu_tier_budget(capacity_bytes: int) -> None:
    """Refuse a CPU tier the host cannot hold, as kv_cache_memory is refused: the tier fills
    as blocks leave the device, so an oversized one fails long after start-up (the OOM
    killer). Checked once the model and the KV cache are allocated."""
    available = host_available_memory()
    if available is not None and capacity_bytes > available:
        raise ValueError(f"kv_offload_cpu {format_bytes(capacity_bytes)} is more than the "
                         f"host has available ({format_bytes(available)} after the model and "
                         f"the KV cache); lower kv_offload_cpu")


def build_tier_chain(config: EngineConfig, kv_config: KVCacheConfig,
                     fingerprint: bytes, *, remote_seed: str | None = None) -> TierChain:
    """The configured tiers, fastest first; a budget below one block or an unusable
    directory is a one-line error."""
    block_bytes = max(g.block_bytes for g in kv_config.groups)
    names: list[str] = []
    tiers: list[KVStore] = []
    if config.kv_offload_cpu is not None:
        check_cpu_tier_budget(int(config.kv_offload_cpu))
        names.append("cpu")
        tiers.append(CPUTier(int(config.kv_offload_cpu), min_entry_bytes=block_bytes))
    if config.kv_offload_disk is not None:
        spec = parse_tier_spec(config.kv_offload_disk, flag="kv_offload_disk")
        names.append("disk")
        tiers.append(DiskTier(spec.path, spec.capacity_bytes, fingerprint,
                              min_entry_bytes=block_bytes))
    if config.kv_remote is not None:
        names.append("remote")
        tiers.append(RedisTier(parse_remote_url(config.kv_remote), fingerprint,
                               timeout_s=float(config.kv_remote_timeout_s),
                               ttl_s=config.kv_remote_ttl_s,
                               queue_bytes=int(config.kv_remote_queue), hash_seed=remote_seed))
    return TierChain(tuple(names), tuple(tiers))
