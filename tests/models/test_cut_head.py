"""A head cut short of a padded embedding (Inkling 2's `unpadded_vocab_size`: 250 logits over
256 embedding rows on the tiny model): the engine samples from and validates against the
head's 250, and still takes prompts with any of the 256 ids."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from hybridkv import LLM, SamplingParams  # noqa: E402
from tests.models.tiny import ARCHS, build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    cut = ARCHS["inkling2"][2]["unpadded_vocab_size"]
    assert cut == 250
    model_dir = build_tiny_model("inkling2", tmp_path_factory.mktemp("cut_head"))
    return LLM(str(model_dir), max_model_len=64, kv_cache_memory="4MiB")


def test_the_engine_samples_the_heads_ids(llm):
    assert llm.engine.vocab_size == 250
    [forced] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, logit_bias={249: 100}))
    assert forced.token_ids == [249] * 4
    many = llm.generate([[3, 1, 4, 1, 5]] * 2, SamplingParams(max_tokens=12, temperature=1.0,
                                                              seed=3))
    assert all(0 <= t < 250 for out in many for t in out.token_ids)


def test_a_bias_past_the_cut_is_refused_in_one_line(llm):
    with pytest.raises(ValueError, match=r"logit_bias names token 252, outside the "
                                         r"vocabulary \[0, 250\)"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logit_bias={252: 1.0}))


def test_prompts_take_every_embedding_row(llm):
    [out] = llm.generate([[5, 253, 255]], SamplingParams(max_tokens=2))
    assert len(out.token_ids) == 2
    with pytest.raises(ValueError, match=r"token id 256 is outside the vocabulary \[0, 256\)"):
        llm.generate([[5, 256]], SamplingParams(max_tokens=2))
