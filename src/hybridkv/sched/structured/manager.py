"""Compiled grammars, per-request matchers and the token bitmask of a step.

    add_request ──> grammar_for(spec) ──> compile(spec): cached Future ──> pool thread
                                            (the token table is built there once, lazily)
    each step   ──> poll(): ready, or failed (the request fails alone with the one line)
                ──> StepGrammars(rows that sample) ──> the runner and sampler ask it
                      allows(row, token): a greedy row whose best token the grammar takes
                                          needs no mask (the masked argmax is that token)
                      bitmask(rows): masks for the rows that still need one
                ──> accept(token) per constrained request that got one

The engine thread never compiles: a request waits in the scheduler's queue until its
grammar is ready while the others keep running. A matcher lives on the request, not in the
worker, so a preempted request resumes where its output is: its tokens are never re-fed.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

from hybridkv.sched.structured.backend import (
    GrammarError,
    TokenTable,
    compile_grammar,
    token_table,
)
from hybridkv.sched.structured.spec import StructuredOutput

MAX_CACHED_GRAMMARS = 512  # distinct specs kept compiled (least recently used go first)
_COMPILE_THREADS = 2

# Timings go to whoever listens (the server's Prometheus histograms): seconds.
TimingObserver = Callable[[float], None]


@dataclass(frozen=True)
class GrammarBitmask:
    """The tokens each constrained row may sample this step: bit t of row i (word t // 32,
    bit t % 32) set = token t allowed for request_ids[i]."""

    request_ids: list[str]
    words: np.ndarray  # [len(request_ids), ceil(vocab / 32)] int32


class RequestGrammar:
    """One request's grammar: compiling at first, then a matcher that has consumed every
    output token so far."""

    def __init__(self, spec: StructuredOutput, compiled: Future[llguidance.LLMatcher]
                 ) -> None:
        self.spec = spec
        self._compiled = compiled
        self.matcher: llguidance.LLMatcher | None = None

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    @property
    def compiling(self) -> Future[llguidance.LLMatcher]:
        return self._compiled

    def poll(self) -> str | None:
        """Take the compiled grammar once it is there; the one-line reason if it failed."""
        if self.matcher is not None or not self._compiled.done():
            return None
        if self._compiled.cancelled():
            return "its grammar's compile was cancelled (the engine is closing)"
        error = self._compiled.exception()
        if error is not None:
            return str(error) if isinstance(error, GrammarError) \
                else f"the grammar failed to compile: {type(error).__name__}: {error}"
        self.matcher = self._compiled.result().deep_copy()
        return None

    def accept(self, token: int) -> str | None:
        """Advance past a sampled token; the reason if the grammar refuses it (a sampled
        token was masked in, so this means a bug, reported rather than ignored)."""
        assert self.matcher is not None, "a token was sampled before the grammar was ready"
        if self.matcher.consume_token(token):
            return None
        return f"the grammar refused token {token}: {self.matcher.get_error()}"

    @property
    def finished(self) -> bool:
        """The grammar has ended (it can take no more text): the request stops."""
        return self.matcher is not None and self.matcher.is_stopped()


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer  # tokenizers.Tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._table: TokenTable | None = None
        self._table_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()
        self._lock = threading.Lock()  # the cache: the server's threads compile too
        self.num_words = (vocab_size + 31) // 32
        self.on_compile: TimingObserver | None = None
        self.on_mask: TimingObserver | None = None

    # ---------------------------------------------------------------- compiling
    def compile(self, spec: StructuredOutput) -> Future[llguidance.LLMatcher]:
        """The compiled grammar of `spec`, shared by every request that asks for the same
        spec; a failure (GrammarError) is cached too. Safe from any thread."""
        key = spec.key
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_COMPILE_THREADS,
                                                thread_name_prefix="hybridkv-grammar")
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return future

    def grammar_for(self, spec: StructuredOutput) -> RequestGrammar:
        return RequestGrammar(spec, self.compile(spec))

    def _compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        table = self._token_table()
        start = time.perf_counter()
        matcher = compile_grammar(table, spec)
        if self.on_compile is not None:
            self.on_compile(time.perf_counter() - start)
        return matcher

    def _token_table(self) -> TokenTable:
        with self._table_lock:  # built once, by the first compile that needs it
            if self._table is None:
                self._table = token_table(self._tokenizer, self.vocab_size,
                                          self._eos_token_ids)
            return self._table

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None  # a later compile starts a new pool
            self._cache.clear()  # cancelled compiles must not be found again

    # ---------------------------------------------------------------- each step
    def fill_bitmask(self, request_ids: list[str], grammars: Sequence[RequestGrammar]
                     ) -> GrammarBitmask:
        """The allowed tokens of each row. One row at a time: at 32 rows this measured
        faster than llguidance's thread pool on a 2-core machine (masks take ~0.02 ms a row
        on JSON; the pool's hand-off costs more)."""
        start = time.perf_counter()
        words = np.empty((len(grammars), self.num_words), dtype=np.int32)
        row_bytes = self.num_words * 4
        base = words.ctypes.data
        for i, grammar in enumerate(grammars):
            assert grammar.matcher is not None
            grammar.matcher.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
        if self.on_mask is not None:
            self.on_mask(time.perf_counter() - start)
        return GrammarBitmask(request_ids, words)


class StepGrammars:
    """The constrained requests that sample in one step, their masks computed only where
    asked for. A mask costs ~0.02-1.5 ms a row at a 262k vocabulary (strings are the slow
    case); checking one token against the grammar costs microseconds. A greedy row takes
    the argmax of its masked logits, which is its unmasked argmax whenever the grammar
    allows that token, the common case (~87% of rows on Gemma 3 270M's JSON), so such a row
    never has its mask computed."""

    def __init__(self, manager: StructuredOutputManager, request_ids: list[str],
                 grammars: Sequence[RequestGrammar]) -> None:
        self._manager = manager
        self.request_ids = request_ids
        self._grammar = dict(zip(request_ids, grammars, strict=True))

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._grammar

    def allows(self, request_id: str, token: int) -> bool:
        """Whether the request's grammar takes `token` next (nothing is consumed)."""
        matcher = self._grammar[request_id].matcher
        assert matcher is not None
        return bool(matcher.validate_tokens([token]) == 1)

    def bitmask(self, request_ids: Sequence[str] | None = None) -> GrammarBitmask:
        """The masks of `request_ids` (default: every constrained row of the step)."""
        ids = list(self.request_ids if request_ids is None else request_ids)
        return self._manager.fill_bitmask(ids, [self._grammar[rid] for rid in ids])
