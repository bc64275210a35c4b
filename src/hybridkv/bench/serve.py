"""`hybridkv bench serve`: load on the OpenAI-compatible server, as `vllm bench serve` does.

Streaming `/v1/completions` requests (`stream_options.include_usage`) of random token-id
prompts with `ignore_eos` and temperature 0, so every output has exactly `--output-len`
tokens. Each run sends `--num-prompts` requests, at most `--concurrency` at a time, arriving
as a Poisson process of `--request-rate` per second (inf: all at once). Per request: TTFT
(the first chunk carrying text), inter-token latencies (gaps between later such chunks; a
chunk carries one engine step's tokens), end-to-end latency; per run their p50/p90/p99,
requests/s, output tokens/s, failures and the prompt tokens the prefix cache served.

The server is `--url`, or one started in this process (a thread with its own event loop, on
a free loopback port) on `--model` or the demo model `hybridkv serve` uses. Client and server
then share the interpreter: the client's parsing competes with the server for the GIL, so
in-process figures are a little pessimistic. `--compare-offline` then runs the prompts of the
busiest run through an offline `LLM` with the same engine options, after the server stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from hybridkv.cli import (
    CLIError,
    Command,
    _bounded,
    add_server_engine_arguments,
    non_negative_int,
    positive_int,
    server_engine_options,
)

DEFAULT_URL_VOCAB = 256  # token ids drawn below this with --url and no --model
MAX_ERRORS_KEPT = 5

@contextmanager
def pinned(cpus: set[int] | None, threads: int | None) -> Iterator[None]:
    """Run on `cpus` (where a server in another process was pinned), then as before."""
    if not cpus:
        yield
        return
    import torch

    before, before_threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads or len(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(before_threads)


def cpu_list(text: str) -> set[int]:
    try:
        cpus = {int(part) for part in text.split(",")}
    except ValueError:
        cpus = set()
    # Any CPU of the machine: this process may be pinned elsewhere (to the client's core).
    count = os.cpu_count() or 1
    if not cpus or min(cpus) < 0 or max(cpus) >= count:
        raise argparse.ArgumentTypeError(
            f"expected CPU numbers in [0, {count - 1}] separated by commas; got {text!r}")
    return cpus


request_rate = _bounded(float, lambda v: v > 0, "a number > 0, or inf")


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cache_reported: bool = False  # the server reported cached_tokens (conversations)


def make_prompts(num: int, input_len: int, shared_prefix_len: int, vocab: int,
                 seed: int) -> list[list[int]]:
    """`num` prompts of `input_len` random ids in [4, vocab), the first `shared_prefix_len`
    of them common to all (at most `input_len`)."""
    rng = random.Random(seed)
    shared = min(shared_prefix_len, input_len)
    prefix = [rng.randrange(4, vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(4, vocab) for _ in range(input_len - shared)]
            for _ in range(num)]


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean, p50, p90, p99 (linear interpolation) of `values` times `scale` (s -> ms)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        k = (len(ordered) - 1) * q
        lo = math.floor(k)
        hi = min(lo + 1, len(ordered) - 1)
        return (ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)) * scale

    return {"mean": sum(ordered) / len(ordered) * scale, "p50": at(0.5), "p90": at(0.9),
            "p99": at(0.99)}


# ---------------------------------------------------------------- the client

# `--structured`: a JSON schema whose replies run past any output length (at least 1,024
# short strings), so that constrained requests decode as many tokens as the free ones and
# the difference in output tok/s is the grammar's cost per token.
STRUCTURED_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["items"], "properties": {"items": {
        "type": "array", "minItems": 1024,
        "items": {"type": "string", "maxLength": 12}}}}


async def send_one(client: Any, url: str, prompt: list[int], output_len: int,
                   model: str | None, extra: dict[str, Any] | None = None) -> RequestResult:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                            "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}, **(extra or {})}
    if model is not None:
        body["model"] = model
    result, _ = await stream_request(client, f"{url}/v1/completions", body,
                                     RequestResult(prompt_tokens=len(prompt)))
    return result


async def stream_request(client: Any, url: str, body: dict[str, Any], result: RequestResult,
                         *, chat: bool = False) -> tuple[RequestResult, str]:
    """POST a streaming completion (`chat`: a chat completion) and time it into `result`:
    TTFT, inter-token gaps, usage (cached prompt tokens from `usage.prompt_tokens_details`,
    else llama-server's `timings.cache_n`); (the result, the generated text)."""
    import httpx

    pieces: list[str] = []
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result, ""
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if "error" in chunk:
                    result.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                    continue
                text = "".join((c.get("delta") or {}).get("content") or "" if chat
                               else c.get("text") or "" for c in chunk.get("choices") or ())
                if text:
                    pieces.append(text)
                    if result.ttft_s is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                usage = chunk.get("usage")
                timings = chunk.get("timings")  # llama-server's own
                if usage:
                    result.output_tokens = usage.get("completion_tokens", 0)
                    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and details.get("cached_tokens") is not None:
                        result.cached_tokens = details["cached_tokens"]
                        result.cache_reported = True
                if isinstance(timings, dict) and "cache_n" in timings \
                        and not result.cache_reported:
                    result.cached_tokens = timings["cache_n"]
                    result.cache_reported = True
            if result.error is None and not done:
                result.error = "the stream ended without [DONE]"
    except (httpx.HTTPError, ValueError) as e:  # ValueError: a chunk that is not JSON
        result.error = f"{type(e).__name__}: {e}"
    result.latency_s = time.perf_counter() - start
    result.ok = result.error is None
    return result, "".join(pieces)


async def run_load(url: str, prompts: list[list[int]], output_len: int,
                   concurrency: int | None, rate: float, seed: int,
                   model: str | None = None, extra: dict[str, Any] | None = None
                   ) -> tuple[list[RequestResult], float]:
    """Every prompt once, at most `concurrency` in flight (None: no limit), arrivals a
    Poisson process of `rate` per second (inf: all at once). (results in prompt order,
    seconds from the first send to the last answer)."""
    import httpx

    rng = random.Random(seed)
    width = concurrency or len(prompts)
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    gate = asyncio.Semaphore(width)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        async def gated(prompt: list[int]) -> RequestResult:
            async with gate:
                return await send_one(client, url, prompt, output_len, model, extra)

        start = time.perf_counter()
        tasks = []
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.ensure_future(gated(prompt)))
            if math.isfinite(rate) and i + 1 < len(prompts):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], elapsed: float, concurrency: int | None,
              rate: float, output_len: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
            if r.ttft_s is not None and r.output_tokens > 1]
    return {
        "concurrency": concurrency,
        "request_rate": rate if math.isfinite(rate) else None,  # None: all at once
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": [r.error for r in results if r.error][:MAX_ERRORS_KEPT],
        # Succeeded with fewer tokens than asked (the server stops at max_model_len).
        "short_outputs": sum(1 for r in ok if r.output_tokens < output_len),
        "total_time_s": elapsed,
        "request_throughput": len(ok) / elapsed if elapsed else None,
        "output_throughput": output / elapsed if elapsed else None,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": output,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "output_tokens": [r.output_tokens for r in results],
        "ttft_ms": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": percentiles([gap for r in ok for gap in r.itl_s]),
        "tpot_ms": percentiles(tpot),
        "e2e_ms": percentiles([r.latency_s for r in ok]),
    }


# ---------------------------------------------------------------- the server

def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(server_engine_options(args))


@contextmanager
def server_in_process(model_dir: str, options: dict[str, Any],
                      name: str = "bench") -> Iterator[str]:
    """A server on a free loopback port in a thread of this process; yields its URL."""
    import uvicorn

    from hybridkv.config import EngineConfig
    from hybridkv.engine.engine import LLMEngine
    from hybridkv.server.app import ServerConfig, build_app

    engine = LLMEngine.from_model_dir(model_dir, EngineConfig.from_kwargs(options))
    app = build_app(engine, ServerConfig(model_name=name, model_dir=model_dir,
                                         shutdown_timeout_s=5.0))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           timeout_graceful_shutdown=5))
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            server.run()
        except BaseException as e:  # noqa: BLE001 - reported by the waiting thread
            errors.append(e)

    thread = threading.Thread(target=serve, name="bench-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if errors or not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the in-process server did not start: "
                               f"{errors[0] if errors else 'timed out'}")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def offline_throughput(model_dir: str, options: dict[str, Any], prompts: list[list[int]],
                       output_len: int) -> dict[str, Any]:
    from hybridkv import LLM, SamplingParams

    llm = LLM(model_dir, **options)
    try:
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        llm.generate([prompts[0][:8] or [5]], SamplingParams(max_tokens=2, ignore_eos=True),
                     use_tqdm=False)  # warm up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.close()
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"num_prompts": len(prompts), "total_time_s": elapsed,
            "total_output_tokens": tokens, "output_throughput": tokens / elapsed,
            "failed": sum(1 for o in outputs if o.error)}


# ---------------------------------------------------------------- the suite

def served_model(url: str) -> str | None:
    """The one model a server (or a router) lists at /v1/models; None if it lists none or
    several, or cannot say."""
    import httpx

    try:
        data = httpx.get(f"{url}/v1/models", timeout=30).json().get("data")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    ids = [m.get("id") for m in data or [] if isinstance(m, dict)]
    return ids[0] if len(ids) == 1 and isinstance(ids[0], str) else None


def bench_conversations(args: argparse.Namespace) -> dict[str, Any]:
    """--workload conversations: one run per --variant (see bench/conversations.py)."""
    from hybridkv.bench.conversations import run_conversations, send_turn
    from hybridkv.cli import demo_model_dir

    model_dir = args.model
    if model_dir is None and not args.url:
        model_dir = str(demo_model_dir())
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    options = engine_options(args)
    runs: list[dict[str, Any]] = []

    replica_urls = [u.rstrip("/") for u in args.replica_urls or ()]
    if replica_urls and not args.url:
        raise CLIError("--replica-urls needs --url (the router in front of them)")
    model = args.served_model_name

    async def warm_up(url: str) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
            await send_turn(client, url, args.endpoint,
                            [{"role": "user", "content": "warm up"}], 2, model)

    def run_all(url: str) -> None:
        nonlocal model
        if model is None and args.url:
            model = served_model(url)  # routers require the field
        # Behind a router, each replica is warmed directly: a warm-up sent through the
        # router reaches one replica only, and a router that estimates each replica's wait
        # from the latencies it has seen then sends every new conversation to the other.
        for target in replica_urls or [url]:
            asyncio.run(warm_up(target))
        for variant in args.variant:
            runs.append(asyncio.run(run_conversations(
                url, variant, args.users, args.turns, args.system_tokens, args.answer_tokens,
                args.endpoint, args.seed, model, replica_urls, args.per_user_system)))

    if args.url:
        run_all(args.url.rstrip("/"))
    else:
        assert model_dir is not None
        with server_in_process(model_dir, options) as url:
            run_all(url)
    return {"workload": "conversations", "model": model_dir, "url": args.url,
            "users": args.users, "turns": args.turns, "system_tokens": args.system_tokens,
            "per_user_system": args.per_user_system,
            "answer_tokens": args.answer_tokens, "endpoint": args.endpoint, "seed": args.seed,
            "engine_options": options if not args.url else None, "runs": runs}


def bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    from hybridkv.bench.engine import model_vocab
    from hybridkv.cli import demo_model_dir

    if args.workload == "conversations":
        if args.compare_offline or args.structured:
            raise CLIError("--compare-offline and --structured are for the random workload "
                           "only")
        return bench_conversations(args)
    if args.replica_urls:
        raise CLIError("--replica-urls is for --workload conversations only")

    if args.compare_offline and args.url and not args.model:
        raise CLIError("--compare-offline with --url needs --model: the server's model "
                       "directory, for the offline run")
    model_dir = args.model
    if model_dir is None and not args.url:
        model_dir = str(demo_model_dir())
    vocab = args.vocab_size or (model_vocab(model_dir) if model_dir else DEFAULT_URL_VOCAB)
    if vocab <= 4:
        raise CLIError(f"--vocab-size must be above 4, got {vocab}")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    options = engine_options(args)
    pairs = [(c, r) for c in (args.concurrency or [None])
             for r in (args.request_rate or [math.inf])]
    runs: list[dict[str, Any]] = []
    prompts_of: list[list[list[int]]] = []

    def run_all(url: str) -> None:
        # Warm up (first kernels, first connection) on a prompt no run uses.
        warm = make_prompts(1, min(args.input_len, 16), 0, vocab, args.seed + 10_000)
        asyncio.run(run_load(url, warm, min(args.output_len, 2), 1, math.inf, args.seed,
                             args.served_model_name))
        # With --structured each setting runs free, then with the JSON schema.
        modes = [None, {"response_format": {"type": "json_schema", "json_schema": {
            "name": "bench", "schema": STRUCTURED_SCHEMA}}}] if args.structured else [None]
        if args.structured:
            # The grammar engine's vocabulary table and the schema's compile are built once
            # per server: warm them too, so the runs compare steady-state decoding.
            asyncio.run(run_load(url, warm, min(args.output_len, 2), 1, math.inf, args.seed,
                                 args.served_model_name, modes[1]))
        for i, (concurrency, rate) in enumerate(pairs):
            for j, extra in enumerate(modes):
                # Fresh prompts per run: an earlier run must not fill the prefix cache.
                prompts = make_prompts(args.num_prompts, args.input_len,
                                       args.shared_prefix_len, vocab,
                                       args.seed * 1000 + i * len(modes) + j)
                results, elapsed = asyncio.run(run_load(url, prompts, args.output_len,
                                                        concurrency, rate, args.seed + i,
                                                        args.served_model_name, extra))
                run = summarize(results, elapsed, concurrency, rate, args.output_len)
                run["structured"] = extra is not None
                runs.append(run)
                prompts_of.append(prompts)

    if args.url:
        run_all(args.url.rstrip("/"))
    else:
        assert model_dir is not None
        with server_in_process(model_dir, options) as url:
            run_all(url)
    threads = None
    if not args.url:
        import torch

        threads = torch.get_num_threads()
    figures: dict[str, Any] = {
        "model": model_dir, "url": args.url, "num_prompts": args.num_prompts,
        "input_len": args.input_len, "output_len": args.output_len,
        "shared_prefix_len": min(args.shared_prefix_len, args.input_len), "seed": args.seed,
        "threads": threads,
        "engine_options": options if not args.url else None,
        "runs": runs}
    if args.compare_offline:
        assert model_dir is not None
        busiest = max(range(len(runs)), key=lambda i: (
            min(runs[i]["concurrency"] or args.num_prompts, args.num_prompts),
            runs[i]["request_rate"] or math.inf, i))
        with pinned(args.offline_cpus, args.threads):
            offline = offline_throughput(model_dir, options, prompts_of[busiest],
                                         args.output_len)
        offline["compared_run"] = busiest
        figures["offline"] = offline
        server_tps = runs[busiest]["output_throughput"]
        figures["server_overhead"] = (server_tps / offline["output_throughput"]
                                      if server_tps and offline["output_throughput"] else None)
        # Offline batches up to max_num_seqs requests; the server only has `concurrency` in
        # flight. The same figure with offline held to that batch isolates the serving path.
        concurrency = runs[busiest]["concurrency"]
        if concurrency is not None and concurrency < int(options.get("max_num_seqs", 64)):
            with pinned(args.offline_cpus, args.threads):
                same = offline_throughput(model_dir, {**options, "max_num_seqs": concurrency},
                                          prompts_of[busiest], args.output_len)
            figures["offline_same_batch"] = same
            figures["server_overhead_same_batch"] = (
                server_tps / same["output_throughput"]
                if server_tps and same["output_throughput"] else None)
    return figures


def _ms(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"


def format_figures(f: dict[str, Any]) -> str:
    target = f["url"] or f"in-process server on {f['model']}"
    lines = [f"{target}: {f['num_prompts']} prompts of {f['input_len']} tokens "
             f"({f['shared_prefix_len']} shared), {f['output_len']} output tokens each"
             + (f", {f['threads']} torch threads" if f["threads"] else ""), "",
             f"{'conc':>5} {'rate':>6} {'json':>4} {'ok':>4} {'fail':>4} {'time s':>7} "
             f"{'req/s':>7} "
             f"{'out tok/s':>9} {'TTFT p50':>8} {'p99':>7} {'ITL p50':>7} {'p99':>7} "
             f"{'E2E p50':>8} {'p99':>8} {'cached':>7}"]
    for r in f["runs"]:
        rate = f"{r['request_rate']:.1f}" if r["request_rate"] is not None else "inf"
        conc = str(r["concurrency"]) if r["concurrency"] is not None else "-"
        json_mode = "yes" if r.get("structured") else "no"
        lines.append(
            f"{conc:>5} {rate:>6} {json_mode:>4} {r['completed']:>4} {r['failed']:>4} "
            f"{r['total_time_s']:>7.2f} {r['request_throughput'] or 0:>7.2f} "
            f"{r['output_throughput'] or 0:>9.1f} {_ms(r['ttft_ms']['p50']):>8} "
            f"{_ms(r['ttft_ms']['p99']):>7} {_ms(r['itl_ms']['p50']):>7} "
            f"{_ms(r['itl_ms']['p99']):>7} {_ms(r['e2e_ms']['p50']):>8} "
            f"{_ms(r['e2e_ms']['p99']):>8} {r['cached_tokens']:>7}")
    lines.append("(latencies in ms; conc -: no limit; rate inf: all at once; json yes: "
                 "every request constrained to a JSON schema)")
    free = [r for r in f["runs"] if not r.get("structured")]
    constrained = [r for r in f["runs"] if r.get("structured")]
    for a, b in zip(free, constrained, strict=False):
        if a["output_throughput"] and b["output_throughput"]:
            lines.append(f"structured output at concurrency {a['concurrency'] or '-'}: "
                         f"{b['output_throughput']:.1f} vs {a['output_throughput']:.1f} output "
                         f"tok/s free ({b['output_throughput'] / a['output_throughput']:.3f}x)")
    for r in f["runs"]:
        lines += [f"error (conc {r['concurrency']}): {e}" for e in r["errors"]]
        if r["short_outputs"]:
            lines.append(f"warning (conc {r['concurrency']}): {r['short_outputs']} requests "
                         f"got fewer than {f['output_len']} output tokens")
    if "offline" in f:
        off = f["offline"]
        run = f["runs"][off["compared_run"]]
        ratio = f["server_overhead"]
        lines += ["", f"offline LLM.generate, same prompts and engine options: "
                      f"{off['output_throughput']:.1f} output tok/s; server at concurrency "
                      f"{run['concurrency'] or '-'}: {run['output_throughput'] or 0:.1f} "
                      f"({ratio:.2f}x offline)" if ratio is not None else
                      f"offline: {off['output_throughput']:.1f} output tok/s"]
        same_ratio = f.get("server_overhead_same_batch")
        if same_ratio is not None:
            lines.append(f"offline with max_num_seqs = that concurrency: "
                         f"{f['offline_same_batch']['output_throughput']:.1f} output tok/s "
                         f"(server {same_ratio:.2f}x)")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None,
                        help="a running server, e.g. http://127.0.0.1:8000 (default: start "
                             "one in this process on a free loopback port)")
    parser.add_argument("--model", default=None,
                        help="model directory of the in-process server, of --compare-offline "
                             "and of the prompts' vocabulary (default: the demo model "
                             "`hybridkv serve` uses; with --url, none)")
    parser.add_argument("--served-model-name", default=None,
                        help="the `model` field of the requests (default: none sent)")
    parser.add_argument("--num-prompts", type=positive_int, default=64,
                        help="requests per run")
    parser.add_argument("--concurrency", type=positive_int, nargs="+", default=None,
                        help="requests in flight at most; several values: one run each "
                             "(default: no limit)")
    parser.add_argument("--request-rate", type=request_rate, nargs="+", default=None,
                        help="requests per second, Poisson arrivals; inf: all at once; "
                             "several values: one run each (default: inf)")
    parser.add_argument("--input-len", type=positive_int, default=128,
                        help="prompt tokens (random ids)")
    parser.add_argument("--output-len", type=positive_int, default=64,
                        help="output tokens per request (ignore_eos, greedy)")
    parser.add_argument("--shared-prefix-len", type=non_negative_int, default=0,
                        help="leading prompt tokens common to every prompt of a run")
    parser.add_argument("--vocab-size", type=positive_int, default=None,
                        help=f"token ids are drawn in [4, this) (default: the model's; with "
                             f"--url and no --model, {DEFAULT_URL_VOCAB})")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="seed of the prompts and arrival times")
    group = parser.add_argument_group(
        "conversation workload (--workload conversations; bench/conversations.py)")
    group.add_argument("--workload", choices=["random", "conversations"], default="random",
                       help="random: --num-prompts random-id prompts per run; conversations: "
                            "multi-turn chats resending the conversation every turn")
    group.add_argument("--users", type=positive_int, default=8,
                       help="concurrent users, each with its own conversation")
    group.add_argument("--turns", type=positive_int, default=6,
                       help="turns per user, in order")
    group.add_argument("--system-tokens", type=positive_int, default=1000,
                       help="the shared system prompt's length (about)")
    group.add_argument("--per-user-system", action="store_true",
                       help="a different system prompt of --system-tokens per user: no prefix "
                            "shared across users, so only routing that keeps a conversation "
                            "on one replica reuses it")
    group.add_argument("--answer-tokens", type=positive_int, default=32,
                       help="tokens per answer (ignore_eos, greedy)")
    group.add_argument("--variant", nargs="+", choices=["resend", "edit", "branch"],
                       default=["resend"],
                       help="resend: append a message each turn; edit: replace the last user "
                            "message by an edited one; branch: from turn 3 on, restart from "
                            "turn 3's state with a different message; several: one run each")
    group.add_argument("--replica-urls", nargs="+", default=None, metavar="URL",
                       help="with --url a router: the replicas behind it, whose /metrics give "
                            "per-replica requests, prefix-cache hit rate and TTFT (default: none)")
    group.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                       help="completions: the conversation as plain text (no chat template "
                            "needed); chat: /v1/chat/completions with the messages")
    parser.add_argument("--structured", action="store_true",
                        help="random workload: run each setting twice, free and with every "
                             "request constrained to a JSON schema (response_format), and "
                             "report the output tok/s of both")
    parser.add_argument("--compare-offline", action="store_true",
                        help="also time the busiest run's prompts through offline "
                             "LLM.generate with the same engine options (after the server "
                             "stopped) and report server / offline output tok/s")
    parser.add_argument("--offline-cpus", type=cpu_list, default=None, metavar="LIST",
                        help="run the --compare-offline run on these CPUs (e.g. 0, or 0,1): "
                             "those a server in another process was pinned to (default: "
                             "where this process runs)")
    group = parser.add_argument_group("engine options (in-process server and offline run)")
    add_server_engine_arguments(group)  # --threads among them
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        import httpx  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise CLIError(f"hybridkv bench serve needs the server extra (missing {e.name}): "
                       f"pip install 'hybridkv[server]'") from None
    figures = bench_serve(args)
    if args.json:
        print(json.dumps(figures))
    elif figures.get("workload") == "conversations":
        from hybridkv.bench.conversations import format_conversations

        print(format_conversations(figures))
    else:
        print(format_figures(figures))
    return 0


COMMAND = Command("serve", "the OpenAI-compatible server under load: TTFT, inter-token "
                           "latency and throughput per concurrency, optionally vs offline",
                  add_arguments, run)
