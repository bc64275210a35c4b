"""`hybridkv plan | generate | demo-model | serve | bench`: the command line.

Every subcommand is a `Command`: its name, a one-line help, the function that adds its
arguments and the one that runs it, side by side. The bench suites keep theirs in their own
modules (`hybridkv.bench.*`). Only `plan` runs without torch, so nothing here imports torch
or the engine at module level.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple, NoReturn, TypeVar

from hybridkv.connector.offload.redis_tier import PASSWORD_ENV, parse_remote_url
from hybridkv.connector.offload.store import TierSpec, parse_tier_spec
from hybridkv.connector.scheduler import STORE_POLICIES
from hybridkv.kv.cache_dtype import KV_CACHE_DTYPES, SKIP_KINDS, STATE_DTYPES, apply_cache_dtype
from hybridkv.kv.plan import (
    KVCacheConfig,
    KVCachePlan,
    format_bytes,
    group_dtype,
    parse_bytes,
    plan_kv_cache,
)
from hybridkv.kv.spec import AttentionSpec, KVCacheSpec, dtype_size
from hybridkv.models.layer_mix import (
    kv_layout_from_config,
    load_hf_config,
    shipped_config_names,
)
from hybridkv.server.follow_up import DEFAULT_WAIT_MS as DEFAULT_FOLLOW_UP_WAIT_MS
from hybridkv.server.host_memory import DEFAULT_MAX_WAITING
from hybridkv.server.reasoning import REASONING_PARSERS

DESCRIPTION = (
    "hybridkv: a small LLM inference engine built around a hybrid KV cache manager. Full, "
    "sliding-window and chunked attention, Mamba/SSM and linear-attention state and layers "
    "that share another layer's KV live in one paged arena, with prefix caching across all "
    "of them. Plan a model's KV cache (no torch needed), write a tiny random demo model, "
    "generate text with continuous batching, run the benchmarks.")
DEFAULT_MODEL = "gemma-3-27b-it"
BLOCK_HASH_SEED_ENV = "HYBRIDKV_BLOCK_HASH_SEED"
T = TypeVar("T")


class CLIError(Exception):
    """A user mistake: printed as one line, exit status 2."""


class UsageError(Exception):
    """A command line argparse refused: printed as one line, exit status 2."""


class Command(NamedTuple):
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    # None for a command that only groups subcommands (`bench`).
    run: Callable[[argparse.Namespace], int] | None


class _Parser(argparse.ArgumentParser):
    """Reports a bad command line in one line instead of usage + message + exit."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A value that starts with a minus and a digit ("-5GiB", "-1.5e3") is a value, not an
        # option: its flag's type then says what is wrong with it (argparse itself only lets
        # plain negative numbers through and answers "expected one argument").
        self._negative_number_matcher = re.compile(r"^-\.?\d[\w.+-]*$")

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each option's default, unless there is none or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        if action.default is None or action.default is False or "default" in help:
            return action.help
        return super()._get_help_string(action)

    def _split_lines(self, text: str, width: int) -> list[str]:
        # Model names such as gpt-oss-20b stay whole on one line.
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def add_command(subparsers: argparse._SubParsersAction[_Parser],
                command: Command) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(command.name, help=command.help,
                                   description=command.help[:1].upper() + command.help[1:]
                                   + ".", formatter_class=HelpFormatter)
    command.add_arguments(parser)
    if command.run is not None:
        parser.set_defaults(run=command.run, prog=parser.prog)
    return parser


# Argument types: each refuses a bad value with a message naming it (argparse adds the flag).

def _bounded(cast: Callable[[str], T], check: Callable[[T], bool],
             expected: str) -> Callable[[str], T]:
    def parse(text: str) -> T:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not check(value):  # NaN fails every comparison
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    return parse


positive_int = _bounded(int, lambda v: v >= 1, "a whole number >= 1")
non_negative_int = _bounded(int, lambda v: v >= 0, "a whole number >= 0")
seed = _bounded(int, lambda v: 0 <= v < 2**64, "a seed in [0, 2**64)")
non_negative_float = _bounded(float, lambda v: 0 <= v < math.inf, "a finite number >= 0")
probability = _bounded(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
positive_float = _bounded(float, lambda v: 0 < v < math.inf, "a finite number > 0")


MEMORY_SIZE_EXAMPLES = "like 40GiB, 512MiB or 1073741824"


def memory(text: str) -> int:
    """A memory size flag's value: bytes, or a number with a unit; more than 0."""
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(
            f"memory size must be positive, {MEMORY_SIZE_EXAMPLES}; got {text!r}")
    try:
        value = parse_bytes(text)
    except (ValueError, OverflowError):  # "nan", "inf"
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a memory size; use bytes or a number with a unit such "
            f"as 40GiB, 512MiB, 8GB") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(
            f"memory size must be positive, {MEMORY_SIZE_EXAMPLES}; got {text!r}")
    return value


def tier_spec(text: str) -> str:
    """A disk tier as DIR:SIZE, checked (the directory is neither read nor created here)."""
    try:
        parse_tier_spec(text, flag="")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).strip()) from None
    return text


def remote_url(text: str) -> str:
    """A remote tier's URL, checked (nothing is connected here); errors never echo it."""
    try:
        parse_remote_url(text, flag="")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(": ")) from None
    return text


def _dtype(text: str) -> str:
    try:
        dtype_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def speculative_config(text: str) -> dict[str, Any]:
    """--speculative-config: a JSON object, read into the engine's speculative_config."""
    from hybridkv.sched.spec import SpeculativeConfig

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text!r}") from None
    try:
        SpeculativeConfig.from_dict(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return dict(value)


SPECULATIVE_HELP = ('speculative decoding, as vLLM spells it: \'{"method": "ngram", '
                    '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                    '"prompt_lookup_min": 1}\', \'{"method": "draft_model", "model": '
                    'PATH, "num_speculative_tokens": 4}\' or \'{"method": "mtp", '
                    '"num_speculative_tokens": 2}\' (default: off)')


def read_text(path: Path) -> str:
    """A user's text file as UTF-8; a bad one is a CLIError naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CLIError(f"{path}: not UTF-8 text (byte {e.start})") from None


# plan

def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help="model directory, config.json, or the name of a shipped config: "
                             f"{', '.join(shipped_config_names())}")
    parser.add_argument("--memory", type=memory, default="40GiB",
                        help="KV cache bytes, plain or with a unit (default: 40GiB)")
    parser.add_argument("--max-model-len", type=positive_int, default=131072,
                        help="longest request (prompt + output) in tokens")
    parser.add_argument("--block-size", type=positive_int, default=16,
                        help="tokens per attention block")
    parser.add_argument("--kv-dtype", type=_dtype, default=None,
                        help="KV cache dtype (default: the model's dtype)")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                        help="tokens per engine step (sizes the state blocks in flight)")
    parser.add_argument("--no-hybrid", action="store_true",
                        help="treat sliding-window and chunked layers as full attention")
    add_kv_cache_dtype_arguments(parser)
    parser.add_argument("--kv-offload-cpu", type=memory, default=None, metavar="SIZE",
                        help="also show what a CPU offload tier of this size holds "
                             "(default: no CPU tier)")
    parser.add_argument("--kv-offload-disk", type=tier_spec, default=None, metavar="DIR:SIZE",
                        help="also show what a disk offload tier of this size holds (the "
                             "directory is not touched; default: no disk tier)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_plan(args: argparse.Namespace) -> int:
    try:
        config = load_hf_config(args.model)
        layout = kv_layout_from_config(config, block_size=args.block_size,
                                       kv_dtype=args.kv_dtype)
        layout = replace(layout, layer_specs=apply_cache_dtype(
            layout.layer_specs, args.kv_cache_dtype, args.kv_cache_dtype_skip,
            args.state_dtype))
    except UnicodeDecodeError:
        raise CLIError(f"{args.model}: config.json is not UTF-8 text") from None
    except KeyError as e:
        raise CLIError(f"{args.model}: the config lacks the field {e}") from None
    common = dict(max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_sharing=layout.kv_sharing)
    main = plan_kv_cache(layout.layer_specs, args.memory, hybrid=not args.no_hybrid, **common)
    other = plan_kv_cache(layout.layer_specs, args.memory, hybrid=args.no_hybrid, strict=False,
                          **common)
    hybrid, no_hybrid = (other, main) if args.no_hybrid else (main, other)
    disk = parse_tier_spec(args.kv_offload_disk) if args.kv_offload_disk else None
    tiers = offload_tiers(main.config, args.kv_offload_cpu, disk)
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
        if tiers:
            summary["offload_tiers"] = [t._asdict() for t in tiers]
        print(json.dumps(summary))
    else:
        table = _plan_table(args.model, layout.model_type, main, hybrid, no_hybrid, unshared,
                            len(layout.kv_sharing))
        print("\n".join([table, *_tier_lines(tiers, main.config)]) if tiers else table)
    return 0


class OffloadTier(NamedTuple):
    """What one offload tier holds for a model (`hybridkv plan --kv-offload-*`)."""

    tier: str
    path: str | None
    capacity_bytes: int
    # A tier stores blocks as the device holds them: prompt tokens of the attention groups,
    # and (models with state layers) state checkpoints of one block per state group.
    capacity_tokens: int | None
    capacity_state_checkpoints: int | None


def offload_block_bytes(config: KVCacheConfig) -> tuple[float, int]:
    """(bytes per token of the attention groups' blocks, bytes of one state checkpoint: one
    block per state group, 0 without state layers). E.g. Llama 12 layers, fp32, 4 KV heads
    of 64 -> (24576.0, 0); the medium demo NemotronH -> (2048.0, 2.37 MiB)."""
    per_token = sum(g.block_bytes / g.block_size for g in config.groups if not g.spec.is_state)
    state = sum(g.block_bytes for g in config.groups if g.spec.is_state)
    return per_token, state


def offload_tiers(config: KVCacheConfig, cpu_bytes: int | None,
                  disk: TierSpec | None) -> list[OffloadTier]:
    per_token, state = offload_block_bytes(config)
    configured = [("cpu", None, cpu_bytes)] if cpu_bytes is not None else []
    if disk is not None:
        configured.append(("disk", disk.path, disk.capacity_bytes))
    return [OffloadTier(name, path, capacity,
                        int(capacity // per_token) if per_token else None,
                        capacity // state if state else None)
            for name, path, capacity in configured]


def _tier_lines(tiers: list[OffloadTier], config: KVCacheConfig) -> list[str]:
    per_token, state = offload_block_bytes(config)
    lines = ["", f"{'offload tier':<21} {'capacity':>12} {'bytes':>18} {'tokens':>14}"]
    for t in tiers:
        name = t.tier if t.path is None else f"{t.tier} {t.path}"
        tokens = f"{t.capacity_tokens:,}" if t.capacity_tokens is not None else "-"
        lines.append(f"{name:<21} {format_bytes(t.capacity_bytes):>12} "
                     f"{t.capacity_bytes:>18,} {tokens:>14}")
    if per_token:
        lines.append(f"(tokens: capacity / {per_token:,.1f} bytes per token of the attention "
                     f"groups' blocks)")
    if state:
        lines.append(f"state layers: a tier holds their state as checkpoints, one per "
                     f"cached prefix end, ~{format_bytes(state)} each (up to "
                     f"{tiers[0].capacity_state_checkpoints:,} in the {tiers[0].tier} tier "
                     f"if it held nothing else)")
    return lines


def _kind_label(spec: KVCacheSpec, layer_specs: tuple[KVCacheSpec, ...] = ()) -> str:
    """A group's kind in the plan table; MLA groups (pages of latents, no K/V), groups of
    K-only pages (raw keys, values derived from them) and kinds compressed per
    `compress_rate` tokens (entries, indexer keys, compressor states) say so."""
    if isinstance(spec, AttentionSpec) and spec.latent:
        return f"{spec.kind} (MLA)"
    rate = getattr(spec, "compress_rate", 1)
    if rate > 1:
        return f"{spec.kind} (1/{rate})"
    keys_only = [isinstance(s, AttentionSpec) and s.keys_only for s in layer_specs or (spec,)]
    if all(keys_only):
        return f"{spec.kind} (K-only)"
    return f"{spec.kind} ({sum(keys_only)} K-only)" if any(keys_only) else spec.kind


def _plan_table(model: str, model_type: str, main: KVCachePlan, hybrid: KVCachePlan,
                no_hybrid: KVCachePlan, unshared: KVCachePlan | None = None,
                num_shared: int = 0) -> str:
    cfg = main.config
    lines = [
        f"{model} ({model_type}): {format_bytes(main.memory_bytes)} KV cache, max_model_len "
        f"{main.max_model_len}, max_num_batched_tokens {main.max_num_batched_tokens}, "
        f"hybrid management {'on' if main.hybrid else 'off'}",
        "",
        f"{'group':>5}  {'kind':<24} {'dtype':<13} {'window':>7} {'layers':>6} {'shared':>6} "
        f"{'block tok':>9} {'block bytes':>12} {'blocks/page':>11} {'pad/page':>10}",
    ]
    for g in cfg.groups:
        window = getattr(g.spec, "sliding_window", None) or getattr(
            g.spec, "attention_chunk_size", None) or "-"
        kind = _kind_label(g.spec, g.layer_specs)
        lines.append(
            f"{g.group_id:>5}  {kind:<24} {group_dtype(g):<13} {window!s:>7} "
            f"{len(g.layer_names):>6} "
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
          f"{cfg.hit_alignment} tokens)" for g in cfg.groups if g.spec.is_state),
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


# generate

def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", help="a Hugging Face-format model directory, a .gguf "
                                          "file, or a real model's short name "
                                          "(gemma-3-270m, smollm2-135m-instruct)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    source.add_argument("--prompts-file", type=Path,
                        help="a UTF-8 text file, one prompt per non-empty line")
    source.add_argument("--chat", action="append", metavar="MESSAGE",
                        help="a user message, sent through the model's chat template "
                             "(repeatable: one conversation each)")
    parser.add_argument("--chat-template", default=None,
                        help="with --chat: a Jinja chat template (a file or the text) "
                             "(default: the model's own)")
    parser.add_argument("--speculative-config", type=speculative_config, default=None,
                        metavar="JSON", help=SPECULATIVE_HELP)
    parser.add_argument("--max-tokens", type=positive_int, default=32,
                        help="output tokens per prompt at most")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0,
                        help="sampling temperature; 0 is greedy")
    parser.add_argument("--top-k", type=non_negative_int, default=0,
                        help="sample among the k most likely tokens; 0 keeps all")
    parser.add_argument("--top-p", type=probability, default=1.0,
                        help="sample within this probability mass (nucleus sampling)")
    parser.add_argument("--seed", type=seed, default=None,
                        help="sampling seed in [0, 2**64) (default: unseeded)")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="longest request in tokens (default: the model's, at most 8192)")
    parser.add_argument("--kv-cache-memory", type=memory, default=None,
                        help="KV cache bytes, plain or with a unit (default: what 64 "
                             "requests of --max-model-len tokens need, at most half the "
                             "memory available once the model is loaded)")
    parser.add_argument("--dtype", default="auto",
                        help="weights and activations dtype (auto: the model's)")
    add_gguf_arguments(parser)
    add_kv_cache_dtype_arguments(parser)
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="turn prefix caching off")
    parser.add_argument("--no-hybrid", action="store_true",
                        help="manage every layer's KV as full attention")
    parser.add_argument("--kv-sharing-fast-prefill", action="store_true",
                        help="run KV-sharing layers (Gemma 3n/4) on sampled tokens only")
    parser.add_argument("--allow-long-max-model-len", action="store_true",
                        help="accept a --max-model-len above the model's "
                             "max_position_embeddings")
    parser.add_argument("--block-hash-algo", choices=["xxh3", "sha256"], default="xxh3",
                        help="block hash for the prefix cache; its secret seed is random per "
                             f"process unless ${BLOCK_HASH_SEED_ENV} sets one (for processes "
                             "that must agree, e.g. a shared KV tier)")
    add_threads_argument(parser)
    add_offload_arguments(parser)
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")


def add_gguf_arguments(parser: argparse.ArgumentParser) -> None:
    """How a GGUF model's quantized weights run (`generate`, the server)."""
    parser.add_argument("--dequantize", action="store_true",
                        help="GGUF models: dequantize the weights to --dtype at load instead "
                             "of computing on their quantized blocks")
    parser.add_argument("--quant-activations", choices=["float32", "int8"], default="float32",
                        help="GGUF models on CPUs: activations of a decode step in float32 "
                             "(exact) or 8 bits for integer dot products (faster, logits "
                             "slightly off)")


def add_kv_cache_dtype_arguments(parser: argparse.ArgumentParser) -> None:
    """How KV pages and states are stored (`plan`, `generate`, the server)."""
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="KV pages of the attention groups: the model's dtype (auto), "
                             "int8, q4 (4-bit, Hadamard-rotated) or fp8 (CUDA); values and "
                             "their scales share each page (default: auto)")
    parser.add_argument("--kv-cache-dtype-skip", default=None, metavar="KINDS",
                        help="attention kinds kept in the model's dtype, e.g. sliding or "
                             f"sliding,cross (accepted: {', '.join(SKIP_KINDS)}; default: "
                             "none)")
    parser.add_argument("--state-dtype", choices=STATE_DTYPES, default="auto",
                        help="recurrent (Mamba / linear attention) states' dtype (auto: as "
                             "the model declares them; default: auto)")


def kv_cache_dtype_options(args: argparse.Namespace) -> dict[str, object]:
    return dict(kv_cache_dtype=args.kv_cache_dtype,
                kv_cache_dtype_skip=args.kv_cache_dtype_skip, state_dtype=args.state_dtype)


def add_offload_arguments(parser: argparse.ArgumentParser) -> None:
    """The KV offload flags of every command that runs the engine (`generate`, the server)."""
    parser.add_argument("--kv-offload-cpu", type=memory, default=None, metavar="SIZE",
                        help="offload KV blocks to CPU memory within this budget, e.g. 8GiB "
                             "(default: no CPU tier)")
    parser.add_argument("--kv-offload-disk", type=tier_spec, default=None, metavar="DIR:SIZE",
                        help="offload KV blocks to files in DIR within SIZE, e.g. "
                             "/mnt/kv:50GiB; a later run on DIR reuses the blocks stored "
                             "there (default: no disk tier)")
    parser.add_argument("--kv-offload-store", choices=STORE_POLICIES, default="evict",
                        help="when blocks are copied to the tiers: when the device evicts "
                             "them, or as soon as a step fills them")
    parser.add_argument("--kv-remote", type=remote_url, default=None, metavar="URL",
                        help="a Redis shared by replicas as the last KV tier, e.g. "
                             "redis://127.0.0.1:6379/0 (rediss:// for TLS; a password in the "
                             f"URL or ${PASSWORD_ENV}); with \"fill\" a prefix is shared as "
                             "soon as it is computed (default: no remote tier)")
    parser.add_argument("--kv-remote-ttl", type=positive_int, default=None, metavar="SECONDS",
                        help="remote keys expire this long after their last store or hit "
                             "(default: never; Redis's maxmemory policy evicts)")
    parser.add_argument("--kv-remote-timeout", type=positive_float, default=1.0,
                        metavar="SECONDS",
                        help="timeout of every remote call; past it the tier is down and "
                             "retried with back-off (default: 1 s)")


def offload_options(args: argparse.Namespace) -> dict[str, object]:
    """The engine options of `add_offload_arguments`' flags."""
    return dict(kv_offload_cpu=args.kv_offload_cpu, kv_offload_disk=args.kv_offload_disk,
                kv_offload_store=args.kv_offload_store, kv_remote=args.kv_remote,
                kv_remote_ttl_s=args.kv_remote_ttl, kv_remote_timeout_s=args.kv_remote_timeout)


def run_generate(args: argparse.Namespace) -> int:
    if args.prompts_file is not None:
        prompts = [line for line in read_text(args.prompts_file).splitlines() if line.strip()]
        if not prompts:
            raise CLIError(f"{args.prompts_file}: no prompts in the file")
    else:
        prompts = args.prompt or args.chat
    from hybridkv import LLM, SamplingParams

    options: dict[str, object] = dict(
        kv_cache_memory=args.kv_cache_memory, dtype=args.dtype, dequantize=args.dequantize,
        quant_activations=args.quant_activations,
        enable_prefix_caching=not args.no_prefix_caching,
        disable_hybrid_kv_cache=args.no_hybrid,
        kv_sharing_fast_prefill=args.kv_sharing_fast_prefill,
        allow_long_max_model_len=args.allow_long_max_model_len,
        block_hash_algo=args.block_hash_algo, threads=args.threads,
        linear_kernel=args.linear_kernel, attention_backend=args.attention_backend,
        # From the environment, not a flag: a secret on the command line is visible to
        # every user of the machine (ps).
        block_hash_seed=os.environ.get(BLOCK_HASH_SEED_ENV) or None,
        speculative_config=args.speculative_config,
        **offload_options(args), **kv_cache_dtype_options(args))
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    try:
        llm = LLM(args.model_dir, **options)
    except UnicodeDecodeError:
        raise CLIError(f"{args.model_dir}: a model file is not UTF-8 text") from None
    except KeyError as e:
        raise CLIError(f"{args.model_dir}: config.json lacks the field {e}") from None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    inputs: list[str] | list[list[int]] = prompts
    if args.chat:
        inputs = [chat_prompt(llm, args.model_dir, message, args.chat_template)
                  for message in args.chat]
    try:
        outputs = llm.generate(inputs, params)
    finally:
        llm.close()  # queued tier writes land before the process exits
    if args.json:
        print("\n".join(json.dumps({"prompt": p, "text": o.text, "token_ids": o.token_ids,
                                    "finish_reason": o.finish_reason, "error": o.error})
                        for p, o in zip(prompts, outputs, strict=True)))
    else:
        print("\n".join(f"--- prompt: {p!r}\n{o.text}" + (f"\n[error: {o.error}]" if o.error
                                                          else "")
                        for p, o in zip(prompts, outputs, strict=True)))
    return 0


def chat_prompt(llm: Any, model: str, message: str, template: str | None) -> list[int]:
    """One user message as the model's chat template renders it, tokenized as transformers'
    apply_chat_template does (the template prints its own special tokens)."""
    from hybridkv.server.chat import (
        ChatTemplate,
        ChatTemplateError,
        find_chat_template,
        special_tokens,
    )

    engine = llm.engine
    source = find_chat_template(model, template) or engine.parts.chat_template
    if source is None:
        raise CLIError(f"{model}: the model has no chat template (chat_template in "
                       f"tokenizer_config.json or chat_template.jinja; tokenizer.chat_template "
                       f"in a GGUF file): pass --chat-template FILE, or use --prompt")
    if engine.tokenizer is None:
        raise CLIError(f"{model}: the model has no tokenizer: --chat needs one")
    variables = {**(engine.parts.special_tokens or {}), **special_tokens(model)}
    try:
        text = ChatTemplate(source, variables).render(
            [{"role": "user", "content": message}], add_generation_prompt=True)
    except ChatTemplateError as e:
        raise CLIError(str(e)) from None
    return list(engine.tokenizer.encode(text, add_special_tokens=False).ids)


# demo-model

def add_demo_model_arguments(parser: argparse.ArgumentParser) -> None:
    from hybridkv.models.demo import ARCHS, SIZES

    sizes = "; ".join(f"{name}: {s.layers} layers of hidden {s.hidden}, {s.heads} heads, "
                      f"{s.kv_heads} KV heads, intermediate {s.intermediate}"
                      for name, s in SIZES.items())
    parser.add_argument("out_dir", help="directory to write (created; files in it replaced)")
    parser.add_argument("--arch", default="gemma3", help=f"architecture: {', '.join(ARCHS)}")
    parser.add_argument("--size", default="small", choices=list(SIZES),
                        help=f"preset shape, overridden by the flags below ({sizes}; medium "
                             f"has about 100M parameters as a Llama or Gemma 3, 50M as "
                             f"NemotronH)")
    for flag, text in (("layers", "decoder layers"), ("hidden", "hidden size"),
                       ("heads", "attention heads"), ("kv-heads", "KV heads (divides --heads)"),
                       ("intermediate", "MLP intermediate size"),
                       ("vocab", "vocabulary size (at least 258)"),
                       ("window", "window of the sliding-window layers")):
        parser.add_argument(f"--{flag}", type=positive_int, default=None,
                            help=f"{text} (default: from --size)")
    parser.add_argument("--head-dim", type=positive_int, default=None,
                        help="size of each attention head (default: hidden / heads)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the random weights")


def run_demo_model(args: argparse.Namespace) -> int:
    from hybridkv.models.demo import demo_shape, write_demo_model

    shape = demo_shape(args.size, layers=args.layers, hidden=args.hidden, heads=args.heads,
                       kv_heads=args.kv_heads, head_dim=args.head_dim,
                       intermediate=args.intermediate, vocab=args.vocab, window=args.window,
                       seed=args.seed)
    path = write_demo_model(args.out_dir, args.arch, shape)
    size = "tiny" if args.size == "small" else args.size
    print(f"wrote a {size} random {args.arch} model to {path}")
    return 0


# serve

API_KEY_ENV = "HYBRIDKV_API_KEY"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", nargs="?", default=None,
                        help="a Hugging Face-format model directory (default: a small random "
                             "demo model, written once to the cache directory; its text is "
                             "noise)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=non_negative_int, default=8000, help="port")
    parser.add_argument("--served-model-name", default=None,
                        help="model id in the API (default: the directory's name)")
    parser.add_argument("--api-key", default=None,
                        help=f"require `Authorization: Bearer KEY` on /v1 (default: "
                             f"${API_KEY_ENV}, else no key)")
    add_server_engine_arguments(parser)
    parser.add_argument("--max-waiting", type=positive_int, default=DEFAULT_MAX_WAITING,
                        help="queued requests at most; more are refused with 503 and "
                             f"Retry-After (default: {DEFAULT_MAX_WAITING})")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template file, or the template itself (default: "
                             "the model's)")
    parser.add_argument("--shutdown-timeout", type=non_negative_float, default=10.0,
                        help="seconds to let in-flight requests finish on SIGTERM/SIGINT")
    parser.add_argument("--max-request-body-bytes", type=memory, default=None, metavar="BYTES",
                        help="the largest request body accepted, bytes or with a unit; a "
                             "larger one is refused with 413 before it is read (default: "
                             "32MiB: a maximal 128k-token prompt is ~0.5-3 MB of JSON)")
    parser.add_argument("--follow-up-wait-ms", type=non_negative_float,
                        default=DEFAULT_FOLLOW_UP_WAIT_MS,
                        help="after a step that ends a request, hold the next step up to "
                             "this long for that client's next request (agents and chat "
                             "clients send it at once); holding stops while it does not "
                             "pay (default: %(default)s; 0: never hold)")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default="auto",
                        help="split <think>...</think> reasoning from the answer in every "
                             "API (think; deepseek_r1, qwen3 and smollm3 name the same "
                             "format); auto: when the chat template writes </think>; none: "
                             "never (default: auto)")
    parser.add_argument("--max-stored-responses", type=non_negative_int, default=None,
                        help="responses /v1/responses keeps for previous_response_id, the "
                             "oldest dropped first (default: 1024; 0: none)")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="log level")
    add_offload_arguments(parser)
    add_replica_arguments(parser)


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    """KV events and replicas: what routers and indexers in front of `serve` read."""
    parser.add_argument("--kv-events-endpoint", default=None, metavar="ENDPOINT",
                        help="publish KV events in vLLM's ZMQ format: tcp://*:PORT binds, "
                             "tcp://HOST:PORT binds if it can, else connects to the "
                             "subscriber that bound it "
                             "(docs/deployment.md; default: none)")
    parser.add_argument("--kv-events-topic", default=None,
                        help="the events' topic, with --kv-events-endpoint (default: "
                             "kv-events)")
    parser.add_argument("--kv-events-replay-endpoint", default=None, metavar="ENDPOINT",
                        help="a ROUTER socket answering replay requests for missed batches "
                             "(default: none)")
    parser.add_argument("--kv-events-queue", type=positive_int, default=None,
                        help="with --kv-events-endpoint: event batches waiting for the "
                             "publisher at most; beyond it they are dropped and counted "
                             "(default: 10000)")
    parser.add_argument("--data-parallel-size", type=positive_int, default=1,
                        help="start N replicas on N consecutive ports (--port .. --port+N-1) "
                             "on disjoint cores, with one block hash seed, for a router "
                             "(default: 1)")
    parser.add_argument("--replica-index", "--data-parallel-rank", dest="replica_index",
                        type=non_negative_int, default=0,
                        help="this replica's index (set by --data-parallel-size): its KV event "
                             "ports are offset by it; its events say rank 0, the one engine "
                             "behind its URL (default: 0)")


def replica_options(args: argparse.Namespace) -> dict[str, object]:
    return dict(kv_events_endpoint=args.kv_events_endpoint,
                kv_events_topic=args.kv_events_topic,
                kv_events_replay_endpoint=args.kv_events_replay_endpoint,
                kv_events_queue=args.kv_events_queue,
                replica_index=args.replica_index)


def add_server_engine_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """The engine options of `serve` (and of `bench serve`'s in-process server), named as
    vLLM names them."""
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="longest request in tokens (default: the model's, at most 8192)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=64,
                        help="requests in the running batch at most")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                        help="tokens per engine step")
    parser.add_argument("--kv-cache-memory", type=memory, default=None,
                        help="KV cache bytes, plain or with a unit (default: what "
                             "--max-num-seqs requests of --max-model-len tokens need, at "
                             "most half the memory available once the model is loaded; the "
                             "startup log states it)")
    parser.add_argument("--dtype", default="auto",
                        help="weights and activations dtype (auto: the model's)")
    add_gguf_arguments(parser)
    add_kv_cache_dtype_arguments(parser)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True, help="reuse the KV cache of shared prompt prefixes")
    parser.add_argument("--speculative-config", type=speculative_config, default=None,
                        metavar="JSON", help=SPECULATIVE_HELP)
    add_threads_argument(parser)


def add_threads_argument(parser: argparse.ArgumentParser | Any) -> None:
    """--threads, --linear-kernel and --attention-backend: how the model's compute runs."""
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch intra-op threads (default: the cores this process may "
                             "run on, from its CPU affinity mask)")
    parser.add_argument("--linear-kernel", choices=["auto", "cpu", "onednn", "torch"],
                        default="auto",
                        help="linear layers: hybridkv's C kernel (CPU, float32), oneDNN "
                             "with prepacked weights (CPU), torch's F.linear, or auto: the "
                             "first of these that runs (default)")
    parser.add_argument("--attention-backend", choices=["auto", "cpu", "torch"],
                        default="auto",
                        help="cpu: C kernels (paged attention read in place, norms, RoPE; "
                             "compiled on first use); torch: gather + SDPA; auto: cpu on CPU "
                             "devices where it compiles (default)")


def server_engine_options(args: argparse.Namespace) -> dict[str, object]:
    """The engine options of `add_server_engine_arguments`' flags."""
    options: dict[str, object] = dict(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory, dtype=args.dtype, dequantize=args.dequantize,
        quant_activations=args.quant_activations,
        enable_prefix_caching=args.enable_prefix_caching, threads=args.threads,
        linear_kernel=args.linear_kernel, attention_backend=args.attention_backend,
        speculative_config=args.speculative_config)
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    return options


def demo_model_dir() -> Path:
    """The demo model `serve` uses without a model directory, written on first use."""
    from hybridkv.models.demo import demo_shape, write_demo_model

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = cache / "hybridkv" / "hybridkv-demo"
    if not (path / "model.safetensors").is_file() or \
            not (path / "tokenizer_config.json").is_file():
        write_demo_model(path, "gemma3", demo_shape("small"))
    return path


def run_serve(args: argparse.Namespace) -> int:
    import importlib.util
    import logging

    def missing_extra(name: str | None) -> CLIError:
        return CLIError(f"hybridkv serve needs the server extra (missing {name}): "
                        f"pip install 'hybridkv[server]'")

    # Found, not imported: a launcher of replicas never imports them (nor torch).
    for name in ("fastapi", "uvicorn", "prometheus_client"):
        if importlib.util.find_spec(name) is None:
            raise missing_extra(name)
    from hybridkv.config import EngineConfig
    from hybridkv.server.replicas import REPLICA_STATUS_ENV, launch_replicas

    # Every engine option is checked first, before torch is imported (a launcher of
    # replicas runs no engine, and its replicas start seconds sooner) or logging is set up:
    # for --data-parallel-size one line now, not N from the replicas.
    config = EngineConfig.from_kwargs(dict(
        server_engine_options(args), **offload_options(args), **kv_cache_dtype_options(args),
        **replica_options(args), block_hash_seed=os.environ.get(BLOCK_HASH_SEED_ENV) or None))
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: "
                                                             "%(message)s")
    log = logging.getLogger("hybridkv.serve")
    if args.data_parallel_size > 1:
        raw = args.raw_argv
        return launch_replicas(raw[raw.index("serve") + 1:],
                               num_replicas=args.data_parallel_size,
                               port=args.port, host=args.host,
                               seed_env=BLOCK_HASH_SEED_ENV)
    from hybridkv.engine.engine import LLMEngine

    try:
        from hybridkv.server.app import ServerConfig, build_app, run_server
        from hybridkv.server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES
    except ImportError as e:
        raise missing_extra(e.name) from None
    model_dir = args.model_dir
    if model_dir is None:
        model_dir = str(demo_model_dir())
        log.warning("no model given: serving the built-in demo model at %s (random "
                    "weights: its text is noise, the machinery is real)", model_dir)
    try:
        engine = LLMEngine.from_model_dir(model_dir, config)
    except UnicodeDecodeError:
        raise CLIError(f"{model_dir}: a model file is not UTF-8 text") from None
    except KeyError as e:
        raise CLIError(f"{model_dir}: config.json lacks the field {e}") from None
    name = args.served_model_name or Path(model_dir).resolve().name
    app = build_app(engine, ServerConfig(
        model_name=name, model_dir=str(model_dir),
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_waiting=args.max_waiting, chat_template=args.chat_template,
        shutdown_timeout_s=args.shutdown_timeout, follow_up_wait_ms=args.follow_up_wait_ms,
        replica_status=os.environ.get(REPLICA_STATUS_ENV) or None,
        max_request_body_bytes=args.max_request_body_bytes or DEFAULT_MAX_REQUEST_BODY_BYTES,
        reasoning_parser=args.reasoning_parser,
        max_stored_responses=args.max_stored_responses))
    log.info("serving %s as '%s' on http://%s:%d/v1", model_dir, name, args.host, args.port)
    # uvicorn handles SIGTERM/SIGINT (stop accepting, let requests finish, stop the engine),
    # then raises the signal again for the handler it found: a quiet one makes that exit 0.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    run_server(app, host=args.host, port=args.port, log_level=args.log_level,
               shutdown_timeout_s=args.shutdown_timeout)
    return 0


# bench

def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from hybridkv.bench import (
        engine,
        fast_prefill,
        gguf,
        kv_quant,
        kv_trace,
        offload,
        peer_vllm,
        prefix,
        serve,
        spec,
    )

    suites = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for suite in (kv_trace.COMMAND, engine.THROUGHPUT, engine.CAPACITY, prefix.COMMAND,
                  fast_prefill.COMMAND, offload.COMMAND, serve.COMMAND, gguf.COMMAND,
                  peer_vllm.COMMAND, kv_quant.COMMAND, spec.COMMAND):
        add_command(suites, suite)


COMMANDS = (
    Command("plan", "plan the KV cache of a model for a memory budget (no torch needed)",
            add_plan_arguments, run_plan),
    Command("generate", "generate text with a model directory", add_generate_arguments,
            run_generate),
    Command("demo-model", "write a random model in Hugging Face format with a tokenizer",
            add_demo_model_arguments, run_demo_model),
    Command("serve", "serve a model over an OpenAI-compatible HTTP API",
            add_serve_arguments, run_serve),
    Command("bench", "benchmarks that print their figures", add_bench_arguments, None),
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hybridkv", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        add_command(sub, command)
    return parser


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        return f"{error.filename}: {error.strerror}"
    return " ".join(str(error).split("\n"))


def main(argv: Sequence[str] | None = None) -> int:
    """Bad input (flags, files, configs, requests) is one line on stderr and status 2;
    anything else is a bug and keeps its traceback."""
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    args.raw_argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return int(args.run(args))
    except BrokenPipeError:
        # The reader went away (`hybridkv plan | head`): not an error of the input. Point
        # stdout at /dev/null so the interpreter's final flush stays quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (CLIError, ValueError, OSError, NotImplementedError) as e:
        print(f"{args.prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # Through the package module, so that its exception classes are the ones raised.
    from hybridkv.cli import main as package_main

    sys.exit(package_main())
