"""Top-k mixture of experts: routing, one dispatch loop, expert weights in the two layouts
checkpoints use (stacked tensors, or one MLP module per expert), and the usual block.

A family picks a `Routing`, an expert layout and where the shared expert goes; the loop that
sends each token to its experts and sums their weighted outputs is written once, here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from hybridkv.models.layers.activations import activation
from hybridkv.models.layers.mlp import GatedMLP

Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) -> hidden


@dataclass(frozen=True)
class Routing:
    """How router logits [T, E] become top-k weights:
    - "softmax": softmax over all experts, then the top k (Jamba, Qwen3-Next, Gemma 4);
    - "softmax_topk": the top k logits, then a softmax over them (gpt-oss, Granite);
    - "sigmoid": the top k logits, each through a sigmoid (Llama 4).
    `renormalize`: the k weights are divided by their sum. `float32`: scores are computed in
    float32 (the weights are then cast to the dtype the caller asks for)."""

    top_k: int
    scoring: Literal["softmax", "softmax_topk", "sigmoid"]
    renormalize: bool = False
    float32: bool = True


def route(logits: torch.Tensor, routing: Routing, dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in `dtype`, expert ids [T, k])."""
    scores = logits.float() if routing.float32 else logits
    if routing.scoring == "softmax":
        weights, ids = torch.topk(torch.softmax(scores, dim=-1), routing.top_k, dim=-1)
    else:
        top, ids = torch.topk(scores, routing.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1) if routing.scoring == "softmax_topk" \
            else torch.sigmoid(top)
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def dispatch(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
             run_expert: Callable[[int, torch.Tensor], torch.Tensor], *,
             scale_inputs: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """sum over each token's k experts of weight * expert(token), added into `out` (zeros if
    None). `scale_inputs` (Llama 4): the weight scales the expert's input, not its output.
    E.g. ids [[0, 2], [2, 1]]: expert 0 runs on token 0, expert 1 on token 1, expert 2 on
    tokens 0 and 1 (one batch per expert)."""
    out = torch.zeros_like(x) if out is None else out
    for expert in ids.unique().tolist():
        token_idx, slot = torch.where(ids == expert)
        w = weights[token_idx, slot, None]  # [n, 1]
        if scale_inputs:
            out.index_add_(0, token_idx, run_expert(expert, x[token_idx] * w))
        else:
            out.index_add_(0, token_idx, (run_expert(expert, x[token_idx]) * w).to(out.dtype))
    return out


class StackedExperts(nn.Module):
    """Expert weights stacked over experts, as one tensor each: `gate_up_proj` and
    `down_proj` (+ `_bias`). `transposed` (gpt-oss, Llama 4): stored [E, H, 2I] / [E, I, H]
    and applied as x @ w; else [E, 2I, H] / [E, H, I] and applied as linear(x, w) (Gemma 4).
    `interleaved` (gpt-oss): gate and up alternate along 2I instead of being two halves."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, glu: Glu, *,
                 transposed: bool = False, interleaved: bool = False,
                 bias: bool = False) -> None:
        super().__init__()
        e, h, i = num_experts, hidden, intermediate
        self.transposed, self.interleaved, self.glu = transposed, interleaved, glu
        self.gate_up_proj = nn.Parameter(torch.zeros((e, h, 2 * i) if transposed
                                                     else (e, 2 * i, h)))
        self.down_proj = nn.Parameter(torch.zeros((e, i, h) if transposed else (e, h, i)))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h)) if bias else None

    def run(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] through one expert."""
        gate_up = glu_project(x, self.gate_up_proj[expert], self.transposed,
                              None if self.gate_up_proj_bias is None
                              else self.gate_up_proj_bias[expert])
        gate, up = (gate_up[..., ::2], gate_up[..., 1::2]) if self.interleaved \
            else gate_up.chunk(2, -1)
        return glu_project(self.glu(gate, up), self.down_proj[expert], self.transposed,
                           None if self.down_proj_bias is None
                           else self.down_proj_bias[expert])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *,
                scale_inputs: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        return dispatch(x, weights, ids, self.run, scale_inputs=scale_inputs, out=out)


def glu_project(x: torch.Tensor, w: torch.Tensor, transposed: bool,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w (w stored [in, out]) or linear(x, w) (w stored [out, in]), plus the bias."""
    y = x @ w if transposed else nn.functional.linear(x, w)
    return y + bias if bias is not None else y


def act_glu(act: str) -> Glu:
    """The usual GLU: act(gate) * up."""
    fn = activation(act)
    return lambda gate, up: fn(gate) * up


class ExpertMLPs(nn.ModuleList):
    """One GatedMLP module per expert (`experts.{e}.gate_proj`, ...), as Jamba and Qwen3-Next
    checkpoints store them."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str) -> None:
        super().__init__(GatedMLP(hidden, intermediate, act) for _ in range(num_experts))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *,
                scale_inputs: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        return dispatch(x, weights, ids, lambda e, rows: self[e](rows),
                        scale_inputs=scale_inputs, out=out)


class MoE(nn.Module):
    """Router -> top-k experts -> weighted sum, with an optional shared expert that every
    token also goes through. The router is a linear layer named as in the checkpoint
    (`router_name`). An ungated shared expert seeds the sum (Llama 4's order); a gated one
    (`shared_expert_gate`, Qwen3-Next) is added after it, scaled by sigmoid(gate(x))."""

    def __init__(self, hidden: int, experts: StackedExperts | ExpertMLPs, routing: Routing, *,
                 router_name: str = "router", router_bias: bool = False,
                 shared_expert: nn.Module | None = None, shared_expert_gate: bool = False,
                 scale_inputs: bool = False) -> None:
        super().__init__()
        num_experts = experts.gate_up_proj.shape[0] if isinstance(experts, StackedExperts) \
            else len(experts)
        self.router_name = router_name
        self.add_module(router_name, nn.Linear(hidden, num_experts, bias=router_bias))
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_expert_gate \
            else None
        self.routing, self.scale_inputs = routing, scale_inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, hidden] -> [T, hidden]
        weights, ids = route(getattr(self, self.router_name)(x), self.routing, x.dtype)
        seed = self.shared_expert(x) if self.shared_expert is not None and \
            self.shared_expert_gate is None else None
        out = self.experts(x, weights, ids, scale_inputs=self.scale_inputs, out=seed)
        if self.shared_expert_gate is not None and self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out  # type: ignore[no-any-return]
