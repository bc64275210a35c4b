"""`hybridkv bench vllm MODEL_DIR`: a float32 model directory under hybridkv and under vLLM's
CPU build (`../shared/bench/peer-vllm/setup.sh` makes its virtual environment), side by side.

Each round starts a fresh process per engine (bench/vllm_child.py, run by each engine's own
Python), pinned to the same core (`--pin`) with one thread, hybridkv first; ratios are the
medians of the rounds' pairs. Per process, each figure is the median of 3 runs:
- pp512: prompt tokens/s of one 512-token prompt (one output token); with `--long-prompt N`
  also ppN, one N-token prompt;
- tg128: tokens/s of 128 decode steps after an 8-token prompt;
- batched: output tokens/s of N prompts of L tokens, K greedy tokens each, in one batch.
Float32, greedy, EOS ignored, prefix caching off, token-id prompts. vLLM's start (~2-3
minutes on one core) is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

from hybridkv.bench.gguf import _last_json, _run_rss, add_side_by_side_arguments, prompt_keys
from hybridkv.cli import Command, positive_int

DEFAULT_VLLM_PYTHON = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / \
    "hybridkv-peers" / "vllm-venv" / "bin" / "python"
CHILD = Path(__file__).with_name("vllm_child.py")


def bench_vllm(model: str, *, rounds: int = 2, pin: str = "0", vllm_python: Path | None = None,
               batched: tuple[int, int, int] = (32, 64, 128), long_prompt: int | None = None,
               as_json: bool = False) -> str:
    import sys

    if not Path(model).is_dir() or not (Path(model) / "config.json").is_file():
        raise ValueError(f"{model}: not a model directory with a config.json (vLLM's CPU "
                         f"build reads the same float32 directory as hybridkv)")
    peer = vllm_python or DEFAULT_VLLM_PYTHON
    if not Path(peer).is_file():
        raise ValueError(f"no vLLM Python at {peer}: run shared/bench/peer-vllm/setup.sh, "
                         f"or pass --vllm-python")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": pin}
    keys = [*prompt_keys(long_prompt), "tg128", "batched"]
    args = [model, *map(str, batched), "3", str(long_prompt or 0)]
    rows: list[dict[str, Any]] = []
    for _ in range(rounds):
        row = {}
        for name, python in (("hybridkv", sys.executable), ("vllm", str(peer))):
            out, rss = _run_rss([python, str(CHILD), name, *args], pin, env)
            row[name] = {**_last_json(out), "rss_mib": rss / 1024}
        rows.append(row)
    pairs = {k: [r["hybridkv"][k] / r["vllm"][k] for r in rows] for k in keys}
    summary = {"model": model, "pin": pin, "threads": 1, "batched": list(batched),
               "rounds": rows,
               "hybridkv": {k: statistics.median(r["hybridkv"][k] for r in rows) for k in keys},
               "vllm": {k: statistics.median(r["vllm"][k] for r in rows) for k in keys},
               "ratio": {k: statistics.median(v) for k, v in pairs.items()},
               "pairs": {k: [round(x, 3) for x in v] for k, v in pairs.items()}}
    if as_json:
        return json.dumps(summary)
    names = {"pp512": "prompt 512, batch 1 (prompt tok/s)",
             f"pp{long_prompt}": f"prompt {long_prompt}, batch 1 (prompt tok/s)",
             "tg128": "decode, batch 1 (tok/s)",
             "batched": f"batched {batched[0]} x {batched[1]} in, {batched[2]} out "
                        f"(output tok/s)"}
    lines = [f"{model}: one core ({pin}), one thread, {rounds} rounds, engines alternating, "
             f"float32"]
    for k in keys:
        lines.append(f"  {names[k]:<44} hybridkv {summary['hybridkv'][k]:8.1f}   vLLM "
                     f"{summary['vllm'][k]:8.1f}   ratio {summary['ratio'][k]:.2f} (pairs "
                     f"{', '.join(f'{x:.2f}' for x in pairs[k])})")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a float32 Hugging Face-format model directory")
    add_side_by_side_arguments(parser, rounds=2)
    parser.add_argument("--vllm-python", type=Path, default=None,
                        help=f"the Python of vLLM's CPU build (default {DEFAULT_VLLM_PYTHON})")
    parser.add_argument("--long-prompt", type=positive_int, default=None, metavar="TOKENS",
                        help="also one prompt of this many tokens at batch 1 (default: none)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    print(bench_vllm(args.model, rounds=args.rounds, pin=args.pin,
                     vllm_python=args.vllm_python, batched=tuple(args.batched),
                     long_prompt=args.long_prompt, as_json=args.json))
    return 0


COMMAND = Command("vllm", "a float32 model directory at batch 1 and batched, beside vLLM's "
                          "CPU build on the same directory", add_arguments, run)
