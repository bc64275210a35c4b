"""Quantized KV rows (`kv_cache_dtype`): the bytes the pages hold, checked against a numpy
reference of the layout (scales first, fp16, one per 32 values, for q4 a scale and a minimum;
int8 values; q4 nibbles with value i low and value i + 16 high in byte i of a group, after a
Hadamard rotation), and the
in-place CPU kernel reading those bytes against the torch path (dequantize, then SDPA)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hybridkv.kv.spec import quantized_row_bytes  # noqa: E402
from hybridkv.worker.attention.backend import (  # noqa: E402
    AttentionMetadata,
    AttentionParams,
    TorchReferenceBackend,
)
from hybridkv.worker.attention.kv_quant import (  # noqa: E402
    dequantize_rows,
    quantize_rows,
    quantize_values_q4,
    rotate_values,
)

HEAD_SIZES = (7, 32, 33, 64, 65, 80, 256)


def hadamard32() -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < 32:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(32)


def reference_decode(row: np.ndarray, dtype: str, dim: int) -> np.ndarray:
    """One row's values from its bytes, written from the layout's description."""
    groups = -(-dim // 32)
    per_group = 2 if dtype == "q4" else 1
    scales = row[:2 * per_group * groups].view(np.float16).astype(np.float64)
    body = row[2 * per_group * groups:]
    out = np.zeros(dim)
    for g in range(groups):
        lo, n = 32 * g, min(32, dim - 32 * g)
        if dtype == "int8":
            out[lo:lo + n] = body[lo:lo + n].view(np.int8).astype(np.float64) * scales[g]
        else:
            half = -(-n // 2)
            b = body[lo // 2:lo // 2 + half]
            vals = np.concatenate([b & 15, b >> 4])[:n].astype(np.float64)
            out[lo:lo + n] = vals * scales[2 * g] + scales[2 * g + 1]
        if dtype == "q4" and n == 32:
            out[lo:lo + n] = hadamard32() @ out[lo:lo + n]
    return out


def reference_encode(x: np.ndarray, dtype: str) -> np.ndarray:
    """One row's bytes from its float32 values."""
    dim = x.shape[0]
    groups = -(-dim // 32)
    scales, values = [], []
    for g in range(groups):
        v = x[32 * g:32 * g + 32].astype(np.float32)
        if dtype == "q4" and v.shape[0] == 32:
            v = (hadamard32().astype(np.float32) @ v).astype(np.float32)
        if dtype == "int8":
            s = np.float16(np.abs(v).max() / np.float32(127))
            q = np.clip(np.rint(v / np.float32(s)) if s > 0 else np.zeros_like(v), -127, 127)
            scales.append(s)
            values.append(q.astype(np.int8).view(np.uint8))
        else:
            m = np.float16(v.min())
            s = np.float16((v.max() - np.float32(m)) / np.float32(15))
            q = np.clip(np.rint((v - np.float32(m)) / np.float32(s)) if s > 0
                        else np.zeros_like(v), 0, 15)
            scales += [s, m]
            n = q.shape[0]
            half = -(-n // 2)
            u = q.astype(np.uint8)
            hi = np.zeros(half, np.uint8)
            hi[:n - half] = u[half:]
            values.append(u[:half] | (hi << 4))
    row = np.concatenate([np.array(scales, np.float16).view(np.uint8), *values])
    pad = quantized_row_bytes(dtype, dim) - row.shape[0]
    return np.concatenate([row, np.zeros(pad, np.uint8)])


@pytest.mark.parametrize("dtype", ["int8", "q4"])
@pytest.mark.parametrize("dim", HEAD_SIZES)
def test_rows_decode_as_the_layout_says(dtype, dim):
    x = torch.randn(6, dim) * torch.linspace(0.01, 30, 6)[:, None]
    rows = quantize_rows(x, dtype)
    assert rows.dtype == torch.uint8 and rows.shape == (6, quantized_row_bytes(dtype, dim))
    ours = dequantize_rows(rows, dtype, dim).double().numpy()
    for i in range(6):
        np.testing.assert_allclose(reference_decode(rows[i].numpy(), dtype, dim), ours[i],
                                   rtol=1e-5, atol=1e-5 * (1 + np.abs(ours[i]).max()))


@pytest.mark.parametrize("dtype", ["int8", "q4"])
@pytest.mark.parametrize("dim", HEAD_SIZES)
def test_rows_encode_as_the_reference_does(dtype, dim):
    x = torch.randn(32, dim) * 3
    rows = quantize_rows(x, dtype).numpy()
    ref = np.stack([reference_encode(r, dtype) for r in x.numpy()])
    if dtype == "int8":
        np.testing.assert_array_equal(rows, ref)
    else:
        # The rotation's float sums may round a value at a tie the other way: a nibble off
        # by one in a handful of places at most, never a shifted layout.
        assert (rows != ref).mean() < 0.02
        assert np.abs(rows.astype(int) - ref.astype(int)).max() <= 16 + 1


@pytest.mark.parametrize("dim", HEAD_SIZES)
def test_the_c_int8_writer_writes_torchs_bytes(dim, monkeypatch):
    # Both write paths must give one block the same bytes (a prefix hit or a tier cannot
    # tell which wrote it): ties at .5, zero groups, scales that round in fp16, huge values.
    from hybridkv.worker.attention import kv_quant

    if kv_quant._int8_kernel() is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(4, 3, 40, dim, generator=gen) * 3
    x[0, 0, 0] = 0.0
    x[0, 1, :, :] = torch.arange(dim) * 0.5 - dim / 4  # halves: ties everywhere
    x[1, 0, 0] = 1e6  # the scale clamps at fp16's largest
    x = x[:, :, ::3]  # not contiguous
    written = quantize_rows(x, "int8")
    monkeypatch.setattr(kv_quant, "_int8_kernel", lambda: None)
    assert torch.equal(written, quantize_rows(x, "int8"))


def test_the_cpu_backend_writes_int8_pages_as_torch_does(monkeypatch):
    # The C writer quantizes straight into the slots: the same bytes in the same places as
    # quantize_rows and an index_put, the other slots untouched.
    from hybridkv.worker import native
    from hybridkv.worker.attention import cpu as cpu_attention
    from hybridkv.worker.attention.backend import TorchReferenceBackend

    try:
        backend = cpu_attention.CPUPagedBackend()
    except native.NativeBuildError as e:
        pytest.skip(str(e))
    gen = torch.Generator().manual_seed(7)
    heads_kv, dim, block = 3, 72, 4
    row = quantized_row_bytes("int8", dim)
    # [pages, 2 blocks per page, 2, block, Hk, row], filled with junk to overwrite
    cache = torch.randint(0, 256, (5, 2, 2, block, heads_kv, row), dtype=torch.uint8,
                          generator=gen)
    slots = torch.tensor([3, 17, 18, 36], dtype=torch.int64)
    qkv = torch.randn(4, 3 * heads_kv, dim, generator=gen)
    k, v = qkv[:, :heads_kv], qkv[:, heads_kv:2 * heads_kv]  # strided views, as projected
    meta = AttentionMetadata(query_start_loc=[0, 4], seq_lens=[40],
                             block_table=torch.zeros(1, 10, dtype=torch.int64),
                             slot_mapping=slots, block_size=block, kernel_block_size=block,
                             blocks_per_page=2, cache_dtype="int8")
    params = AttentionParams(scale=1.0)
    expected = cache.clone()
    TorchReferenceBackend().write(k, v, expected, meta, params)
    calls = []
    writer = cpu_attention.write_int8_kv
    monkeypatch.setattr(cpu_attention, "write_int8_kv",
                        lambda *a: calls.append(1) or writer(*a))
    backend.write(k, v, cache, meta, params)
    assert calls and torch.equal(cache, expected)


@pytest.mark.parametrize("dtype, bound", [("int8", 0.015), ("q4", 0.09), ("fp8", 0.02)])
def test_round_trip_error_is_bounded(dtype, bound):
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    x[:, 5] *= 20  # an outlier channel: what the q4 rotation is for
    back = dequantize_rows(quantize_rows(x, dtype), dtype, 128)
    assert float((back - x).norm() / x.norm()) < bound
    zeros = torch.zeros(2, 128)
    assert torch.equal(dequantize_rows(quantize_rows(zeros, dtype), dtype, 128), zeros)


def test_q4_value_rotation_does_not_depend_on_the_rows_beside_them():
    """q4 V rows are rotated before rounding: a row's rotated values (and so its bytes) must
    be the same bits computed alone, among 4,096 rows or at another thread count (a matmul's
    summation order follows its shape; a last-bit difference can become another nibble:
    batch invariance)."""
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((4096, 3, 64),
                                                                  dtype=np.float32))
    alone = torch.cat([rotate_values(x[i:i + 1]) for i in range(64)])
    alone_bytes = torch.cat([quantize_values_q4(x[i:i + 1]) for i in range(64)])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for n in (2, 7, 64, 512, 4096):
                m = min(n, 64)
                assert torch.equal(rotate_values(x[:n])[:m], alone[:m]), (n, threads)
                assert torch.equal(quantize_values_q4(x[:n])[:m], alone_bytes[:m])
    finally:
        torch.set_num_threads(before)


def test_the_rotation_helps_q4_with_outliers():
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(1))
    x[:, 3] *= 30
    back = dequantize_rows(quantize_rows(x, "q4"), "q4", 128)
    # Without the rotation a group's step is the outlier's range / 15: its other 31 values
    # round to one or two levels.
    plain = x.unflatten(-1, (4, 32))
    low = plain.amin(-1, keepdim=True)
    step = (plain.amax(-1, keepdim=True) - low) / 15
    unrotated = (((plain - low) / step).round().clamp(0, 15) * step + low).flatten(-2)
    assert (back - x).norm() < 0.7 * (unrotated - x).norm()


def test_a_shifted_scale_or_swapped_nibbles_change_the_values():
    x = torch.randn(4, 64)
    rows = quantize_rows(x, "q4")
    good = dequantize_rows(rows, "q4", 64)
    swapped = rows.clone()
    swapped[:, 8:] = (rows[:, 8:] >> 4) | ((rows[:, 8:] & 15) << 4)
    assert not torch.allclose(dequantize_rows(swapped, "q4", 64), good)
    shifted = torch.cat([rows[:, 4:8], rows[:, 0:4], rows[:, 8:]], dim=1)
    assert not torch.allclose(dequantize_rows(shifted, "q4", 64), good)


def test_wrong_rows_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"int8 rows of head size 64 are uint8 \[\.\.\., 68\]"):
        dequantize_rows(torch.zeros(2, 64, dtype=torch.uint8), "int8", 64)
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'"):
        quantize_rows(torch.zeros(2, 64), "int4")


# ---------------------------------------------------------------- the in-place CPU kernel

def _paged(dtype, num_blocks, block, heads_kv, dim, gen):
    k = torch.randn(num_blocks, block, heads_kv, dim, generator=gen)
    v = torch.randn(num_blocks, block, heads_kv, dim, generator=gen)
    # [pages, 1 block per page, 2, block, Hk, row]
    return torch.stack([quantize_rows(k, dtype), quantize_rows(v, dtype)], 1)[:, None]


@pytest.mark.parametrize("dtype", ["int8"])
@pytest.mark.parametrize("heads, heads_kv, dim", [(4, 1, 256), (9, 3, 64), (2, 2, 80),
                                                  (4, 2, 40)])
@pytest.mark.parametrize("window, softcap", [(None, None), (20, 30.0)])
def test_the_kernel_reads_quantized_pages_as_the_torch_path(dtype, heads, heads_kv, dim,
                                                            window, softcap):
    from hybridkv.worker import native
    from hybridkv.worker.attention import cpu as cpu_attention

    try:
        backend = cpu_attention.CPUPagedBackend()
    except native.NativeBuildError as e:
        pytest.skip(str(e))
    gen = torch.Generator().manual_seed(dim + heads)
    block, num_blocks = 16, 12
    cache = _paged(dtype, num_blocks, block, heads_kv, dim, gen)
    seq_lens = [150, 37, 3]
    table = torch.stack([torch.randperm(num_blocks - 1, generator=gen)[:10] + 1
                         for _ in seq_lens])
    # One decode query per request, and a 3-token chunk in the last one.
    query_lens = [1, 1, 3]
    loc = [0, 1, 2, 5]
    meta = AttentionMetadata(query_start_loc=loc, seq_lens=seq_lens, block_table=table,
                             slot_mapping=torch.zeros(5, dtype=torch.int64), block_size=block,
                             kernel_block_size=block, blocks_per_page=1, cache_dtype=dtype)
    assert meta.query_lens == query_lens
    q = torch.randn(5, heads, dim, generator=gen)
    params = AttentionParams(scale=dim ** -0.5, sliding_window=window, softcap=softcap)
    # With int8 pages and a head size of whole groups both paths read int8 queries (the
    # kernel takes integer dot products): the same math, equal to float rounding.
    expected = TorchReferenceBackend().attend(q, cache, meta, params)
    out = backend.forward(q, None, None, cache, meta, params)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
