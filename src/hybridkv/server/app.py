"""The FastAPI app: routes, the API key check, and the engine thread's lifetime.

    app = build_app(engine, ServerConfig(model_name="demo", model_dir=...))
    uvicorn.run(app, host=..., port=...)   # lifespan starts and stops the engine thread
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

import hybridkv
from hybridkv.engine.engine import LLMEngine
from hybridkv.server import anthropic_api, ollama_api, responses_api
from hybridkv.server import protocol as p
from hybridkv.server.async_engine import AsyncEngine, EngineDeadError
from hybridkv.server.chat import ChatTemplate, find_chat_template, special_tokens
from hybridkv.server.errors import bad_request, error_response, install_error_handlers
from hybridkv.server.follow_up import DEFAULT_WAIT_MS, FollowUpWait
from hybridkv.server.host_memory import DEFAULT_MAX_WAITING, host_holders
from hybridkv.server.host_memory import describe as describe_host_memory
from hybridkv.server.limits import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    BodyLimitMiddleware,
    JSONRoute,
    max_chars_per_token,
)
from hybridkv.server.metrics import HostMemoryCollector, ServerMetrics, scheduler_loads
from hybridkv.server.openai_api import create_chat_completion, create_completion
from hybridkv.server.reasoning import reasoning_enabled
from hybridkv.server.serving import ServerState

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    model_name: str
    model_dir: str
    api_key: str | None = None
    # More queued requests than this: 503 + Retry-After (each holds its prompt until it runs).
    max_waiting: int = DEFAULT_MAX_WAITING
    chat_template: str | None = None  # a file or the template itself; default: the model's
    shutdown_timeout_s: float = 10.0
    # After a step that ends a request, hold the next step this long for that client's next
    # request (server/follow_up.py; adaptive); 0: never hold.
    follow_up_wait_ms: float = DEFAULT_WAIT_MS
    # A replica of `--data-parallel-size`: the launcher's status file of all replicas,
    # reported by /metrics (server/replicas.py).
    replica_status: str | None = None
    # A larger request body is refused with 413 before it is read (server/limits.py).
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # Replies split into reasoning and content (server/reasoning.py): auto, when the chat
    # template writes </think>.
    reasoning_parser: str = "auto"
    # Responses kept for previous_response_id (server/responses_api.py); 0: none; None:
    # responses_api.DEFAULT_MAX_STORED_RESPONSES.
    max_stored_responses: int | None = None


def group_names(engine: LLMEngine) -> list[str]:
    """A label per KV cache group: its kind and window, e.g. full, sliding_window_512."""
    names: list[str] = []
    for group in engine.plan.config.groups:
        spec = group.spec
        size = getattr(spec, "sliding_window", None) or getattr(
            spec, "attention_chunk_size", None)
        name = f"{spec.kind}_{size}" if size else spec.kind
        if name in names:
            name = f"{name}_{group.group_id}"
        names.append(name)
    return names


def cache_info(engine: LLMEngine) -> dict[str, str]:
    """vllm:cache_config_info's labels: the block size a prefix hit aligns to, and the KV
    capacity in blocks of that size (what a vLLM scheduler divides usage by): the tokens of
    max_model_len requests the arena holds at once, as /v1/loads reports them. One number
    for every group: a model of one group gets its pool's blocks; in a hybrid model a
    sliding window costs its blocks once per request, however long the request."""
    plan, config = engine.plan, engine.config
    block_size = plan.config.hit_alignment
    return {"block_size": str(block_size),
            "num_gpu_blocks": str(plan.capacity_tokens // block_size),
            "cache_dtype": str(getattr(config, "kv_cache_dtype", "auto")),
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "prefix_caching_hash_algo": config.block_hash_algo,
            "num_kv_cache_groups": str(len(plan.config.groups))}


class APIKeyMiddleware:
    """`Authorization: Bearer KEY` (or `x-api-key: KEY`, as Anthropic's clients send it) on
    /v1/... and Ollama's /api/... (health, metrics and version stay open, as in vLLM).
    Checked before the body is read, so an unauthenticated client learns nothing."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.bearer = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path.startswith(("/v1", "/api/")) \
                and scope["method"] != "OPTIONS":
            headers = dict(scope["headers"])
            bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.bearer)
            key = hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)
            if not (bearer or key):
                response = error_response(401, "a valid API key is required "
                                               "(Authorization: Bearer KEY, or x-api-key: "
                                               "KEY)", path=path)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    template = find_chat_template(config.model_dir, config.chat_template)
    variables = special_tokens(config.model_dir)
    if engine.parts.special_tokens:  # a single-file model (GGUF) carries its own
        variables = {**engine.parts.special_tokens, **variables}
    if template is None:
        template = engine.parts.chat_template
    chat_template = ChatTemplate(template, variables) if template is not None else None
    holder: dict[str, AsyncEngine] = {}
    metrics = ServerMetrics(config.model_name, lambda: holder["engine"].snapshot,
                            group_names(engine), cache_info(engine), engine.kv_events,
                            config.replica_status)
    async_engine = AsyncEngine(engine, max_waiting=config.max_waiting,
                               on_output=metrics.observe_output,
                               on_scheduled=metrics.observe_queue_time,
                               follow_up=FollowUpWait(config.follow_up_wait_ms / 1000))
    if engine.structured is not None:
        engine.structured.on_compile = metrics.observe_grammar_compile
        engine.structured.on_mask = metrics.observe_grammar_mask
    holder["engine"] = async_engine
    state = ServerState(engine=async_engine, metrics=metrics, model_name=config.model_name,
                        model_dir=config.model_dir, tokenizer=engine.tokenizer,
                        max_model_len=engine.max_model_len, chat_template=chat_template,
                        chars_per_token=max_chars_per_token(engine.tokenizer)
                        if engine.tokenizer is not None else None,
                        thinks=reasoning_enabled(config.reasoning_parser, template),
                        saves_part_points=engine.kv_manager.saves_branch_points)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            logger.info("stopping the engine")
            async_engine.shutdown(config.shutdown_timeout_s)

    app = FastAPI(title="hybridkv", version=hybridkv.__version__, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_body_bytes)
    if config.api_key:  # added last, so it runs first: no key, nothing read
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.router.route_class = JSONRoute  # bodies parsed with a stated nesting limit
    add_routes(app, state)
    anthropic_api.add_routes(app, state)
    ollama_api.add_routes(app, state)
    stored = config.max_stored_responses
    store = responses_api.ResponseStore(
        responses_api.DEFAULT_MAX_STORED_RESPONSES if stored is None else stored)
    responses_api.add_routes(app, state, store)
    holders = host_holders(engine, max_waiting=config.max_waiting, responses=store,
                           num_waiting=lambda: async_engine.snapshot.num_waiting)
    metrics.registry.register(HostMemoryCollector(holders, config.model_name))
    logger.info("%s", describe_host_memory(holders))
    return app


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", response_model=None)
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        return await create_completion(state, body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(state, body, request)

    @app.get("/v1/models")
    async def models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=state.model_name, root=state.model_dir,
                                             max_model_len=state.max_model_len)])

    @app.get("/health", response_model=None)
    async def health() -> Response:
        if state.engine.alive:
            return Response(status_code=200)
        return error_response(503, state.engine.dead_reason())

    @app.get("/v1/loads")
    async def loads() -> dict[str, Any]:
        """SGLang's load report, as its gateway polls it (see `scheduler_loads`)."""
        engine = state.engine.engine  # its plan and config are fixed once it is built
        return scheduler_loads(state.engine.snapshot, engine.plan.capacity_tokens,
                               engine.config.max_num_seqs)

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": hybridkv.__version__}

    @app.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest) -> p.TokenizeResponse:
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
        if body.messages is not None:
            ids = await state.tokenize_chat(body.messages, body.add_generation_prompt)
        else:
            [ids] = await state.tokenize([body.prompt or ""])
        return p.TokenizeResponse(count=len(ids), max_model_len=state.max_model_len,
                                  tokens=ids)

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        state.check_model(body.model)
        if state.tokenizer is None:
            raise bad_request("this model has no tokenizer", "tokens")
        vocab = state.tokenizer.get_vocab_size()
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})",
                              "tokens")
        return p.DetokenizeResponse(prompt=await state.detokenize(body.tokens))

    @app.post("/reset_prefix_cache", response_model=None)
    async def reset_prefix_cache() -> Response:
        """Drop the device prefix cache (offload tiers keep theirs), as vLLM's endpoint of
        that name; refused with a 409 while requests hold blocks."""
        try:
            done = await state.engine.call(lambda engine: engine.reset_prefix_cache())
        except EngineDeadError as e:
            return error_response(503, str(e))
        if not done:
            return error_response(409, "requests are running; reset the prefix cache when "
                                       "the server is idle")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def run_server(app: FastAPI, *, host: str, port: int, log_level: str,
               shutdown_timeout_s: float) -> None:
    """uvicorn on `app`, with a shutdown that never leaves a client hanging: on SIGTERM or
    SIGINT it stops accepting, lets in-flight requests finish for `shutdown_timeout_s`, then
    ends the rest (a last error event on a stream, a 503 otherwise) before uvicorn would
    cancel them mid-response, and stops the engine."""
    import uvicorn

    async_engine = app.state.server.engine

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            timer = asyncio.get_running_loop().call_later(
                shutdown_timeout_s, async_engine.end_all,
                f"the server is shutting down (requests get {shutdown_timeout_s:g} s to "
                f"finish)")
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    # uvicorn's own limit comes later: the ended responses need a moment to be sent.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=int(math.ceil(shutdown_timeout_s)) + 5)
    Server(config).run()
