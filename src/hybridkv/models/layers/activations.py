"""Activations by their Hugging Face config names."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Activation = Callable[[torch.Tensor], torch.Tensor]

ACTIVATIONS: dict[str, Activation] = {
    "silu": nn.functional.silu,
    "gelu": nn.functional.gelu,
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "relu": nn.functional.relu,
    "relu2": lambda x: torch.relu(x).square(),
}


def activation(name: str) -> Activation:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: "
                         f"{', '.join(ACTIVATIONS)}") from None


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, *, alpha: float,
                   limit: float) -> torch.Tensor:
    """gpt-oss's GLU: both halves clamped, gate * sigmoid(alpha * gate), times (up + 1)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
