"""One engine's figures for `hybridkv bench vllm`, run as a script by either engine's Python
(vLLM's CPU build lives in a virtual environment of its own, without hybridkv): nothing
here imports hybridkv at module level.

    python vllm_child.py ENGINE MODEL_DIR N L K REPEATS [LONG]

prints one JSON line: pp512 (prompt tokens/s of one 512-token prompt, one output token),
ppLONG (the same for one LONG-token prompt, where LONG is given and not 0),
tg128 (decode tokens/s of 128 tokens after an 8-token prompt), batched (output tokens/s of N
prompts of L tokens, K greedy tokens each, in one batch), each the median of REPEATS runs,
and init_s. Both engines: float32, greedy, EOS ignored, prefix caching off, token-id
prompts (the ones `hybridkv bench gguf` gives llama.cpp)."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable


def prompt(n: int, shift: int = 0) -> list[int]:
    return [3 + (j * 11 + shift) % 1000 for j in range(n)]


def batched_prompts(n: int, length: int, r: int) -> list[list[int]]:
    return [[3 + (i * 37 + j * 11 + r * 101) % 1000 for j in range(length)] for i in range(n)]


def engine(name: str, model: str, max_len: int, max_seqs: int
           ) -> Callable[[list[list[int]], int], int]:
    """generate(prompts, max_tokens) -> output tokens, for `name`'s engine."""
    if name == "vllm":
        import os

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        vllm = LLM(model=model, tokenizer=model, dtype="float32", max_model_len=max_len,
                   seed=0, enable_prefix_caching=False, max_num_seqs=max_seqs)

        def gen_vllm(ps: list[list[int]], k: int) -> int:
            sp = SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
            outs = vllm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp,
                                 use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)

        return gen_vllm
    from hybridkv import LLM as HLLM
    from hybridkv import SamplingParams as HParams

    hyb = HLLM(model, dtype="float32", max_model_len=max_len, enable_prefix_caching=False,
               max_num_seqs=max_seqs, kv_cache_memory="1GiB", threads=1)

    def gen_hybridkv(ps: list[list[int]], k: int) -> int:
        outs = hyb.generate(ps, HParams(temperature=0.0, max_tokens=k, ignore_eos=True),
                            use_tqdm=False)
        return sum(len(o.token_ids) for o in outs)

    return gen_hybridkv


def timed(gen: Callable[[list[list[int]], int], int], ps: list[list[int]], k: int
          ) -> tuple[int, float]:
    t = time.perf_counter()
    n = gen(ps, k)
    return n, time.perf_counter() - t


def main(argv: list[str]) -> None:
    name, model = argv[0], argv[1]
    n, length, k, repeats = (int(x) for x in argv[2:6])
    long = int(argv[6]) if len(argv) > 6 else 0
    t0 = time.perf_counter()
    gen = engine(name, model, max(512, length + k, long) + 32, max(n, 2))
    init_s = time.perf_counter() - t0
    gen(batched_prompts(2, length, 99), 4)  # warm-up on prompts no run uses
    pp, pp_long, tg, batched = [], [], [], []
    for r in range(repeats):
        _, dt = timed(gen, [prompt(512, 7 * r)], 1)
        pp.append(512 / dt)
        if long:
            _, dt = timed(gen, [prompt(long, 7 * r + 3)], 1)
            pp_long.append(long / dt)
        _, dt = timed(gen, [prompt(8, 7 * r + 1)], 129)
        tg.append(128 / dt)
        out, dt = timed(gen, batched_prompts(n, length, r), k)
        batched.append(out / dt)
    figures = {"engine": name, "init_s": init_s, "pp512": statistics.median(pp),
               "tg128": statistics.median(tg), "batched": statistics.median(batched)}
    if long:
        figures[f"pp{long}"] = statistics.median(pp_long)
    print(json.dumps(figures))


if __name__ == "__main__":
    main(sys.argv[1:])
