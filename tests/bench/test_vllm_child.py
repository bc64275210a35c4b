"""`hybridkv bench vllm`'s per-engine script, run as the bench runs it (a script of its own),
with hybridkv's engine on a tiny model: every figure, the long prompt's included."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")


def test_the_child_reports_a_long_prompt_beside_its_figures(tmp_path):
    from hybridkv.bench.peer_vllm import CHILD
    from tests.models.tiny import build_tiny_model

    # The child's token-id prompts reach id 1,002.
    model = build_tiny_model("llama", tmp_path / "hf", max_position_embeddings=4096,
                             vocab_size=1024)
    out = subprocess.run([sys.executable, str(CHILD), "hybridkv", str(model), "2", "8", "4",
                          "1", "700"], capture_output=True, text=True, timeout=600, check=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["engine"] == "hybridkv"
    assert all(figures[k] > 0 for k in ("pp512", "pp700", "tg128", "batched"))
