"""`hybridkv bench throughput | capacity`: the engine end to end, figures printed."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.cli import Command, add_threads_argument, memory, positive_int


def _prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (length,), generator=gen).tolist() for _ in range(num)]


def model_vocab(model_dir: str) -> int:
    """The vocabulary size in a model directory's config.json (or of a GGUF file, or of a
    real model's short name)."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        from hybridkv.models.layer_mix import load_hf_config

        config = load_hf_config(model_dir)
        return int((config.get("text_config") or config)["vocab_size"])
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        return int((config.get("text_config") or config)["vocab_size"])
    except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, no vocab_size
        raise ValueError(f"{path}: not a model config with a vocab_size") from None


@dataclass(frozen=True)
class Case:
    """One workload: `num_prompts` random prompts of `input_len` tokens, `output_len` out."""

    name: str
    num_prompts: int
    input_len: int
    output_len: int


# Long prompts, few outputs: the run is mostly prefill.
LONG_PROMPTS = Case("long prompts", 8, 2048, 16)


@dataclass(frozen=True)
class Timing:
    input_tokens: int
    output_tokens: int
    seconds: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def input_tokens_per_s(self) -> float:
        return self.input_tokens / self.seconds


def _ours(model_dir: str, prompts: list[list[int]], output_len: int,
          options: dict[str, Any]) -> Timing:
    from hybridkv import LLM, SamplingParams

    llm = LLM(model_dir, **options)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # warm up
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True),
                        use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.close()
    return Timing(sum(map(len, prompts)), sum(len(o.token_ids) for o in outs), elapsed)


def _transformers(model_dir: str, prompts: list[list[int]], output_len: int) -> Timing:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids[:2, :16], max_new_tokens=2, **kwargs)  # warm up
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
    elapsed = time.perf_counter() - start
    return Timing(ids.numel(), (out.shape[1] - ids.shape[1]) * ids.shape[0], elapsed)


def _median(timings: list[Timing], attr: str) -> float:
    return statistics.median(getattr(t, attr) for t in timings)


def _run_case(model_dir: str, case: Case, *, repeat: int, with_transformers: bool,
              threads: int | None, busy_neighbour: bool,
              linear_kernel: str = "auto", attention_backend: str = "auto"
              ) -> dict[str, Any]:
    from hybridkv.bench.neighbour import busy_neighbour as neighbour
    from hybridkv.bench.neighbour import own_cores, split_cores

    prompts = _prompts(case.num_prompts, case.input_len, model_vocab(model_dir))
    options = dict(dtype="float32", max_model_len=case.input_len + case.output_len + 16,
                   max_num_seqs=case.num_prompts, kv_cache_memory="256MiB",
                   max_num_batched_tokens=max(2048, case.input_len), threads=threads,
                   linear_kernel=linear_kernel, attention_backend=attention_backend)
    ours: list[Timing] = []
    theirs: list[Timing] = []
    busy: list[Timing] = []
    engine_cores, neighbour_core = split_cores() if busy_neighbour else (set(), -1)
    for _ in range(repeat):  # interleaved, so every side sees the same machine load
        if busy_neighbour:
            with own_cores(engine_cores):
                ours.append(_ours(model_dir, prompts, case.output_len, options))
                with neighbour(neighbour_core):
                    busy.append(_ours(model_dir, prompts, case.output_len, options))
        else:
            ours.append(_ours(model_dir, prompts, case.output_len, options))
        if with_transformers:
            theirs.append(_transformers(model_dir, prompts, case.output_len))
    import torch

    figures: dict[str, Any] = {
        "case": case.name, "num_prompts": case.num_prompts, "input_len": case.input_len,
        "output_len": case.output_len, "repeat": repeat, "threads": torch.get_num_threads(),
        "linear_kernel": linear_kernel, "attention_backend": attention_backend,
        "output_tokens_per_s": _median(ours, "output_tokens_per_s"),
        "input_tokens_per_s": _median(ours, "input_tokens_per_s")}
    if theirs:
        figures["transformers_output_tokens_per_s"] = _median(theirs, "output_tokens_per_s")
        figures["transformers_input_tokens_per_s"] = _median(theirs, "input_tokens_per_s")
        figures["ratio"] = statistics.median(
            b.seconds / a.seconds for a, b in zip(ours, theirs, strict=True))
    if busy:
        figures["engine_cores"] = sorted(engine_cores)
        figures["neighbour_core"] = neighbour_core
        figures["busy_output_tokens_per_s"] = _median(busy, "output_tokens_per_s")
        figures["busy_ratio"] = statistics.median(
            q.seconds / b.seconds for q, b in zip(ours, busy, strict=True))
    return figures


def bench_throughput(model_dir: str, *, num_prompts: int, input_len: int, output_len: int,
                     repeat: int = 1, with_transformers: bool = True,
                     threads: int | None = None, busy_neighbour: bool = False,
                     long_prompts: bool = False, as_json: bool = False,
                     linear_kernel: str = "auto", attention_backend: str = "auto") -> str:
    cases = [Case("batch", num_prompts, input_len, output_len)]
    if long_prompts:
        cases.append(LONG_PROMPTS)
    results = [_run_case(model_dir, case, repeat=repeat, with_transformers=with_transformers,
                         threads=threads, busy_neighbour=busy_neighbour,
                         linear_kernel=linear_kernel, attention_backend=attention_backend)
               for case in cases]
    if as_json:
        return json.dumps(results[0] if len(results) == 1 else {"cases": results})
    return "\n\n".join(map(_format_case, results))


def _format_case(f: dict[str, Any]) -> str:
    lines = [f"{f['case']}: {f['num_prompts']} prompts x {f['input_len']} tokens in, "
             f"{f['output_len']} out, float32, {f['threads']} torch threads, attention "
             f"{f['attention_backend']}, linear {f['linear_kernel']}, medians of {f['repeat']}",
             f"hybridkv      {f['output_tokens_per_s']:9.1f} output tokens/s "
             f"{f['input_tokens_per_s']:11.1f} prompt tokens/s (whole run)"]
    if "ratio" in f:
        lines.append(f"transformers  {f['transformers_output_tokens_per_s']:9.1f} output "
                     f"tokens/s {f['transformers_input_tokens_per_s']:11.1f} prompt tokens/s "
                     f"(generate, batch {f['num_prompts']})")
        lines.append(f"ratio         {f['ratio']:9.2f}x (paired runs, median)")
    if "busy_ratio" in f:
        lines.append(f"busy neighbour {f['busy_output_tokens_per_s']:8.1f} output tokens/s on "
                     f"cores {f['engine_cores']} beside a Python loop on core "
                     f"{f['neighbour_core']}: {f['busy_ratio']:.2f}x of quiet")
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
    parser.add_argument("--long-prompts", action="store_true",
                        help=f"also run {LONG_PROMPTS.num_prompts} prompts x "
                             f"{LONG_PROMPTS.input_len} tokens in, {LONG_PROMPTS.output_len} "
                             f"out (mostly prefill)")
    parser.add_argument("--busy-neighbour", action="store_true",
                        help="also time each run beside a Python busy loop pinned to the last "
                             "core of this process's affinity mask (the engine keeps to the "
                             "others) and report busy / quiet")
    add_threads_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_throughput(args: argparse.Namespace) -> int:
    print(bench_throughput(args.model_dir, num_prompts=args.num_prompts,
                           input_len=args.input_len, output_len=args.output_len,
                           repeat=args.repeat, with_transformers=not args.no_transformers,
                           threads=args.threads, busy_neighbour=args.busy_neighbour,
                           long_prompts=args.long_prompts, as_json=args.json,
                           linear_kernel=args.linear_kernel,
                           attention_backend=args.attention_backend))
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
