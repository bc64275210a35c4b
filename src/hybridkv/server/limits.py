"""What keeps one hostile request from stalling or crashing the server: a limit on the body's
size, a JSON parser with a stated nesting limit, and a bound on a prompt's length in
characters that refuses a prompt longer than the context without tokenizing it.

    body size     Content-Length (or the bytes received so far) beyond
                  --max-request-body-bytes: 413, before the body is read or parsed
    JSON nesting  the body is parsed by pydantic's parser (jiter), which stops at 200 levels
                  with a line and column; Python's json module would raise RecursionError
                  and FastAPI answer a vague "There was an error parsing the body"
    prompt chars  a tokenizer that keeps every character of its text (byte-level BPE,
                  SentencePiece: the LLM ones) needs at least len(text) / L tokens for a
                  text, L its longest token in characters; beyond max_model_len * L the
                  prompt is too long whatever it says, and is refused at once
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi import Request
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridkv.server.errors import error_response

MIB = 1 << 20
# A maximal prompt of 131,072 tokens (the longest context of the models served here) is
# ~0.5 MB of text at 4 characters a token and ~3 MB written as \uXXXX escapes; 32 MiB leaves
# room for batches of such prompts and prompts of token ids (~7 bytes each), while bounding
# what one request makes the server read, parse and validate (~0.1-1 s at this size).
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * MIB
MAX_JSON_NESTING = 200  # jiter's fixed limit (pydantic_core.from_json)
FLAG = "--max-request-body-bytes"


def _size(n: int) -> str:
    return f"{n / MIB:g} MiB" if n >= MIB and n % (MIB // 4) == 0 else f"{n:,} bytes"


class BodyTooLarge(HTTPException):
    """Raised from the body's receive: an HTTPException, so FastAPI's body reading passes it
    on (it turns any other error into a 400) to the server's handler for the envelope."""

    def __init__(self, limit: int, size: int | None) -> None:
        got = f"is {_size(size)}" if size is not None else f"is larger than {_size(limit)}"
        super().__init__(413, f"the request body {got}; this server accepts at most "
                              f"{_size(limit)} ({FLAG})")


class BodyLimitMiddleware:
    """A body larger than `limit` bytes: 413. A Content-Length says so before anything is
    read; a body sent without one (chunked) is counted as it arrives."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        size = int(declared) if declared is not None and declared.isdigit() else None
        if size is not None and size > self.limit:
            error = BodyTooLarge(self.limit, size)
            await error_response(413, str(error.detail), path=scope["path"])(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit, None)
            return message

        await self.app(scope, limited, send)


class JSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = pydantic_core.from_json(body)
            except ValueError as e:
                raise HTTPException(400, _json_error(str(e))) from None
        return self._json


def _json_error(message: str) -> str:
    if message.startswith("recursion limit exceeded"):
        where = message.removeprefix("recursion limit exceeded").strip()
        return (f"the request body nests JSON more than {MAX_JSON_NESTING} levels deep "
                f"({where}); at most {MAX_JSON_NESTING} are accepted")
    return f"malformed JSON in the request body: {message}"


class JSONRoute(APIRoute):
    """Routes whose body is parsed by JSONRequest (FastAPI's documented way to change how a
    route reads its request)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parse_with_limits(request: Request) -> Response:
            return await handler(JSONRequest(request.scope, request.receive))

        return parse_with_limits


# What a tokenizer may do to its text and still keep every character of it (so that no token
# stands for more characters than the longest in its vocabulary): normalizers and
# pre-tokenizers by their tokenizer.json "type". Anything else (NFKC composing characters,
# BERT's clean-up deleting control characters, whitespace splitting dropping the spaces,
# WordPiece's one [UNK] for a whole unknown word) may shrink a text without bound.
_KEEPING_NORMALIZERS = {"Prepend", "NFD", "NFKD", "Lowercase", "Sequence", "Replace"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split",
                           "UnicodeScripts", "Sequence"}


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for, or None when the tokenizer may
    drop characters (then no character count proves a prompt too long)."""
    parts = [(getattr(tokenizer, "normalizer", None), _KEEPING_NORMALIZERS),
             (getattr(tokenizer, "pre_tokenizer", None), _KEEPING_PRE_TOKENIZERS)]
    try:  # a component's tokenizer.json entry, without serializing the whole vocabulary
        configs = [(json.loads(part.__getstate__()) if part is not None else None, kinds)
                   for part, kinds in parts]
    except (AttributeError, TypeError, ValueError):
        return None
    if not all(_keeps(config, kinds) for config, kinds in configs) or \
            not _model_keeps(getattr(tokenizer, "model", None)):
        return None
    # An added token that strips the whitespace beside it takes a run of any length.
    added: dict[int, Any] = getattr(tokenizer, "get_added_tokens_decoder", dict)()
    if any(getattr(token, "lstrip", False) or getattr(token, "rstrip", False)
           for token in added.values()):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max((len(token) for token in vocab), default=0) or None


def _keeps(part: Any, kinds: set[str]) -> bool:
    if part is None:
        return True
    if not isinstance(part, dict) or part.get("type") not in kinds:
        return False
    if part["type"] == "Sequence":
        children = part.get("normalizers", part.get("pretokenizers"))
        return isinstance(children, list) and all(_keeps(c, kinds) for c in children)
    if part["type"] == "Replace":  # a literal replaced by one at least as long
        pattern, content = part.get("pattern"), part.get("content")
        return isinstance(pattern, dict) and isinstance(pattern.get("String"), str) and \
            isinstance(content, str) and len(content) >= len(pattern["String"])
    if part["type"] in ("Split", "Punctuation"):  # "Removed" drops what it splits on
        return part.get("behavior") != "Removed"
    return True


def _model_keeps(model: Any) -> bool:
    """BPE and Unigram keep every character unless unknown ones fuse into one token."""
    kind = type(model).__name__
    fallback = bool(getattr(model, "byte_fallback", False))
    if kind == "BPE":
        return getattr(model, "unk_token", None) is None or fallback or \
            not getattr(model, "fuse_unk", True)
    return kind == "Unigram" and fallback


def too_long(text: str, max_model_len: int, chars_per_token: int | None) -> str | None:
    """Why `text` cannot fit the context without tokenizing it, or None if it might."""
    if chars_per_token is None or len(text) <= max_model_len * chars_per_token:
        return None
    return (f"the prompt has {len(text):,} characters, so at least "
            f"{-(-len(text) // chars_per_token):,} tokens (no token of this model is longer "
            f"than {chars_per_token} characters); this model's maximum context length is "
            f"{max_model_len:,} tokens")
