"""Sampling parameters of one request, checked when the request arrives."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from hybridkv.sched.checks import check_bool, check_int, check_number
from hybridkv.sched.structured.spec import StructuredOutput

# Below this a softmax over float32 logits is an argmax anyway, and dividing by it overflows
# (vLLM treats it as greedy too).
_MIN_TEMPERATURE = 1e-5
MAX_N = 128  # samples per prompt
# Past these a float32 logit divided (or multiplied) by the penalty overflows to inf, or a
# zero logit times it is NaN, and the step cannot sample; a penalty of 1e4 already bans a
# token seen before.
MIN_REPETITION_PENALTY = 1e-4
MAX_REPETITION_PENALTY = 1e4


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = all tokens (-1, vLLM's spelling, is read as 0)
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # return this many top logprobs per generated token
    # n samples of one prompt: the prompt is computed once (the first sample's blocks are
    # prefix-cache hits for the others); sample i draws with seed + i.
    n: int = 1
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    # Penalties on tokens already seen, as OpenAI and vLLM define them: presence and
    # frequency (in [-2, 2]) subtract from the logits of generated tokens, once / per
    # occurrence; repetition (> 0, 1 = off) divides positive and multiplies negative
    # logits of tokens in the prompt or the output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict, hash=False)  # id -> added
    # The output follows a JSON schema, a regex, a choice or a grammar (a StructuredOutput,
    # or a dict of its fields); each of n samples follows it on its own.
    structured_output: StructuredOutput | None = None
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
        # -1 is vLLM's (and the routers' SGLang-era default's) spelling of "all tokens".
        check_int("top_k", self.top_k, low=-1,
                  what="an integer >= 0 (0 or -1 = all tokens)")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
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
        check_int("n", self.n, low=1, high=MAX_N)
        min_p = check_number("min_p", self.min_p, low=0.0)
        if min_p > 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        object.__setattr__(self, "min_p", min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = check_number(name, getattr(self, name), low=-2.0)
            if value > 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
            object.__setattr__(self, name, value)
        repetition = check_number("repetition_penalty", self.repetition_penalty, low=0.0)
        if not MIN_REPETITION_PENALTY <= repetition <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                             f"{MAX_REPETITION_PENALTY:g}] (1 = off, > 1 penalizes repeats), "
                             f"got {self.repetition_penalty!r}")
        object.__setattr__(self, "repetition_penalty", repetition)
        object.__setattr__(self, "logit_bias", _check_logit_bias(self.logit_bias))
        if self.structured_output is not None:
            object.__setattr__(self, "structured_output",
                               StructuredOutput.from_value(self.structured_output))
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

    @property
    def penalized(self) -> bool:
        """Whether the logits change with the tokens seen so far."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def plain_argmax(self) -> bool:
        """Greedy on the model's own logits: nothing to apply before the argmax."""
        return self.greedy and not self.penalized and not self.logit_bias

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample `index` of n: one sample, its own seed."""
        seed = None if self.seed is None else (self.seed + index) % 2**64
        return replace(self, n=1, seed=seed)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SamplingParams:
        """From user input: unknown fields are an error naming the accepted ones."""
        if not isinstance(values, Mapping):
            raise ValueError(f"sampling params must be a SamplingParams or a dict of its "
                             f"fields, got {type(values).__name__}")
        known = set(accepted_fields())
        return cls(**{k: v for k, v in values.items() if k in known},
                   extra={k: v for k, v in values.items() if k not in known})



def _check_logit_bias(bias: object) -> dict[int, float]:
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got "
                         f"{type(bias).__name__}")
    checked = {}
    for token, value in bias.items():
        # JSON object keys are strings: "50256" is token 50256, as OpenAI reads it.
        if isinstance(token, str) and token.isdecimal():
            token = int(token)
        check_int("logit_bias", token, low=0, what="a dict whose keys are token ids >= 0")
        number = check_number(f"logit_bias[{token}]", value, low=-100.0)
        if number > 100.0:
            raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {value!r}")
        checked[token] = number
    return checked


def accepted_fields() -> list[str]:
    return [f.name for f in fields(SamplingParams) if f.name != "extra"]
