"""The greedy rejection rule: the longest agreeing prefix, then the target's own token."""

from __future__ import annotations

import pytest

from hybridkv.worker.sampling.rejection import verify_greedy


@pytest.mark.parametrize("drafts, targets, accepted, token", [
    ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7], 8),  # all kept: the bonus token
    ([5, 6, 7], [5, 9, 7, 8], [5], 9),  # the correction replaces the first mismatch
    ([5, 6, 7], [1, 6, 7, 8], [], 1),  # a later agreement counts for nothing
    ([], [4], [], 4),
])
def test_longest_agreeing_prefix(drafts, targets, accepted, token):
    assert verify_greedy(drafts, targets) == (accepted, token)


def test_rows_must_match_the_drafts():
    with pytest.raises(ValueError, match="2 drafts need 3 target tokens, got 2"):
        verify_greedy([1, 2], [1, 2])


def test_speculative_sampling_rule_keeps_the_target_distribution():
    torch = pytest.importorskip("torch")
    from hybridkv.worker.sampling.rejection import verify_sampled

    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]])
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    kept = 0
    n = 20000
    for _ in range(n):
        accepted, token = verify_sampled([1], p, generator)
        kept += len(accepted)
        counts[accepted[0] if accepted else token] += 1
    # The first token is distributed as p[0] whatever the draft; the draft (1) is kept
    # with probability p[0][1].
    assert float((counts / n - p[0]).abs().sum() / 2) < 0.015
    assert abs(kept / n - 0.3) < 0.015


def test_certain_and_impossible_drafts():
    torch = pytest.importorskip("torch")
    from hybridkv.worker.sampling.rejection import verify_sampled

    certain = torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    assert verify_sampled([1, 1], certain) == ([1, 1], 0)  # kept, then the bonus token
    impossible = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    assert verify_sampled([0], impossible) == ([], 1)  # rejected: a token other than 0
