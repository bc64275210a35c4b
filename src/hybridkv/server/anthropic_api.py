"""/v1/messages and /v1/messages/count_tokens, Anthropic's Messages API, over the core
(serving.py): its request onto one chat reply, the reply back as content blocks.

    request                               core
    system (string or text blocks)        a system message
    messages: text blocks                 user / assistant text
              tool_use blocks             an assistant's earlier tool calls
              tool_result blocks          tool messages, in their place
              thinking blocks             dropped (templates drop earlier reasoning too)
    tools, tool_choice auto|any|tool|none ToolUse auto|required|named|none
    max_tokens, temperature, top_p,       SamplingParams
    top_k, stop_sequences

    reply        thinking block (a reasoning parser), text block, tool_use blocks
    stop_reason  tool_use | max_tokens | stop_sequence | end_turn
    usage        input_tokens: prompt tokens computed; cache_read_input_tokens: those a
                 prefix hit reused (input_tokens + cache_read_input_tokens = the prompt)

Streamed, the events are Anthropic's: message_start, ping, content_block_start / _delta /
_stop per block, message_delta (stop reason, output tokens), message_stop. Errors use
Anthropic's envelope, `{"type": "error", "error": {"type", "message"}}`. Images and
documents are refused with a 400.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, model_validator

from hybridkv.engine.outputs import RequestOutput
from hybridkv.sched.structured import StructuredOutput
from hybridkv.server import protocol as p
from hybridkv.server.errors import bad_request, register_envelope
from hybridkv.server.protocol import Items
from hybridkv.server.reasoning import Split
from hybridkv.server.serving import (
    ChatJob,
    ChatTurn,
    ServerState,
    event_stream,
    finished_outputs,
    merged,
)
from hybridkv.server.tools import ToolUse, parse_tools

BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


register_envelope("/v1/messages", error_body)


# ---------------------------------------------------------------- request

class TextBlock(p.Request):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # accepted: prefix caching is automatic
    citations: Items[dict[str, Any]] | None = None


class ToolUseBlock(p.Request):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(p.Request):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | Items[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            p.refuse_unknown_types(data["content"], ("text",), "blocks")
        return data

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            text = "".join(block.text for block in self.content)
        else:
            text = self.content or ""
        return f"error: {text}" if self.is_error else text


class ThinkingBlock(p.Request):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(p.Request):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
                  | RedactedThinkingBlock, Field(discriminator="type")]


class MessageParam(p.Request):
    role: Literal["user", "assistant"]
    content: str | Items[Block]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            p.refuse_unknown_types(data["content"], BLOCK_TYPES, "blocks")
        return data


class ToolParam(p.Request):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None  # a forced call follows the schema whatever this says


class ToolChoiceParam(p.Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None  # a forced call is one call anyway


class ThinkingParam(p.Request):
    """Whether the reply's thinking is shown: a local model thinks as its template says,
    whatever the budget."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None

    @property
    def shown(self) -> bool:
        return self.type != "disabled" and self.display != "omitted"


class OutputFormatParam(p.Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfigParam(p.Request):
    format: OutputFormatParam | None = None
    # Accepted, as a hint a local model has no levels for.
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class CountTokensRequest(p.Request):
    model: str
    messages: Items[MessageParam] = Field(min_length=1)
    system: str | Items[TextBlock] | None = None
    tools: Items[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: Items[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # {"user_id": ...}: accepted, as OpenAI's user
    output_config: OutputConfigParam | None = None  # format: a JSON schema the reply follows
    cache_control: dict[str, Any] | None = None  # accepted: prefix caching is automatic
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here


# ---------------------------------------------------------------- request -> core

def chat_messages(body: CountTokensRequest) -> list[p.ChatMessage]:
    """The conversation as the core's messages: tool results become tool messages where
    they stand, an assistant's tool_use blocks its earlier calls."""
    out: list[p.ChatMessage] = []
    if body.system:
        system = body.system if isinstance(body.system, str) \
            else "\n".join(block.text for block in body.system)
        out.append(p.ChatMessage(role="system", content=system))
    for message in body.messages:
        blocks = [TextBlock(type="text", text=message.content)] \
            if isinstance(message.content, str) else message.content
        if message.role == "assistant":
            text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
            calls = [p.MessageToolCall(id=b.id, function=p.CalledFunction(
                name=b.name, arguments=b.input)) for b in blocks if isinstance(b, ToolUseBlock)]
            out.append(p.ChatMessage(role="assistant", content=text, tool_calls=calls or None))
            continue
        text = ""
        for block in blocks:
            if isinstance(block, ToolResultBlock):
                if text:
                    out.append(p.ChatMessage(role="user", content=text))
                    text = ""
                out.append(p.ChatMessage(role="tool", content=block.text,
                                         tool_call_id=block.tool_use_id))
            elif isinstance(block, TextBlock):
                text += block.text
            else:
                raise bad_request(f"a user message cannot hold a {block.type} block",
                                  "messages")
        if text or not out or out[-1].role != "tool":
            out.append(p.ChatMessage(role="user", content=text))
    return out


def tool_use(body: CountTokensRequest) -> ToolUse:
    tools = [p.Tool(function=p.FunctionDefinition(name=t.name, description=t.description,
                                                  parameters=t.input_schema))
             for t in body.tools or []]
    choice = body.tool_choice
    if choice is None:
        return parse_tools(tools, None)
    if choice.type == "tool":
        if not choice.name:
            raise bad_request('tool_choice {"type": "tool"} needs the tool\'s "name"',
                              "tool_choice")
        return parse_tools(tools, p.NamedToolChoice(type="function",
                                                    function=p.NamedFunction(name=choice.name)))
    if choice.type != "none" and not tools:
        raise bad_request(f"tool_choice {choice.type!r} needs tools", "tool_choice")
    return parse_tools(tools, {"any": "required"}.get(choice.type, choice.type))


async def count_tokens(state: ServerState, body: CountTokensRequest) -> dict[str, int]:
    state.check_model(body.model)
    use = tool_use(body)
    ids = await state.tokenize_chat(chat_messages(body), True, use)
    return {"input_tokens": len(ids)}


async def create_message(state: ServerState, body: MessagesRequest,
                         request: Request) -> Response:
    state.check_model(body.model)
    values: dict[str, Any] = {"temperature": 1.0 if body.temperature is None
                              else body.temperature}
    for name, value in (("top_p", body.top_p), ("top_k", body.top_k),
                        ("stop", body.stop_sequences)):
        if value is not None:
            values[name] = value
    spec, spec_param = None, ""
    if body.output_config is not None and body.output_config.format is not None:
        spec_param = "output_config.format.schema"
        try:
            spec = StructuredOutput(json_schema=body.output_config.format.schema_)
        except ValueError as e:
            raise bad_request(f"{spec_param}: {e}", "output_config") from None
    turn = await state.start_chat(
        f"msg_{uuid.uuid4().hex}", chat_messages(body), tool_use(body), ChatJob(
            values=values, max_tokens=body.max_tokens, max_tokens_param="max_tokens",
            spec=spec, spec_param=spec_param, names={"stop": "stop_sequences"}))
    show_thinking = body.thinking is None or body.thinking.shown
    message_id = turn.base_id
    if body.stream:
        return event_stream(state, turn.streams, events(
            state, body, turn, message_id, show_thinking),
            on_dead=lambda m: event("error", error_body(503, m)))
    finals = await finished_outputs(state, request, turn.streams)
    if finals is None:
        return Response(status_code=499)
    [out] = finals
    reply = turn.reply(out.text)
    content: list[dict[str, Any]] = []
    if reply.reasoning and show_thinking:
        content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        content.append({"type": "text", "text": reply.content})
    content += [tool_use_block(call) for call in reply.calls or []]
    reason, sequence = stop_reason(body, out, bool(reply.calls))
    return JSONResponse({
        "id": message_id, "type": "message", "role": "assistant", "model": state.model_name,
        "content": content, "stop_reason": reason, "stop_sequence": sequence,
        "usage": usage(turn, out)})


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
            "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


def stop_reason(body: MessagesRequest, out: RequestOutput, has_calls: bool
                ) -> tuple[str, str | None]:
    if has_calls:
        return "tool_use", None
    if out.finish_reason == "length":
        return "max_tokens", None
    if isinstance(out.stop_reason, str) and out.stop_reason in (body.stop_sequences or ()):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def usage(turn: ChatTurn, out: RequestOutput, *, output_tokens: int | None = None
          ) -> dict[str, int]:
    prompt = turn.streams[0].num_prompt_tokens
    return {"input_tokens": prompt - out.num_cached_tokens,
            "output_tokens": len(out.token_ids) if output_tokens is None else output_tokens,
            "cache_read_input_tokens": out.num_cached_tokens,
            "cache_creation_input_tokens": 0}


# ---------------------------------------------------------------- streaming

def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"


class Blocks:
    """The content blocks of a streamed message: one open at a time, each started and
    stopped around its deltas."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def write(self, kind: str, text: str) -> list[str]:
        if not text:
            return []
        out = []
        if self.open != kind:
            out += self.close()
            self.index += 1
            self.open = kind
            start = {"type": "text", "text": ""} if kind == "text" \
                else {"type": "thinking", "thinking": "", "signature": ""}
            out.append(event("content_block_start",
                             {"index": self.index, "content_block": start}))
        delta = {"type": "text_delta", "text": text} if kind == "text" \
            else {"type": "thinking_delta", "thinking": text}
        out.append(event("content_block_delta", {"index": self.index, "delta": delta}))
        return out

    def split(self, split: Split, show_thinking: bool) -> list[str]:
        return self.write("thinking", split.reasoning if show_thinking else "") + \
            self.write("text", split.content)

    def tool_use(self, call: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        block = tool_use_block(call)
        out.append(event("content_block_start", {"index": self.index, "content_block": {
            **block, "input": {}}}))
        out.append(event("content_block_delta", {"index": self.index, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(block["input"])}}))
        return out + self.close()

    def close(self) -> list[str]:
        was, self.open = self.open, None
        return [event("content_block_stop", {"index": self.index})] if was else []


async def events(state: ServerState, body: MessagesRequest, turn: ChatTurn,
                 message_id: str, show_thinking: bool) -> AsyncIterator[str]:
    reply = turn.reply_stream()
    blocks = Blocks()
    started = False
    batch: list[str] = []
    async for _, out, more in merged(turn.streams):
        if not started:  # the first output knows the prompt's cached tokens
            started = True
            batch.append(event("message_start", {"message": {
                "id": message_id, "type": "message", "role": "assistant", "content": [],
                "model": state.model_name, "stop_reason": None, "stop_sequence": None,
                "usage": usage(turn, out, output_tokens=0)}}))
            batch.append(event("ping", {}))
        if out.error:
            batch.append(event("error", error_body(500, out.error)))
            break
        batch += blocks.split(reply.feed(out.new_text), show_thinking)
        if out.finished:
            rest, calls = reply.finish()
            batch += blocks.split(rest, show_thinking)
            for call in calls or []:
                batch += blocks.tool_use(call)
            batch += blocks.close()
            reason, sequence = stop_reason(body, out, bool(calls))
            batch.append(event("message_delta", {
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": len(out.token_ids)}}))
            batch.append(event("message_stop", {}))
        if batch and not more:
            yield "".join(batch)
            batch.clear()
    if batch:
        yield "".join(batch)


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/messages", response_model=None)
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await create_message(state, body, request)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(body: CountTokensRequest) -> dict[str, int]:
        return await count_tokens(state, body)
