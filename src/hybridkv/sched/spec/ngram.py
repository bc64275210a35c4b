"""Prompt lookup (n-gram) drafts: text that repeats its context (a file being edited, an
answer quoting its document, code renaming a variable) continues as it did before.

    tokens  ... a b c X Y Z ... a b c      (the last n = 3 tokens occurred before)
    drafts                    X Y Z        (what followed them there)

The longest suffix of `prompt_lookup_max` down to `prompt_lookup_min` tokens that occurred
earlier wins, at its latest earlier occurrence (nearby context predicts best). numpy over the
token history; no model code.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

# Only the latest tokens are searched: a match further back is rarely better, and the cost
# per step stays bounded however long the request grows.
SEARCH_WINDOW = 8192


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}, "
                             f"{max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        if num_tokens < 1 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids[-SEARCH_WINDOW:], dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. length - n - 1: every earlier occurrence, not the
            # suffix itself. E.g. [a b a b], n = 2 -> windows ab, ba; "ab" at 0 -> [a, b].
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if len(hits):
                return _continue(tokens, int(hits[-1]) + n, num_tokens)
        return []


def _continue(tokens: np.ndarray, start: int, num_tokens: int) -> list[int]:
    """The tokens that followed position `start`, as the continuation of the sequence: past
    its end they repeat the drafts themselves (a loop of period p keeps looping). E.g.
    [x y x y], start 2 -> [x y x y ...]."""
    drafts = [int(t) for t in tokens[start:start + num_tokens]]
    length = len(tokens)
    while len(drafts) < num_tokens:
        drafts.append(drafts[start + len(drafts) - length])
    return drafts
