"""What a spec must satisfy before the grammar library sees it: the limits past which
llguidance fails badly (a crash, a minutes-long compile) rather than with an error, and a
check it lacks, that a JSON schema matches at least one value.

    nesting          a schema nests at most MAX_SCHEMA_NESTING levels: llguidance's JSON
                     reader stops at 128 with "recursion limit exceeded at line 1 column N"
    through $ref     at most MAX_SCHEMA_REF_DEPTH levels, counting each $ref the compiler
                     follows: it resolves a $ref where it first meets it, recursively, and
                     ~1,000 $defs chained one to the next overflow its thread's stack
                     (a segfault that takes the server down; measured on llguidance 1.9)
    properties       an object lists at most MAX_OBJECT_PROPERTIES: compile time grows with
                     the square of an object's optional properties (4,000: 1.8 s, 10,000:
                     31 s), past the point where the parser can use them anyway (it gives up
                     on a row of more than 2,000 items, ~500 optional properties)
    grammar rules    a Lark or GBNF grammar defines at most MAX_GRAMMAR_RULES rules and
                     terminals: ~3,000 rules chained one to the next overflow the stack too
    satisfiable      a schema whose every value would have to contain another of itself
                     ({"$ref": "#"}, a -> b -> a, a required property that refers back)
                     matches nothing: llguidance compiles it and then either allows no first
                     token or forces an endless prefix ({"x": {"x": ...), so the request ends
                     at once with empty text or runs out of tokens; refused here instead

Each check raises ValueError with one line; the caller names the field.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

MAX_SCHEMA_NESTING = 100
MAX_SCHEMA_REF_DEPTH = 1000
MAX_OBJECT_PROPERTIES = 1000
MAX_GRAMMAR_RULES = 1000

_JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# A rule or terminal definition at the start of a line: Lark's `name:`, `?name:`,
# `NAME.2:`, `name[stop=""]:`, `name{x}:`; GBNF's `name ::=`.
_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*(?:\{[^}\n]*\})?(?:\[[^\]\n]*\])?"
                         r"(?:\.-?\d+)?[ \t]*(?::(?!:)|::=)", re.MULTILINE)


def check_grammar(text: str) -> None:
    rules = sum(1 for _ in _DEFINITION.finditer(text))
    if rules > MAX_GRAMMAR_RULES:
        raise ValueError(f"the grammar defines {rules:,} rules and terminals; at most "
                         f"{MAX_GRAMMAR_RULES:,} are accepted")


def check_schema(schema: dict[str, Any]) -> None:
    """The limits above, then satisfiability (only a schema with a $ref can recurse)."""
    refs = _walk(schema)
    if refs:
        _check_ref_depth(schema)
        _check_satisfiable(schema, refs)


def _walk(schema: dict[str, Any]) -> list[str]:
    """Nesting and property counts, without recursion (the nesting is not checked yet); the
    $ref strings found, in document order."""
    refs: list[str] = []
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_NESTING:
            raise ValueError(f"the schema nests deeper than {MAX_SCHEMA_NESTING} levels, the "
                             f"most accepted")
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                refs.append(ref)
            properties = node.get("properties")
            if isinstance(properties, dict) and len(properties) > MAX_OBJECT_PROPERTIES:
                raise ValueError(f"an object of the schema lists {len(properties):,} "
                                 f"properties; at most {MAX_OBJECT_PROPERTIES:,} are "
                                 f"accepted in one object")
            stack.extend((value, depth + 1) for value in reversed(node.values()))
        elif isinstance(node, list):
            stack.extend((value, depth + 1) for value in reversed(node))
    refs.reverse()
    return refs


_MISSING = object()


def _resolve(schema: dict[str, Any], ref: str) -> Any:
    """The target of a local `#/...` JSON pointer (RFC 6901); _MISSING for anything else
    (an anchor, another document), which the library resolves or refuses itself."""
    if not ref.startswith("#"):
        return _MISSING
    pointer = unquote(ref[1:])
    if not pointer:
        return schema
    if not pointer.startswith("/"):
        return _MISSING
    node: Any = schema
    for part in pointer[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _children(node: Any) -> Iterator[Any]:
    if isinstance(node, dict):
        yield from node.values()
    elif isinstance(node, list):
        yield from node


def _check_ref_depth(schema: dict[str, Any]) -> None:
    """The depth the compiler's recursion reaches: a depth-first walk in document order that
    follows each $ref the first time it is met, as llguidance's schema builder does."""
    seen: set[str] = set()
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_REF_DEPTH:
            raise ValueError(f"the schema nests deeper than {MAX_SCHEMA_REF_DEPTH:,} levels "
                             f"counting each $ref followed (a long chain of $defs?), the most "
                             f"accepted")
        children = [(child, depth + 1) for child in _children(node)]
        ref = node.get("$ref") if isinstance(node, dict) else None
        if isinstance(ref, str) and ref not in seen:
            seen.add(ref)
            target = _resolve(schema, ref)
            if target is not _MISSING:
                children.append((target, depth + 1))
        stack.extend(reversed(children))


class _Formula:
    """A node of the and/or graph whose least solution says which subschemas match some
    value: an AND holds once all its parts hold, an OR once one does (an OR of nothing never
    does)."""

    __slots__ = ("parts", "waiting", "parents", "holds", "ref")

    def __init__(self, parts: list[_Formula], is_and: bool, ref: str | None = None) -> None:
        self.parts = parts
        self.waiting = len(parts) if is_and else 1
        self.parents: list[_Formula] = []
        self.holds = False
        self.ref = ref  # set on the node standing for a $ref


def _check_satisfiable(schema: dict[str, Any], refs: list[str]) -> None:
    if any(isinstance(node, dict) and "$id" in node and node is not schema
           for node in _nodes(schema)):
        return  # $refs inside a nested resource resolve against it: leave them to the library
    targets = {ref: _resolve(schema, ref) for ref in dict.fromkeys(refs)}
    targets = {ref: target for ref, target in targets.items() if target is not _MISSING}
    by_ref: dict[str, _Formula] = {}
    leaves: list[_Formula] = []

    def node(parts: list[_Formula], is_and: bool, ref: str | None = None) -> _Formula:
        formula = _Formula(parts, is_and, ref)
        for part in parts:
            part.parents.append(formula)
        if formula.waiting == 0:
            leaves.append(formula)
        return formula

    def of(subschema: Any) -> _Formula:
        """What a value of `subschema` needs that can make it need another value; what the
        library checks itself is taken as met."""
        if subschema is False:
            return node([], False)
        if not isinstance(subschema, dict):
            return node([], True)
        parts: list[_Formula] = []
        ref = subschema.get("$ref")
        if isinstance(ref, str) and ref in targets:
            if ref not in by_ref:  # its parts are linked once every target has a formula
                by_ref[ref] = _Formula([], False, ref)
            parts.append(by_ref[ref])
        all_of = subschema.get("allOf")
        if isinstance(all_of, list):
            parts.extend(of(s) for s in all_of)
        for key in ("anyOf", "oneOf"):
            options = subschema.get(key)
            if isinstance(options, list) and options:
                parts.append(node([of(s) for s in options], False))
        if "const" not in subschema and "enum" not in subschema:
            kind = subschema.get("type")
            kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) \
                else _JSON_TYPES
            parts.append(node([of_type(str(k), subschema) for k in kinds], False))
        return node(parts, True)

    def of_type(kind: str, subschema: dict[str, Any]) -> _Formula:
        needed: list[Any] = []
        if kind == "object":
            properties = subschema.get("properties")
            properties = properties if isinstance(properties, dict) else {}
            other = subschema.get("additionalProperties", True)
            required = subschema.get("required")
            for name in required if isinstance(required, list) else []:
                if name in properties:
                    needed.append(properties[name])
                elif "patternProperties" not in subschema:
                    needed.append(other)
        elif kind == "array":
            least = subschema.get("minItems", 0)
            least = least if isinstance(least, int) else 0
            items = subschema.get("items", True)
            prefix = subschema.get("prefixItems")
            if isinstance(items, list):  # drafts 4-7: a tuple
                prefix, items = items, subschema.get("additionalItems", True)
            prefix = prefix if isinstance(prefix, list) else []
            needed.extend(prefix[:least])
            if least > len(prefix):
                needed.append(items)
        return node([of(s) for s in needed], True)

    root = of(schema)
    pending = list(by_ref)
    while pending:  # a target's formula can meet further $refs
        ref = pending.pop()
        known = set(by_ref)
        target = of(targets[ref])
        by_ref[ref].parts = [target]
        target.parents.append(by_ref[ref])
        pending.extend(r for r in by_ref if r not in known)
    # From what holds outright upwards, each node once: linear in the schema's size.
    queue = leaves
    while queue:
        formula = queue.pop()
        if formula.holds:
            continue
        formula.holds = True
        for parent in formula.parents:
            parent.waiting -= 1
            if parent.waiting <= 0 and not parent.holds:
                queue.append(parent)
    if root.holds:
        return
    failing = _failing_ref(root)
    if failing is None:
        raise ValueError("no JSON value matches the schema")
    if _recursive(by_ref[failing]):
        raise ValueError(f"no JSON value matches the schema: a value of {failing!r} would "
                         f"have to contain another without end (a $ref recursion needs a way "
                         f"out: an optional property, an empty array, an anyOf branch "
                         f"without it)")
    raise ValueError(f"no JSON value matches the schema: {failing!r} matches none")


def _failing_ref(root: _Formula) -> str | None:
    """The first $ref (depth first, in document order) that keeps `root` from holding."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        formula = stack.pop()
        if id(formula) in seen or formula.holds:
            continue
        seen.add(id(formula))
        if formula.ref is not None:
            return formula.ref
        stack.extend(reversed(formula.parts))
    return None


def _recursive(ref_node: _Formula) -> bool:
    """Whether a failing $ref fails because it needs itself: found again below it."""
    seen: set[int] = set()
    stack = list(ref_node.parts)
    while stack:
        formula = stack.pop()
        if formula is ref_node:
            return True
        if id(formula) in seen or formula.holds:
            continue
        seen.add(id(formula))
        stack.extend(formula.parts)
    return False


def _nodes(schema: Any) -> Iterator[Any]:
    stack = [schema]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(_children(node))
