"""The k largest logits of each batch row, kept while the LM head is computed a block of
the vocabulary at a time (models/base.py: head_candidates).

k = 1 is a greedy step's argmax; a larger k gives structured output's greedy rows their
candidates in order, so a row whose best token the grammar allows never needs its mask
(worker/model_runner.py, `_greedy_step`). The [rows, vocab] logits are never written."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridkv.worker import native


@dataclass
class HeadCandidates:
    values: torch.Tensor  # [N, k] float32, descending; among equal values, ascending id
    ids: torch.Tensor  # [N, k] int64 (-1 where fewer than k finite logits were seen)
    nan: torch.Tensor  # [N] bool: the row has a NaN logit (its candidates mean nothing)

    def complete(self, row: int, j: int) -> bool:
        """Whether every token with a logit >= candidate j's is listed: j's value beats
        the last listed one (a token tied with the last may have been left out)."""
        return bool(self.values[row, j] > self.values[row, -1]) or \
            bool(self.ids[row, -1] < 0 and self.ids[row, j] >= 0)


class HeadTopK:
    """Running top-k of each of N rows; update() with each block (r0, y [n, N]) in
    vocabulary order, then result()."""

    def __init__(self, rows: int, k: int) -> None:
        self.k = k
        self.values = torch.full((rows, k), float("-inf"))
        self.ids = torch.full((rows, k), -1, dtype=torch.int64)
        self.nan = torch.zeros(rows, dtype=torch.uint8)
        self._last = torch.full((rows,), float("-inf"))
        self._kernel = _kernel()

    def update(self, r0: int, y: torch.Tensor) -> None:
        n, cols = y.shape
        if self._kernel is not None and y.stride(1) == 1:
            self._kernel(y.data_ptr(), n, cols, y.stride(0), r0, self.k,
                         self.values.data_ptr(), self.ids.data_ptr(), self.nan.data_ptr(),
                         self._last.data_ptr())
            return
        # Without the C kernel: the block's first k by a stable sort (torch.topk may take
        # any of equal values), then a stable merge: the kept ones, all of lower ids, stay
        # ahead of equal values from the block.
        self.nan |= y.isnan().any(dim=0).to(torch.uint8)
        block = y.T.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
        top = torch.sort(block, dim=1, descending=True, stable=True)
        values = torch.cat([self.values, top.values[:, :self.k]], dim=1)
        ids = torch.cat([self.ids, top.indices[:, :self.k] + r0], dim=1)
        order = torch.sort(values, dim=1, descending=True, stable=True).indices[:, :self.k]
        self.values = values.gather(1, order)
        self.ids = torch.where(self.values == float("-inf"), -1, ids.gather(1, order))

    def result(self) -> HeadCandidates:
        return HeadCandidates(self.values, self.ids, self.nan.bool())


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# y, rows, cols, its row stride, r0, k, values, ids, nan flags, the last values
_ARGTYPES = [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR]


def _kernel() -> Callable[..., None] | None:
    """The C kernel (worker/native/head_topk.c), None where it cannot be built."""
    fn: Callable[..., None] | None = native.function("head_topk", "hkv_head_topk", _ARGTYPES)
    return fn
