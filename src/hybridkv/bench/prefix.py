"""`hybridkv bench prefix`: prefix caching on a seeded multi-turn chat trace.

Conversations of several turns each re-send their history; several conversations share a
system prompt. Turn t of every conversation runs as one batch (turn t+1 needs turn t's
answer). For a state-space hybrid the figures compare state checkpoints at prompt ends only,
with branch points, and the block size vLLM's single page size would force (its attention
page must be as large as a state, so its block grows to hundreds of tokens on real models).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hybridkv.bench.engine import model_vocab
from hybridkv.cli import Command, memory, positive_int
from hybridkv.kv.spec import AttentionSpec, MambaSpec, cdiv


@dataclass
class PrefixBenchResult:
    hit_tokens: int
    prompt_tokens: int
    prefill_tokens_computed: int
    hit_rate: float
    wall_s: float


def make_chat_trace(seed: int, *, num_systems: int, conversations_per_system: int,
                    turns: int, vocab: int, system_len: tuple[int, int] = (100, 2000)
                    ) -> tuple[list[list[int]], list[list[list[int]]]]:
    """(system prompts of `system_len` tokens, per conversation its user messages)."""
    import random

    rng = random.Random(seed)
    systems = [[rng.randrange(4, vocab) for _ in range(rng.randint(*system_len))]
               for _ in range(num_systems)]
    users = [[[rng.randrange(4, vocab) for _ in range(rng.randint(20, 60))]
              for _ in range(turns)] for _ in range(num_systems * conversations_per_system)]
    return systems, users


def run_chat(model_dir: str, systems: list[list[int]], users: list[list[list[int]]],
             answer_len: int, options: dict[str, Any]) -> PrefixBenchResult:
    from hybridkv import LLM, SamplingParams

    llm = LLM(model_dir, **options)
    params = SamplingParams(max_tokens=answer_len, ignore_eos=True)
    histories = [list(systems[c % len(systems)]) for c in range(len(users))]
    start = time.perf_counter()
    for turn in range(len(users[0])):
        prompts = [history + users[c][turn] for c, history in enumerate(histories)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        histories = [p + o.token_ids for p, o in zip(prompts, outputs, strict=True)]
    wall = time.perf_counter() - start
    stats = llm.engine.kv_manager.stats
    return PrefixBenchResult(
        hit_tokens=stats.num_hit_tokens, prompt_tokens=stats.num_queried_tokens,
        prefill_tokens_computed=stats.num_queried_tokens - stats.num_hit_tokens,
        hit_rate=stats.num_hit_tokens / max(1, stats.num_queried_tokens), wall_s=wall)


def single_page_block_size(model_dir: str, block_size: int = 16) -> int | None:
    """The attention block size that makes one attention page as large as one layer's
    state, rounded up to a multiple of `block_size` (vLLM's unified page size); None for
    models without state layers."""
    from hybridkv.models.layer_mix import kv_layout_from_config, load_hf_config

    specs = kv_layout_from_config(load_hf_config(model_dir), block_size=block_size).layer_specs
    states = [s.page_size_bytes for s in specs.values() if isinstance(s, MambaSpec)]
    attention = [s.bytes_per_token for s in specs.values() if isinstance(s, AttentionSpec)]
    if not states or not attention:
        return None
    tokens = math.ceil(max(states) / min(attention))
    return cdiv(tokens, block_size) * block_size


def bench_prefix(model_dir: str | None, *, num_systems: int, conversations_per_system: int,
                 turns: int, answer_len: int, kv_cache_memory: int = 256 << 20,
                 compare_eviction: bool = False, system_len: tuple[int, int] = (100, 2000),
                 as_json: bool = False) -> str:
    """On `model_dir`, or by default on a tiny NemotronH-like and a tiny Gemma-3-like model."""
    from hybridkv.models.demo import DemoShape, write_demo_model

    run_args = (num_systems, conversations_per_system, turns, answer_len, kv_cache_memory,
                compare_eviction, system_len, as_json)
    if model_dir is not None:
        return _bench_prefix_one(model_dir, *run_args)
    shape = DemoShape(layers=9, hidden=128, heads=4, kv_heads=2, head_dim=32,
                      intermediate=256, vocab=512, window=64)
    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("nemotron_h", "gemma3"):
            path = str(write_demo_model(Path(tmp) / arch, arch, shape))
            outputs[arch] = _bench_prefix_one(path, *run_args)
    if as_json:
        return json.dumps({arch: json.loads(out) for arch, out in outputs.items()})
    return "\n\n".join(f"{arch}-like:\n{out}" for arch, out in outputs.items())


def _bench_prefix_one(model_dir: str, num_systems: int, conversations_per_system: int,
                      turns: int, answer_len: int, kv_cache_memory: int,
                      compare_eviction: bool, system_len: tuple[int, int],
                      as_json: bool) -> str:
    vocab = model_vocab(model_dir)
    systems, users = make_chat_trace(0, num_systems=num_systems,
                                     conversations_per_system=conversations_per_system,
                                     turns=turns, vocab=vocab, system_len=system_len)
    longest = max(len(s) for s in systems) + turns * (60 + answer_len) + 16
    base = dict(dtype="float32", max_model_len=longest, kv_cache_memory=kv_cache_memory,
                max_num_seqs=len(users))
    runs = {
        "prompt_ends": dict(base, mamba_checkpoint_branch_points=False),
        "branch_points": dict(base),
    }
    forced = single_page_block_size(model_dir)
    if compare_eviction and forced is not None:
        # Under memory pressure: which cached blocks go when pages move between groups.
        runs["branch_points_lru_eviction"] = dict(base, kv_eviction="lru")
        runs["branch_points_value_eviction"] = dict(base, kv_eviction="value")
    if forced is not None:
        runs[f"single_page_block_{forced}"] = dict(
            base, block_size=forced, mamba_checkpoint_branch_points=False)
    results = {name: run_chat(model_dir, systems, users, answer_len, options)
               for name, options in runs.items()}
    if as_json:
        return json.dumps({name: asdict(r) for name, r in results.items()})
    lines = [f"{len(users)} conversations x {turns} turns, {num_systems} system prompts of "
             f"{min(map(len, systems))}-{max(map(len, systems))} tokens, answers of "
             f"{answer_len} tokens",
             f"{'checkpoints':28} {'hit / prompt tokens':>22} {'hit rate':>8} "
             f"{'prefilled':>9} {'wall s':>7}"]
    for name, r in results.items():
        lines.append(f"{name:28} {f'{r.hit_tokens} / {r.prompt_tokens}':>22} "
                     f"{r.hit_rate:8.1%} {r.prefill_tokens_computed:9d} {r.wall_s:7.2f}")
    if forced is not None:
        real = single_page_block_size("Nemotron-H-8B-Base-8K")
        lines.append(f"(with Nemotron-H-8B's real shapes a single page size forces attention "
                     f"blocks of {real} tokens; hybridkv keeps 16)")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", nargs="?", default=None,
                        help="a model directory (default: a tiny NemotronH-like and a tiny "
                             "Gemma-3-like demo model built on the fly)")
    parser.add_argument("--systems", type=positive_int, default=2,
                        help="distinct system prompts")
    parser.add_argument("--conversations-per-system", type=positive_int, default=3,
                        help="conversations sharing each system prompt")
    parser.add_argument("--turns", type=positive_int, default=3,
                        help="user turns per conversation (20-60 tokens each)")
    parser.add_argument("--answer-len", type=positive_int, default=16,
                        help="tokens of each answer")
    parser.add_argument("--kv-cache-memory", type=memory, default="256MiB",
                        help="KV cache bytes, plain or with a unit")
    parser.add_argument("--system-len", type=positive_int, nargs=2, default=(100, 2000),
                        metavar=("MIN", "MAX"),
                        help="system prompt lengths (default 100 2000)")
    parser.add_argument("--compare-eviction", action="store_true",
                        help="also run with lru and value-aware eviction (use a small budget)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    print(bench_prefix(args.model_dir, num_systems=args.systems,
                       conversations_per_system=args.conversations_per_system,
                       turns=args.turns, answer_len=args.answer_len,
                       kv_cache_memory=args.kv_cache_memory,
                       compare_eviction=args.compare_eviction,
                       system_len=tuple(args.system_len), as_json=args.json))
    return 0


COMMAND = Command("prefix", "prefix caching on a multi-turn chat trace", add_arguments, run)
