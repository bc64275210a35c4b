"""Block hashes: keyed by a seed, per-process random by default, xxh3 or sha256."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridkv.kv.hashing import (
    BlockHasher,
    hash_cost_per_block,
    hash_fingerprint,
    make_block_hasher,
    random_seed,
)
from hybridkv.kv.manager import KVCacheManager
from hybridkv.kv.request import KVRequest
from tests.kv.toy import BLOCK, full, mamba, toy_config

TOKENS = list(range(100, 118))  # 4 full blocks of 4


def hashes(hasher: BlockHasher, tokens: list[int] = TOKENS) -> list[bytes]:
    return KVRequest("r", tokens, hash_block_size=BLOCK, block_hasher=hasher).block_hashes


def in_fresh_process(code: str) -> str:
    return subprocess.run([sys.executable, "-c", "from hybridkv.kv.hashing import *\n" + code],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("algo", ["xxh3", "sha256"])
def test_same_seed_same_hashes_in_two_processes(algo):
    mine = hashes(BlockHasher("s3cret", algo))
    assert mine == hashes(BlockHasher(b"s3cret", algo))  # constructed twice; str = utf-8
    assert len(mine) == 4 and len(mine[0]) == (16 if algo == "xxh3" else 32)
    theirs = in_fresh_process(
        f"h = []; BlockHasher('s3cret', {algo!r}).extend_block_hashes(h, {TOKENS}, {BLOCK});"
        f"print(','.join(x.hex() for x in h))")
    assert theirs.split(",") == [h.hex() for h in mine]


def test_different_seeds_or_algorithms_give_different_hashes_and_fingerprints():
    a, b = BlockHasher("alice"), BlockHasher("bob")
    c = BlockHasher("alice", "sha256")
    assert not set(hashes(a)) & set(hashes(b))
    assert not set(hashes(a)) & set(hashes(c))
    assert len({a.fingerprint, b.fingerprint, c.fingerprint}) == 3
    assert a == BlockHasher("alice") and a != b
    assert hash_fingerprint("alice") == a.fingerprint and len(a.fingerprint) == 16
    assert "alice" not in repr(a)


def test_the_default_seed_is_random_per_process_and_shared_within_one():
    assert random_seed() != random_seed()
    assert len(random_seed()) == 32
    assert make_block_hasher() is make_block_hasher()  # requests and manager agree
    assert make_block_hasher().fingerprint != make_block_hasher("x").fingerprint
    code = "print(hash_fingerprint())"
    assert in_fresh_process(code) != in_fresh_process(code)


def test_bad_hash_settings_are_refused():
    with pytest.raises(ValueError, match="accepted: xxh3, sha256"):
        BlockHasher("x", "md5")
    with pytest.raises(ValueError, match="seed is empty"):
        BlockHasher(b"")


@pytest.mark.parametrize("algo", ["xxh3", "sha256"])
def test_prefix_hits_end_to_end_with_a_seed(algo):
    m = KVCacheManager(toy_config(full(), mamba(), num_pages=40), max_model_len=1024,
                       hash_seed="shared secret", hash_algo=algo)
    assert m.hash_fingerprint == hash_fingerprint("shared secret", algo)
    a = KVRequest("a", TOKENS, hash_block_size=BLOCK, block_hasher=m.block_hasher)
    assert m.allocate_slots(a, a.num_tokens) is not None
    a.num_computed_tokens = a.num_tokens
    # Another process with the same seed hashes b the same way: equal hasher, new object.
    b = KVRequest("b", TOKENS + [5], hash_block_size=BLOCK,
                  block_hasher=BlockHasher("shared secret", algo))
    hit = m.get_computed_blocks(b)
    assert hit.num_computed_tokens == 16  # the checkpoint at the prompt end of a
    assert m.allocate_slots(b, b.num_tokens - 16, 16, hit.blocks) is not None
    m.check_integrity()


def test_a_request_hashed_differently_is_refused_not_silently_missed():
    m = KVCacheManager(toy_config(full(), num_pages=10), max_model_len=64, hash_seed="k")
    stranger = KVRequest("s", TOKENS, hash_block_size=BLOCK)  # the process default
    with pytest.raises(ValueError, match="hashed with"):
        m.get_computed_blocks(stranger)


def test_hash_cost_per_block_reports_both_algorithms():
    costs = hash_cost_per_block(num_blocks=200, repeat=1)
    assert set(costs) == {"xxh3", "sha256"} and all(c > 0 for c in costs.values())
