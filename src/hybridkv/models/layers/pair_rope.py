"""DeepSeek-V4's RoPE: adjacent pairs (x[2i], x[2i+1]) of each head's last `dim` channels
rotated by angle i, with "main" parameters (plain theta) on sliding layers and "compress"
ones (their own theta, YaRN without its attention factor) on compressed layers, their
compressors and indexer, as transformers derives them from the config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.layers.rotary import _yarn


def rope_parameters(cfg: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{"main", "compress"} RoPE parameters as transformers derives them: nested in
    `rope_parameters`, else main = plain `rope_theta`, compress = `compress_rope_theta` with
    the config's scaling (YaRN without its attention factor)."""
    given = cfg.get("rope_parameters") or {}
    if isinstance(given.get("main"), Mapping) and isinstance(given.get("compress"), Mapping):
        return {"main": dict(given["main"]), "compress": dict(given["compress"])}
    scaling = {k: v for k, v in (given or cfg.get("rope_scaling") or {}).items()
               if k not in ("main", "compress")}
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    compress = {**scaling, "rope_theta": cfg.get("compress_rope_theta", 160000.0)}
    compress.setdefault("rope_type", "default")
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return {"main": {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)},
            "compress": compress}


class PairRope(nn.Module):
    """RoPE on the last `dim` channels of each head, rotating adjacent pairs (x[2i],
    x[2i+1]) by angle i, in float32 with cos/sin rounded to the input's dtype first."""

    def __init__(self, dim: int, params: Mapping[str, Any], max_positions: int) -> None:
        super().__init__()
        kind = params.get("rope_type") or "default"
        theta = float(params.get("rope_theta", 10000.0))
        if kind == "default":
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.scaling = 1.0
        elif kind == "yarn":
            yarn = {"original_max_position_embeddings": max_positions, **params}
            inv_freq, self.scaling = _yarn(dim, theta, yarn)
        else:
            raise NotImplementedError(f"deepseek_v4: RoPE type {kind!r} is not supported; "
                                      f"accepted: default, yarn")
        self.dim = dim
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)
        return ((freqs.cos() * self.scaling).to(dtype)[:, None],
                (freqs.sin() * self.scaling).to(dtype)[:, None])  # [m, 1, dim / 2]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [m, H, D] with its last `dim` channels rotated; cos/sin [m, 1, dim / 2]."""
        rope = x[..., -self.dim:].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        c, s = cos.float(), sin.float()
        rotated = torch.stack([even * c + (-odd) * s, odd * c + even * s], dim=-1).flatten(-2)
        return torch.cat([x[..., :-self.dim], rotated.to(x.dtype)], dim=-1)

    def at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin(positions, x.dtype)
        return self.rotate(x, cos, sin)
