"""Linear layers on the CPU through one C call each (worker/native/linear.c), float32.

A decode step's projections are a few dozen rows against weights far larger than the
caches, so their cost is streaming the weights once from memory. The weights are packed
here, once, into the kernel's panels ([panels, in_features, 64]: 64 output columns, each
panel one forward stream), and a gated MLP's gate and up are interleaved per panel (32
columns each) so the kernel applies the activation and the product in registers.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from hybridkv.worker import native

PANEL = 64
PLAIN = 0
# Hugging Face activation name -> the kernel's gated epilogue (see linear.c).
GATED_ACTIVATIONS = {"silu": 1, "gelu_pytorch_tanh": 2, "gelu_new": 2, "relu": 3}

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURE: list[Any] = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _INT]
_fn: Any = None


def library() -> ctypes.CDLL:
    """The compiled kernel (built on first use; NativeBuildError where no compiler runs)."""
    global _fn
    lib = native.load("linear")
    if _fn is None:
        fn = lib.hkv_linear_f32
        fn.argtypes, fn.restype = _SIGNATURE, None
        _fn = fn
    return lib


_STRIDED_SIGNATURE: list[Any] = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64,
                                 _INT]


def strided_product() -> Any:
    """The kernel behind `product_into`, or None where the library cannot be built."""
    return native.function("linear", "hkv_linear_f32_strided", _STRIDED_SIGNATURE)


def product_into(x: torch.Tensor, panels: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """out [m, n] = x [m, k] times the first k rows of each of `panels` [p, K >= k, 64]
    (`pack`'s layout: panel i holds columns 64 i .. 64 i + 63; n <= 64 p), a product over a
    prefix of K without repacking. x and out: float32 CPU rows of unit stride; the kernel
    must build (`strided_product`)."""
    if not (x.stride(-1) == 1 and out.stride(-1) == 1 and panels.is_contiguous()
            and k <= min(panels.shape[1], x.shape[1])
            and out.shape[1] <= PANEL * panels.shape[0] and x.shape[0] == out.shape[0]):
        raise ValueError(f"product_into takes rows of unit stride and a prefix of the "
                         f"panels, not x {tuple(x.shape)}, panels {tuple(panels.shape)}, "
                         f"k {k}, out {tuple(out.shape)}")
    strided_product()(x.data_ptr(), x.shape[0], x.stride(0), panels.data_ptr(), k,
                      panels.shape[1] * PANEL, None, out.data_ptr(), out.shape[1],
                      out.stride(0), PLAIN)


def _panels(rows: torch.Tensor, width: int) -> torch.Tensor:
    """[n, ...] -> [ceil(n / width), width, ...], zero rows appended."""
    padded = rows.new_zeros((-(-rows.shape[0] // width) * width, *rows.shape[1:]))
    padded[:rows.shape[0]] = rows
    return padded.view(-1, width, *rows.shape[1:])


def pack(weight: torch.Tensor, bias: torch.Tensor | None
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """weight [n, k] (and bias [n]) -> the kernel's panels [p, k, 64] (and bias [p * 64])."""
    packed = _panels(weight.detach(), PANEL).transpose(1, 2).contiguous()
    return packed, None if bias is None else _panels(bias.detach(), PANEL).flatten()


def pack_gated(gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor | None,
               up_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gate, up [n, k] -> panels [p, k, 64] of 32 gate columns then the same 32 of up."""
    half = PANEL // 2
    packed = torch.cat([_panels(gate.detach(), half), _panels(up.detach(), half)], dim=1)
    if gate_bias is None and up_bias is None:
        return packed.transpose(1, 2).contiguous(), None
    biases = [b.detach() if b is not None else gate.new_zeros(gate.shape[0])
              for b in (gate_bias, up_bias)]
    bias = torch.cat([_panels(b, half) for b in biases], dim=1).flatten()
    return packed.transpose(1, 2).contiguous(), bias


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int,
           mode: int = PLAIN) -> torch.Tensor:
    """x [..., k] times packed weights -> [..., n] (n: the gated outputs for a gated mode)."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"the CPU linear kernel takes float32 CPU inputs, not {x.dtype} on "
                         f"{x.device.type}")
    k = packed.shape[1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = x.new_empty((rows.shape[0], n))
    if rows.shape[0]:
        if _fn is None:
            library()
        _fn(rows.data_ptr(), rows.shape[0], rows.stride(0), packed.data_ptr(), k,
            None if bias is None else bias.data_ptr(), out.data_ptr(), n, n, mode)
    return out.view(*x.shape[:-1], n)
