"""A relative bias per query and a sink per query (AttentionParams.query_bias / token_sinks,
Inkling's attention) over paged KV, against a softmax written out query by query."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hybridkv.worker.attention.backend import AttentionParams, get_backend  # noqa: E402
from tests.worker.test_attention import BS, H_KV, H_Q, D, paged_metadata  # noqa: E402

EXTENT = 6  # the bias covers distances 0..5: shorter than the contexts, longer than none


def by_hand(q, keys, values, q_pos, scale, window, bias, sinks):
    """One query at a time: scores over its visible keys, + bias at each key's distance
    (zero from EXTENT on), a sink logit joining the softmax."""
    out = torch.zeros_like(q)
    group = H_Q // H_KV
    for t, p in enumerate(q_pos.tolist()):
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(H_Q):
            k, v = keys[lo:p + 1, h // group], values[lo:p + 1, h // group]
            scores = (k @ q[t, h]) * scale
            if bias is not None:
                scores = scores + torch.tensor([bias[t, h, p - j] if p - j < EXTENT else 0.0
                                                for j in range(lo, p + 1)])
            logits = scores if sinks is None else torch.cat([scores, sinks[t, h:h + 1]])
            probs = torch.softmax(logits, 0)[:scores.shape[0]]
            out[t, h] = probs @ v
    return out


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("kernel_block", [BS, BS // 2])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("parts", ["bias", "sinks", "both"])
def test_per_query_bias_and_sinks_equal_a_softmax_by_hand(backend, kernel_block, window,
                                                          parts):
    torch.manual_seed(3)
    per_page = 3
    kv = torch.zeros(12, per_page, 2, BS, H_KV, D)
    # A decode at 19, a chunk of 6 at 7..12, a chunk of 19 at 3..21 (longer than the window).
    lens, new = [20, 13, 22], [1, 6, 19]
    tables = [[5, 9, 14], [30, 4], [7, 20, 33]]
    keys_all = [torch.randn(n, H_KV, D) for n in lens]
    values_all = [torch.randn(n, H_KV, D) for n in lens]
    for r, (table, n) in enumerate(zip(tables, lens, strict=True)):
        for pos in range(n - new[r]):
            b = table[pos // BS]
            kv[b // per_page, b % per_page, 0, pos % BS] = keys_all[r][pos]
            kv[b // per_page, b % per_page, 1, pos % BS] = values_all[r][pos]
    meta = paged_metadata(tables, lens, new, per_page, kernel_block)
    loc = meta.query_start_loc
    q = torch.randn(loc[-1], H_Q, D)
    bias = 3 * torch.randn(loc[-1], H_Q, EXTENT) if parts != "sinks" else None
    sinks = 2 * torch.randn(loc[-1], H_Q) if parts != "bias" else None
    params = AttentionParams(scale=1 / math.sqrt(D), sliding_window=window, query_bias=bias,
                             token_sinks=sinks)
    k_new = torch.cat([k[-m:] for k, m in zip(keys_all, new, strict=True)])
    v_new = torch.cat([v[-m:] for v, m in zip(values_all, new, strict=True)])
    out = get_backend(backend).forward(q, k_new, v_new, kv, meta, params)
    for r in range(len(lens)):
        rows = slice(loc[r], loc[r + 1])
        expect = by_hand(q[rows], keys_all[r], values_all[r],
                         torch.arange(lens[r] - new[r], lens[r]), params.scale, window,
                         None if bias is None else bias[rows],
                         None if sinks is None else sinks[rows])
        torch.testing.assert_close(out[rows], expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_int8_pages_give_the_in_place_kernel_the_torch_paths_scores(window):
    """int8 pages, head size 32 (queries read as int8 too, the kernel's int8 dot path): the
    "cpu" backend's in-place kernel and the torch path agree with bias and sinks on."""
    from hybridkv.kv.spec import quantized_row_bytes
    from hybridkv.worker.attention.backend import TorchReferenceBackend

    torch.manual_seed(4)
    dim, per_page = 32, 3
    kv = torch.zeros(12, per_page, 2, BS, H_KV, quantized_row_bytes("int8", dim),
                     dtype=torch.uint8)
    lens, new = [20, 13, 22], [1, 6, 19]
    tables = [[5, 9, 14], [30, 4], [7, 20, 33]]
    past = [n - m for n, m in zip(lens, new, strict=True)]
    earlier = paged_metadata(tables, past, past, per_page, BS)
    earlier.cache_dtype = "int8"
    num_past = earlier.query_start_loc[-1]
    TorchReferenceBackend().write(torch.randn(num_past, H_KV, dim),
                                  torch.randn(num_past, H_KV, dim), kv, earlier,
                                  AttentionParams(scale=1.0))
    outs = []
    for backend in ("torch", "cpu"):
        meta = paged_metadata(tables, lens, new, per_page, BS)
        meta.cache_dtype = "int8"
        gen = torch.Generator().manual_seed(5)
        num = meta.query_start_loc[-1]
        q, k, v = (torch.randn(num, h, dim, generator=gen) for h in (H_Q, H_KV, H_KV))
        params = AttentionParams(
            scale=1 / math.sqrt(dim), sliding_window=window,
            query_bias=3 * torch.randn(num, H_Q, EXTENT, generator=gen),
            token_sinks=2 * torch.randn(num, H_Q, generator=gen))
        outs.append(get_backend(backend).forward(q, k, v, kv.clone(), meta, params))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
