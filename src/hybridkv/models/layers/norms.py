"""Normalisations: weighted RMSNorm (plain and Gemma's `1 + w`), scale-free forms, and the
gated, grouped RMSNorm of Mamba2 mixers."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.worker import cpu_ops


class RMSNorm(nn.Module):
    """`offset=1.0` is Gemma's `(1 + w)` form, computed in float32 then cast back."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset
        self.native_ops = False  # float32 CPU rows in one C call (worker/cpu_ops.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_ops and x.dim() in (2, 3) and cpu_ops.takes(x) and \
                self.weight.dtype == torch.float32:
            return cpu_ops.rms_norm(x, self.weight, self.eps, self.offset)
        # Normalise in float32 (as the reference implementations do), one fused op.
        normed = nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.offset:
            return (normed * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def rms_normalize(x: torch.Tensor, eps: float, *, fused: bool = True) -> torch.Tensor:
    """RMSNorm without a scale (Gemma's value norm), in float32. `fused=False` spells the
    ops out as Llama 4's reference does, so its q/k norms stay bit-equal to it."""
    if fused:
        return nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / |x| over the last dim (Gated DeltaNet's q and k)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedRMSNorm(nn.Module):
    """x * silu(gate), normalised per group of channels (float32), then weighted; with
    `norm_before_gate` (Falcon-H1), normalised and weighted first, then gated."""

    def __init__(self, dim: int, group_size: int, eps: float,
                 norm_before_gate: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps
        self.norm_before_gate = norm_before_gate

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if not self.norm_before_gate:
            h = h * nn.functional.silu(gate.float())
        groups = h.unflatten(-1, (-1, self.group_size))
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.norm_before_gate:
            weighted = self.weight.float() * groups.flatten(-2)
            return (weighted * nn.functional.silu(gate.float())).to(x.dtype)
        return self.weight * groups.flatten(-2).to(x.dtype)
