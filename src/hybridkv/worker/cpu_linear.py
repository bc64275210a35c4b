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


_CAUSAL_SIGNATURE: list[Any] = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64]


def causal_kernel() -> Any:
    """The kernel behind `causal_attention`, or None where the library cannot be built."""
    return native.function("linear", "hkv_causal_attention_f32", _CAUSAL_SIGNATURE, _INT)


def causal_attention(q_rows: torch.Tensor, group: int, k_panels: torch.Tensor,
                     v_panels: torch.Tensor, out: torch.Tensor) -> None:
    """Causal attention of one KV head's query rows, queries and keys both at positions
    0 .. L-1 (linear.c `hkv_causal_attention_f32`): q_rows [L * group, D] (position-major,
    scaled), k_panels `pack(keys [L, D])`, v_panels [ceil(Dv / 64), >= L, 64] (V^T's
    panels), out [L * group, Dv] rows of unit stride. float32 CPU tensors; the kernel must
    build (`causal_kernel`)."""
    rows, head_dim = q_rows.shape
    length = rows // group
    value_dim = out.shape[1]
    if not (q_rows.is_contiguous() and k_panels.is_contiguous() and v_panels.is_contiguous()
            and out.stride(-1) == 1 and rows == length * group and out.shape[0] == rows
            and k_panels.shape[1] == head_dim and k_panels.shape[0] * PANEL >= length
            and v_panels.shape[1] >= length and v_panels.shape[0] * PANEL >= value_dim):
        raise ValueError(f"causal_attention takes [L * G, D] query rows and the keys' and "
                         f"values' panels, not q {tuple(q_rows.shape)} (G {group}), k panels "
                         f"{tuple(k_panels.shape)}, v panels {tuple(v_panels.shape)}, out "
                         f"{tuple(out.shape)}")
    if causal_kernel()(q_rows.data_ptr(), length, group, head_dim, k_panels.data_ptr(),
                       v_panels.data_ptr(), v_panels.shape[1], value_dim, out.data_ptr(),
                       out.stride(0)):
        raise MemoryError("causal attention: no memory for a thread's row of scores")


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
