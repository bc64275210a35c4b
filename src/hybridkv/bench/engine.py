"""`hybridkv bench throughput | capacity`: the engine end to end, figures printed."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from hybridkv.cli import Command, memory, positive_int


def _prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (length,), generator=gen).tolist() for _ in range(num)]


def model_vocab(model_dir: str) -> int:
    """The vocabulary size in a model directory's config.json."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        return int((config.get("text_config") or config)["vocab_size"])
    except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, no vocab_size
        raise ValueError(f"{path}: not a model config with a vocab_size") from None


def _ours(model_dir: str, prompts: list[list[int]], output_len: int,
          options: dict[str, Any]) -> tuple[float, Any]:
    from hybridkv import LLM, SamplingParams

    llm = LLM(model_dir, **options)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # warm up
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True),
                        use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed, llm


def _transformers(model_dir: str, prompts: list[list[int]], output_len: int) -> float:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids[:2], max_new_tokens=2, **kwargs)  # warm up
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / elapsed


def bench_throughput(model_dir: str, *, num_prompts: int, input_len: int, output_len: int,
                     repeat: int = 1, with_transformers: bool = True,
                     as_json: bool = False) -> str:
    prompts = _prompts(num_prompts, input_len, model_vocab(model_dir))
    options = dict(dtype="float32", max_model_len=input_len + output_len + 16,
                   max_num_seqs=num_prompts, kv_cache_memory="256MiB")
    ours, theirs = [], []
    for _ in range(repeat):  # interleaved, so both see the same machine load
        ours.append(_ours(model_dir, prompts, output_len, options)[0])
        if with_transformers:
            theirs.append(_transformers(model_dir, prompts, output_len))
    figures: dict[str, Any] = {
        "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
        "repeat": repeat, "output_tokens_per_s": statistics.median(ours),
        "transformers_output_tokens_per_s": statistics.median(theirs) if theirs else None}
    if theirs:
        figures["ratio"] = figures["output_tokens_per_s"] / figures[
            "transformers_output_tokens_per_s"]
    if as_json:
        return json.dumps(figures)
    lines = [f"{num_prompts} prompts x {input_len} tokens in, {output_len} out, float32, "
             f"medians of {repeat}",
             f"hybridkv      {figures['output_tokens_per_s']:9.1f} output tokens/s"]
    if theirs:
        lines.append(f"transformers  {figures['transformers_output_tokens_per_s']:9.1f} output "
                     f"tokens/s (generate, batch {num_prompts})")
        lines.append(f"ratio         {figures['ratio']:9.2f}x")
    return "\n".join(lines)


def bench_capacity(model_dir: str | None, *, kv_cache_memory: int, num_prompts: int,
                   input_len: int, output_len: int, as_json: bool = False) -> str:
    """Concurrent long requests and throughput in one KV budget, hybrid on vs off."""
    from hybridkv.models.demo import DemoShape, write_demo_model

    with tempfile.TemporaryDirectory() as tmp:
        if model_dir is None:
            # Gemma-3-like: 5 sliding layers (window 256) per full layer.
            model_dir = str(write_demo_model(Path(tmp) / "gemma3", "gemma3", DemoShape(
                layers=6, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256,
                vocab=512, window=256)))
        prompts = _prompts(num_prompts, input_len, model_vocab(model_dir), seed=1)
        rows = {}
        for hybrid in (True, False):
            options = dict(dtype="float32", max_model_len=input_len + output_len + 16,
                           max_num_seqs=num_prompts, kv_cache_memory=kv_cache_memory,
                           max_num_batched_tokens=input_len,
                           disable_hybrid_kv_cache=not hybrid)
            tok_s, llm, peak = _ours_with_peak(model_dir, prompts, output_len, options)
            rows["hybrid" if hybrid else "no_hybrid"] = {
                "max_concurrent_requests": peak, "output_tokens_per_s": tok_s,
                "preemptions": llm.engine.scheduler.num_preemptions,
                "plan_max_concurrency": llm.engine.plan.max_concurrency}
    figures = {"kv_cache_memory": kv_cache_memory, "num_prompts": num_prompts,
               "input_len": input_len, "output_len": output_len, **rows}
    if as_json:
        return json.dumps(figures)
    lines = [f"{num_prompts} requests of {input_len} + {output_len} tokens, KV budget "
             f"{kv_cache_memory / (1 << 20):.1f} MiB",
             f"{'':10} {'concurrent':>10} {'plan':>8} {'tokens/s':>9} {'preempt':>8}"]
    for name, r in rows.items():
        lines.append(f"{name:10} {r['max_concurrent_requests']:10d} "
                     f"{r['plan_max_concurrency']:8.2f} {r['output_tokens_per_s']:9.1f} "
                     f"{r['preemptions']:8d}")
    return "\n".join(lines)


def _ours_with_peak(model_dir: str, prompts: list[list[int]], output_len: int,
                    options: dict[str, Any]) -> tuple[float, Any, int]:
    """Output tokens/s, the LLM, and the most requests running at once."""
    from hybridkv import LLM, SamplingParams

    llm = LLM(model_dir, **options)
    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"c{i}", prompt, params)
    produced = peak = 0
    start = time.perf_counter()
    while engine.has_unfinished:
        produced += len(engine.step())
        peak = max(peak, len(engine.scheduler.running))
    return produced / (time.perf_counter() - start), llm, peak


def add_throughput_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", help="a model directory (e.g. from hybridkv demo-model)")
    parser.add_argument("--num-prompts", type=positive_int, default=32,
                        help="prompts, all run as one batch")
    parser.add_argument("--input-len", type=positive_int, default=64,
                        help="tokens per prompt (random ids)")
    parser.add_argument("--output-len", type=positive_int, default=128,
                        help="output tokens per prompt (no early stop)")
    parser.add_argument("--repeat", type=positive_int, default=1,
                        help="runs, interleaved with transformers; medians reported")
    parser.add_argument("--no-transformers", action="store_true",
                        help="skip the transformers generate baseline")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_throughput(args: argparse.Namespace) -> int:
    print(bench_throughput(args.model_dir, num_prompts=args.num_prompts,
                           input_len=args.input_len, output_len=args.output_len,
                           repeat=args.repeat, with_transformers=not args.no_transformers,
                           as_json=args.json))
    return 0


def add_capacity_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", nargs="?", default=None,
                        help="a model directory (default: a tiny Gemma-3-like demo model "
                             "built on the fly)")
    parser.add_argument("--kv-cache-memory", type=memory, default="8MiB",
                        help="KV cache bytes, plain or with a unit")
    parser.add_argument("--num-prompts", type=positive_int, default=16,
                        help="requests, all queued at once")
    parser.add_argument("--input-len", type=positive_int, default=1024,
                        help="tokens per prompt (random ids)")
    parser.add_argument("--output-len", type=positive_int, default=32,
                        help="output tokens per request (no early stop)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_capacity(args: argparse.Namespace) -> int:
    print(bench_capacity(args.model_dir, kv_cache_memory=args.kv_cache_memory,
                         num_prompts=args.num_prompts, input_len=args.input_len,
                         output_len=args.output_len, as_json=args.json))
    return 0


THROUGHPUT = Command("throughput", "output tokens/s, side by side with transformers generate",
                     add_throughput_arguments, run_throughput)
CAPACITY = Command("capacity", "concurrent long requests in one KV budget, hybrid management "
                               "on vs off", add_capacity_arguments, run_capacity)
