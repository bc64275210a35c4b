"""The LM head's pre-pass copy kept on disk (worker/head/cache.py): a second build of the same
head maps the stored copy (file pages, no build) holding the same values; a file cut short,
or a head whose bytes differ, is never mapped; and a head's greedy choices are the same from
a built and from a mapped copy."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from hybridkv.worker.head import bound as hb  # noqa: E402
from hybridkv.worker.head import cache as head_cache  # noqa: E402
from hybridkv.worker.head.bound import HeadBound  # noqa: E402
from hybridkv.worker.linear import quant as quant_linear  # noqa: E402
from tests.worker.test_head_bound import Q4_K, Q8_0, hidden, quantized_head  # noqa: E402

if not quant_linear.available() or not hb.available():
    pytest.skip("no pre-pass kernel here (needs a C compiler and AVX2)",
                allow_module_level=True)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The copies in a folder of this test's own (head_cache.path_of reads cache_dir())."""
    monkeypatch.setattr(head_cache, "cache_dir", lambda: tmp_path / "native")
    return tmp_path / "head"


def _fields(bound: HeadBound) -> list[torch.Tensor | None]:
    return [bound.packed, bound.scales, bound.wnorm, bound.dnorm, bound.wblock, bound.dblock]


def _mapped(tensor: torch.Tensor, path) -> bool:
    """Whether the tensor's bytes lie in this process's mapping of `path`."""
    ptr, target = tensor.untyped_storage().data_ptr(), os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        lines = maps.read().splitlines()
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].strip() == target:
            start, end = (int(a, 16) for a in fields[0].split("-"))
            if start <= ptr < end:
                return True
    return False


@pytest.mark.parametrize("qtype", [Q8_0, Q4_K], ids=["Q8_0", "Q4_K"])
def test_a_second_start_maps_the_stored_copy(cache, qtype):
    head = quantized_head(qtype, 300, 256)
    built = HeadBound.of_quantized(head)
    [stored] = list(cache.iterdir())
    mapped = HeadBound.of_quantized(head)
    assert built is not None and mapped is not None
    for a, b in zip(_fields(built), _fields(mapped), strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)
    assert (built.dnorm is None) == (qtype == Q8_0)  # a Q8_0 head's copy is its own values
    if os.path.exists("/proc/self/maps"):
        assert _mapped(mapped.packed, stored) and not _mapped(built.packed, stored)
    x = hidden(5, 256)
    assert torch.equal(built.approx(x), mapped.approx(x))


def test_a_file_cut_short_or_another_heads_is_never_mapped(cache):
    head = quantized_head(Q8_0, 300, 256)
    built = HeadBound.of_quantized(head)
    [stored] = list(cache.iterdir())
    data = stored.read_bytes()
    stored.write_bytes(data[:-100])  # a crash mid-write (were it not renamed into place)
    again = HeadBound.of_quantized(head)  # rebuilt, and stored whole again
    assert again is not None and torch.equal(again.packed, built.packed)
    assert stored.read_bytes() == data
    other = quantized_head(Q8_0, 300, 256)
    other.data[7, 5] ^= 1  # one byte of one row: another head, another file
    HeadBound.of_quantized(other)
    assert len(list(cache.iterdir())) == 2
