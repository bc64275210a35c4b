"""The LM head's 8-bit pre-pass copy (worker/head/bound.py), kept on disk and mapped.

Building the copy reads and requantizes every row of the head: ~2-3 s of a 262k-token
vocabulary's start-up, paid again by every process. Kept in the cache directory under a hash
of the head's own bytes (its type and width too), a later start maps the file instead: no
build, and its pages are the page cache's, shared by every process and replica serving the
model. The mapping is private (copy-on-write): nothing writes to the copy, and a stray write
would change only this process's page, never the file. A file that does not match (another
layout version, cut short by a crash) is rebuilt; any failure to read or write the cache
only costs the build.

Files: `$HYBRIDKV_CACHE_DIR/head/`, else `$XDG_CACHE_HOME/hybridkv/head/`, else
`~/.cache/hybridkv/head/`; one per head, about a Q8_0 copy of it in size (a 262k x 640 head:
~190 MiB). Delete the folder to reclaim the space.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

import numpy as np
import torch

from hybridkv.worker.native import cache_dir

MAGIC = b"HKVHEAD1"
# (name, numpy dtype) of the stored tensors, in file order; shapes come from the header.
FIELDS = (("packed", np.int8), ("scales", np.float16), ("wnorm", np.float32),
          ("dnorm", np.float32), ("wblock", np.float32), ("dblock", np.float32))
_HEADER = struct.Struct("<8s16sqqq?")  # magic, key, vocab, cols, groups, exact


# The code that makes the copy: a change to it names every copy anew (as a changed kernel
# source names a new library), so a file made by other code is never mapped.
_MAKERS = (Path(__file__).with_name("bound.py"), Path(__file__),
           Path(__file__).parents[1] / "native" / "head_bound.c")


def head_key(data: torch.Tensor, kind: str) -> bytes:
    """16 bytes naming a head's copy: xxh3-128 of the head's bytes, its kind (GGML type and
    width, or float32 and width) and the code that makes the copy."""
    import xxhash

    digest = xxhash.xxh3_128()
    digest.update(kind.encode())
    for maker in _MAKERS:
        digest.update(maker.read_bytes())
    digest.update(data.detach().contiguous().view(torch.uint8).numpy().data)
    return digest.digest()


def path_of(key: bytes) -> Path:
    return cache_dir().parent / "head" / f"{key.hex()}.bin"


def shapes(vocab: int, cols: int, groups: int, exact: bool) -> dict[str, tuple[int, ...]]:
    nb = cols // 32
    out: dict[str, tuple[int, ...]] = {
        "packed": (groups, nb, 8, 32), "scales": (groups, nb, 8), "wnorm": (vocab,),
        "dnorm": (vocab,), "wblock": (vocab, nb), "dblock": (vocab, nb)}
    if exact:  # a Q8_0 head's own values: no weight error to store
        del out["dnorm"], out["dblock"]
    return out


def load(key: bytes, vocab: int, cols: int, groups: int
         ) -> tuple[dict[str, torch.Tensor], bool] | None:
    """The stored tensors (views of a private mapping) and whether the copy is exact, or
    None where no matching file is there."""
    path = path_of(key)
    try:
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError):
        return None
    if len(mapped) < _HEADER.size:
        return None
    magic, stored, v, c, g, exact = _HEADER.unpack_from(mapped, 0)
    if (magic, stored, v, c, g) != (MAGIC, key, vocab, cols, groups):
        return None
    want = shapes(vocab, cols, groups, exact)
    dtypes = dict(FIELDS)
    if len(mapped) != _HEADER.size + sum(
            int(np.prod(s)) * np.dtype(dtypes[n]).itemsize for n, s in want.items()):
        return None  # cut short, or not ours
    data = np.frombuffer(mapped, dtype=np.uint8)
    out, at = {}, _HEADER.size
    for name, shape in want.items():
        size = int(np.prod(shape)) * np.dtype(dtypes[name]).itemsize
        out[name] = torch.from_numpy(data[at:at + size].view(dtypes[name]).reshape(shape))
        at += size
    return out, bool(exact)


def store(key: bytes, vocab: int, cols: int, tensors: dict[str, torch.Tensor | None]) -> None:
    """Write the copy's tensors for `key` (a temporary file renamed into place, so a process
    starting beside this one never maps half a file). Failures are ignored: the cache only
    saves a later start its build."""
    exact = tensors.get("dnorm") is None
    groups = int(tensors["packed"].shape[0])  # type: ignore[union-attr]
    path = path_of(key)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, key, vocab, cols, groups, exact))
            for name in shapes(vocab, cols, groups, exact):
                tensor = tensors[name]
                assert tensor is not None
                f.write(tensor.contiguous().view(torch.uint8).numpy().data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
