"""`speculative_config`, with vLLM's field names, checked when the engine is built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from hybridkv.sched.checks import check_int

# Methods this engine runs; `make_proposer` has one proposer per name.
METHODS = ("ngram",)
# Methods users of other engines may name, with why they are refused here.
_NOT_HERE = {
    "draft_model": "draft models are not supported yet",
    "mtp": "multi-token-prediction heads are not supported yet",
    "eagle": "EAGLE heads are not supported",
    "eagle3": "EAGLE heads are not supported",
    "medusa": "Medusa heads are not supported",
}


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """How drafts are made. `ngram` (prompt lookup): the longest n-gram, between
    `prompt_lookup_min` and `prompt_lookup_max` tokens, that ends the request's tokens and
    occurred earlier in them proposes the `num_speculative_tokens` tokens that followed it
    there (the latest such occurrence)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            why = _NOT_HERE.get(self.method) if isinstance(self.method, str) else None
            raise ValueError(f"speculative_config method {self.method!r}"
                             f"{': ' + why if why else ' is unknown'}; accepted: "
                             f"{', '.join(METHODS)}")
        check_int("speculative_config num_speculative_tokens", self.num_speculative_tokens,
                  low=1, high=64)
        check_int("speculative_config prompt_lookup_min", self.prompt_lookup_min, low=1)
        check_int("speculative_config prompt_lookup_max", self.prompt_lookup_max, low=1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min})"
                             f" must be <= prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def from_dict(cls, values: object) -> SpeculativeConfig:
        """From user input (a dict, or a SpeculativeConfig): unknown fields are an error
        naming the accepted ones. A dict without `method` is refused (vLLM would guess)."""
        if isinstance(values, SpeculativeConfig):
            return values
        if not isinstance(values, Mapping):
            raise ValueError(f"speculative_config must be a dict such as {{\"method\": "
                             f"\"ngram\", \"num_speculative_tokens\": 4}}, got "
                             f"{type(values).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in values if k not in known)
        if unknown:
            raise ValueError(f"unknown speculative_config field(s) {', '.join(unknown)}; "
                             f"accepted: {', '.join(known)}")
        if "method" not in values:
            raise ValueError(f"speculative_config needs a method; accepted: "
                             f"{', '.join(METHODS)}")
        options: dict[str, Any] = dict(values)
        return cls(**options)
