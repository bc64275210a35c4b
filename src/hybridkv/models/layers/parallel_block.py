"""The parallel residual block (Cohere): one norm, attention and MLP side by side on it,
both added to the residual: h + attn(norm(h)) + mlp(norm(h)); and Cohere's LayerNorm, which
centres and scales but has no bias, computed in float32."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.worker.forward_context import ForwardContext


class FloatLayerNorm(nn.Module):
    """LayerNorm with a weight and no bias, in float32 then cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = nn.functional.layer_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class ParallelBlock(nn.Module):
    """Parts named as Cohere checkpoints name them: input_layernorm, self_attn, mlp."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, norm: nn.Module) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn, self.mlp = norm, attn, mlp

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = self.input_layernorm(h)
        return h + self.self_attn(x, positions, ctx) + self.mlp(x)  # type: ignore[no-any-return]
