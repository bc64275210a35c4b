"""RMSNorm, RoPE, K/V writes and Mamba-2's state steps and prompt scans for float32
tensors on the CPU, one C call each (worker/native/cpu_ops.c).

A decode step's norms and rotations are tiny ([batch, width] rows), so torch's cost there
is per op, not per element: RMSNorm alone runs five ops (about 15-30 us per call for 32
rows, against ~2 us here). Models call these through `RMSNorm` and `Rotary` once
`use_cpu_ops(model)` has switched them on (the loader does, on CPU devices where the C
library builds, with the "cpu" attention backend); any other dtype or device takes the
torch formulas, which stay the reference the tests compare against.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn

from hybridkv.worker import native

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SIGNATURES: dict[str, list[Any]] = {
    "hkv_rms_norm_f32": [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _F32, _F32],
    "hkv_rope_f32": [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64],
    "hkv_write_kv_f32": [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR,
                         _I64, _I64, _I64, _I64, _I64, _I64, _I64],
    "hkv_ssd_decode_f32": [_PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR,
                           _PTR],
    "hkv_ssd_scan_f32": [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR,
                         _PTR, _I64, _PTR, _PTR],
}
_lib: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The compiled ops (built on first use; NativeBuildError where no compiler runs)."""
    global _lib
    if _lib is None:
        lib = native.load("cpu_ops")
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
        _lib = lib
    return _lib


def takes(x: torch.Tensor) -> bool:
    """Whether these kernels take x: float32 on the CPU, unit stride along its last dim."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(-1) == 1


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(n0, stride0, n1, stride1) of x's rows: [T, D] or [T, H, D]."""
    if x.dim() not in (2, 3):
        raise ValueError(f"the CPU ops take [T, D] or [T, H, D] rows, not shape "
                         f"{tuple(x.shape)}")
    if x.dim() == 2:
        return x.shape[0], x.stride(0), 1, 0
    return x.shape[0], x.stride(0), x.shape[1], x.stride(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             offset: float = 0.0) -> torch.Tensor:
    """x / rms(x) * (offset + weight) over the last dim; x [T, D] or [T, H, D]."""
    n0, s0, n1, s1 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype)
    library().hkv_rms_norm_f32(x.data_ptr(), s0, s1, out.data_ptr(), n0, n1, x.shape[-1],
                               None if weight is None else weight.data_ptr(), offset, eps)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
         ) -> torch.Tensor:
    """x [T, H, D] with the first `rotary_dim` of each head rotated (half-split pairs);
    cos/sin [T, 1, rotary_dim] contiguous."""
    n0, s0, n1, s1 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype)
    library().hkv_rope_f32(x.data_ptr(), s0, s1, out.data_ptr(), n0, n1, x.shape[-1],
                           cos.data_ptr(), sin.data_ptr(), rotary_dim)
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, block_size: int, blocks_per_page: int) -> None:
    """k/v [T, Hk, D] into their slots of K/V pages [pages, per_page, 2, block, Hk, D]."""
    cs = kv_cache.stride()
    library().hkv_write_kv_f32(
        k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
        k.shape[0], k.shape[1], k.shape[2], slot_mapping.data_ptr(), kv_cache.data_ptr(),
        cs[0], cs[1], cs[2], cs[3], cs[4], block_size, blocks_per_page)


def ssd_decode_takes(states: torch.Tensor) -> bool:
    """Whether ssd_decode takes these states: float32 on the CPU, [pages, slots, H, P, N]
    with each (page, slot) state contiguous."""
    if states.dtype != torch.float32 or states.device.type != "cpu" or states.dim() != 5:
        return False
    _, _, heads, head_dim, size = states.shape
    return states.stride()[2:] == (head_dim * size, size, 1)


def ssd_decode(states: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor,
               decay: torch.Tensor, dtx: torch.Tensor, b: torch.Tensor, c: torch.Tensor
               ) -> torch.Tensor:
    """One Mamba-2 decode step in place on the states of rows (pages[r], slots[r]) of
    `states` [pages, slots, H, P, N] (ssd_decode_takes): state = state * decay[r, h] +
    dtx[r, h, p] b[r, g] (g: head h's group of B/C), returns y [R, H, P] = state . c[r, g].
    decay [R, H], dtx [R, H, P], b / c [R, G, N]: float32, contiguous."""
    rows, heads, head_dim = dtx.shape
    offsets = (pages * states.stride(0) + slots * states.stride(1)).to(torch.int64)
    y = torch.empty((rows, heads, head_dim), dtype=torch.float32)
    library().hkv_ssd_decode_f32(
        states.data_ptr(), offsets.data_ptr(), rows, heads, head_dim, states.shape[4],
        b.shape[1], decay.data_ptr(), dtx.data_ptr(), b.data_ptr(), c.data_ptr(),
        y.data_ptr())
    return y


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             c: torch.Tensor, state: torch.Tensor, save_at: dict[int, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """models/layers/ssd.py's ssd_scan (same arguments but the chunk size, same results to
    float rounding) as the token-by-token recurrence in one C call: x [L, H, P], dt [L, H],
    a [H], b / c [L, G, N], state [H, P, N], float32 on the CPU. Returns (y [L, H, P]
    without the D skip, the final state); writes the state after `offset` tokens into
    `save_at[offset]` (any dtype)."""
    tokens, heads, head_dim = x.shape
    groups, size = b.shape[1], b.shape[2]
    final = state.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    decay = torch.exp(dt * a).contiguous()  # [L, H]
    b, c = b.contiguous(), c.contiguous()  # (held here: the C call reads them)
    dtx = (x * dt[:, :, None]).contiguous()  # [L, H, P]
    offsets = sorted(o for o in save_at if 0 < o <= tokens)
    buffers = [torch.empty_like(final) for _ in offsets]
    at = torch.tensor(offsets, dtype=torch.int64)
    pointers = (ctypes.c_void_p * max(1, len(buffers)))(*[t.data_ptr() for t in buffers])
    y = torch.empty((tokens, heads, head_dim), dtype=torch.float32)
    work = torch.empty(head_dim * size)  # one head's state, turned [N, P]
    library().hkv_ssd_scan_f32(
        final.data_ptr(), tokens, heads, head_dim, size, groups, decay.data_ptr(),
        dtx.data_ptr(), b.data_ptr(), c.data_ptr(), y.data_ptr(),
        at.data_ptr(), len(offsets), ctypes.addressof(pointers), work.data_ptr())
    for offset, buffer in zip(offsets, buffers, strict=True):
        save_at[offset].copy_(buffer.to(save_at[offset].dtype))
    return y, final


def use_cpu_ops(model: nn.Module) -> None:
    """Switch on these kernels in every module that has them (a `native_ops` attribute)."""
    library()
    for module in model.modules():
        if isinstance(getattr(module, "native_ops", None), bool):
            module.__dict__["native_ops"] = True  # a plain attribute, not a submodule
