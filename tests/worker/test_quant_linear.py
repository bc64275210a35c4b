"""The GGML-quantized kernels (worker/native/quant.c through worker/quant_linear.py) against
gguf-py's numpy dequantization and a float matmul: every supported block type, the AVX2
and the portable dequantization, odd row counts, strided inputs, several threads."""

from __future__ import annotations

import functools
import warnings

import gguf
import numpy as np
import pytest
import torch

from hybridkv.worker import quant_linear as ql

TYPES = sorted(ql.SUPPORTED)
K_QUANTS = {12, 13, 14}  # gguf-py has no quantizer for these: random blocks instead
# Offsets of each K-quant block's f16 super-block scales (d, and dmin for Q4_K/Q5_K).
SCALE_OFFSETS = {12: (0, 2), 13: (0, 2), 14: (208,)}

needs_c = pytest.mark.skipif(not ql.available(), reason="the C kernels do not build here")


@functools.cache
def weights(qtype: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF bytes [rows, row_bytes] of a random matrix of `qtype` (shared: read-only)."""
    rng = np.random.default_rng(seed)
    values, nbytes = ql.block_shape(qtype)
    if qtype in K_QUANTS:
        raw = rng.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
        for offset in SCALE_OFFSETS[qtype]:
            scales = rng.uniform(0.002, 0.02, size=(rows, cols // values)).astype(np.float16)
            raw[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, -1, 2)
        out = raw.reshape(rows, -1)
    else:
        data = rng.standard_normal((rows, cols), dtype=np.float32)
        quantized = gguf.quants.quantize(data, gguf.GGMLQuantizationType(qtype))
        out = np.ascontiguousarray(quantized).view(np.uint8).reshape(rows, -1)
    out.flags.writeable = False  # as a memory-mapped file's tensor: nothing may write
    return out


def as_tensor(raw: np.ndarray) -> torch.Tensor:
    """A read-only array as a tensor (as the loader wraps a memory-mapped file)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(raw)


def reference(raw: np.ndarray, qtype: int, cols: int) -> torch.Tensor:
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(-1, cols))


def close_matmul(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got == x @ w.T to float rounding: 1e-5 of the row's scale (sum |x| |w|)."""
    want = (x.double() @ w.double().T).float()
    scale = x.abs().double() @ w.abs().double().T
    assert got.shape == want.shape
    err = ((got.double() - want.double()).abs() / (scale + 1e-30)).max().item() if got.numel() \
        else 0.0
    assert err < 1e-5, f"relative error {err:.3g}"


@pytest.fixture(params=["fast", "portable"])
def path(request: pytest.FixtureRequest):
    """Each test under the AVX2 dequantization (where built) and under the portable one."""
    if not ql.available():
        pytest.skip("the C kernels do not build here")
    fn = ql.library().hkv_quant_force_portable
    has_fast = fn(request.param == "portable")
    if request.param == "portable" and not has_fast:
        fn(0)
        pytest.skip("no fast path on this CPU: the portable one is the only one")
    yield request.param
    fn(0)


def shapes(qtype: int) -> list[tuple[int, int]]:
    values, _ = ql.block_shape(qtype)
    if values == 1:  # F32/F16/BF16: any width, vector tails included
        return [(1, 1), (5, 13), (67, 72), (300, 200)]
    if values == 32:
        return [(1, 32), (5, 64), (67, 96), (300, 160)]
    return [(1, 256), (5, 512), (67, 768), (300, 256)]


@pytest.mark.parametrize("qtype", TYPES, ids=[ql.SUPPORTED[t] for t in TYPES])
def test_dequantize_and_rows_equal_gguf(qtype: int, path: str) -> None:
    for rows, cols in shapes(qtype):
        raw = weights(qtype, rows, cols, seed=rows)
        want = reference(raw, qtype, cols)
        data = as_tensor(raw)
        torch.testing.assert_close(ql.dequantize(data, qtype, cols), want, rtol=0, atol=0)
        ids = torch.tensor([rows - 1, 0, rows // 2, 0], dtype=torch.int64)
        torch.testing.assert_close(ql.dequantize_rows(data, qtype, cols, ids), want[ids],
                                   rtol=0, atol=0)
        assert ql.dequantize_rows(data, qtype, cols, ids[:0]).shape == (0, cols)


@pytest.mark.parametrize("qtype", TYPES, ids=[ql.SUPPORTED[t] for t in TYPES])
def test_matmul_equals_float_matmul(qtype: int, path: str) -> None:
    torch.manual_seed(qtype)
    for rows, cols in shapes(qtype):
        raw = weights(qtype, rows, cols, seed=rows + 1)
        w = reference(raw, qtype, cols)
        data = as_tensor(raw)
        for m in (0, 1, 3, 17, 64):
            x = torch.randn(m, cols)
            close_matmul(ql.matmul(x, data, qtype, cols), x, w)
        # Strided rows (a row subset of a wider buffer) and a column-strided x.
        wide = torch.randn(7, cols + 5)[:, 2:cols + 2]
        close_matmul(ql.matmul(wide, data, qtype, cols), wide, w)
        cstrided = torch.randn(9, 2 * cols)[:, ::2]
        close_matmul(ql.matmul(cstrided, data, qtype, cols), cstrided, w)


@needs_c
@pytest.mark.parametrize("qtype", [2, 8, 12, 14], ids=["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_matmul_on_two_threads_and_into_out(qtype: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    rows, cols = 301, 512
    raw = weights(qtype, rows, cols, seed=3)
    w = reference(raw, qtype, cols)
    data = as_tensor(raw)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for m in (1, 7, 200):  # 200: torch's GEMM on dequantized rows
            x = torch.randn(m, cols)
            close_matmul(ql.matmul(x, data, qtype, cols), x, w)
            out = torch.full((m, rows + 3), float("nan"))[:, 1:rows + 1]
            assert ql.matmul(x, data, qtype, cols, out=out) is out
            close_matmul(out, x, w)
        torch.testing.assert_close(ql.dequantize(data, qtype, cols), w, rtol=0, atol=0)
        # The C tiles on many rows too (several blocks of x rows per panel).
        monkeypatch.setattr(ql, "LARGE_M", 1 << 30)
        x = torch.randn(150, cols)
        close_matmul(ql.matmul(x, data, qtype, cols), x, w)
    finally:
        torch.set_num_threads(before)


@needs_c
@pytest.mark.parametrize("qtype", [1, 7, 13], ids=["F16", "Q5_1", "Q5_K"])
def test_prefill_in_chunks_of_rows(qtype: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """From LARGE_M rows the product runs torch's GEMM on dequantized chunks of rows."""
    rows, cols = 70, 256
    raw = weights(qtype, rows, cols, seed=5)
    w = reference(raw, qtype, cols)
    data = as_tensor(raw)
    x = torch.randn(ql.LARGE_M + 3, cols)
    close_matmul(ql.matmul(x, data, qtype, cols), x, w)  # one chunk, straight into out
    monkeypatch.setattr(ql, "_CHUNK_FLOATS", 16 * cols)  # chunks of 16 rows, a partial last
    close_matmul(ql.matmul(x, data, qtype, cols), x, w)
    out = torch.empty(x.shape[0], rows + 1)[:, 1:]
    close_matmul(ql.matmul(x[:, :], data, qtype, cols, out=out), x, w)


@needs_c
def test_weight_from_readonly_memmap_and_strided_table(tmp_path) -> None:
    qtype, rows, cols = 6, 40, 64  # Q5_0
    raw = weights(qtype, rows, cols)
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    weight = ql.QuantizedWeight.from_numpy(mapped, qtype, rows, cols)
    assert weight.nbytes == raw.size and weight.type_name == "Q5_0"
    w = reference(raw, qtype, cols)
    torch.testing.assert_close(weight.dequantize(), w, rtol=0, atol=0)
    x = torch.randn(2, 3, cols)
    y = weight.matmul(x)
    assert y.shape == (2, 3, rows)
    close_matmul(y.reshape(6, rows), x.reshape(6, cols), w)
    ids = torch.tensor([[3, 39], [0, 3]])
    torch.testing.assert_close(weight.rows_of(ids), w[ids], rtol=0, atol=0)
    assert weight.matmul(x[0, 0]).shape == (rows,)
    with pytest.raises(ValueError, match="64"):
        weight.matmul(torch.randn(2, 63))
    # A table whose rows sit apart in a larger buffer (row stride > row bytes).
    padded = np.zeros((rows, raw.shape[1] + 10), dtype=np.uint8)
    padded[:, :raw.shape[1]] = raw
    table = torch.from_numpy(padded)[:, :raw.shape[1]]
    torch.testing.assert_close(ql.dequantize(table, qtype, cols), w, rtol=0, atol=0)
    close_matmul(ql.matmul(x.reshape(6, cols), table, qtype, cols), x.reshape(6, cols), w)


def test_numpy_fallback_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    qtype, rows, cols = 8, 9, 64
    raw = weights(qtype, rows, cols)
    w = reference(raw, qtype, cols)
    monkeypatch.setattr(ql, "_lib", None)
    monkeypatch.setattr(ql, "_unavailable", "no compiler (test)")
    assert not ql.available()
    data = as_tensor(raw)
    torch.testing.assert_close(ql.dequantize(data, qtype, cols), w)
    x = torch.randn(3, cols)
    close_matmul(ql.matmul(x, data, qtype, cols), x, w)
    torch.testing.assert_close(ql.dequantize_rows(data, qtype, cols, torch.tensor([2, 2])),
                               w[[2, 2]])


def test_shapes_and_errors() -> None:
    assert ql.SUPPORTED[2] == "Q4_0" and ql.SUPPORTED[30] == "BF16" and len(ql.SUPPORTED) == 11
    for qtype in TYPES:
        assert ql.block_shape(qtype) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    assert ql.row_bytes(2, 64) == 36 and ql.row_bytes(14, 512) == 420 and ql.row_bytes(1, 3) == 6
    with pytest.raises(ValueError, match="multiple") as bad_cols:
        ql.row_bytes(12, 640)
    assert "\n" not in str(bad_cols.value)
    with pytest.raises(ValueError, match="unsupported GGML quantization type 10") as bad_type:
        ql.block_shape(10)  # Q2_K
    assert "\n" not in str(bad_type.value)
    with pytest.raises(ValueError, match="unsupported"):
        ql.matmul(torch.randn(1, 32), torch.zeros(1, 18, dtype=torch.uint8), 99, 32)
    with pytest.raises(ValueError, match="multiple"):
        ql.dequantize(torch.zeros(1, 18, dtype=torch.uint8), 2, 33)
