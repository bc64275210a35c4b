"""A top-k MoE routed by sigmoid scores with a selection bias (LFM2-MoE; the DeepSeek-V3
style of load balancing without an auxiliary loss):

    scores = sigmoid(router(x))                       # [T, E]
    ids    = top-k of (scores + expert_bias)          # the bias only chooses experts
    w      = scores[ids] / (sum + 1e-6) * routed_scaling_factor

then the kit's dispatch over the experts."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.moe import ExpertMLPs, MoE, Routing


class SigmoidBiasMoE(MoE):
    def __init__(self, hidden: int, experts: ExpertMLPs, top_k: int, *, router_name: str,
                 expert_bias: bool, renormalize: bool, scaling: float) -> None:
        super().__init__(hidden, experts, Routing(top_k, "sigmoid", renormalize=renormalize),
                         router_name=router_name)
        # A parameter (not a buffer) so the loader finds it under its checkpoint name.
        self.expert_bias = nn.Parameter(torch.zeros(len(experts)), requires_grad=False) \
            if expert_bias else None
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, hidden] -> [T, hidden]
        scores = torch.sigmoid(getattr(self, self.router_name)(x).float())
        k = self.routing.top_k
        if self.expert_bias is None:
            weights, ids = torch.topk(scores, k, dim=-1)
        else:
            _, ids = torch.topk(scores + self.expert_bias.float(), k, dim=-1)
            weights = scores.gather(1, ids)
        if self.routing.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        return self.experts(x, (weights * self.scaling).to(x.dtype), ids)  # type: ignore[no-any-return]
