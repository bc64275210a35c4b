"""`hybridkv serve`: an OpenAI-compatible HTTP server on the engine (FastAPI + uvicorn).

    async_engine  the engine loop in one thread; requests in and outputs out via the event loop
    follow_up     how long a step is held for a client's next request
    protocol      request and response bodies (pydantic)
    serving       /v1/completions and /v1/chat/completions, whole or streamed
    chat          chat templates
    metrics       Prometheus metrics named like vLLM's (hybridkv: prefix)
    errors        OpenAI's error envelope for every failure
    limits        what keeps a hostile request from stalling the server: body size, JSON
                  nesting, a prompt's length in characters
    app           the FastAPI app and its routes
"""
