"""Feed-forward blocks: the gated MLP of nearly every decoder here, and the plain one."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.activations import activation


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)). Options, each one family's twist:
    - `fused` (Granite): one projection yields [gate | up]; stored under the two given names
      (gate-up, down) instead of gate_proj / up_proj / down_proj.
    - `activation_sparsity` (Gemma 3n): the gate keeps only values above
      mean + std * Φ⁻¹(sparsity) of each token (a Gaussian top-k) before the activation.
    - `multipliers` (Falcon-H1 µP): (on the gate's pre-activation, on the output)."""

    def __init__(self, hidden: int, intermediate: int, act: str, *, bias: bool = False,
                 fused: tuple[str, str] | None = None, activation_sparsity: float = 0.0,
                 multipliers: tuple[float, float] = (1.0, 1.0)) -> None:
        super().__init__()
        self.fused = fused
        if fused is None:
            self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
            self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
            self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        else:
            self.add_module(fused[0], nn.Linear(hidden, 2 * intermediate, bias=bias))
            self.add_module(fused[1], nn.Linear(intermediate, hidden, bias=bias))
        self.act = activation(act)
        self.std_multiplier = float(torch.distributions.Normal(0.0, 1.0).icdf(
            torch.tensor(activation_sparsity, dtype=torch.float32))) \
            if activation_sparsity > 0 else None
        self.gate_multiplier, self.down_multiplier = multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is None:
            gate, up, down = self.gate_proj(x), self.up_proj(x), self.down_proj
        else:
            gate, up = getattr(self, self.fused[0])(x).chunk(2, dim=-1)
            down = getattr(self, self.fused[1])
        if self.std_multiplier is not None:
            cutoff = gate.mean(-1, keepdim=True) + gate.std(
                -1, keepdim=True, unbiased=False) * self.std_multiplier
            gate = nn.functional.relu(gate - cutoff)
        if self.gate_multiplier != 1.0:
            gate = gate * self.gate_multiplier
        out = down(self.act(gate) * up)
        return out * self.down_multiplier if self.down_multiplier != 1.0 else out  # type: ignore[no-any-return]


class MLP(nn.Module):
    """down(act(up(x))), e.g. NemotronH's relu²."""

    def __init__(self, hidden: int, intermediate: int, act: str, *, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))  # type: ignore[no-any-return]
