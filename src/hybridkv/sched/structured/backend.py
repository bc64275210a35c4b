"""The grammar library behind structured output: llguidance.

Why llguidance rather than xgrammar (both were measured on Gemma 3 270M's 262,144-token
vocabulary, docs/structured-output.md has the figures): it is one wheel with no
dependencies (xgrammar requires torch, transformers and triton), compiles a JSON schema in
about a millisecond (xgrammar: tens of ms), builds its masks in well under a millisecond per
row, reads a `tokenizers.Tokenizer` directly, and refuses the schema keywords it cannot
enforce ("Unimplemented keys: ["not"]") instead of ignoring them.

The token table is built from the engine's own tokenizer (tokenizer.json or the one rebuilt
from a GGUF file): llguidance reads its byte-level and SentencePiece byte-fallback (<0xNN>)
tokens as the bytes they stand for, and its special tokens as never allowed inside the
text. EOS is allowed where the grammar may end, and only EOS once it has ended.

A compile is checked three ways before any request uses it: the limits of limits.py first
(past them llguidance crashes or takes minutes), then the library's own compile, then a
probe: 32 tokens along the grammar (limits.py says why each is needed). Some of the
library's failures only show once text is fed: a parser row past its limit of 2,000 items
(an object of ~500 optional properties, an anyOf of ~2,000 objects) fails on the first
token, and a grammar that matches nothing allows no first token at all. The probe finds
those at compile time, so the request is refused before it is queued instead of failing
mid-stream; a failure further in remains possible and fails only its own request.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

from hybridkv.sched.structured.limits import check_grammar, check_schema
from hybridkv.sched.structured.spec import StructuredOutput

# JSON as a model writes it: one optional space after ':' and ','. Unbounded whitespace
# (the JSON default) lets a small model fill its whole budget with newlines.
_JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ",
                      "key_separator": ": "}


_PROBE_TOKENS = 32
# The probe takes these one-byte tokens first, in this order: they open and close the
# structures (objects, their keys, arrays) where the parser's rows are widest.
_PROBE_BYTES = b'"{[,:'
_MAX_MESSAGE = 300  # characters of an error: llguidance's can quote a whole regex


class GrammarError(ValueError):
    """A spec the grammar library cannot compile; the message is one line."""


@dataclass(frozen=True, eq=False)
class TokenTable:
    """The library's token table, and what the probe needs to walk a grammar with it."""

    tokenizer: llguidance.LLTokenizer
    vocab_size: int
    lengths: np.ndarray  # bytes of each token; special tokens count as longest
    preferred: tuple[int, ...]  # the one-byte tokens of _PROBE_BYTES that exist, in order


def token_table(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> TokenTable:
    """The library's view of `tokenizer` (a `tokenizers.Tokenizer`), `vocab_size` wide: the
    model's logits may have more rows than the tokenizer has tokens (embeddings padded to a
    multiple), and those ids are never allowed. Takes seconds on a 262k vocabulary."""
    if not eos_token_ids:
        raise GrammarError("structured output needs the model's EOS token id (none is "
                           "configured), to end a finished grammar")
    table = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size,
                                   eos_token=list(eos_token_ids))
    lengths = np.array([len(table.decode_bytes([t])) for t in range(vocab_size)])
    special = [t for t in range(vocab_size) if table.is_special_token(t)]
    lengths[special] = np.iinfo(lengths.dtype).max
    one_byte = {table.decode_bytes([int(t)]): int(t) for t in np.flatnonzero(lengths == 1)}
    preferred = tuple(one_byte[bytes([b])] for b in _PROBE_BYTES if bytes([b]) in one_byte)
    return TokenTable(table, vocab_size, lengths, preferred)


def grammar_text(spec: StructuredOutput) -> str:
    """The spec as an llguidance grammar, once it is within limits.py's limits (the other
    errors are the compile's to find)."""
    try:
        if spec.json_schema is not None:
            assert isinstance(spec.json_schema, dict)  # a dict once checked
            check_schema(spec.json_schema)
        elif spec.grammar is not None:
            check_grammar(spec.grammar)
    except ValueError as e:
        raise GrammarError(f"structured_output.{spec.kind}: {e}") from None
    if spec.json_schema is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(
            spec.json_schema, defaults=_JSON_OPTIONS)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=_JSON_OPTIONS)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        # JSON string literals are Lark string literals: every choice is matched verbatim.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in spec.choice))
    assert spec.grammar is not None
    try:
        # Lark as it is; GBNF (llama.cpp's `root ::= ...`) converted to Lark first.
        return llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as e:
        raise GrammarError(_one_line(f"structured_output.grammar: {e}")) from None


def _limits() -> llguidance.LLParserLimits:
    # Errors without the parser's state: one line, and no request text in them.
    return llguidance.LLParserLimits(verbose_errors=False)


def compile_grammar(table: TokenTable, spec: StructuredOutput) -> llguidance.LLMatcher:
    """A matcher at the start of the grammar: the compiled form, copied per request."""
    matcher = llguidance.LLMatcher(table.tokenizer, grammar_text(spec), log_level=0,
                                   limits=_limits())
    if matcher.is_error():
        raise GrammarError(_one_line(f"structured_output.{spec.kind}: "
                                     f"{matcher.get_error()}"))
    failure = _probe(table, matcher)
    if failure is not None:
        raise GrammarError(_one_line(f"structured_output.{spec.kind}: {failure}"))
    return matcher


def _probe(table: TokenTable, matcher: llguidance.LLMatcher) -> str | None:
    """Why the library fails on the grammar within its first tokens, if it does: a walk of
    up to _PROBE_TOKENS tokens on a copy, each the first of _PROBE_BYTES the grammar allows,
    else its shortest allowed token, until the grammar may end."""
    walker = matcher.deep_copy()
    for step in range(_PROBE_TOKENS):
        mask = np.frombuffer(walker.compute_bitmask(), dtype=np.uint8)
        if walker.is_error():
            if step == 0 and walker.stop_reason() in ("NoExtension", "NoExtensionBias"):
                return "no output matches it (the grammar allows no first token)"
            return _gave_up(walker)
        if walker.is_accepting() or walker.is_stopped():
            return None
        token = next((t for t in table.preferred if mask[t >> 3] >> (t & 7) & 1), None)
        if token is None:
            allowed = np.flatnonzero(np.unpackbits(mask, bitorder="little")[:table.vocab_size])
            if not allowed.size:
                return None  # nothing to walk on: whatever happens is a request's own failure
            token = int(allowed[np.argmin(table.lengths[allowed])])
        if not walker.consume_token(token):
            return _gave_up(walker)
    return None


def _gave_up(walker: llguidance.LLMatcher) -> str:
    error = _one_line(walker.get_error())
    if "items; max is" in error:
        # The parser's limit on one row ("Current row has 2003 items; max is 2000"): its
        # advice (left recursion) is for grammar authors; a schema's cause is a wide choice.
        error = error.partition("; consider")[0]
        return (f"the grammar engine gives up on it at the start of the output: too many "
                f"alternatives at one point, such as an object with hundreds of optional "
                f"properties or an anyOf of thousands ({error})")
    return f"the grammar engine gives up on it at the start of the output: {error}"


def check_json_schema(schema: dict[str, Any]) -> None:
    """A JSON schema the model is shown but not held to (the parameters of a tool it may or
    may not call): refused only where it is invalid or matches nothing, never for keywords
    the library cannot enforce ("lenient"). No token table needed: it is never enforced."""
    try:
        check_schema(schema)
    except ValueError as e:
        raise GrammarError(str(e)) from None
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults=_JSON_OPTIONS, overrides={"lenient": True})
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, None, limits=_limits())
    if failed:
        raise GrammarError(_one_line(messages[0] if messages else "invalid JSON schema"))


def _one_line(message: str) -> str:
    """llguidance's errors can span lines (a caret under the regex); the first says it."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    head = lines[0] if lines else message
    # "invalid regex ... regex parse error:" then "error: unclosed group" further down.
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    if len(head) > _MAX_MESSAGE:  # the quoted input goes, what is wrong with it stays
        head = head[:_MAX_MESSAGE - 1] + "…"
    return f"{head} {detail}" if detail else head
