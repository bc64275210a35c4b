"""Quantized KV rows in torch: what the pages of a `kv_cache_dtype` group hold, written on the
way in and read back on the torch attention path (any device; the CPU kernel reads the same
bytes in place, worker/native/paged_attention.c).

Row layout (kv/spec.py, `quantized_row_bytes`): [fp16 scale per group of 32 (q4: scale and
minimum pairs) | values | pad]. q4 K/V pages of self-attention (kv/spec.py, `q4_kv_layout`):
keys per channel over groups of KEY_GROUP tokens (`quantize_key_groups`), values per token
(`quantize_values_q4`).
Rounding is round-half-to-even in float32 on every device, so one process writes the same
bytes for the same K/V whatever path or tier a block later takes.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable

import torch

from hybridkv.kv.spec import (
    CACHE_DTYPES,
    KEY_GROUP,
    QUANT_GROUP,
    cdiv,
    q4_kv_layout,
    quantized_row_bytes,
)

# Largest representable magnitude of each dtype's values (int8 leaves -128 out so that the
# range is symmetric); q4 has 16 levels from each group's minimum.
_QMAX = {"int8": 127.0, "fp8": 448.0}
_Q4_LEVELS = 15.0
_FP16_MAX = 65504.0
_HADAMARD_NORM = 1 / math.sqrt(QUANT_GROUP)


def hadamard_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., 32] times the orthonormal 32 x 32 Sylvester Hadamard matrix (symmetric: its
    own inverse), by the fast transform's butterflies. Each value's adds run in one fixed
    order whatever the number of rows, where a matmul's summation order depends on its shape
    and thread count (q4 V bytes would then depend on the batch), and in the order the paged
    kernel's rotate_groups uses (worker/native/paged_attention.c)."""
    shape = x.shape
    length = 1
    while length < QUANT_GROUP:
        pairs = x.reshape(*shape[:-1], QUANT_GROUP // (2 * length), 2, length)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2)
        length *= 2
    return x.reshape(shape) * _HADAMARD_NORM


def quantize_rows(x: torch.Tensor, cache_dtype: str) -> torch.Tensor:
    """x [..., D] -> uint8 [..., row_bytes]."""
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {cache_dtype!r}; accepted: "
                         f"{', '.join(CACHE_DTYPES)}")
    head_size = x.shape[-1]
    if cache_dtype == "int8" and x.device.type == "cpu" and x.dtype == torch.float32:
        kernel = _int8_kernel()
        if kernel is not None:  # the same bytes, without torch's per-op cost
            flat = x.reshape(-1, head_size)
            if flat.stride(-1) != 1:
                flat = flat.contiguous()
            row_bytes = quantized_row_bytes(cache_dtype, head_size)
            out = torch.empty((flat.shape[0], row_bytes), dtype=torch.uint8)
            kernel(flat.data_ptr(), flat.shape[0], flat.stride(0), head_size, out.data_ptr(),
                   row_bytes)
            return out.view(*x.shape[:-1], row_bytes)
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
        xp = _rotate_groups(xp, full)
    if cache_dtype == "q4":
        # Asymmetric: a rotated K group is not centred on 0 (RoPE'd keys carry per-channel
        # offsets), and min/scale spends all 16 levels on its range (measured on
        # SmolLM2: mean KL 0.089 -> 0.061 against 15 symmetric levels).
        least, most = xp.amin(-1), xp.amax(-1)
        tail = head_size - full * QUANT_GROUP
        if tail:  # the padding zeros are not values: the tail's range is its own
            least[..., full] = xp[..., full, :tail].amin(-1)
            most[..., full] = xp[..., full, :tail].amax(-1)
        low = least.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)
        lo = low.float().unsqueeze(-1)
        scale = ((most.unsqueeze(-1) - lo) / _Q4_LEVELS).squeeze(-1).clamp(
            max=_FP16_MAX).to(torch.float16)
        s = scale.float().unsqueeze(-1)
        q = torch.where(s > 0, (xp - lo) / torch.where(s > 0, s, 1.0), 0.0)
        values = _pack_q4(q.round().clamp(0, _Q4_LEVELS).to(torch.uint8), head_size)
        pairs = torch.stack([scale, low], dim=-1).flatten(-2)  # [..., 2G]: scale, min
        return _with_pad([pairs.view(torch.uint8), values], cache_dtype, head_size)
    qmax = _QMAX[cache_dtype]
    scale = (xp.abs().amax(-1) / qmax).clamp(max=_FP16_MAX).to(torch.float16)
    s = scale.float().unsqueeze(-1)
    scaled = torch.where(s > 0, xp / torch.where(s > 0, s, 1.0), 0.0)
    if cache_dtype == "int8":
        values = scaled.round().clamp(-qmax, qmax).to(torch.int8).flatten(-2)[
            ..., :head_size].view(torch.uint8)
    else:
        values = scaled.clamp(-qmax, qmax).to(torch.float8_e4m3fn).flatten(-2)[
            ..., :head_size].view(torch.uint8)
    return _with_pad([scale.view(torch.uint8), values], cache_dtype, head_size)


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = {
    "hkv_quantize_int8_rows": [_PTR, _I64, _I64, _I64, _PTR, _I64],
    # k, its strides, v, its strides, tokens, heads, head size, row bytes, slots, cache,
    # its strides in bytes (page, slot, K->V, token, head), block size, blocks per page
    "hkv_write_kv_int8": [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _PTR,
                          _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64],
    # rotated v, tokens, heads, head size, slots, cache, its strides in bytes (page, slot,
    # K->V, token, head), block size, blocks per page
    "hkv_write_v_q4": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64,
                       _I64],
}


def _native(name: str) -> Callable[..., None] | None:
    """A C writer of int8 rows (worker/native/kv_quant.c), None where it cannot be built
    (torch's operations write the same bytes)."""
    from hybridkv.worker import native

    fn: Callable[..., None] | None = native.function("kv_quant", name, _ARGTYPES[name])
    return fn


def _int8_kernel() -> Callable[..., None] | None:
    return _native("hkv_quantize_int8_rows")


def write_int8_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, block_size: int, blocks_per_page: int) -> bool:
    """k/v [T, Hk, D] float32 (unit stride along D) quantized into their slots of int8
    pages [pages, per_page, 2, block, Hk, row_bytes] on the CPU; False where the C writer
    cannot be built (the caller writes through quantize_rows: the same bytes)."""
    kernel = _native("hkv_write_kv_int8")
    if kernel is None:
        return False
    cs = kv_cache.stride()  # uint8: strides are bytes
    kernel(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
           k.shape[0], k.shape[1], k.shape[2], kv_cache.shape[5], slot_mapping.data_ptr(),
           kv_cache.data_ptr(), cs[0], cs[1], cs[2], cs[3], cs[4], block_size,
           blocks_per_page)
    return True


def _with_pad(parts: list[torch.Tensor], cache_dtype: str, head_size: int) -> torch.Tensor:
    """The row's parts and its padding, as one uint8 row."""
    pad = quantized_row_bytes(cache_dtype, head_size) - sum(p.shape[-1] for p in parts)
    if pad:
        parts.append(parts[-1].new_zeros(*parts[-1].shape[:-1], pad))
    return torch.cat(parts, dim=-1)


def quantize_queries(q: torch.Tensor, scale: float) -> torch.Tensor:
    """q [..., D] as attention over int8 pages reads it: q * scale through int8 per 32
    values (scale max|.| / 127) and back, divided by scale again. Every path does this (the
    CPU kernel takes integer dot products against int8 K rows, llama.cpp's q8_0 way), so a
    token's logits do not depend on which path computed it (a prefix hit recomputes the
    last prompt token on another path than the prefill did)."""
    x = q.float() * scale
    groups = x.unflatten(-1, (-1, QUANT_GROUP))
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    back = torch.round(groups * inv) * (amax / 127.0)
    out: torch.Tensor = (back.flatten(-2) / scale).to(q.dtype)
    return out


def quantizes_queries(cache_dtype: str | None, head_size: int) -> bool:
    """Whether attention over pages of `cache_dtype` reads quantize_queries(q)."""
    return cache_dtype == "int8" and head_size % QUANT_GROUP == 0


def dequantize_rows(rows: torch.Tensor, cache_dtype: str, head_size: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., row_bytes] -> [..., head_size] in `dtype` (q4: rotated back)."""
    expected = quantized_row_bytes(cache_dtype, head_size)
    if rows.dtype != torch.uint8 or rows.shape[-1] != expected:
        raise ValueError(f"{cache_dtype} rows of head size {head_size} are uint8 [..., "
                         f"{expected}], got {rows.dtype} [..., {rows.shape[-1]}]")
    groups = cdiv(head_size, QUANT_GROUP)
    full = head_size // QUANT_GROUP
    per_group = 2 if cache_dtype == "q4" else 1  # q4: (scale, minimum) pairs
    scales = rows[..., :2 * per_group * groups].contiguous().view(torch.float16).float()
    body = rows[..., 2 * per_group * groups:]
    if cache_dtype == "int8":
        values = body[..., :head_size].contiguous().view(torch.int8).float()
    elif cache_dtype == "fp8":
        values = body[..., :head_size].contiguous().view(torch.float8_e4m3fn).float()
    else:
        values = _unpack_q4(body, head_size).float()
    if groups * QUANT_GROUP != head_size:
        values = torch.nn.functional.pad(values, (0, groups * QUANT_GROUP - head_size))
    values = values.unflatten(-1, (groups, QUANT_GROUP))
    if cache_dtype == "q4":
        pairs = scales.unflatten(-1, (groups, 2))
        values = values * pairs[..., :1] + pairs[..., 1:]
    else:
        values = values * scales.unsqueeze(-1)
    if cache_dtype == "q4" and full:
        values = _rotate_groups(values, full)
    return values.flatten(-2)[..., :head_size].to(dtype)


def _rotate_groups(groups: torch.Tensor, full: int) -> torch.Tensor:
    """[..., G, 32] with its first `full` groups rotated (the Hadamard matrix is its own
    inverse: this writes and reads back alike); a tail group stays as it is."""
    if not full:
        return groups
    return torch.cat([hadamard_rows(groups[..., :full, :]), groups[..., full:, :]], dim=-2)


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


# ------------------------------------------------------------- q4 K/V pages (kv/spec.py)
def _pack_nibbles(q: torch.Tensor, head_size: int) -> torch.Tensor:
    """[..., D] nibble values -> [..., ceil(D / 2)] bytes, packed per group of 32 as q4
    rows are (`_pack_q4`)."""
    groups = cdiv(head_size, QUANT_GROUP)
    if groups * QUANT_GROUP != head_size:
        q = torch.nn.functional.pad(q, (0, groups * QUANT_GROUP - head_size))
    return _pack_q4(q.unflatten(-1, (groups, QUANT_GROUP)), head_size)


def quantize_key_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole key groups x [N, KEY_GROUP, Hk, D] -> (their K rows [N, KEY_GROUP, Hk, row],
    the shares their V rows end with [N, KEY_GROUP, Hk, v_tail]), uint8. Per channel and
    group: minimum and scale = (max - min) / 15 in fp16, values round((x - min) / scale)."""
    n, tokens, heads, head_size = x.shape
    if tokens != KEY_GROUP:
        raise ValueError(f"key groups are {KEY_GROUP} tokens, got {tokens}")
    lay = q4_kv_layout(head_size)
    xf = x.float()
    least, most = xf.amin(1), xf.amax(1)  # [N, Hk, D]
    low = least.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)
    lo = low.float()
    scale = ((most - lo) / _Q4_LEVELS).clamp(max=_FP16_MAX).to(torch.float16)
    s = scale.float()
    safe = torch.where(s > 0, s, 1.0)
    q = torch.where(s[:, None] > 0, (xf - lo[:, None]) / safe[:, None], 0.0)
    nibbles = _pack_nibbles(q.round().clamp(0, _Q4_LEVELS).to(torch.uint8), head_size)
    # (scale, minimum) per channel, channels padded to KEY_GROUP shares of C each.
    pairs = torch.zeros(n, heads, KEY_GROUP * lay.channels, 2, dtype=torch.float16,
                        device=x.device)
    pairs[:, :, :head_size, 0] = scale
    pairs[:, :, :head_size, 1] = low
    shares = pairs.view(torch.uint8).view(n, heads, KEY_GROUP, lay.share).transpose(1, 2)
    k_rows = torch.cat([nibbles, shares[..., :lay.k_tail]], dim=-1)
    if k_rows.shape[-1] < lay.row:
        k_rows = torch.nn.functional.pad(k_rows, (0, lay.row - k_rows.shape[-1]))
    return k_rows, shares[..., lay.k_tail:].contiguous()


def dequantize_key_groups(k_rows: torch.Tensor, v_rows: torch.Tensor, head_size: int,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """K rows and V rows [..., L, Hk, row] of whole key groups (L a multiple of KEY_GROUP,
    group-aligned) -> keys [..., L, Hk, D] in `dtype`."""
    lay = q4_kv_layout(head_size)
    length, heads = k_rows.shape[-3], k_rows.shape[-2]
    if k_rows.dtype != torch.uint8 or k_rows.shape[-1] != lay.row or length % KEY_GROUP:
        raise ValueError(f"q4 K rows of head size {head_size} are uint8 [..., L, Hk, "
                         f"{lay.row}] with L a multiple of {KEY_GROUP}, got {k_rows.dtype} "
                         f"{list(k_rows.shape)}")
    shares = torch.cat([k_rows[..., lay.nibbles:lay.nibbles + lay.k_tail],
                        v_rows[..., lay.v_bytes:lay.v_bytes + lay.v_tail]], dim=-1)
    lead = shares.shape[:-3]
    groups = length // KEY_GROUP
    # [..., n, G, Hk, share] -> [..., n, Hk, G * share] -> fp16 pairs per channel
    shares = shares.unflatten(-3, (groups, KEY_GROUP)).transpose(-3, -2).contiguous()
    pairs = shares.view(*lead, groups, heads, KEY_GROUP * lay.share).view(
        torch.float16).float()
    pairs = pairs.unflatten(-1, (-1, 2))[..., :head_size, :]  # [..., n, Hk, D, 2]
    values = _unpack_q4(k_rows[..., :lay.nibbles], head_size).float()
    values = values.unflatten(-3, (groups, KEY_GROUP))  # [..., n, G, Hk, D]
    keys: torch.Tensor = values * pairs[..., None, :, :, 0] + pairs[..., None, :, :, 1]
    return keys.flatten(-4, -3).to(dtype)


def rotate_values(x: torch.Tensor) -> torch.Tensor:
    """V [..., D] in float32 with each full group of 32 rotated (a tail group as it is)."""
    head_size = x.shape[-1]
    full = head_size // QUANT_GROUP
    xf = x.float()
    if not full:
        return xf
    rotated = hadamard_rows(xf[..., :full * QUANT_GROUP].unflatten(-1, (full, QUANT_GROUP))
                            ).flatten(-2)
    if full * QUANT_GROUP == head_size:
        return rotated
    return torch.cat([rotated, xf[..., full * QUANT_GROUP:]], dim=-1)


def quantize_values_q4(x: torch.Tensor) -> torch.Tensor:
    """V [..., D] -> the V rows' own bytes [..., v_bytes]: each full group of 32 rotated,
    then per group scale = max|x| / 7 (fp16) and nibbles round(x / scale) + 8 in [0, 15]."""
    head_size = x.shape[-1]
    groups = cdiv(head_size, QUANT_GROUP)
    xp = rotate_values(x)
    if groups * QUANT_GROUP != head_size:
        xp = torch.nn.functional.pad(xp, (0, groups * QUANT_GROUP - head_size))
    xp = xp.unflatten(-1, (groups, QUANT_GROUP))
    scale = (xp.abs().amax(-1) / 7.0).clamp(max=_FP16_MAX).to(torch.float16)
    s = scale.float().unsqueeze(-1)
    q = torch.where(s > 0, xp / torch.where(s > 0, s, 1.0), 0.0).round().clamp(-8, 7) + 8
    values = _pack_q4(q.to(torch.uint8), head_size)
    return torch.cat([scale.view(torch.uint8), values], dim=-1)


def write_v_q4(v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
               block_size: int, blocks_per_page: int) -> bool:
    """v [T, Hk, D] quantized (`quantize_values_q4`'s bytes) into the V rows of their slots
    of q4 K/V pages on the CPU, by the C writer after torch's rotation; False where it cannot
    run here (the caller writes through torch: the same bytes)."""
    if not (v.device.type == "cpu" and v.dtype == torch.float32 and kv_cache.dim() == 6
            and kv_cache.stride(5) == 1 and slot_mapping.dtype == torch.int64
            and slot_mapping.is_contiguous()):
        return False
    kernel = _native("hkv_write_v_q4")
    if kernel is None:
        return False
    rotated = rotate_values(v).contiguous()
    cs = kv_cache.stride()  # uint8: strides are bytes
    kernel(rotated.data_ptr(), v.shape[0], v.shape[1], v.shape[2], slot_mapping.data_ptr(),
           kv_cache.data_ptr(), cs[0], cs[1], cs[2], cs[3], cs[4], block_size,
           blocks_per_page)
    return True


def dequantize_values_q4(v_rows: torch.Tensor, head_size: int,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """V rows [..., row] (or their own bytes [..., v_bytes]) -> [..., D] in `dtype`."""
    groups = cdiv(head_size, QUANT_GROUP)
    full = head_size // QUANT_GROUP
    scales = v_rows[..., :2 * groups].contiguous().view(torch.float16).float()
    values = _unpack_q4(v_rows[..., 2 * groups:], head_size).float() - 8
    if groups * QUANT_GROUP != head_size:
        values = torch.nn.functional.pad(values, (0, groups * QUANT_GROUP - head_size))
    values = _rotate_groups(values.unflatten(-1, (groups, QUANT_GROUP))
                            * scales.unsqueeze(-1), full)
    return values.flatten(-2)[..., :head_size].to(dtype)
