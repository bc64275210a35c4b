"""Structured output's token mask on logits: the C kernel and the torch path (CUDA's) give
the same masked rows, ids past the mask are never allowed, and the model's logits are left
as they were (logprobs are computed from them)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llguidance")

from hybridkv.sched.structured.manager import GrammarBitmask  # noqa: E402
from hybridkv.worker.sampling import sampler  # noqa: E402


@pytest.mark.parametrize("vocab, words", [(1000, 32), (1024, 32), (1030, 32)])
def test_kernel_and_torch_path_mask_alike(vocab, words, monkeypatch):
    rng = np.random.default_rng(vocab)
    bits = rng.integers(0, 2**32, size=(3, words), dtype=np.uint64).astype(np.uint32)
    bits[0, :5] = 0xFFFFFFFF  # whole words allowed
    bits[1, :5] = 0  # and forbidden
    mask = GrammarBitmask(["b", "c", "a"], bits.view(np.int32))
    logits = torch.randn(4, vocab)
    before = logits.clone()
    at_c, masked_c = sampler.masked_rows(mask, ["a", "b", "c", "d"], logits)
    monkeypatch.setattr(sampler, "_mask_kernel", lambda: None)
    at_t, masked_t = sampler.masked_rows(mask, ["a", "b", "c", "d"], logits)
    assert at_c == at_t == {1: 0, 2: 1, 0: 2}
    assert torch.equal(masked_c, masked_t)
    assert torch.equal(logits, before)
    for row, i in at_c.items():
        allowed = np.unpackbits(bits[i].view(np.uint8), bitorder="little")[:vocab].astype(bool)
        got = masked_c[i]
        expect = logits[row].clone()
        expect[: len(allowed)][~allowed] = float("-inf")
        expect[len(allowed):] = float("-inf")  # past the mask's words
        assert torch.equal(got, expect)
