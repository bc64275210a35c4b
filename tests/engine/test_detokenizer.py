"""The incremental detokenizer against decoding everything at once."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")

from hybridkv.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from hybridkv.models.demo import train_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer

    path = tmp_path_factory.mktemp("tok")
    train_tokenizer(path, 400)
    return Tokenizer.from_file(str(path / "tokenizer.json"))


@pytest.mark.parametrize("text", [
    "the quick brown fox jumps over the lazy dog",
    "héllo wörld — ünïcödé ✓ 日本語",  # multi-byte characters split over byte tokens
])
def test_streamed_text_equals_the_whole_decode(tokenizer, text):
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(ids[:n])[0] for n in range(1, len(ids) + 1)]
    assert "".join(pieces) == tokenizer.decode(ids) == detok.text
    assert all("\ufffd" not in p for p in pieces)


def test_an_incomplete_character_is_held_back_until_the_end(tokenizer):
    ids = tokenizer.encode("✓").ids[:-1]  # the first bytes of a 3-byte character
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids) == ("", None)
    assert detok.add(ids, final=True)[0] == tokenizer.decode(ids)


def test_stop_string_cuts_the_text(tokenizer):
    ids = tokenizer.encode("one, two, three, four").ids
    detok = IncrementalDetokenizer(tokenizer, stop=("three",))
    stop = None
    for n in range(1, len(ids) + 1):
        _, stop = detok.add(ids[:n])
        if stop:
            break
    assert stop == "three" and detok.text == "one, two, "
