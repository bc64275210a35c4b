"""The GGML-quantized kernels (worker/native/quant.c through worker/linear/quant.py) against
gguf-py's numpy dequantization and a float matmul: every supported block type, the AVX2
and the portable kernels, 8-bit and float activations, odd row counts, strided inputs,
several threads."""

from __future__ import annotations

import functools
import os
import warnings

import gguf
import numpy as np
import pytest
import torch

from hybridkv.worker.linear import quant as ql

TYPES = sorted(ql.SUPPORTED)
K_QUANTS = {12, 13, 14}  # gguf-py has no quantizer for these: random blocks instead
INT8_TYPES = {2, 3, 6, 7, 8, 12, 13, 14}  # the block types that take 8-bit activations
# Offsets of the f16 min (Q4_1, Q5_1) or dmin (Q4_K, Q5_K) in each block.
MIN_OFFSETS = {3: 2, 7: 2, 12: 2, 13: 2}
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


def without_min(raw: np.ndarray, qtype: int, cols: int) -> torch.Tensor:
    """The dequantized weights less their blocks' min terms (d q: what the 8-bit x values
    multiply; the min goes through x's exact block sums)."""
    if qtype not in MIN_OFFSETS:
        return reference(raw, qtype, cols)
    values, nbytes = ql.block_shape(qtype)
    blocks = raw.reshape(raw.shape[0], -1, nbytes).copy()
    blocks[:, :, MIN_OFFSETS[qtype]:MIN_OFFSETS[qtype] + 2] = 0
    return reference(blocks.reshape(raw.shape[0], -1), qtype, cols)


def int8_bound(x: torch.Tensor, wq: torch.Tensor, group: int = 32) -> torch.Tensor:
    """linear/quant.py's bound on |y - y_float| from 8-bit x: per group of x values sharing a
    scale (ql.int8_x_block: 32, or 256 for the K-quants), max |x| / 254 times sum |d q| of
    the group's weights (wq: without their mins)."""
    m, cols = x.shape
    half_step = x.abs().double().reshape(m, cols // group, group).amax(dim=2) / 254
    return half_step.repeat_interleave(group, dim=1) @ wq.abs().double().T


def check_matmul(got: torch.Tensor, x: torch.Tensor, raw: np.ndarray, qtype: int,
                 cols: int, w: torch.Tensor | None = None) -> float:
    """got against x @ w.T: to float rounding, or within int8_bound (plus float rounding)
    where the product may quantize x (a small batch, a quantized type, 8-bit activations
    on); returns the largest error over its bound."""
    w = reference(raw, qtype, cols) if w is None else w
    if x.shape[0] > ql.int8_rows(qtype) or not got.numel():
        close_matmul(got, x, w)
        return 0.0
    want = x.double() @ w.double().T
    scale = x.abs().double() @ w.abs().double().T
    bound = int8_bound(x, without_min(raw, qtype, cols), ql.int8_x_block(qtype)) + \
        1e-5 * scale + 1e-30
    ratio = ((got.double() - want).abs() / bound).max().item()
    assert ratio <= 1.0, f"error {ratio:.3g} x the 8-bit activations' bound"
    return ratio


@pytest.fixture(params=["int8", "float"])
def activations(request: pytest.FixtureRequest):
    """Each matmul test with x quantized to 8 bits for small batches (the default) and with
    x kept in float (HYBRIDKV_QUANT_FLOAT_ACTIVATIONS=1)."""
    was = ql.set_float_activations(request.param == "float")
    yield request.param
    ql.set_float_activations(was)


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
def test_matmul_equals_float_matmul(qtype: int, path: str, activations: str) -> None:
    """Float activations: the float matmul to rounding; 8-bit ones: within their bound, and
    visibly not the float result (the integer kernel ran)."""
    torch.manual_seed(qtype)
    for rows, cols in shapes(qtype):
        raw = weights(qtype, rows, cols, seed=rows + 1)
        w = reference(raw, qtype, cols)
        data = as_tensor(raw)
        for m in (0, 1, 2, 3, 4, 5, 6, 8, 17, 64):  # 1 to 8: every type's integer kernel
            x = torch.randn(m, cols)
            got = ql.matmul(x, data, qtype, cols)
            check_matmul(got, x, raw, qtype, cols, w)
            if 0 < m <= ql.int8_rows(qtype):
                err = ((got.double() - x.double() @ w.double().T).abs()
                       / (x.abs().double() @ w.abs().double().T + 1e-30)).max().item()
                assert err > 1e-5, "x kept in float: the integer kernel did not run"
        # Strided rows (a row subset of a wider buffer) and a column-strided x.
        wide = torch.randn(7, cols + 5)[:, 2:cols + 2]
        check_matmul(ql.matmul(wide, data, qtype, cols), wide, raw, qtype, cols, w)
        cstrided = torch.randn(9, 2 * cols)[:, ::2]
        check_matmul(ql.matmul(cstrided, data, qtype, cols), cstrided, raw, qtype, cols, w)


@needs_c
@pytest.mark.parametrize("qtype", sorted(INT8_TYPES),
                         ids=[ql.SUPPORTED[t] for t in sorted(INT8_TYPES)])
def test_int8_activations_bound_is_tight_and_kernels_agree(qtype: int) -> None:
    """The bound holds with x's blocks of very different magnitudes (a wide range inside a
    block makes its small values coarse), is not vacuous (the error reaches a fair share of
    it), and the AVX2 and portable integer kernels agree to float rounding."""
    if ql.int8_rows(qtype) < 8:
        pytest.skip("no integer kernel on this CPU")
    rows, cols = 45, 512
    raw = weights(qtype, rows, cols, seed=11)
    w = reference(raw, qtype, cols)
    data = as_tensor(raw)
    gen = torch.Generator().manual_seed(qtype)
    x = torch.randn(6, cols, generator=gen) * torch.logspace(-3, 2, cols).roll(qtype * 7)
    x[:, 5] = 0.0
    x[2] = 0.0  # an all-zero row: scale 0
    lib = ql.library()
    worst = check_matmul(ql.matmul(x, data, qtype, cols), x, raw, qtype, cols, w)
    assert worst > 0.01, f"the error is only {worst:.3g} of the bound: vacuous?"
    fast = ql.matmul(x, data, qtype, cols)
    lib.hkv_quant_force_portable(1)
    try:
        portable = ql.matmul(x, data, qtype, cols)
    finally:
        lib.hkv_quant_force_portable(0)
    torch.testing.assert_close(fast, portable, rtol=1e-5, atol=1e-5 * float(fast.abs().max()))
    assert not fast[2].any()


def test_float_activations_switch() -> None:
    """x stays in float by default (HYBRIDKV_QUANT_FLOAT_ACTIVATIONS unset or 1); 0 at
    import turns the 8-bit activations on; set_float_activations switches at run time (in
    the C library too)."""
    import subprocess
    import sys

    code = ("from hybridkv.worker.linear import quant as ql; "
            "print(ql.FLOAT_ACTIVATIONS, ql.available() and "
            "ql.library().hkv_quant_float_activations(-1))")
    for value, want in (("1", "True 1"), ("0", "False 0"), (None, "True 1")):
        env = {k: v for k, v in os.environ.items() if k != "HYBRIDKV_QUANT_FLOAT_ACTIVATIONS"}
        if value is not None:
            env["HYBRIDKV_QUANT_FLOAT_ACTIVATIONS"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout.split()
        assert out[0] == want.split()[0]
        if ql.available():
            assert out[1] == want.split()[1]
    if ql.available():
        was = ql.set_float_activations(True)
        try:
            assert ql.library().hkv_quant_float_activations(-1) == 1
            assert ql.int8_rows(8) == 0
            assert ql.set_float_activations(False) is True
            assert ql.library().hkv_quant_float_activations(-1) == 0
            assert ql.int8_rows(1) == 0  # F16: always float
            assert all(ql.int8_rows(t) >= 8 for t in INT8_TYPES) or not ql.int8_rows(8)
        finally:
            ql.set_float_activations(was)


@needs_c
@pytest.mark.parametrize("qtype", [2, 3, 6, 7, 8, 12, 13, 14],
                         ids=["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_matmul_on_two_threads_and_into_out(qtype: int, activations: str) -> None:
    rows, cols = 301, 512
    raw = weights(qtype, rows, cols, seed=3)
    w = reference(raw, qtype, cols)
    data = as_tensor(raw)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for m in (1, 7, 40, 200):  # 40 and 200: the buffered tiles
            x = torch.randn(m, cols)
            check_matmul(ql.matmul(x, data, qtype, cols), x, raw, qtype, cols, w)
            out = torch.full((m, rows + 3), float("nan"))[:, 1:rows + 1]
            assert ql.matmul(x, data, qtype, cols, out=out) is out
            check_matmul(out, x, raw, qtype, cols, w)
        torch.testing.assert_close(ql.dequantize(data, qtype, cols), w, rtol=0, atol=0)
    finally:
        torch.set_num_threads(before)


GEMM_TYPES = [t for t in TYPES if ql.takes_gemm(t, 256)]


@needs_c
@pytest.mark.parametrize("qtype", GEMM_TYPES, ids=[ql.SUPPORTED[t] for t in GEMM_TYPES])
def test_a_rows_result_does_not_depend_on_its_batch(qtype: int) -> None:
    """quant_gemm.c: one order of arithmetic for every number of x rows, so each row's
    result is bit for bit the same alone, beside others (the few-row kernel below 8 rows,
    the buffered tiles from 8, partial tiles and chunks), into a strided out, and on 1, 2
    or 3 threads (work is split by output rows only); plain and gated; close to the float
    product of the dequantized weights."""
    from hybridkv.worker.linear import cpu as cpu_linear

    values, _ = ql.block_shape(qtype)
    cols = 512 if values == 256 else 320
    rows = 2 * 67  # no whole chunk of 32 / 48 rows; even, for the gated halves
    raw = weights(qtype, rows, cols, seed=11)
    w = reference(raw, qtype, cols)
    data = as_tensor(raw)
    weight = ql.QuantizedWeight(data, qtype, rows, cols)
    x = torch.randn(70, cols)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([ql.matmul(x[i:i + 1], data, qtype, cols) for i in range(70)])
        gated_alone = torch.cat([ql.gated_matmul(x[i:i + 1], weight, 1) for i in range(70)])
        close_matmul(alone, x, w)
        g, u = w[:67].double(), w[67:].double()
        want = torch.nn.functional.silu(x.double() @ g.T) * (x.double() @ u.T)
        scale = (x.abs().double() @ g.abs().T) * (x.abs().double() @ u.abs().T)
        assert ((gated_alone.double() - want).abs() / (scale + 1e-12)).max() < 1e-5
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 70):
                assert torch.equal(ql.matmul(x[:m], data, qtype, cols), alone[:m]), (threads, m)
                got = ql.gated_matmul(x[:m], weight, cpu_linear.GATED_ACTIVATIONS["silu"])
                assert torch.equal(got, gated_alone[:m]), (threads, m)
            out = torch.full((70, rows + 2), float("nan"))[:, 1:rows + 1]
            assert ql.matmul(x, data, qtype, cols, out=out) is out
            assert torch.equal(out, alone)
    finally:
        torch.set_num_threads(before)


@needs_c
@pytest.mark.parametrize("qtype", sorted(INT8_TYPES),
                         ids=[ql.SUPPORTED[t] for t in sorted(INT8_TYPES)])
def test_8bit_activations_rows_do_not_depend_on_their_batch(qtype: int, path: str) -> None:
    """With 8-bit activations every row count takes them (each x row quantized alone, each
    dot the same instructions): a row's result is bit for bit the same alone, in any batch
    and on 1-3 threads, and hkv_quant_gemm_int8 (the native decode layers' call) gives the
    operator path's bytes, plain and gated (gate and up products, then gated_rows)."""
    from hybridkv.worker.linear import cpu as cpu_linear

    values, _ = ql.block_shape(qtype)
    # nine K-quant blocks: one full group of k_group's eight partial sums and one short
    cols = 9 * 256 if values == 256 else 320
    rows = 2 * 67
    raw = weights(qtype, rows, cols, seed=12)
    data = as_tensor(raw)
    x = torch.randn(70, cols)
    was = ql.set_float_activations(False)
    before = torch.get_num_threads()
    lib = ql.library()
    fn = lib.hkv_quant_gemm_int8

    def gemm_int8(xs: torch.Tensor, n: int, mode: int) -> torch.Tensor:
        out = torch.empty(xs.shape[0], n)
        assert fn(xs.data_ptr(), xs.shape[0], xs.stride(0), data.data_ptr(), data.stride(0),
                  qtype, n, cols, out.data_ptr(), out.stride(0), mode, None) == 0
        return out

    try:
        if not ql.int8_capable(qtype):
            pytest.skip("8-bit activations need AVX2")
        assert ql.int8_rows(qtype) >= 1 << 40
        torch.set_num_threads(1)
        alone = torch.cat([ql.matmul(x[i:i + 1], data, qtype, cols) for i in range(70)])
        check_matmul(alone, x, raw, qtype, cols)
        silu = cpu_linear.GATED_ACTIVATIONS["silu"]
        gated = ql.gated_rows(alone[:, :67].contiguous(), alone[:, 67:].contiguous(), silu)
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 25, 70):
                assert torch.equal(ql.matmul(x[:m], data, qtype, cols), alone[:m]), (threads, m)
                assert torch.equal(gemm_int8(x[:m], rows, 0), alone[:m]), (threads, m)
                assert torch.equal(gemm_int8(x[:m], 67, silu), gated[:m]), (threads, m)
    finally:
        torch.set_num_threads(before)
        ql.set_float_activations(was)


@needs_c
def test_rows_wider_than_the_chunk_buffer() -> None:
    """Rows of more than half a thread's chunk buffer (32,768 floats) still take two rows a
    chunk, the buffer grown to fit: the same bytes as one row at a time."""
    qtype, rows, cols = 8, 5, 40960  # Q8_0
    raw = weights(qtype, rows, cols, seed=4)
    data = as_tensor(raw)
    x = torch.randn(9, cols)
    many = ql.matmul(x, data, qtype, cols)
    close_matmul(many, x, reference(raw, qtype, cols))
    assert torch.equal(many, torch.cat([ql.matmul(x[i:i + 1], data, qtype, cols)
                                        for i in range(9)]))


@needs_c
def test_gate_and_up_of_two_types_get_the_one_matrix_bytes() -> None:
    """A gated MLP whose gate and up are of two block types: two plain products, then the
    kernel's own activation loop (gated_rows), the same bytes as one gated matrix."""
    qtype, n, cols = 6, 45, 256
    gate, up = (ql.QuantizedWeight(as_tensor(weights(qtype, n, cols, seed=s)), qtype, n, cols)
                for s in (1, 2))
    x = torch.randn(9, cols)
    both = ql.gated_matmul(x, concat([gate, up]), 2)
    apart = ql.gated_rows(gate.matmul(x), up.matmul(x), 2)
    assert torch.equal(both, apart)


@pytest.mark.parametrize("qtype", [2, 6, 12, 14], ids=["Q4_0", "Q5_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh", "relu"])
def test_gated_product_equals_activation_of_gate_times_up(qtype: int, act: str) -> None:
    """gated_matmul: act(x G^T) * (x U^T) in the kernel's epilogue at every row count (None
    with 8-bit activations' rows: the caller applies the activation); outputs that fill no
    whole chunk, several chunks on two threads."""
    from hybridkv.worker.linear import cpu as cpu_linear
    if not ql.takes_gemm(qtype, 256):
        pytest.skip("the one-order kernel does not build here")
    fn = {"silu": torch.nn.functional.silu, "relu": torch.relu,
          "gelu_pytorch_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}[act]
    mode = cpu_linear.GATED_ACTIVATIONS[act]
    values, _ = ql.block_shape(qtype)
    cols = max(values, 64)
    before = torch.get_num_threads()
    try:
        for threads, n in ((1, 45), (2, 200)):
            torch.set_num_threads(threads)
            gate, up = (weights(qtype, n, cols, seed=n + s) for s in (0, 1))
            g, u = reference(gate, qtype, cols), reference(up, qtype, cols)
            both = concat([ql.QuantizedWeight(as_tensor(r), qtype, n, cols) for r in (gate, up)])
            for m in (1, 7, 40):
                x = torch.randn(m, cols) * 3
                got = ql.gated_matmul(x, both, mode)
                assert got is not None
                want = fn(x.double() @ g.double().T) * (x.double() @ u.double().T)
                # Float rounding of both products, through act (slope <= 1.13) and the
                # product: within 1e-5 of (sum |x||g|) (sum |x||u|).
                scale = (x.abs().double() @ g.abs().double().T) * \
                    (x.abs().double() @ u.abs().double().T)
                err = ((got.double() - want).abs() / (scale + 1e-12)).max().item()
                assert err < 1e-5, f"relative error {err:.3g}"
        was = ql.set_float_activations(False)
        try:
            if ql.int8_rows(qtype):
                assert ql.gated_matmul(torch.randn(1, cols), both, mode) is None
        finally:
            ql.set_float_activations(was)
    finally:
        torch.set_num_threads(before)


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
    check_matmul(y.reshape(6, rows), x.reshape(6, cols), raw, qtype, cols, w)
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
    check_matmul(ql.matmul(x.reshape(6, cols), table, qtype, cols), x.reshape(6, cols), raw,
                 qtype, cols, w)


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


def concat(weights: list[ql.QuantizedWeight]) -> ql.QuantizedWeight:
    """Matrices of one block type and width stacked by rows (one matrix, as a fused file
    tensor holds them)."""
    first = weights[0]
    return ql.QuantizedWeight(torch.cat([w.data for w in weights]), first.qtype,
                              sum(w.rows for w in weights), first.cols)


@needs_c
@pytest.mark.parametrize("qtype", [2, 8, 12, 14], ids=["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_parts_kept_apart_give_the_stacked_matrix_bytes(qtype: int) -> None:
    """q/k/v and gate/up stay where the file holds them (QuantizedParts writes each part's
    columns; the gated product takes gate and up as two matrices): at every row count the
    bytes of one product on the rows stacked, as a copy side by side gave them."""
    from hybridkv.worker.linear.quantized import QuantizedLinear, QuantizedParts

    cols = 256
    q, k, v = (ql.QuantizedWeight(as_tensor(weights(qtype, n, cols, seed=s)), qtype, n, cols)
               for s, n in ((1, 64), (2, 24), (3, 24)))
    gate, up = (ql.QuantizedWeight(as_tensor(weights(qtype, 40, cols, seed=s)), qtype, 40,
                                   cols) for s in (4, 5))
    parts = QuantizedParts([QuantizedLinear(w) for w in (q, k, v)])
    stacked, both = concat([q, k, v]), concat([gate, up])
    for m in (1, 3, 5, 8, 9, 40):
        x = torch.randn(m, cols)
        assert torch.equal(parts(x), stacked.matmul(x)), m
        for mode in (1, 2):
            assert torch.equal(ql.gated_matmul(x, gate, mode, up),
                               ql.gated_matmul(x, both, mode)), (m, mode)


@needs_c
@pytest.mark.parametrize("qtype", [2, 12, 14], ids=["Q4_0", "Q4_K", "Q6_K"])
def test_rows_in_the_files_order_give_the_reordered_matrix_bytes(qtype: int) -> None:
    """A matrix whose file stores its rows in another order (llama.cpp's q/k permutation)
    is kept as it lies, with `row_order`: alone and as a part of q/k/v, at every row count
    its product is the bytes of the product over the rows copied into order, and it
    dequantizes in order."""
    from hybridkv.worker.linear.quantized import QuantizedLinear, QuantizedParts

    cols, n = 256, 64
    data = as_tensor(weights(qtype, n, cols, seed=7))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    kept = ql.QuantizedWeight(data, qtype, n, cols, row_order=order)
    copied = ql.QuantizedWeight(data[order].contiguous(), qtype, n, cols)
    v = ql.QuantizedWeight(as_tensor(weights(qtype, 24, cols, seed=8)), qtype, 24, cols)
    parts = QuantizedParts([QuantizedLinear(kept), QuantizedLinear(v)])
    stacked = concat([copied, v])
    assert torch.equal(kept.dequantize(), copied.dequantize())
    for m in (1, 3, 8, 9, 40):
        x = torch.randn(m, cols)
        assert torch.equal(kept.matmul(x), copied.matmul(x)), m
        assert torch.equal(parts(x), stacked.matmul(x)), m
    with pytest.raises(ValueError, match="row_order"):
        ql.QuantizedWeight(data, qtype, n, cols, row_order=order[:3])
