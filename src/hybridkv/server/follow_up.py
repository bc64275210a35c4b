"""How long the engine thread holds its next step for a client's next request.

Agent loops and chat clients send their next request the moment an answer ends, with the
whole conversation again. It reaches the server a few milliseconds after the last token
(measured here: 6-7 ms on loopback, HTTP and tokenization included), by which time the
engine has started its next step, and it waits for that step to end before it can be
scheduled: the length of a prompt chunk, 50-70 ms on one CPU core at a 96-128 token
budget. Holding the next step for a few milliseconds after a step that ended a request
lets the follow-up join it. The hold ends as soon as any request arrives.

The hold costs every running request its length, so it adapts: it keeps holding while
holds are mostly met by a new request, and otherwise stops, trying again every
`probe_every`-th time, so a workload whose clients do not come straight back (batch jobs,
one-shot requests) loses at most one hold in `probe_every` ends.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_WAIT_MS = 10.0


@dataclass
class FollowUpWait:
    """`timeout()` before a hold (None: do not hold), `record(arrived)` after it."""

    wait_s: float = DEFAULT_WAIT_MS / 1000
    min_hit_rate: float = 0.25  # below this share of recent holds met, holding stops
    probe_every: int = 16
    smoothing: float = 0.2  # weight of the newest hold in the running share (~5 holds)
    hit_rate: float = 1.0  # start by holding: a conversation's first ends already count
    holds: int = 0
    hits: int = 0
    _skipped: int = 0

    def __post_init__(self) -> None:
        if not self.wait_s >= 0:
            raise ValueError(f"the follow-up wait must be >= 0 seconds, got {self.wait_s}")

    def timeout(self) -> float | None:
        """Seconds to hold for a request now, or None (off, or holds are not paying)."""
        if self.wait_s <= 0:
            return None
        if self.hit_rate < self.min_hit_rate:
            self._skipped += 1
            if self._skipped < self.probe_every:
                return None
        self._skipped = 0
        return self.wait_s

    def record(self, arrived: bool) -> None:
        """A hold ended: a request arrived within it, or it ran out."""
        self.holds += 1
        self.hits += arrived
        self.hit_rate += self.smoothing * (float(arrived) - self.hit_rate)
