"""`hybridkv bench spec MODEL`: decode speed with speculative decoding on and off, on a
copy-heavy workload and a prose one.

- copy: "repeat this text" and "edit this text" (a rename) over excerpts of a file given in
  the prompt (`--file`, default the GPL-3.0 text shipped with the package): the answer
  copies most of its prompt, which is where drafts hit;
- prose: an open-ended story, which repeats little of its prompt (drafts should cost
  nothing there: the back-off stops them).

Each workload runs `--batch` requests at once (distinct excerpts; `--batches` such batches
one after another, tokens/s the mean of theirs), greedy, EOS ignored,
`--max-tokens` tokens each, once to warm up and then `--rounds` times, on one engine with
`--speculative-config` and one without, both loaded, the rounds alternating between them
(which goes first alternates too). Decode tokens/s counts the tokens after each request's
first one over the time after the step that brought the batch's first tokens (prefill is
not timed), median of the rounds. The ratio is the median of the rounds' on / off ratios;
the greedy tokens of both runs are compared, and the drafts scored and kept are
reported. Models without a tokenizer get token-id prompts of the same shape (a random
"file", its copy asked for by position only). Run it pinned and alone: `taskset -c 0
hybridkv bench spec MODEL --threads 1`.

Beside llama-server: for a GGUF model at batch 1, when llama.cpp's binaries are there
(`shared/bench/peer-llamacpp/setup.sh`), the same token-id prompts go to llama-server on the
same file, the same threads and cores (the affinity is inherited), without speculation and
with each `--llama-spec-types` entry (`--spec-type ngram-simple` ...), its own
`predicted_per_second` per request, median of the rounds after a warm-up; its greedy tokens
with speculation are compared with its own without.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.cli import Command, positive_int, speculative_config

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}
EXCERPT_CHARS = 1200  # about 300 tokens of English: the text to repeat or edit
PROSE = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
         "Describe the storm, the keeper's past and what the message says.")


@dataclass
class WorkloadRun:
    tokens: list[list[int]]  # per request, its output
    decode_tok_s: float  # median over the rounds
    num_draft_tokens: int
    num_accepted_tokens: int


def _text(path: str | None) -> str:
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    from importlib import resources

    return (resources.files("hybridkv") / "data" / "texts" / "gpl-3.0.txt").read_text(
        encoding="utf-8")


def text_workloads(text: str, batch: int) -> dict[str, list[str]]:
    """Per workload, `batch` user messages (copy and edit take distinct excerpts)."""
    step = max(1, (len(text) - EXCERPT_CHARS) // max(1, batch))
    excerpts = [text[i * step:i * step + EXCERPT_CHARS] for i in range(batch)]
    return {
        "copy": [f"Repeat the following text exactly, word for word, and nothing else:\n\n"
                 f"{e}" for e in excerpts],
        "edit": [f"Rewrite the following text with every \"the\" replaced by \"THE\"; change "
                 f"nothing else:\n\n{e}" for e in excerpts],
        "prose": [PROSE] * batch,
    }


def token_workloads(vocab: int, batch: int) -> dict[str, list[list[int]]]:
    """Token-id prompts of the same shape, for a model without a tokenizer: a seeded random
    "file" followed by its first tokens (a copy under way), and a random prompt."""
    rng = random.Random(0)
    files = [[rng.randrange(4, vocab) for _ in range(300)] for _ in range(batch)]
    return {"copy": [f + f[:8] for f in files],
            "prose": [[rng.randrange(4, vocab) for _ in range(40)] for _ in range(batch)]}


def _render(llm: Any, model: str, messages: list[str]) -> list[Any]:
    """Prompts through the model's chat template when it has one, else the plain text."""
    from hybridkv.server.chat import ChatTemplate, find_chat_template, special_tokens

    path = Path(model)
    template = find_chat_template(path) if path.is_dir() else None
    template = template or llm.engine.parts.chat_template
    if template is None:
        return list(messages)
    variables = {**(llm.engine.parts.special_tokens or {}), **special_tokens(model)}
    chat = ChatTemplate(template, variables)
    rendered = [chat.render([{"role": "user", "content": m}], add_generation_prompt=True)
                for m in messages]
    # The rendered text carries the BOS token already: encode it without another.
    return [list(llm.engine.tokenizer.encode(r, add_special_tokens=False).ids)
            for r in rendered]


def run_round(llm: Any, prompts: list[Any], max_tokens: int, tag: str
              ) -> tuple[float, list[list[int]], int, int]:
    """One batch of a workload's round: (decode tokens/s, each request's output, drafts
    scored, drafts kept)."""
    from hybridkv.sched.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    llm.reset_prefix_cache()  # each round prefills its prompts (not timed anyway)
    ids = [f"spec-{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    outputs: dict[str, Any] = {}
    started: float | None = None
    before = 0  # tokens the requests had when the timing started
    while engine.has_unfinished:
        for out in engine.step():
            outputs[out.request_id] = out
        if started is None and len(outputs) == len(ids):
            # Every request has its first token: from here on the steps decode.
            started = time.perf_counter()
            before = sum(len(o.token_ids) for o in outputs.values())
    elapsed = time.perf_counter() - (started or time.perf_counter())
    decoded = sum(len(outputs[r].token_ids) for r in ids) - before
    return (decoded / elapsed if elapsed > 0 else 0.0, [outputs[r].token_ids for r in ids],
            sum(outputs[r].num_draft_tokens for r in ids),
            sum(outputs[r].num_accepted_tokens for r in ids))


def run_batches(llm: Any, batches: list[list[Any]], max_tokens: int, tag: str
                ) -> tuple[float, list[list[int]], int, int]:
    """A workload's round: its batches one after another; tokens/s is the mean of theirs."""
    rates, tokens, drafts, kept = [], [], 0, 0
    for b, prompts in enumerate(batches):
        rate, out, d, k = run_round(llm, prompts, max_tokens, f"{tag}-{b}")
        rates.append(rate)
        tokens += out
        drafts += d
        kept += k
    return statistics.fmean(rates), tokens, drafts, kept


def run_paired(engines: dict[str, Any], batches: list[list[Any]], max_tokens: int,
               rounds: int) -> tuple[dict[str, WorkloadRun], list[float]]:
    """The workload on each engine in turn, a warm-up round and then `rounds` timed ones,
    alternating which goes first: each engine's run, and the on / off ratio per round."""
    rates: dict[str, list[float]] = {name: [] for name in engines}
    runs: dict[str, WorkloadRun] = {}
    totals = {name: [0, 0] for name in engines}
    ratios = []
    for round_index in range(rounds + 1):  # round 0 warms up
        order = list(engines) if round_index % 2 else list(reversed(engines))
        tokens: dict[str, list[list[int]]] = {}
        for name in order:
            rate, tokens[name], drafts, kept = run_batches(
                engines[name], batches, max_tokens, f"{name}-{round_index}")
            if round_index:
                rates[name].append(rate)
                totals[name][0] += drafts
                totals[name][1] += kept
        if round_index:
            ratios.append(rates["on"][-1] / rates["off"][-1] if rates["off"][-1] else 0.0)
            for name in engines:
                runs[name] = WorkloadRun(tokens[name], statistics.median(rates[name]),
                                         *totals[name])
    return runs, ratios


DEFAULT_LLAMA_SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")


def llama_server_runs(binary: Path, model: str, prompts: dict[str, list[list[int]]], *,
                      types: list[str], max_tokens: int, rounds: int, threads: int,
                      ctx: int) -> dict[str, Any]:
    """Per llama-server `--spec-type` ("none": without speculation), per workload: the median
    decode tok/s, the drafts made and kept, and whether the greedy tokens equal its own run
    without speculation."""
    from hybridkv.bench.peer_llama_server import LlamaServer

    runs: dict[str, dict[str, Any]] = {}
    for kind in ["none", *types]:
        extra = [] if kind == "none" else ["--spec-type", kind]
        per: dict[str, Any] = {}
        with LlamaServer(binary, model, threads=threads, ctx=ctx, extra=extra) as server:
            for w, ps in prompts.items():
                rates, tokens, drafts, accepted = [], [], 0, 0
                for round_index in range(rounds + 1):  # round 0 warms up
                    outs = [server.complete(p, max_tokens) for p in ps]
                    if round_index:
                        rates.append(statistics.median(o.decode_tok_s for o in outs))
                        tokens = [o.tokens for o in outs]
                        drafts += sum(o.num_draft_tokens for o in outs)
                        accepted += sum(o.num_accepted_tokens for o in outs)
                per[w] = {"decode_tok_s": statistics.median(rates), "tokens": tokens,
                          "num_draft_tokens": drafts, "num_accepted_tokens": accepted}
        runs[kind] = per
    out: dict[str, Any] = {}
    for kind, per in runs.items():
        out[kind] = {}
        for w, r in per.items():
            base = runs["none"][w]["decode_tok_s"]
            out[kind][w] = {
                "decode_tok_s": r["decode_tok_s"],
                "ratio": r["decode_tok_s"] / base if base else None,
                "num_draft_tokens": r["num_draft_tokens"],
                "num_accepted_tokens": r["num_accepted_tokens"],
                "same_tokens": r["tokens"] == runs["none"][w]["tokens"]}
    return out


def _llama_peer(model: str, batch: int, llama_bin: Path | None) -> tuple[Path | None, str]:
    """(llama-server's path and the GGUF file) when the peer can run, else (None, why not)."""
    from hybridkv.bench.gguf import DEFAULT_LLAMA_BIN
    from hybridkv.models.sources import resolve_model

    try:
        source = resolve_model(model)
    except ValueError as e:
        return None, str(e)
    if not source.is_gguf:
        return None, "the model is not a GGUF file"
    if batch != 1:
        return None, "it runs at batch 1 (one llama-server slot)"
    binary = (llama_bin or DEFAULT_LLAMA_BIN) / "llama-server"
    if not binary.is_file():
        return None, (f"no llama-server in {binary.parent}: run "
                      f"shared/bench/peer-llamacpp/setup.sh, or pass --llama-bin")
    return binary, str(source.path)


def bench_spec(model: str, *, spec: dict[str, Any], max_tokens: int, batch: int,
               rounds: int, threads: int | None, max_model_len: int,
               kv_cache_memory: str | None, file: str | None,
               activations: str = "float32", llama_bin: Path | None = None,
               llama_spec_types: list[str] | None = None,
               num_batches: int = 1) -> dict[str, Any]:
    from hybridkv.engine.llm import LLM

    options: dict[str, Any] = dict(max_model_len=max_model_len, threads=threads,
                                   max_num_seqs=batch, max_num_batched_tokens=2048,
                                   quant_activations=activations)
    if kv_cache_memory is not None:
        options["kv_cache_memory"] = kv_cache_memory
    # Both engines at once, the rounds alternating between them: the machine's drift
    # (another process, the clock) falls on both alike; the ratio is the median of the
    # rounds' ratios.
    engines = {"off": LLM(model, **options), "on": LLM(model, **options,
                                                       speculative_config=spec)}
    llm = engines["off"]
    if llm.engine.tokenizer is not None:
        messages = text_workloads(_text(file), batch * num_batches)
        prompts = {w: _render(llm, model, m) for w, m in messages.items()}
        tokenizer = llm.engine.tokenizer
        id_prompts = {w: [p if isinstance(p, list) else list(tokenizer.encode(p).ids)
                          for p in ps] for w, ps in prompts.items()}
        kind = "text"
    else:
        prompts = dict(token_workloads(llm.engine.vocab_size, batch * num_batches))
        id_prompts = dict(prompts)
        kind = "token ids (the model has no tokenizer)"
    workloads = {}
    for w, p in prompts.items():
        batches = [p[i:i + batch] for i in range(0, len(p), batch)]
        runs, ratios = run_paired(engines, batches, max_tokens, rounds)
        off, on = runs["off"], runs["on"]
        workloads[w] = {
            "off_decode_tok_s": off.decode_tok_s, "on_decode_tok_s": on.decode_tok_s,
            "ratio": statistics.median(ratios) if off.decode_tok_s else None,
            "ratios": ratios, "num_draft_tokens": on.num_draft_tokens,
            "num_accepted_tokens": on.num_accepted_tokens,
            "same_tokens": on.tokens == off.tokens}
    for engine in engines.values():
        engine.close()
    del engines, llm
    gc.collect()
    result = {"model": model, "speculative_config": spec, "prompts": kind, "batch": batch,
              "batches": num_batches,
              "max_tokens": max_tokens, "rounds": rounds, "quant_activations": activations,
              "workloads": workloads}
    if llama_spec_types is not None:
        binary, detail = _llama_peer(model, batch, llama_bin)  # detail: the file, or why not
        if binary is None:
            result["llama_server_skipped"] = detail
        else:
            count = threads or len(os.sched_getaffinity(0))
            result["llama_server"] = llama_server_runs(
                binary, detail, id_prompts, types=llama_spec_types, max_tokens=max_tokens,
                rounds=rounds, threads=count, ctx=max_model_len)
            result["llama_server_threads"] = count
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{result['model']}: batch {result['batch']} x {result.get('batches', 1)}, "
             f"{result['max_tokens']} greedy "
             f"tokens per request, {result['rounds']} rounds alternating (ratio: median of "
             f"theirs), {result['prompts']}, "
             f"{result.get('quant_activations', 'float32')} activations",
             f"speculative_config {json.dumps(result['speculative_config'])}",
             f"{'workload':10} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>7} "
             f"{'accepted / drafts':>18} {'same tokens':>12}"]
    for name, w in result["workloads"].items():
        ratio = f"{w['ratio']:.2f}x" if w["ratio"] is not None else "-"
        lines.append(f"{name:10} {w['off_decode_tok_s']:10.1f} {w['on_decode_tok_s']:10.1f} "
                     f"{ratio:>7} {w['num_accepted_tokens']:>8} / {w['num_draft_tokens']:<7}"
                     f" {'yes' if w['same_tokens'] else 'NO':>12}")
    if "llama_server_skipped" in result:
        lines.append(f"llama-server not run: {result['llama_server_skipped']}")
    for kind, per in (result.get("llama_server") or {}).items():
        for name, w in per.items():
            ratio = f"{w['ratio']:.2f}x" if w["ratio"] is not None else "-"
            same = "yes" if w["same_tokens"] else "NO"
            lines.append(f"llama-server {kind:13} {name:6} {w['decode_tok_s']:8.1f} tok/s "
                         f"{ratio:>7} (vs its none) {w['num_accepted_tokens']:>6} / "
                         f"{w['num_draft_tokens']:<6} {same:>4}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a model directory, .gguf file or known model name")
    parser.add_argument("--speculative-config", type=speculative_config, default=DEFAULT_SPEC,
                        help=f"the speculation measured (default: {json.dumps(DEFAULT_SPEC)})")
    parser.add_argument("--max-tokens", type=positive_int, default=256,
                        help="greedy tokens per request (default 256)")
    parser.add_argument("--batch", type=positive_int, default=1,
                        help="requests decoding at once (default 1)")
    parser.add_argument("--batches", type=positive_int, default=1,
                        help="batches per workload and round, one after another (distinct "
                             "excerpts; tokens/s their mean; default 1)")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="timed rounds per workload after a warm-up (default 3)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch threads (default: the engine's)")
    parser.add_argument("--max-model-len", type=positive_int, default=2048,
                        help="the engines' max_model_len (default 2048)")
    parser.add_argument("--kv-cache-memory", default=None,
                        help="KV cache bytes or a size (default: the engine's)")
    parser.add_argument("--quant-activations", choices=["float32", "int8"], default="float32",
                        help="GGUF models: activations of the quantized products in float32 "
                             "(default) or 8 bits (llama.cpp's arithmetic), both runs alike")
    parser.add_argument("--file", default=None,
                        help="the text to copy and edit (default: the GPL-3.0 text)")
    parser.add_argument("--llama-bin", type=Path, default=None,
                        help="llama.cpp's build/bin, for llama-server beside hybridkv on a "
                             "GGUF file at batch 1 (default: where setup.sh builds it)")
    parser.add_argument("--llama-spec-types", type=_spec_types,
                        default=list(DEFAULT_LLAMA_SPEC_TYPES),
                        help="llama-server --spec-type values to measure, comma-separated "
                             f"(default {','.join(DEFAULT_LLAMA_SPEC_TYPES)})")
    parser.add_argument("--no-llama", action="store_true",
                        help="do not run llama-server beside hybridkv")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _spec_types(text: str) -> list[str]:
    types = [t.strip() for t in text.split(",") if t.strip()]
    if not types or any(t == "none" for t in types):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected llama-server --spec-type values such as ngram-simple,"
            f"ngram-mod (without speculation is always measured)")
    return types


def run(args: argparse.Namespace) -> int:
    result = bench_spec(args.model, spec=args.speculative_config, max_tokens=args.max_tokens,
                        batch=args.batch, rounds=args.rounds, threads=args.threads,
                        max_model_len=args.max_model_len,
                        kv_cache_memory=args.kv_cache_memory, file=args.file,
                        activations=args.quant_activations, llama_bin=args.llama_bin,
                        llama_spec_types=None if args.no_llama else args.llama_spec_types,
                        num_batches=args.batches)
    print(json.dumps(result) if args.json else format_table(result))
    return 0


COMMAND = Command("spec", "decode speed with speculative decoding on and off (copy, prose)",
                  add_arguments, run)
