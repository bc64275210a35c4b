"""Prefix caching on models with per-request states: hits through state checkpoints, outputs
identical to running without the cache. One model per state kind: Mamba2 + attention
(NemotronH), Mamba1 alone with no attention group at all (Mamba), a short-convolution state
(LFM2), Gated DeltaNet with split projections (Qwen3.5) and Griffin's RG-LRU beside
sliding-window attention (RecurrentGemma), lightning attention (MiniMax) and Kimi Delta
Attention beside latent attention (Kimi Linear), RWKV-4's token shifts and WKV
and xLSTM's mLSTM memories (no attention either)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridkv import LLM, SamplingParams  # noqa: E402
from tests.models.tiny import build_tiny_model  # noqa: E402

GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module", params=["nemotron_h", "mamba", "lfm2", "qwen3_5_text",
                                        "recurrent_gemma", "minimax", "kimi_linear",
                                        "zamba2", "zamba", "rwkv", "xlstm"])
def model_dir(request, tmp_path_factory):
    return build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def engines(model_dir, **options):
    common = dict(dtype="float32", max_model_len=256, kv_cache_memory="16MiB", **options)
    return (LLM(str(model_dir), **common),
            LLM(str(model_dir), enable_prefix_caching=False, **common))


def tokens(seed, n):
    return torch.randint(4, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_multi_turn_hits_the_checkpoint_at_the_end_of_turn_one(model_dir):
    cached, plain = engines(model_dir)
    turn1 = tokens(1, 50)
    [out1] = cached.generate(turn1, GREEDY)
    assert out1.token_ids == plain.generate(turn1, GREEDY)[0].token_ids
    turn2 = turn1 + out1.token_ids + tokens(2, 20)
    before = cached.engine.kv_manager.stats.num_hit_tokens
    [out2] = cached.generate(turn2, GREEDY)
    # Turn 1's prompt ended in block 3 (48 tokens): its state checkpoint is there.
    assert cached.engine.kv_manager.stats.num_hit_tokens - before == 48
    assert out2.token_ids == plain.generate(turn2, GREEDY)[0].token_ids


@pytest.mark.parametrize("tail", [1, 4])
def test_a_shared_system_prompt_hits_at_the_branch_point(model_dir, tail):
    cached, plain = engines(model_dir, mamba_checkpoint_tail=tail)
    system = tokens(3, 100)
    stats = cached.engine.kv_manager.stats
    outputs = []
    for i, seed in enumerate((4, 5, 6)):
        prompt = system + tokens(seed, 20)
        before = stats.num_hit_tokens
        [out] = cached.generate(prompt, GREEDY)
        outputs.append(stats.num_hit_tokens - before)
        assert out.token_ids == plain.generate(prompt, GREEDY)[0].token_ids, f"request {i}"
    # With a tail of one block the first request checkpoints its prompt end (112) only, so
    # the second finds no state inside the shared 96 tokens; it saves one at its branch
    # point, where the third hits. (Without attention layers, Mamba's state group
    # remembers computed block hashes to find the branch point.) With four (the default)
    # the first request's tail, 64 to 112, already holds the state at 96.
    assert outputs == ([0, 0, 96] if tail == 1 else [0, 96, 96])


def test_checkpoint_interval_and_chunked_prefill(model_dir):
    cached, plain = engines(model_dir, mamba_checkpoint_interval=2,
                            max_num_batched_tokens=24)
    long = tokens(7, 120)
    [first] = cached.generate(long, GREEDY)
    assert first.token_ids == plain.generate(long, GREEDY)[0].token_ids
    # Checkpoints every 32 tokens, written across chunk boundaries of 24 tokens.
    other = long[:70] + tokens(8, 10)
    before = cached.engine.kv_manager.stats.num_hit_tokens
    [second] = cached.generate(other, GREEDY)
    assert cached.engine.kv_manager.stats.num_hit_tokens - before == 64
    assert second.token_ids == plain.generate(other, GREEDY)[0].token_ids


def _generate(llm, prompt, **options):
    """One request through the engine's own API (LLM.generate names no part points)."""
    llm.engine.add_request("part", prompt, GREEDY, **options)
    while llm.engine.has_unfinished:
        for out in llm.engine.step():
            if out.finished:
                return out
    raise AssertionError("no output")


def test_a_prompt_parting_at_a_named_part_point_resumes_there(model_dir):
    """A chat's next turn that replaces the last message parts where it began, inside
    what the turn before computed (not at a checkpoint of its own): a part point named
    there saves one, rounded down to a block, and the later prompt hits it."""
    cached, plain = engines(model_dir, mamba_checkpoint_tail=1)
    history, last = tokens(7, 70), tokens(8, 30)  # the last message starts at 70
    stats = cached.engine.kv_manager.stats
    first = _generate(cached, history + last, part_points=[70])
    assert first.token_ids == plain.generate(history + last, GREEDY)[0].token_ids
    branch = history + tokens(9, 25)
    before = stats.num_hit_tokens
    out = _generate(cached, branch)
    assert stats.num_hit_tokens - before == 64  # 70 rounded down to a block of 16
    assert out.token_ids == plain.generate(branch, GREEDY)[0].token_ids

    # Without it the state was saved at the prompt's end only, past where they part.
    again, _ = engines(model_dir, mamba_checkpoint_tail=1)
    _generate(again, history + last)
    before = again.engine.kv_manager.stats.num_hit_tokens
    _generate(again, branch)
    assert again.engine.kv_manager.stats.num_hit_tokens - before < 64


def test_part_points_outside_the_prompt_are_refused_in_one_line(model_dir):
    cached, _ = engines(model_dir)
    for bad in ([0], [40], [1, 2, 3, 4, 5], ["3"], [True]):
        with pytest.raises(ValueError, match=r"part_points must be at most 4 prompt "
                                             r"positions in \[1, 39\]"):
            cached.engine.add_request("bad", tokens(1, 40), GREEDY, part_points=bad)
    assert not cached.engine.has_unfinished
