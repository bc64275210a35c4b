"""The LM head computed a block of vocabulary rows at a time (large heads on the CPU): the
logits equal the whole head's, and the greedy fast path (every row plain greedy, nothing
reading the logits) gives the tokens an argmax of those logits gives, ties and soft-capped
heads included. Tiny models take the blocked path here by lowering its thresholds."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.models.base import CausalLM  # noqa: E402
from tests.hooks import record_logits  # noqa: E402
from tests.models.tiny import build_tiny_model  # noqa: E402


def greedy_tokens(model, hidden):
    """The blocked head's argmax (its one best candidate a row)."""
    found = model.head_candidates(hidden, 1)
    assert found is not None and not found.nan.any()
    return found.ids[:, 0]


@pytest.fixture
def blocked(monkeypatch):
    monkeypatch.setattr(CausalLM, "BLOCKED_HEAD_WEIGHTS", 1)
    monkeypatch.setattr(CausalLM, "HEAD_BLOCK_ROWS", 48)  # not a divisor of 256


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: a soft-capped head
def test_blocked_logits_and_greedy_tokens_match_the_whole_head(arch, tmp_path, blocked,
                                                               monkeypatch):
    # A tied head on the torch linear kernel stays the embedding's nn.Linear, the layout of
    # Gemma's 262k x 640 head (a packed or untied head is computed whole).
    llm = LLM(str(build_tiny_model(arch, tmp_path, tie_word_embeddings=True)),
              dtype="float32", device="cpu",
              max_model_len=64, kv_cache_memory="4MiB", linear_kernel="torch")
    model = llm.engine.runner.model
    hidden = torch.randn(5, model.lm_head.weight.shape[1])
    blocked_logits = model.compute_logits(hidden)
    assert model._head_blocks(hidden) is not None
    monkeypatch.setattr(CausalLM, "BLOCKED_HEAD_WEIGHTS", 1 << 40)
    whole = model.compute_logits(hidden)
    torch.testing.assert_close(blocked_logits, whole, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(CausalLM, "BLOCKED_HEAD_WEIGHTS", 1)
    assert torch.equal(greedy_tokens(model, hidden), torch.argmax(blocked_logits, dim=-1))
    # A tie across blocks keeps the first index, as torch.argmax does: rows 3 and 200 of
    # the head made equal and the largest for the first hidden state.
    weight = model.lm_head.weight.data
    saved = weight.clone()
    try:
        weight[3] = weight[200] = hidden[0] * 10
        tokens = greedy_tokens(model, hidden)
        assert tokens[0] == 3
        assert torch.equal(tokens, torch.argmax(model.compute_logits(hidden), dim=-1))
    finally:
        weight.copy_(saved)


def test_the_greedy_fast_path_gives_the_sampled_tokens(tmp_path, blocked):
    model_dir = build_tiny_model("llama", tmp_path, tie_word_embeddings=True)
    prompts = [[5, 9, 17, 33, 65] * 4, [7] * 11]
    options = dict(dtype="float32", device="cpu", max_model_len=64, kv_cache_memory="4MiB",
                   linear_kernel="torch")
    fast = LLM(str(model_dir), **options)
    slow = LLM(str(model_dir), **options)
    record_logits(slow)  # a logits hook: every step takes the full logits and the sampler
    params = SamplingParams(max_tokens=8)
    calls = []
    candidates = fast.engine.runner.model.head_candidates
    fast.engine.runner.model.head_candidates = \
        lambda h, k: calls.append(k) or candidates(h, k)
    assert [o.token_ids for o in fast.generate(prompts, params)] == \
        [o.token_ids for o in slow.generate(prompts, params)]
    assert calls and set(calls) == {1}  # the fast path ran, one candidate a row
