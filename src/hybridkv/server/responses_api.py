"""/v1/responses, OpenAI's Responses API, over the core (serving.py).

    request                                   core
    instructions                              a system message, first
    input: a string                           a user message
           message items (input_text parts)   messages of their role
           function_call items                an assistant's earlier tool calls
           function_call_output items         tool messages
           reasoning items                    dropped (templates drop earlier reasoning)
    tools (function), tool_choice             ToolUse
    text.format json_schema | json_object     the reply's grammar
    max_output_tokens, temperature, top_p     SamplingParams
    previous_response_id                      that response's conversation, then `input`

    output  a reasoning item (a reasoning parser), a message item (output_text), and a
            function_call item per call; status "incomplete" at max_output_tokens

Streamed, the events are the Responses API's: response.created, response.in_progress, and
per item response.output_item.added, its deltas (response.reasoning_text.delta,
response.output_text.delta inside a content part, response.function_call_arguments.delta)
and their .done events, response.output_item.done; then response.completed (or
response.incomplete). Every event carries its sequence_number.

`store` (on by default, as OpenAI's) keeps the response and its conversation in memory,
the most recent `max_stored_responses` of them (`--max-stored-responses`, oldest dropped
first); GET /v1/responses/{id} reads one back, DELETE drops it. A continuation renders the
whole conversation again, and the prefix cache already holds all of it but the new input:
the engine recomputes only the new tokens and the last partial block.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from hybridkv.engine.outputs import RequestOutput
from hybridkv.sched.structured import StructuredOutput
from hybridkv.server import protocol as p
from hybridkv.server.errors import APIError, bad_request
from hybridkv.server.protocol import Items
from hybridkv.server.replies import Reply
from hybridkv.server.serving import (
    ChatJob,
    ChatTurn,
    Exchange,
    ServerState,
    event_stream,
    finished_outputs,
    merged,
)
from hybridkv.server.tools import ToolUse, parse_tools

DEFAULT_MAX_STORED_RESPONSES = 1024
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
PART_TYPES = ("input_text", "output_text", "text")


# ---------------------------------------------------------------- request

class TextContent(p.Request):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: Items[Any] | None = None
    logprobs: Items[Any] | None = None


class MessageItem(p.Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Items[TextContent]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            p.refuse_unknown_types(data["content"], PART_TYPES, "parts")
        return data

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(p.Request):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(p.Request):
    type: Literal["function_call_output"]
    call_id: str
    output: str | Items[TextContent]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningItem(p.Request):
    type: Literal["reasoning"]
    id: str | None = None
    summary: Items[Any] = []
    content: Items[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if kind in ITEM_TYPES else None
    return None


Item = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type, custom_error_type="item_type",
                  custom_error_message=f"input items must be of type {', '.join(ITEM_TYPES)}")]


class FunctionTool(p.Request):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "function":
            raise PydanticCustomError("part_type", "tools of type {kind} are not supported; "
                                      "accepted: function",
                                      {"kind": repr(data.get("type"))[:60]})
        return data


class FunctionChoice(p.Request):
    type: Literal["function"]
    name: str


class TextFormat(p.Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(p.Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint, as effort is


class ReasoningConfig(p.Request):
    """Accepted: a local model thinks as its template says."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(p.Request):
    model: str
    input: str | Items[Item]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: Items[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled"] | None = None
    include: Items[str] | None = None  # e.g. reasoning.encrypted_content: reasoning is plain
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # accepted: prefix caching is automatic
    service_tier: str | None = None
    top_logprobs: int | None = None
    stream_options: dict[str, Any] | None = None


# ---------------------------------------------------------------- the store

@dataclass(frozen=True)
class Stored:
    conversation: list[p.ChatMessage]  # its input and its output, without instructions
    response: dict[str, Any]
    exchange: Exchange | None  # its prompt and reply, as the engine saw them


class ResponseStore:
    """The last `capacity` stored responses, by id; the oldest is dropped first."""

    def __init__(self, capacity: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: Stored) -> None:
        if self.capacity <= 0:
            return
        self._items[response_id] = stored
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str = "previous_response_id") -> Stored:
        stored = self._items.get(response_id)
        if stored is None:
            raise APIError(404, f"no stored response '{response_id}' (this server keeps the "
                                f"last {self.capacity} responses created with store: true)",
                           param=param)
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id, "response_id")
        del self._items[response_id]


# ---------------------------------------------------------------- request -> core

def input_messages(body: ResponsesRequest) -> list[p.ChatMessage]:
    if isinstance(body.input, str):
        return [p.ChatMessage(role="user", content=body.input)]
    out: list[p.ChatMessage] = []
    for item in body.input:
        if isinstance(item, MessageItem):
            out.append(p.ChatMessage(role=item.role, content=item.text))
        elif isinstance(item, FunctionCallItem):
            call = p.MessageToolCall(id=item.call_id, function=p.CalledFunction(
                name=item.name, arguments=item.arguments))
            if out and out[-1].role == "assistant" and out[-1].tool_calls:
                out[-1].tool_calls.append(call)
            else:
                out.append(p.ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            out.append(p.ChatMessage(role="tool", content=item.text,
                                     tool_call_id=item.call_id))
    return out


def structured(body: ResponsesRequest) -> tuple[StructuredOutput | None, str]:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None, ""
    if fmt.type == "json_object":
        return StructuredOutput(json_object=True), "text.format"
    if fmt.schema_ is None:
        raise bad_request("text.format.schema is missing: type json_schema needs "
                          '{"type": "json_schema", "name": ..., "schema": {...}}', "text")
    try:
        return StructuredOutput(json_schema=fmt.schema_), "text.format.schema"
    except ValueError as e:
        raise bad_request(f"text.format.schema: {e}", "text") from None


def tool_use(body: ResponsesRequest) -> ToolUse:
    tools = [p.Tool(function=p.FunctionDefinition(name=t.name, description=t.description,
                                                  parameters=t.parameters))
             for t in body.tools or []]
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        return parse_tools(tools, p.NamedToolChoice(
            type="function", function=p.NamedFunction(name=choice.name)))
    return parse_tools(tools, choice)


async def create_response(state: ServerState, store: ResponseStore, body: ResponsesRequest,
                          request: Request) -> Response:
    state.check_model(body.model)
    if body.top_logprobs:
        raise bad_request("top_logprobs is not supported on /v1/responses yet",
                          "top_logprobs")
    earlier = store.get(body.previous_response_id) \
        if body.previous_response_id is not None else None
    history = earlier.conversation if earlier is not None else []
    new = input_messages(body)
    system = [p.ChatMessage(role="system", content=body.instructions)] \
        if body.instructions else []
    values: dict[str, Any] = {"temperature": 1.0 if body.temperature is None
                              else body.temperature}
    if body.top_p is not None:
        values["top_p"] = body.top_p
    spec, spec_param = structured(body)
    turn = await state.start_chat(
        f"resp_{uuid.uuid4().hex}", [*system, *history, *new], tool_use(body), ChatJob(
            values=values, max_tokens=body.max_output_tokens,
            max_tokens_param="max_output_tokens", messages_param="input", spec=spec,
            spec_param=spec_param), earlier=earlier.exchange if earlier is not None else None)
    response = Draft(state, body, turn)
    if body.stream:
        return event_stream(state, turn.streams, events(response, store, [*history, *new]),
                            on_dead=lambda m: sse("error", {
                                "code": "server_error", "message": m, "param": None,
                                "sequence_number": 0}))
    finals = await finished_outputs(state, request, turn.streams)
    if finals is None:
        return Response(status_code=499)
    [out] = finals
    done = response.finish(out, turn.reply(out.text))
    if body.store:
        store.put(done["id"], Stored([*history, *new, *reply_messages(done)], done,
                                     turn.exchange(out)))
    return JSONResponse(done)


def reply_messages(response: dict[str, Any]) -> list[p.ChatMessage]:
    """A response's output as the conversation's next messages."""
    text, calls = "", []
    for item in response["output"]:
        if item["type"] == "message":
            text += "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            calls.append(p.MessageToolCall(id=item["call_id"], function=p.CalledFunction(
                name=item["name"], arguments=item["arguments"])))
    return [p.ChatMessage(role="assistant", content=text, tool_calls=calls or None)]


# ---------------------------------------------------------------- core -> response

class Draft:
    """A response as it is written: its fixed fields, and items as they come."""

    def __init__(self, state: ServerState, body: ResponsesRequest, turn: ChatTurn) -> None:
        self.turn = turn
        self.id = turn.base_id
        fmt = body.text.format if body.text is not None else None
        self.head: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": int(time.time()),
            "model": state.model_name, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": body.tool_choice.model_dump() if isinstance(
                body.tool_choice, FunctionChoice) else body.tool_choice or "auto",
            "tools": [t.model_dump(by_alias=True) for t in body.tools or []],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)
                     if fmt is not None else {"type": "text"}},
            "reasoning": {"effort": None, "summary": None}, "store": body.store,
            "truncation": "disabled", "metadata": body.metadata or {}, "error": None,
            "incomplete_details": None, "user": body.user}

    def snapshot(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self.head, "status": status, "output": output, "usage": None}

    def finish(self, out: RequestOutput, reply: Reply) -> dict[str, Any]:
        output = []
        if reply.reasoning:
            output.append(reasoning_item(new_id("rs"), reply.reasoning, "completed"))
        if reply.content or not reply.calls:
            output.append(message_item(new_id("msg"), reply.content, "completed"))
        output += [call_item(new_id("fc"), call, "completed") for call in reply.calls or []]
        return self.done(out, output)

    def done(self, out: RequestOutput, output: list[dict[str, Any]]) -> dict[str, Any]:
        incomplete = out.finish_reason == "length"
        prompt = self.turn.streams[0].num_prompt_tokens
        generated = len(out.token_ids)
        return {**self.head, "status": "incomplete" if incomplete else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": output, "usage": {
                    "input_tokens": prompt,
                    "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                    "output_tokens": generated,
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": prompt + generated}}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [text_part(text)] if text is not None else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call: dict[str, Any], status: str, arguments: str | None = None
              ) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if arguments is None else arguments,
            "status": status}


# ---------------------------------------------------------------- streaming

def sse(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"


class Writer:
    """The events of one streamed response, numbered; one item open at a time."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.text = ""

    def event(self, event_type: str, **data: Any) -> str:
        self.sequence += 1
        return sse(event_type, {**data, "sequence_number": self.sequence - 1})

    def write(self, kind: str, text: str) -> list[str]:
        """Text for a reasoning or a message item, opening it first when needed."""
        if not text:
            return []
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self.close()
            item = reasoning_item(new_id("rs"), "", "in_progress") if kind == "reasoning" \
                else message_item(new_id("msg"), None, "in_progress")
            out += self.add(item)
            if kind == "message":
                out.append(self.event("response.content_part.added", **self.where(),
                                      content_index=0, part=text_part("")))
        self.text += text
        name = "response.reasoning_text.delta" if kind == "reasoning" \
            else "response.output_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        out.append(self.event(name, **self.where(), content_index=0, delta=text, **extra))
        return out

    def add(self, item: dict[str, Any]) -> list[str]:
        self.open, self.text = item, ""
        self.output.append(item)
        return [self.event("response.output_item.added", output_index=len(self.output) - 1,
                           item=item)]

    def where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def call(self, call: dict[str, Any]) -> list[str]:
        out = self.close()
        out += self.add(call_item(new_id("fc"), call, "in_progress", arguments=""))
        arguments = call["function"]["arguments"]
        out.append(self.event("response.function_call_arguments.delta", **self.where(),
                              delta=arguments))
        self.text = arguments
        return out + self.close()

    def close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        out = []
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], self.text, "completed")
            out.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                  text=self.text))
        elif item["type"] == "message":
            done = message_item(item["id"], self.text, "completed")
            out.append(self.event("response.output_text.done", **where, content_index=0,
                                  text=self.text, logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=text_part(self.text)))
        else:
            done = {**item, "arguments": self.text, "status": "completed"}
            out.append(self.event("response.function_call_arguments.done", **where,
                                  name=item["name"], arguments=self.text))
        self.output[-1] = done
        out.append(self.event("response.output_item.done", output_index=where["output_index"],
                              item=done))
        return out


async def events(draft: Draft, store: ResponseStore, conversation: list[p.ChatMessage]
                 ) -> AsyncIterator[str]:
    writer = Writer()
    reply = draft.turn.reply_stream()
    yield writer.event("response.created", response=draft.snapshot("in_progress", [])) + \
        writer.event("response.in_progress", response=draft.snapshot("in_progress", []))
    batch: list[str] = []
    async for _, out, more in merged(draft.turn.streams):
        if out.error:
            batch.append(writer.event("error", code="server_error", message=out.error,
                                      param=None))
            break
        split = reply.feed(out.new_text)
        batch += writer.write("reasoning", split.reasoning)
        batch += writer.write("message", split.content)
        if out.finished:
            rest, calls = reply.finish()
            batch += writer.write("reasoning", rest.reasoning)
            batch += writer.write("message", rest.content)
            if not calls and not any(i["type"] == "message" for i in writer.output):
                batch += writer.add(message_item(new_id("msg"), None, "in_progress"))
                batch.append(writer.event("response.content_part.added", **writer.where(),
                                          content_index=0, part=text_part("")))
            for call in calls or []:
                batch += writer.call(call)
            batch += writer.close()
            done = draft.done(out, writer.output)
            if draft.head["store"]:
                store.put(done["id"], Stored([*conversation, *reply_messages(done)], done,
                                             draft.turn.exchange(out)))
            name = "response.incomplete" if done["status"] == "incomplete" \
                else "response.completed"
            batch.append(writer.event(name, response=done))
        if batch and not more:
            yield "".join(batch)
            batch.clear()
    if batch:
        yield "".join(batch)


def add_routes(app: FastAPI, state: ServerState, store: ResponseStore) -> None:
    @app.post("/v1/responses", response_model=None)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(state, store, body, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return store.get(response_id, "response_id").response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

