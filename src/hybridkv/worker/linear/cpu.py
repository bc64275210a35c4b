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


_ATTENTION_SIGNATURE: list[Any] = [_PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64,
                                   _PTR, _PTR, _I64, _I64, _PTR, _I64]


def attention_kernel() -> Any:
    """The kernel behind `attention`, or None where the library cannot be built."""
    return native.function("linear", "hkv_attention_f32", _ATTENTION_SIGNATURE, _INT)


def attention(q_rows: torch.Tensor, group: int, k_panels: torch.Tensor, keys: int,
              v_panels: torch.Tensor, out: torch.Tensor, *, q_start: int = 0,
              k_start: int = 0, window: int | None = None, chunk: int | None = None) -> None:
    """One KV head's queries over its keys (linear.c `hkv_attention_f32`): query rows
    [nq * group, D] (position-major, scaled) at positions q_start .. q_start + nq - 1, each
    over the keys at its position and before, from its window's or chunk's start; the
    `keys` keys at positions k_start .. as k_panels `pack(keys [keys, D])` and v_panels
    [ceil(Dv / 64), >= keys, 64] (V^T's panels); out [nq * group, Dv] rows of unit stride.
    float32 CPU tensors; the kernel must build (`attention_kernel`)."""
    rows, head_dim = q_rows.shape
    num_q = rows // group
    value_dim = out.shape[1]
    last = q_start + num_q - 1
    if not (q_rows.is_contiguous() and k_panels.is_contiguous() and v_panels.is_contiguous()
            and out.stride(-1) == 1 and rows == num_q * group and out.shape[0] == rows
            and k_panels.shape[1] == head_dim and k_panels.shape[0] * PANEL >= keys
            and v_panels.shape[1] >= keys and v_panels.shape[0] * PANEL >= value_dim
            and k_start <= q_start and last < k_start + keys):
        raise ValueError(f"attention takes [nq * G, D] query rows at positions the keys "
                         f"cover and the keys' and values' panels, not q "
                         f"{tuple(q_rows.shape)} (G {group}) at {q_start}, {keys} keys at "
                         f"{k_start} in k panels {tuple(k_panels.shape)}, v panels "
                         f"{tuple(v_panels.shape)}, out {tuple(out.shape)}")
    if attention_kernel()(q_rows.data_ptr(), num_q, group, head_dim, q_start, k_start, keys,
                          window or 0, chunk or 0, k_panels.data_ptr(), v_panels.data_ptr(),
                          v_panels.shape[1], value_dim, out.data_ptr(), out.stride(0)):
        raise MemoryError("attention: no memory for a thread's row of scores")


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
