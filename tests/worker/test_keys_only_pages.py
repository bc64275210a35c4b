"""K-only pages in the reference backend: a layer writes raw keys and derives K and V from a
context's raw keys at each read. Against dense attention over the derived K/V, for every cache
layout, kernel blocks inside manager blocks, and the batched / alone / soft-capped paths."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hybridkv.worker.attention.backend import AttentionParams, get_backend  # noqa: E402
from tests.worker.test_attention import BS, H_KV, H_Q, D, dense, paged_metadata  # noqa: E402


def derive(raw: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A position-dependent K (a rotation of the two head halves, like RoPE) and a V that is
    another function of the same raw keys: raw [..., L, Hk, D], positions [L]."""
    angle = (0.3 * positions.float())[:, None, None]  # [L, 1, 1]
    a, b = raw.chunk(2, dim=-1)
    keys = torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], -1)
    return keys, torch.tanh(2 * raw) - 0.5


@pytest.mark.parametrize("layout", ["flat", "multi_block_pages", "padded_pages"])
@pytest.mark.parametrize("kernel_block", [BS, BS // 2])
@pytest.mark.parametrize("feature", ["plain", "window", "softcap"])
def test_k_only_pages_attend_as_dense_over_the_derived_keys_and_values(
        layout, kernel_block, feature):
    torch.manual_seed(0)
    per_page, num_pages = (1, 12) if layout == "flat" else (3, 12)
    page_elems = per_page * BS * H_KV * D + (5 if layout == "padded_pages" else 0)
    arena = torch.zeros(num_pages, page_elems)
    kv = arena[:, :per_page * BS * H_KV * D].unflatten(1, (per_page, BS, H_KV, D))
    params = AttentionParams(scale=1 / math.sqrt(D), derive_kv=derive,
                             sliding_window=5 if feature == "window" else None,
                             softcap=3.0 if feature == "softcap" else None)
    # A decode (19 -> 20), a prompt chunk of 6 at 7..12 and one of 19 at 3..21 (longer than
    # the window: attended alone), and a whole prompt of 9 from position 0.
    lens, new = [20, 13, 22, 9], [1, 6, 19, 9]
    tables = [[5, 9, 11], [10, 4], [1, 2, 3], [6, 7]] if layout == "flat" else \
        [[5, 9, 14], [30, 4], [7, 20, 33], [12, 13]]
    raw_all = [torch.randn(n, H_KV, D) for n in lens]
    for r, (table, n) in enumerate(zip(tables, lens, strict=True)):  # past tokens, by hand
        for pos in range(n - new[r]):
            b = table[pos // BS]
            kv[b // per_page, b % per_page, pos % BS] = raw_all[r][pos]
    meta = paged_metadata(tables, lens, new, per_page, kernel_block)
    loc = meta.query_start_loc
    q = torch.randn(loc[-1], H_Q, D)
    raw_new = torch.cat([raw[-m:] for raw, m in zip(raw_all, new, strict=True)])
    out = get_backend("torch").forward(q, raw_new, None, kv, meta, params)
    expect = torch.cat([
        dense(q[loc[r]:loc[r + 1]], *derive(raw_all[r], torch.arange(lens[r])),
              torch.arange(lens[r] - new[r], lens[r]), params) for r in range(len(lens))])
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
    # The page holds the raw keys as written, nothing else.
    for r, (table, n) in enumerate(zip(tables, lens, strict=True)):
        pos = n - 1
        b = table[pos // BS]
        assert torch.equal(kv[b // per_page, b % per_page, pos % BS], raw_all[r][pos])
    # A layer reading this cache (KV sharing) writes nothing and derives the same.
    torch.testing.assert_close(get_backend("torch").forward(q, None, None, kv, meta, params),
                               expect, atol=1e-5, rtol=1e-5)


def test_a_page_layout_and_a_layer_that_disagree_fail_clearly():
    kv_pages = torch.zeros(4, 1, 2, BS, H_KV, D)
    k_only_pages = torch.zeros(4, 1, BS, H_KV, D)
    meta = paged_metadata([[1]], [1], [1], 1, BS)
    q, k = torch.randn(1, H_Q, D), torch.randn(1, H_KV, D)
    plain = AttentionParams(scale=1.0)
    with pytest.raises(ValueError, match="K-only pages need a layer that derives K and V"):
        get_backend("torch").forward(q, k, k, k_only_pages, meta, plain)
    with pytest.raises(ValueError, match="derives K and V from raw keys but its pages hold"):
        get_backend("torch").forward(q, k, None, kv_pages, meta,
                                     AttentionParams(scale=1.0, derive_kv=derive))

