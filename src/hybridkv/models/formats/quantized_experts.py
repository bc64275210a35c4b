"""Stacked experts whose matrices stay in their GGUF blocks.

A family such as Gemma 4 keeps its experts as two stacked parameters (`StackedExperts`:
gate_up_proj [E, 2I, H], down_proj [E, H, I]); llama.cpp's converter writes them as the 3-D
tensors ffn_gate_up_exps / ffn_down_exps, each expert's rows contiguous and quantized on
their own. The GGUF loader puts this module in their place: one quantized matrix per expert
and projection, run as StackedExperts runs them (gate and up as the two halves of gate_up),
so the float32 copy of the experts (most of such a model's weights) is never made.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.moe import StackedExperts, dispatch
from hybridkv.worker.linear.quantized import QuantizedLinear


class QuantizedStackedExperts(nn.Module):
    """StackedExperts (not transposed, halves not interleaved, no biases) with each expert's
    projections as QuantizedLinear; `gate_up` / `down` are filled as the loader reads them."""

    def __init__(self, source: StackedExperts, num_experts: int) -> None:
        super().__init__()
        self.glu = source.glu
        self.num_experts = num_experts
        self.gate_up = nn.ModuleList()
        self.down = nn.ModuleList()

    @staticmethod
    def takes(module: nn.Module) -> bool:
        """Whether `module` is a StackedExperts this module can stand in for."""
        return isinstance(module, StackedExperts) and not module.transposed \
            and not module.interleaved and module.gate_up_proj_bias is None \
            and module.down_proj_bias is None

    def set(self, projection: str, experts: list[QuantizedLinear]) -> None:
        """`projection` "gate_up_proj" or "down_proj": one matrix per expert, in order."""
        if len(experts) != self.num_experts:
            raise ValueError(f"{projection}: {len(experts)} experts, expected "
                             f"{self.num_experts}")
        target = self.gate_up if projection == "gate_up_proj" else self.down
        target.extend(experts)

    @property
    def complete(self) -> bool:
        return len(self.gate_up) == len(self.down) == self.num_experts

    def run(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] through one expert."""
        gate, up = self.gate_up[expert](x).chunk(2, -1)
        return self.down[expert](self.glu(gate, up))  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *,
                scale_inputs: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        return dispatch(x, weights, ids, self.run, scale_inputs=scale_inputs, out=out)
