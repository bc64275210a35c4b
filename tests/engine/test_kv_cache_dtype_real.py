"""int8 and q4 KV pages on the real SmolLM2-135M-Instruct (a GGUF installed from PyPI): the
first step's logits stay within a stated bound of float32 pages (int8: measured 0.32 on
logits of magnitude ~40; q4: 1.29 of ~30), and a prefix hit (and for q4, chunks that end
inside key groups) changes no token. Accuracy over a long text
is `hybridkv bench kv-quant`'s (docs/benchmarks.md)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.models.sources import real_model_path  # noqa: E402
from tests.hooks import record_logits  # noqa: E402

# Its greedy tokens win by >= 0.2 logits (checked below): a hit recomputes the last
# block's tokens in a batch of another shape, whose float rounding can flip an int8 value
# at a rounding boundary (~0.05 logits); at a near tie (0.006 apart in float32 pages, as
# the license text's first token) that picks the other token, without caching being wrong.
PROMPT = ("The capital of France is Paris. The capital of Germany is Berlin. The capital of "
          "Italy is")
NAME = "smollm2-135m-instruct"


PARAMS = SamplingParams(temperature=0, max_tokens=12)


def _engine(**options) -> LLM:
    try:
        real_model_path(NAME)
    except ValueError as e:
        pytest.skip(str(e))
    return LLM(NAME, kv_cache_memory="64MiB", max_model_len=512, **options)


def _reference_and_quantized(prompt: str, kv_cache_dtype: str):
    """(float32 pages' first-step logits, the quantized engine, its 12 greedy tokens'
    output and their logits), each greedy step's top two at least 0.1 apart."""
    base = _engine()
    seen = record_logits(base)
    ref = base.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    ref_logits = seen[ref.request_id][0]
    llm = _engine(kv_cache_dtype=kv_cache_dtype)
    seen = record_logits(llm)
    first = llm.generate([prompt], PARAMS)[0]
    logits = seen[first.request_id]
    gaps = [float(top.values[0] - top.values[1]) for top in (lg.topk(2) for lg in logits)]
    assert min(gaps) > 0.1
    return ref_logits, llm, first, logits


def test_int8_pages_on_the_real_model():
    ref_logits, llm, first, logits = _reference_and_quantized(PROMPT, "int8")
    assert float((logits[0] - ref_logits).abs().max()) < 1.0
    assert set(ref_logits.topk(5).indices.tolist()) == set(logits[0].topk(5).indices.tolist())
    again = llm.generate([PROMPT], PARAMS)[0]
    assert again.num_cached_tokens > 0
    assert again.token_ids == first.token_ids


# 40 tokens: two whole key groups that a hit reads from the pages, then an unfinished one.
PROMPT_Q4 = ("The capital of France is Paris. The capital of Germany is Berlin. The capital of "
             "Spain is Madrid. The capital of Portugal is Lisbon. The capital of Austria is "
             "Vienna. The capital of Italy is")


def test_q4_pages_on_the_real_model():
    ref_logits, llm, first, logits = _reference_and_quantized(PROMPT_Q4, "q4")
    assert float((logits[0] - ref_logits).abs().max()) < 2.0
    assert ref_logits.topk(2).indices.tolist() == logits[0].topk(2).indices.tolist()
    again = llm.generate([PROMPT_Q4], PARAMS)[0]
    assert again.num_cached_tokens >= 32
    assert again.token_ids == first.token_ids
    chunked = _engine(kv_cache_dtype="q4", max_num_batched_tokens=7,
                      enable_prefix_caching=False)
    assert chunked.generate([PROMPT_Q4], PARAMS)[0].token_ids == first.token_ids
