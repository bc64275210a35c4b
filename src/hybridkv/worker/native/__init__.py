"""C kernels for the CPU, compiled on first use and loaded with ctypes.

The sources sit beside this file. Each is compiled once per machine with the system C
compiler (`cc`, or `$CC`) for this CPU (`-march=native`) into the cache directory
(`$HYBRIDKV_CACHE_DIR`, else `$XDG_CACHE_HOME/hybridkv`, else `~/.cache/hybridkv`), under a
name that hashes the source (and the headers beside it), the flags, the compiler's version
and the CPU's model and flags, so a shared home on different machines never loads a library
built for another CPU. A
compile takes about a second; a build goes to a temporary file renamed into place, so
processes starting together never load a half-written library.

No torch here: callers pass data pointers (see worker/attention/cpu.py).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

SOURCES = Path(__file__).parent
# -fopenmp: a library links libgomp.so.1, and torch has loaded its own copy under that name
# by the time one is loaded here, so the kernels' threads are torch's pool, not a second one.
# -fno-trapping-math: no code here reads floating-point exception flags, and without it a
# select on a float comparison or a nearbyintf keeps a loop scalar (simd.h's gated_row, ~6x
# torch's silu(g) * u); it allows no reassociation or contraction, so values are the same.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
         "-shared", "-fPIC")


class NativeBuildError(RuntimeError):
    """The C compiler is missing or failed: the caller decides whether that is fatal."""


_loaded: dict[str, ctypes.CDLL] = {}
_functions: dict[tuple[str, str], Any] = {}


def cache_dir() -> Path:
    if os.environ.get("HYBRIDKV_CACHE_DIR"):
        return Path(os.environ["HYBRIDKV_CACHE_DIR"]) / "native"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hybridkv" / "native"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeBuildError("no C compiler found (set CC, or install gcc)")
    return cc


@functools.cache
def _cpu_identity() -> str:
    """The CPU's model and feature flags (Linux), else the platform's description (read
    once: the build key and every cpu_has ask for it)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))  # the first core's lines are enough


@functools.cache
def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists `flag` (e.g. "avx512f") for this CPU: the kernels are
    built with -march=native, so its instructions are theirs (False off Linux)."""
    return flag in _cpu_identity().split()


def load(name: str) -> ctypes.CDLL:
    """The compiled library of `<name>.c`, built if this machine has no copy yet."""
    if name in _loaded:
        return _loaded[name]
    source = SOURCES / f"{name}.c"
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeBuildError(f"C compiler {cc!r} does not run: {exc}") from None
    # The headers beside the sources are part of every source.
    headers = [h.read_text() for h in sorted(SOURCES.glob("*.h"))]
    key = hashlib.sha256("\0".join([source.read_text(), *headers, " ".join(FLAGS), version,
                                    _cpu_identity()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if not target.exists():
        try:
            _build(cc, source, target)
        except (OSError, subprocess.SubprocessError) as exc:  # unwritable cache, timeout
            raise NativeBuildError(f"cannot build {source.name} into {target.parent}: "
                                   f"{exc}") from None
    try:
        library = ctypes.CDLL(str(target))
    except OSError as exc:
        raise NativeBuildError(f"cannot load {target}: {exc}") from None
    _loaded[name] = library
    return library


def function(name: str, symbol: str, argtypes: list[Any], restype: Any = None) -> Any:
    """`symbol` of `<name>.c`'s library with its ctypes signature, or None where the
    library cannot be built (the caller then takes its torch path). Looked up once."""
    key = (name, symbol)
    if key not in _functions:
        try:
            fn = getattr(load(name), symbol)
        except NativeBuildError:
            fn = None
        else:
            fn.argtypes, fn.restype = argtypes, restype
        _functions[key] = fn
    return _functions[key]


def _build(cc: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, str(source), "-lm"],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise NativeBuildError(f"compiling {source.name} failed: "
                                   f"{done.stderr.strip().splitlines()[-1:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
