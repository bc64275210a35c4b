"""Rotary position embeddings: the parameters of a layer from its config, inverse frequencies
for the RoPE types in use (default, linear, llama3, yarn, proportional), and the two rotation
conventions (half-split and adjacent pairs)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.layer_mix import SLIDING
from hybridkv.worker import cpu_ops
from hybridkv.worker.forward_context import ForwardContext


def rope_params(cfg: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """RoPE parameters of a layer of `kind`, from the newer `rope_parameters` (possibly keyed
    by layer type) or the older `rope_theta` / `rope_scaling` / `rope_local_base_freq`."""
    params = cfg.get("rope_parameters")
    layer_type = "sliding_attention" if kind == SLIDING else "full_attention"
    if isinstance(params, Mapping):
        return dict(params.get(layer_type, params))
    out: dict[str, Any] = dict(cfg.get("rope_scaling") or {})
    out["rope_theta"] = cfg.get("rope_theta", 10000.0)
    if kind == SLIDING and cfg.get("rope_local_base_freq"):
        out = {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}
    return out


def rope_key(head_dim: int, params: Mapping[str, Any]) -> object:
    return (head_dim, tuple(sorted((k, str(v)) for k, v in params.items())))


def rope_inv_freq(head_dim: int, params: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, cos/sin scaling) for RoPE of type default, linear, llama3, yarn."""
    theta = float(params.get("rope_theta", 10000.0))
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return inv_freq.float(), 1.0
    if kind == "linear":
        return (inv_freq / float(params["factor"])).float(), 1.0
    if kind == "proportional":
        # Gemma 4 full layers: the first `partial_rotary_factor` of the angles rotate (with
        # exponents over the whole head), the rest get frequency 0, i.e. pass unchanged.
        rotated = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        inv_freq = inv_freq / float(params.get("factor", 1.0))
        inv_freq[rotated:] = 0.0
        return inv_freq.float(), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, params)
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled).float(), 1.0
    raise NotImplementedError(f"RoPE type {kind!r} is not supported yet "
                              f"(supported: default, linear, llama3, yarn, proportional)")


def _yarn(dim: int, base: float, params: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp in between; scale cos/sin."""
    factor = float(params["factor"])
    old_len = float(params["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention_factor = mscale(factor, params["mscale"]) / mscale(
                factor, params["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(float(params.get("beta_fast") or 32))
    high = correction_dim(float(params.get("beta_slow") or 1))
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * \
        extrapolation
    return inv_freq, float(attention_factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by position, the half-split convention of HF checkpoints;
    cos/sin [T, 1, D] from `ForwardContext.rope_cos_sin`."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def apply_rope_pairs(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
                     ) -> torch.Tensor:
    """x [T, H, D] rotated as complex pairs (x[2i], x[2i+1]) (Llama 4's convention)."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.to(x.device)  # [T, D/2]
    rot = torch.polar(torch.ones_like(freqs), freqs).unsqueeze(1)  # [T, 1, D/2]
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * rot).flatten(-2).to(x.dtype)


class Rotary(nn.Module):
    """RoPE of one layer on the first `rotary_dim` of each head; the rest passes unchanged.
    A `partial_rotary_factor` shortens `rotary_dim` (Bamba, Qwen3-Next), except for the
    "proportional" type, which spends it on frequencies over the whole head (Gemma 4)."""

    def __init__(self, head_dim: int, params: Mapping[str, Any],
                 partial_rotary_factor: float = 1.0) -> None:
        super().__init__()
        params = dict(params)
        if params.get("rope_type") != "proportional":
            partial_rotary_factor = float(params.pop("partial_rotary_factor",
                                                     partial_rotary_factor))
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        self.partial = self.rotary_dim != head_dim
        inv_freq, self.scaling = rope_inv_freq(self.rotary_dim, params)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # Layers with equal RoPE parameters share one cos/sin per step.
        self.key = rope_key(self.rotary_dim, params)
        self.native_ops = False  # float32 CPU rows in one C call (worker/cpu_ops.py)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], head_dim: int, kind: str) -> Rotary:
        return cls(head_dim, rope_params(cfg, kind),
                   float(cfg.get("partial_rotary_factor") or 1.0))

    def cos_sin(self, positions: torch.Tensor, ctx: ForwardContext
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return ctx.rope_cos_sin(positions, self.key, self.inv_freq, self.scaling)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] -> the same with its first `rotary_dim` rotated."""
        if self.native_ops and x.dim() == 3 and cpu_ops.takes(x) and \
                cos.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous() \
                and cos.shape == (x.shape[0], 1, self.rotary_dim):
            return cpu_ops.rope(x, cos, sin, self.rotary_dim)
        if not self.partial:
            return apply_rope(x, cos, sin)
        d = self.rotary_dim
        return torch.cat([apply_rope(x[..., :d], cos, sin), x[..., d:]], dim=-1)
