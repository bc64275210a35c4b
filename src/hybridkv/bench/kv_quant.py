"""`hybridkv bench kv-quant MODEL`: what a quantized KV cache costs in accuracy and buys in
memory and decode speed, per KV cache dtype, against the same engine with pages in the
model's dtype.

- accuracy over a fixed English text (the GPL-3.0 licence, shipped with the package) of
  `--tokens` tokens, prefilled in chunks so that every chunk attends to the quantized pages of
  the chunks before it: the mean KL divergence of the next-token distribution from the
  unquantized cache's, and the text's perplexity under each;
- greedy agreement: 8 prompts cut from the text, 64 greedy tokens each; the share of tokens
  equal to the unquantized cache's before the first difference, and how many replies are
  identical;
- bytes per token of the attention groups (the planner's page sizes, scales included);
- decode tokens/s of one request at a `--context`-token context (its prefix cached, so the
  figure is the decode steps), the engines alternating round by round; the ratio is the
  median of the rounds' pairs.

Run it pinned for the speed figure: `taskset -c 0 hybridkv bench kv-quant MODEL`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from importlib import resources
from typing import Any

from hybridkv.cli import Command, positive_int

GREEDY_PROMPTS = 8
GREEDY_PROMPT_LEN = 64
GREEDY_TOKENS = 64


def bench_text() -> str:
    return (resources.files("hybridkv") / "data" / "texts" / "gpl-3.0.txt").read_text(
        encoding="utf-8")


def _engine(model: str, dtype: str, max_model_len: int, threads: int) -> Any:
    from hybridkv import LLM

    return LLM(model, kv_cache_dtype=dtype, max_model_len=max_model_len, threads=threads,
               kv_cache_memory="1GiB", max_num_seqs=GREEDY_PROMPTS,
               max_num_batched_tokens=512)


def _hidden_states(llm: Any, tokens: list[int]) -> Any:
    """The final hidden state of every position of `tokens`, prefilled in chunks."""
    import torch

    from hybridkv import SamplingParams

    captured: list[torch.Tensor] = []
    runner = llm.engine.runner
    handle = runner.model.register_forward_hook(
        lambda module, args, out: captured.append(out.detach().float().clone()))
    try:
        llm.reset_prefix_cache()
        llm.generate([tokens], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                     use_tqdm=False)
    finally:
        handle.remove()
    hidden = torch.cat(captured)[:len(tokens)]
    if hidden.shape[0] != len(tokens):
        raise RuntimeError(f"captured {hidden.shape[0]} hidden states for {len(tokens)} "
                           f"tokens")
    return hidden


def _accuracy(llm: Any, reference: Any, hidden: Any, tokens: list[int]) -> dict[str, float]:
    """Mean KL(reference || this) of next-token distributions and both perplexities."""
    import torch

    model = llm.engine.runner.model
    kl_sum, nll_ref, nll = 0.0, 0.0, 0.0
    targets = torch.tensor(tokens[1:])
    n = len(tokens) - 1
    with torch.inference_mode():
        for start in range(0, n, 256):
            end = min(start + 256, n)
            ref = torch.log_softmax(model.compute_logits(reference[start:end]).float(), -1)
            ours = torch.log_softmax(model.compute_logits(hidden[start:end]).float(), -1)
            kl_sum += float((ref.exp() * (ref - ours)).sum())
            t = targets[start:end, None]
            nll_ref -= float(ref.gather(1, t).sum())
            nll -= float(ours.gather(1, t).sum())
    return {"mean_kl": kl_sum / n, "perplexity": math.exp(nll / n),
            "reference_perplexity": math.exp(nll_ref / n)}


def _greedy(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    from hybridkv import SamplingParams

    llm.reset_prefix_cache()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS,
                                                ignore_eos=True), use_tqdm=False)
    return [o.token_ids for o in outs]


def _agreement(ours: list[list[int]], ref: list[list[int]]) -> tuple[float, int]:
    """(share of tokens before the first difference, replies identical)."""
    prefix = []
    for a, b in zip(ours, ref, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        prefix.append(same / len(b))
    return sum(prefix) / len(prefix), sum(p == 1.0 for p in prefix)


def _decode_tok_s(llm: Any, prompt: list[int], steps: int) -> float:
    """Decode tokens/s of one request whose prompt is cached (warmed by the caller)."""
    from hybridkv import SamplingParams

    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=steps + 1,
                                          ignore_eos=True), use_tqdm=False)
    return steps / (time.perf_counter() - t)


def bytes_per_token(llm: Any) -> float:
    """Bytes one token costs in the attention groups' pages (scales included)."""
    return sum(g.block_bytes / g.block_size for g in llm.engine.plan.config.groups
               if not g.spec.is_state)


def bench_kv_quant(model: str, dtypes: list[str], *, num_tokens: int = 4096,
                   context: int = 4096, steps: int = 32, rounds: int = 3,
                   threads: int = 1) -> dict[str, Any]:
    engines = {d: _engine(model, d, max(num_tokens, context) + steps + 64, threads)
               for d in ["auto", *dtypes]}
    tokenizer = engines["auto"].engine.tokenizer
    text_ids = tokenizer.encode(bench_text()).ids
    need = max(num_tokens, context, GREEDY_PROMPTS * GREEDY_PROMPT_LEN)
    if len(text_ids) < need:
        raise ValueError(f"the bench text is {len(text_ids)} tokens for this tokenizer; "
                         f"lower --tokens / --context to at most that")
    tokens = text_ids[:num_tokens]
    stride = len(text_ids) // GREEDY_PROMPTS
    prompts = [text_ids[i * stride:i * stride + GREEDY_PROMPT_LEN]
               for i in range(GREEDY_PROMPTS)]
    reference = _hidden_states(engines["auto"], tokens)
    ref_greedy = _greedy(engines["auto"], prompts)
    results: dict[str, Any] = {}
    for d, llm in engines.items():
        row: dict[str, Any] = {"bytes_per_token": bytes_per_token(llm)}
        if d != "auto":
            row.update(_accuracy(llm, reference, _hidden_states(llm, tokens), tokens))
            row["greedy_prefix_share"], row["greedy_identical"] = _agreement(
                _greedy(llm, prompts), ref_greedy)
        results[d] = row
    # Decode speed at the context: every engine's prompt cached first, then rounds of all
    # engines in turn.
    prompt = text_ids[:context]
    for llm in engines.values():
        llm.reset_prefix_cache()
        _decode_tok_s(llm, prompt, 1)
    speed: dict[str, list[float]] = {d: [] for d in engines}
    for _ in range(rounds):
        for d, llm in engines.items():
            speed[d].append(_decode_tok_s(llm, prompt, steps))
    for d in engines:
        results[d]["decode_tok_s"] = statistics.median(speed[d])
        results[d]["decode_vs_auto"] = statistics.median(
            a / b for a, b in zip(speed[d], speed["auto"], strict=True))
    first = results["auto"]
    return {"model": model, "tokens": num_tokens, "context": context, "decode_steps": steps,
            "rounds": rounds, "threads": threads,
            "reference_perplexity": next(
                (r["reference_perplexity"] for r in results.values()
                 if "reference_perplexity" in r), None),
            "auto_bytes_per_token": first["bytes_per_token"], "dtypes": results}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{result['model']}: KV cache dtypes against the model's dtype (auto); "
             f"{result['tokens']} tokens of text, perplexity {result['reference_perplexity']:.3f}"
             f" with auto; decode at a {result['context']}-token context, "
             f"{result['threads']} thread(s), median of {result['rounds']} alternating rounds",
             "",
             f"{'dtype':<6} {'bytes/tok':>10} {'capacity':>9} {'mean KL':>9} {'ppl':>9} "
             f"{'ppl diff':>9} {'greedy':>7} {'same':>5} {'decode tok/s':>13} {'vs auto':>8}"]
    base = result["auto_bytes_per_token"]
    for d, r in result["dtypes"].items():
        acc = d != "auto"
        ppl_diff = (r["perplexity"] / r["reference_perplexity"] - 1) if acc else 0.0
        lines.append(
            f"{d:<6} {r['bytes_per_token']:>10,.0f} {base / r['bytes_per_token']:>8.2f}x "
            f"{r['mean_kl'] if acc else 0.0:>9.5f} "
            f"{r['perplexity'] if acc else result['reference_perplexity']:>9.3f} "
            f"{ppl_diff:>+8.2%} "
            f"{r['greedy_prefix_share'] if acc else 1.0:>6.1%} "
            f"{r['greedy_identical'] if acc else GREEDY_PROMPTS:>3}/{GREEDY_PROMPTS} "
            f"{r['decode_tok_s']:>13.2f} {r['decode_vs_auto']:>7.2f}x")
    lines.append("")
    lines.append(f"greedy: share of {GREEDY_TOKENS} greedy tokens equal to auto's before the "
                 f"first difference, over {GREEDY_PROMPTS} prompts; same: identical replies")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a model directory, a .gguf file or a real model's "
                                      "short name (gemma-3-270m, smollm2-135m-instruct)")
    parser.add_argument("--dtypes", default="int8,q4",
                        help="KV cache dtypes to compare with auto (default: int8,q4)")
    parser.add_argument("--tokens", type=positive_int, default=4096,
                        help="tokens of text for KL and perplexity (default: 4096)")
    parser.add_argument("--context", type=positive_int, default=4096,
                        help="context of the decode-speed figure (default: 4096)")
    parser.add_argument("--steps", type=positive_int, default=32,
                        help="decode steps per speed round (default: 32)")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="alternating speed rounds (default: 3)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch threads (default: 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from hybridkv.kv.cache_dtype import check_kv_cache_dtype

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        check_kv_cache_dtype(d)
    dtypes = [d for d in dict.fromkeys(dtypes) if d != "auto"]
    if not dtypes:
        raise ValueError("--dtypes names no quantized KV cache dtype to compare with auto")
    result = bench_kv_quant(args.model, dtypes, num_tokens=args.tokens, context=args.context,
                            steps=args.steps, rounds=args.rounds, threads=args.threads)
    print(json.dumps(result) if args.json else format_table(result))
    return 0


COMMAND = Command("kv-quant", "a quantized KV cache's accuracy (KL, perplexity, greedy "
                              "agreement), bytes per token and decode speed against the "
                              "model's dtype", add_arguments, run)
