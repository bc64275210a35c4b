"""/v1/completions and /v1/chat/completions, OpenAI's API: its request bodies onto the
core's engine requests (serving.py), the outputs back as one response or as server-sent
events."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from hybridkv.engine.outputs import RequestOutput
from hybridkv.sched.structured import StructuredOutput
from hybridkv.server import protocol as p
from hybridkv.server.async_engine import RequestStream
from hybridkv.server.errors import bad_request, error_body
from hybridkv.server.reasoning import starts_inside
from hybridkv.server.replies import ReplyStream, parse_reply
from hybridkv.server.serving import (
    ServerState,
    choice_index,
    completion_prompts,
    finish_reason,
    finished_outputs,
    max_tokens_for,
    merged,
    sampling_params,
    sse,
    streaming,
    usage_of,
)
from hybridkv.server.structured import check_tool_schemas, compile_or_400, request_spec
from hybridkv.server.tools import ToolUse, parse_calls, parse_tools

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
    text, prompt = await state.render_and_tokenize(body.messages, body.add_generation_prompt,
                                                   use)
    # A reply held to a grammar (a forced call, a schema) has no room to think.
    thinks = state.thinks and spec is None
    inside = thinks and starts_inside(text)
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
    points = await state.part_points(body.messages, prompt, use)
    streams = await state.submit(base_id, [prompt], [params], points)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return streaming(state, streams, chat_chunks(state, body, base_id, streams,
                                                     include_usage, use, thinks, inside))
    finals = await finished_outputs(state, request, streams)
    if finals is None:
        return Response(status_code=499)  # the client went away: nobody to answer
    choices = [chat_choice(state, body, out, use, k, thinks, inside) for out in finals]
    response = p.ChatCompletionResponse(id=base_id, model=state.model_name, choices=choices,
                                        usage=usage_of(streams, finals))
    return JSONResponse(response.model_dump())


def chat_choice(state: ServerState, body: p.ChatCompletionRequest, out: RequestOutput,
                use: ToolUse, k: int, thinks: bool = False, inside: bool = False
                ) -> p.ChatChoice:
    message: p.AssistantMessage
    if thinks:  # the reasoning apart, then the calls or content in the rest
        reply = parse_reply(out.text, use, thinks=True, inside=inside)
        calls = reply.calls
        message = p.ThinkingMessage(
            content=None if calls else reply.content,
            tool_calls=[p.ToolCall(**c) for c in calls] if calls else None,
            reasoning_content=reply.reasoning or None, reasoning=reply.reasoning or None)
    else:
        calls = parse_calls(out.text, use) if use.parses_calls else None
        message = p.AssistantMessage(content=None, tool_calls=[
            p.ToolCall(**c) for c in calls]) if calls else p.AssistantMessage(content=out.text)
    return p.ChatChoice(index=out.index, message=message,
                        finish_reason=use.finish_reason(out.finish_reason, bool(calls)),
                        stop_reason=out.stop_reason,
                        logprobs=chat_logprobs(state, out, out.token_ids, 0, k)
                        if body.logprobs else None)


async def chat_chunks(state: ServerState, body: p.ChatCompletionRequest, base_id: str,
                      streams: list[RequestStream], include_usage: bool, use: ToolUse,
                      thinks: bool = False, inside: bool = False) -> AsyncIterator[str]:
    def chunk(index: int, delta: p.Delta, reason: str | None = None,
              logprobs: p.ChatLogprobs | None = None) -> str:
        return sse(p.ChatCompletionChunk(id=base_id, model=state.model_name, choices=[
            p.ChatChunkChoice(index=index, delta=delta, finish_reason=reason,
                              logprobs=logprobs)]))

    for index in range(streams[0].n):
        yield chunk(index, p.Delta(role="assistant", content=""))
    # Per choice: text that could be a tool call is held back until the choice ends; the
    # reasoning (a model that thinks) goes apart.
    replies = [ReplyStream(use, thinks=thinks, inside=inside)
               for _ in range(streams[0].n)]
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
            split = replies[out.index].feed(out.new_text)
            text, reasoning = split.content, split.reasoning
            reason = finish_reason(out)
            if out.finished:
                finals.append(out)
                rest, found = replies[out.index].finish()
                text += rest.content
                reasoning += rest.reasoning
            if reasoning:
                batch.append(chunk(out.index, p.ThinkingDelta(
                    reasoning_content=reasoning, reasoning=reasoning)))
            if out.finished:
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
