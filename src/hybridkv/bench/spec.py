"""`hybridkv bench spec MODEL`: decode speed with speculative decoding on and off, on a
copy-heavy workload and a prose one.

- copy: "repeat this text" and "edit this text" (a rename) over excerpts of a file given in
  the prompt (`--file`, default the GPL-3.0 text shipped with the package): the answer
  copies most of its prompt, which is where drafts hit;
- prose: an open-ended story, which repeats little of its prompt (drafts should cost
  nothing there: the back-off stops them).

Each workload runs `--batch` requests at once (distinct excerpts), greedy, EOS ignored,
`--max-tokens` tokens each, once to warm up and then `--rounds` times, on one engine with
`--speculative-config` and one without (built in turn, so one model is in memory at a
time). Decode tokens/s counts the tokens after each request's first one over the time
after the step that brought the batch's first tokens (prefill is not timed). The ratio is
on / off; the greedy tokens of both runs are compared, and the drafts scored and kept are
reported. Models without a tokenizer get token-id prompts of the same shape (a random
"file", its copy asked for by position only). Run it pinned and alone: `taskset -c 0
hybridkv bench spec MODEL --threads 1`.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.cli import Command, positive_int, speculative_config

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
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


def run_workload(llm: Any, prompts: list[Any], max_tokens: int, rounds: int) -> WorkloadRun:
    from hybridkv.sched.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    rates, tokens, drafts, accepted = [], [], 0, 0
    for round_index in range(rounds + 1):  # round 0 warms up
        llm.reset_prefix_cache()  # each round prefills its prompts (not timed anyway)
        ids = [f"spec-{round_index}-{i}" for i in range(len(prompts))]
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
        if round_index:
            rates.append(decoded / elapsed if elapsed > 0 else 0.0)
            tokens = [outputs[r].token_ids for r in ids]
            drafts += sum(outputs[r].num_draft_tokens for r in ids)
            accepted += sum(outputs[r].num_accepted_tokens for r in ids)
    return WorkloadRun(tokens, statistics.median(rates), drafts, accepted)


def bench_spec(model: str, *, spec: dict[str, Any], max_tokens: int, batch: int,
               rounds: int, threads: int | None, max_model_len: int,
               kv_cache_memory: str | None, file: str | None,
               activations: str = "float32") -> dict[str, Any]:
    from hybridkv.engine.llm import LLM

    options: dict[str, Any] = dict(max_model_len=max_model_len, threads=threads,
                                   max_num_seqs=batch, max_num_batched_tokens=2048,
                                   quant_activations=activations)
    if kv_cache_memory is not None:
        options["kv_cache_memory"] = kv_cache_memory
    runs: dict[str, dict[str, WorkloadRun]] = {}
    kind = ""
    for name, extra in (("off", {}), ("on", {"speculative_config": spec})):
        llm = LLM(model, **options, **extra)
        if llm.engine.tokenizer is not None:
            messages = text_workloads(_text(file), batch)
            prompts = {w: _render(llm, model, m) for w, m in messages.items()}
            kind = "text"
        else:
            prompts = dict(token_workloads(llm.engine.vocab_size, batch))
            kind = "token ids (the model has no tokenizer)"
        runs[name] = {w: run_workload(llm, p, max_tokens, rounds) for w, p in prompts.items()}
        llm.close()
        del llm
        gc.collect()
    workloads = {}
    for w, off in runs["off"].items():
        on = runs["on"][w]
        workloads[w] = {
            "off_decode_tok_s": off.decode_tok_s, "on_decode_tok_s": on.decode_tok_s,
            "ratio": on.decode_tok_s / off.decode_tok_s if off.decode_tok_s else None,
            "num_draft_tokens": on.num_draft_tokens,
            "num_accepted_tokens": on.num_accepted_tokens,
            "same_tokens": on.tokens == off.tokens}
    return {"model": model, "speculative_config": spec, "prompts": kind, "batch": batch,
            "max_tokens": max_tokens, "rounds": rounds, "quant_activations": activations,
            "workloads": workloads}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{result['model']}: batch {result['batch']}, {result['max_tokens']} greedy "
             f"tokens per request, median of {result['rounds']} rounds, {result['prompts']}, "
             f"{result.get('quant_activations', 'float32')} activations",
             f"speculative_config {json.dumps(result['speculative_config'])}",
             f"{'workload':10} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>7} "
             f"{'accepted / drafts':>18} {'same tokens':>12}"]
    for name, w in result["workloads"].items():
        ratio = f"{w['ratio']:.2f}x" if w["ratio"] is not None else "-"
        lines.append(f"{name:10} {w['off_decode_tok_s']:10.1f} {w['on_decode_tok_s']:10.1f} "
                     f"{ratio:>7} {w['num_accepted_tokens']:>8} / {w['num_draft_tokens']:<7}"
                     f" {'yes' if w['same_tokens'] else 'NO':>12}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a model directory, .gguf file or known model name")
    parser.add_argument("--speculative-config", type=speculative_config, default=DEFAULT_SPEC,
                        help=f"the speculation measured (default: {json.dumps(DEFAULT_SPEC)})")
    parser.add_argument("--max-tokens", type=positive_int, default=256,
                        help="greedy tokens per request (default 256)")
    parser.add_argument("--batch", type=positive_int, default=1,
                        help="requests decoding at once (default 1)")
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
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    result = bench_spec(args.model, spec=args.speculative_config, max_tokens=args.max_tokens,
                        batch=args.batch, rounds=args.rounds, threads=args.threads,
                        max_model_len=args.max_model_len,
                        kv_cache_memory=args.kv_cache_memory, file=args.file,
                        activations=args.quant_activations)
    print(json.dumps(result) if args.json else format_table(result))
    return 0


COMMAND = Command("spec", "decode speed with speculative decoding on and off (copy, prose)",
                  add_arguments, run)
