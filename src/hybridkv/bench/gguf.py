"""`hybridkv bench gguf MODEL`: a GGUF model under hybridkv, and beside llama.cpp on the same
file when its binaries are there (`../shared/bench/peer-llamacpp/setup.sh` builds them).

Each figure comes from a fresh process pinned to the same cores (`--pin`, default the first
`--threads` cores), both engines with the same thread count (`--threads`, default 1), the
engines alternating round by round; ratios are medians of the rounds' pairs:
- batch 1 (llama-bench's figures): pp512 = tokens/s of one 512-token prompt, tg128 = tokens/s
  of the 128 decode steps after an 8-token prompt's first token (timed alone, as llama-bench
  times its decode calls: the request's time less its prompt's and first token's);
  token-id prompts, greedy, EOS ignored; with `--long-prompt N` also ppN, one N-token
  prompt in a process of its own;
- batched: N prompts of L tokens, K greedy tokens each, all in one batch (output tokens/s;
  the peers' workload, `gen_llamacpp` on llama.cpp's side);
- resident memory: the peak RSS of the batch-1 process (the kernel's ru_maxrss, read for both
  engines the same way through wait4);
- load: seconds from starting the hybridkv process (interpreter and imports included) to its
  first generated token;
- with `--two-processes`, two hybridkv processes on the file at once: their RSS and PSS and
  the sum of the PSS over one RSS (bench/shared_memory.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# The token ids gen_llamacpp and the vLLM peers use (vllm_child imports nothing of ours, so
# vLLM's own Python runs it).
from hybridkv.bench.vllm_child import batched_prompts as _batched_prompts
from hybridkv.bench.vllm_child import prompt as _prompt
from hybridkv.cli import Command, positive_int

DEFAULT_LLAMA_BIN = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / \
    "hybridkv-peers" / "llama.cpp" / "src" / "build" / "bin"


def prompt_keys(long_prompt: int | None) -> list[str]:
    """The batch-1 prompt figures a side-by-side bench reports: pp512, and ppN for a long
    prompt of N tokens (`--long-prompt`). N = 512 is refused: that is pp512 itself."""
    if long_prompt == 512:
        raise ValueError("--long-prompt 512 is the 512-token prompt already measured; "
                         "give another length")
    return ["pp512", *([f"pp{long_prompt}"] if long_prompt else [])]


def child_single(model: str, repeats: int, spawned: float, activations: str, threads: int
                 ) -> dict[str, Any]:
    from hybridkv import LLM, SamplingParams

    # The KV cache one request of max_model_len needs (as llama-bench sizes its context to
    # its prompt and decode): a fixed budget would be too small for a wide model's KV.
    llm = LLM(model, max_model_len=1024, enable_prefix_caching=False, max_num_seqs=1,
              threads=threads, quant_activations=activations)
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([_prompt(16)], greedy, use_tqdm=False)
    load_s = time.time() - spawned
    pp, tg = [], []
    for r in range(repeats):
        prompt = _prompt(512, 7 * r)
        t = time.perf_counter()
        llm.generate([prompt], greedy, use_tqdm=False)
        pp.append(512 / (time.perf_counter() - t))
        # The 128 steps after the first token, as llama-bench times its 128 decode calls
        # alone: the time of the whole request less that of its prompt and first token.
        short = [x + 1 for x in prompt[:8]]
        t = time.perf_counter()
        llm.generate([short], greedy, use_tqdm=False)
        first = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate([short], SamplingParams(temperature=0.0, max_tokens=129, ignore_eos=True),
                     use_tqdm=False)
        tg.append(128 / (time.perf_counter() - t - first))
    return {"pp512": statistics.median(pp), "tg128": statistics.median(tg), "load_s": load_s}


def child_long(model: str, length: int, repeats: int, activations: str, threads: int
               ) -> dict[str, Any]:
    """Prompt tokens/s of one `length`-token prompt (its first token included), the median of
    `repeats`, in a process of its own (the batch-1 process's peak RSS stays comparable)."""
    from hybridkv import LLM, SamplingParams

    llm = LLM(model, max_model_len=length + 16, enable_prefix_caching=False, max_num_seqs=4,
              kv_cache_memory="1GiB", threads=threads, quant_activations=activations)
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([_prompt(length, 99)], greedy, use_tqdm=False)
    rates = []
    for r in range(repeats):
        t = time.perf_counter()
        llm.generate([_prompt(length, 7 * r + 3)], greedy, use_tqdm=False)
        rates.append(length / (time.perf_counter() - t))
    return {f"pp{length}": statistics.median(rates)}


def child_batched(model: str, n: int, length: int, k: int, repeats: int, activations: str,
                  threads: int) -> dict[str, Any]:
    from hybridkv import LLM, SamplingParams

    llm = LLM(model, max_model_len=length + k + 32, enable_prefix_caching=False,
              max_num_seqs=max(n, 2), kv_cache_memory="1GiB", threads=threads,
              quant_activations=activations)
    params = SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
    llm.generate(_batched_prompts(2, length, 99), params, use_tqdm=False)
    rates = []
    for r in range(repeats):
        t = time.perf_counter()
        outs = llm.generate(_batched_prompts(n, length, r), params, use_tqdm=False)
        rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
    return {"tok_s": statistics.median(rates)}


def _run_rss(cmd: list[str], pin: str, env: dict[str, str]) -> tuple[str, int]:
    """(stdout, peak RSS in KiB) of a child pinned to `pin`, its rusage read through wait4."""
    read, write = os.pipe()
    err_read, err_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: pin, redirect, exec
        try:
            os.sched_setaffinity(0, {int(c) for c in pin.split(",")})
            os.dup2(write, 1)
            os.dup2(err_write, 2)
            os.close(read)
            os.close(err_read)
            os.execvpe(cmd[0], cmd, env)
        finally:
            os._exit(127)
    os.close(write)
    os.close(err_write)
    with os.fdopen(read) as out_f, os.fdopen(err_read) as err_f:
        import threading

        err_text: list[str] = []
        drain = threading.Thread(target=lambda: err_text.append(err_f.read()))
        drain.start()
        out = out_f.read()
        drain.join()
    _, status, usage = os.wait4(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        lines = "".join(err_text).strip().splitlines()
        raise RuntimeError(f"{Path(cmd[0]).name} failed ({code}): {lines[-1] if lines else ''}")
    return out, int(usage.ru_maxrss)


def _last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise RuntimeError(f"no JSON line in {text[-200:]!r}")


def pin_for(threads: int, pin: str | None) -> str:
    """The cores both engines run on: `pin` as given (at least `threads` cores), or the
    first `threads` cores of this process's affinity mask."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(os.cpu_count() or 1))
    if pin is None:
        if threads > len(cores):
            raise ValueError(f"--threads {threads} is more than the {len(cores)} cores this "
                             f"process may run on")
        return ",".join(str(c) for c in cores[:threads])
    try:
        given = [int(c) for c in pin.split(",")]
    except ValueError:
        raise ValueError(f"--pin {pin!r}: give core numbers joined by commas, e.g. 0,1") \
            from None
    if len(set(given)) < threads:
        raise ValueError(f"--pin {pin} names {len(set(given))} core(s) for --threads "
                         f"{threads}: each thread needs a core of its own")
    return pin


def bench_gguf(model: str, *, rounds: int = 3, pin: str | None = None, threads: int = 1,
               llama_bin: Path | None = None, batched: tuple[int, int, int] = (32, 64, 128),
               skip_batched: bool = False, activations: str = "float32",
               long_prompt: int | None = None, as_json: bool = False,
               two_processes: bool = False) -> str:
    from hybridkv.models.sources import resolve_model

    source = resolve_model(model)
    if not source.is_gguf:
        raise ValueError(f"{model}: not a GGUF file (bench gguf compares GGUF models)")
    path = str(source.path)
    pin = pin_for(threads, pin)
    keys = [*prompt_keys(long_prompt), "tg128", "batched_tok_s", "rss_mib"]
    # gen_llamacpp reads OMP_NUM_THREADS; llama-bench gets -t.
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    bin_dir = llama_bin or DEFAULT_LLAMA_BIN
    have_llama = (bin_dir / "llama-bench").is_file()
    me = [sys.executable, "-m", "hybridkv.bench.gguf"]
    t = ["--threads", str(threads)]
    rows: list[dict[str, Any]] = []
    for _ in range(rounds):
        row: dict[str, Any] = {}
        spawned = time.time()
        out, rss = _run_rss([*me, "single", path, activations, "--spawned", repr(spawned),
                             *t], pin, env)
        row["hybridkv"] = {**_last_json(out), "rss_mib": rss / 1024}
        if long_prompt:
            out, _ = _run_rss([*me, "long", path, activations, str(long_prompt), *t], pin,
                              env)
            row["hybridkv"].update(_last_json(out))
        if not skip_batched:
            out, _ = _run_rss([*me, "batched", path, activations, *map(str, batched), *t],
                              pin, env)
            row["hybridkv"]["batched_tok_s"] = _last_json(out)["tok_s"]
        if have_llama:
            out, rss = _run_rss([str(bin_dir / "llama-bench"), "-m", path, "-t", str(threads),
                                 "-p",
                                 "512", "-n", "128", "-r", "2", "-o", "json"], pin, env)
            figures = {("pp512" if r["n_prompt"] else "tg128"): r["avg_ts"]
                       for r in json.loads(out)}
            row["llama.cpp"] = {**figures, "rss_mib": rss / 1024}
            if long_prompt:
                out, _ = _run_rss([str(bin_dir / "llama-bench"), "-m", path, "-t",
                                   str(threads), "-p",
                                   str(long_prompt), "-n", "0", "-r", "2", "-o", "json"], pin,
                                  env)
                row["llama.cpp"].update({f"pp{r['n_prompt']}": r["avg_ts"]
                                         for r in json.loads(out) if r["n_prompt"]})
            if not skip_batched and (bin_dir / "gen_llamacpp").is_file():
                out, _ = _run_rss([str(bin_dir / "gen_llamacpp"), path,
                                   *map(str, batched), "2", "0", "f32"], pin, env)
                row["llama.cpp"]["batched_tok_s"] = _last_json(out)["median_tok_s"]
        rows.append(row)
    summary: dict[str, Any] = {"model": path, "rounds": rows, "pin": pin, "threads": threads,
                               "batched": list(batched), "quant_activations": activations}
    hyb = {k: statistics.median(r["hybridkv"][k] for r in rows) for k in keys + ["load_s"]
           if all(k in r["hybridkv"] for r in rows)}
    summary["hybridkv"] = hyb
    if two_processes:
        from hybridkv.bench.shared_memory import two_processes as shared

        summary["two_processes"] = shared(path, threads, pin, env)
    if have_llama:
        ratios = {k: [r["hybridkv"][k] / r["llama.cpp"][k] for r in rows
                      if k in r["hybridkv"] and k in r.get("llama.cpp", {})] for k in keys}
        summary["llama.cpp"] = {k: statistics.median(r["llama.cpp"][k] for r in rows)
                                for k in keys if all(k in r["llama.cpp"] for r in rows)}
        summary["ratio"] = {k: statistics.median(v) for k, v in ratios.items() if v}
        summary["pairs"] = {k: [round(x, 3) for x in v] for k, v in ratios.items() if v}
    if as_json:
        return json.dumps(summary)
    lines = [f"{path}: cores {pin}, {threads} thread(s) each engine, {rounds} rounds, engines "
             f"alternating; hybridkv activations {activations}"]
    names = {"pp512": "prompt 512 (tok/s)", f"pp{long_prompt}": f"prompt {long_prompt} (tok/s)",
             "tg128": "decode, batch 1 (tok/s)",
             "batched_tok_s": f"batched {batched[0]} x {batched[1]} in, {batched[2]} out "
                              f"(output tok/s)", "rss_mib": "peak RSS, batch 1 (MiB)"}
    for k in keys:
        if k not in hyb:
            continue
        line = f"  {names[k]:<44} hybridkv {hyb[k]:9.1f}"
        if have_llama and k in summary["ratio"]:
            line += (f"   llama.cpp {summary['llama.cpp'][k]:9.1f}   ratio "
                     f"{summary['ratio'][k]:.2f} (pairs "
                     f"{', '.join(f'{x:.2f}' for x in summary['pairs'][k])})")
        lines.append(line)
    lines.append(f"  {'load to first token (s)':<44} hybridkv {hyb['load_s']:9.2f}")
    if two_processes:
        two = summary["two_processes"]
        lines.append(f"  {'two processes: PSS sum / one RSS':<44} hybridkv "
                     f"{two['pss_sum_over_rss']:9.2f} (RSS {two['rss_mib']} MiB, PSS "
                     f"{two['pss_mib']} MiB)")
    if not have_llama:
        lines.append(f"  (llama.cpp not found in {bin_dir}: run "
                     f"shared/bench/peer-llamacpp/setup.sh, or pass --llama-bin)")
    return "\n".join(lines)


def add_side_by_side_arguments(parser: argparse.ArgumentParser, rounds: int,
                               pin_help: str = "the core(s) both engines run on (default: 0)"
                               ) -> None:
    """The options every side-by-side bench shares: rounds, the pinned core(s), the batched
    workload."""
    parser.add_argument("--rounds", type=positive_int, default=rounds,
                        help=f"rounds of both engines, alternating; medians reported "
                             f"(default: {rounds})")
    parser.add_argument("--pin", default="0", help=pin_help)
    parser.add_argument("--batched", type=positive_int, nargs=3, default=[32, 64, 128],
                        metavar=("N", "L", "K"),
                        help="the batched workload (default: 32 64 128)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a .gguf file or a real model's short name "
                                      "(gemma-3-270m, smollm2-135m-instruct)")
    add_side_by_side_arguments(parser, rounds=3, pin_help=(
        "the cores both engines run on, e.g. 0,1 (default: the first --threads cores this "
        "process may run on)"))
    parser.set_defaults(pin=None)
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="threads of each engine, one core each (llama.cpp's -t; "
                             "default: 1)")
    parser.add_argument("--llama-bin", type=Path, default=None,
                        help=f"llama.cpp's build/bin (default {DEFAULT_LLAMA_BIN})")
    parser.add_argument("--no-batched", action="store_true", help="batch 1 only")
    parser.add_argument("--quant-activations", choices=["float32", "int8"], default="float32",
                        help="hybridkv's activations for the quantized matrices (default: "
                             "float32)")
    parser.add_argument("--long-prompt", type=positive_int, default=None, metavar="TOKENS",
                        help="also one prompt of this many tokens at batch 1, in a process "
                             "of its own (llama-bench -p TOKENS beside it; default: none)")
    parser.add_argument("--two-processes", action="store_true",
                        help="also two hybridkv processes on the file at once: the sum of "
                             "their PSS over one process's RSS (Linux)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    print(bench_gguf(args.model, rounds=args.rounds, pin=args.pin, threads=args.threads,
                     llama_bin=args.llama_bin,
                     batched=tuple(args.batched), skip_batched=args.no_batched,
                     activations=args.quant_activations, long_prompt=args.long_prompt,
                     as_json=args.json, two_processes=args.two_processes))
    return 0


COMMAND = Command("gguf", "a GGUF model at batch 1 and batched, its memory and load time, "
                          "beside llama.cpp on the same file", add_arguments, run)


def _child_main(argv: list[str]) -> None:
    threads = int(argv[argv.index("--threads") + 1])
    if argv[0] == "single":
        result = child_single(argv[1], 3, float(argv[argv.index("--spawned") + 1]), argv[2],
                              threads)
    elif argv[0] == "long":
        result = child_long(argv[1], int(argv[3]), 2, argv[2], threads)
    else:
        n, length, k = (int(x) for x in argv[3:6])
        result = child_batched(argv[1], n, length, k, 2, argv[2], threads)
    print(json.dumps(result))


if __name__ == "__main__":
    _child_main(sys.argv[1:])
