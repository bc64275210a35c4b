"""A top-k MoE whose experts are chosen with a load-balancing bias that does not weight them,
plus an ungated shared expert (Kolibri 1, Laguna):

    logits = [softcap](gate(x))                          # [T, E], float32
    ids    = top-k of (choose(logits) + e_score_correction_bias)
    w      = sigmoid(logits)[ids]  [/ their sum]  x routed_scaling
    out    = sum of w x expert(x) over ids  +  shared(x)

`select_on`: what the bias is added to, "scores" (sigmoid(logits): Laguna) or "logits" (the
raw logits: Kolibri 1). Unlike layers/sigmoid_moe.py the sum is divided without an epsilon
(as both references divide), and the shared expert is part of the block."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.moe import ExpertMLPs


class BiasedSigmoidMoE(nn.Module):
    """x [T, hidden] -> [T, hidden]. Parts named as the checkpoints (after renaming) name
    them: `gate`, `e_score_correction_bias`, `experts.{e}`, the shared expert under
    `shared_name`."""

    def __init__(self, hidden: int, experts: ExpertMLPs, top_k: int, *,
                 select_on: Literal["scores", "logits"], renormalize: bool,
                 shared: GatedMLP | None, shared_name: str, routed_scaling: float = 1.0,
                 softcap: float = 0.0, float32_logits: bool = True) -> None:
        """`float32_logits=False` (Laguna): the router's matmul runs in the input's dtype
        and only its logits are cast to float32."""
        super().__init__()
        self.gate = nn.Linear(hidden, len(experts), bias=False)
        # A parameter (not a buffer) so the loader finds it under its checkpoint name.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(len(experts)),
                                                    requires_grad=False)
        self.experts = experts
        self.shared_name = shared_name if shared is not None else None
        if shared is not None:
            self.add_module(shared_name, shared)
        self.top_k, self.select_on, self.renormalize = top_k, select_on, renormalize
        self.routed_scaling, self.softcap = routed_scaling, softcap
        self.float32_logits = float32_logits

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        w = self.gate.weight
        logits = nn.functional.linear(x.float(), w.float()) if self.float32_logits \
            else nn.functional.linear(x, w).float()
        if self.softcap > 0.0:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        scores = torch.sigmoid(logits)
        choice = scores if self.select_on == "scores" else logits
        ids = torch.topk(choice + self.e_score_correction_bias.float(), self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if self.routed_scaling != 1.0:
            out = out * self.routed_scaling
        if self.shared_name is not None:
            out = out + getattr(self, self.shared_name)(x)
        return out  # type: ignore[no-any-return]
