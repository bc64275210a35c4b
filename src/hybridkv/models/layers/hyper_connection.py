"""Hyper-connections (Qwen4-Exp): the residual stream is `count` copies of the hidden state,
[T, count x hidden]. Each sublayer reads a learned mix of the normed copies and writes its
output back into every copy, scaled per copy:

    n   = norm of each copy (RMSNorm per `hidden` group, x (1 + w))
    x   = mean over copies of sigmoid(up(silu(down(n) / count))) * n     [T, hidden]
    w   = 2 sigmoid(inject(n) / count)                                   [T, count]
    h'  = h + w[:, c] * sublayer(x)   for each copy c

The model's last mixer has no `inject`: its x is the decoder's output."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class StreamNorm(nn.Module):
    """RMSNorm of each `group` channels of x [..., k x group], scaled by (1 + w) over all."""

    def __init__(self, dim: int, group: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.group, self.eps = group, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = x.float().unflatten(-1, (-1, self.group))
        normed = nn.functional.rms_norm(groups, (self.group,), eps=self.eps).flatten(-2)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class HyperConnection(nn.Module):
    """forward(h [T, count x hidden], sublayer) -> h with the sublayer's output injected;
    `mix(h)` -> the sublayer's input [T, hidden] alone (the model's output mixer)."""

    def __init__(self, hidden: int, count: int, rank: int, eps: float, *,
                 inject: bool = True) -> None:
        super().__init__()
        self.hidden, self.count = hidden, count
        self.hc_norm = StreamNorm(count * hidden, hidden, eps)
        self.input_mix_weight_down = nn.Linear(count * hidden, rank, bias=False)
        self.input_mix_weight_up = nn.Linear(rank, count * hidden, bias=False)
        self.block_inject_weight = nn.Linear(count * hidden, count, bias=False) if inject \
            else None

    def mix(self, h: torch.Tensor) -> torch.Tensor:
        return self._mix(self.hc_norm(h))

    def _mix(self, normed: torch.Tensor) -> torch.Tensor:
        weight = torch.sigmoid(self.input_mix_weight_up(nn.functional.silu(
            self.input_mix_weight_down(normed) / self.count)))
        copies = (self.count, self.hidden)
        mixed: torch.Tensor = (weight.unflatten(-1, copies) * normed.unflatten(-1, copies)
                               ).mean(dim=-2)
        return mixed

    def forward(self, h: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]
                ) -> torch.Tensor:
        assert self.block_inject_weight is not None, "the output mixer only mixes"
        normed = self.hc_norm(h)
        inject = 2 * torch.sigmoid(self.block_inject_weight(normed) / self.count)  # [T, count]
        out = sublayer(self._mix(normed))  # [T, hidden]
        return h + (out[:, None, :] * inject[..., None]).flatten(-2)
