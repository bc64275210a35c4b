"""Quantized KV rows in torch: what the pages of a `kv_cache_dtype` group hold, written on the
way in and read back on the torch attention path (any device; the CPU kernel reads the same
bytes in place, worker/native/paged_attention.c).

Row layout (kv/spec.py, `quantized_row_bytes`): [fp16 scale per group of 32 | values | pad].
Rounding is round-half-to-even in float32 on every device, so one process writes the same
bytes for the same K/V whatever path or tier a block later takes.
"""

from __future__ import annotations

import math

import torch

from hybridkv.kv.spec import CACHE_DTYPES, QUANT_GROUP, cdiv, quantized_row_bytes

# Largest representable magnitude of each dtype's values (int8 leaves -128 out so that the
# range is symmetric; q4 keeps 15 levels, -7..7, stored as 1..15).
_QMAX = {"int8": 127.0, "q4": 7.0, "fp8": 448.0}
_FP16_MAX = 65504.0
_hadamards: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def hadamard(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal 32 x 32 Sylvester Hadamard matrix (symmetric: its own inverse)."""
    key = (device, dtype)
    h = _hadamards.get(key)
    if h is None:
        m = torch.ones(1, 1, dtype=torch.float64)
        while m.shape[0] < QUANT_GROUP:
            m = torch.cat([torch.cat([m, m], 1), torch.cat([m, -m], 1)], 0)
        h = _hadamards[key] = (m / math.sqrt(QUANT_GROUP)).to(device=device, dtype=dtype)
    return h


def quantize_rows(x: torch.Tensor, cache_dtype: str) -> torch.Tensor:
    """x [..., D] -> uint8 [..., row_bytes]."""
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {cache_dtype!r}; accepted: "
                         f"{', '.join(CACHE_DTYPES)}")
    head_size = x.shape[-1]
    groups = cdiv(head_size, QUANT_GROUP)
    full = head_size // QUANT_GROUP
    xp = x.float()
    if groups * QUANT_GROUP != head_size:
        xp = torch.nn.functional.pad(xp, (0, groups * QUANT_GROUP - head_size))
    xp = xp.unflatten(-1, (groups, QUANT_GROUP))
    if cache_dtype == "q4" and full:
        # Rotate the full groups (a tail group stays as it is): outliers spread over the
        # group, so a 4-bit grid resolves the rest. Attention is invariant to it (the
        # rotation is orthonormal, applied alike to what is read back).
        xp = torch.cat([xp[..., :full, :] @ hadamard(xp.device), xp[..., full:, :]], dim=-2)
    qmax = _QMAX[cache_dtype]
    scale = (xp.abs().amax(-1) / qmax).clamp(max=_FP16_MAX).to(torch.float16)
    s = scale.float().unsqueeze(-1)
    scaled = torch.where(s > 0, xp / torch.where(s > 0, s, 1.0), 0.0)
    if cache_dtype == "int8":
        values = scaled.round().clamp(-qmax, qmax).to(torch.int8).flatten(-2)[
            ..., :head_size].view(torch.uint8)
    elif cache_dtype == "fp8":
        values = scaled.clamp(-qmax, qmax).to(torch.float8_e4m3fn).flatten(-2)[
            ..., :head_size].view(torch.uint8)
    else:
        values = _pack_q4((scaled.round().clamp(-qmax, qmax) + 8).to(torch.uint8), head_size)
    parts = [scale.view(torch.uint8), values]
    pad = quantized_row_bytes(cache_dtype, head_size) - 2 * groups - values.shape[-1]
    if pad:
        parts.append(values.new_zeros(*values.shape[:-1], pad))
    return torch.cat(parts, dim=-1)


def dequantize_rows(rows: torch.Tensor, cache_dtype: str, head_size: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., row_bytes] -> [..., head_size] in `dtype` (q4: rotated back)."""
    expected = quantized_row_bytes(cache_dtype, head_size)
    if rows.dtype != torch.uint8 or rows.shape[-1] != expected:
        raise ValueError(f"{cache_dtype} rows of head size {head_size} are uint8 [..., "
                         f"{expected}], got {rows.dtype} [..., {rows.shape[-1]}]")
    groups = cdiv(head_size, QUANT_GROUP)
    full = head_size // QUANT_GROUP
    scale = rows[..., :2 * groups].contiguous().view(torch.float16).float()  # [..., G]
    body = rows[..., 2 * groups:]
    if cache_dtype == "int8":
        values = body[..., :head_size].contiguous().view(torch.int8).float()
    elif cache_dtype == "fp8":
        values = body[..., :head_size].contiguous().view(torch.float8_e4m3fn).float()
    else:
        values = _unpack_q4(body, head_size).float() - 8
    if groups * QUANT_GROUP != head_size:
        values = torch.nn.functional.pad(values, (0, groups * QUANT_GROUP - head_size))
    values = values.unflatten(-1, (groups, QUANT_GROUP)) * scale.unsqueeze(-1)
    if cache_dtype == "q4" and full:
        values = torch.cat([values[..., :full, :] @ hadamard(values.device),
                            values[..., full:, :]], dim=-2)
    return values.flatten(-2)[..., :head_size].to(dtype)


def _pack_q4(q: torch.Tensor, head_size: int) -> torch.Tensor:
    """[..., G, 32] nibble values -> [..., ceil(D / 2)] bytes: in a group of n values,
    byte i holds value i (low nibble) and value i + ceil(n / 2) (high nibble)."""
    full = head_size // QUANT_GROUP
    parts = []
    if full:
        g = q[..., :full, :]
        parts.append((g[..., :16] | (g[..., 16:] << 4)).flatten(-2))
    tail = head_size - full * QUANT_GROUP
    if tail:
        t = q[..., full, :tail]
        half = cdiv(tail, 2)
        hi = t[..., half:]
        if hi.shape[-1] < half:
            hi = torch.nn.functional.pad(hi, (0, half - hi.shape[-1]))
        parts.append(t[..., :half] | (hi << 4))
    return torch.cat(parts, dim=-1)


def _unpack_q4(body: torch.Tensor, head_size: int) -> torch.Tensor:
    """The inverse of `_pack_q4`: [..., >= ceil(D / 2)] bytes -> [..., D] nibble values."""
    full = head_size // QUANT_GROUP
    parts = []
    if full:
        b = body[..., :full * 16].unflatten(-1, (full, 16))
        parts.append(torch.cat([b & 15, b >> 4], dim=-1).flatten(-2))
    tail = head_size - full * QUANT_GROUP
    if tail:
        half = cdiv(tail, 2)
        b = body[..., full * 16:full * 16 + half]
        parts.append(torch.cat([b & 15, b >> 4], dim=-1)[..., :tail])
    return torch.cat(parts, dim=-1)
