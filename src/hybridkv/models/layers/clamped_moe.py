"""DeepSeek-V4's MoE: experts and a shared expert with their SwiGLU pre-activations clamped
at `swiglu_limit`; routing by sqrt(softplus) (or sigmoid) scores, either the top k after a
correction bias or (hash layers) a fixed token -> experts table; the chosen scores
renormalised and scaled by `routed_scaling_factor`. Checkpoint names: `gate.weight`,
`gate.bias` / `gate.tid2eid`, `experts.{e}.w1/w2/w3`, `shared_experts.w1/w2/w3`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.layers.activations import activation
from hybridkv.models.layers.moe import dispatch


class Expert(nn.Module):
    """SwiGLU with its pre-activations clamped (w1 gate, w3 up, w2 down)."""

    def __init__(self, hidden: int, intermediate: int, act: str, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        self.act, self.limit = activation(act), limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(self.act(gate) * up)  # type: ignore[no-any-return]


class Router(nn.Module):
    """`ffn.gate`: weight [E, hidden] and a correction bias (top-k layers) or a token ->
    experts table `tid2eid` (hash layers)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, vocab: int,
                 hashed: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        if hashed:
            self.tid2eid = nn.Parameter(torch.zeros(vocab, top_k, dtype=torch.int64),
                                        requires_grad=False)
        else:
            self.bias = nn.Parameter(torch.zeros(num_experts))
        self.hashed, self.top_k = hashed, top_k


class V4MoE(nn.Module):
    """forward(x [T, hidden], token ids [T]) -> routed experts + the shared expert."""

    def __init__(self, cfg: Mapping[str, Any], hashed: bool) -> None:
        super().__init__()
        hidden, inter = int(cfg["hidden_size"]), int(cfg["moe_intermediate_size"])
        num, act = int(cfg["n_routed_experts"]), str(cfg.get("hidden_act") or "silu")
        limit = float(cfg.get("swiglu_limit", 10.0))
        self.gate = Router(hidden, num, int(cfg["num_experts_per_tok"]),
                           int(cfg["vocab_size"]), hashed)
        self.experts = nn.ModuleList(Expert(hidden, inter, act, limit) for _ in range(num))
        self.shared_experts = Expert(hidden, inter, act, limit)
        self.scoring = str(cfg.get("scoring_func") or "sqrtsoftplus")
        self.scale = float(cfg.get("routed_scaling_factor") or 1.0)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(x, self.gate.weight)
        scores = nn.functional.softplus(logits).sqrt() if self.scoring == "sqrtsoftplus" \
            else torch.sigmoid(logits)
        if self.gate.hashed:
            chosen = self.gate.tid2eid[ids].long()
        else:
            chosen = torch.topk(scores + self.gate.bias, self.gate.top_k, dim=-1,
                                sorted=False).indices
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scale
        routed = dispatch(x, weights, chosen, lambda e, rows: self.experts[e](rows))
        return routed + self.shared_experts(x)  # type: ignore[no-any-return]
