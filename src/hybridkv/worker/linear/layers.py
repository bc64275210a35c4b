"""Linear layers as the runner runs them, chosen once the model is loaded and on its device.

Two things change against a plain `nn.Linear` per projection:
- projections of the same input are one GEMM (q/k/v; a gated MLP's gate and up): fewer,
  larger calls, which matters most when a step is a few dozen tokens;
- on CPUs, float32 weights are packed once for hybridkv's own kernel ("cpu",
  worker/linear/cpu.py: a C call per projection, the gated MLP's activation and product in
  its registers), which streams the weights at decode about 1.1x faster than oneDNN and
  runs prefill at oneDNN's speed; or, for bfloat16, reordered once into oneDNN's blocked
  layout for its prepacked GEMM ("onednn", about 1.2x faster than `F.linear` for these
  shapes here, the gated MLP's activation and product as the GEMMs' post-ops).

The kernel is "cpu", "onednn" or "torch" (`choose_kernel`); "torch" is what runs on CUDA.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from hybridkv.worker import native
from hybridkv.worker.linear import cpu as cpu_linear
from hybridkv.worker.linear import quant as quant_linear
from hybridkv.worker.linear.quantized import QuantizedLinear, QuantizedParts

logger = logging.getLogger(__name__)

KERNELS = ("auto", "cpu", "onednn", "torch")
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
    """"auto": the C kernel for float32 on CPUs where it compiles, else oneDNN where it runs
    this device and dtype, else torch."""
    device = torch.device(device)
    if name not in KERNELS:
        raise ValueError(f"linear_kernel {name!r} is not one of {', '.join(KERNELS)}")
    if name in ("cpu", "auto") and device.type == "cpu" and dtype == torch.float32:
        try:
            cpu_linear.library()
            return "cpu"
        except native.NativeBuildError as exc:
            if name == "cpu":
                raise ValueError(f"linear_kernel 'cpu' cannot be built here ({exc}); use "
                                 f"'auto', 'onednn' or 'torch'") from None
            logger.warning("linear kernel 'cpu' unavailable (%s); using oneDNN or torch", exc)
    elif name == "cpu":
        raise ValueError(f"linear_kernel 'cpu' needs a CPU device and float32; got "
                         f"{device.type}, {dtype}; use 'auto', 'onednn' or 'torch'")
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

    def __init__(self, linears: Sequence[nn.Linear | QuantizedLinear], kernel: str) -> None:
        super().__init__()
        self.sizes = [lin.out_features for lin in linears]
        self.out_features = sum(self.sizes)
        self.kernel = kernel
        self.quantized: QuantizedParts | None = None
        if any(isinstance(lin, QuantizedLinear) for lin in linears):
            # Weights kept in GGUF blocks: the quantized kernels, whatever `kernel` says.
            if not all(isinstance(lin, QuantizedLinear) for lin in linears):
                raise ValueError("a fused projection mixes quantized and float weights")
            self.kernel = "quantized"
            self.quantized = QuantizedParts(linears)  # type: ignore[arg-type]
            self.register_buffer("weight", None, persistent=False)
            self.register_buffer("bias", None, persistent=False)
            return
        weight, bias = _cat(linears)  # type: ignore[arg-type]
        if kernel == "onednn":
            weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        elif kernel == "cpu":
            weight, bias = cpu_linear.pack(weight, bias)
        # Buffers, not parameters: they are a kernel's copy of loaded weights, not a
        # checkpoint's tensors (and the oneDNN and "cpu" ones are in blocked layouts).
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized(x)  # type: ignore[no-any-return]
        if self.kernel == "cpu":
            return cpu_linear.linear(x, self.weight, self.bias, self.out_features)
        if self.kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise(  # type: ignore[no-any-return]
                x.contiguous(), self.weight, self.bias, "none", [], "")
        return nn.functional.linear(x, self.weight, self.bias)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(self.sizes) == 1:
            return (self(x),)
        return tuple(self(x).split(self.sizes, dim=-1))


class GatedLinear(nn.Module):
    """act(gate(x)) * up(x): with the "cpu" kernel one pass over interleaved gate/up panels,
    the activation and product in registers; with oneDNN two GEMMs, the first applying the
    activation and the second multiplying by it as post-ops; otherwise (torch, or an
    activation the kernel lacks) one GEMM for both, then act and product."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, gate: nn.Linear | QuantizedLinear, up: nn.Linear | QuantizedLinear,
                 activation: str, act: Callable[[torch.Tensor], torch.Tensor],
                 kernel: str) -> None:
        """`activation`: the Hugging Face name of `act`. Quantized gate and up run as one
        quantized call, then the activation and product; where they share a block type and
        the C kernel has the activation, the quantized kernel's gated product
        (quant_linear.gated_matmul; gate and up of two types: the same C activation loop,
        quant_linear.gated_rows)."""
        super().__init__()
        quantized = isinstance(gate, QuantizedLinear)
        self.quantized_mode = cpu_linear.GATED_ACTIVATIONS.get(activation) \
            if quantized and gate.bias is None and up.bias is None else None
        self.gated_mode = cpu_linear.GATED_ACTIVATIONS.get(activation) \
            if kernel == "cpu" and not quantized else None
        self.post_op = ONEDNN_ACTIVATIONS.get(activation) \
            if kernel == "onednn" and not quantized else None
        if self.gated_mode is not None:
            assert isinstance(gate, nn.Linear) and isinstance(up, nn.Linear)
            weight, bias = cpu_linear.pack_gated(gate.weight, up.weight, gate.bias, up.bias)
            self.register_buffer("weight", weight, persistent=False)
            self.register_buffer("bias", bias, persistent=False)
            self.out_features = gate.out_features
        elif self.post_op is not None:
            self.gate, self.up = Linear([gate], kernel), Linear([up], kernel)
        else:
            self.gate_up = Linear([gate, up], kernel)
            self.act = act

    @property
    def fused_activation(self) -> bool:
        """Whether the activation and product run inside the GEMMs."""
        return self.gated_mode is not None or self.post_op is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated_mode is not None:
            return cpu_linear.linear(x, self.weight, self.bias, self.out_features,
                                     self.gated_mode)
        if self.quantized_mode is not None:
            parts = self.gate_up.quantized
            rows = x.reshape(-1, x.shape[-1])
            if parts is not None and len(parts.weights) <= 2:
                # One matrix of gate then up rows (a fused file tensor), or gate and up.
                y = quant_linear.gated_matmul(rows, parts.weights[0], self.quantized_mode,
                                              *parts.weights[1:])
                if y is not None:
                    return y.view(*x.shape[:-1], y.shape[-1])
            if parts is not None and all(quant_linear.takes_gemm(w.qtype, w.cols)
                                           for w in parts.weights):
                # Gate and up of two block types, or 8-bit activations: the activation by
                # the kernel's own loop, so the bytes do not depend on which path a row took
                # (the native decode layers run the same loop).
                gate, up = self.gate_up.split(rows)
                y = quant_linear.gated_rows(gate, up, self.quantized_mode)
                return y.view(*x.shape[:-1], y.shape[-1])
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
