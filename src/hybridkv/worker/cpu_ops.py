"""RMSNorm, RoPE, K/V writes, causal convolutions and Mamba-2's state steps and prompt
scans for float32 tensors on the CPU, one C call each (worker/native/cpu_ops.c).

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
    "hkv_mamba2_decode_f32": [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64,
                              _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR,
                              _PTR],
    "hkv_mamba2_scan_f32": [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _I64, _I64,
                            _PTR, _I64, _PTR, _PTR, _PTR, _F32, _PTR, _I64, _PTR, _PTR, _PTR],
    "hkv_gdn_decode_f32": [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR,
                           _I64, _I64, _I64, _I64, _PTR, _PTR],
    "hkv_gdn_gates_f32": [_PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _F32, _PTR, _PTR],
    "hkv_gated_head_norm_f32": [_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _F32, _PTR],
    "hkv_sigmoid_gate_f32": [_PTR, _PTR, _I64, _I64, _I64, _I64, _I64],
    "hkv_short_conv_decode_f32": [_PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _PTR],
    "hkv_causal_conv_f32": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, ctypes.c_int,
                            _PTR, _I64, _PTR, _PTR, _PTR],
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


def decode_states_take(conv_states: torch.Tensor, ssm_states: torch.Tensor) -> bool:
    """Whether mamba2_decode takes these states: float32 on the CPU, conv states
    [pages, slots, C, kernel - 1] and SSM states [pages, slots, H, P, N], each (page, slot)
    state contiguous."""
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (conv_states,
                                                                       ssm_states)):
        return False
    if conv_states.dim() != 4 or ssm_states.dim() != 5:
        return False
    _, _, heads, head_dim, size = ssm_states.shape
    return conv_states.stride()[2:] == (conv_states.shape[3], 1) and \
        ssm_states.stride()[2:] == (head_dim * size, size, 1)


def mamba2_decode(conv_states: torch.Tensor, ssm_states: torch.Tensor, pages: torch.Tensor,
                  slots: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor,
                  weight: torch.Tensor, bias: torch.Tensor | None, dt_bias: torch.Tensor,
                  a: torch.Tensor, skip: torch.Tensor, groups: int) -> torch.Tensor:
    """One Mamba-2 decode step of rows (pages[r], slots[r]) as models/layers/mamba2.py's
    torch code computes it (the conv from its state and silu, softplus(dt + dt_bias), the
    state update, y = state . C + x D), in one C call, both states updated in place
    (decode_states_take): xbc [R, C] and dt [R, H] rows (unit stride), weight [C, 1, k].
    Returns y [R, H P] float32."""
    rows, channels = xbc.shape
    _, _, heads, head_dim, size = ssm_states.shape
    kernel = weight.shape[-1]
    weight = weight.reshape(channels, kernel).float().contiguous()
    bias = None if bias is None else bias.float().contiguous()
    dt_bias, a, skip = (t.float().contiguous() for t in (dt_bias, a, skip))
    conv_at = (pages * conv_states.stride(0) + slots * conv_states.stride(1)).to(torch.int64)
    ssm_at = (pages * ssm_states.stride(0) + slots * ssm_states.stride(1)).to(torch.int64)
    y = torch.empty((rows, heads * head_dim), dtype=torch.float32)
    work = torch.empty(channels)
    library().hkv_mamba2_decode_f32(
        conv_states.data_ptr(), conv_at.data_ptr(), ssm_states.data_ptr(), ssm_at.data_ptr(),
        rows, xbc.data_ptr(), xbc.stride(0), weight.data_ptr(),
        None if bias is None else bias.data_ptr(), kernel, channels, dt.data_ptr(),
        dt.stride(0), dt_bias.data_ptr(), a.data_ptr(), skip.data_ptr(), heads, head_dim, size,
        groups, y.data_ptr(), work.data_ptr())
    return y


def gdn_decode(conv_states: torch.Tensor, ssm_states: torch.Tensor, pages: torch.Tensor,
               slots: torch.Tensor, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
               weight: torch.Tensor, k_heads: int) -> torch.Tensor:
    """One Gated DeltaNet decode step of rows (pages[r], slots[r]) as
    models/layers/gated_deltanet.py's torch code computes it (the conv from its state and
    silu, q and k L2-normalised, q by 1/sqrt(k_dim), the gated delta rule), in one C call,
    both states updated in place (decode_states_take: delta states [pages, slots, Hv, Dk,
    Dv]): mixed [R, 2 Hk Dk + Hv Dv] rows q|k|v (unit stride), beta and g [R, Hv], weight
    [C, 1, kernel] (no bias). Returns [R, Hv, Dv] float32."""
    rows, channels = mixed.shape
    _, _, v_heads, k_dim, v_dim = ssm_states.shape
    kernel = weight.shape[-1]
    weight = weight.reshape(channels, kernel).float().contiguous()
    beta, g = beta.float().contiguous(), g.float().contiguous()
    conv_at = (pages * conv_states.stride(0) + slots * conv_states.stride(1)).to(torch.int64)
    ssm_at = (pages * ssm_states.stride(0) + slots * ssm_states.stride(1)).to(torch.int64)
    out = torch.empty((rows, v_heads, v_dim), dtype=torch.float32)
    work = torch.empty(rows * channels)
    library().hkv_gdn_decode_f32(
        conv_states.data_ptr(), conv_at.data_ptr(), ssm_states.data_ptr(), ssm_at.data_ptr(),
        rows, mixed.data_ptr(), mixed.stride(0), weight.data_ptr(), kernel, beta.data_ptr(),
        g.data_ptr(), k_heads, v_heads, k_dim, v_dim, out.data_ptr(), work.data_ptr())
    return out


def gdn_gates(b: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, a_neg: torch.Tensor,
              beta_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's (beta, g), each [T, heads] float32, from b and a [T, heads] rows
    (unit stride): beta = sigmoid(b) * beta_scale, g = a_neg * softplus(a + dt_bias), a_neg
    = -exp(A_log) (float32, contiguous)."""
    rows, heads = b.shape
    beta = torch.empty((rows, heads), dtype=torch.float32)
    g = torch.empty((rows, heads), dtype=torch.float32)
    library().hkv_gdn_gates_f32(b.data_ptr(), b.stride(0), a.data_ptr(), a.stride(0), rows,
                                heads, dt_bias.data_ptr(), a_neg.data_ptr(), beta_scale,
                                beta.data_ptr(), g.data_ptr())
    return beta, g


def gated_head_norm(out: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """Gated DeltaNet's output norm, weight * (out / rms(out)) * silu(z) per value head:
    out [T, heads, dim] contiguous, z [T, heads, dim] with unit strides inside a row,
    weight [dim] float32 contiguous. Returns [T, heads * dim] float32."""
    rows, heads, dim = out.shape
    y = torch.empty((rows, heads * dim), dtype=torch.float32)
    library().hkv_gated_head_norm_f32(out.data_ptr(), z.data_ptr(), z.stride(0), rows, heads,
                                      dim, weight.data_ptr(), eps, y.data_ptr())
    return y


def gated_head_norm_takes(out: torch.Tensor, z: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether gated_head_norm takes these tensors."""
    return all(takes(t) for t in (out, z, weight)) and out.dim() == z.dim() == 3 and \
        out.is_contiguous() and weight.is_contiguous() and \
        z.stride(1) == z.shape[2] and out.shape == z.shape


def sigmoid_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """out [T, H D] (contiguous) times sigmoid(gate [T, H, D], unit stride along D), in
    place; returns out."""
    rows, heads, dim = gate.shape
    library().hkv_sigmoid_gate_f32(out.data_ptr(), gate.data_ptr(), gate.stride(0),
                                   gate.stride(1), rows, heads, dim)
    return out


def conv_states_take(conv_states: torch.Tensor) -> bool:
    """Whether short_conv_decode takes these states: float32 on the CPU, [pages, slots, C,
    kernel - 1] with each (page, slot) state contiguous."""
    return conv_states.dtype == torch.float32 and conv_states.device.type == "cpu" and \
        conv_states.dim() == 4 and conv_states.stride()[2:] == (conv_states.shape[3], 1)


def short_conv_decode(conv_states: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor,
                      bcx: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """One LFM2 short-conv decode step of rows (pages[r], slots[r]) as
    models/layers/short_conv.py computes it (C * conv(B * x), the conv from its state), in
    one C call, the states updated in place (conv_states_take): bcx [R, 3 C] rows B | C | x
    (unit stride), weight [C, 1, kernel]. Returns [R, C] float32."""
    rows = bcx.shape[0]
    channels, kernel = weight.shape[0], weight.shape[-1]
    weight = weight.reshape(channels, kernel).float().contiguous()
    bias = None if bias is None else bias.float().contiguous()
    conv_at = (pages * conv_states.stride(0) + slots * conv_states.stride(1)).to(torch.int64)
    y = torch.empty((rows, channels), dtype=torch.float32)
    library().hkv_short_conv_decode_f32(
        conv_states.data_ptr(), conv_at.data_ptr(), rows, bcx.data_ptr(), bcx.stride(0),
        weight.data_ptr(), None if bias is None else bias.data_ptr(), kernel, channels,
        y.data_ptr())
    return y


def _checkpoints(save_at: dict[int, torch.Tensor], tokens: int, first: int
                 ) -> tuple[list[int], list[torch.Tensor], torch.Tensor, Any]:
    """The checkpoints to write (offsets first..tokens, ascending), each as a float32
    contiguous buffer the C code writes: the checkpoint itself where it is one, else a
    temporary the caller copies over (`_finish`)."""
    offsets = sorted(o for o in save_at if first <= o <= tokens)
    buffers = [save_at[o] if save_at[o].dtype == torch.float32 and save_at[o].is_contiguous()
               else torch.empty(save_at[o].shape, dtype=torch.float32) for o in offsets]
    at = torch.tensor(offsets, dtype=torch.int64)
    pointers = (ctypes.c_void_p * max(1, len(buffers)))(*[t.data_ptr() for t in buffers])
    return offsets, buffers, at, pointers


def _finish(save_at: dict[int, torch.Tensor], offsets: list[int],
            buffers: list[torch.Tensor]) -> None:
    for offset, buffer in zip(offsets, buffers, strict=True):
        if buffer is not save_at[offset]:
            save_at[offset].copy_(buffer)


def takes_state(state: torch.Tensor) -> bool:
    """Whether the C prompt code updates this state in place: float32, contiguous, CPU."""
    return state.dtype == torch.float32 and state.device.type == "cpu" and \
        state.is_contiguous()


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, save_at: dict[int, torch.Tensor],
                silu: bool) -> torch.Tensor:
    """models/layers/state.py's causal_conv (then silu if asked) in one C call: x [L, C]
    float32 rows (unit stride along C), conv_state [C, kernel - 1] (takes_state) updated in
    place, weight [C, 1, kernel], save_at {offset: [C, kernel - 1] checkpoint} written with
    the kernel - 1 inputs before token `offset`. Returns [L, C] float32."""
    tokens, channels = x.shape
    kernel = weight.shape[-1]
    weight = weight.reshape(channels, kernel).float().contiguous()
    bias = None if bias is None else bias.float().contiguous()
    offsets, buffers, at, pointers = _checkpoints(save_at, tokens, 0)
    out = torch.empty((tokens, channels), dtype=torch.float32)
    work = torch.empty((2 * kernel - 1) * channels)
    library().hkv_causal_conv_f32(
        x.data_ptr(), x.stride(0), tokens, channels, conv_state.data_ptr(),
        weight.data_ptr(), None if bias is None else bias.data_ptr(), kernel, int(silu),
        at.data_ptr(), len(offsets), ctypes.addressof(pointers), out.data_ptr(),
        work.data_ptr())
    _finish(save_at, offsets, buffers)
    return out


def mamba2_scan(xbc: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor,
                skip: torch.Tensor, dt_min: float | None, state: torch.Tensor,
                groups: int, save_at: dict[int, torch.Tensor]) -> torch.Tensor:
    """A Mamba-2 prompt's steps after its convolution, as models/layers/mamba2.py's torch
    code computes them (softplus(dt + dt_bias), at least dt_min unless None; the scan of
    models/layers/ssd.py's ssd_scan to float rounding; the D skip), in one C call: xbc
    [L, inner + 2 G N] the conv's output after silu (x, then B, then C; unit stride), dt
    [L, H] (unit stride), state [H, P, N] (takes_state) updated in place, save_at {offset:
    [H, P, N] checkpoint} written with the state after `offset` (1..L) tokens. Returns y [L, H P]
    float32."""
    heads, head_dim, size = state.shape
    tokens, inner = xbc.shape[0], heads * head_dim
    offsets, buffers, at, pointers = _checkpoints(save_at, tokens, 1)
    dt_bias, a, skip = (t.float().contiguous() for t in (dt_bias, a, skip))
    y = torch.empty((tokens, inner), dtype=torch.float32)
    work = torch.empty(2 * tokens * heads + head_dim * size)
    library().hkv_mamba2_scan_f32(
        state.data_ptr(), tokens, heads, head_dim, size, groups, xbc.data_ptr(),
        xbc.stride(0), inner, inner + groups * size, dt.data_ptr(), dt.stride(0),
        dt_bias.data_ptr(), a.data_ptr(), skip.data_ptr(),
        float("-inf") if dt_min is None else dt_min, at.data_ptr(), len(offsets),
        ctypes.addressof(pointers), y.data_ptr(), work.data_ptr())
    _finish(save_at, offsets, buffers)
    return y


def use_cpu_ops(model: nn.Module) -> None:
    """Switch on these kernels in every module that has them (a `native_ops` attribute)."""
    library()
    for module in model.modules():
        if isinstance(getattr(module, "native_ops", None), bool):
            module.__dict__["native_ops"] = True  # a plain attribute, not a submodule
