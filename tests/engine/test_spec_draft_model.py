"""Speculative decoding with a draft model (`speculative_config` method draft_model) on tiny
random models: greedy tokens with drafts equal the tokens without, on attention, sliding,
state and hybrid targets, under prefix hits, chunked prefill and preemption; the draft's
layers are planned in the target's arena; bad drafts are refused in one line.

Both models keep four rows of their output head (test_spec_decode.narrow_head), so their
tokens come from one small alphabet: an unrelated draft then guesses some of the target's
tokens right and many wrong. The target as its own draft must guess every one right; there
the models keep their whole head (`whole`), whose argmax turns on small changes of the
context, so that draft KV one position stale shows as a rejected draft."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.worker.spec.draft_model import DRAFT_PREFIX  # noqa: E402
from tests.engine.test_spec_decode import (  # noqa: E402
    ALPHABET,
    GREEDY,
    PROMPTS,
    engine,
    narrow_head,
    tiny,
)
from tests.models.tiny import build_tiny_model, planner_minimum  # noqa: E402

# A smaller llama than the targets (one layer, narrower), with their vocabulary.
SMALL = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
             num_attention_heads=2, num_key_value_heads=1, head_dim=16)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return narrow_head(build_tiny_model("llama", tmp_path_factory.mktemp("draft"), **SMALL))


def whole(name: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(name, tmp_path_factory.mktemp(name + "_whole"))


def drafting(draft: Path, k: int = 4) -> dict[str, object]:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}


def check_equal_with_draft(model_dir: Path, draft: Path, prompts: list[list[int]] = PROMPTS,
                           params: SamplingParams = GREEDY, **options: object
                           ) -> tuple[list, LLM]:
    plain = engine(model_dir, **options).generate(prompts, params)
    spec_llm = engine(model_dir, speculative_config=drafting(draft), **options)
    spec = spec_llm.generate(prompts, params)
    for p, s in zip(plain, spec, strict=True):
        assert s.token_ids == p.token_ids
    spec_llm.engine.kv_manager.check_integrity()
    return spec, spec_llm


def counts(outputs: list) -> tuple[int, int]:
    return (sum(o.num_accepted_tokens for o in outputs),
            sum(o.num_draft_tokens for o in outputs))


# Full attention; sliding + full; Mamba2 + attention; Mamba1 alone (the draft's layers are
# then a group of their own beside the state group); Gated DeltaNet + attention.
TARGETS = ["llama", "gemma3", "nemotron_h", "mamba", "qwen3_5_text"]


@pytest.mark.parametrize("name", TARGETS)
def test_greedy_equal_with_a_small_draft(name, draft_dir, tmp_path_factory):
    spec, llm = check_equal_with_draft(tiny(name, tmp_path_factory), draft_dir)
    accepted, drafts = counts(spec)
    assert 0 < accepted < drafts, (accepted, drafts)  # some kept, some rejected
    # The draft's layers are layers of the one plan, in the one arena.
    groups = llm.engine.plan.config.groups
    draft_layers = [n for g in groups for n in g.layer_names if n.startswith(DRAFT_PREFIX)]
    assert draft_layers == [DRAFT_PREFIX + "model.layers.0.self_attn"]


@pytest.mark.parametrize("name", ["llama", "gemma3"])  # (a state model drafts for none)
def test_the_target_as_its_own_draft_has_every_draft_accepted(name, tmp_path_factory):
    model_dir = whole(name, tmp_path_factory)
    spec, _ = check_equal_with_draft(model_dir, model_dir)
    accepted, drafts = counts(spec)
    assert drafts > 0 and accepted == drafts


def test_draft_pages_share_the_target_blocks(draft_dir, tmp_path_factory, caplog):
    # A full-attention target: the draft's full layer joins its group (one block table),
    # and the plan's bytes per block grow by the draft's pages; the startup log says so.
    model_dir = tiny("llama", tmp_path_factory)
    plain = engine(model_dir).engine.plan.config
    with caplog.at_level("INFO", logger="hybridkv.engine.build"):
        with_draft = engine(model_dir,
                            speculative_config=drafting(draft_dir)).engine.plan.config
    assert "1 attention layers in the KV cache plan beside the target's" in caplog.text
    assert "128 bytes per token more than the target's 512" in caplog.text
    assert len(with_draft.groups) == len(plain.groups) == 1
    [group] = with_draft.groups
    draft_page = 2 * 16 * 1 * 16 * 4  # K and V, 16 tokens, 1 KV head of 16, float32
    assert group.block_bytes == plain.groups[0].block_bytes + draft_page


# Prompts sharing a 32-token prefix (hits), 24-token steps (chunked prefill), 80 tokens
# each and a cache a little over what one request of max_model_len needs (preemption).
SHARED_PROMPTS = [ALPHABET * 8 + [7, 8, 9] * i for i in range(1, 5)]
LONG = SamplingParams(max_tokens=80, ignore_eos=True)


def under_pressure(model_dir: Path, factor: float, **options: object) -> dict[str, object]:
    dtype = str(options.get("kv_cache_dtype", "auto"))
    budget = int(factor * planner_minimum(model_dir, max_model_len=128, batch=24,
                                          kv_cache_dtype=dtype))
    return dict(options, max_num_batched_tokens=24, kv_cache_memory=budget,
                max_model_len=128)


@pytest.mark.parametrize("name, factor", [("llama", 1.4), ("nemotron_h", 1.1)])
def test_with_prefix_hits_chunked_prefill_and_preemption(name, factor, draft_dir,
                                                         tmp_path_factory):
    model_dir = tiny(name, tmp_path_factory)
    spec, llm = check_equal_with_draft(model_dir, draft_dir, SHARED_PROMPTS, LONG,
                                       **under_pressure(model_dir, factor))
    assert sum(s.num_cached_tokens for s in spec) > 0
    assert llm.engine.scheduler.num_preemptions > 0
    accepted, drafts = counts(spec)
    assert accepted < drafts  # (acceptance under pressure: the self-draft test below)


@pytest.mark.parametrize("name, options", [
    ("llama", {}), ("gemma3", {}), ("llama", {"kv_cache_dtype": "int8"}),
])
def test_self_draft_keeps_every_draft_under_hits_chunks_and_preemption(name, options,
                                                                       tmp_path_factory):
    # The target as its own draft guesses right exactly when the draft's KV is that of the
    # request's tokens: stale KV after a rejection, a prefix hit, a chunk or a preemption
    # would show as a rejected draft. (Its pages double the target's: twice the budget.)
    model_dir = whole(name, tmp_path_factory)
    spec, llm = check_equal_with_draft(model_dir, model_dir, SHARED_PROMPTS, LONG,
                                       **under_pressure(model_dir, 2.6, **options))
    assert sum(s.num_cached_tokens for s in spec) > 0
    assert llm.engine.scheduler.num_preemptions > 0
    accepted, drafts = counts(spec)
    assert drafts > 0 and accepted == drafts


def test_draft_pages_come_back_from_an_offload_tier(tmp_path_factory):
    # The device cache forgotten, the second run's prefixes load from the CPU tier, draft
    # pages and all: the self-draft still keeps every draft.
    model_dir = whole("llama", tmp_path_factory)
    llm = engine(model_dir, speculative_config=drafting(model_dir), kv_offload_cpu="8MiB")
    first = llm.generate(SHARED_PROMPTS, GREEDY)
    assert llm.reset_prefix_cache()
    again = llm.generate(SHARED_PROMPTS, GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert sum(o.cached_tokens_by_tier["cpu"] for o in again) > 0
    accepted, drafts = counts(again)
    assert drafts > 0 and accepted == drafts


def test_speculative_sampling_over_draft_model_guesses_keeps_the_distribution(tmp_path):
    # As test_spec_sampling's n-gram case: the first drafted output tokens of 2,000 seeded
    # requests at temperature 0.5 are distributed as without speculation. A draft model's
    # greedy guess is a point (q = 1 on it), as a proposer's is.
    from tests.engine.test_spec_sampling import BOUND, first_tokens, tv

    target = build_tiny_model("llama", tmp_path / "target", vocab_size=8)
    draft = build_tiny_model("llama", tmp_path / "draft", vocab_size=8, **SMALL)
    plain, _ = first_tokens(target)
    spec, outputs = first_tokens(target, speculative_config=drafting(draft, k=3))
    accepted, drafts = counts(outputs)
    assert 0 < accepted < drafts
    distances = [tv(p, s) for p, s in zip(plain, spec, strict=True)]
    assert max(distances) < BOUND, distances


def test_bad_drafts_fail_in_one_line(draft_dir, tmp_path, tmp_path_factory):
    model_dir = tiny("llama", tmp_path_factory)
    other_vocab = build_tiny_model("llama", tmp_path / "v128", vocab_size=128, **SMALL)
    state_draft = build_tiny_model("mamba", tmp_path / "mamba")
    for config, message in [
        (drafting(other_vocab), "has a vocabulary of 128 tokens, the target 256"),
        (drafting(tmp_path / "nowhere"), "no such file or directory"),
        (drafting(state_draft), "has state layers (mamba); draft models must be "
                                "attention-only"),
        (drafting(draft_dir, k=0), "num_speculative_tokens must be an integer in [1, 64]"),
        ({"method": "draft_model"}, "method 'draft_model' needs a model"),
    ]:
        with pytest.raises(ValueError) as e:
            engine(model_dir, speculative_config=config)
        assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="kv_cache_dtype 'q4' is not supported with a draft"):
        engine(model_dir, speculative_config=drafting(draft_dir), kv_cache_dtype="q4")
