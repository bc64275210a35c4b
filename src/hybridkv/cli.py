"""`hybridkv plan | generate | demo-model | bench kv`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from hybridkv.kv.plan import KVCachePlan, format_bytes, parse_bytes, plan_kv_cache
from hybridkv.kv.spec import dtype_size
from hybridkv.models.layer_mix import kv_layout_from_config, load_hf_config

DEFAULT_MODEL = "gemma-3-27b-it"


class CLIError(Exception):
    """A user mistake: printed as one line, exit status 2."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def _memory(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _dtype(text: str) -> str:
    try:
        dtype_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="plan the KV cache of a model for a memory budget")
    plan.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                      help="model directory, config.json, or a shipped model name "
                           f"(default {DEFAULT_MODEL})")
    plan.add_argument("--memory", type=_memory, default=parse_bytes("40GiB"),
                      help="KV cache bytes, plain or with a unit (default 40GiB)")
    plan.add_argument("--max-model-len", type=_positive_int, default=131072)
    plan.add_argument("--block-size", type=_positive_int, default=16)
    plan.add_argument("--kv-dtype", type=_dtype, default=None,
                      help="KV cache dtype (default: the model's dtype)")
    plan.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048)
    plan.add_argument("--no-hybrid", action="store_true",
                      help="treat sliding-window and chunked layers as full attention")
    plan.add_argument("--json", action="store_true", help="print one JSON object")

    gen = sub.add_parser("generate", help="generate text with a model directory")
    gen.add_argument("model_dir")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    source.add_argument("--prompts-file", type=Path, help="one prompt per line")
    gen.add_argument("--max-tokens", type=_positive_int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-model-len", type=_positive_int, default=None)
    gen.add_argument("--kv-cache-memory", type=_memory, default=parse_bytes("256MiB"))
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--no-prefix-caching", action="store_true")
    gen.add_argument("--no-hybrid", action="store_true")
    gen.add_argument("--kv-sharing-fast-prefill", action="store_true",
                     help="run KV-sharing layers (Gemma 3n/4) on sampled tokens only")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")

    demo = sub.add_parser("demo-model", help="write a tiny random model with a tokenizer")
    demo.add_argument("out_dir")
    demo.add_argument("--arch", default="gemma3",
                      help="llama, qwen3, mistral, gemma2, gemma3, gemma3n or nemotron_h "
                           "(default gemma3)")
    for flag, default in (("layers", 6), ("hidden", 128), ("heads", 4), ("kv-heads", 2),
                          ("head-dim", 32), ("intermediate", 256), ("vocab", 512),
                          ("window", 32)):
        demo.add_argument(f"--{flag}", type=_positive_int, default=default)
    demo.add_argument("--seed", type=int, default=0)

    bench = sub.add_parser("bench", help="benchmarks that print their figures")
    suites = bench.add_subparsers(dest="suite", required=True)
    kv = suites.add_parser("kv", help="the KV manager trace of shared/bench/kv-trace.md")
    kv.add_argument("--config", choices=["hybrid", "full", "both"], default="both")
    kv.add_argument("--memory", type=_memory, default=None,
                    help="byte budget (default: 20,000 four-layer 64 KiB blocks)")
    kv.add_argument("--num-requests", type=_positive_int, default=512)
    kv.add_argument("--trace", type=Path, default=None,
                    help="a trace file written by make_kv_trace.py (default: generate it)")
    kv.add_argument("--repeat", type=_positive_int, default=1,
                    help="run N times and report the median of each figure")
    kv.add_argument("--json", action="store_true")

    tp = suites.add_parser("throughput", help="output tokens/s, side by side with "
                                              "transformers generate")
    tp.add_argument("model_dir")
    tp.add_argument("--num-prompts", type=_positive_int, default=32)
    tp.add_argument("--input-len", type=_positive_int, default=64)
    tp.add_argument("--output-len", type=_positive_int, default=128)
    tp.add_argument("--repeat", type=_positive_int, default=1)
    tp.add_argument("--no-transformers", action="store_true")
    tp.add_argument("--json", action="store_true")

    cap = suites.add_parser("capacity", help="concurrent long requests in one KV budget, "
                                             "hybrid management on vs off")
    cap.add_argument("model_dir", nargs="?", default=None,
                     help="default: a tiny Gemma-3-like demo model built on the fly")
    cap.add_argument("--kv-cache-memory", type=_memory, default=parse_bytes("8MiB"))
    cap.add_argument("--num-prompts", type=_positive_int, default=16)
    cap.add_argument("--input-len", type=_positive_int, default=1024)
    cap.add_argument("--output-len", type=_positive_int, default=32)
    cap.add_argument("--json", action="store_true")

    fp = suites.add_parser("fast-prefill", help="KV-sharing fast prefill on vs off: time of "
                                                "the shared-KV layers and of the forward")
    fp.add_argument("model_dir", nargs="?", default=None,
                    help="default: a Gemma-3n-like demo model (hidden 512) built on the fly")
    fp.add_argument("--prompt-len", type=_positive_int, default=8192)
    fp.add_argument("--mixed-lens", type=_positive_int, nargs="+",
                    default=[3072, 2048, 1536, 1024, 384, 128],
                    help="prompt lengths of the mixed batch")
    fp.add_argument("--layers", type=_positive_int, default=14)
    fp.add_argument("--hidden", type=_positive_int, default=512)
    fp.add_argument("--repeat", type=_positive_int, default=3)
    fp.add_argument("--device", default="auto")
    fp.add_argument("--json", action="store_true")

    pre = suites.add_parser("prefix", help="prefix caching on a multi-turn chat trace")
    pre.add_argument("model_dir", nargs="?", default=None,
                     help="default: a tiny NemotronH-like demo model built on the fly")
    pre.add_argument("--systems", type=_positive_int, default=2)
    pre.add_argument("--conversations-per-system", type=_positive_int, default=3)
    pre.add_argument("--turns", type=_positive_int, default=3)
    pre.add_argument("--answer-len", type=_positive_int, default=16)
    pre.add_argument("--kv-cache-memory", type=_memory, default=parse_bytes("256MiB"))
    pre.add_argument("--system-len", type=_positive_int, nargs=2, default=(100, 2000),
                     metavar=("MIN", "MAX"), help="system prompt lengths (default 100 2000)")
    pre.add_argument("--compare-eviction", action="store_true",
                     help="also run with lru and value-aware eviction (use a small budget)")
    pre.add_argument("--json", action="store_true")
    return parser


def cmd_plan(args: argparse.Namespace) -> str:
    config = load_hf_config(args.model)
    layout = kv_layout_from_config(config, block_size=args.block_size, kv_dtype=args.kv_dtype)
    common = dict(max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_sharing=layout.kv_sharing)
    main = plan_kv_cache(layout.layer_specs, args.memory, hybrid=not args.no_hybrid, **common)
    other = plan_kv_cache(layout.layer_specs, args.memory, hybrid=args.no_hybrid, strict=False,
                          **common)
    hybrid, no_hybrid = (other, main) if args.no_hybrid else (main, other)
    # What KV sharing saves: the same plan with every layer keeping its own cache.
    unshared = plan_kv_cache(layout.layer_specs, args.memory, hybrid=not args.no_hybrid,
                             strict=False, **{**common, "kv_sharing": {}}) \
        if layout.kv_sharing else None
    if args.json:
        summary = main.summary()
        summary["model_type"] = layout.model_type
        summary["no_hybrid"] = {k: v for k, v in no_hybrid.summary().items() if k != "groups"}
        summary["hybrid_gain"] = (hybrid.max_concurrency / no_hybrid.max_concurrency
                                  if no_hybrid.max_concurrency else None)
        if unshared is not None:
            summary["without_kv_sharing"] = {
                k: v for k, v in unshared.summary().items() if k != "groups"}
        return json.dumps(summary)
    return _plan_table(args.model, layout.model_type, main, hybrid, no_hybrid, unshared,
                       len(layout.kv_sharing))


def _plan_table(model: str, model_type: str, main: KVCachePlan, hybrid: KVCachePlan,
                no_hybrid: KVCachePlan, unshared: KVCachePlan | None = None,
                num_shared: int = 0) -> str:
    cfg = main.config
    lines = [
        f"{model} ({model_type}): {format_bytes(main.memory_bytes)} KV cache, max_model_len "
        f"{main.max_model_len}, max_num_batched_tokens {main.max_num_batched_tokens}, "
        f"hybrid management {'on' if main.hybrid else 'off'}",
        "",
        f"{'group':>5}  {'kind':<15} {'window':>7} {'layers':>6} {'shared':>6} "
        f"{'block tok':>9} {'block bytes':>12} {'blocks/page':>11} {'pad/page':>10}",
    ]
    for g in cfg.groups:
        window = getattr(g.spec, "sliding_window", None) or getattr(
            g.spec, "attention_chunk_size", None) or "-"
        lines.append(
            f"{g.group_id:>5}  {g.spec.kind:<15} {window!s:>7} {len(g.layer_names):>6} "
            f"{len(g.shared_layer_names):>6} {g.block_size:>9} {format_bytes(g.block_bytes):>12} "
            f"{g.blocks_per_large_page:>11} "
            f"{format_bytes(g.padding_bytes_per_large_page(cfg.large_page_bytes)):>10}")
    lines += [
        "",
        f"large page            {format_bytes(cfg.large_page_bytes)} x {cfg.num_large_pages} "
        f"(arena {format_bytes(cfg.arena_bytes)}, page 0 holds the null blocks)",
        f"padding               {format_bytes(main.padding_bytes)}",
        *(f"state / request       {format_bytes(g.block_bytes)} (group {g.group_id}: one "
          f"state block of {len(g.layer_names)} layers; attention blocks stay "
          f"{cfg.hit_alignment} tokens)" for g in cfg.groups if g.spec.kind == "mamba"),
        f"ideal bytes / token   {main.ideal_bytes_per_token:,.1f} (at max_model_len)",
        f"capacity              {main.capacity_tokens:,} tokens",
        f"max concurrency       {main.max_concurrency:.2f} requests of {main.max_model_len} "
        f"tokens ({main.ideal_fraction:.2%} of the physical limit)",
        "",
        f"hybrid on vs off      {hybrid.max_concurrency:.2f} vs {no_hybrid.max_concurrency:.2f} "
        f"requests at max_model_len",
    ]
    if unshared is not None:
        lines.append(
            f"kv sharing            {num_shared} layers read another layer's KV and own no "
            f"pages: {main.max_concurrency:.2f} vs {unshared.max_concurrency:.2f} requests "
            f"if every layer kept its own ({main.ideal_bytes_per_token:,.1f} vs "
            f"{unshared.ideal_bytes_per_token:,.1f} ideal bytes / token)")
    lines += [f"warning: {w}" for w in (*main.warnings,
                                         *(f"without hybrid management: {w}"
                                           for w in no_hybrid.warnings if main.hybrid))]
    return "\n".join(lines)


def cmd_generate(args: argparse.Namespace) -> str:
    from hybridkv import LLM, SamplingParams

    if args.prompts_file is not None:
        prompts = [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
        if not prompts:
            raise CLIError(f"{args.prompts_file}: no prompts in the file")
    else:
        prompts = args.prompt
    options: dict[str, object] = dict(
        kv_cache_memory=args.kv_cache_memory, dtype=args.dtype,
        enable_prefix_caching=not args.no_prefix_caching,
        disable_hybrid_kv_cache=args.no_hybrid,
        kv_sharing_fast_prefill=args.kv_sharing_fast_prefill)
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    llm = LLM(args.model_dir, **options)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    outputs = llm.generate(prompts, params)
    if args.json:
        return "\n".join(json.dumps({"prompt": p, "text": o.text, "token_ids": o.token_ids,
                                     "finish_reason": o.finish_reason})
                         for p, o in zip(prompts, outputs, strict=True))
    return "\n".join(f"--- prompt: {p!r}\n{o.text}" for p, o in zip(prompts, outputs,
                                                                    strict=True))


def cmd_demo_model(args: argparse.Namespace) -> str:
    from hybridkv.models.demo import DemoShape, write_demo_model

    shape = DemoShape(layers=args.layers, hidden=args.hidden, heads=args.heads,
                      kv_heads=args.kv_heads, head_dim=args.head_dim,
                      intermediate=args.intermediate, vocab=args.vocab, window=args.window,
                      seed=args.seed)
    path = write_demo_model(args.out_dir, args.arch, shape)
    return f"wrote a tiny random {args.arch} model to {path}"


def cmd_bench(args: argparse.Namespace) -> str:
    from hybridkv.bench.kv_trace import DEFAULT_MEMORY, bench_kv

    if args.suite == "throughput":
        from hybridkv.bench.engine import bench_throughput

        return bench_throughput(args.model_dir, num_prompts=args.num_prompts,
                                input_len=args.input_len, output_len=args.output_len,
                                repeat=args.repeat, with_transformers=not args.no_transformers,
                                as_json=args.json)
    if args.suite == "prefix":
        from hybridkv.bench.prefix import bench_prefix

        return bench_prefix(args.model_dir, num_systems=args.systems,
                            conversations_per_system=args.conversations_per_system,
                            turns=args.turns, answer_len=args.answer_len,
                            kv_cache_memory=args.kv_cache_memory,
                            compare_eviction=args.compare_eviction,
                            system_len=tuple(args.system_len), as_json=args.json)
    if args.suite == "fast-prefill":
        from hybridkv.bench.fast_prefill import bench_fast_prefill

        return bench_fast_prefill(args.model_dir, prompt_len=args.prompt_len,
                                  mixed_lens=tuple(args.mixed_lens), layers=args.layers,
                                  hidden=args.hidden, repeat=args.repeat, device=args.device,
                                  as_json=args.json)
    if args.suite == "capacity":
        from hybridkv.bench.engine import bench_capacity

        return bench_capacity(args.model_dir, kv_cache_memory=args.kv_cache_memory,
                              num_prompts=args.num_prompts, input_len=args.input_len,
                              output_len=args.output_len, as_json=args.json)

    configs = ["hybrid", "full"] if args.config == "both" else [args.config]
    return bench_kv(configs, memory_bytes=args.memory or DEFAULT_MEMORY,
                    num_requests=args.num_requests, trace_file=args.trace,
                    repeat=args.repeat, as_json=args.json)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        command = {"plan": cmd_plan, "generate": cmd_generate, "demo-model": cmd_demo_model,
                   "bench": cmd_bench}[args.command]
        out = command(args)
    except (ValueError, CLIError, OSError, NotImplementedError) as e:
        print(f"hybridkv {args.command}: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
