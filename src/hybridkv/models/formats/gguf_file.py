"""The header of a GGUF file: its metadata and its tensors' names, types, shapes and offsets.

Pure Python (struct over a memory map), so `hybridkv plan model.gguf` needs no torch and no
numpy. The `gguf` package's reader builds a numpy view per array element: 21 s for the
262,144-token vocabulary of Gemma 3 270M on this machine class, against ~0.3 s here. Tensor
data is not read here: the loader maps it (formats/gguf_weights.py).

Every malformed file is one ValueError naming the file and what was wrong (a wrong magic, a
truncated header, a value of an unknown type, a tensor past the end of the file).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types -> struct format of one scalar (8: string, 9: array are read apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# GGML tensor types: id -> (name, values per block, bytes per block). The types llama.cpp
# writes into model files; which of them the engine computes on is the kernels' business.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}


def type_name(qtype: int) -> str:
    return GGML_TYPES[qtype][0] if qtype in GGML_TYPES else f"type {qtype}"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: rows first ([out, in] for a matrix)
    qtype: int
    offset: int  # from the file's start
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: Mapping[str, Any]
    tensors: Mapping[str, TensorInfo]
    data_offset: int

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{self.path}: general.architecture is missing or not a string")
        return arch


class _Cursor:
    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF header (needs byte "
                             f"{self.pos + size:,}, the file has {len(self.buf):,})")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF header (a string of {n:,} bytes "
                             f"at byte {self.pos:,})")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int, key: str) -> list[str]:
        """An array of strings (a vocabulary: 262,144 for Gemma), in one tight loop."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = struct.Struct("<Q").unpack_from
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError(f"{self.path}: truncated GGUF header (array {key!r})")
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > end:
                raise ValueError(f"{self.path}: truncated GGUF header (array {key!r})")
            append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if etype in _SCALARS:
                fmt = _SCALARS[etype]
                size = struct.calcsize(fmt)
                if self.pos + size * count > len(self.buf):
                    raise ValueError(f"{self.path}: truncated GGUF header (array {key!r} of "
                                     f"{count:,} values)")
                values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos))
                self.pos += size * count
                return values
            if etype == _STRING:
                return self.strings(count, key)
            return [self.value(etype, key) for _ in range(count)]
        raise ValueError(f"{self.path}: metadata key {key!r} has unknown value type {vtype}")


def read_header(path: str | Path) -> GGUFHeader:
    """The file's metadata (key -> Python value; arrays as lists) and tensor table."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if path.stat().st_size < 24:
                raise ValueError(f"{path}: not a GGUF file (only {path.stat().st_size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return _parse(memoryview(mm), path)
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror})") from None


def _parse(buf: memoryview, path: Path) -> GGUFHeader:
    try:
        return _parse_unguarded(buf, path)
    finally:
        buf.release()


def _parse_unguarded(buf: memoryview, path: Path) -> GGUFHeader:
    if bytes(buf[:4]) != MAGIC:
        raise ValueError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected "
                         f"{MAGIC!r})")
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are; "
                         f"a big-endian file reads as a huge version)")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    if n_tensors > 10_000_000 or n_kv > 10_000_000:
        raise ValueError(f"{path}: implausible GGUF header ({n_tensors:,} tensors, {n_kv:,} "
                         f"metadata keys)")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("<I"), key)
    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.take("<I")
        if n_dims > 8:
            raise ValueError(f"{path}: tensor {name!r} has {n_dims} dimensions")
        dims = tuple(cur.take("<Q") for _ in range(n_dims))
        qtype, offset = cur.take("<I"), cur.take("<Q")
        infos.append((name, dims, qtype, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: general.alignment must be a power of two, got "
                         f"{alignment!r}")
    data_offset = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, dims, qtype, offset in infos:
        if qtype not in GGML_TYPES:
            raise ValueError(f"{path}: tensor {name!r} has unknown GGML type {qtype}")
        _, block, block_bytes = GGML_TYPES[qtype]
        elements = 1
        for d in dims:
            elements *= d
        if dims and dims[0] % block:
            raise ValueError(f"{path}: tensor {name!r} ({type_name(qtype)}) has rows of "
                             f"{dims[0]} values, not a multiple of its block of {block}")
        nbytes = elements // block * block_bytes
        start = data_offset + offset
        if start + nbytes > len(buf):
            raise ValueError(f"{path}: tensor {name!r} ends at byte {start + nbytes:,}, past "
                             f"the end of the file ({len(buf):,} bytes): truncated?")
        # GGUF lists dimensions fastest first; numpy order puts rows first.
        tensors[name] = TensorInfo(name, tuple(reversed(dims)), qtype, start, nbytes)
    return GGUFHeader(path, version, metadata, tensors, data_offset)


def read_f32_values(header: GGUFHeader, name: str) -> list[float]:
    """The values of a small F32 tensor (Gemma 4's rope_freqs: which angles rotate), read
    without numpy; the config needs them before any weight is mapped."""
    info = header.tensors.get(name)
    if info is None:
        raise ValueError(f"{header.path}: tensor {name!r} is missing")
    if info.qtype != 0:
        raise ValueError(f"{header.path}: tensor {name!r} is {info.type_name}, expected F32")
    with open(header.path, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.nbytes)
    if len(data) != info.nbytes:
        raise ValueError(f"{header.path}: tensor {name!r} is cut short")
    return list(struct.unpack(f"<{info.nbytes // 4}f", data))


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a file that starts with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        with open(p, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False
