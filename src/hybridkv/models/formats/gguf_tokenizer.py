"""A `tokenizers.Tokenizer` built from the tokenizer a GGUF file describes in its metadata.

A GGUF carries no `tokenizer.json`: llama.cpp's converter writes the vocabulary
(`tokenizer.ggml.tokens`), per-token scores and types, byte-level merges and the special token ids
as metadata keys. This module rebuilds an HF `tokenizers` pipeline from those keys that gives the
same ids as transformers' GGUF tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=name)`),
with BOS/EOS added by a post-processor as `tokenizer.ggml.add_bos_token` / `add_eos_token` say.

Two vocabulary kinds (`tokenizer.ggml.model`) are supported:

* ``llama`` -- SentencePiece BPE. The pieces (``\u2581`` for a space) become a BPE model with
  byte fallback (``<0x41>`` tokens); when the file has no merges they are recovered from the
  vocabulary: every way to cut a token in two known pieces is a merge, ranked by the token's score
  (or, for Gemma files, whose scores do not follow the merge order, by the token's position).
* ``gpt2`` -- byte-level BPE from the file's merges, split first by the regex that
  `tokenizer.ggml.pre` names (see `PRE_TOKENIZER_NAMES`).
* ``gemma4`` -- Gemma 4's vocabulary as llama.cpp's converter writes it: SentencePiece-style
  BPE (``\u2581`` for a space, byte fallback) with its merges in the file, read as the
  ``llama`` kind reads a Gemma file; transformers' GemmaTokenizer runs the merges over the
  whole text, and so does this one (llama.cpp also cuts the text at newline runs first).

Tokens typed CONTROL (3) become special added tokens, USER_DEFINED (4) plain added tokens, both
matched whole in the raw text as llama.cpp does.

`read_tokenizer_metadata` reads only the metadata keys (no tensors) straight from the file; it does
not use `gguf.GGUFReader`, which parses every string of a 262k vocabulary into numpy parts and
takes seconds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from hybridkv.models.formats.gguf_file import read_header

__all__ = [
    "GGUFTokenizerInfo",
    "PRE_TOKENIZER_NAMES",
    "read_tokenizer_metadata",
    "tokenizer_from_gguf",
]

# llama.cpp's token types (`tokenizer.ggml.token_type`)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_SPACE = "\u2581"  # SentencePiece's visible space

_SUPPORTED_MODELS = ("gpt2", "llama", "gemma4")


@dataclass(frozen=True)
class GGUFTokenizerInfo:
    tokenizer: tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # eos plus the eot / eom ids the file names, deduplicated
    bos_token: str | None  # the token text, for chat templates that print {{ bos_token }}
    eos_token: str | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None


# --------------------------------------------------------------------------------------------------
# pre-tokenizer regexes for byte-level (gpt2) vocabularies, by `tokenizer.ggml.pre`

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
# GPT-2's split: ByteLevel(use_regex=True) applies exactly this one.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# tiktoken's cl100k split, used by Llama 3 and many others: digits in groups of up to three.
_LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2: like Llama 3, but every digit alone.
_QWEN2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5: Qwen2's, with combining marks kept inside words.
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    + r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tiktoken's o200k split (GPT-4o, Llama 4): case-aware words, contractions glued on.
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's tekken: o200k without contractions, every digit alone.
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# name -> list of regexes applied in turn (each match isolated), then the byte-level mapping.
# `None` stands for GPT-2's own split (ByteLevel's built-in regex).
_PRE_SPLITS: dict[str, tuple[str | None, ...]] = {}
for _names, _splits in (
    (("default", "gpt2", "gpt-2", "mpt", "olmo", "jais"), (None,)),
    # llama.cpp isolates every digit first for these, then splits as GPT-2 does
    (
        ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"),
        (r"\p{N}", None),
    ),
    (
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "dbrx",
            "smaug-bpe",
            "lfm2",
        ),
        (_LLAMA3,),
    ),
    (("qwen2", "deepseek-r1-qwen", "megrez"), (_QWEN2,)),
    (("qwen35",), (_QWEN35,)),
    (("gpt-4o", "llama4", "minimax-m2"), (_GPT4O,)),
    (("tekken",), (_TEKKEN,)),
):
    for _name in _names:
        _PRE_SPLITS[_name] = _splits

PRE_TOKENIZER_NAMES: tuple[str, ...] = tuple(sorted(_PRE_SPLITS))


def _byte_level_pre_tokenizer(splits: tuple[str | None, ...]) -> pre_tokenizers.PreTokenizer:
    if splits == (None,):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(_GPT2 if s is None else s), behavior="isolated") for s in splits
    ]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


# --------------------------------------------------------------------------------------------------
# metadata validation


def _bad(source: str, key: str, what: str) -> ValueError:
    return ValueError(f"{source}: {key} {what}")


def _str_list(
    meta: Mapping[str, Any], key: str, source: str, *, required: bool
) -> list[str] | None:
    value = meta.get(key)
    if value is None:
        if required:
            raise _bad(source, key, "is missing")
        return None
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise _bad(source, key, f"must be a list of strings, got {type(value).__name__}")
    out = list(value)
    kinds = set(map(type, out))
    if not kinds <= {str}:
        if all(issubclass(k, str) for k in kinds):
            return [str(item) for item in out]
        bad = next(k for k in kinds if not issubclass(k, str))
        raise _bad(source, key, f"must be a list of strings, got an item of type {bad.__name__}")
    return out


def _num_array(
    meta: Mapping[str, Any], key: str, source: str, n: int, dtype: Any
) -> np.ndarray | None:
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, (str, bytes)):
        raise _bad(source, key, f"must be a list of numbers, got {type(value).__name__}")
    try:
        arr = np.asarray(value)
        if arr.dtype.kind not in "biuf" or arr.ndim != 1:
            raise TypeError
        arr = arr.astype(dtype, copy=False)
    except (TypeError, ValueError):
        raise _bad(source, key, "must be a list of numbers") from None
    if len(arr) != n:
        raise _bad(source, key, f"has {len(arr)} entries but tokenizer.ggml.tokens has {n}")
    return arr


def _opt_id(meta: Mapping[str, Any], key: str, source: str, n: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise _bad(source, key, f"must be an integer token id, got {type(value).__name__}")
    value = int(value)
    if not 0 <= value < n:
        raise _bad(source, key, f"is {value}, outside the vocabulary of {n} tokens")
    return value


def _opt_bool(meta: Mapping[str, Any], key: str, source: str, default: bool) -> bool:
    value = meta.get(key)
    if value is None:
        return default
    if not isinstance(value, (bool, np.bool_, int, np.integer)):
        raise _bad(source, key, f"must be a boolean, got {type(value).__name__}")
    return bool(value)


def _opt_str(meta: Mapping[str, Any], key: str, source: str) -> str | None:
    value = meta.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad(source, key, f"must be a string, got {type(value).__name__}")
    return value


# --------------------------------------------------------------------------------------------------
# SentencePiece merges recovered from the vocabulary


_MASK64 = (1 << 64) - 1
# two odd multipliers for polynomial hashes modulo 2**64 (odd, so each has an inverse)
_HASH_BASES = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)


def _inverse_mod_2_64(b: int) -> int:
    x = b  # Newton's iteration doubles the number of correct low bits each step
    for _ in range(6):
        x = (x * (2 - b * x)) & _MASK64
    return x


def _derived_merges(pieces: list[str], scores: np.ndarray) -> np.ndarray:
    """The merges a SentencePiece BPE vocabulary implies: every cut of a piece into two pieces that
    are both in the vocabulary. Ranked by the piece's score, high first; among equal scores the
    longer left part, then the longer right part, then the vocabulary order goes first (the ranking
    transformers' `generate_merges` gives).

    `pieces` are distinct; `scores[i]` belongs to `pieces[i]`. Done with numpy: every piece and
    every cut is hashed (two 64-bit polynomial hashes of the code points, plus the length), and a
    cut is a merge when both halves hash like a piece; a 262k vocabulary has about 1.2M cuts.
    Returns int32 [2, merges]: the left and right pieces' indices, in rank order.
    """
    count = len(pieces)
    lens = np.fromiter(map(len, pieces), dtype=np.int64, count=count)
    codes = np.frombuffer("".join(pieces).encode("utf-32-le"), dtype=np.uint32).astype(
        np.uint64
    ) + np.uint64(1)
    ends = np.cumsum(lens)
    starts = ends - lens
    total = len(codes)
    tables = []
    with np.errstate(over="ignore"):
        for base in _HASH_BASES:
            powers = np.full(total + 1, base, dtype=np.uint64)
            powers[0] = 1
            np.cumprod(powers, out=powers)  # base**q, wrapping modulo 2**64
            inverse = np.full(total + 1, _inverse_mod_2_64(base), dtype=np.uint64)
            inverse[0] = 1
            np.cumprod(inverse, out=inverse)
            prefix = np.zeros(total + 1, dtype=np.uint64)
            np.cumsum(codes * powers[:total], out=prefix[1:])
            tables.append((prefix, inverse))

        def hashes(a: np.ndarray, b: np.ndarray) -> list[np.ndarray]:
            # the hash of codes[a:b], shifted to power 0 so equal strings hash alike anywhere
            return [(prefix[b] - prefix[a]) * inverse[a] for prefix, inverse in tables]

        piece_h1, piece_h2 = hashes(starts, ends)
        by_hash = np.argsort(piece_h1)
        sorted_h1 = piece_h1[by_hash]

        def find(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            h1, h2 = hashes(a, b)
            at = np.minimum(np.searchsorted(sorted_h1, h1), count - 1)
            found = by_hash[at]
            ok = (sorted_h1[at] == h1) & (piece_h2[found] == h2) & (lens[found] == b - a)
            return found, ok

        cuts = np.maximum(lens - 1, 0)
        owner = np.repeat(np.arange(count), cuts)  # the piece each cut belongs to
        left_len = np.arange(len(owner)) - np.repeat(np.cumsum(cuts) - cuts, cuts) + 1
        a = starts[owner]
        mid = a + left_len
        left_id, left_ok = find(a, mid)
        keep = np.flatnonzero(left_ok)
        right_id, right_ok = find(mid[keep], ends[owner[keep]])
        right_id = right_id[right_ok]
        keep = keep[right_ok]
    left_id = left_id[keep]
    owner = owner[keep]
    left_len = left_len[keep]
    right_len = lens[owner] - left_len
    # lexsort is stable and sorts by its last key first; negated keys rank high first, ties in order
    order = np.lexsort((-right_len, -left_len, -np.asarray(scores, dtype=np.float64)[owner]))
    return np.stack([left_id[order], right_id[order]]).astype(np.int32)


def _cached_derived_merges(pieces: list[str], scores: np.ndarray) -> list[tuple[str, str]]:
    """`_derived_merges`, kept on disk per vocabulary (keyed by a hash of its pieces and
    scores): deriving them is ~1 s of a 262k vocabulary's ~2 s tokenizer build, paid again at
    every start otherwise. The cache is an optimisation: any failure to read or write it just
    derives them."""
    import os

    import xxhash

    from hybridkv.worker.native import cache_dir

    digest = xxhash.xxh3_128()
    digest.update("\0".join(pieces).encode("utf-8", "surrogatepass"))
    digest.update(np.asarray(scores, dtype=np.float64).tobytes())
    path = cache_dir().parent / "gguf" / f"merges-{digest.hexdigest()}.npy"
    ids: np.ndarray | None = None
    try:
        ids = np.load(path, allow_pickle=False)
        if ids.ndim != 2 or ids.shape[0] != 2 or (ids.size and int(ids.max()) >= len(pieces)):
            ids = None
    except (OSError, ValueError):
        ids = None
    if ids is None:
        ids = _derived_merges(pieces, scores)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
            np.save(tmp, ids)
            os.replace(tmp, path)
        except OSError:
            pass
    return list(zip(map(pieces.__getitem__, ids[0].tolist()),
                    map(pieces.__getitem__, ids[1].tolist()), strict=True))


def _file_merges(merges: list[str], source: str) -> list[tuple[str, str]]:
    out = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise _bad(
                source,
                "tokenizer.ggml.merges",
                f"holds {merge!r}, not two tokens joined by one space",
            )
        out.append((parts[0], parts[1]))
    return out


# --------------------------------------------------------------------------------------------------


def tokenizer_from_gguf(
    meta: Mapping[str, Any], *, source: str = "model.gguf"
) -> GGUFTokenizerInfo:
    """Build the tokenizer described by GGUF metadata `meta` (key -> python value; token, score,
    type and merge arrays may be lists or numpy arrays). `source` names the file in errors."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise _bad(source, "tokenizer.ggml.model", "is missing")
    if kind not in _SUPPORTED_MODELS:
        raise ValueError(
            f"{source}: tokenizer.ggml.model {kind!r} is not supported; "
            f"supported: {', '.join(_SUPPORTED_MODELS)}"
        )
    gemma4 = kind == "gemma4"
    if gemma4:  # SentencePiece pieces with file merges: the llama kind's reading of Gemma
        kind = "llama"
    tokens = _str_list(meta, "tokenizer.ggml.tokens", source, required=True)
    assert tokens is not None
    n = len(tokens)
    if n == 0:
        raise _bad(source, "tokenizer.ggml.tokens", "is empty")
    token_type = _num_array(meta, "tokenizer.ggml.token_type", source, n, np.int64)
    scores = _num_array(meta, "tokenizer.ggml.scores", source, n, np.float64)
    file_merges = _str_list(meta, "tokenizer.ggml.merges", source,
                            required=kind == "gpt2" or gemma4)
    architecture = _opt_str(meta, "general.architecture", source) or ""
    pre = _opt_str(meta, "tokenizer.ggml.pre", source)
    chat_template = _opt_str(meta, "tokenizer.chat_template", source)

    bos_id = _opt_id(meta, "tokenizer.ggml.bos_token_id", source, n)
    eos_id = _opt_id(meta, "tokenizer.ggml.eos_token_id", source, n)
    unk_id = _opt_id(meta, "tokenizer.ggml.unknown_token_id", source, n)
    pad_id = _opt_id(meta, "tokenizer.ggml.padding_token_id", source, n)
    eot_id = _opt_id(meta, "tokenizer.ggml.eot_token_id", source, n)
    eom_id = _opt_id(meta, "tokenizer.ggml.eom_token_id", source, n)
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    add_bos = _opt_bool(meta, "tokenizer.ggml.add_bos_token", source, default=kind == "llama")
    add_eos = _opt_bool(meta, "tokenizer.ggml.add_eos_token", source, default=False)
    add_space_prefix = _opt_bool(meta, "tokenizer.ggml.add_space_prefix", source, default=True)
    if add_bos and bos_id is None:
        raise _bad(
            source,
            "tokenizer.ggml.bos_token_id",
            "is missing but tokenizer.ggml.add_bos_token is true",
        )
    if add_eos and eos_id is None:
        raise _bad(
            source,
            "tokenizer.ggml.eos_token_id",
            "is missing but tokenizer.ggml.add_eos_token is true",
        )

    gemma = architecture.startswith("gemma") or gemma4
    if kind == "llama":
        spelled = tokens
        if gemma:
            # Gemma stores its tokens of two or more spaces as real spaces; the text reaches the
            # model with spaces already turned into "\u2581", so they are looked up (and merged)
            # as such.
            spelled = [_SPACE * len(t) if (" " in t and not t.strip()) else t for t in tokens]
        vocab = {t: i for i, t in enumerate(spelled)}
        if file_merges is not None:
            merges = _file_merges(file_merges, source)
        else:
            # the distinct pieces in order of first appearance; a repeat scores as its last copy
            pieces = list(vocab)
            if gemma or scores is None:
                # Gemma's scores do not follow its merge order; the order of the tokens does
                piece_scores = -np.fromiter(vocab.values(), dtype=np.float64, count=len(vocab))
            else:
                piece_scores = scores[np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))]
            merges = _cached_derived_merges(pieces, piece_scores)
        unk = tokens[unk_id] if unk_id is not None else None
        bpe_options: dict[str, Any] = dict(unk_token=unk, fuse_unk=True, byte_fallback=True)
    else:
        splits = _PRE_SPLITS.get(pre or "default")
        if splits is None:
            raise ValueError(
                f"{source}: tokenizer.ggml.pre {pre!r} is not supported; "
                f"supported: {', '.join(PRE_TOKENIZER_NAMES)}"
            )
        # Byte-level tokens are spelled in GPT-2's byte alphabet already; an added token spelled
        # in raw text (e.g. "<\uff5cUser\uff5c>") keeps its raw spelling, under which it is then
        # matched as an added token.
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = _file_merges(file_merges or [], source)
        bpe_options = dict(continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    try:
        model = models.BPE(vocab=vocab, merges=merges, dropout=None, **bpe_options)
    except Exception as exc:  # a merge naming a token the vocabulary lacks
        detail = " ".join(str(exc).split())
        raise _bad(
            source, "tokenizer.ggml.merges", f"does not fit tokenizer.ggml.tokens ({detail})"
        ) from None
    tok = tokenizers.Tokenizer(model)

    if kind == "llama":
        if gemma:
            tok.normalizer = normalizers.Replace(" ", _SPACE)
            strip_first_space = False
        elif architecture == "phi3":
            # Phi-3 adds its space in a normalizer: each text piece between added tokens has one
            tok.normalizer = normalizers.Sequence(
                [normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)]
            )
            strip_first_space = True
        else:
            scheme = "first" if add_space_prefix else "never"
            tok.pre_tokenizer = pre_tokenizers.Metaspace(
                replacement=_SPACE, prepend_scheme=scheme, split=False
            )
            strip_first_space = add_space_prefix
        steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        if strip_first_space:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        tok.decoder = decoders.Sequence(steps)
    else:
        assert splits is not None
        tok.pre_tokenizer = _byte_level_pre_tokenizer(splits)
        tok.decoder = decoders.ByteLevel()

    # Added tokens, matched whole in the raw text: CONTROL ones special, USER_DEFINED ones not.
    if token_type is not None:
        control_ids = np.flatnonzero(token_type == _CONTROL).tolist()
        user_ids = np.flatnonzero(token_type == _USER_DEFINED).tolist()
    else:
        control_ids, user_ids = [], []
    specials = [AddedToken(tokens[i], normalized=False, special=True) for i in control_ids]
    seen = {tokens[i] for i in control_ids}
    # the named special tokens are special even when the file types them otherwise
    for i in (bos_id, eos_id, unk_id, pad_id):
        if i is not None and tokens[i] not in seen and tokens[i] in vocab:
            seen.add(tokens[i])
            specials.append(AddedToken(tokens[i], normalized=False, special=True))
    if specials:
        tok.add_special_tokens(specials)
    # a user-defined token the vocabulary knows under another spelling (Gemma's runs of spaces) is
    # left to the model, which produces it from the respelled text
    plain = [
        AddedToken(tokens[i], normalized=False, special=False)
        for i in user_ids
        if tokens[i] in vocab and tokens[i] not in seen
    ]
    if plain:
        tok.add_tokens(plain)

    bos_token = tokens[bos_id] if bos_id is not None else None
    eos_token = tokens[eos_id] if eos_id is not None else None
    tok.post_processor = _post_processor(bos_token, bos_id, eos_token, eos_id, add_bos, add_eos)

    eos_ids: list[int] = []
    for i in (eos_id, eot_id, eom_id):
        if i is not None and i not in eos_ids:
            eos_ids.append(i)
    return GGUFTokenizerInfo(
        tokenizer=tok,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        eos_token_ids=tuple(eos_ids),
        bos_token=bos_token,
        eos_token=eos_token,
        add_bos=add_bos,
        add_eos=add_eos,
        chat_template=chat_template,
    )


def _post_processor(
    bos: str | None,
    bos_id: int | None,
    eos: str | None,
    eos_id: int | None,
    add_bos: bool,
    add_eos: bool,
) -> processors.TemplateProcessing:
    """`[bos] $A [eos]` for one sequence, `[bos] $A [eos] [bos] $B [eos]` for a pair."""
    # Template pieces are parsed from strings ("name:type_id"), so the names are aliases that cannot
    # clash with that syntax; each alias carries the real token text and id.
    head: list[str] = ["[BOS]"] if add_bos else []
    tail: list[str] = ["[EOS]"] if add_eos else []
    special_tokens: list[dict[str, Any]] = []
    if add_bos:
        special_tokens.append({"id": "[BOS]", "ids": [bos_id], "tokens": [bos]})
    if add_eos:
        special_tokens.append({"id": "[EOS]", "ids": [eos_id], "tokens": [eos]})
    single = [*head, "$A:0", *tail]
    pair = [*head, "$A:0", *tail, *(f"{p}:1" for p in head), "$B:1", *(f"{p}:1" for p in tail)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special_tokens)


# --------------------------------------------------------------------------------------------------


def read_tokenizer_metadata(path: str) -> dict[str, Any]:
    """The `tokenizer.*` and `general.architecture` keys of the GGUF file at `path`, without
    reading any tensor (formats/gguf_file.py reads the header; arrays come back as lists)."""
    header = read_header(path)
    return {key: value for key, value in header.metadata.items()
            if key.startswith("tokenizer.") or key == "general.architecture"}
