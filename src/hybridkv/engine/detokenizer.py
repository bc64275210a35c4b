"""Incremental detokenization: each step decodes only a short window of recent tokens.

    tokens  ... | prefix_offset ......... read_offset | new ...
                  decoded once as `prefix`,           decoded with the prefix as `full`
    emitted text += full[len(prefix):]   unless it ends in an incomplete UTF-8 sequence

Decoding a window with some context before it keeps tokenizers that merge across token
boundaries (byte-level BPE, SentencePiece spaces) exact, and holding text back while it ends
in U+FFFD waits for the rest of a multi-byte character.
"""

from __future__ import annotations

from typing import Any

_CONTEXT = 5  # tokens of context kept before the unread ones


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, output_ids: list[int], *, final: bool = False) -> tuple[str, str | None]:
        """Take the output tokens so far; return (new text, the stop string that ended the
        text, if one did: the text is then cut before it). `final` flushes what is held back
        (the request ends: an incomplete character will not be completed)."""
        decode = self.tokenizer.decode
        prefix = decode(output_ids[self.prefix_offset:self.read_offset])
        full = decode(output_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return "", None  # nothing complete yet
        new = full[len(prefix):]
        self.prefix_offset = max(self.read_offset, len(output_ids) - _CONTEXT)
        self.read_offset = len(output_ids)
        old_len = len(self.text)
        self.text += new
        for stop in self.stop:
            # Only look where the new text could complete a stop string.
            cut = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if cut >= 0:
                self.text = self.text[:cut]
                return self.text[old_len:], stop
        return new, None
