"""Sampling parameters of one request, checked when the request arrives."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = all tokens
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # return this many top logprobs per generated token
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.extra:
            raise ValueError(f"unknown sampling field(s) {', '.join(sorted(self.extra))}; "
                             f"accepted: {', '.join(accepted_fields())}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = all tokens), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SamplingParams:
        """From user input: unknown fields are an error naming the accepted ones."""
        known = set(accepted_fields())
        return cls(**{k: v for k, v in values.items() if k in known},
                   extra={k: v for k, v in values.items() if k not in known})


def accepted_fields() -> list[str]:
    return [f.name for f in fields(SamplingParams) if f.name != "extra"]
