"""Verification of draft tokens: which of a request's drafts the target model keeps.

Greedy requests keep a draft while it is the target's argmax (`verify_greedy`); sampled
ones by speculative sampling (`verify_sampled`), which keeps the target's distribution.

A request with drafts d_0 .. d_{k-1} is scored in one pass over [last known token, d_0, ...,
d_{k-1}]: row i of its logits is the target's distribution after its known tokens and
d_0 .. d_{i-1}, so k + 1 rows. The longest prefix of drafts the target agrees with is kept,
and one more token comes from the row after it: the correction where a draft was rejected,
the bonus token where every draft was kept. Nothing here knows where drafts come from.

    drafts   d0 d1 d2          targets  d0 d1 x  y       -> accepted [d0, d1], next x
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class Verified(NamedTuple):
    accepted: list[int]  # the drafts kept (a prefix of them)
    token: int  # the token after them: the correction, or the bonus token


def verify_greedy(draft_ids: Sequence[int], target_ids: Sequence[int]) -> Verified:
    """Greedy acceptance: `target_ids` [k + 1] are the target's argmax tokens of each row;
    a draft is kept while it equals the target's token, so the tokens are exactly those of
    decoding without drafts."""
    if len(target_ids) != len(draft_ids) + 1:
        raise ValueError(f"{len(draft_ids)} drafts need {len(draft_ids) + 1} target tokens, "
                         f"got {len(target_ids)}")
    n = 0
    while n < len(draft_ids) and draft_ids[n] == target_ids[n]:
        n += 1
    return Verified(list(draft_ids[:n]), int(target_ids[n]))


def verify_sampled(draft_ids: Sequence[int], probs: torch.Tensor,
                   generator: torch.Generator | None = None) -> Verified:
    """Speculative sampling (Leviathan et al., 2023; Chen et al., 2023) for drafts that came
    with no distribution of their own (a proposer's one guess: q = 1 on the draft). `probs`
    [k + 1, V]: the target's sampling distribution at each row. Draft i is kept with
    probability p_i(d_i); the first one rejected is replaced by a draw from p_i without d_i
    (renormalized: max(p - q, 0)), and when all are kept the bonus token is drawn from
    p_k. Each token is then distributed exactly as p: P(t) = p(d) [t = d] + (1 - p(d))
    p(t) / (1 - p(d)) [t != d] = p(t)."""
    if probs.shape[0] != len(draft_ids) + 1:
        raise ValueError(f"{len(draft_ids)} drafts need {len(draft_ids) + 1} target rows, "
                         f"got {probs.shape[0]}")
    device = probs.device
    for i, draft in enumerate(draft_ids):
        if float(torch.rand((), generator=generator, device=device)) < float(probs[i, draft]):
            continue
        residual = probs[i].clone()
        residual[draft] = 0.0
        if not bool(residual.sum() > 0):
            continue  # p(d) is 1 but for rounding: d is the only token left
        token = int(torch.multinomial(residual, 1, generator=generator))
        return Verified(list(draft_ids[:i]), token)
    bonus = int(torch.multinomial(probs[-1], 1, generator=generator))
    return Verified(list(draft_ids), bonus)
