"""DeepSeek-V3-style routing and the MoE block around it (dots.llm1, EXAONE MoE, MiMo):
sigmoid scores per expert; a learned correction bias steers which experts are chosen but not
their weights; experts come in groups, a token first keeps its `topk_group` best groups (a
group's score: the sum of its two best corrected scores), then its top k experts among them.
Weights: the chosen raw sigmoid scores, optionally renormalised, times
`routed_scaling_factor`. Shared experts run on every token and are added."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.moe import ExpertMLPs


class GroupedTopKRouter(nn.Module):
    """x [T, hidden] -> (weights [T, k] float32, expert ids [T, k]); scores in float32."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, num_groups: int = 1,
                 topk_groups: int = 1, renormalize: bool = True, scale: float = 1.0,
                 float32_logits: bool = True) -> None:
        """`float32_logits=False` (AFMoE): the router's matmul runs in the input's dtype and
        only its logits are cast to float32."""
        super().__init__()
        if num_experts % num_groups:
            raise ValueError(f"n_group ({num_groups}) must divide the number of experts "
                             f"({num_experts})")
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))
        self.top_k, self.num_groups, self.topk_groups = top_k, num_groups, topk_groups
        self.renormalize, self.scale = renormalize, scale
        self.float32_logits = float32_logits

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = nn.functional.linear(x.float(), self.weight.float()) if self.float32_logits \
            else nn.functional.linear(x, self.weight).float()
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.num_groups > 1:
            groups = choice.unflatten(-1, (self.num_groups, -1))
            group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1)[0].sum(dim=-1)
            kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
                1, group_scores.topk(self.topk_groups, dim=-1)[1], True)
            choice = choice.masked_fill(~kept.repeat_interleave(groups.shape[-1], dim=-1),
                                        float("-inf"))
        ids = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class SharedExpertsMoE(nn.Module):
    """Parts named as the checkpoints name them: gate (the router), experts.{e},
    shared_experts (absent when the config has none)."""

    def __init__(self, hidden: int, gate: GroupedTopKRouter, experts: ExpertMLPs,
                 shared_experts: GatedMLP | None) -> None:
        super().__init__()
        self.gate, self.experts, self.shared_experts = gate, experts, shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out  # type: ignore[no-any-return]
