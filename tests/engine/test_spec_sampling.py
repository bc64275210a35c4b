"""Speculative sampling keeps the target distribution: the distributions of a tiny model's
first output tokens, sampled at temperature 0.5 by thousands of seeded requests, are the
same with n-gram drafts as without (total-variation distance under a bound), and the bound
is tight enough that a biased rule (on rejection, resampling from the target's whole
distribution instead of the residual) fails it."""

from __future__ import annotations

from collections import Counter

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.worker import model_runner  # noqa: E402
from hybridkv.worker.sampling.rejection import Verified  # noqa: E402
from tests.models.tiny import build_tiny_model  # noqa: E402

NUM_SAMPLES = 2000
PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]  # drafts follow any of 1-4
# Two empirical distributions of these tokens (four likely ones) from 2,000 samples each
# differ by ~0.025 in total variation by chance, rarely by more than 0.05; the biased rule
# moves a draft's probability p to p + p(1 - p) wherever it is rejected (~0.12 in total
# variation at the first drafted position here).
BOUND = 0.07
POSITIONS = (1, 2)  # output tokens drafted for (the first comes from the prompt's step)


def biased_verify_sampled(draft_ids, probs, generator=None):
    for i, draft in enumerate(draft_ids):
        if float(torch.rand((), generator=generator)) < float(probs[i, draft]):
            continue
        return Verified(list(draft_ids[:i]), int(torch.multinomial(probs[i], 1,
                                                                   generator=generator)))
    return Verified(list(draft_ids), int(torch.multinomial(probs[-1], 1,
                                                           generator=generator)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama8"), vocab_size=8)


def first_tokens(model_dir, **options) -> tuple[list[Counter[int]], list]:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=64, kv_cache_memory="16MiB",
              max_num_seqs=256, **options)
    params = [SamplingParams(max_tokens=3, temperature=0.5, top_p=0.95, seed=i)
              for i in range(NUM_SAMPLES)]
    outputs = llm.generate([PROMPT] * NUM_SAMPLES, params)
    return [Counter(o.token_ids[i] for o in outputs) for i in POSITIONS], outputs


def tv(a: Counter[int], b: Counter[int]) -> float:
    return sum(abs(a[t] - b[t]) for t in set(a) | set(b)) / (2 * NUM_SAMPLES)


def test_speculative_sampling_keeps_the_distribution(model_dir, monkeypatch):
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    plain, _ = first_tokens(model_dir)
    spec, outputs = first_tokens(model_dir, speculative_config=ngram)
    drafts = sum(o.num_draft_tokens for o in outputs)
    accepted = sum(o.num_accepted_tokens for o in outputs)
    assert 0 < accepted < drafts
    distances = [tv(p, s) for p, s in zip(plain, spec, strict=True)]
    assert max(distances) < BOUND, distances
    monkeypatch.setattr(model_runner, "verify_sampled", biased_verify_sampled)
    biased, _ = first_tokens(model_dir, speculative_config=ngram)
    assert tv(plain[0], biased[0]) > BOUND
