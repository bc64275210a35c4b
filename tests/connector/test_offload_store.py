"""The store interface's helpers: keys, tier specs, the torch-free import, and that both tiers
are `KVStore`s."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.connector.offload import (
    CPUTier,
    DiskTier,
    KVStore,
    TierSpec,
    make_key,
    parse_bytes,
    parse_tier_spec,
)
from tests.kv.test_no_torch import BLOCK_TORCH


def test_keys_keep_fingerprint_group_and_hash_apart():
    # Moving a byte between the fingerprint and the hash, or changing the group, changes the key.
    keys = {make_key(b"ab", 0, b"c"), make_key(b"a", 0, b"bc"), make_key(b"ab", 1, b"c"),
            make_key(b"", 0, b"abc")}
    assert len(keys) == 4
    assert make_key(b"ab", 7, b"h") == make_key(b"ab", 7, b"h")


@pytest.mark.parametrize("args", [(b"x" * 70_000, 0, b"h"), (b"fp", -1, b"h"),
                                  (b"fp", 2**32, b"h")])
def test_a_key_that_cannot_be_encoded_is_one_line(args):
    with pytest.raises(ValueError) as e:
        make_key(*args)
    assert "\n" not in str(e.value)


def test_tier_spec():
    assert parse_tier_spec("/mnt/kv:50GiB") == TierSpec("/mnt/kv", 50 << 30)
    assert parse_tier_spec("/a:b/kv:512MiB") == ("/a:b/kv", 512 << 20)  # colons in the path
    assert parse_tier_spec("kv:1000") == ("kv", 1000)
    assert parse_bytes("2GiB") == 2 << 30


@pytest.mark.parametrize(("spec", "says"), [
    ("/mnt/kv", "has no size"),
    (":50GiB", "empty path"),
    ("  :50GiB", "empty path"),
    ("/mnt/kv:lots", "cannot read 'lots'"),
    ("/mnt/kv:", "cannot read ''"),
    ("/mnt/kv:0GiB", "more than 0 bytes"),
])
def test_bad_tier_specs_fail_with_one_line(spec, says):
    with pytest.raises(ValueError) as e:
        parse_tier_spec(spec)
    assert says in str(e.value)
    assert "--kv-offload-disk" in str(e.value)
    assert "\n" not in str(e.value)


def test_both_tiers_are_kv_stores(tmp_path: Path):
    stores: list[KVStore] = [CPUTier(1 << 20), DiskTier(tmp_path, 1 << 20, b"fp")]
    assert all(isinstance(s, KVStore) for s in stores)


def test_offload_imports_and_runs_without_torch(tmp_path: Path):
    code = BLOCK_TORCH + f"""
from hybridkv.connector.offload import CPUTier, DiskTier, make_key
key = make_key(b"fp", 0, b"h")
for tier in (CPUTier(100), DiskTier({str(tmp_path)!r}, 1000, b"fp")):
    assert tier.put([(key, b"abc")]) == [True]
    assert tier.get([key]) == [b"abc"]
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
