"""The running top-k of the blocked LM head (worker/head/topk.py): the C kernel and the
torch fallback both give each row's k largest logits in order, equal values by ascending
id (k = 1 is torch.argmax), across blocks of any size, with NaN rows flagged."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv.worker.head import topk as head_topk  # noqa: E402


def reference(logits: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Sorted by (value descending, id ascending), the first k."""
    values, ids = [], []
    for row in logits.tolist():
        order = sorted(range(len(row)), key=lambda t: (-row[t], t))[:k]
        values.append([row[t] for t in order])
        ids.append(order)
    return values, ids


def run(logits: torch.Tensor, k: int, block: int) -> head_topk.HeadCandidates:
    top = head_topk.HeadTopK(logits.shape[0], k)
    transposed = logits.T.contiguous()  # the head's blocks are [vocab rows, batch rows]
    for r0 in range(0, transposed.shape[0], block):
        top.update(r0, transposed[r0:r0 + block])
    return top.result()


@pytest.fixture(params=["c", "torch"])
def kernel(request, monkeypatch):
    if request.param == "c":
        if head_topk._kernel() is None:
            pytest.skip("no C compiler")
    else:
        monkeypatch.setattr(head_topk, "_kernel", lambda: None)
    return request.param


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("cols", [1, 5, 8, 19])  # eight at a time, and a tail
def test_top_k_in_order_with_ties_by_id(kernel, k, cols):
    gen = torch.Generator().manual_seed(k * 100 + cols)
    # Few distinct values: ties everywhere, across blocks and inside them.
    logits = torch.randint(0, 6, (cols, 103), generator=gen).float()
    logits[0, 50:] = 9.0  # the first row's maximum tied 53 times, its first at id 50
    found = run(logits, k, block=16)
    values, ids = reference(logits, k)
    assert found.ids.tolist() == ids
    assert found.values.tolist() == values
    assert not found.nan.any()
    assert found.ids[:, 0].tolist() == torch.argmax(logits, dim=-1).tolist()
    assert found.ids[0, 0] == 50


def test_fewer_finite_logits_than_k_and_nan_rows(kernel):
    logits = torch.full((3, 40), float("-inf"))
    logits[0, [7, 30]] = torch.tensor([1.0, 2.0])
    logits[1] = torch.arange(40.0)
    logits[1, 13] = float("nan")
    logits[2, 5] = 0.5
    found = run(logits, 4, block=16)
    assert found.ids[0].tolist() == [30, 7, -1, -1]
    assert found.nan.tolist() == [False, True, False]
    assert found.ids[2].tolist() == [5, -1, -1, -1]
    # Row 2 lists every finite logit: its first candidate is known to be the best.
    assert found.complete(2, 0) and found.complete(0, 1)


def test_a_candidate_tied_with_the_last_listed_is_not_complete(kernel):
    # Tokens 2, 3, 4 tie; with k = 2 the list holds 0 and 2: a grammar that refuses 0 may
    # allow 3, which a kept 2 does not rule out... unless 2 beats the last listed value.
    logits = torch.tensor([[5.0, 1.0, 3.0, 3.0, 3.0]])
    found = run(logits, 2, block=2)
    assert found.ids[0].tolist() == [0, 2]
    assert found.complete(0, 0)
    assert not found.complete(0, 1)
