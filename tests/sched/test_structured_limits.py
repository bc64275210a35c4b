"""limits.py on its own: which schemas match no value (refused) and which recursive ones have
a way out (accepted), the size and depth limits, and the grammar's rule count. llguidance
compiles every refused schema below but the last without complaint;
tests/server/test_hostile_input.py sends the same kinds over HTTP."""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.sched.structured.limits import (
    MAX_GRAMMAR_RULES,
    MAX_OBJECT_PROPERTIES,
    check_grammar,
    check_schema,
)

NODE = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}


@pytest.mark.parametrize(("schema", "says"), [
    ({"$ref": "#"}, "'#' would have to contain another"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
      "$ref": "#/$defs/a"}, "'#/$defs/a'"),
    (NODE, "without end"),
    ({"allOf": [{"$ref": "#"}]}, "without end"),
    ({"type": "object", "additionalProperties": {"$ref": "#"}, "required": ["k"]},
     "without end"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "without end"),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"$ref": "#"}], "minItems": 2},
     "without end"),
    ({"anyOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}],
      "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}}},
     "without end"),
    ({"$defs": {"never": False}, "type": "object",
      "properties": {"x": {"$ref": "#/$defs/never"}}, "required": ["x"]},
     "'#/$defs/never' matches none"),
])
def test_a_schema_that_matches_nothing_is_refused(schema: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match="no JSON value matches the schema") as info:
        check_schema(schema)
    assert says in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}},
     "required": ["children"]},
    {**NODE, "type": ["object", "null"]},  # null ends it
    {k: v for k, v in NODE.items() if k != "type"},  # any other type ends it (a number)
    {**NODE, "required": []},  # next may be left out
    {"$defs": {"n": {"anyOf": [{"type": "null"}, {**NODE, "properties": {
        "next": {"$ref": "#/$defs/n"}}}]}}, "$ref": "#/$defs/n"},
    {"oneOf": [{"const": 0}, NODE]},
    {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"enum": [None]}]}},
     "required": ["next"]},  # an enum's values are values
    {"type": "array", "items": [{"$ref": "#"}], "minItems": 0},  # draft-7 tuple, may be empty
    {"$id": "urn:x", "$defs": {"a": {"$id": "urn:y", "$ref": "#"}}, "$ref": "#/$defs/a"},
    {"$ref": "https://example.com/schema.json"},  # the library's to resolve or refuse
    {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}, "required": ["x"]},
])
def test_a_recursive_schema_with_a_way_out_is_accepted(schema: dict[str, Any]) -> None:
    check_schema(schema)


def test_size_and_depth_limits() -> None:
    wide = {"type": "object", "properties": {f"p{i}": {} for i in range(MAX_OBJECT_PROPERTIES)}}
    check_schema(wide)
    wide["properties"]["one more"] = {}
    with pytest.raises(ValueError, match="lists 1,001 properties; at most 1,000"):
        check_schema(wide)
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(120):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nests deeper than 100 levels"):
        check_schema(deep)
    chain = {"$defs": {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}]}
                       for i in range(600)}, "$ref": "#/$defs/d0"}
    with pytest.raises(ValueError, match="counting each \\$ref followed"):
        check_schema(chain)


def test_grammar_rules_are_counted_in_lark_and_gbnf() -> None:
    lark = "\n".join([f"r{i}: r{i + 1} | \"x\"" for i in range(MAX_GRAMMAR_RULES - 1)] +
                     ['start: r0'])
    check_grammar(lark)
    with pytest.raises(ValueError, match="1,001 rules and terminals"):
        check_grammar(lark + '\nNUMBER.2: /[0-9]+/')
    gbnf = "\n".join(f"r{i} ::= \"a\" r{i + 1}" for i in range(MAX_GRAMMAR_RULES + 1))
    with pytest.raises(ValueError, match="1,001 rules"):
        check_grammar(gbnf)
    check_grammar('root ::= "(" ("x" | "y")+ ")"\n  | "z"')
