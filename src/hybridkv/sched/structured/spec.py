"""What a request's output must follow: exactly one of a JSON schema, any JSON object, a
regular expression, a choice list or a grammar (Lark, or llama.cpp's GBNF)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, kw_only=True)
class StructuredOutput:
    # A JSON schema as a dict (or its JSON text). Keywords the grammar library cannot
    # enforce fail the request rather than being dropped.
    json_schema: Mapping[str, Any] | str | None = field(default=None, hash=False)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # the output is exactly one of these
    grammar: str | None = None  # Lark or GBNF (llama.cpp's grammar files)

    def __post_init__(self) -> None:
        chosen = [name for name in _KINDS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            got = ", ".join(chosen) if chosen else "none"
            raise ValueError(f"structured_output must set exactly one of "
                             f"{', '.join(_KINDS)}; got {got}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_output.json_object must be True or False, got "
                             f"{self.json_object!r}")
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _schema(self.json_schema))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_output.{name} must be a non-empty string, got "
                                 f"{value!r}")
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))

    @property
    def kind(self) -> str:
        return next(name for name in _KINDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> str:
        """One text per distinct spec: equal specs share one compiled grammar."""
        value: Any = getattr(self, self.kind)
        return json.dumps([self.kind, value], sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_value(cls, value: object) -> StructuredOutput:
        """A StructuredOutput, or a dict of its fields (unknown ones are an error)."""
        if isinstance(value, StructuredOutput):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"structured_output must be a StructuredOutput or a dict with "
                             f"one of {', '.join(_KINDS)}, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ValueError(f"unknown structured_output field(s) {', '.join(unknown)}; "
                             f"accepted: {', '.join(_KINDS)}")
        return cls(**value)


def _schema(schema: object) -> dict[str, Any]:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"structured_output.json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, Mapping):
        raise ValueError(f"structured_output.json_schema must be a JSON object (a dict), got "
                         f"{type(schema).__name__}")
    try:
        # A deep copy that is plain JSON: the caller's dict may change later, and a value
        # JSON cannot hold (a set, a function) is refused here rather than in a step.
        copied: dict[str, Any] = json.loads(json.dumps(dict(schema)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_output.json_schema is not plain JSON: {e}") from None
    return copied


def _choices(choice: object) -> tuple[str, ...]:
    if isinstance(choice, (str, bytes)) or not isinstance(choice, Iterable):
        raise ValueError(f"structured_output.choice must be a list of strings, got "
                         f"{choice!r}")
    items = tuple(choice)
    if not items:
        raise ValueError("structured_output.choice must not be empty")
    for item in items:
        if not isinstance(item, str) or not item:
            raise ValueError(f"structured_output.choice must hold non-empty strings, got "
                             f"{item!r}")
    return items
