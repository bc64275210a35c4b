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
        # Every earlier occurrence of the suffix ends at an earlier copy of the last token:
        # those positions alone are extended backwards, one token at a time (the prompt is
        # scanned once per step, not once per n-gram size). E.g. [a b a b]: the copy of b
        # at 1 matches "a b" (2 tokens) -> the tokens after it, [a, b].
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if not len(ends):
            return []
        matched = np.ones(len(ends), dtype=np.int64)
        for k in range(1, min(self.max_n, length - 1)):
            back = ends - k
            still = (matched == k) & (back >= 0)
            still[still] = tokens[back[still]] == tokens[length - 1 - k]
            if not still.any():
                break
            matched += still
        n = min(self.max_n, int(matched.max()))
        if n < self.min_n:
            return []
        # The longest suffix that occurred, at its latest occurrence.
        return _continue(tokens, int(ends[np.flatnonzero(matched >= n)[-1]]) + 1, num_tokens)


def _continue(tokens: np.ndarray, start: int, num_tokens: int) -> list[int]:
    """The tokens that followed position `start`, as the continuation of the sequence: past
    its end they repeat the drafts themselves (a loop of period p keeps looping). E.g.
    [x y x y], start 2 -> [x y x y ...]."""
    drafts = [int(t) for t in tokens[start:start + num_tokens]]
    length = len(tokens)
    while len(drafts) < num_tokens:
        drafts.append(drafts[start + len(drafts) - length])
    return drafts
