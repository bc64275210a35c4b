"""GGML-quantized weights kept in their GGUF blocks: dequantization, embedding rows and
y = x W^T through one C call each (worker/native/quant.c), float32 out.

A weight is the GGUF tensor's raw bytes as uint8 [rows, row_bytes] (rows: output features;
the quantization blocks run along cols, the input features), possibly a view of a
memory-mapped file: nothing here writes to it. On CPUs the product reads the quantized rows
once (decode streams them near memory bandwidth); where the C library does not build,
everything falls back to gguf-py's numpy dequantization and a float matmul.

Which path y = x W^T takes (M: the rows of x):
  * By default (x in float) every M takes native/quant_gemm.c's kernel, whose order of
    arithmetic does not depend on M: a row's result is the same bits alone, in a chunk or
    in any batch (the guarantee prefix caching, chunked prefill and batching rely on to
    keep a request's tokens; docs/engine.md, "Batch invariance"). Under 8 rows it
    dequantizes the blocks in registers as it streams them (decode reads the quantized
    bytes once), from 8 rows it dequantizes chunks of rows into a thread's buffer and runs
    register tiles on them. Gate/up pairs take its gated epilogue at every M.
  * With 8-bit activations on (quant_activations="int8"; off by default, see
    FLOAT_ACTIVATIONS), quantized types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) on a
    CPU with AVX2 take 8-bit activations at every M: each x row is quantized alone in
    groups of 32 values, 256 for the K-quants (int8_x_block; scale d = max|x| / 127, q =
    round(x / d)), and dotted with the weight blocks' integers in int32 (AVX2 maddubs/madd,
    or one VNNI dpbusd: the same sums), one float scaling per 32 values (per 256 for the
    K-quants, as llama.cpp's Q8_K); mins go through x's exact sums per 32. A row's
    result does not depend on its batch here either (each (x row, weight row) dot runs the
    same instructions, the work split by weight rows). At M=1 on one core this runs
    1.7-2.9x the float kernel; at M=512, 0.8-1.1x. Gated MLPs take the product then
    gated_rows (the C loop the float kernel's epilogue runs); the native decode layers call
    hkv_quant_gemm_int8, the same.
  * Rows whose width is not a multiple of 32 (F32/F16/BF16 only), and machines where the
    C kernels do not build, take torch's matmul on the dequantized weights.

Accuracy of the 8-bit activations: rounding x to its group's grid moves each value by at
most d / 2 = max|x_group| / 254, so for each output
    |y - y_float| <= sum over x groups B of (max_{k in B} |x_k| / 254) * sum_{k in B} |d q_k|
plus float rounding (~1e-6 sum |x||w|), with d q the weight less its block's min (the
weight itself for Q4_0, Q5_0, Q8_0, Q6_K). The tests check it for every type (odd block
counts, strided rows, 2 threads, both kernels). In practice errors stay ~5% of that bound;
relative to sum_k |x_k w_k| they measured <= 1.2e-3 for Gaussian x and <= 6e-3 for x whose
magnitudes span five decades (as llama.cpp's Q8_0 activations).
"""

from __future__ import annotations

import ctypes
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridkv.worker import native

# GGML type id -> (name, values per block, bytes per block).
_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}
SUPPORTED: dict[int, str] = {t: name for t, (name, _, _) in _TYPES.items()}

# x rows from which a quantized LM head that the batch-invariant kernel does not take is
# computed a block of vocabulary rows at a time (models/base.py: _head_blocks).
LARGE_M = 128

# x stays in float unless 8-bit activations are asked for: by the engine option
# quant_activations="int8" (set_float_activations(False)) or HYBRIDKV_QUANT_FLOAT_ACTIVATIONS=0
# (read once, at import). Float is the default because it is exact against the dequantized
# model (greedy tokens equal to transformers'); 8 bits move real models' logits by up to
# ~1-4 (of ~30) and change greedy tokens where the top two are within ~0.3.
FLOAT_ACTIVATIONS = os.environ.get("HYBRIDKV_QUANT_FLOAT_ACTIVATIONS", "1") != "0"

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
# x, m, ldx, w, ldw, type, n, cols, y, ldy, mode, u: quant_gemm.c's hkv_quant_gemm and
# quant.c's hkv_quant_gemm_int8
_GEMM_SIGNATURE: list[Any] = [_PTR, _I64, _I64, _PTR, _I64, _INT, _I64, _I64, _PTR, _I64,
                              _INT, _PTR]
_SIGNATURES: dict[str, list[Any]] = {
    "hkv_quant_dequantize": [_PTR, _I64, _INT, _I64, _PTR, _I64, _PTR, _I64],
    "hkv_quant_matmul": [_PTR, _I64, _I64, _PTR, _I64, _INT, _I64, _I64, _PTR, _I64],
    "hkv_quant_force_portable": [_INT],
    "hkv_quant_float_activations": [_INT],
    "hkv_quant_int8_rows": [_INT],
    "hkv_quant_int8_capable": [_INT],
    "hkv_quant_gemm_int8": _GEMM_SIGNATURE,
}
_lib: ctypes.CDLL | None = None
_unavailable: str | None = None


def library() -> ctypes.CDLL:
    """The compiled kernels (built on first use; NativeBuildError where no compiler runs)."""
    global _lib
    if _lib is None:
        lib = native.load("quant")
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        lib.hkv_quant_int8_rows.restype = _I64
        lib.hkv_quant_float_activations(int(FLOAT_ACTIVATIONS))
        _lib = lib
    return _lib


def available() -> bool:
    """Whether the C kernels build and load here (the answer is remembered)."""
    global _unavailable
    if _lib is not None:
        return True
    if _unavailable is not None:
        return False
    try:
        library()
        return True
    except native.NativeBuildError as exc:
        _unavailable = str(exc)
        return False


def set_float_activations(on: bool) -> bool:
    """Keep x in float (True, the default) or quantize small batches of x rows to 8 bits
    (False); returns the previous setting."""
    global FLOAT_ACTIVATIONS
    was = FLOAT_ACTIVATIONS
    FLOAT_ACTIVATIONS = bool(on)
    if _lib is not None:
        _lib.hkv_quant_float_activations(int(FLOAT_ACTIVATIONS))
    return was


_GATED_SIGNATURE: list[Any] = [_PTR, _I64, _PTR, _I64, _I64, _I64, _INT, _PTR, _I64]
_GEMM_TYPES = frozenset({0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30})


def _gemm() -> Any:
    """quant_gemm.c's hkv_quant_gemm, or None where it does not build."""
    return native.function("quant_gemm", "hkv_quant_gemm", _GEMM_SIGNATURE, _INT)


def takes_gemm(qtype: int, cols: int) -> bool:
    """Whether `qtype` rows of `cols` values take the batch-invariant kernel."""
    return int(qtype) in _GEMM_TYPES and cols % 32 == 0 and cols > 0 and _gemm() is not None


def gemm_address(float_activations: bool | None = None) -> int:
    """The batch-invariant kernel's address for float activations or 8-bit ones (default:
    the current setting), which native decode calls from C: quant_gemm.c's, or quant.c's
    hkv_quant_gemm_int8; 0: not built."""
    if not (FLOAT_ACTIVATIONS if float_activations is None else float_activations):
        if not available():
            return 0
        return int(ctypes.cast(library().hkv_quant_gemm_int8, ctypes.c_void_p).value or 0)
    fn = _gemm()
    return int(ctypes.cast(fn, ctypes.c_void_p).value or 0) if fn is not None else 0


def int8_x_block(qtype: int) -> int:
    """x values that share one 8-bit scale in `qtype`'s products with 8-bit activations:
    256 for the K-quants (Q4_K, Q5_K, Q6_K: llama.cpp's Q8_K), else 32."""
    return 256 if int(qtype) in (12, 13, 14) else 32


def int8_capable(qtype: int) -> bool:
    """Whether `qtype` rows take 8-bit activations (at every row count) where they are on:
    the quantized types, on a CPU with AVX2."""
    return available() and bool(library().hkv_quant_int8_capable(int(qtype)))


def gated_rows(gate: torch.Tensor, up: torch.Tensor, mode: int) -> torch.Tensor:
    """act(gate) * up for float32 [M, n] rows of unit stride (a gated mode of
    worker/linear/cpu.py), by the same C loop as the kernel's gated epilogue; gate and up
    computed apart (matrices of two block types) then get the bytes one matrix would."""
    fn = native.function("quant_gemm", "hkv_gated_rows", _GATED_SIGNATURE)
    m, n = gate.shape
    out = torch.empty((m, n), dtype=torch.float32)
    fn(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), m, n, mode,
       out.data_ptr(), out.stride(0))
    return out


def _gemm_product(x: torch.Tensor, data: torch.Tensor, qtype: int, n: int, cols: int,
                  out: torch.Tensor, mode: int = 0, up: torch.Tensor | None = None) -> None:
    """out = x W^T (or the gated product: gate = data, up = `up`, or data's second n rows
    where `up` is None) through quant_gemm.c."""
    rc = _gemm()(x.data_ptr(), x.shape[0], x.stride(0), data.data_ptr(), data.stride(0),
                 qtype, n, cols, out.data_ptr(), out.stride(0), mode,
                 None if up is None else up.data_ptr())
    if rc == -2:
        raise MemoryError("the quantized matmul could not allocate its buffers")
    if rc != 0:
        raise ValueError(f"the quantized matmul does not take type {qtype} x {cols}")


def int8_rows(qtype: int) -> int:
    """x rows up to which the product quantizes x to 8 bits for `qtype` (0: never, as for
    F32/F16/BF16, without AVX2, without the C library, or with float activations set)."""
    if FLOAT_ACTIVATIONS or not available():
        return 0
    return int(library().hkv_quant_int8_rows(int(qtype)))


def _type(qtype: int) -> tuple[str, int, int]:
    try:
        return _TYPES[int(qtype)]
    except KeyError:
        raise ValueError(f"unsupported GGML quantization type {qtype} (supported: "
                         f"{', '.join(SUPPORTED.values())})") from None


def block_shape(qtype: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGML type."""
    _, values, nbytes = _type(qtype)
    return values, nbytes


def row_bytes(qtype: int, cols: int) -> int:
    """Bytes of one row of `cols` values (a whole number of blocks)."""
    name, values, nbytes = _type(qtype)
    if cols < 0 or cols % values:
        raise ValueError(f"{name} rows hold whole blocks of {values} values; {cols} columns "
                         f"is not a multiple")
    return cols // values * nbytes


def _check(data: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """data as uint8 [rows, row_bytes] on the CPU with unit stride along its bytes."""
    nbytes = row_bytes(qtype, cols)
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != nbytes:
        raise ValueError(f"{SUPPORTED[int(qtype)]} data for {cols} columns is uint8 "
                         f"[rows, {nbytes}], not {data.dtype} {tuple(data.shape)}")
    if data.device.type != "cpu":
        raise ValueError(f"quantized data is read on the CPU, not on {data.device.type}")
    if data.stride(1) != 1 and data.shape[0] and data.shape[1] > 1:
        data = data.contiguous()
    return data


def _reference(data: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """gguf-py's numpy dequantization (the fallback, and the tests' reference)."""
    import gguf

    raw = np.ascontiguousarray(data.numpy())
    if raw.shape[0] == 0:
        return torch.empty((0, cols), dtype=torch.float32)
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(qtype)))
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(-1, cols))


def dequantize(data: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """uint8 [rows, row_bytes] -> float32 [rows, cols]."""
    data = _check(data, qtype, cols)
    if not available():
        return _reference(data, qtype, cols)
    out = torch.empty((data.shape[0], cols), dtype=torch.float32)
    if data.shape[0] and cols:
        library().hkv_quant_dequantize(data.data_ptr(), data.stride(0), int(qtype), cols,
                                       None, data.shape[0], out.data_ptr(), cols)
    return out


def dequantize_rows(data: torch.Tensor, qtype: int, cols: int,
                    ids: torch.Tensor) -> torch.Tensor:
    """float32 [len(ids), cols]: rows `ids` (int64) of the table, only those dequantized."""
    data = _check(data, qtype, cols)
    flat = ids.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= data.shape[0]):
        raise IndexError(f"row ids out of range for a table of {data.shape[0]} rows")
    if not available():
        return _reference(data[flat], qtype, cols)
    out = torch.empty((flat.numel(), cols), dtype=torch.float32)
    if flat.numel() and cols:
        library().hkv_quant_dequantize(data.data_ptr(), data.stride(0), int(qtype), cols,
                                       flat.data_ptr(), flat.numel(), out.data_ptr(), cols)
    return out


def matmul(x: torch.Tensor, data: torch.Tensor, qtype: int, cols: int,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x float32 [M, cols] times W^T, W the dequantized [rows, cols] -> float32 [M, rows]
    (written into `out` when given: float32 [M, rows], unit stride along rows)."""
    data = _check(data, qtype, cols)
    if x.dim() != 2 or x.shape[1] != cols:
        raise ValueError(f"x is [M, {cols}], not {tuple(x.shape)}")
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"the quantized matmul takes float32 CPU inputs, not {x.dtype} on "
                         f"{x.device.type}")
    return _product(x, data, int(qtype), cols, out)


def _product(x: torch.Tensor, data: torch.Tensor, qtype: int, cols: int,
             out: torch.Tensor | None) -> torch.Tensor:
    """matmul() once data and x are known good (QuantizedWeight calls this directly)."""
    m, rows = x.shape[0], data.shape[0]
    if out is None:
        out = torch.empty((m, rows), dtype=torch.float32)
    elif (out.shape != (m, rows) or out.dtype != torch.float32 or out.device.type != "cpu"
          or (out.stride(1) != 1 and rows > 1)):
        raise ValueError(f"out must be float32 [{m}, {rows}] on the CPU with unit stride "
                         f"along rows, not {out.dtype} {tuple(out.shape)}")
    if m == 0 or rows == 0:
        return out
    if cols == 0:
        return out.zero_()
    if x.stride(1) != 1:
        x = x.contiguous()
    if _lib is not None or available():
        if m <= int8_rows(qtype):
            rc = library().hkv_quant_matmul(x.data_ptr(), m, x.stride(0), data.data_ptr(),
                                            data.stride(0), qtype, rows, cols, out.data_ptr(),
                                            out.stride(0))
            if rc != 0:
                raise MemoryError("the quantized matmul could not allocate its buffers")
            return out
        if takes_gemm(qtype, cols):
            _gemm_product(x, data, qtype, rows, cols, out)
            return out
    # Rows that are not whole blocks of 32 (F32/F16/BF16 only), or no C kernels here.
    out.copy_(x @ dequantize(data, qtype, cols).T)
    return out


def gated_matmul(x: torch.Tensor, weight: QuantizedWeight, mode: int,
                 up: QuantizedWeight | None = None) -> torch.Tensor | None:
    """act(x G^T) * (x U^T), float32 [M, n], for `weight` the n gate rows and `up` the n up
    rows (of one type, width and row stride), or, `up` None, `weight` the n gate rows then the
    n up rows; `mode` one of worker/linear/cpu.py's GATED_ACTIVATIONS: quant_gemm.c's gated
    epilogue, at every M (batch invariant). None where the plain product runs these rows
    (8-bit activations' rows, a type or width the kernel does not take): the caller then
    applies the activation."""
    m = x.shape[0]
    if weight.row_order is not None or (up is not None and up.row_order is not None):
        return None  # gate/up rows are never reordered; the caller's plain product orders
    if up is not None and (up.qtype != weight.qtype or up.cols != weight.cols
                           or up.rows != weight.rows
                           or up.data.stride(0) != weight.data.stride(0)):
        return None
    if ((up is None and weight.rows % 2) or x.dim() != 2 or x.dtype != torch.float32
            or x.device.type != "cpu" or not available() or m <= int8_rows(weight.qtype)
            or not takes_gemm(weight.qtype, weight.cols)):
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    n = weight.rows if up is not None else weight.rows // 2
    out = torch.empty((m, n), dtype=torch.float32)
    _gemm_product(x, weight.data, weight.qtype, n, weight.cols, out, mode,
                  None if up is None else up.data)
    return out


def transposed_chunks(x: torch.Tensor, data: torch.Tensor, qtype: int, cols: int,
                      chunk_rows: int) -> Iterator[tuple[int, torch.Tensor]]:
    """W x^T a block of W's rows at a time: yields (r0, y) with y = W[r0:r0 + n] x^T, float32
    [n, M] (a buffer reused for the next block: read it before asking for the next).

    For a matrix far taller than x (a 262k-vocabulary LM head against a batch of 32 rows),
    torch's GEMM runs ~1.3x faster with the tall side as its rows than as x W^T (measured on
    an AVX2 core), and a block of rows stays in the caches between its dequantization and
    the product. The caller may reduce each block as it comes (a greedy argmax) without
    ever writing the whole [M, rows] product. x: float32 [M, cols], contiguous."""
    data = _check(data, qtype, cols)
    rows, m = data.shape[0], x.shape[0]
    chunk = max(1, min(chunk_rows, rows))
    wbuf = torch.empty((chunk, cols), dtype=torch.float32)
    ybuf = torch.empty((chunk, m), dtype=torch.float32)
    lib = library() if available() else None
    xt = x.T
    for r0 in range(0, rows, chunk):
        n = min(chunk, rows - r0)
        if lib is not None:
            lib.hkv_quant_dequantize(data[r0].data_ptr(), data.stride(0), qtype, cols, None, n,
                                     wbuf.data_ptr(), cols)
            w = wbuf[:n]
        else:
            w = _reference(data[r0:r0 + n], qtype, cols)
        y = ybuf[:n]
        torch.mm(w, xt, out=y)
        yield r0, y


@dataclass
class QuantizedWeight:
    """A GGUF weight kept quantized: data uint8 [rows, row_bytes] of `qtype` blocks.
    `row_order`: where the file stores the rows in another order than the model's (llama.cpp's
    q/k permutation), the data row of each output row: the product's columns are put in
    that order (the same bytes as a product over reordered rows), so the blocks stay where
    the file holds them instead of being copied."""

    data: torch.Tensor
    qtype: int
    rows: int
    cols: int
    row_order: torch.Tensor | None = None  # int64 [rows]

    def __post_init__(self) -> None:
        self.data = _check(self.data, self.qtype, self.cols)
        if self.data.shape[0] != self.rows:
            raise ValueError(f"data holds {self.data.shape[0]} rows, not {self.rows}")
        if self.row_order is not None and self.row_order.shape != (self.rows,):
            raise ValueError(f"row_order has shape {tuple(self.row_order.shape)}, not "
                             f"({self.rows},)")

    @classmethod
    def from_numpy(cls, raw: np.ndarray, qtype: int, rows: int, cols: int
                   ) -> QuantizedWeight:
        """From a GGUF tensor's raw bytes (any shape; a memmap view is kept, not copied)."""
        flat = raw.view(np.uint8).reshape(rows, row_bytes(qtype, cols))
        with warnings.catch_warnings():  # a read-only memmap: nothing here writes to it
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            data = torch.from_numpy(flat)
        return cls(data, int(qtype), rows, cols)

    @property
    def nbytes(self) -> int:
        return self.rows * row_bytes(self.qtype, self.cols)

    @property
    def type_name(self) -> str:
        return SUPPORTED[self.qtype]

    def dequantize(self) -> torch.Tensor:
        w = dequantize(self.data, self.qtype, self.cols)
        return w if self.row_order is None else w[self.row_order]

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., cols] -> [..., rows]."""
        if x.shape[-1] != self.cols:
            raise ValueError(f"x is [..., {self.cols}], not {tuple(x.shape)}")
        rows2d = x.reshape(-1, self.cols)
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"the quantized matmul takes float32 CPU inputs, not {x.dtype} "
                             f"on {x.device.type}")
        y = _product(rows2d, self.data, self.qtype, self.cols, out)
        if self.row_order is not None:
            y.copy_(y[:, self.row_order])  # a gather of outputs, not a copy of the matrix
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.rows)

    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: ids [...] -> float32 [..., cols]."""
        if self.row_order is not None:
            ids = self.row_order[ids]
        return dequantize_rows(self.data, self.qtype, self.cols, ids).view(*ids.shape,
                                                                             self.cols)
