"""Defaults that fit: without kv_cache_memory the KV cache gets what max_num_seqs requests of
max_model_len need (stated in one logged line), capped by the memory available; without
max_model_len the model's context is lowered to what one request can hold under that cap,
with one logged line; an explicit max_model_len that does not fit is still refused."""

from __future__ import annotations

import logging
import random

import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.engine import build
from hybridkv.kv.plan import format_bytes, memory_for_requests
from tests.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny"),
                            max_position_embeddings=4096)


def test_the_cap_is_a_share_of_available_memory():
    available = build.available_memory("cpu")
    cap, why = build.kv_memory_cap("cpu")
    assert available is not None and 0 < cap <= available // 2
    assert cap <= build.AUTO_KV_CAP and why


@pytest.mark.parametrize("arch", ["llama", "gemma3", "nemotron_h"])  # plain, sliding, state
def test_default_budget_runs_max_num_seqs_requests_of_max_model_len(arch, tmp_path, caplog):
    model = build_tiny_model(arch, tmp_path)
    with caplog.at_level(logging.INFO, logger="hybridkv.engine.build"):
        llm = LLM(str(model), dtype="float32", max_model_len=128, max_num_seqs=4)
    plan = llm.engine.plan
    # What 4 requests of 128 tokens need (well under a MiB for these layers, a few MiB for
    # the state model's checkpoints), not a share of the machine.
    assert plan.max_concurrency >= 4 and plan.memory_bytes < 16 << 20
    [line] = [r.getMessage() for r in caplog.records if "KV cache memory" in r.getMessage()]
    assert f"{format_bytes(plan.memory_bytes)}, for 512 tokens = max_model_len 128 x " \
           f"max_num_seqs 4" in line
    assert "--kv-cache-memory" in line
    # 4 requests of max_model_len run at once, none preempted.
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 250) for _ in range(120)] for _ in range(4)]
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=8, temperature=0.0,
                                                          ignore_eos=True))
    most = 0
    while engine.has_unfinished:
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most == 4 and engine.scheduler.num_preemptions == 0


def test_the_budget_is_the_smallest_that_runs_them():
    """Torch-free: the planner's sizing is tight to a large page."""
    from hybridkv.kv.plan import plan_kv_cache
    from hybridkv.models.layer_mix import kv_layout_from_config, load_hf_config

    # (The state model without prefix caching: with it, its requests' checkpoints take
    # room that max_concurrency, a steady-state figure, does not count.)
    for name, caching in (("Llama-3.1-8B", True), ("gemma-3-270m", True),
                          ("Nemotron-H-8B-Base-8K", False)):
        layout = kv_layout_from_config(load_hf_config(name), kv_dtype="bf16")
        options = dict(max_model_len=4096, max_num_batched_tokens=2048,
                       kv_sharing=layout.kv_sharing, enable_caching=caching)
        need = memory_for_requests(layout.layer_specs, 16, **options)
        plan = plan_kv_cache(layout.layer_specs, need, **options)
        assert plan.max_concurrency >= 16, name
        smaller = plan_kv_cache(layout.layer_specs, need - plan.config.large_page_bytes,
                                **options)
        assert smaller.max_concurrency < 16, name


def test_context_lowered_to_what_fits(tiny, monkeypatch, caplog):
    monkeypatch.setattr(build, "kv_memory_cap", lambda device: (1 << 20, "1 MiB"))
    with caplog.at_level(logging.INFO, logger="hybridkv.engine.build"):
        llm = LLM(str(tiny), dtype="float32")
    assert 0 < llm.engine.max_model_len < 4096
    assert llm.engine.plan.memory_bytes == 1 << 20
    lines = [r.getMessage() for r in caplog.records if "max_model_len lowered" in r.getMessage()]
    assert len(lines) == 1 and f"to {llm.engine.max_model_len}" in lines[0]
    [budget] = [r.getMessage() for r in caplog.records if "KV cache memory" in r.getMessage()]
    assert "1 MiB: 262,144 tokens = max_model_len 4096 x max_num_seqs 64 would need" in budget
    # A prompt filling the lowered length runs.
    out = llm.generate([[5] * (llm.engine.max_model_len - 1)], None)[0]
    assert out.error is None


def test_explicit_length_that_does_not_fit_is_refused(tiny, monkeypatch):
    monkeypatch.setattr(build, "kv_memory_cap", lambda device: (1 << 20, "1 MiB"))
    with pytest.raises(ValueError, match="too small for one request of 4096 tokens"):
        LLM(str(tiny), dtype="float32", max_model_len=4096)
