"""Feed-forward blocks: the gated MLP of nearly every decoder here, and the plain one."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.activations import activation
from hybridkv.worker.linear.layers import GatedLinear, Linear
from hybridkv.worker.linear.quant import QuantizedWeight
from hybridkv.worker.linear.quantized import QuantizedLinear


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)). Options, each one family's twist:
    - `fused` (Granite): one projection yields [gate | up]; stored under the two given names
      (gate-up, down) instead of gate_proj / up_proj / down_proj.
    - `activation_sparsity` (Gemma 3n): the gate keeps only values above
      mean + std * Φ⁻¹(sparsity) of each token (a Gaussian top-k) before the activation.
    - `multipliers` (Falcon-H1 µP): (on the gate's pre-activation, on the output).
    After `fuse_linears`, gate and up are one GEMM (or two with the activation and product
    as post-ops, see worker/linear/layers.py) and the checkpoint's modules are gone."""

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
        self.act, self.act_name = activation(act), act
        self.std_multiplier = float(torch.distributions.Normal(0.0, 1.0).icdf(
            torch.tensor(activation_sparsity, dtype=torch.float32))) \
            if activation_sparsity > 0 else None
        self.gate_multiplier, self.down_multiplier = multipliers
        # Set by fuse_linears: the whole act(gate) * up, or gate and up as one GEMM when the
        # gate changes before its activation; and down.
        self.gated: GatedLinear | None = None
        self.gate_up: Linear | None = None
        self.down: Linear | None = None

    def _projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        if self.fused is None:
            return self.gate_proj, self.up_proj, self.down_proj
        gate_up: nn.Linear = getattr(self, self.fused[0])
        if isinstance(gate_up, QuantizedLinear):  # a GGUF file's blocks: rows split as bytes
            q, n = gate_up.qweight, gate_up.out_features // 2
            parts = [QuantizedLinear(QuantizedWeight(rows, q.qtype, n, q.cols), bias)
                     for rows, bias in zip(q.data.chunk(2), gate_up.bias.detach().chunk(2)
                                           if gate_up.bias is not None else (None, None),
                                           strict=True)]
            return parts[0], parts[1], getattr(self, self.fused[1])
        halves = []
        for rows in gate_up.weight.detach().chunk(2):
            half = nn.Linear(gate_up.in_features, rows.shape[0], bias=False,
                             device=rows.device, dtype=rows.dtype)
            half.weight.data = rows
            halves.append(half)
        if gate_up.bias is not None:
            for half, bias in zip(halves, gate_up.bias.detach().chunk(2), strict=True):
                half.bias = nn.Parameter(bias)
        return halves[0], halves[1], getattr(self, self.fused[1])

    def fuse_linears(self, kernel: str) -> None:
        gate, up, down = self._projections()
        if self.std_multiplier is None and self.gate_multiplier == 1.0:
            self.gated = GatedLinear(gate, up, self.act_name, self.act, kernel)
        else:
            self.gate_up = Linear([gate, up], kernel)
        self.down = Linear([down], kernel)
        for name in (("gate_proj", "up_proj", "down_proj") if self.fused is None
                     else self.fused):
            delattr(self, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated is not None:
            assert self.down is not None
            out = self.down(self.gated(x))
            return out * self.down_multiplier if self.down_multiplier != 1.0 else out
        if self.gate_up is not None:
            gate, up = self.gate_up.split(x)
            down = self.down
        elif self.fused is None:
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
