"""GGML-quantized weights kept in their GGUF blocks: dequantization, embedding rows and
y = x W^T through one C call each (worker/native/quant.c), float32 out.

A weight is the GGUF tensor's raw bytes as uint8 [rows, row_bytes] (rows: output features;
the quantization blocks run along cols, the input features), possibly a view of a
memory-mapped file: nothing here writes to it. On CPUs the product reads the quantized rows
once (decode streams them near memory bandwidth); where the C library does not build,
everything falls back to gguf-py's numpy dequantization and a float matmul.

Which path y = x W^T takes (M: the rows of x):
  * With 8-bit activations on (quant_activations="int8"; off by default, see
    FLOAT_ACTIVATIONS), quantized types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) on a
    CPU with AVX2, M
    up to 24 (Q8_0), 20 (Q4_0, Q4_1), 16 (Q5_0, Q6_K), 12 (Q5_1), 10 (Q4_K) or 8 (Q5_K):
    8-bit activations. Each x row is quantized once per call in blocks of 32 values
    (scale d = max|x| / 127, q = round(x / d)) and dotted with the weight blocks' integers
    in int32 (AVX2 maddubs/madd), one float scaling per 32 values; mins go through x's exact
    block sums. At M=1 on one core this runs 1.7-2.2x the float kernel (a 262144 x 640 Q8_0
    LM head at ~17 GB/s, near memory bandwidth). The limits are where it stopped beating
    the float kernels (measured on an AMD EPYC core); without AVX2 x stays in float (the
    portable integer kernel, kept for other CPUs and tested, measured slower there).
  * Otherwise x in float: up to 4 rows (8 for Q8_0; 6 on AVX-512) the fused kernel, then
    the C dot panels; from 16 rows (7 on AVX-512, 9 for Q8_0 there: packed_from; past the
    8-bit limit when that is on) a few panels of W at a time dequantized into the float
    linear kernel's layout and multiplied by its register tiles; from LARGE_M rows
    (prefill) the same tiles over chunks of ~16 MiB of panels, x packed once a chunk
    (torch's GEMM on dequantized chunks of rows where the float kernel does not build).
    F32/F16/BF16 always float.
  * By default (set_float_activations(True); HYBRIDKV_QUANT_FLOAT_ACTIVATIONS unset or 1)
    x stays in float everywhere.

Accuracy of the 8-bit activations: rounding x to its block's grid moves each value by at
most d / 2 = max|x_block| / 254, so for each output
    |y - y_float| <= sum over x blocks B of (max_{k in B} |x_k| / 254) * sum_{k in B} |d q_k|
plus float rounding (~1e-6 sum |x||w|), with d q the weight less its block's min (the
weight itself for Q4_0, Q5_0, Q8_0, Q6_K). The tests check it for every type (odd block
counts, strided rows, 2 threads, both kernels). In practice errors stay ~5% of that bound;
relative to sum_k |x_k w_k| they measured <= 1.2e-3 for Gaussian x and <= 6e-3 for x whose
magnitudes span five decades (as llama.cpp's Q8_0 activations).
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridkv.worker import cpu_linear, native

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

# x rows from which the product dequantizes chunks of _CHUNK_FLOATS weights (~0.15 ns a
# weight, once per call) and multiplies each chunk whole: through the float kernel's tiles
# (PREFILL_PACKED), or torch's GEMM where that kernel does not build. On an AVX2 core
# torch's GEMM measured 1.0-1.1x the few-panel tiles at 512 rows; the tiles over a whole
# chunk, x packed once, ran Gemma 3 270M's 512-token prompt 1.16x faster than torch's GEMM
# on an AVX-512 core (SmolLM2 1.23x), the same tokens.
LARGE_M = 128
_CHUNK_FLOATS = 1 << 22  # 16 MiB: torch's GEMM loses speed on narrower chunks
# x rows [lo, hi) for which a few panels of W at a time are dequantized into the float
# kernel's layout (worker/native/linear.c's, 64 output columns per panel) and its register
# tiles run on them while they are in L2. Measured on Gemma 3 270M's Q5_0, Q4_K, Q6_K and
# Q8_0 weights (one AVX2 core): 0.95-1.13x the dot tiles at 16 rows (by type), 1.02-1.2x
# at 32 and 64, and at 32 rows 1.1-1.2x dequantizing whole matrices for torch's GEMM,
# which catches up at 128; below 16 rows the dot tiles' cheaper dequantization wins (at 8
# rows by 1.1-1.3x). On an AVX-512 core the float tiles are 16 lanes wide and so is the
# fused kernel (4 x rows a pass over W); the fused kernel takes up to 6 rows there (two
# passes still ahead: native/quant.c, FUSED_MAX), the tiles from 7 (ahead of the dot
# panels at 5-8 rows by 1.15-1.36x on Gemma 3 270M's and SmolLM2's matrices).
_AVX512 = all(native.cpu_has(f) for f in ("avx512f", "avx512bw", "avx512vl"))
PACKED_ROWS = (7 if _AVX512 else 16, LARGE_M)
# Q8_0's blocks decode cheaply enough that the fused kernel (its C limit: 2 FUSED_MAX
# rows) stays ahead of the tiles for 7 and 8 rows on AVX-512: 1.1-1.4x at a Mamba-2
# hybrid's 512-1,536-wide matrices, level at 10 (one core, alternating).
PACKED_ROWS_Q8_0 = 9 if _AVX512 else PACKED_ROWS[0]
Q8_0 = 8
PREFILL_PACKED = True  # LARGE_M rows and more on the float tiles (tests turn it off)
_linear_address: int | None = None
# The chunk buffers, per thread (two engines in one process must not share one).
_packed_buffers = threading.local()

# x stays in float unless 8-bit activations are asked for: by the engine option
# quant_activations="int8" (set_float_activations(False)) or HYBRIDKV_QUANT_FLOAT_ACTIVATIONS=0
# (read once, at import). Float is the default because it is exact against the dequantized
# model (greedy tokens equal to transformers'); 8 bits move real models' logits by up to
# ~1-4 (of ~30) and change greedy tokens where the top two are within ~0.3.
FLOAT_ACTIVATIONS = os.environ.get("HYBRIDKV_QUANT_FLOAT_ACTIVATIONS", "1") != "0"

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES: dict[str, list[Any]] = {
    "hkv_quant_dequantize": [_PTR, _I64, _INT, _I64, _PTR, _I64, _PTR, _I64],
    "hkv_quant_matmul": [_PTR, _I64, _I64, _PTR, _I64, _INT, _I64, _I64, _PTR, _I64],
    "hkv_quant_force_portable": [_INT],
    "hkv_quant_float_activations": [_INT],
    "hkv_quant_panel_codes": [_INT],
    "hkv_quant_int8_rows": [_INT],
    "hkv_quant_matmul_packed": [_PTR, _I64, _I64, _PTR, _I64, _INT, _I64, _I64, _PTR, _I64,
                                _INT, _PTR, _I64, _PTR],
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
        lib.hkv_quant_packed_floats.argtypes = [_I64, _I64]
        lib.hkv_quant_packed_floats.restype = _I64
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
    lib = _lib
    if lib is None:
        if not available():
            torch.matmul(x, _reference(data, qtype, cols).T, out=out)
            return out
        lib = library()
    if x.stride(1) != 1:
        x = x.contiguous()
    if _takes_packed(m, qtype) and _packed(x, data, qtype, rows, cols, out):
        return out
    if m >= LARGE_M:
        # Prefill: dequantize a chunk of rows at a time (16 MiB of floats, L3-resident) and
        # run torch's float GEMM on it; the dequantization is ~1% of the GEMM's time.
        chunk = max(1, _CHUNK_FLOATS // max(cols, 1))
        buf = torch.empty((min(chunk, rows), cols), dtype=torch.float32)
        fn = lib.hkv_quant_dequantize
        for r0 in range(0, rows, chunk):
            n = min(chunk, rows - r0)
            fn(data[r0].data_ptr(), data.stride(0), qtype, cols, None, n, buf.data_ptr(), cols)
            if n == rows and out.is_contiguous():
                torch.mm(x, buf.T, out=out)
            else:
                out[:, r0:r0 + n] = torch.mm(x, buf[:n].T)
        return out
    rc = lib.hkv_quant_matmul(x.data_ptr(), m, x.stride(0), data.data_ptr(), data.stride(0),
                               qtype, rows, cols, out.data_ptr(), out.stride(0))
    if rc != 0:
        raise MemoryError("the quantized matmul could not allocate its panel buffers")
    return out


def packed_from(qtype: int) -> int:
    """The fewest x rows that take the packed float tiles for this type (below LARGE_M)."""
    return PACKED_ROWS_Q8_0 if qtype == Q8_0 else PACKED_ROWS[0]


def _takes_packed(m: int, qtype: int) -> bool:
    """Whether m rows of x take the packed float tiles: from packed_from(qtype) rows,
    unless 8-bit activations are on and the integer kernel takes that many rows."""
    if m >= PACKED_ROWS[1]:
        return PREFILL_PACKED
    return packed_from(qtype) <= m and (FLOAT_ACTIVATIONS or m > int8_rows(qtype))


def _packed_linear() -> int | None:
    """The address of the float tile kernel (worker/native/linear.c), or None where it does
    not build."""
    global _linear_address
    if _linear_address is None:
        try:
            _linear_address = ctypes.cast(cpu_linear.library().hkv_linear_f32,
                                          ctypes.c_void_p).value or 0
        except native.NativeBuildError:
            _linear_address = 0
    return _linear_address or None


def packed_kernel() -> int | None:
    """The float tile kernel's address the packed products pass on (None: not built)."""
    return _packed_linear()


def _packed(x: torch.Tensor, data: torch.Tensor, qtype: int, n: int, cols: int,
            out: torch.Tensor, mode: int = 0) -> bool:
    """out = x W^T (mode 0) or the gated product (a gated mode of worker/cpu_linear.py: W
    holds n gate rows, then n up rows) through the float tiles, dequantizing a few panels of
    W at a time; False where the float kernel does not build (nothing written)."""
    linear = _packed_linear()
    if linear is None or cols % 8:  # (a panel is transposed 8 x 8 values at a time)
        return False
    lib = library()
    # One panel per thread per chunk: the float kernel splits a chunk's panels over them.
    # A prefill's chunk is ~_CHUNK_FLOATS of weights: the kernel packs x once per chunk.
    panels = max(1, torch.get_num_threads())
    if x.shape[0] >= LARGE_M:
        width = cpu_linear.PANEL // 2 if mode else cpu_linear.PANEL
        panels = max(panels, min(-(-n // width), _CHUNK_FLOATS // (cpu_linear.PANEL * cols)))
    buffers: dict[str, torch.Tensor] = _packed_buffers.__dict__
    key = f"{cols}x{panels}"
    buf = buffers.get(key)
    if buf is None:
        buf = buffers[key] = torch.empty(int(lib.hkv_quant_packed_floats(panels, cols)))
    rc = lib.hkv_quant_matmul_packed(x.data_ptr(), x.shape[0], x.stride(0), data.data_ptr(),
                                     data.stride(0), qtype, n, cols, out.data_ptr(),
                                     out.stride(0), mode, buf.data_ptr(), panels, linear)
    if rc == -2:
        raise MemoryError("the quantized matmul could not allocate its scratch")
    if rc != 0:
        raise ValueError(f"the packed quantized matmul does not take type {qtype}")
    return True


def gated_matmul(x: torch.Tensor, weight: QuantizedWeight, mode: int) -> torch.Tensor | None:
    """act(x G^T) * (x U^T), float32 [M, n], for `weight` the n gate rows then the n up rows
    and `mode` one of worker/cpu_linear.py's GATED_ACTIVATIONS: the activation and product
    in the float kernel's registers. None where the plain product runs these rows (outside
    PACKED_ROWS, 8-bit activations, no C kernels): the caller then applies the activation."""
    m = x.shape[0]
    if (weight.rows % 2 or x.dim() != 2 or x.dtype != torch.float32
            or x.device.type != "cpu" or not available() or not _takes_packed(m, weight.qtype)):
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    n = weight.rows // 2
    out = torch.empty((m, n), dtype=torch.float32)
    return out if _packed(x, weight.data, weight.qtype, n, weight.cols, out, mode) else None


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
    """A GGUF weight kept quantized: data uint8 [rows, row_bytes] of `qtype` blocks."""

    data: torch.Tensor
    qtype: int
    rows: int
    cols: int

    def __post_init__(self) -> None:
        self.data = _check(self.data, self.qtype, self.cols)
        if self.data.shape[0] != self.rows:
            raise ValueError(f"data holds {self.data.shape[0]} rows, not {self.rows}")

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
        return dequantize(self.data, self.qtype, self.cols)

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., cols] -> [..., rows]."""
        if x.shape[-1] != self.cols:
            raise ValueError(f"x is [..., {self.cols}], not {tuple(x.shape)}")
        rows2d = x.reshape(-1, self.cols)
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"the quantized matmul takes float32 CPU inputs, not {x.dtype} "
                             f"on {x.device.type}")
        y = _product(rows2d, self.data, self.qtype, self.cols, out)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.rows)

    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: ids [...] -> float32 [..., cols]."""
        return dequantize_rows(self.data, self.qtype, self.cols, ids).view(*ids.shape,
                                                                             self.cols)
