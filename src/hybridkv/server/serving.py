"""/v1/completions and /v1/chat/completions: a request body in, engine requests out, and
their outputs back as one response or as server-sent events.

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
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
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
from hybridkv.server.structured import check_tool_schemas, compile_or_400, request_spec
from hybridkv.server.tools import (
    CallStream,
    ToolUse,
    describe,
    parse_calls,
    parse_tools,
    render_call,
)

RETRY_AFTER_S = "1"


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
        def render_and_encode() -> list[int]:
            text = self.render_chat(messages, add_generation_prompt, use)
            self.check_length(text, "messages")
            return self.encode(text, "messages", add_special_tokens=False)

        return await asyncio.to_thread(render_and_encode)

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
                    use: ToolUse | None = None) -> str:
        if self.chat_template is None:
            raise bad_request(NO_TEMPLATE, "messages")
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
            raise bad_request(str(e), "messages") from None

    # ------------------------------------------------------------ queueing
    async def submit(self, base_id: str, prompts: list[list[int]],
                     params: list[SamplingParams]) -> list[RequestStream]:
        """Queue one engine request per prompt, all or none."""
        streams: list[RequestStream] = []
        try:
            for i, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
                streams.append(await self.engine.add(f"{base_id}-{i}", ids, sp))
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


async def collect(state: ServerState, request: Request, streams: list[RequestStream]
                  ) -> list[RequestOutput] | None:
    """Every sample's final output, in choice order; None (all aborted) if the client went
    away first."""
    finals: list[RequestOutput | None] = [None] * sum(s.n for s in streams)

    async def gather() -> None:
        async for index, out, _ in merged(streams):
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
                           streams: list[RequestStream]) -> list[RequestOutput] | None:
    """`collect`, with the engine's failures as API errors: 503 when it died, 500 when a
    request failed inside a step."""
    try:
        finals = await collect(state, request, streams)
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
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except EngineDeadError as e:
            yield sse(error_body(503, str(e)))
        finally:
            # The client went away (the response was cancelled) or we are done.
            state.abort_unfinished(streams)
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finished else None


# ---------------------------------------------------------------- /v1/completions

def completion_logprobs(state: ServerState, out: RequestOutput, token_ids: Sequence[int],
                        first: int, offset: int, k: int) -> p.CompletionLogprobs:
    """OpenAI's legacy logprobs for `token_ids`, the generated tokens from index `first`."""
    result = p.CompletionLogprobs()
    entries = (out.logprobs or [])[first:first + len(token_ids)]
    for token, entry in zip(token_ids, entries, strict=False):
        text = state.decode([token])
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        result.tokens.append(text)
        result.token_logprobs.append(entry.get(token))
        result.top_logprobs.append({state.decode([t]): lp for t, lp in top})
        result.text_offset.append(offset)
        offset += len(text)
    return result


async def create_completion(state: ServerState, body: p.CompletionRequest,
                            request: Request) -> Response:
    state.check_model(body.model)
    spec, spec_param = request_spec(body)
    prompts = await completion_prompts(state, body.prompt)
    params = [sampling_params(body, logprobs=body.logprobs, max_tokens=max_tokens_for(
        body.max_tokens, ids, state.max_model_len, "max_tokens"), structured_output=spec)
        for ids in prompts]
    if spec is not None:
        await compile_or_400(state.engine.engine, spec, spec_param)
    # echo: the prompt's text before each choice's (a prompt of token ids, decoded).
    echoes = [prompt_text(state, body.prompt, i, ids) if body.echo else ""
              for i, ids in enumerate(prompts)]
    base_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await state.submit(base_id, prompts, params)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return streaming(state, streams, completion_chunks(state, body, base_id, streams,
                                                           include_usage, echoes))
    finals = await finished_outputs(state, request, streams)
    if finals is None:
        return Response(status_code=499)  # the client went away: nobody to answer
    n = streams[0].n
    choices = [p.CompletionChoice(
        index=i, text=echoes[i // n] + out.text, finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        logprobs=completion_logprobs(state, out, out.token_ids, 0, 0, body.logprobs)
        if body.logprobs is not None else None) for i, out in enumerate(finals)]
    response = p.CompletionResponse(id=base_id, model=state.model_name, choices=choices,
                                    usage=usage_of(streams, finals))
    return JSONResponse(response.model_dump())


def prompt_text(state: ServerState, prompt: object, index: int, ids: list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and isinstance(prompt[index], str):
        return str(prompt[index])
    return state.decode(ids)


async def completion_chunks(state: ServerState, body: p.CompletionRequest, base_id: str,
                            streams: list[RequestStream], include_usage: bool,
                            echoes: Sequence[str]) -> AsyncIterator[str]:
    num_choices = sum(s.n for s in streams)
    finals: list[RequestOutput | None] = [None] * num_choices
    offsets = [0] * num_choices
    pending_echo = [bool(echoes[i // streams[0].n]) for i in range(num_choices)]
    # Every chunk has the same head; only the choice changes (built as a dict: this runs
    # once per token of every stream).
    head = {"id": base_id, "object": "text_completion", "created": int(time.time()),
            "model": state.model_name}
    batch: list[str] = []
    async for stream_index, out, more in merged(streams):
        index = choice_index(streams, stream_index, out)
        if out.finished:
            finals[index] = out
        if out.error:
            batch.append(sse(error_body(500, out.error)))
        else:
            logprobs = None
            if body.logprobs is not None and out.new_token_ids:
                first = len(out.token_ids) - len(out.new_token_ids)
                logprobs = completion_logprobs(state, out, out.new_token_ids, first,
                                               offsets[index], body.logprobs).model_dump()
            offsets[index] += len(out.new_text)
            text = out.new_text
            if pending_echo[index]:  # the prompt goes first, in the choice's first chunk
                pending_echo[index] = False
                text = echoes[stream_index] + text
            # Nothing to send for a token still being decoded (an incomplete UTF-8
            # sequence).
            if text or out.finished or logprobs is not None:
                batch.append(sse({**head, "choices": [{
                    "index": index, "text": text, "logprobs": logprobs,
                    "finish_reason": finish_reason(out), "stop_reason": out.stop_reason}],
                    "usage": None}))
        if batch and not more:
            yield "".join(batch)
            batch.clear()
    if batch:
        yield "".join(batch)
    if include_usage:
        done = [out for out in finals if out is not None]
        yield sse(p.CompletionResponse(id=base_id, model=state.model_name, choices=[],
                                       usage=usage_of(streams, done)))


# ---------------------------------------------------------------- /v1/chat/completions

def chat_logprobs(state: ServerState, out: RequestOutput, token_ids: Sequence[int],
                  first: int, k: int) -> p.ChatLogprobs:
    content = []
    entries = (out.logprobs or [])[first:first + len(token_ids)]
    for token, entry in zip(token_ids, entries, strict=False):
        text = state.decode([token])
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        content.append(p.TokenLogprob(
            token=text, logprob=entry.get(token, float("-inf")),
            bytes=list(text.encode()), top_logprobs=[
                p.TopLogprob(token=state.decode([t]), logprob=lp,
                             bytes=list(state.decode([t]).encode())) for t, lp in top]))
    return p.ChatLogprobs(content=content)


async def create_chat_completion(state: ServerState, body: p.ChatCompletionRequest,
                                 request: Request) -> Response:
    state.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    use = parse_tools(body.tools, body.tool_choice)
    await check_tool_schemas(use.tools)
    spec, spec_param = request_spec(body)
    if use.constrained:
        if spec is not None:
            raise bad_request(f"tool_choice {use.choice!r} constrains the reply to a tool "
                              f"call: {spec_param.split('.')[0]} cannot be set with it",
                              "tool_choice")
        spec, spec_param = StructuredOutput(json_schema=use.call_schema()), "tools"
    prompt = await state.tokenize_chat(body.messages, body.add_generation_prompt, use)
    state.check_prompt(prompt, "messages")
    requested = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    k = body.top_logprobs or 0
    params = sampling_params(body, logprobs=k if body.logprobs else None,
                             max_tokens=max_tokens_for(requested, prompt,
                                                       state.max_model_len, param),
                             structured_output=spec)
    if spec is not None:
        await compile_or_400(state.engine.engine, spec, spec_param)
    base_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await state.submit(base_id, [prompt], [params])
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return streaming(state, streams, chat_chunks(state, body, base_id, streams,
                                                     include_usage, use))
    finals = await finished_outputs(state, request, streams)
    if finals is None:
        return Response(status_code=499)  # the client went away: nobody to answer
    choices = [chat_choice(state, body, out, use, k) for out in finals]
    response = p.ChatCompletionResponse(id=base_id, model=state.model_name, choices=choices,
                                        usage=usage_of(streams, finals))
    return JSONResponse(response.model_dump())


def chat_choice(state: ServerState, body: p.ChatCompletionRequest, out: RequestOutput,
                use: ToolUse, k: int) -> p.ChatChoice:
    calls = parse_calls(out.text, use) if use.parses_calls else None
    message = p.AssistantMessage(content=None, tool_calls=[p.ToolCall(**c) for c in calls]) \
        if calls else p.AssistantMessage(content=out.text)
    return p.ChatChoice(index=out.index, message=message,
                        finish_reason=use.finish_reason(out.finish_reason, bool(calls)),
                        stop_reason=out.stop_reason,
                        logprobs=chat_logprobs(state, out, out.token_ids, 0, k)
                        if body.logprobs else None)


async def chat_chunks(state: ServerState, body: p.ChatCompletionRequest, base_id: str,
                      streams: list[RequestStream], include_usage: bool, use: ToolUse
                      ) -> AsyncIterator[str]:
    def chunk(index: int, delta: p.Delta, reason: str | None = None,
              logprobs: p.ChatLogprobs | None = None) -> str:
        return sse(p.ChatCompletionChunk(id=base_id, model=state.model_name, choices=[
            p.ChatChunkChoice(index=index, delta=delta, finish_reason=reason,
                              logprobs=logprobs)]))

    for index in range(streams[0].n):
        yield chunk(index, p.Delta(role="assistant", content=""))
    # Per choice: text that could be a tool call is held back until the choice ends.
    calls = [CallStream(use) for _ in range(streams[0].n)]
    finals: list[RequestOutput] = []
    batch: list[str] = []
    async for _, out, more in merged(streams):
        if out.error:
            batch.append(sse(error_body(500, out.error)))
        else:
            logprobs = None
            if body.logprobs and out.new_token_ids:
                first = len(out.token_ids) - len(out.new_token_ids)
                logprobs = chat_logprobs(state, out, out.new_token_ids, first,
                                         body.top_logprobs or 0)
            text = calls[out.index].feed(out.new_text)
            reason = finish_reason(out)
            if out.finished:
                finals.append(out)
                rest, found = calls[out.index].finish()
                text += rest
                reason = use.finish_reason(reason, bool(found))
                if found:  # each call whole in one delta; clients join deltas by index
                    batch.append(chunk(out.index, p.Delta(tool_calls=[
                        {"index": i, **call} for i, call in enumerate(found)])))
            if text or out.finished or logprobs is not None:
                batch.append(chunk(out.index, p.Delta(content=text), reason, logprobs))
        if batch and not more:  # outputs already waiting go out in one write
            yield "".join(batch)
            batch.clear()
    if batch:
        yield "".join(batch)
    if include_usage and finals:
        yield sse(p.ChatCompletionChunk(id=base_id, model=state.model_name, choices=[],
                                        usage=usage_of(streams, finals)))
