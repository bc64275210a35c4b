"""The reference backend over paged KV against dense attention, for every cache layout."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hybridkv.worker.attention.backend import (  # noqa: E402
    CAUSAL_TILE,
    AttentionMetadata,
    AttentionParams,
    TorchReferenceBackend,
    _attend_padded,
    get_backend,
)

BS, H_Q, H_KV, D = 8, 4, 2, 16


def dense(q, keys, values, q_pos, params):
    """q [nq, Hq, D] at positions q_pos; keys/values [L, Hk, D] at 0..L-1."""
    keys = keys.repeat_interleave(H_Q // H_KV, dim=1)
    values = values.repeat_interleave(H_Q // H_KV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * params.scale
    if params.softcap:
        scores = torch.tanh(scores / params.softcap) * params.softcap
    k_pos = torch.arange(keys.shape[0])
    ok = k_pos[None, :] <= q_pos[:, None]
    if params.sliding_window:
        ok &= q_pos[:, None] - k_pos[None, :] < params.sliding_window
    if params.chunk_size:
        ok &= k_pos[None, :] // params.chunk_size == q_pos[:, None] // params.chunk_size
    scores = scores.masked_fill(~ok, float("-inf"))
    if params.sinks is not None:
        sink = params.sinks.view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return torch.einsum("hqk,khd->qhd", probs, values)


BACKENDS = ["torch", "cpu"]  # "cpu": short query runs read the pages in place (C kernel)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["flat", "multi_block_pages", "padded_pages"])
@pytest.mark.parametrize("kernel_block", [BS, BS // 2])
@pytest.mark.parametrize("feature", ["plain", "window", "chunk", "softcap", "sinks"])
def test_paged_attention_equals_dense(layout, kernel_block, feature, backend):
    torch.manual_seed(0)
    per_page = 1 if layout == "flat" else 3
    num_pages = 12
    # A padded page leaves room after its blocks: the view is strided over pages.
    page_elems = per_page * 2 * BS * H_KV * D + (7 if layout == "padded_pages" else 0)
    arena = torch.zeros(num_pages, page_elems)
    kv = arena[:, :per_page * 2 * BS * H_KV * D].unflatten(1, (per_page, 2, BS, H_KV, D))
    params = AttentionParams(
        scale=1 / math.sqrt(D), sliding_window=5 if feature == "window" else None,
        chunk_size=8 if feature == "chunk" else None,
        softcap=3.0 if feature == "softcap" else None,
        sinks=torch.randn(H_Q) if feature == "sinks" else None)
    # Three requests: one decoding (context 19 -> 20), a prompt chunk of 6 at 7..12, and a
    # chunk of 19 at 3..21 (longer than the window and crossing chunks: queries in blocks).
    lens, new = [20, 13, 22], [1, 6, 19]
    tables = [[5, 9, 14], [30, 4], [7, 20, 33]]  # manager block ids (page = id // per_page)
    if layout == "flat":
        tables = [[5, 9, 11], [10, 4], [1, 2, 3]]
    check_paged_attention(kv, per_page, kernel_block, params, lens, new, tables, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kernel_block", [BS, BS // 2])
@pytest.mark.parametrize("feature", ["plain", "window", "softcap", "sinks"])
def test_a_mixed_batch_attends_in_batches(kernel_block, feature, backend):
    """Decodes, prompt chunks of near lengths (one padded batch), a short chunk (a batch of
    its own) and, with a window, a chunk longer than it (alone): every token as dense."""
    torch.manual_seed(1)
    per_page, num_pages = 3, 14
    kv = torch.zeros(num_pages, per_page, 2, BS, H_KV, D)
    params = AttentionParams(
        scale=1 / math.sqrt(D), sliding_window=7 if feature == "window" else None,
        softcap=3.0 if feature == "softcap" else None,
        sinks=torch.randn(H_Q) if feature == "sinks" else None)
    lens, new = [9, 17, 6, 11, 14, 3, 20], [1, 1, 6, 5, 4, 2, 12]
    tables = [[1, 2], [3, 4, 5], [6], [7, 8], [9, 10], [11], [12, 13, 14]]
    meta = check_paged_attention(kv, per_page, kernel_block, params, lens, new, tables,
                                 backend)
    # [query slots per request] of each call: the decodes; the 12-token chunk; the chunks of
    # 6, 5 and 4 padded to 6; the 2-token chunk. With the window of 7, the 12 goes alone.
    batches, alone = meta.plan(params.sliding_window, params.chunk_size)
    shapes = [tuple(b.tokens.shape) for b in batches]
    if feature == "window":
        assert shapes == [(2, 1), (3, 6), (1, 2)] and alone == [6]
    else:
        assert shapes == [(2, 1), (1, 12), (3, 6), (1, 2)] and alone == []


@pytest.mark.parametrize("feature", ["plain", "window", "chunk", "softcap", "sinks"])
def test_in_place_kernel_over_long_contexts(feature):
    """Decode steps and short chunks over contexts across the kernel's 32-key tiles (the
    running softmax rescales between tiles), two query heads per KV head."""
    torch.manual_seed(2)
    per_page = 2
    kv = torch.zeros(40, per_page, 2, BS, H_KV, D)
    params = AttentionParams(
        scale=1 / math.sqrt(D), sliding_window=37 if feature == "window" else None,
        chunk_size=24 if feature == "chunk" else None,
        softcap=2.0 if feature == "softcap" else None,
        sinks=torch.randn(H_Q) if feature == "sinks" else None)
    lens, new = [1, 32, 33, 65, 100, 71], [1, 1, 1, 1, 3, 16]
    tables, next_block = [], 0
    for n in lens:
        tables.append(list(range(next_block, next_block + -(-n // BS))))
        next_block += len(tables[-1])
    check_paged_attention(kv, per_page, BS, params, lens, new, tables, "cpu")


def check_paged_attention(kv, per_page, kernel_block, params, lens, new, tables,
                          backend="torch"):
    """Requests with contexts `lens`, the last `new` tokens of each scheduled this step,
    blocks from `tables`: the backend's output equals dense attention, token by token."""
    keys_all = [torch.randn(n, H_KV, D) for n in lens]
    values_all = [torch.randn(n, H_KV, D) for n in lens]
    for r, (table, n) in enumerate(zip(tables, lens, strict=True)):  # past tokens, by hand
        for pos in range(n - new[r]):
            b = table[pos // BS]
            kv[b // per_page, b % per_page, 0, pos % BS] = keys_all[r][pos]
            kv[b // per_page, b % per_page, 1, pos % BS] = values_all[r][pos]
    meta = paged_metadata(tables, lens, new, per_page, kernel_block)
    loc = meta.query_start_loc
    q = torch.randn(loc[-1], H_Q, D)
    k_new = torch.cat([k[-m:] for k, m in zip(keys_all, new, strict=True)])
    v_new = torch.cat([v[-m:] for v, m in zip(values_all, new, strict=True)])
    out = get_backend(backend).forward(q, k_new, v_new, kv, meta, params)
    expect = torch.cat([
        dense(q[loc[r]:loc[r + 1]], keys_all[r], values_all[r],
              torch.arange(lens[r] - new[r], lens[r]), params) for r in range(len(lens))])
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
    # And as one group of layers sees it: a second layer reusing the step's plan.
    torch.testing.assert_close(get_backend(backend).forward(q, None, None, kv, meta, params),
                               expect, atol=1e-5, rtol=1e-5)
    return meta


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(ValueError,
                       match="unknown attention backend 'flash'; available: auto, cpu, torch"):
        get_backend("flash")
    assert isinstance(get_backend("torch"), TorchReferenceBackend)
    assert type(get_backend("auto", "cpu")).__name__ == "CPUPagedBackend"
    assert type(get_backend("auto", "meta")) is TorchReferenceBackend
    with pytest.raises(ValueError, match="attention backend 'cpu' runs on CPU devices"):
        get_backend("cpu", "meta")


def paged_metadata(tables, lens, new, per_page, kernel_block):
    """Metadata of requests with manager blocks `tables`, contexts `lens`, the last `new`
    tokens of each scheduled this step."""
    k_per = BS // kernel_block
    width = max(len(t) for t in tables) * k_per + 2
    kernel_table = torch.tensor([[b * k_per + j for b in t for j in range(k_per)]
                                 + [0] * (width - len(t) * k_per) for t in tables])
    slots = [table[p // BS] * BS + p % BS for table, n, m in zip(tables, lens, new, strict=True)
             for p in range(n - m, n)]
    loc = [0]
    for m in new:
        loc.append(loc[-1] + m)
    return AttentionMetadata(query_start_loc=loc, seq_lens=lens, block_table=kernel_table,
                             slot_mapping=torch.tensor(slots), block_size=BS,
                             kernel_block_size=kernel_block, blocks_per_page=per_page)


@pytest.mark.parametrize("path", ["C kernel", "C kernel, 2 threads", "torch"])
@pytest.mark.parametrize(("length", "kv_heads", "value_dim", "scale"), [
    (2 * CAUSAL_TILE, 2, 24, 0.2), (3 * CAUSAL_TILE + 17, 2, 24, 0.2),
    (3 * CAUSAL_TILE + 17, 1, 80, 0.2),  # one KV head: its output rows written in place
    (2 * CAUSAL_TILE + 5, 1, 64, 1.0)])  # scores in the tens: softmaxes near one-hot
def test_long_causal_prompts_in_query_tiles_equal_one_masked_softmax(length, kv_heads,
                                                                     value_dim, scale, path,
                                                                     monkeypatch):
    """The CPU's causal path for prompts from position 0 (linear.c's kernel: tiles of query
    rows over only the keys before them, query heads of a KV head stacked; or torch's query
    tiles) against a plain masked softmax: two prompts, grouped query heads, a length that is no
    multiple of the tile or a panel, value widths that are no multiple of a panel."""
    from hybridkv.worker.linear import cpu as cpu_linear

    calls = []
    if path == "torch":
        monkeypatch.setattr(cpu_linear, "attention_kernel", lambda: None)
    elif cpu_linear.attention_kernel() is None:
        pytest.skip("the linear kernel does not build here")
    else:
        real = cpu_linear.attention
        monkeypatch.setattr(cpu_linear, "attention",
                            lambda *a, **kw: calls.append(1) or real(*a, **kw))
    if path.endswith("2 threads"):
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(3)
    group = 4 // kv_heads
    q = torch.randn(2, length, 4, 32, generator=gen)
    keys = torch.randn(2, length, kv_heads, 32, generator=gen)
    values = torch.randn(2, length, kv_heads, value_dim, generator=gen)
    try:
        out = _attend_padded(q, keys, values, None, AttentionParams(scale=scale))
    finally:
        if path.endswith("2 threads"):
            torch.set_num_threads(threads)
    assert len(calls) == (0 if path == "torch" else 2 * kv_heads)
    k = keys.repeat_interleave(group, dim=2)
    v = values.repeat_interleave(group, dim=2)
    scores = torch.einsum("pqhd,plhd->phql", q.double(), k.double()) * scale
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    ref = torch.einsum("phql,plhd->pqhd", probs, v.double())
    # float32 scores carry ~1e-7 of their size: larger scores, larger error in the weights
    torch.testing.assert_close(out.double(), ref, atol=2e-6 * max(1.0, 5 * scale), rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("num_q", "q_start", "key_start", "num_keys", "window", "chunk"), [
    (300, 0, 0, 300, None, None),  # a whole prompt
    (300, 0, 0, 300, 100, None),  # ... of a sliding layer, longer than its window
    (90, 210, 0, 300, 100, None),  # a chunk after a cached prefix
    (90, 210, 64, 236, 100, None),  # ... its keys gathered from the window's first block
    (200, 100, 96, 204, None, 64),  # chunked attention
    (17, 283, 0, 300, None, None),  # a short chunk over a long context
    (40, 0, 0, 70, None, None)])  # padded keys past the last query
def test_attention_tiles_in_c_equal_a_masked_softmax(num_q, q_start, key_start, num_keys,
                                                      window, chunk, threads):
    """linear.c's attention over keys at positions key_start.., queries at q_start.., each
    over exactly the keys its position, window and chunk allow, against a masked softmax in
    float64: grouped query heads (3 per KV head), widths that are no multiple of a panel,
    rows left out for padding untouched."""
    from hybridkv.worker.attention.backend import _c_tiles
    from hybridkv.worker.linear import cpu as cpu_linear

    if cpu_linear.attention_kernel() is None:
        pytest.skip("the linear kernel does not build here")
    gen = torch.Generator().manual_seed(num_q + q_start)
    q = torch.randn(2, num_q + 3, 6, 40, generator=gen)  # 3 padding rows
    keys = torch.randn(2, num_keys, 2, 40, generator=gen)
    values = torch.randn(2, num_keys, 2, 72, generator=gen)
    params = AttentionParams(scale=0.3, sliding_window=window, chunk_size=chunk)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = _c_tiles(q, keys, values, params, [q_start] * 2, [key_start] * 2, [num_q] * 2)
    finally:
        torch.set_num_threads(before)
    q_pos = torch.arange(q_start, q_start + num_q)[:, None]
    k_pos = torch.arange(key_start, key_start + num_keys)[None, :]
    ok = k_pos <= q_pos
    if window:
        ok &= q_pos - k_pos < window
    if chunk:
        ok &= k_pos // chunk == q_pos // chunk
    scores = torch.einsum("pqhd,plhd->phql", q[:, :num_q].double(),
                          keys.repeat_interleave(3, dim=2).double()) * 0.3
    probs = scores.masked_fill(~ok, float("-inf")).softmax(-1)
    ref = torch.einsum("phql,plhd->pqhd", probs, values.repeat_interleave(3, dim=2).double())
    torch.testing.assert_close(out[:, :num_q].double(), ref, atol=4e-6, rtol=1e-5)


def test_attention_tiles_in_c_refuse_queries_their_keys_do_not_cover():
    from hybridkv.worker.linear import cpu as cpu_linear

    if cpu_linear.attention_kernel() is None:
        pytest.skip("the linear kernel does not build here")
    keys = torch.randn(64, 32)
    k_panels, _ = cpu_linear.pack(keys, None)
    v_panels = cpu_linear.pack(keys.t(), None)[0]
    with pytest.raises(ValueError, match="positions the keys cover"):
        cpu_linear.attention(torch.randn(16, 32), 1, k_panels, 64, v_panels,
                             torch.empty(16, 32), q_start=60)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize(("lens", "new"), [([100], [45]),  # one prompt: split by queries
                                           ([100, 20, 9, 33], [45, 1, 9, 1])])
def test_the_in_place_kernel_gives_one_threads_bytes_at_any_thread_count(lens, new, threads):
    """The paged kernel splits a step's queries over threads (runs of a request's queries):
    every output row is the bytes one thread gives it, a lone prompt included."""
    from hybridkv.worker.attention import cpu as cpu_attention

    torch.manual_seed(5)
    kv = torch.zeros(40, 2, 2, BS, H_KV, D)
    tables, next_block = [], 0
    for n in lens:
        tables.append(list(range(next_block, next_block + -(-n // BS))))
        next_block += len(tables[-1])
    for r, (table, n) in enumerate(zip(tables, lens, strict=True)):
        for pos in range(n - new[r]):
            b = table[pos // BS]
            kv[b // 2, b % 2, :, pos % BS] = torch.randn(2, H_KV, D)
    meta = paged_metadata(tables, lens, new, 2, BS)
    assert cpu_attention.max_query(meta) >= max(new)  # every query takes the paged kernel
    q = torch.randn(sum(new), H_Q, D)
    k_new, v_new = torch.randn(sum(new), H_KV, D), torch.randn(sum(new), H_KV, D)
    params = AttentionParams(scale=1 / math.sqrt(D), sliding_window=37)
    before, outs = torch.get_num_threads(), []
    try:
        for t in (1, threads):
            torch.set_num_threads(t)
            outs.append(get_backend("cpu").forward(q, k_new, v_new, kv.clone(), meta, params))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
