"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual stream is `n`
streams [T, n, D]. Around each sublayer, one linear map of the normed streams gives

    pre  = sigmoid(. x s_pre + b_pre) + eps             [T, n]   how the streams collapse
    post = 2 sigmoid(. x s_post + b_post)               [T, n]   how the output spreads
    comb = Sinkhorn(softmax(. x s_comb + b_comb) + eps)  [T, n, n] doubly stochastic mixing
    h'   = post[:, :, None] x sublayer(sum_i pre_i h_i) + comb^T h

all in float32 (the reference keeps these weights in float32 whatever the model's dtype).
The model's head collapses the streams once more with a `pre` of its own (`HyperHead`)."""

from __future__ import annotations

import torch
from torch import nn


def scale_free_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def hyper_weights(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                  *, iters: int, eps: float, norm_eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, n, D] -> (post [T, n], comb [T, n, n], the collapsed input [T, D])."""
    tokens, n, _ = h.shape
    mixes = nn.functional.linear(scale_free_norm(h.reshape(tokens, -1).float(), norm_eps),
                                 fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(tokens, n, n) * comb_s + comb_b.view(n, n), dim=-1) + eps
    # Sinkhorn-Knopp: columns, then rows and columns alternately, to sum to 1.
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
    return post, comb, collapsed


def hyper_merge(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor) -> torch.Tensor:
    """The sublayer's output [T, D] spread over the streams, plus the mixed streams."""
    dtype = h.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), h)


class HyperHead(nn.Module):
    """The streams [T, n, D] -> [T, D] before the final norm (checkpoint: hc_head.hc_*)."""

    def __init__(self, hidden: int, n: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_fn = nn.Parameter(torch.zeros(n, n * hidden))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.ones(1))
        self.eps, self.norm_eps = eps, norm_eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = scale_free_norm(h.flatten(1).float(), self.norm_eps)
        mixes = nn.functional.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
