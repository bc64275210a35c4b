"""Checks of user-given values with one-line errors that name the value and what is accepted.
bool is an int subclass, but `max_tokens=True` or `max_num_seqs=False` is a mistake, not a
number, so booleans are refused where numbers are expected."""

from __future__ import annotations

import math


def check_int(name: str, value: object, *, low: int, high: int | None = None,
              what: str | None = None) -> int:
    accepted = what or (f"an integer >= {low}" if high is None
                        else f"an integer in [{low}, {high}]")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be {accepted}, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be {accepted}, got {value!r}")
    return value


def check_number(name: str, value: object, *, low: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < low:
        raise ValueError(f"{name} must be >= {low:g} (a finite number), got {value!r}")
    return float(value)


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
