"""RoPE on adjacent pairs (x[2i], x[2i+1]) instead of the two halves of each head: Cohere's
convention. It reuses the step's cached half-split cos/sin (same frequencies, laid out as
[f0..fn, f0..fn]) and spreads them over the pairs."""

from __future__ import annotations

import torch

from hybridkv.models.layers.rotary import Rotary


def apply_rope_adjacent(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, 1, D] in the half-split layout of `ForwardContext`."""
    half = cos.shape[-1] // 2
    cos = cos[..., :half].repeat_interleave(2, dim=-1)
    sin = sin[..., :half].repeat_interleave(2, dim=-1)
    xf = x.float()
    rotated = torch.stack([-xf[..., 1::2], xf[..., ::2]], dim=-1).flatten(-2)
    return (xf * cos + rotated * sin).to(x.dtype)


class AdjacentPairRotary(Rotary):
    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not self.partial:
            return apply_rope_adjacent(x, cos, sin)
        d = self.rotary_dim
        return torch.cat([apply_rope_adjacent(x[..., :d], cos, sin), x[..., d:]], dim=-1)
