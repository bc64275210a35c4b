"""int8 KV pages on the real SmolLM2-135M-Instruct (a GGUF installed from PyPI): the first
step's logits stay within a stated bound of float32 pages (measured 0.32 on logits of
magnitude ~40), and a prefix hit on int8 pages changes no token. Accuracy over a long text
is `hybridkv bench kv-quant`'s (docs/benchmarks.md)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.models.sources import real_model_path  # noqa: E402
from tests.hooks import record_logits  # noqa: E402

PROMPT = ("The GNU General Public License is a free, copyleft license for software and other "
          "kinds of works. The licenses for most software")
NAME = "smollm2-135m-instruct"


def _engine(**options) -> LLM:
    try:
        real_model_path(NAME)
    except ValueError as e:
        pytest.skip(str(e))
    return LLM(NAME, kv_cache_memory="64MiB", max_model_len=512, **options)


def test_int8_pages_on_the_real_model():
    base = _engine()
    seen = record_logits(base)
    ref = base.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))[0]
    ref_logits = seen[ref.request_id][0]
    llm = _engine(kv_cache_dtype="int8")
    seen = record_logits(llm)
    params = SamplingParams(temperature=0, max_tokens=12)
    first = llm.generate([PROMPT], params)[0]
    assert float((seen[first.request_id][0] - ref_logits).abs().max()) < 1.0
    assert set(ref_logits.topk(5).indices.tolist()) == set(
        seen[first.request_id][0].topk(5).indices.tolist())
    again = llm.generate([PROMPT], params)[0]
    assert again.num_cached_tokens > 0
    assert again.token_ids == first.token_ids
