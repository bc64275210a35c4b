"""Sampling parameters of one request, checked when the request arrives."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from hybridkv.sched.checks import check_bool, check_int, check_number

# Below this a softmax over float32 logits is an argmax anyway, and dividing by it overflows
# (vLLM treats it as greedy too).
_MIN_TEMPERATURE = 1e-5


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
        # Everything is checked here, at admission: a value that passed must never fail
        # inside a step, where it would take the batch down with it.
        if self.extra:
            raise ValueError(f"unknown sampling field(s) {', '.join(sorted(self.extra))}; "
                             f"accepted: {', '.join(accepted_fields())}")
        check_int("max_tokens", self.max_tokens, low=1)
        temperature = check_number("temperature", self.temperature, low=0.0)
        object.__setattr__(self, "temperature", 0.0 if temperature < _MIN_TEMPERATURE
                           else temperature)
        check_int("top_k", self.top_k, low=0, what="an integer >= 0 (0 = all tokens)")
        top_p = check_number("top_p", self.top_p, low=0.0)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "top_p", top_p)
        if self.seed is not None:
            check_int("seed", self.seed, low=0, high=2**64 - 1,
                 what="an integer in [0, 2**64) or None")
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, low=0, what="an integer >= 0 or None")
        check_bool("ignore_eos", self.ignore_eos)
        stop_ids = self.stop_token_ids
        if isinstance(stop_ids, (str, bytes)) or not isinstance(stop_ids, Iterable):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {stop_ids!r}")
        stop_ids = tuple(stop_ids)
        for token in stop_ids:
            check_int("stop_token_ids", token, low=0, what="a list of integers >= 0")
        object.__setattr__(self, "stop_token_ids", stop_ids)
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, bytes) or not isinstance(stop, Iterable):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        stop = tuple(stop)
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must be a string or a list of strings, got {s!r} "
                                 f"({type(s).__name__}) in it")
            if not s:
                raise ValueError("stop strings must not be empty")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SamplingParams:
        """From user input: unknown fields are an error naming the accepted ones."""
        if not isinstance(values, Mapping):
            raise ValueError(f"sampling params must be a SamplingParams or a dict of its "
                             f"fields, got {type(values).__name__}")
        known = set(accepted_fields())
        return cls(**{k: v for k, v in values.items() if k in known},
                   extra={k: v for k, v in values.items() if k not in known})



def accepted_fields() -> list[str]:
    return [f.name for f in fields(SamplingParams) if f.name != "extra"]
