import json

import pytest

pytest.importorskip("torch")

from hybridkv.bench.prefix import single_page_block_size  # noqa: E402
from hybridkv.cli import main  # noqa: E402


def test_single_page_block_size_of_real_state_hybrids():
    # Nemotron-H-8B: a 2.16 MB Mamba2 state per layer vs 4 KiB per token per attention layer.
    assert single_page_block_size("Nemotron-H-8B-Base-8K") == 528
    assert single_page_block_size("gemma-3-27b-it") is None


def test_bench_prefix_runs_and_branch_points_only_add_hits(capsys):
    assert main(["bench", "prefix", "--systems", "1", "--conversations-per-system", "2",
                 "--turns", "2", "--answer-len", "4", "--json"]) == 0
    both = json.loads(capsys.readouterr().out)
    figures = both["nemotron_h"]
    ends, branches = figures["prompt_ends"], figures["branch_points"]
    assert ends["prompt_tokens"] == branches["prompt_tokens"] > 0
    assert branches["hit_tokens"] >= ends["hit_tokens"] > 0
    assert any(k.startswith("single_page_block_") for k in figures)
    # Attention-only: no state constraint, every cached full block is reused.
    assert both["gemma3"]["prompt_ends"]["hit_tokens"] >= branches["hit_tokens"]
