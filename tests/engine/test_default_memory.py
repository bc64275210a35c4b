"""Defaults that fit: without kv_cache_memory the KV cache is sized from the memory available,
and without max_model_len the model's context is lowered to what one request can hold, with
one logged line; an explicit max_model_len that does not fit is still refused."""

from __future__ import annotations

import logging

import pytest

from hybridkv import LLM
from hybridkv.engine import build
from tests.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny"),
                            max_position_embeddings=4096)


def test_auto_budget_is_a_share_of_available_memory():
    available = build.available_memory("cpu")
    budget = build.auto_kv_cache_memory("cpu")
    assert available is not None and 0 < budget <= available // 2
    assert budget <= build.AUTO_KV_CAP


def test_context_lowered_to_what_fits(tiny, monkeypatch, caplog):
    monkeypatch.setattr(build, "auto_kv_cache_memory", lambda device: 1 << 20)  # 1 MiB
    with caplog.at_level(logging.WARNING, logger="hybridkv.engine.build"):
        llm = LLM(str(tiny), dtype="float32")
    assert 0 < llm.engine.max_model_len < 4096
    lines = [r.getMessage() for r in caplog.records if "max_model_len lowered" in r.getMessage()]
    assert len(lines) == 1 and f"to {llm.engine.max_model_len}" in lines[0]
    # A prompt filling the lowered length runs.
    out = llm.generate([[5] * (llm.engine.max_model_len - 1)], None)[0]
    assert out.error is None


def test_explicit_length_that_does_not_fit_is_refused(tiny, monkeypatch):
    monkeypatch.setattr(build, "auto_kv_cache_memory", lambda device: 1 << 20)
    with pytest.raises(ValueError, match="too small for one request of 4096 tokens"):
        LLM(str(tiny), dtype="float32", max_model_len=4096)
