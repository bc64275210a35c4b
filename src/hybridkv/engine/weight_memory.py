"""Where a loaded model's weights sit: used in place in a mapping of the model's file (page
cache, one copy however many processes and replicas map the file), mapped from hybridkv's
cache (the LM head's 8-bit pre-pass copy, worker/head/cache.py: page cache as well), or in
memory of this process's own (what a load had to change: dequantized norms, joined or
reordered rows of float or dequantized weights). The startup log says all three, so the
cost of every copy is visible.

Linux only (the mappings come from /proc/self/maps); elsewhere nothing is reported.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hybridkv.worker.head import cache as head_cache
from hybridkv.worker.head.bound import HeadBound
from hybridkv.worker.linear.quant import QuantizedWeight


@dataclass(frozen=True)
class WeightMemory:
    mapped: int  # bytes used where they lie in a mapping of the file
    cached: int  # bytes mapped from hybridkv's cache (kernel copies kept on disk)
    own: int  # bytes of this process's own
    own_parts: tuple[tuple[str, int], ...]  # own bytes by kind, largest first


def _file_ranges(path: Path, folder: Path) -> tuple[list[tuple[int, int]],
                                                    list[tuple[int, int]]] | None:
    """Address ranges of this process's mappings of `path` and of files in `folder`, or None
    without /proc."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    target, inside = os.path.realpath(path), os.path.realpath(folder) + os.sep
    of_file, of_folder = [], []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and (fields[5] == target or fields[5].startswith(inside)):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            (of_file if fields[5] == target else of_folder).append((start, end))
    return of_file, of_folder


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(kind, tensor) for every tensor the model's modules hold: parameters, buffers,
    quantized matrices, and the tensors of kernel copies kept beside them."""
    out: list[tuple[str, torch.Tensor]] = []

    def add(kind: str, value: object) -> None:
        if isinstance(value, torch.Tensor):
            if kind == "float" and not value.is_floating_point():
                kind = "other"
            out.append((kind, value))
        elif isinstance(value, QuantizedWeight):
            out.append(("quantized", value.data))
        elif isinstance(value, HeadBound):
            for field in dataclasses.fields(value):
                add("LM head pre-pass", getattr(value, field.name))
        elif isinstance(value, (list, tuple)):
            for item in value:
                add(kind, item)

    for module in model.modules():
        for name, value in vars(module).items():
            if name in ("_parameters", "_buffers"):
                for tensor in value.values():
                    if tensor is not None:
                        add("float", tensor)
            elif not name.startswith("_"):
                add("float", value)  # tables kept as attributes (RoPE's cos/sin, ...)
    return out


def weight_memory(model: nn.Module, path: str | Path) -> WeightMemory | None:
    """The model's weight bytes, mapped from `path` or of this process's own (each storage
    counted once); None where the mappings cannot be read."""
    found = _file_ranges(Path(path), head_cache.path_of(b"").parent)
    if found is None:
        return None
    ranges, cache_ranges = found
    seen: dict[int, tuple[str, int]] = {}
    for kind, tensor in _tensors(model):
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if size and (ptr not in seen or seen[ptr][1] < size):
            seen[ptr] = (kind, size)
    mapped = cached = own = 0
    parts: dict[str, int] = {}
    for ptr, (kind, size) in seen.items():
        if any(start <= ptr < end for start, end in ranges):
            mapped += size
        elif any(start <= ptr < end for start, end in cache_ranges):
            cached += size
        else:
            own += size
            parts[kind] = parts.get(kind, 0) + size
    return WeightMemory(mapped, cached, own,
                        tuple(sorted(parts.items(), key=lambda kv: -kv[1])))


def describe(memory: WeightMemory, path: str | Path) -> str:
    """One line for the startup log."""
    from hybridkv.kv.plan import format_bytes

    parts = ", ".join(f"{kind} {format_bytes(size)}" for kind, size in memory.own_parts)
    cached = (f", {format_bytes(memory.cached)} of kernel copies mapped from "
              f"{head_cache.path_of(b'').parent} (shared alike)" if memory.cached else "")
    return (f"weights: {format_bytes(memory.mapped)} used in place from {Path(path).name} "
            f"(page cache, shared by every process that maps the file){cached}, "
            f"{format_bytes(memory.own)} of this process's own" + (f" ({parts})" if parts
                                                                    else ""))
