"""Penalties, logit bias, min-p and n > 1 samples, checked against transformers' logits
processors and against a plain re-implementation applied to the model's own logits."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridkv import LLM, SamplingParams  # noqa: E402
from tests.hooks import record_logits  # noqa: E402
from tests.models.tiny import build_tiny_model  # noqa: E402

PROMPTS = [[5 + (7 * i) % 200 for i in range(40)], [9, 8, 7, 6, 9, 8, 7]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture()
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", max_model_len=128, kv_cache_memory="4MiB")


def test_repetition_penalty_matches_transformers(model_dir, llm):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = SamplingParams(max_tokens=16, repetition_penalty=1.8)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                          repetition_penalty=1.8, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist()
    # And the penalty changed something: without it the tokens differ.
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=16))
    assert [o.token_ids for o in plain] != [o.token_ids for o in outs]


def _penalized(logits, prompt, output, p):
    """OpenAI's presence/frequency and the CTRL repetition penalty, one token at a time."""
    logits = logits.clone()
    for token in set(prompt) | set(output):
        if p.repetition_penalty != 1.0:
            value = logits[token]
            logits[token] = value / p.repetition_penalty if value > 0 \
                else value * p.repetition_penalty
    for token in set(output):
        count = output.count(token)
        logits[token] -= p.frequency_penalty * count + p.presence_penalty
    return logits


@pytest.mark.parametrize("penalties", [
    dict(presence_penalty=1.5), dict(frequency_penalty=0.7),
    dict(presence_penalty=-0.5, frequency_penalty=1.2, repetition_penalty=1.3)])
def test_presence_and_frequency_penalties_follow_their_definition(llm, penalties):
    params = SamplingParams(max_tokens=24, **penalties)
    seen = record_logits(llm)
    outs = llm.generate(PROMPTS, params)
    ids = sorted(seen, key=int)
    changed = False
    for rid, prompt, out in zip(ids, PROMPTS, outs, strict=True):
        for step, raw in enumerate(seen[rid]):
            adjusted = _penalized(raw, prompt, out.token_ids[:step], params)
            assert out.token_ids[step] == int(torch.argmax(adjusted))
            changed |= out.token_ids[step] != int(torch.argmax(raw))
    assert changed  # the penalties did move some choice


def test_logit_bias_moves_the_choice(llm):
    seen = record_logits(llm)
    [forced] = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=6, logit_bias={17: 100}))
    assert forced.token_ids == [17] * 6
    [plain] = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1))
    first = plain.token_ids[0]
    [banned] = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1,
                                                        logit_bias={first: -100}))
    raw = seen[max(seen, key=int)][0]
    assert banned.token_ids[0] == int(torch.topk(raw, 2).indices[1]) != first


def test_min_p_keeps_only_tokens_near_the_top(llm):
    seen = record_logits(llm)
    params = SamplingParams(max_tokens=32, temperature=1.0, min_p=0.3, seed=11)
    outs = llm.generate(PROMPTS, params)
    for rid, out in zip(sorted(seen, key=int), outs, strict=True):
        for token, raw in zip(out.token_ids, seen[rid], strict=True):
            probs = torch.softmax(raw, dim=-1)
            assert probs[token] >= 0.3 * probs.max()
    # Without min-p the same seeds pick tokens below that line: the filter did work.
    free = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=1.0, seed=11))
    assert [o.token_ids for o in free] != [o.token_ids for o in outs]


def test_n_samples_share_the_prompt_and_draw_their_own_seeds(llm):
    prompt = PROMPTS[0]
    n = 4
    outs = llm.generate([prompt, PROMPTS[1]],
                        SamplingParams(max_tokens=10, temperature=1.0, seed=5, n=n))
    assert [(o.request_id, o.index) for o in outs] == \
        [("0", i) for i in range(n)] + [("1", i) for i in range(n)]
    first = outs[:n]
    # The first sample computed the prompt; the others reused its full blocks.
    assert first[0].num_cached_tokens == 0
    block = llm.engine.plan.config.hash_block_size
    shared = (len(prompt) - 1) // block * block
    assert all(o.num_cached_tokens == shared for o in first[1:])
    assert len({tuple(o.token_ids) for o in first}) > 1  # different draws
    # Sample i is the request with seed + i.
    for i, out in enumerate(first):
        [alone] = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=1.0,
                                                        seed=5 + i))
        assert alone.token_ids == out.token_ids
    assert llm.engine.kv_manager.usage == 0.0
    assert not llm.engine.has_unfinished


def test_aborting_a_request_with_n_samples_aborts_them_all(llm):
    engine = llm.engine
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=50, n=3))
    engine.step()  # the first sample computes the prompt; the others are held
    engine.abort_request("r")
    assert not engine.has_unfinished and engine.kv_manager.usage == 0.0
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("q", PROMPTS[0], SamplingParams(n=2))
        engine.add_request("q#1", PROMPTS[0])
    engine.abort_request("q")
    assert not engine.has_unfinished


@pytest.mark.parametrize("bad, match", [
    (dict(n=0), "n must be"), (dict(min_p=-0.1), "min_p"),
    (dict(presence_penalty=2.1), "presence_penalty"),
    (dict(repetition_penalty=-1), "repetition_penalty"),
    (dict(logit_bias={"7": "x"}), r"logit_bias\[7\]"), (dict(logit_bias={-1: 1}), "logit_bias")])
def test_bad_values_are_refused_with_their_name(llm, bad, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(PROMPTS[:1], SamplingParams(**bad))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(PROMPTS[:1], SamplingParams(logit_bias={10**6: 1.0}))


@pytest.mark.parametrize("arch", ["nemotron_h", "gemma3"])
def test_n_samples_share_the_prompt_on_hybrid_models(tmp_path, arch):
    """Mamba state (a checkpoint where the first sample's prompt blocks end) and sliding
    windows serve the other samples' hits too."""
    llm = LLM(str(build_tiny_model(arch, tmp_path / arch)), dtype="float32",
              max_model_len=128, kv_cache_memory="8MiB")
    prompt = PROMPTS[0]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=2, n=3)
    outs = llm.generate([prompt], params)
    block = llm.engine.plan.config.hash_block_size
    assert [o.num_cached_tokens for o in outs] == [0] + [(len(prompt) - 1) // block * block] * 2
    llm.reset_prefix_cache()
    for i, out in enumerate(outs):
        [alone] = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0,
                                                        seed=2 + i))
        assert alone.token_ids == out.token_ids
