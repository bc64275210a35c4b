"""`hybridkv bench gguf` on a tiny GGUF file, without llama.cpp: every hybridkv figure,
the long prompt's in a process of its own, and two processes' memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("gguf")
pytest.importorskip("transformers")


def test_bench_gguf_reports_a_long_prompt_beside_the_batch_1_figures(tmp_path):
    from tests.models.gguf_writer import write_gguf
    from tests.models.tiny import build_tiny_model

    # The bench's token-id prompts reach id 1,002.
    model_dir = build_tiny_model("llama", tmp_path / "hf", max_position_embeddings=4096,
                                 vocab_size=1024)
    path = write_gguf(model_dir, tmp_path / "model.gguf")
    cores = sorted(os.sched_getaffinity(0))
    threads = min(2, len(cores))  # all the cores CI has
    out = subprocess.run(
        [sys.executable, "-m", "hybridkv.cli", "bench", "gguf", str(path), "--rounds", "1",
         "--no-batched", "--long-prompt", "640", "--llama-bin", str(tmp_path / "none"),
         "--threads", str(threads), "--two-processes", "--json"], capture_output=True,
        text=True, timeout=600, check=True)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["threads"] == threads
    assert summary["pin"] == ",".join(str(c) for c in cores[:threads])
    figures = summary["hybridkv"]
    assert {"pp512", "pp640", "tg128", "rss_mib", "load_s"} <= figures.keys()
    assert all(figures[k] > 0 for k in ("pp512", "pp640", "tg128"))
    assert "llama.cpp" not in summary  # not built here: no peer figures, no ratios
    two = summary["two_processes"]  # both alive at once: each holds resident pages
    assert len(two["rss_mib"]) == len(two["pss_mib"]) == 2
    assert all(0 < p < r for p, r in zip(two["pss_mib"], two["rss_mib"], strict=True))
    assert two["pss_sum_over_rss"] < 2


def test_a_long_prompt_of_512_tokens_is_refused_in_one_line(tmp_path, capsys):
    """pp512 is measured already: a long prompt of 512 would overwrite it (and print it twice)."""
    from hybridkv.cli import main

    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"GGUF")  # refused before the file is read
    assert main(["bench", "gguf", str(gguf_file), "--long-prompt", "512"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("--long-prompt 512 is the 512-token prompt already measured; give "
                            "another length"), err


def test_threads_need_a_core_each(tmp_path, capsys):
    from hybridkv.cli import main

    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"GGUF")
    cores = len(os.sched_getaffinity(0))
    assert main(["bench", "gguf", str(gguf_file), "--threads", str(cores + 1)]) != 0
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"--threads {cores + 1} is more than the {cores} cores this process may run on")
    assert main(["bench", "gguf", str(gguf_file), "--threads", "2", "--pin", "0"]) != 0
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--pin 0 names 1 core(s) for --threads 2: each thread needs a core of its own")
