"""`hybridkv serve`: an HTTP server on the engine (FastAPI + uvicorn) speaking OpenAI's,
Anthropic's and Ollama's APIs, one adapter module per API over one core.

    async_engine  the engine loop in one thread; requests in and outputs out via the event loop
    follow_up     how long a step is held for a client's next request
    protocol      request and response bodies (pydantic)
    serving       the core: tokenizing, templating, queueing, collecting and streaming
    replies       a reply's reasoning, content and tool calls, whole or streamed
    reasoning     <think>...</think> kept apart (--reasoning-parser)
    openai_api    /v1/completions and /v1/chat/completions
    responses_api /v1/responses, and the store previous_response_id reads
    anthropic_api /v1/messages and /v1/messages/count_tokens
    ollama_api    /api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version
    chat          chat templates
    metrics       Prometheus metrics named like vLLM's (hybridkv: prefix)
    errors        every failure in the envelope of the API asked (OpenAI's by default)
    limits        what keeps a hostile request from stalling the server: body size, JSON
                  nesting, a prompt's length in characters
    app           the FastAPI app and its routes
"""
