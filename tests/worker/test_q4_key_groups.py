"""q4 K/V pages (kv/spec.py `q4_kv_layout`): keys quantized per channel over groups of 16
tokens, their (scale, minimum) pairs spread over the group's K and V row tails; values per
token, symmetric nibbles of Hadamard-rotated groups. The bytes against a numpy reference of
the layout, the writes against the staging they need (a group is quantized once whole), and
the in-place CPU kernel against the torch path, including queries whose own group is not
whole yet (read in full precision)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hybridkv.kv.spec import KEY_GROUP, FullAttentionSpec, q4_kv_layout  # noqa: E402
from hybridkv.worker.attention.backend import (  # noqa: E402
    AttentionMetadata,
    AttentionParams,
    TorchReferenceBackend,
)
from hybridkv.worker.attention.kv_quant import (  # noqa: E402
    dequantize_key_groups,
    dequantize_values_q4,
    quantize_key_groups,
    quantize_values_q4,
)
from tests.worker.test_kv_quant import hadamard32  # noqa: E402

HEAD_SIZES = (16, 40, 64, 80, 128, 256)


def nibbles(row: np.ndarray, dim: int) -> np.ndarray:
    """A row's 4-bit values: per group of 32, byte i holds value i (low) and i + 16 (high);
    a tail group of n holds value i and i + ceil(n / 2)."""
    out = np.zeros(dim, np.int64)
    for lo in range(0, dim, 32):
        n = min(32, dim - lo)
        half = -(-n // 2)
        b = row[lo // 2:lo // 2 + half].astype(np.int64)
        out[lo:lo + n] = np.concatenate([b & 15, b >> 4])[:n]
    return out


def reference_keys(k_rows: np.ndarray, v_rows: np.ndarray, dim: int) -> np.ndarray:
    """A group's keys [16, D] from its K and V rows [16, row], by the layout's words."""
    lay = q4_kv_layout(dim)
    share = np.concatenate([np.concatenate([k_rows[i, lay.nibbles:lay.nibbles + lay.k_tail],
                                            v_rows[i, lay.v_bytes:lay.v_bytes + lay.v_tail]])
                            for i in range(KEY_GROUP)])
    pairs = share.view(np.float16).astype(np.float64).reshape(-1, 2)[:dim]
    return np.stack([nibbles(k_rows[i], dim) * pairs[:, 0] + pairs[:, 1]
                     for i in range(KEY_GROUP)])


def reference_values(v_row: np.ndarray, dim: int) -> np.ndarray:
    groups = -(-dim // 32)
    scales = v_row[:2 * groups].view(np.float16).astype(np.float64)
    vals = (nibbles(v_row[2 * groups:], dim) - 8).astype(np.float64)
    out = np.zeros(dim)
    for g in range(groups):
        lo, n = 32 * g, min(32, dim - 32 * g)
        out[lo:lo + n] = vals[lo:lo + n] * scales[g]
        if n == 32:
            out[lo:lo + n] = hadamard32() @ out[lo:lo + n]
    return out


@pytest.mark.parametrize("dim", HEAD_SIZES)
def test_key_groups_decode_as_the_layout_says(dim):
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(3, KEY_GROUP, 2, dim, generator=gen) * 2 + \
        torch.randn(dim, generator=gen) * 10  # per-channel offsets, as RoPE'd keys have
    k_rows, v_tails = quantize_key_groups(x)
    lay = q4_kv_layout(dim)
    assert k_rows.shape == (3, KEY_GROUP, 2, lay.row) and v_tails.shape[-1] == lay.v_tail
    v_rows = torch.zeros(3, KEY_GROUP, 2, lay.row, dtype=torch.uint8)
    v_rows[..., lay.v_bytes:lay.v_bytes + lay.v_tail] = v_tails
    ours = dequantize_key_groups(k_rows.flatten(0, 1), v_rows.flatten(0, 1), dim)
    ours = ours.unflatten(0, (3, KEY_GROUP)).double()
    for n in range(3):
        for h in range(2):
            ref = reference_keys(k_rows[n, :, h].numpy(), v_rows[n, :, h].numpy(), dim)
            np.testing.assert_allclose(ours[n, :, h].numpy(), ref, rtol=1e-6, atol=1e-5)
    # Per channel the error is at most half a step of that channel's range / 15.
    step = (x.amax(1, keepdim=True) - x.amin(1, keepdim=True)) / 15
    assert bool(((ours - x).abs() <= step / 2 + 1e-2 * step + 1e-3).all())


@pytest.mark.parametrize("dim", HEAD_SIZES)
def test_values_decode_as_the_layout_says(dim):
    x = torch.randn(20, dim, generator=torch.Generator().manual_seed(dim)) * 3
    rows = quantize_values_q4(x)
    assert rows.shape == (20, q4_kv_layout(dim).v_bytes)
    ours = dequantize_values_q4(rows, dim).double().numpy()
    for i in range(20):
        np.testing.assert_allclose(ours[i], reference_values(rows[i].numpy(), dim),
                                   rtol=1e-5, atol=1e-5)
    assert float((torch.from_numpy(ours) - x).norm() / x.norm()) < 0.2


def test_a_shifted_share_or_swapped_nibbles_change_the_keys():
    x = torch.randn(1, KEY_GROUP, 1, 64) * 3
    k_rows, v_tails = quantize_key_groups(x)
    lay = q4_kv_layout(64)
    v_rows = torch.zeros(1, KEY_GROUP, 1, lay.row, dtype=torch.uint8)
    v_rows[..., lay.v_bytes:] = v_tails
    good = dequantize_key_groups(k_rows[0], v_rows[0], 64)
    swapped = k_rows.clone()
    swapped[..., :lay.nibbles] = (k_rows[..., :lay.nibbles] >> 4) | \
        ((k_rows[..., :lay.nibbles] & 15) << 4)
    assert not torch.allclose(dequantize_key_groups(swapped[0], v_rows[0], 64), good)
    rolled = k_rows.roll(1, dims=1)  # each token's share moved to the next row
    rolled[..., :lay.nibbles] = k_rows[..., :lay.nibbles]
    assert not torch.allclose(dequantize_key_groups(rolled[0], v_rows[0], 64), good)


def test_q4_pages_hold_at_least_six_times_the_float32_tokens():
    for dim in (64, 128, 256):
        f32 = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=dim,
                                dtype="float32")
        q4 = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=dim,
                               dtype="float32", cache_dtype="q4")
        assert f32.page_size_bytes / q4.page_size_bytes >= 6.0


def test_q4_refuses_blocks_that_split_a_key_group():
    with pytest.raises(ValueError, match="multiple of 16, got 8"):
        FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=64, dtype="float32",
                          cache_dtype="q4")


# ------------------------------------------------------------ writes, reads and the kernel

class Pages:
    """One layer's q4 K/V pages [blocks, 1, 2, block, Hk, row] with requests' block tables
    and staging, written step by step through the torch backend."""

    def __init__(self, heads_kv: int, dim: int, num_blocks: int, seqs: int, gen):
        self.heads_kv, self.dim, self.block = heads_kv, dim, 16
        lay = q4_kv_layout(dim)
        self.cache = torch.zeros(num_blocks, 1, 2, self.block, heads_kv, lay.row,
                                 dtype=torch.uint8)
        self.staging = torch.zeros(seqs, KEY_GROUP, heads_kv, dim)
        self.table = torch.stack([torch.randperm(num_blocks - 1, generator=gen)[:12] + 1
                                  for _ in range(seqs)])
        self.gen = gen

    def step(self, rows: list[int], computed: list[int], new: list[int]
             ) -> tuple[AttentionMetadata, torch.Tensor]:
        """Write `new[i]` tokens after `computed[i]` for request rows[i]; returns the
        metadata (with its fresh keys) and the keys written."""
        loc, slots = [0], []
        for r, c, n in zip(rows, computed, new, strict=True):
            loc.append(loc[-1] + n)
            for pos in range(c, c + n):
                slots.append(int(self.table[r, pos // self.block]) * self.block
                             + pos % self.block)
        meta = AttentionMetadata(
            query_start_loc=loc, seq_lens=[c + n for c, n in zip(computed, new, strict=True)],
            block_table=self.table[rows], slot_mapping=torch.tensor(slots),
            block_size=self.block, kernel_block_size=self.block, blocks_per_page=1,
            cache_dtype="q4", key_groups=True, staging={self.cache.data_ptr(): self.staging},
            stage_rows=rows)
        k = torch.randn(loc[-1], self.heads_kv, self.dim, generator=self.gen) * 2 + 1
        v = torch.randn(loc[-1], self.heads_kv, self.dim, generator=self.gen)
        TorchReferenceBackend().write(k, v, self.cache, meta, AttentionParams(scale=1.0))
        return meta, k


def test_a_group_is_quantized_once_whole_from_its_staged_keys():
    """Tokens of one group written over three steps give the bytes of the group written at
    once; before it is whole its K rows are not written at all."""
    gen = torch.Generator().manual_seed(0)
    one = Pages(2, 64, 8, 1, gen)
    meta, k = one.step([0], [0], [32])
    chunks = Pages(2, 64, 8, 1, gen)
    pieces = [(0, 5), (5, 9), (14, 18)]  # the last write completes the second group
    for start, n in pieces:
        loc_meta = AttentionMetadata(
            query_start_loc=[0, n], seq_lens=[start + n], block_table=one.table[[0]],
            slot_mapping=torch.tensor([int(one.table[0, p // 16]) * 16 + p % 16
                                       for p in range(start, start + n)]),
            block_size=16, kernel_block_size=16, blocks_per_page=1, cache_dtype="q4",
            key_groups=True, staging={chunks.cache.data_ptr(): chunks.staging},
            stage_rows=[0])
        v = torch.zeros(n, 2, 64)
        before = chunks.cache[one.table[0, 1], 0, 0].clone()
        TorchReferenceBackend().write(k[start:start + n], v, chunks.cache, loc_meta,
                                      AttentionParams(scale=1.0))
        if start + n < 32:  # the second group is not whole: its K rows stay unwritten
            assert torch.equal(chunks.cache[one.table[0, 1], 0, 0], before)
    block = one.table[0, :2]
    assert torch.equal(chunks.cache[block, 0, 0], one.cache[block, 0, 0])
    lay = q4_kv_layout(64)
    assert torch.equal(chunks.cache[block, 0, 1, ..., lay.v_bytes:],
                       one.cache[block, 0, 1, ..., lay.v_bytes:])


@pytest.mark.parametrize("heads, heads_kv, dim", [(4, 1, 256), (9, 3, 64), (2, 2, 80),
                                                  (4, 2, 40)])
@pytest.mark.parametrize("window, softcap", [(None, None), (20, 30.0)])
def test_the_kernel_reads_q4_pages_as_the_torch_path(heads, heads_kv, dim, window, softcap):
    from hybridkv.worker import native
    from hybridkv.worker.attention import cpu as cpu_attention

    try:
        backend = cpu_attention.CPUPagedBackend()
    except native.NativeBuildError as e:
        pytest.skip(str(e))
    gen = torch.Generator().manual_seed(dim + heads)
    pages = Pages(heads_kv, dim, 40, 3, gen)
    # A context written before (its last group unfinished in two of them), then a decode
    # query in each of the first two and a chunk of 6 crossing a group boundary in the last.
    pages.step([0, 1, 2], [0, 0, 0], [149, 36, 14])
    meta, _ = pages.step([0, 1, 2], [149, 36, 14], [1, 1, 6])
    q = torch.randn(8, heads, dim, generator=gen)
    params = AttentionParams(scale=dim ** -0.5, sliding_window=window, softcap=softcap)
    expected = TorchReferenceBackend().attend(q, pages.cache, meta, params)
    out = backend.forward(q, None, None, pages.cache, meta, params)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    # A query's own group is read from the fresh keys (full precision), the rest from the
    # pages: moving request 0's own-group keys moves its output only.
    fresh = meta.fresh[pages.cache.data_ptr()]
    fresh.keys[0, 149 - 144] += 3.0
    moved = backend.forward(q, None, None, pages.cache, meta, params)
    assert not torch.allclose(moved[0], out[0]) and torch.equal(moved[1:], out[1:])


@pytest.mark.parametrize("dim", (16, 40, 64, 80, 256))
def test_the_c_v_writer_writes_torchs_bytes(dim):
    """The CPU's C writer of q4 V rows and torch's operations give a slot the same bytes
    (ties at .5, zero groups, fp16-clamped scales), and leave the rows' tails (their key
    group's shares) and every other slot as they were."""
    from hybridkv.worker.attention import kv_quant

    if kv_quant._native("hkv_write_v_q4") is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(dim)
    lay = q4_kv_layout(dim)
    cache = torch.randint(0, 256, (5, 2, 2, 16, 3, lay.row), dtype=torch.uint8,
                          generator=gen)
    v = torch.randn(6, 3, dim, generator=gen) * 3
    v[0, 0] = 0.0
    v[1, 1] = torch.arange(dim) * 0.5 - dim / 4
    v[2, 2, 0] = 1e6
    slots = torch.tensor([3, 17, 40, 41, 100, 159])
    expected = cache.clone()
    blocks, offsets = slots // 16, slots % 16
    expected.narrow(-1, 0, lay.v_bytes)[blocks // 2, blocks % 2, 1, offsets] = \
        quantize_values_q4(v)
    assert kv_quant.write_v_q4(v, cache, slots, 16, 2)
    assert torch.equal(cache, expected)


def test_q4_rows_per_token_take_the_torch_path():
    """Pages of q4 rows per token (cross-attention's) are not what the kernel reads: the CPU
    backend leaves them to the torch path, which decodes them as written."""
    from hybridkv.worker import native
    from hybridkv.worker.attention import cpu as cpu_attention
    from hybridkv.worker.attention.kv_quant import quantize_rows

    try:
        backend = cpu_attention.CPUPagedBackend()
    except native.NativeBuildError as e:
        pytest.skip(str(e))
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(4, 16, 2, 64, generator=gen)
    v = torch.randn(4, 16, 2, 64, generator=gen)
    cache = torch.stack([quantize_rows(k, "q4"), quantize_rows(v, "q4")], 1)[:, None]
    meta = AttentionMetadata(query_start_loc=[0, 1], seq_lens=[50],
                             block_table=torch.tensor([[2, 0, 3, 1]]),
                             slot_mapping=torch.zeros(1, dtype=torch.int64), block_size=16,
                             kernel_block_size=16, blocks_per_page=1, cache_dtype="q4")
    q = torch.randn(1, 4, 64, generator=gen)
    params = AttentionParams(scale=0.125)
    torch.testing.assert_close(backend.forward(q, None, None, cache, meta, params),
                               TorchReferenceBackend().attend(q, cache, meta, params))
