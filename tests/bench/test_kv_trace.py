import json
from pathlib import Path

import pytest

from hybridkv.bench.kv_trace import (
    DEFAULT_MEMORY,
    kv_config,
    make_trace,
    read_trace,
    run_kv_trace,
)
from hybridkv.cli import main

SHARED = Path(__file__).resolve().parents[3] / "shared" / "bench" / "make_kv_trace.py"


def test_trace_matches_the_published_checksum():
    prompts, checksum = make_trace(num_requests=32)
    assert checksum == "d8766b41f1e3653f"
    assert len(prompts) == 32 and prompts[0][:2048] == prompts[2][:2048]


@pytest.mark.skipif(not SHARED.exists(), reason="shared/bench not beside the repository")
def test_trace_file_written_by_the_reference_script_reads_back(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "trace.jsonl"
    subprocess.run([sys.executable, str(SHARED), str(out), "--num-requests", "32"], check=True,
                   capture_output=True)
    prompts, checksum = read_trace(out)
    assert checksum == "d8766b41f1e3653f"
    assert prompts == make_trace(num_requests=32)[0]


@pytest.mark.parametrize("config", ["hybrid", "full"])
def test_ample_memory_reaches_the_ideal_hit_count(config):
    prompts, _ = make_trace(num_requests=32)
    # 40,000 four-layer blocks: all 32 prompts (172,369 tokens) fit at once in 3 groups.
    result = run_kv_trace(prompts, kv_config(config, 2 * DEFAULT_MEMORY))
    # 16 shared requests: each after the first reuses the 2,048-token prefix.
    assert result.hit_tokens == 15 * 2048
    assert result.preemptions == 0
    assert result.queried_tokens == sum(len(p) for p in prompts)
    assert result.steps == 128  # all admitted in step 1, 127 decode steps


@pytest.mark.parametrize("config, num_blocks", [("full", 2600), ("hybrid", 6000)])
def test_tight_memory_preempts_and_still_finishes(config, num_blocks):
    prompts, _ = make_trace(num_requests=32)
    # Budgets (in four-layer 64 KiB blocks) where decode growth outruns the free blocks.
    result = run_kv_trace(prompts, kv_config(config, num_blocks * 4 * 64 * 1024))
    assert result.preemptions > 0
    assert result.peak_used_bytes <= num_blocks * 4 * 64 * 1024


def test_a_request_that_can_never_fit_is_an_error_not_a_hang():
    prompts, _ = make_trace(num_requests=4)
    with pytest.raises(ValueError, match="does not fit in an empty KV cache"):
        run_kv_trace(prompts, kv_config("hybrid", 1000 * 4 * 64 * 1024))


def test_bench_kv_cli_prints_one_json_object(capsys):
    assert main(["bench", "kv", "--num-requests", "32", "--config", "full", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert set(figures) == {"wall_s", "allocate_slots_us", "allocate_slots_decode_us",
                            "allocate_slots_admit_us", "get_computed_blocks_us", "free_us",
                            "hit_tokens", "queried_tokens", "peak_used_bytes", "steps",
                            "preemptions"}
    assert figures["hit_tokens"] == 15 * 2048


def test_bench_kv_times_both_hash_algorithms(capsys):
    assert main(["bench", "kv", "--num-requests", "16", "--config", "full", "--json",
                 "--hash-cost"]) == 0
    costs = json.loads(capsys.readouterr().out)["hash_us_per_block"]
    assert set(costs) == {"xxh3", "sha256"} and all(us > 0 for us in costs.values())
