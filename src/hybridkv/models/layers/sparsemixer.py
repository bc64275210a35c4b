"""SparseMixer top-2 routing (PhiMoE) at inference: each of the two picks is the best
remaining expert, weighted by a softmax over only the experts whose logits are within a
relative `2 * jitter_eps` of that pick's logit (the others count as -inf)."""

from __future__ import annotations

import torch


def _pick(scores: torch.Tensor, candidates: torch.Tensor, jitter_eps: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [T, 1], expert [T, 1]) of the best of `candidates` (scores with experts already
    taken set to -inf). The relative gap is measured on the raw `scores`."""
    best, expert = candidates.max(dim=-1, keepdim=True)
    gap = (best - scores) / scores.abs().clamp(min=best)
    kept = candidates.masked_fill(gap > 2 * jitter_eps, float("-inf"))
    return torch.softmax(kept, dim=-1).gather(-1, expert), expert


def sparsemixer_top2(logits: torch.Tensor, jitter_eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, 2], expert ids [T, 2]), in the logits' dtype."""
    w1, e1 = _pick(logits, logits, jitter_eps)
    w2, e2 = _pick(logits, logits.scatter(-1, e1, float("-inf")), jitter_eps)
    return torch.cat([w1, w2], dim=-1), torch.cat([e1, e2], dim=-1)
