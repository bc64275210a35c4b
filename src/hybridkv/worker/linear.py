"""Linear layers as the runner runs them, chosen once the model is loaded and on its device.

Two things change against a plain `nn.Linear` per projection:
- projections of the same input are one GEMM (q/k/v; a gated MLP's gate and up): fewer,
  larger calls, which matters most when a step is a few dozen tokens;
- on CPUs where torch has oneDNN, weights are reordered once into oneDNN's blocked layout
  and run through its prepacked GEMM (about 1.2x faster than `F.linear` for these shapes on
  the machines here), with a gated MLP's activation and product done as the GEMMs' post-ops
  instead of two passes over the [tokens, intermediate] activations.

The kernel is "onednn" or "torch" (`choose_kernel`); "torch" is what runs on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

KERNELS = ("auto", "onednn", "torch")
# Hugging Face activation name -> oneDNN eltwise post-op (attr, algorithm).
ONEDNN_ACTIVATIONS: dict[str, tuple[str, str]] = {
    "silu": ("swish", ""), "gelu": ("gelu", "none"), "gelu_pytorch_tanh": ("gelu", "tanh"),
    "gelu_new": ("gelu", "tanh"), "relu": ("relu", ""),
}


def onednn_supports(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def choose_kernel(name: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """"auto": oneDNN where it runs this device and dtype, torch elsewhere."""
    device = torch.device(device)
    if name not in KERNELS:
        raise ValueError(f"linear_kernel {name!r} is not one of {', '.join(KERNELS)}")
    if name == "onednn" and not onednn_supports(device, dtype):
        raise ValueError(f"linear_kernel 'onednn' needs a CPU device with oneDNN and float32 "
                         f"(or bfloat16 where the CPU has it); got {device.type}, {dtype}; "
                         f"use 'auto' or 'torch'")
    if name == "auto":
        return "onednn" if onednn_supports(device, dtype) else "torch"
    return name


def _cat(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([lin.weight.detach() for lin in linears])
    if all(lin.bias is None for lin in linears):
        return weight, None
    bias = torch.cat([lin.bias.detach() if lin.bias is not None else
                      weight.new_zeros(lin.out_features) for lin in linears])
    return weight, bias


class Linear(nn.Module):
    """One or more linear maps of one input as a single GEMM.

    forward(x) -> all outputs side by side; split(x) -> one tensor per map (views)."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linears: Sequence[nn.Linear], kernel: str) -> None:
        super().__init__()
        weight, bias = _cat(linears)
        self.sizes = [lin.out_features for lin in linears]
        self.onednn = kernel == "onednn"
        if self.onednn:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        # Buffers, not parameters: they are a kernel's copy of loaded weights, not a
        # checkpoint's tensors (and the oneDNN one is in a blocked layout).
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(  # type: ignore[no-any-return]
                x.contiguous(), self.weight, self.bias, "none", [], "")
        return nn.functional.linear(x, self.weight, self.bias)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(self.sizes) == 1:
            return (self(x),)
        return tuple(self(x).split(self.sizes, dim=-1))


class GatedLinear(nn.Module):
    """act(gate(x)) * up(x): with oneDNN two GEMMs, the first applying the activation and the
    second multiplying by it as post-ops; with torch one GEMM for both, then act and product."""

    def __init__(self, gate: nn.Linear, up: nn.Linear, activation: str,
                 act: Callable[[torch.Tensor], torch.Tensor], kernel: str) -> None:
        """`activation`: the Hugging Face name of `act`."""
        super().__init__()
        self.post_op = ONEDNN_ACTIVATIONS.get(activation) if kernel == "onednn" else None
        if self.post_op is not None:
            self.gate, self.up = Linear([gate], kernel), Linear([up], kernel)
        else:
            self.gate_up = Linear([gate, up], kernel)
            self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.post_op is None:
            gate, up = self.gate_up.split(x)
            return self.act(gate) * up
        x = x.contiguous()
        attr, algorithm = self.post_op
        gated = torch.ops.mkldnn._linear_pointwise(
            x, self.gate.weight, self.gate.bias, attr, [], algorithm)
        return torch.ops.mkldnn._linear_pointwise.binary(  # type: ignore[no-any-return]
            x, gated, self.up.weight, self.up.bias, "mul")


def fuse_linears(model: nn.Module, kernel: str) -> None:
    """Let every module that knows how (`fuse_linears(kernel)`: attention, gated MLPs, the
    LM head) replace its projections by the kernel's. Call once, after the weights are loaded
    and the model is on its device; the replaced `nn.Linear`s and their weights are dropped."""
    for module in list(model.modules()):
        fuse = getattr(module, "fuse_linears", None)
        if fuse is not None:
            fuse(kernel)
