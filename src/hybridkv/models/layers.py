"""Layers shared by model families: norms, rotary embeddings, activations, the forward
context that carries attention metadata and KV views through one forward pass."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


class RMSNorm(nn.Module):
    """`offset=1.0` is Gemma's `(1 + w)` form, computed in float32 then cast back."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 (as the reference implementations do), one fused op.
        normed = nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.offset:
            return (normed * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)


ACTIVATIONS = {
    "silu": nn.functional.silu,
    "gelu": nn.functional.gelu,
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "relu": nn.functional.relu,
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), the MLP of most decoders here."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))  # type: ignore[no-any-return]


def activation(name: str) -> Any:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: "
                         f"{', '.join(ACTIVATIONS)}") from None


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
