"""The engine loop: requests in, scheduler + model runner each step, outputs out.

    engine.add_request(rid, prompt, params)     # bad input raises here; others keep going
    while engine.has_unfinished:
        for out in engine.step(): ...            # streaming: new tokens/text per request
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

from hybridkv.config import EngineConfig
from hybridkv.connector.events import (
    DEFAULT_QUEUE,
    DEFAULT_TOPIC,
    KVEventPublisher,
    group_infos,
)
from hybridkv.engine.build import EngineParts, build_engine
from hybridkv.engine.detokenizer import IncrementalDetokenizer
from hybridkv.engine.outputs import RequestOutput
from hybridkv.sched.checks import check_int
from hybridkv.sched.request import Request, RequestStatus
from hybridkv.sched.sampling import SamplingParams
from hybridkv.sched.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from hybridkv.sched.structured.manager import StructuredOutputManager

# Every tier a request's prompt can come from, in outputs even when unused.
# Part points one request may name (each takes a state block while it is cached).
MAX_PART_POINTS = 4
NO_CACHED_TOKENS = {"device": 0, "cpu": 0, "disk": 0, "remote": 0}
ACCEPTED_PROMPTS = "a string or a list of token ids (ints)"


def check_token_ids(prompt: object) -> list[int]:
    if isinstance(prompt, (list, tuple)):
        for i, token in enumerate(prompt):
            if isinstance(token, bool) or not isinstance(token, int):
                raise ValueError(f"token {i} of the prompt is {token!r} "
                                 f"({type(token).__name__}); token ids must be ints")
        return list(prompt)
    hint = " (convert it with .tolist())" if hasattr(prompt, "tolist") else ""
    raise ValueError(f"a prompt must be {ACCEPTED_PROMPTS}, got {type(prompt).__name__}"
                     f"{hint}")


def _close_at_exit(engine_ref: weakref.ref[LLMEngine]) -> None:
    engine = engine_ref()
    if engine is not None:
        engine.close()


def as_sampling_params(params: object) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, Mapping):
        return SamplingParams.from_dict(params)
    raise ValueError(f"sampling params must be a SamplingParams, a dict of its fields or "
                     f"None, got {type(params).__name__}")

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, parts: EngineParts, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.parts = parts
        self.scheduler = parts.scheduler
        self.kv_manager = parts.scheduler.kv
        self.runner = parts.runner
        self.plan = parts.plan
        self.tokenizer = parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.vocab_size = parts.vocab_size
        self.input_vocab_size = parts.input_vocab_size or parts.vocab_size
        self.max_model_len = parts.max_model_len
        self._params: dict[str, SamplingParams] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._next_index = 0
        # n > 1: request id -> its samples' engine ids, and back (id, index); samples held
        # until the first (the key) has computed the prompt.
        self._samples: dict[str, list[str]] = {}
        self._sample_of: dict[str, tuple[str, int]] = {}
        self._held: dict[str, list[Request]] = {}
        # Structured output (a tokenizer is needed to know what each token spells); the
        # grammar library is loaded and its token table built on first use.
        self.structured: StructuredOutputManager | None = None
        if self.tokenizer is not None:
            from hybridkv.sched.structured.manager import StructuredOutputManager
            self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size,
                                                      self.eos_token_ids)
        self._compiling: dict[str, Request] = {}  # queued, their grammar not ready yet
        self.connector = parts.scheduler.connector
        self._closed = False
        self.kv_events = self._start_kv_events()
        if self.connector is not None:
            # At exit, the device cache and the queued writes go to the tiers: a later
            # process on the same disk directory finds them. (A weak reference: the exit
            # hook must not keep a dropped engine's memory alive.)
            atexit.register(_close_at_exit, weakref.ref(self))

    @classmethod
    def from_model_dir(cls, model_dir: str, config: EngineConfig) -> LLMEngine:
        return cls(build_engine(model_dir, config), config)

    # ---------------------------------------------------------------- requests
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt as token ids. Anything but a string or a list of int token ids is refused
        with what was given and what is accepted."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass token ids")
            return list(self.tokenizer.encode(prompt).ids)
        return check_token_ids(prompt)

    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: SamplingParams | Mapping[str, Any] | None = None, *,
                    priority: int = 0, part_points: Sequence[int] = ()) -> None:
        """Validate and queue a request; a bad one raises ValueError and changes nothing.
        `part_points`: prompt positions where later prompts are expected to part from
        this one (the server passes where a chat's last messages start); with prefix
        caching, state layers save a checkpoint at each (rounded down to a block), so that
        a prompt parting there resumes from it (at most MAX_PART_POINTS).
        With `n` > 1 its samples are engine requests of their own ("{id}#{i}") whose outputs
        carry the request's id and their `index`; the first computes the prompt, the others
        wait until it has, and then reuse its blocks through the prefix cache."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        params = as_sampling_params(params)
        check_int("priority", priority, low=-(2**63), high=2**63 - 1, what="an integer")
        if request_id in self._params or request_id in self._samples:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.encode(prompt)
        if not token_ids:
            raise ValueError(f"request {request_id}: the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"request {request_id}: the prompt has {len(token_ids)} tokens, "
                             f"max_model_len is {self.max_model_len} (prompt + at least one "
                             f"generated token must fit)")
        bad = [t for t in token_ids if not 0 <= t < self.input_vocab_size]
        if bad:
            raise ValueError(f"request {request_id}: token id {bad[0]} is outside the "
                             f"vocabulary [0, {self.input_vocab_size})")
        bad = [t for t in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(f"request {request_id}: logit_bias names token {bad[0]}, outside "
                             f"the vocabulary [0, {self.vocab_size})")
        points = list(part_points)
        if len(points) > MAX_PART_POINTS or \
                any(isinstance(p, bool) or not isinstance(p, int) or not 0 < p < len(token_ids)
                    for p in points):
            raise ValueError(f"request {request_id}: part_points must be at most "
                             f"{MAX_PART_POINTS} prompt positions in [1, "
                             f"{len(token_ids) - 1}], got {points[:8]}")
        points = sorted(set(points))
        if params.structured_output is not None and self.structured is None:
            raise ValueError(f"request {request_id}: structured_output needs the model's "
                             f"tokenizer, and this model has none")
        if params.n == 1:
            self._queue(self._request(request_id, token_ids, params, priority,
                                      tuple(points)))
            return
        ids = [f"{request_id}#{i}" for i in range(params.n)]
        taken = next((i for i in ids if i in self._params or i in self._samples), None)
        if taken is not None:
            raise ValueError(f"request id {taken!r} (a sample of {request_id!r}) is already "
                             f"in use")
        requests = [self._request(rid, token_ids, params.for_sample(i), priority,
                                  tuple(points))
                    for i, rid in enumerate(ids)]
        self._samples[request_id] = ids
        for i, rid in enumerate(ids):
            self._sample_of[rid] = (request_id, i)
        self._queue(requests[0])
        self._held[ids[0]] = requests[1:]

    def num_samples(self, request_id: str) -> int:
        """How many outputs finish for a queued request (its n)."""
        return len(self._samples.get(request_id, [request_id]))

    def _request(self, request_id: str, token_ids: list[int], params: SamplingParams,
                 priority: int, part_points: tuple[int, ...] = ()) -> Request:
        request = Request(request_id, token_ids, params,
                          hash_block_size=self.plan.config.hash_block_size,
                          eos_token_ids=self.eos_token_ids, arrival_index=self._next_index,
                          priority=priority, block_hasher=self.kv_manager.block_hasher,
                          part_points=part_points)
        self._next_index += 1
        self._params[request_id] = params
        if params.structured_output is not None:
            assert self.structured is not None  # checked in add_request
            # Compiles on the manager's threads (or is cached): it is admitted when ready.
            request.grammar = self.structured.grammar_for(params.structured_output)
            self._compiling[request_id] = request
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
        return request

    def _queue(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def _release_held(self) -> None:
        """Queue the samples waiting on a first sample that has computed its prompt (or
        ended): from here on its prompt blocks are in the prefix cache."""
        for first, waiting in list(self._held.items()):
            request = self.scheduler.requests.get(first)
            if request is None or request.num_computed_tokens >= request.num_prompt_tokens:
                del self._held[first]
                for held in waiting:
                    self._queue(held)

    def abort_request(self, request_id: str) -> None:
        """Abort a request (all its samples when n > 1) and free its blocks."""
        for rid in self._samples.pop(request_id, [request_id]):
            self._held.pop(rid, None)
            request = self.scheduler.requests.get(rid)
            if request is not None:
                self.scheduler.finish([request], RequestStatus.FINISHED_ABORTED)
            self._forget(rid)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._held)

    # ---------------------------------------------------------------- structured output
    def _poll_grammars(self) -> list[RequestOutput]:
        """Take the grammars compiled since the last step; fail the requests whose grammar
        could not be compiled (alone: nothing else is affected)."""
        failed = []
        for rid, request in list(self._compiling.items()):
            if rid not in self.scheduler.requests:
                continue  # a held sample of n: polled once it is queued
            assert request.grammar is not None
            error = request.grammar.poll()
            if error is not None:
                failed.append(self._fail(request, error))
            elif request.grammar.ready:
                del self._compiling[rid]
        return failed

    def _wait_for_grammars(self, timeout: float) -> None:
        """Nothing could be scheduled: rather than spin, wait a little for a compile."""
        pending = [r.grammar.compiling for r in self._compiling.values()
                   if r.grammar is not None]
        if pending:
            wait_futures(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def _step_grammars(self, out: SchedulerOutput) -> None:
        """The grammars of the constrained requests that sample in this step (their
        scheduled tokens reach their last known token); masks are computed where needed."""
        rows = []
        for rid, num in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[rid]
            if request.grammar is not None and \
                    request.num_computed_tokens + num == request.num_tokens:
                rows.append((rid, request.grammar))
        if rows:
            from hybridkv.sched.structured.manager import StepGrammars

            assert self.structured is not None
            out.grammars = StepGrammars(self.structured, [rid for rid, _ in rows],
                                        [grammar for _, grammar in rows])

    def _advance_grammar(self, request: Request) -> RequestStatus | None:
        """Feed the sampled token to the request's grammar; STOPPED once the grammar has
        ended (only EOS could follow)."""
        grammar = request.grammar
        if grammar is None:
            return None
        error = grammar.accept(request.token_ids[-1])
        if error is not None:
            raise RuntimeError(error)
        return RequestStatus.FINISHED_STOPPED if grammar.finished else None

    # ---------------------------------------------------------------- KV events
    def _start_kv_events(self) -> KVEventPublisher | None:
        """The KV event publisher, when configured; the pool (and the tiers) then log events
        that each step hands to it."""
        config = self.config
        if config.kv_events_endpoint is None:
            return None
        publisher = KVEventPublisher(
            config.kv_events_endpoint, groups=group_infos(self.plan.config),
            topic=DEFAULT_TOPIC if config.kv_events_topic is None else config.kv_events_topic,
            replay_endpoint=config.kv_events_replay_endpoint,
            port_offset=config.replica_index, max_queue=config.kv_events_queue or DEFAULT_QUEUE)
        self.kv_manager.pool.kv_events = []
        if self.connector is not None:
            self.connector.enable_kv_events()  # the tiers' stores and removals too
        return publisher

    def _publish_kv_events(self) -> None:
        """Hand the events since the last call to the publisher (it never blocks)."""
        pool = self.kv_manager.pool
        if self.kv_events is None or pool.kv_events is None:
            return
        if self.connector is not None:
            # The offload thread logged these; taking them never waits on it.
            pool.kv_events.extend(self.connector.take_kv_events())
        if pool.kv_events:
            events, pool.kv_events = pool.kv_events, []
            self.kv_events.publish(events)

    # ---------------------------------------------------------------- one step
    def step(self) -> list[RequestOutput]:
        try:
            return self._step()
        finally:
            if self.kv_events is not None:
                self._publish_kv_events()

    def _step(self) -> list[RequestOutput]:
        if self._held:
            self._release_held()
        outputs = self._poll_grammars() if self._compiling else []
        out = self.scheduler.schedule()
        outputs += [self._fail(request, "it does not fit in the KV cache even alone (raise "
                               "kv_cache_memory or lower max_model_len)")
                    for request in self.scheduler.take_never_fitting()]
        if not out.num_scheduled_tokens:
            if self._compiling:
                self._wait_for_grammars(timeout=0.05)
            meta = out.kv_connector_meta
            if meta is not None and meta.has_work:
                self.runner.execute(out)  # copies and loads only
            if self.connector is not None and self.connector.has_loads:
                self.connector.wait(timeout=0.5)  # nothing to compute until a load is done
            return outputs
        try:
            if self.structured is not None:
                self._step_grammars(out)
            result = self.runner.execute(out)
        except Exception as e:
            # The forward itself failed: no request can be blamed, so the step's requests
            # end with the error and the engine stays usable for the next ones.
            logger.exception("a step of %d requests failed", len(out.num_scheduled_tokens))
            message = f"the step failed: {type(e).__name__}: {e}"
            return outputs + [self._fail(self.scheduler.requests[rid], message, computed=False)
                              for rid in out.num_scheduled_tokens
                              if rid in self.scheduler.requests]
        for rid, message in result.errors.items():
            logger.warning("request %s failed: %s", rid, message)
            outputs.append(self._fail(self.scheduler.requests[rid], message))
        updated = self.scheduler.update_from_output(out, result.sampled, result.accepted,
                                                    result.drafts)
        finished: dict[RequestStatus, list[Request]] = {}
        for request in updated:
            rid = request.request_id
            # With accepted drafts a step brings several tokens: each is taken as a step of
            # its own would take it, and those after a stop are dropped.
            later = request.token_ids[request.num_tokens - request.num_new_tokens + 1:]
            if later:
                request.truncate(request.num_tokens - len(later))
            new_text = ""
            try:
                if rid in result.logprobs:  # (a request with drafts asks for none)
                    request.output_logprobs.append(result.logprobs[rid])
                while True:
                    status = self._check_stop(request)
                    grammar_status = self._advance_grammar(request)
                    status = status or grammar_status
                    text, stopped = self._detokenize(request, final=status is not None)
                    new_text += text
                    if stopped and status is None:
                        status = RequestStatus.FINISHED_STOPPED
                    if status is not None or not later:
                        break
                    request.append_token_ids([later.pop(0)])
            except Exception as e:
                logger.exception("request %s failed after its step", rid)
                outputs.append(self._fail(request, f"{type(e).__name__}: {e}"))
                continue
            request.num_new_tokens -= len(later)
            if status is not None:
                finished.setdefault(status, []).append(request)
            outputs.append(self._output(request, status, new_text))
        for status, requests in finished.items():
            self.scheduler.finish(requests, status)
            for request in requests:
                self._forget(request.request_id)
        return outputs

    def _fail(self, request: Request, message: str, *, computed: bool = True) -> RequestOutput:
        """Finish one request with an error, free its blocks, report it. `computed=False`:
        this step's KV of the request was never written, so its blocks must not stay
        hit-able."""
        self.scheduler.finish([request], RequestStatus.FINISHED_ERROR, computed=computed)
        output = self._output(request, RequestStatus.FINISHED_ERROR, "", new_token=False)
        self._forget(request.request_id)
        output.error = f"request {request.request_id}: {message}"
        return output

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        token = request.token_ids[-1]
        if not params.ignore_eos and token in request.eos_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or \
                request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _detokenize(self, request: Request, *, final: bool) -> tuple[str, bool]:
        """(new text, whether a stop string ended the request there)."""
        detokenizer = self._detokenizers.get(request.request_id)
        if detokenizer is None:
            return "", False
        new_text, stop = detokenizer.add(request.output_token_ids, final=final)
        if stop is not None:
            request.stop_reason = stop
        return new_text, stop is not None

    def _output(self, request: Request, status: RequestStatus | None,
                new_text: str, *, new_token: bool = True) -> RequestOutput:
        rid = request.request_id
        detokenizer = self._detokenizers.get(rid)
        parent, index = self._sample_of.get(rid, (rid, 0))
        return RequestOutput(
            request_id=parent, index=index, prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=detokenizer.text if detokenizer else "",
            finished=status is not None, finish_reason=status.value if status else None,
            logprobs=list(request.output_logprobs) if request.sampling_params.logprobs
            is not None else None,
            new_token_ids=request.token_ids[request.num_tokens - request.num_new_tokens:]
            if new_token else [],
            new_text=new_text,
            stop_reason=request.stop_reason if status is not None else None,
            num_cached_tokens=request.num_cached_tokens or 0,
            cached_tokens_by_tier={**NO_CACHED_TOKENS, **request.cached_tokens_by_tier},
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens)

    # ---------------------------------------------------------------- the KV cache
    def reset_prefix_cache(self) -> bool:
        """Forget the device prefix cache (offload tiers keep theirs; with the "evict" store
        policy the device's cached blocks go to them first). Refused (False) while requests
        hold blocks."""
        done = self.kv_manager.reset_prefix_cache()
        self._publish_kv_events()
        return done

    def offload_stats(self) -> dict[str, Any] | None:
        """Per tier: lookups, hits, hit tokens, bytes and seconds of loads and stores,
        evictions, rejected entries; None without offloading."""
        return self.connector.stats_summary() if self.connector is not None else None

    def close(self) -> None:
        """Write the device prefix cache to the tiers (store policy "evict": the device
        cache goes away now), finish queued tier writes and stop the offload thread."""
        if self.structured is not None:
            self.structured.close()  # compiles still queued are dropped
        self._close_connector()
        if self.kv_events is not None:  # after the tiers' last writes: those are announced
            self._publish_kv_events()
            self.kv_events.close()
            self.kv_manager.pool.kv_events = None  # nobody drains it any more

    def _close_connector(self) -> None:
        worker = getattr(self.runner, "connector", None)
        if self._closed or self.connector is None or worker is None:
            return
        self._closed = True
        if not self.scheduler.running:
            self.connector.store_all_cached()
            meta = self.connector.build_meta()
            if meta.has_work:
                worker.before_forward(meta)
        worker.close()

    def _forget(self, request_id: str) -> None:
        self._params.pop(request_id, None)
        self._compiling.pop(request_id, None)
        self._detokenizers.pop(request_id, None)
        sample = self._sample_of.pop(request_id, None)
        if sample is not None:
            parent = sample[0]
            remaining = self._samples.get(parent)
            if remaining is not None and not any(r in self._sample_of for r in remaining):
                del self._samples[parent]
