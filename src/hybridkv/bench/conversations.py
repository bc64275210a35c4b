"""`hybridkv bench serve --workload conversations`: multi-turn chats, where prefix caching
across requests is what saves the prefill.

A system prompt of about `--system-tokens` tokens shared by `--users` users (with
`--per-user-system`, one of that length per user instead: conversations that share no prefix,
as when every user brings their own document or history); each user runs
`--turns` turns in order (a turn is sent when the previous answer has arrived), the users
concurrently. Every turn resends the conversation, as chat clients do, plus a new user
message of about 30-60 tokens; answers are `--answer-tokens` long (temperature 0,
ignore_eos). Messages are words of a fixed list drawn by a seeded RNG, so the text is the
same on every server. Variants (`--variant`):

- resend: turn t sends [system, u1, a1, ..., u(t-1), a(t-1), ut].
- edit: every turn after the first replaces the last user message by an edited one (its
  first half kept, the rest new words) instead of appending: the prefix up to the previous
  assistant answer stays; with one user message in the conversation, that is the system
  prompt and the message's first half.
- branch: from turn 3 on, every turn restarts from turn 3's state (the system prompt and the
  first two exchanges, answers included) with a different new message.

Behind a router (`--url` the router's), `--replica-urls` names the replicas: each one's
/metrics before and after a run give its requests, prompt tokens, prefix-cache hit tokens
and hit rate, and its mean TTFT (vLLM's metric names, which hybridkv also serves), so
cache-aware and round-robin routing can be compared; the first replica answers /tokenize,
which routers do not forward.

`--endpoint completions` (the default) renders the conversation as plain text
("System: ...\\n\\nUser: ...\\nAssistant: ...") so models without a chat template run it;
`chat` sends the messages to /v1/chat/completions.

Per request the server's `usage.prompt_tokens_details.cached_tokens` (hybridkv, vLLM,
llama-server) or llama-server's `timings.cache_n` gives the tokens it recomputed. After the
run, the server's /tokenize (hybridkv and vLLM: {"prompt"}, llama-server: {"content"}) turns
every prompt, and every prompt followed by its answer's text, into tokens: a turn's new
tokens are those past the longest common prefix with anything the same user sent or
received before. The excess (recomputed - new) is what a cache that keeps every computed
token would not recompute; a block-granular cache such as hybridkv's stays within one block
(16) of zero, plus one token after a resent answer (its last token was sampled, never run
through the model, so no server has its KV). An answer whose generated tokens are not how
the server tokenizes its text (random-weight models, a token merging across the answer's
end) costs a recompute from there that no cache keyed on tokens avoids; `new_vs_prompts`
counts new tokens against the earlier prompts only (answers as new), a bound that holds
regardless.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridkv.bench.serve import MAX_ERRORS_KEPT, RequestResult, percentiles, stream_request

VARIANTS = ("resend", "edit", "branch")
ENDPOINTS = ("completions", "chat")
MESSAGE_TOKENS = (30, 60)
BRANCH_TURN = 3
BLOCK = 16  # hybridkv's block size: the excess a block-granular cache may show

# Common English words, one token each in most tokenizers; the fixed list keeps the text
# identical across servers and versions.
_WORDS = (
    "the of and to in is was for on that with as by at from his her he she it they we you "
    "this are be had have not but or an which were their one all there been has would when "
    "who will more no if out so said what up its about into than them can only other new "
    "some could time these two may then do first any my now such like our over man me even "
    "most made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same "
    "another know while last might us great old year off come since against go came right "
    "used take three states himself few house use during without again place around however "
    "home small found thought went say part once general high upon school every does got "
    "united left number course war until always away something fact though water less public "
    "put think almost hand enough far took head yet government system better set told nothing "
    "night end why called didn eyes find going look asked later knew point next city give "
    "group young days let room president side social present given several order national "
    "possible rather second face per among form important often things looked early white "
    "case large need big become felt children along saw best church ever least power "
    "development light seemed family interest want members others mind country area done "
    "turned although open service problem certain kind different thing began whole back")
WORDS = tuple(_WORDS.split())


def words(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(n)]


def system_prompts(seed: int, variant: str, users: int, system_tokens: int,
                   words_per_token: float, per_user: bool = False) -> list[str]:
    """Each user's system prompt: one shared by all, or (per_user) a different one each.
    Fresh per (seed, variant): one run must not warm the next."""
    n = max(1, round(system_tokens * words_per_token))
    if not per_user:
        shared = " ".join(words(random.Random(f"{seed}-{variant}-system"), n))
        return [shared] * users
    return [" ".join(words(random.Random(f"{seed}-{variant}-system-{u}"), n))
            for u in range(users)]


@dataclass
class Turn:
    """One request of one user: what it sent, what came back."""
    user: int
    turn: int  # 1-based
    messages: list[dict[str, str]]
    result: RequestResult = field(default_factory=RequestResult)
    answer: str = ""
    recomputed: int | None = None  # None: the server did not report its cache hits
    new_tokens: int | None = None  # None: the server has no /tokenize
    new_vs_prompts: int | None = None


class Conversation:
    """One user's messages: deterministic in (seed, user), answers filled in as they come."""

    def __init__(self, system: str, variant: str, rng: random.Random, words_per_token: float):
        self.variant, self.rng, self.wpt = variant, rng, words_per_token
        self.system = system
        self.history: list[dict[str, str]] = [{"role": "system", "content": system}]
        self.last_user: list[str] = []
        self.branch_state: list[dict[str, str]] | None = None

    def message_words(self) -> int:
        lo, hi = MESSAGE_TOKENS
        return max(1, round(self.rng.randint(lo, hi) * self.wpt))

    def next_messages(self, turn: int) -> list[dict[str, str]]:
        if self.variant == "edit" and turn > 1:
            kept = self.last_user[:len(self.last_user) // 2]
            text = kept + words(self.rng, max(1, self.message_words() - len(kept)))
            self.history = self.history[:-2]  # the last user message and its answer
        else:
            if self.variant == "branch" and turn >= BRANCH_TURN:
                if self.branch_state is None:
                    self.branch_state = list(self.history)
                self.history = list(self.branch_state)
            text = words(self.rng, self.message_words())
        self.last_user = text
        self.history.append({"role": "user", "content": " ".join(text)})
        return list(self.history)

    def answered(self, answer: str) -> None:
        self.history.append({"role": "assistant", "content": answer})


def render_text(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The conversation as plain text for /v1/completions."""
    parts = []
    for m in messages:
        if m["role"] == "system":
            parts.append(f"System: {m['content']}\n\n")
        elif m["role"] == "user":
            parts.append(f"User: {m['content']}\n")
        else:  # the answer as generated, after "Assistant:"
            parts.append(f"Assistant:{m['content']}\n")
    if add_generation_prompt:
        parts.append("Assistant:")
    return "".join(parts)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


# ---------------------------------------------------------------- the client

async def send_turn(client: Any, url: str, endpoint: str, messages: list[dict[str, str]],
                    answer_tokens: int, model: str | None) -> tuple[RequestResult, str]:
    """Stream one turn; (the result, the answer's text)."""
    body: dict[str, Any] = {"max_tokens": answer_tokens, "temperature": 0.0,
                            "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = messages
        path = "/v1/chat/completions"
    else:
        body["prompt"] = render_text(messages)
        path = "/v1/completions"
    if model is not None:
        body["model"] = model
    return await stream_request(client, url + path, body, RequestResult(),
                                chat=endpoint == "chat")


class Tokenizer:
    """The server's own tokenization, through its /tokenize endpoint."""

    def __init__(self, client: Any, url: str, endpoint: str, model: str | None):
        self.client, self.url, self.endpoint, self.model = client, url, endpoint, model
        self.dialect: str | None = None  # "hybridkv" ({"prompt"}) or "llama" ({"content"})

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        response = await self.client.post(self.url + path, json=body)
        return response.json() if response.status_code == 200 else None

    async def text(self, text: str) -> list[int] | None:
        for dialect in ([self.dialect] if self.dialect else ["hybridkv", "llama"]):
            if dialect == "hybridkv":
                body: dict[str, Any] = {"prompt": text}
                if self.model is not None:
                    body["model"] = self.model
            else:
                body = {"content": text, "add_special": True}
            reply = await self._post("/tokenize", body)
            tokens = reply.get("tokens") if reply else None
            if isinstance(tokens, list) and (tokens or not text):
                self.dialect = dialect
                return [t if isinstance(t, int) else t.get("id") for t in tokens]
        return None

    async def conversation(self, messages: list[dict[str, str]],
                           add_generation_prompt: bool) -> list[int] | None:
        if self.endpoint == "completions":
            return await self.text(render_text(messages, add_generation_prompt))
        if self.dialect in (None, "hybridkv"):
            body: dict[str, Any] = {"messages": messages,
                                    "add_generation_prompt": add_generation_prompt}
            if self.model is not None:
                body["model"] = self.model
            reply = await self._post("/tokenize", body)
            if reply and isinstance(reply.get("tokens"), list):
                self.dialect = "hybridkv"
                return [int(t) for t in reply["tokens"]]
        # llama-server: render with its template, then tokenize the text
        rendered = await self._post("/apply-template", {"messages": messages})
        if not rendered or not isinstance(rendered.get("prompt"), str):
            return None
        # (The template adds its generation prompt after an answer too: past the LCP.)
        self.dialect = "llama"
        return await self.text(rendered["prompt"])


async def words_per_token(tokenizer: Tokenizer, rng: random.Random) -> float:
    """Words of the list per token of this server's tokenizer (1.0 if it cannot tell)."""
    sample = words(rng, 400)
    counts = []
    for text in (" ".join(sample), " ".join(sample[:200])):
        tokens = await tokenizer.text(text)
        if tokens is None:
            return 1.0
        counts.append(len(tokens))
    per = 200 / max(1, counts[0] - counts[1])
    return min(4.0, max(0.1, per))


# Per replica, summed over labels: (name, the other server's name for it).
REPLICA_METRICS = {"queries": ("vllm:prefix_cache_queries_total",),
                   "hits": ("vllm:prefix_cache_hits_total",),
                   "ttft_sum": ("hybridkv:time_to_first_token_seconds_sum",
                                "vllm:time_to_first_token_seconds_sum"),
                   "ttft_count": ("hybridkv:time_to_first_token_seconds_count",
                                  "vllm:time_to_first_token_seconds_count")}


async def scrape(client: Any, url: str) -> dict[str, float] | None:
    """The REPLICA_METRICS of one server's /metrics (None: it has none)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = await client.get(f"{url}/metrics")
    except Exception:
        return None
    if response.status_code != 200:
        return None
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    out = {}
    for key, names in REPLICA_METRICS.items():
        found = [samples[n] for n in names if n in samples]
        out[key] = found[0] if found else 0.0
    return out


def replica_figures(url: str, before: dict[str, float] | None,
                    after: dict[str, float] | None) -> dict[str, Any]:
    if before is None or after is None:
        return {"url": url, "requests": None, "prompt_tokens": None, "hit_tokens": None,
                "hit_rate": None, "ttft_mean_ms": None}
    d = {k: after[k] - before[k] for k in REPLICA_METRICS}
    return {"url": url, "requests": int(d["ttft_count"]), "prompt_tokens": int(d["queries"]),
            "hit_tokens": int(d["hits"]),
            "hit_rate": d["hits"] / d["queries"] if d["queries"] else None,
            "ttft_mean_ms": 1000 * d["ttft_sum"] / d["ttft_count"] if d["ttft_count"] else None}


async def run_conversations(url: str, variant: str, users: int, turns: int,
                            system_tokens: int, answer_tokens: int, endpoint: str,
                            seed: int, model: str | None = None,
                            replica_urls: Sequence[str] = (),
                            per_user_system: bool = False) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=users + 1, max_keepalive_connections=users + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        tokenizer = Tokenizer(client, replica_urls[0] if replica_urls else url, endpoint,
                              model)
        wpt = await words_per_token(tokenizer, random.Random(seed))
        systems = system_prompts(seed, variant, users, system_tokens, wpt, per_user_system)
        convs = [Conversation(systems[u], variant, random.Random(f"{seed}-{variant}-{u}"), wpt)
                 for u in range(users)]
        log: list[list[Turn]] = [[] for _ in range(users)]

        async def user(u: int) -> None:
            for t in range(1, turns + 1):
                turn = Turn(u, t, convs[u].next_messages(t))
                turn.result, turn.answer = await send_turn(
                    client, url, endpoint, turn.messages, answer_tokens, model)
                log[u].append(turn)
                convs[u].answered(turn.answer)

        before = [await scrape(client, r) for r in replica_urls]
        start = time.perf_counter()
        await asyncio.gather(*(user(u) for u in range(users)))
        elapsed = time.perf_counter() - start
        replicas = [replica_figures(r, b, await scrape(client, r))
                    for r, b in zip(replica_urls, before, strict=True)]
        # The server's tokens of every prompt and prompt + answer, after the timed part.
        for u in range(users):
            seen: list[list[int]] = []
            prompts_seen: list[list[int]] = []
            for turn in log[u]:
                if turn.result.ok and turn.result.cache_reported:
                    turn.recomputed = turn.result.prompt_tokens - turn.result.cached_tokens
                prompt = await tokenizer.conversation(turn.messages, True)
                if prompt is None:
                    continue
                turn.new_tokens = len(prompt) - max(
                    (common_prefix(prompt, s) for s in seen), default=0)
                turn.new_vs_prompts = len(prompt) - max(
                    (common_prefix(prompt, s) for s in prompts_seen), default=0)
                full = await tokenizer.conversation(
                    [*turn.messages, {"role": "assistant", "content": turn.answer}], False)
                seen += [prompt] + ([full] if full is not None else [])
                prompts_seen.append(prompt)
    return {**summarize(variant, log, elapsed, answer_tokens, wpt), "replicas": replicas}


def summarize(variant: str, log: list[list[Turn]], elapsed: float, answer_tokens: int,
              wpt: float) -> dict[str, Any]:
    turns = [t for user in log for t in user]
    ok = [t for t in turns if t.result.ok]
    output = sum(t.result.output_tokens for t in ok)

    def excess(t: Turn, new: int | None) -> int | None:
        return t.recomputed - new if t.recomputed is not None and new is not None else None

    per_turn = []
    for n in range(1, max((t.turn for t in turns), default=0) + 1):
        at = [t for t in ok if t.turn == n]

        def mean(values: list[int | None]) -> float | None:
            known = [v for v in values if v is not None]
            return sum(known) / len(known) if len(known) == len(values) and known else None

        def most(values: list[int | None]) -> int | None:
            known = [v for v in values if v is not None]
            return max(known) if len(known) == len(values) and known else None

        per_turn.append({
            "turn": n, "requests": len(at),
            "prompt_tokens": mean([t.result.prompt_tokens for t in at]),
            "recomputed": mean([t.recomputed for t in at]),
            "new_tokens": mean([t.new_tokens for t in at]),
            "new_vs_prompts": mean([t.new_vs_prompts for t in at]),
            "max_excess": most([excess(t, t.new_tokens) for t in at]),
            "max_excess_vs_prompts": most([excess(t, t.new_vs_prompts) for t in at]),
            "ttft_ms": percentiles([t.result.ttft_s for t in at if t.result.ttft_s is not None]),
        })
    reported = bool(ok) and all(t.recomputed is not None for t in ok)
    later = [t for t in ok if t.turn > 1]

    def max_excess(key: str) -> int | None:
        values = [excess(t, getattr(t, key)) for t in later]
        known = [v for v in values if v is not None]
        return max(known) if known and len(known) == len(values) else None

    return {
        "variant": variant, "users": len(log), "turns": max((t.turn for t in turns), default=0),
        "words_per_token": wpt,
        "completed": len(ok), "failed": len(turns) - len(ok),
        "errors": [t.result.error for t in turns if t.result.error][:MAX_ERRORS_KEPT],
        "short_outputs": sum(1 for t in ok if t.result.output_tokens < answer_tokens),
        "total_time_s": elapsed,
        "output_throughput": output / elapsed if elapsed else None,
        "total_input_tokens": sum(t.result.prompt_tokens for t in ok),
        "total_output_tokens": output,
        "cache_reported": reported,
        "total_recomputed": sum(t.recomputed or 0 for t in ok) if reported else None,
        "ttft_ms": percentiles([t.result.ttft_s for t in ok if t.result.ttft_s is not None]),
        "itl_ms": percentiles([g for t in ok for g in t.result.itl_s]),
        "e2e_ms": percentiles([t.result.latency_s for t in ok]),
        "per_turn": per_turn,
        # Over the turns after the first (the first's new tokens include the system prompt).
        "max_excess": max_excess("new_tokens"),
        "max_excess_vs_prompts": max_excess("new_vs_prompts"),
        "requests": [{"user": t.user, "turn": t.turn, "ok": t.result.ok,
                      "prompt_tokens": t.result.prompt_tokens, "recomputed": t.recomputed,
                      "new_tokens": t.new_tokens, "new_vs_prompts": t.new_vs_prompts,
                      "output_tokens": t.result.output_tokens} for t in turns],
    }


def _n(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_conversations(f: dict[str, Any]) -> str:
    target = f["url"] or f"in-process server on {f['model']}"
    system = "per-user system prompts" if f.get("per_user_system") else "system prompt"
    lines = [f"{target}: conversations, {f['users']} users x {f['turns']} turns, {system} "
             f"~{f['system_tokens']} tokens, {f['answer_tokens']}-token answers, "
             f"/v1/{'chat/' if f['endpoint'] == 'chat' else ''}completions"]
    for r in f["runs"]:
        lines += ["", f"{r['variant']}: {r['completed']} ok, {r['failed']} failed, "
                      f"{r['total_time_s']:.2f} s, {r['output_throughput'] or 0:.1f} out tok/s, "
                      f"TTFT p50 {_n(r['ttft_ms']['p50'], 1)} / p99 "
                      f"{_n(r['ttft_ms']['p99'], 1)} ms, recomputed "
                      + (f"{r['total_recomputed']} of {r['total_input_tokens']} prompt tokens"
                         if r["cache_reported"] else "not reported"),
                  f"{'turn':>4} {'prompt':>7} {'recomp':>7} {'new':>6} {'excess':>7} "
                  f"{'new(p)':>7} {'exc(p)':>7} {'TTFT p50':>9}"]
        for t in r["per_turn"]:
            lines.append(f"{t['turn']:>4} {_n(t['prompt_tokens']):>7} "
                         f"{_n(t['recomputed']):>7} {_n(t['new_tokens']):>6} "
                         f"{_n(t['max_excess']):>7} {_n(t['new_vs_prompts']):>7} "
                         f"{_n(t['max_excess_vs_prompts']):>7} "
                         f"{_n(t['ttft_ms']['p50'], 1):>9}")
        lines.append(f"max excess over turns 2+: {_n(r['max_excess'])} (vs earlier prompts "
                     f"only: {_n(r['max_excess_vs_prompts'])}); one block is {BLOCK}")
        for rep in r.get("replicas", []):
            rate = rep["hit_rate"]
            lines.append(f"replica {rep['url']}: {_n(rep['requests'])} requests, "
                         f"{_n(rep['prompt_tokens'])} prompt tokens, {_n(rep['hit_tokens'])} "
                         f"from its prefix cache ("
                         + ("-" if rate is None else f"{100 * rate:.1f}%")
                         + f"), TTFT mean {_n(rep['ttft_mean_ms'], 1)} ms")
        lines += [f"error: {e}" for e in r["errors"]]
        if r["short_outputs"]:
            lines.append(f"warning: {r['short_outputs']} answers got fewer than "
                         f"{f['answer_tokens']} tokens")
    lines.append("(tokens are means over users; excess: recomputed - new, the most over "
                 "users; (p): answers counted as new; -: not reported)")
    return "\n".join(lines)
