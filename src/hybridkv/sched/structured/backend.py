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
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance

from hybridkv.sched.structured.spec import StructuredOutput

# JSON as a model writes it: one optional space after ':' and ','. Unbounded whitespace
# (the JSON default) lets a small model fill its whole budget with newlines.
_JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ",
                      "key_separator": ": "}


class GrammarError(ValueError):
    """A spec the grammar library cannot compile; the message is one line."""


def token_table(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]
                ) -> llguidance.LLTokenizer:
    """The library's view of `tokenizer` (a `tokenizers.Tokenizer`), `vocab_size` wide: the
    model's logits may have more rows than the tokenizer has tokens (embeddings padded to a
    multiple), and those ids are never allowed. Takes seconds on a 262k vocabulary."""
    if not eos_token_ids:
        raise GrammarError("structured output needs the model's EOS token id (none is "
                           "configured), to end a finished grammar")
    return llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size,
                                  eos_token=list(eos_token_ids))


def grammar_text(spec: StructuredOutput) -> str:
    """The spec as an llguidance grammar (no check yet: `compile` finds the errors)."""
    if spec.json_schema is not None:
        assert isinstance(spec.json_schema, dict)  # a dict once checked
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


def compile_grammar(table: llguidance.LLTokenizer, spec: StructuredOutput
                    ) -> llguidance.LLMatcher:
    """A matcher at the start of the grammar: the compiled form, copied per request."""
    matcher = llguidance.LLMatcher(table, grammar_text(spec), log_level=0)
    if matcher.is_error():
        raise GrammarError(_one_line(f"structured_output.{spec.kind}: "
                                     f"{matcher.get_error()}"))
    return matcher


def _one_line(message: str) -> str:
    """llguidance's errors can span lines (a caret under the regex); the first says it."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    head = lines[0] if lines else message
    # "invalid regex ... regex parse error:" then "error: unclosed group" further down.
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    return f"{head} {detail}" if detail else head
