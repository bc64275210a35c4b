"""A preemption storm: 64 requests with shared prefixes, on an SSM hybrid (NemotronH) and a
sliding-window hybrid (Gemma 3), at KV budgets from the planner's minimum to twice it, with
prefix caching on and off. Every request must finish with the tokens it gets with ample
memory (greedy, float32), and the books must be clean afterwards: nothing aborted, nothing
raised, no block left in use."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridkv import LLM, SamplingParams  # noqa: E402
from tests.models.tiny import build_tiny_model, planner_minimum  # noqa: E402

MAX_MODEL_LEN, BATCH = 96, 32
PARAMS = SamplingParams(max_tokens=6)


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    systems = [[rng.randrange(4, 256) for _ in range(n)] for n in (33, 20)]
    prompts = []
    for i in range(64):
        head = systems[i % 2] if i % 3 else []
        prompts.append(head + [rng.randrange(4, 256) for _ in range(rng.randrange(3, 40))])
    return prompts


@pytest.fixture(scope="module", params=["nemotron_h", "gemma3"])
def model(request, tmp_path_factory):
    model_dir = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    prompts = _prompts()
    ample = LLM(str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN,
                max_num_batched_tokens=BATCH, kv_cache_memory="64MiB")
    expected = [o.token_ids for o in ample.generate(prompts, PARAMS)]
    return model_dir, prompts, expected


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no_caching"])
@pytest.mark.parametrize("scale", [1.0, 1.5, 2.0])
def test_storm_finishes_with_the_tokens_of_ample_memory(model, caching, scale):
    model_dir, prompts, expected = model
    llm = LLM(str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN,
              max_num_batched_tokens=BATCH, enable_prefix_caching=caching,
              kv_cache_memory=int(scale * planner_minimum(
                  model_dir, max_model_len=MAX_MODEL_LEN, batch=BATCH, caching=caching)))
    outs = llm.generate(prompts, PARAMS)
    assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
    assert [o.token_ids for o in outs] == expected
    if scale == 1.0 and caching:
        # At the minimum with checkpoints competing for pages, requests outgrow the cache.
        assert llm.engine.scheduler.num_preemptions > 0
    kv = llm.engine.kv_manager
    kv.pool.check_integrity()
    assert kv.usage == 0.0 and not llm.engine.scheduler.has_unfinished
