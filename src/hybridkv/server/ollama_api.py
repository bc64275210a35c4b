"""Ollama's API (/api/...), over the core (serving.py): what Open WebUI, editors and the
`ollama` client speak.

    /api/tags, /api/ps        the one served model, as `NAME:latest` (NAME is accepted too)
    /api/show                 its template, details, context length and capabilities
    /api/version              hybridkv's version
    /api/chat                 messages (+ tools, format, options) -> one chat reply
    /api/generate             a prompt (templated as a user turn, or `raw`) -> one reply;
                              `context` continues an earlier exchange's tokens
    /api/pull, /api/embed...  a 501 saying what is not served

Replies stream as NDJSON by default (`"stream": false` for one object), the last line with
Ollama's timings in nanoseconds: prompt_eval_count (prompt tokens computed, prefix hits
left out) and prompt_eval_duration (until the first token), eval_count and eval_duration
(the tokens generated, and the time after the first), total_duration, load_duration (0: the
model is loaded at start). `options` are Ollama's: num_predict, temperature, top_k, top_p,
min_p, seed, stop, repeat_penalty, presence_penalty, frequency_penalty, num_ctx; the
hardware and loading knobs (num_gpu, num_thread, ...) are accepted and change nothing here;
mirostat, tfs_z, typical_p and a windowed repeat_last_n are refused. Defaults are Ollama's
(temperature 0.8, top_k 40, top_p 0.9). `keep_alive` is accepted: the model stays loaded.
Errors are Ollama's `{"error": message}`.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict

import hybridkv
from hybridkv.engine.outputs import RequestOutput
from hybridkv.sched.structured import StructuredOutput
from hybridkv.server import protocol as p
from hybridkv.server.errors import APIError, bad_request, register_envelope
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
from hybridkv.server.tools import parse_tools

NDJSON = "application/x-ndjson"
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}  # Ollama's
STARTED = datetime.now(timezone.utc).isoformat()
# Ollama routes this server does not serve, and why.
NOT_SERVED = {
    ("POST", "/api/pull"): "it serves the one model it was started with",
    ("POST", "/api/push"): "it serves the one model it was started with",
    ("POST", "/api/create"): "it serves the one model it was started with",
    ("POST", "/api/copy"): "it serves the one model it was started with",
    ("DELETE", "/api/delete"): "it serves the one model it was started with",
    ("POST", "/api/blobs/{digest}"): "it serves the one model it was started with",
    ("HEAD", "/api/blobs/{digest}"): "it serves the one model it was started with",
    ("POST", "/api/embed"): "it generates text, not embeddings",
    ("POST", "/api/embeddings"): "it generates text, not embeddings",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": message}


register_envelope("/api", error_body)


# ---------------------------------------------------------------- request

class Options(p.Request):
    model_config = ConfigDict(extra="forbid", strict=False)  # 1 for 1.0, as Ollama reads it

    num_predict: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Items[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: int | None = None
    # Refused unless neutral: samplers the engine does not have.
    repeat_last_n: int | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    tfs_z: float | None = None
    typical_p: float | None = None
    penalize_newline: bool | None = None
    # How Ollama loads and runs a model: nothing to do here.
    numa: bool | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = None
    num_keep: int | None = None


# option -> (the value that changes nothing, what another value would ask for)
UNSUPPORTED = {"repeat_last_n": (-1, "a repeat penalty over the last n tokens only (-1: "
                                     "the whole context, as here)"),
               "mirostat": (0, "mirostat sampling"), "tfs_z": (1.0, "tail-free sampling"),
               "typical_p": (1.0, "typical sampling"),
               "penalize_newline": (None, "penalize_newline")}


class ToolCallFunction(p.Request):
    name: str
    arguments: dict[str, Any] | str = {}
    index: int | None = None


class ToolCall(p.Request):
    function: ToolCallFunction
    id: str | None = None
    type: Literal["function"] | None = None


class Message(p.Request):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None  # an earlier reply's: dropped, as templates drop it
    images: Items[Any] | None = None
    tool_calls: Items[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class GenerateFields(p.Request):
    model: str
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: float | int | str | None = None  # the model stays loaded whatever it says
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ChatRequest(GenerateFields):
    messages: Items[Message] | None = None
    tools: Items[p.Tool] | None = None


class GenerateRequest(GenerateFields):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: Items[int] | None = None
    raw: bool | None = None
    images: Items[Any] | None = None
    width: int | None = None
    height: int | None = None


class ShowRequest(p.Request):
    model: str | None = None
    name: str | None = None  # the older spelling
    verbose: bool | None = None


# ---------------------------------------------------------------- request -> core

def check_model(state: ServerState, model: str | None) -> None:
    if model not in (state.model_name, tag(state)):
        raise APIError(404, f"model '{model}' not found; this server serves "
                            f"'{tag(state)}'", param="model")


def tag(state: ServerState) -> str:
    return state.model_name if ":" in state.model_name else f"{state.model_name}:latest"


def job(state: ServerState, body: GenerateFields) -> ChatJob:
    if body.logprobs or body.top_logprobs:
        raise bad_request("logprobs are not supported on /api yet: use /v1/chat/completions",
                          "logprobs")
    if body.think and not state.thinks:
        raise bad_request(f"'{tag(state)}' does not think (its chat template writes no "
                          f"</think>; a server started with --reasoning-parser splits the "
                          f"reasoning out)", "think")
    options = body.options or Options()
    for name, (neutral, what) in UNSUPPORTED.items():
        value = getattr(options, name)
        if value is not None and value != neutral:
            raise bad_request(f"options.{name}: {what} is not supported", "options")
    values: dict[str, Any] = dict(DEFAULTS)
    for ours, theirs in (("temperature", "temperature"), ("top_k", "top_k"),
                         ("top_p", "top_p"), ("min_p", "min_p"), ("seed", "seed"),
                         ("stop", "stop"), ("repetition_penalty", "repeat_penalty"),
                         ("presence_penalty", "presence_penalty"),
                         ("frequency_penalty", "frequency_penalty")):
        value = getattr(options, theirs)
        if value is not None:
            values[ours] = value
    if options.num_ctx is not None and not 0 < options.num_ctx <= state.max_model_len:
        raise bad_request(f"options.num_ctx: {options.num_ctx} is beyond this server's "
                          f"context of {state.max_model_len} tokens (--max-model-len)",
                          "options")
    max_tokens = options.num_predict
    if max_tokens is not None and max_tokens in (-1, -2):
        max_tokens = None  # until the context ends
    elif max_tokens is not None and max_tokens < 1:
        raise bad_request(f"options.num_predict must be >= 1, or -1 (until the context "
                          f"ends), got {max_tokens}", "options")
    spec, spec_param = structured(body.format)
    return ChatJob(values=values, max_tokens=max_tokens, max_tokens_param="options.num_predict",
                   messages_param="messages", spec=spec, spec_param=spec_param,
                   names={n: f"options.{o}" for n, o in (
                       ("temperature", "temperature"), ("top_k", "top_k"),
                       ("top_p", "top_p"), ("min_p", "min_p"), ("seed", "seed"),
                       ("stop", "stop"), ("repetition_penalty", "repeat_penalty"))})


def structured(format: str | dict[str, Any] | None) -> tuple[StructuredOutput | None, str]:
    if format is None or format == "":
        return None, ""
    if format == "json":
        return StructuredOutput(json_object=True), "format"
    if isinstance(format, str):
        raise bad_request(f"format must be \"json\" or a JSON schema, got {format!r}"[:200],
                          "format")
    try:
        return StructuredOutput(json_schema=format), "format"
    except ValueError as e:
        raise bad_request(f"format: {e}", "format") from None


def chat_messages(messages: list[Message]) -> list[p.ChatMessage]:
    out = []
    for i, m in enumerate(messages):
        if m.images:
            raise bad_request(f"messages[{i}].images: images are not supported (this server "
                              f"serves a text model)", "messages")
        calls = [p.MessageToolCall(id=c.id, function=p.CalledFunction(
            name=c.function.name, arguments=c.function.arguments))
            for c in m.tool_calls or []]
        out.append(p.ChatMessage(role=m.role, content=m.content or "",
                                 tool_calls=calls or None,
                                 tool_call_id=m.tool_call_id or m.tool_name,
                                 name=m.tool_name))
    return out


async def create_chat(state: ServerState, body: ChatRequest, request: Request) -> Response:
    check_model(state, body.model)
    if not body.messages:  # Ollama's "load the model": it is loaded
        return JSONResponse(final(state, {"message": {"role": "assistant", "content": ""}},
                                  "load", None, None))
    use = parse_tools(body.tools, None)
    turn = await state.start_chat(f"chat-{uuid.uuid4().hex}", chat_messages(body.messages),
                                  use, job(state, body))
    return await respond(state, body, request, turn, chat_fields(body))


async def create_generate(state: ServerState, body: GenerateRequest,
                          request: Request) -> Response:
    check_model(state, body.model)
    for name in ("suffix", "template", "width", "height"):
        if getattr(body, name) is not None:
            raise bad_request(f"'{name}' is not supported by this server", name)
    if body.images:
        raise bad_request("images are not supported (this server serves a text model)",
                          "images")
    if not body.prompt and not body.context:
        return JSONResponse(final(state, {"response": ""}, "load", None, None))
    base_id = f"gen-{uuid.uuid4().hex}"
    context = list(body.context or [])
    if body.raw:
        [ids] = await state.tokenize([body.prompt or ""], add_special_tokens=not context)
        turn = await state.start(base_id, context + ids, job(state, body))
    else:
        messages = [p.ChatMessage(role="system", content=body.system)] if body.system else []
        messages.append(p.ChatMessage(role="user", content=body.prompt or ""))
        turn = await state.start_chat(base_id, messages, parse_tools(None, None),
                                      job(state, body), context=context)
    return await respond(state, body, request, turn, generate_fields(body, turn))


# ---------------------------------------------------------------- core -> reply

# (the reply's part, the finished output or None, the tool calls) -> the line's fields
Fields = Callable[[Split, RequestOutput | None, list[dict[str, Any]] | None],
                  dict[str, Any]]


def chat_fields(body: GenerateFields) -> Fields:
    def fields(split: Split, out: RequestOutput | None,
               calls: list[dict[str, Any]] | None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": split.content}
        if split.reasoning and body.think is not False:
            message["thinking"] = split.reasoning
        if calls:
            message["tool_calls"] = [{"function": {
                "name": c["function"]["name"],
                "arguments": json.loads(c["function"]["arguments"])}} for c in calls]
        return {"message": message}
    return fields


def generate_fields(body: GenerateFields, turn: ChatTurn) -> Fields:
    def fields(split: Split, out: RequestOutput | None,
               calls: list[dict[str, Any]] | None) -> dict[str, Any]:
        line: dict[str, Any] = {"response": split.content}
        if split.reasoning and body.think is not False:
            line["thinking"] = split.reasoning
        if out is not None:
            line["context"] = turn.prompt + out.token_ids
        return line
    return fields


class Timer:
    """Ollama's timings, in nanoseconds."""

    def __init__(self) -> None:
        self.start = time.monotonic_ns()
        self.first: int | None = None

    def tick(self) -> None:
        if self.first is None:
            self.first = time.monotonic_ns()

    def fields(self, turn: ChatTurn, out: RequestOutput) -> dict[str, int]:
        end = time.monotonic_ns()
        first = self.first or end
        return {"total_duration": end - self.start, "load_duration": 0,
                "prompt_eval_count": len(turn.prompt) - out.num_cached_tokens,
                "prompt_eval_duration": first - self.start,
                "eval_count": len(out.token_ids), "eval_duration": end - first}


def final(state: ServerState, fields: dict[str, Any], reason: str,
          timer: Timer | None, turn: ChatTurn | None, out: RequestOutput | None = None
          ) -> dict[str, Any]:
    line = {"model": tag(state), "created_at": now(), **fields, "done": True,
            "done_reason": reason}
    if timer is not None and turn is not None and out is not None:
        line.update(timer.fields(turn, out))
    return line


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


async def respond(state: ServerState, body: GenerateFields, request: Request,
                  turn: ChatTurn, fields: Fields) -> Response:
    timer = Timer()
    if body.stream:
        return event_stream(state, turn.streams, lines(state, turn, fields, timer),
                            on_dead=lambda m: json.dumps({"error": m}) + "\n",
                            media_type=NDJSON)
    finals = await finished_outputs(state, request, turn.streams,
                                    lambda out: timer.tick())
    if finals is None:
        return Response(status_code=499)
    [out] = finals
    reply = turn.reply(out.text)
    return JSONResponse(final(state, fields(Split(reply.reasoning, reply.content), out,
                                            reply.calls), out.finish_reason or "stop",
                              timer, turn, out))


async def lines(state: ServerState, turn: ChatTurn, fields: Fields, timer: Timer
                ) -> AsyncIterator[str]:
    reply = turn.reply_stream()
    batch: list[str] = []
    async for _, out, more in merged(turn.streams):
        timer.tick()
        if out.error:
            batch.append(json.dumps({"error": out.error}) + "\n")
            break
        split = reply.feed(out.new_text)
        if out.finished:
            rest, calls = reply.finish()
            split = Split(split.reasoning + rest.reasoning, split.content + rest.content)
            if split.reasoning or split.content or calls:
                batch.append(json.dumps({"model": tag(state), "created_at": now(),
                                         **fields(split, None, calls), "done": False}) + "\n")
            batch.append(json.dumps(final(state, fields(Split(), out, None),
                                          out.finish_reason or "stop", timer, turn,
                                          out)) + "\n")
        elif split.reasoning or split.content:
            batch.append(json.dumps({"model": tag(state), "created_at": now(),
                                     **fields(split, None, None), "done": False}) + "\n")
        if batch and not more:
            yield "".join(batch)
            batch.clear()
    if batch:
        yield "".join(batch)


# ---------------------------------------------------------------- the model

def model_files(model_dir: str) -> tuple[str, int]:
    """(format, size in bytes) of the served model's files, as far as they are found."""
    path = Path(model_dir)
    files = [path] if path.is_file() else list(path.glob("*")) if path.is_dir() else []
    size = sum(f.stat().st_size for f in files if f.is_file())
    fmt = "gguf" if path.suffix == ".gguf" or any(f.suffix == ".gguf" for f in files) \
        else "safetensors"
    return fmt, size


def details(state: ServerState) -> dict[str, Any]:
    fmt, _ = model_files(state.model_dir)
    family = ""
    config = Path(state.model_dir) / "config.json"
    if config.is_file():
        try:
            family = str(json.loads(config.read_text()).get("model_type", ""))
        except (ValueError, OSError):
            family = ""
    return {"parent_model": "", "format": fmt, "family": family,
            "families": [family] if family else None}


def model_entry(state: ServerState) -> dict[str, Any]:
    _, size = model_files(state.model_dir)
    digest = hashlib.sha256(f"{state.model_name}\0{state.model_dir}".encode()).hexdigest()
    return {"name": tag(state), "model": tag(state), "modified_at": STARTED, "size": size,
            "digest": digest, "details": details(state)}


def show(state: ServerState) -> dict[str, Any]:
    family = details(state)["family"] or "model"
    capabilities = ["completion", "tools"] + ["thinking"] * state.thinks
    return {"modelfile": f"# served by hybridkv {hybridkv.__version__}\nFROM "
                         f"{state.model_dir}\n",
            "parameters": "", "template": state.chat_template.source
            if state.chat_template is not None else "",
            "details": details(state), "modified_at": STARTED,
            "model_info": {"general.architecture": family,
                           f"{family}.context_length": state.max_model_len},
            "capabilities": capabilities}


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/api/version")
    async def version() -> dict[str, str]:
        return {"version": hybridkv.__version__}

    @app.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [model_entry(state)]}

    @app.get("/api/ps")
    async def ps() -> dict[str, Any]:
        return {"models": [{**model_entry(state), "expires_at": "2318-01-01T00:00:00Z",
                            "size_vram": 0, "context_length": state.max_model_len}]}

    @app.post("/api/show")
    async def show_model(body: ShowRequest) -> dict[str, Any]:
        check_model(state, body.model or body.name)
        return show(state)

    @app.post("/api/chat", response_model=None)
    async def chat(body: ChatRequest, request: Request) -> Response:
        return await create_chat(state, body, request)

    @app.post("/api/generate", response_model=None)
    async def generate(body: GenerateRequest, request: Request) -> Response:
        return await create_generate(state, body, request)

    for (method, path), why in NOT_SERVED.items():
        app.add_api_route(path, not_served(path.split("/{")[0], why), methods=[method],
                          response_model=None)


def not_served(path: str, why: str) -> Callable[[], Any]:
    async def endpoint() -> Response:
        return JSONResponse({"error": f"{path} is not served by hybridkv: {why}; served: "
                                      f"/api/chat, /api/generate, /api/tags, /api/show, "
                                      f"/api/ps, /api/version"}, status_code=501)
    return endpoint
