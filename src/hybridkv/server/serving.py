"""The core every API adapter stands on: tokenizing and chat templating, the engine
requests a body asks for, and the outputs they give back, whole or streamed.

    openai_api.py   anthropic_api.py   responses_api.py   ollama_api.py   (one per API)
          |                |                  |                |
    ServerState.start_chat / submit, collect / merged, ReplyStream (here, replies.py)
                                     |
                                AsyncEngine

An adapter maps its request onto `start_chat` (messages, tools, sampling values, a
structured-output spec) and the engine's outputs onto its own wire format; scheduling,
tokenizing, tool parsing, reasoning and errors live here once.

Every check that can fail runs before the first request is queued; a request whose client
goes away (mid-stream, or while waiting for a whole response) is aborted at once.
Tokenizing, detokenizing and chat templating run in threads (the tokenizer releases the
GIL), so a long prompt never holds up the event loop, /health or the other requests; a
prompt whose characters alone prove it longer than the context is refused without
tokenizing it (server/limits.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from hybridkv.engine.outputs import RequestOutput
from hybridkv.sched.sampling import SamplingParams, accepted_fields
from hybridkv.sched.structured import StructuredOutput
from hybridkv.server import protocol as p
from hybridkv.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestStream,
)
from hybridkv.server.chat import NO_TEMPLATE, ChatTemplate, ChatTemplateError
from hybridkv.server.errors import APIError, bad_request, error_body
from hybridkv.server.limits import too_long
from hybridkv.server.metrics import ServerMetrics
from hybridkv.server.reasoning import starts_inside
from hybridkv.server.replies import Reply, ReplyStream, parse_reply
from hybridkv.server.structured import check_tool_schemas, compile_or_400
from hybridkv.server.tools import (
    ToolUse,
    describe,
    render_call,
)

RETRY_AFTER_S = "1"
NO_TOOLS = ToolUse((), "none")


@dataclass
class ServerState:
    engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    model_dir: str
    tokenizer: Any | None  # tokenizers.Tokenizer
    max_model_len: int
    chat_template: ChatTemplate | None
    # The most characters one token stands for (limits.max_chars_per_token); None: no
    # character count proves a prompt too long.
    chars_per_token: int | None = None
    # Whether replies are split into reasoning and content (server/reasoning.py).
    thinks: bool = False
    # Whether state layers save checkpoints where prompts part (chats then name their
    # last messages' starts: `part_points`).
    saves_part_points: bool = False

    # ------------------------------------------------------------ checks
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves "
                                f"'{self.model_name}'", param="model")

    def encode(self, text: str, param: str = "prompt", *,
               add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids", param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids))) if self.tokenizer else ""

    # Off the event loop: a prompt within the bound below can still be ~10^6 characters,
    # seconds of tokenizing (the tokenizer and jinja2 let the loop run meanwhile).
    async def tokenize(self, texts: list[str], param: str = "prompt", *,
                       add_special_tokens: bool = True) -> list[list[int]]:
        for text in texts:
            self.check_length(text, param)

        def encode() -> list[list[int]]:
            return [self.encode(text, param, add_special_tokens=add_special_tokens)
                    for text in texts]

        return await asyncio.to_thread(encode)

    async def tokenize_chat(self, messages: list[p.ChatMessage], add_generation_prompt: bool,
                            use: ToolUse | None = None) -> list[int]:
        """The rendered chat's tokens as transformers' `apply_chat_template(tokenize=True)`
        gives them: templates print their own special tokens (`{{ bos_token }}`), so the
        tokenizer adds none (its post-processor would add a second BOS). Rendered, checked
        and tokenized in one thread hop (~0.1 ms)."""
        _, ids = await self.render_and_tokenize(messages, add_generation_prompt, use)
        return ids

    async def render_and_tokenize(self, messages: list[p.ChatMessage],
                                  add_generation_prompt: bool, use: ToolUse | None = None,
                                  param: str = "messages") -> tuple[str, list[int]]:
        """(the rendered chat, its tokens), as `tokenize_chat`."""
        def render_and_encode() -> tuple[str, list[int]]:
            text = self.render_chat(messages, add_generation_prompt, use, param)
            self.check_length(text, param)
            return text, self.encode(text, param, add_special_tokens=False)

        return await asyncio.to_thread(render_and_encode)

    async def part_points(self, messages: list[p.ChatMessage], prompt: Sequence[int],
                          use: ToolUse | None = None, param: str = "messages") -> list[int]:
        """Where the chat's last two messages start in `prompt`, its tokens: a later turn
        parts there when it edits or replaces the last message (a branch) or regenerates
        the answer before it, and a model with state layers then resumes from a checkpoint
        saved there (engine.add_request's `part_points`) instead of the last one before.
        Each is the longest common prefix of `prompt` with the earlier messages rendered
        and tokenized alone; only for models whose state layers save such checkpoints."""
        if not self.saves_part_points or len(messages) < 2:
            return []

        def find() -> list[int]:
            points = []
            for k in range(len(messages) - 1, max(0, len(messages) - 3), -1):
                try:
                    ids = self.encode(self.render_chat(messages[:k], False, use, param),
                                      param, add_special_tokens=False)
                except APIError:  # a template that cannot end there: no point
                    continue
                n = next((i for i, (a, b) in enumerate(zip(ids, prompt, strict=False))
                          if a != b), min(len(ids), len(prompt)))
                if 0 < n < len(prompt):
                    points.append(n)
            return points

        return await asyncio.to_thread(find)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return await asyncio.to_thread(self.decode, token_ids)

    def check_length(self, text: str, param: str) -> None:
        """A text longer than the context whatever its tokens: refused untokenized."""
        why = too_long(text, self.max_model_len, self.chars_per_token)
        if why is not None:
            raise bad_request(why, param)

    def check_prompt(self, token_ids: list[int], param: str = "prompt") -> None:
        if not token_ids:
            raise bad_request(f"'{param}' is empty", param)
        if len(token_ids) >= self.max_model_len:
            raise bad_request(f"the prompt has {len(token_ids)} tokens; this model's maximum "
                              f"context length is {self.max_model_len} tokens (prompt + at "
                              f"least one generated token)", param)

    def render_chat(self, messages: list[p.ChatMessage], add_generation_prompt: bool,
                    use: ToolUse | None = None, param: str = "messages") -> str:
        if self.chat_template is None:
            raise bad_request(NO_TEMPLATE, param)
        native = self.chat_template.reads_tools
        plain = [plain_message(m, native) for m in messages]
        tools = use.tools if use is not None and use.choice != "none" else ()
        if tools and not native:  # the template cannot show them: a system message does
            if plain and plain[0]["role"] == "system":
                plain[0] = {**plain[0], "content": plain[0]["content"] + "\n\n" +
                            describe(tools)}
            else:
                plain.insert(0, {"role": "system", "content": describe(tools)})
        try:
            return self.chat_template.render(
                plain, add_generation_prompt=add_generation_prompt,
                tools=[t.as_openai() for t in tools] if tools and native else None)
        except ChatTemplateError as e:
            raise bad_request(str(e), param) from None

    # ------------------------------------------------------------ queueing
    async def start_chat(self, base_id: str, messages: list[p.ChatMessage], use: ToolUse,
                         job: ChatJob, *, context: Sequence[int] = (),
                         earlier: Exchange | None = None) -> ChatTurn:
        """Queue one chat reply: the tools' schemas checked, the chat rendered and tokenized
        (after `context`, the tokens of an earlier exchange), then `start`. When the chat
        renders as `earlier`'s text and more, its prompt is `earlier`'s tokens and the rest:
        the tokens the engine already computed, reused whole by the prefix cache (the text
        tokenized again can differ from what the model wrote, and would miss from there)."""
        await check_tool_schemas(use.tools)
        text, prompt = await self.render_and_tokenize(messages, True, use, job.messages_param)
        if earlier is not None and text.startswith(earlier.text):
            [rest] = await self.tokenize([text[len(earlier.text):]], job.messages_param,
                                         add_special_tokens=False)
            prompt = [*earlier.token_ids, *rest]
        points = await self.part_points(messages, prompt, use, job.messages_param)
        return await self.start(base_id, [*context, *prompt], job, use=use,
                                prompt_text=None if context else text,
                                inside=self.thinks and starts_inside(text),
                                part_points=[len(context) + n for n in points])

    async def start(self, base_id: str, prompt: list[int], job: ChatJob, *,
                    use: ToolUse = NO_TOOLS, inside: bool = False,
                    prompt_text: str | None = None,
                    part_points: Sequence[int] = ()) -> ChatTurn:
        """Queue one reply to `prompt`: a constrained tool_choice turned into the reply's
        grammar, the sampling values checked, the grammar compiled; every failure a 400
        before anything is queued."""
        spec, spec_param = job.spec, job.spec_param
        if use.constrained:
            if spec is not None:
                raise bad_request(f"a tool choice that forces a call constrains the reply: "
                                  f"{spec_param} cannot be set with it", spec_param)
            spec, spec_param = StructuredOutput(json_schema=use.call_schema()), "tools"
        self.check_prompt(prompt, job.messages_param)
        max_tokens = max_tokens_for(job.max_tokens, prompt, self.max_model_len,
                                    job.max_tokens_param)
        params = engine_params({**job.values, "max_tokens": max_tokens,
                                "structured_output": spec}, job.names)
        if spec is not None:
            await compile_or_400(self.engine.engine, spec, spec_param)
        streams = await self.submit(base_id, [prompt], [params], part_points)
        # A reply held to a grammar (a forced call, a schema) has no room to think.
        thinks = self.thinks and spec is None
        return ChatTurn(streams=streams, prompt=prompt, prompt_text=prompt_text, use=use,
                        thinks=thinks, inside=thinks and inside)

    async def submit(self, base_id: str, prompts: list[list[int]],
                     params: list[SamplingParams],
                     part_points: Sequence[int] = ()) -> list[RequestStream]:
        """Queue one engine request per prompt, all or none (`part_points`: of a single
        chat prompt, see `part_points`)."""
        streams: list[RequestStream] = []
        try:
            for i, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
                streams.append(await self.engine.add(f"{base_id}-{i}", ids, sp, part_points))
        except BaseException as e:
            for stream in streams:
                self.engine.abort(stream.request_id)
            if isinstance(e, ValueError):
                message = str(e).split(": ", 1)[-1] if str(e).startswith("request ") \
                    else str(e)
                param = next((f for f in accepted_fields() if message.startswith(f)),
                             "prompt")
                raise bad_request(message, param) from None
            if isinstance(e, QueueFullError):
                raise APIError(503, f"the server is busy ({e}); retry later",
                               headers={"Retry-After": RETRY_AFTER_S}) from None
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e)) from None
            raise
        return streams

    def abort_unfinished(self, streams: Sequence[RequestStream]) -> None:
        for stream in streams:
            if not stream.ended:
                stream.ended = True
                self.engine.abort(stream.request_id)
                self.metrics.finish(stream.request_id, "abort", stream)


def plain_message(m: p.ChatMessage, native_tools: bool) -> dict[str, Any]:
    """A message as templates read it. Earlier tool calls go to a template with tool support
    as OpenAI's `tool_calls`; to one without, as the JSON the model was asked to write."""
    message: dict[str, Any] = {"role": m.role, "content": m.text}
    if m.name:
        message["name"] = m.name
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        if native_tools:
            message["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
        else:
            message["content"] = "\n".join([m.text] * bool(m.text) +
                                           [render_call(c) for c in m.tool_calls])
    return message


@dataclass(frozen=True, kw_only=True)
class ChatJob:
    """What an API asks of one chat reply, in the engine's terms, with the API's own field
    names for its errors."""

    values: dict[str, Any]  # SamplingParams fields (max_tokens and the grammar apart)
    max_tokens: int | None  # None: up to the context's end
    max_tokens_param: str
    messages_param: str = "messages"
    spec: StructuredOutput | None = None
    spec_param: str = ""
    names: dict[str, str] = field(default_factory=dict)  # engine field -> API field


@dataclass(frozen=True)
class Exchange:
    """An earlier prompt and its reply: the text, and the tokens the engine computed."""

    text: str
    token_ids: list[int]


@dataclass(frozen=True, kw_only=True)
class ChatTurn:
    """A queued chat reply: its stream, and how to read its text."""

    streams: list[RequestStream]
    prompt: list[int]
    prompt_text: str | None  # the rendered chat; None: a prompt of tokens
    use: ToolUse
    thinks: bool
    inside: bool  # the prompt opened the thinking

    @property
    def base_id(self) -> str:
        return self.streams[0].request_id.rsplit("-", 1)[0]

    def exchange(self, out: RequestOutput) -> Exchange | None:
        """The prompt and its reply, as text and tokens, for a continuation to start from;
        None when the two do not match (a stop string is in the tokens, not the text)."""
        if self.prompt_text is None or isinstance(out.stop_reason, str):
            return None
        ids = list(out.token_ids)
        if ids and out.stop_reason is not None and ids[-1] == out.stop_reason:
            ids.pop()  # EOS: the template writes its own end of turn
        return Exchange(self.prompt_text + out.text, [*self.prompt, *ids])

    def reply_stream(self) -> ReplyStream:
        return ReplyStream(self.use, thinks=self.thinks, inside=self.inside)

    def reply(self, text: str) -> Reply:
        return parse_reply(text, self.use, thinks=self.thinks, inside=self.inside)


def engine_params(values: dict[str, Any], names: dict[str, str]) -> SamplingParams:
    """SamplingParams of `values`; a bad value is a 400 naming the API's field (`names`
    maps the engine's field names to it)."""
    try:
        return SamplingParams(**values)
    except ValueError as e:
        message = str(e)
        field_name = next((f for f in accepted_fields() if message.startswith(f)), None)
        param = names.get(field_name, field_name) if field_name else None
        if field_name and param and param != field_name:
            message = param + message[len(field_name):]
        raise bad_request(message, param) from None


def sampling_params(body: p.SamplingFields, *, max_tokens: int, logprobs: int | None,
                    structured_output: StructuredOutput | None = None) -> SamplingParams:
    """The engine's params; a bad value is a 400 naming its field."""
    unsupported = p.unsupported_fields(body)
    if unsupported:
        name, what = unsupported[0]
        raise bad_request(f"{what} is not supported yet", name)
    values: dict[str, Any] = dict(
        max_tokens=max_tokens, temperature=1.0 if body.temperature is None
        else body.temperature, ignore_eos=body.ignore_eos, logprobs=logprobs,
        structured_output=structured_output)
    for name in ("top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "n",
                 "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "logit_bias"):
        value = getattr(body, name)
        if value is not None:
            values[name] = value
    try:
        return SamplingParams(**values)
    except ValueError as e:
        message = str(e)
        param = next((f for f in accepted_fields() if message.startswith(f)), None)
        raise bad_request(message, param) from None


async def completion_prompts(state: ServerState, prompt: object) -> list[list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> token ids per prompt, checked."""
    if isinstance(prompt, str):
        prompts = await state.tokenize([prompt])
    elif isinstance(prompt, list) and not prompt:
        raise bad_request("'prompt' is an empty list", "prompt")
    elif isinstance(prompt, list) and isinstance(prompt[0], str):
        prompts = await state.tokenize([str(text) for text in prompt])
    elif isinstance(prompt, list) and isinstance(prompt[0], int):
        prompts = [list(prompt)]
    else:
        prompts = [list(ids) for ids in prompt]  # type: ignore[attr-defined]
    for ids in prompts:
        state.check_prompt(ids)
    return prompts


def max_tokens_for(requested: int | None, prompt: list[int], max_model_len: int,
                   param: str) -> int:
    if requested is None:
        return max(max_model_len - len(prompt), 1)
    if requested < 1:
        raise bad_request(f"'{param}' must be >= 1, got {requested}", param)
    if len(prompt) + requested > max_model_len:
        # Refused, as vLLM does, rather than cut short at max_model_len without a word.
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens; "
                          f"the request asks for {len(prompt) + requested} ({len(prompt)} in "
                          f"the prompt, {requested} in '{param}')", param)
    return requested


def sse(chunk: BaseModel | dict[str, Any]) -> str:
    """One server-sent event. A plain dict is the per-token path: no pydantic model per
    chunk, and compact like pydantic's JSON."""
    data = chunk.model_dump_json() if isinstance(chunk, BaseModel) \
        else json.dumps(chunk, separators=(",", ":"))
    return f"data: {data}\n\n"


async def merged(streams: Sequence[RequestStream]
                 ) -> AsyncIterator[tuple[int, RequestOutput, bool]]:
    """Outputs of several streams as they come: (stream index, output, whether another
    output is already waiting). Writers gather the chunks of waiting outputs into one write:
    a server behind on a busy step catches up in one send per stream, not one per token."""
    if len(streams) == 1:
        stream = streams[0]
        async for out in stream:
            yield 0, out, stream.has_more
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except Exception as e:
            queue.put_nowait((index, e))
        queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item, not queue.empty()
    finally:
        for task in tasks:
            task.cancel()


async def until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def choice_index(streams: Sequence[RequestStream], stream_index: int,
                 out: RequestOutput) -> int:
    """Choices are prompt-major: prompt i's n samples are choices i*n .. i*n + n - 1."""
    return stream_index * streams[stream_index].n + out.index


async def collect(state: ServerState, request: Request, streams: list[RequestStream],
                  on_output: Callable[[RequestOutput], None] | None = None
                  ) -> list[RequestOutput] | None:
    """Every sample's final output, in choice order; None (all aborted) if the client went
    away first. `on_output` sees every output as it comes (an API's timings)."""
    finals: list[RequestOutput | None] = [None] * sum(s.n for s in streams)

    async def gather() -> None:
        async for index, out, _ in merged(streams):
            if on_output is not None:
                on_output(out)
            if out.finished:
                finals[choice_index(streams, index, out)] = out

    work = asyncio.ensure_future(gather())
    watch = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            state.abort_unfinished(streams)
    if not work.done() or work.cancelled():
        return None
    work.result()  # the engine died: EngineDeadError
    return [out for out in finals if out is not None]


async def finished_outputs(state: ServerState, request: Request,
                           streams: list[RequestStream],
                           on_output: Callable[[RequestOutput], None] | None = None
                           ) -> list[RequestOutput] | None:
    """`collect`, with the engine's failures as API errors: 503 when it died, 500 when a
    request failed inside a step."""
    try:
        finals = await collect(state, request, streams, on_output)
    except EngineDeadError as e:
        raise APIError(503, str(e)) from None
    if finals is not None:
        error = engine_error(finals)
        if error is not None:
            raise APIError(500, error)
    return finals


def engine_error(outputs: Sequence[RequestOutput]) -> str | None:
    return next((o.error or "the request failed" for o in outputs
                 if o.finish_reason == "error"), None)


def usage_of(streams: Sequence[RequestStream], outputs: Sequence[RequestOutput]) -> p.Usage:
    """A prompt counts once however many samples it has (as OpenAI counts it), its cached
    tokens those of its first sample (the others reuse that sample's prompt blocks)."""
    usage = p.Usage()
    prompts = {s.request_id: s.num_prompt_tokens for s in streams}
    for out in outputs:
        first = out.index == 0
        usage.add(prompts[out.request_id] if first else 0, len(out.token_ids),
                  out.num_cached_tokens if first else 0)
    return usage


def streaming(state: ServerState, streams: list[RequestStream],
              chunks: AsyncIterator[str]) -> StreamingResponse:
    """OpenAI's server-sent events: an error event when the engine dies, then [DONE]."""
    return event_stream(state, streams, chunks, on_dead=lambda m: sse(error_body(503, m)),
                        last="data: [DONE]\n\n")


def event_stream(state: ServerState, streams: list[RequestStream], chunks: AsyncIterator[str],
                 *, on_dead: Callable[[str], str], media_type: str = "text/event-stream",
                 last: str = "") -> StreamingResponse:
    """A streamed response of any API: `on_dead(message)` is its last event when the engine
    dies mid-stream; the requests are aborted when the client goes away."""
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except EngineDeadError as e:
            yield on_dead(str(e))
        finally:
            state.abort_unfinished(streams)
        if last:
            yield last

    return StreamingResponse(body(), media_type=media_type,
                             headers={"Cache-Control": "no-cache"})


def finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finished else None
