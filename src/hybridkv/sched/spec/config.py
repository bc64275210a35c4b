"""`speculative_config`, with vLLM's field names, checked when the engine is built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from hybridkv.sched.checks import check_int

# Methods this engine runs. The scheduler's proposers (`make_proposer`) guess from the token
# history; a worker method's drafts come from a model the worker runs at the step's start,
# and the scheduler only reserves their slots.
SCHEDULER_METHODS = ("ngram",)
WORKER_METHODS = ("draft_model", "mtp")
METHODS = (*SCHEDULER_METHODS, *WORKER_METHODS)
# Methods users of other engines may name, with why they are refused here.
_NOT_HERE = {
    "eagle": "EAGLE heads are not supported",
    "eagle3": "EAGLE heads are not supported",
    "medusa": "Medusa heads are not supported",
}


MAX_SPECULATIVE_TOKENS = 64  # num_speculative_tokens' upper bound


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """How drafts are made. `ngram` (prompt lookup): the longest n-gram, between
    `prompt_lookup_min` and `prompt_lookup_max` tokens, that ends the request's tokens and
    occurred earlier in them proposes the `num_speculative_tokens` tokens that followed it
    there (the latest such occurrence). `draft_model`: `model` (a path or a known model's
    name), a smaller model with the target's vocabulary, proposes `num_speculative_tokens`
    tokens greedily each step. `mtp`: the target's own multi-token-prediction head (a
    checkpoint's `mtp.*` weights or a GGUF's `nextn` tensors) proposes them, recurrently."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # the draft model (method draft_model)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            why = _NOT_HERE.get(self.method) if isinstance(self.method, str) else None
            raise ValueError(f"speculative_config method {self.method!r}"
                             f"{': ' + why if why else ' is unknown'}; accepted: "
                             f"{', '.join(METHODS)}")
        check_int("speculative_config num_speculative_tokens", self.num_speculative_tokens,
                  low=1, high=MAX_SPECULATIVE_TOKENS)
        check_int("speculative_config prompt_lookup_min", self.prompt_lookup_min, low=1)
        check_int("speculative_config prompt_lookup_max", self.prompt_lookup_max, low=1)
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model.strip():
                raise ValueError("speculative_config method 'draft_model' needs a model: the "
                                 "draft model's path or name, e.g. {\"method\": "
                                 "\"draft_model\", \"model\": \"/models/small\"}")
        elif self.model is not None:
            raise ValueError(f"speculative_config model applies to method 'draft_model', not "
                             f"{self.method!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min})"
                             f" must be <= prompt_lookup_max ({self.prompt_lookup_max})")

    @property
    def drafts_in_worker(self) -> bool:
        """Whether drafts come from a model the worker runs (the scheduler reserves slots)."""
        return self.method in WORKER_METHODS

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
