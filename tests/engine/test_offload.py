"""KV offloading end to end: a prefix served from the CPU or disk tier gives the tokens the
engine computes without any cache, on every architecture, under preemption and chunked prefill,
across processes, and through every fault a tier can suffer (damaged files, a vanished or
read-only directory, full tiers, slow loads, aborted requests). Each fault costs a hit at most:
the request recomputes, the counters say so, and one warning per kind says why.

Round 2 of most tests runs after `reset_prefix_cache()`, which drops the device prefix cache
only, so every hit of that round has to come from a tier. Prompt lengths are never multiples
of 16: a state (Mamba) group checkpoints at the prompt end rounded down to a block, and a hit
must leave the last token to compute, so a prompt of exactly k blocks never hits its own
checkpoint.
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.connector.offload import disk_tier  # noqa: E402
from tests.models.tiny import build_tiny_model, planner_minimum  # noqa: E402

GREEDY = SamplingParams(max_tokens=6)
COMMON = dict(dtype="float32", device="cpu", max_model_len=256)
LENGTHS = (41, 75, 100)  # none a multiple of 16 (see the module docstring)
# Both store policies on a mix of kinds: full, sliding, chunked, Mamba, DeltaNet, KV sharing.
# The first 16 architectures: one of each group kind the connector moves (new families
# reuse these kinds; add one here when it brings a new kind).
ARCHS = ["llama", "qwen3", "qwen3_swa", "mistral", "gemma2", "gemma3", "gpt_oss",
         "llama4_text", "nemotron_h", "bamba", "granitemoehybrid", "jamba", "falcon_h1",
         "qwen3_next", "gemma3n", "gemma4_text", "lfm2", "mamba",
         "recurrent_gemma", "kimi_linear", "dots3_note", "qwen4_exp", "deepseek_v4"]
FILL_ARCHS = ["llama", "gemma3", "llama4_text", "nemotron_h", "qwen3_next", "gemma3n"]
# Jamba: a Mamba state; DeepSeek-V4: compressed entries, indexer keys, compressor states.
DISK_ARCHS = ["qwen3_swa", "jamba", "deepseek_v4"]


def make_prompts(seed: int, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 250) for _ in range(n)] for n in lengths]


def model_builder(tmp_path_factory, **config):
    """`get(name)`: the tiny model's directory (`config` overriding its config fields),
    built on first use."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_tiny_model(name, tmp_path_factory.mktemp(name), **config)
        return built[name]

    return get


def reference_runner(model, engine_options: dict):
    """`get(name, prompts, **options)`: the greedy tokens without any cache, each set of
    prompts and options run once."""
    seen: dict[tuple, list[list[int]]] = {}

    def get(name: str, prompts: list[list[int]], **options) -> list[list[int]]:
        key = (name, tuple(map(tuple, prompts)), tuple(sorted(options.items())))
        if key not in seen:
            llm = LLM(str(model(name)), enable_prefix_caching=False,
                      **{**engine_options, **options})
            seen[key] = tokens_of(llm.generate(prompts, GREEDY))
        return seen[key]

    return get


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """`model(name)`: the tiny model's directory, built on first use in this module."""
    return model_builder(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(model):
    """`reference(name, prompts, **options)`: the greedy tokens without any cache."""
    return reference_runner(model, {**COMMON, "kv_cache_memory": "4MiB"})


def tokens_of(outputs) -> list[list[int]]:
    """Every output's tokens, after checking none failed and its hit adds up per tier."""
    for out in outputs:
        assert out.finish_reason != "error", out.error
        assert sum(out.cached_tokens_by_tier.values()) == out.num_cached_tokens
    return [out.token_ids for out in outputs]


def tier_tokens(outputs, tier: str) -> int:
    return sum(out.cached_tokens_by_tier[tier] for out in outputs)


def check_cpu_round(first, second, expected: list[list[int]]) -> None:
    """Both rounds give the reference tokens; the second's hit came from the CPU tier (the
    device cache was handed to it in between)."""
    assert tokens_of(first) == expected
    assert tokens_of(second) == expected
    assert tier_tokens(second, "device") == 0
    assert tier_tokens(second, "cpu") > 0


def offload_llm(model_dir: Path, **options) -> LLM:
    return LLM(str(model_dir), **{**COMMON, "kv_cache_memory": "4MiB", **options})


def two_rounds(llm: LLM, prompts: list[list[int]]) -> tuple[list, list]:
    """Generate, drop the device prefix cache, generate the same prompts again."""
    first = llm.generate(prompts, GREEDY)
    assert llm.reset_prefix_cache() is True
    return first, llm.generate(prompts, GREEDY)


def flush(llm: LLM) -> None:
    """Wait until the offload thread has written (and loaded) everything queued."""
    llm.engine.runner.connector.flush()


def books_clean(llm: LLM) -> None:
    """Once idle and every completion drained: nothing holds a block."""
    flush(llm)
    llm.engine.step()  # drains load completions (a load given up on still owns blocks)
    kv = llm.engine.kv_manager
    kv.check_integrity()
    assert kv.usage == 0.0
    assert not llm.engine.scheduler.has_unfinished
    assert not llm.engine.connector.has_loads


def synchronous_loads(llm: LLM) -> None:
    """Loads and stores complete before each forward: the same steps on every run, so a
    scenario under memory pressure is deterministic."""
    worker = llm.engine.runner.connector
    queue_and_start = worker.before_forward

    def before_forward(meta) -> None:
        queue_and_start(meta)
        worker.flush()

    worker.before_forward = before_forward


def warnings_per_kind(caplog: pytest.LogCaptureFixture) -> Counter:
    """hybridkv's warnings, counted per message template (one kind of fault each)."""
    return Counter(r.msg for r in caplog.records
                   if r.levelno >= logging.WARNING and r.name.startswith("hybridkv"))


def block_bytes(llm: LLM) -> int:
    return max(g.block_bytes for g in llm.engine.plan.config.groups)


# ---------------------------------------------------------------- every architecture


@pytest.mark.parametrize("arch", ARCHS)
def test_cpu_tier_hits_give_the_reference_tokens(arch, model, reference):
    prompts = make_prompts(1)
    llm = offload_llm(model(arch), kv_offload_cpu="64MiB")
    first, second = two_rounds(llm, prompts)
    check_cpu_round(first, second, reference(arch, prompts))
    stats = llm.offload_stats()
    assert stats["blocks_loaded"] > 0 and stats["blocks_failed"] == 0
    assert stats["tokens_by_tier"]["cpu"] == tier_tokens(second, "cpu")
    books_clean(llm)
    llm.close()


@pytest.mark.parametrize("arch", FILL_ARCHS)
def test_the_fill_policy_gives_the_reference_tokens(arch, model, reference):
    prompts = make_prompts(2)
    llm = offload_llm(model(arch), kv_offload_cpu="64MiB", kv_offload_store="fill")
    first, second = two_rounds(llm, prompts)
    check_cpu_round(first, second, reference(arch, prompts))
    # "fill" stores every computed block once, as it is filled, even those never evicted.
    assert llm.offload_stats()["blocks_stored"] > 0
    books_clean(llm)


@pytest.mark.parametrize("arch", DISK_ARCHS)
def test_a_disk_only_tier_gives_the_reference_tokens(arch, model, reference, tmp_path):
    prompts = make_prompts(3)
    llm = offload_llm(model(arch), kv_offload_disk=f"{tmp_path}:64MiB")
    first, second = two_rounds(llm, prompts)
    expected = reference(arch, prompts)
    assert tokens_of(first) == expected
    assert tokens_of(second) == expected
    assert tier_tokens(second, "disk") > 0
    assert tier_tokens(second, "cpu") == tier_tokens(second, "device") == 0
    [disk] = llm.offload_stats()["tiers"]
    assert disk["tier"] == "disk" and disk["bytes_stored"] > 0
    flush(llm)
    assert list(tmp_path.glob("*.kv"))
    books_clean(llm)


def test_cpu_then_disk_a_cleared_cpu_tier_is_refilled_from_the_disk(model, reference,
                                                                    tmp_path):
    prompts = make_prompts(4)
    llm = offload_llm(model("gemma3"), kv_offload_cpu="64MiB",
                      kv_offload_disk=f"{tmp_path}:64MiB", kv_offload_store="fill")
    llm.generate(prompts, GREEDY)
    flush(llm)
    llm.engine.connector.chain.clear(0)  # the CPU tier forgets: only the disk has them
    assert llm.reset_prefix_cache()
    second = llm.generate(prompts, GREEDY)
    assert tokens_of(second) == reference("gemma3", prompts)
    assert tier_tokens(second, "disk") > 0 and tier_tokens(second, "cpu") == 0
    cpu, disk = llm.offload_stats()["tiers"]
    assert disk["hits"] > 0 and cpu["promotions"] == disk["hits"]
    # Round 3: the promoted blocks now come from the CPU tier.
    assert llm.reset_prefix_cache()
    third = llm.generate(prompts, GREEDY)
    assert tokens_of(third) == tokens_of(second)
    assert tier_tokens(third, "cpu") > 0 and tier_tokens(third, "disk") == 0
    books_clean(llm)


# ---------------------------------------------------------------- memory pressure


@pytest.mark.parametrize(("arch", "scale"), [("llama", 1.25), ("gemma3", 1.25),
                                             ("nemotron_h", 1.0)])
def test_preemption_and_chunked_prefill_under_a_tiny_budget(arch, scale, model, reference):
    """Near the planner's minimum budget, with 32-token steps, requests preempt each other;
    round 2 finds its prefixes in the tier only. Loads are synchronous so that every run
    takes the same steps."""
    prompts = make_prompts(5, (41, 75, 100, 57, 90, 66))
    options = dict(max_model_len=128, max_num_batched_tokens=32)
    expected = reference(arch, prompts, **options)
    # (With one block of prompt tail checkpoints: more would leave room to spare.)
    budget = int(planner_minimum(model(arch), max_model_len=128, batch=32,
                                 checkpoint_tail=1) * scale)
    llm = offload_llm(model(arch), kv_cache_memory=budget, kv_offload_cpu="64MiB",
                      mamba_checkpoint_tail=1, **options)
    synchronous_loads(llm)
    assert tokens_of(llm.generate(prompts, GREEDY)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.reset_prefix_cache()
    second = llm.generate(prompts, GREEDY)
    assert tokens_of(second) == expected
    # Counted over every admission (a preempted request is admitted again).
    assert llm.offload_stats()["tokens_by_tier"]["cpu"] > 0
    books_clean(llm)


def test_a_device_cache_too_small_serves_old_prefixes_from_the_tier(model, reference):
    arch = "nemotron_h"
    many = make_prompts(6, (41, 75, 57, 90, 66, 83, 45, 70, 99, 53))
    again = many[:3]
    # Room for about two prompts at a time: the first ones are long evicted when they come
    # back (no reset here: the device simply could not keep them).
    budget = planner_minimum(model(arch), max_model_len=128, batch=128) * 2
    llm = offload_llm(model(arch), kv_cache_memory=budget, max_model_len=128,
                      max_num_batched_tokens=128, kv_offload_cpu="64MiB")
    synchronous_loads(llm)
    assert tokens_of(llm.generate(many, GREEDY)) == reference(arch, many)
    outputs = llm.generate(again, GREEDY)
    assert tokens_of(outputs) == reference(arch, again)
    assert tier_tokens(outputs, "cpu") > 0
    books_clean(llm)


def test_finished_loads_holding_memory_do_not_fail_a_waiting_request(model, reference):
    """Two requests' tier loads take every device block; both complete and go back to
    `waiting`. The head request then needs one more block: the other request's finished
    load holds it, so that load is given back (its blocks stay cached) instead of the head
    being declared "does not fit in the KV cache even alone"."""
    arch = "llama"
    prompts = make_prompts(7, (40, 40))  # 3 blocks each; a hit of 2 blocks each
    probe = offload_llm(model(arch))
    four_blocks = 4 * block_bytes(probe) + probe.engine.plan.config.large_page_bytes
    del probe
    llm = offload_llm(model(arch), kv_cache_memory=four_blocks, max_model_len=64,
                      max_num_batched_tokens=64, kv_offload_cpu="1MiB")
    assert llm.engine.plan.config.num_large_pages == 5  # 4 usable blocks
    synchronous_loads(llm)
    first, second = two_rounds(llm, prompts)
    expected = reference(arch, prompts, max_model_len=64)
    assert tokens_of(first) == expected
    assert tokens_of(second) == expected


# ---------------------------------------------------------------- a second process

SECOND_PROCESS = """
import json, sys
from hybridkv import LLM, SamplingParams
model_dir, disk, policy, prompts = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
llm = LLM(model_dir, dtype="float32", device="cpu", max_model_len=256, kv_cache_memory="4MiB",
          kv_offload_disk=disk, kv_offload_store=policy)
outputs = llm.generate(json.loads(prompts), SamplingParams(max_tokens=6))
print(json.dumps({"tokens": [o.token_ids for o in outputs],
                  "disk": [o.cached_tokens_by_tier["disk"] for o in outputs],
                  "errors": [o.error for o in outputs if o.error]}))
"""


@pytest.mark.parametrize("policy", ["fill", "evict"])
def test_a_second_process_on_the_same_directory_hits_the_first_ones_blocks(
        policy, model, reference, tmp_path):
    """With "fill" every block was stored as it filled; with "evict" close() writes the
    device cache out (it is going away, as if evicted)."""
    arch = "bamba"
    prompts = make_prompts(8)
    disk = f"{tmp_path / 'kv'}:64MiB"
    llm = offload_llm(model(arch), kv_offload_disk=disk, kv_offload_store=policy)
    expected = reference(arch, prompts)
    assert tokens_of(llm.generate(prompts, GREEDY)) == expected
    llm.close()
    script = tmp_path / "second.py"
    script.write_text(SECOND_PROCESS)
    done = subprocess.run(
        [sys.executable, str(script), str(model(arch)), disk, policy, json.dumps(prompts)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["errors"] == []
    assert result["tokens"] == expected
    assert sum(result["disk"]) > 0, "the second process found none of the first's blocks"


# ---------------------------------------------------------------- durability of the disk tier
# With the default store policy ("evict") nothing leaves a device cache that has room; the
# disk tier still gets every block as it fills (written through in the background), so a
# process that dies without close() leaves its work for the next one.

KILLED_PROCESS = """
import json, sys, time
from hybridkv import LLM, SamplingParams
model_dir, disk, prompts = sys.argv[1:4]
llm = LLM(model_dir, dtype="float32", device="cpu", max_model_len=256, kv_cache_memory="4MiB",
          kv_offload_disk=disk)
# One token: the prompt's last blocks are filled by the request's last step.
llm.generate(json.loads(prompts), SamplingParams(max_tokens=1))
print(json.dumps(llm.offload_stats()), flush=True)
time.sleep(600)  # SIGKILLed here: never closed
"""


def device_hits(model_dir: Path, prompts: list[list[int]]) -> list[int]:
    """Per prompt, the hit a second request gets from one process's device cache: what a
    later process should find on disk."""
    llm = offload_llm(model_dir)
    llm.generate(prompts, GREEDY)
    return [out.num_cached_tokens for out in llm.generate(prompts, GREEDY)]


def disk_files(directory: Path, count: int, timeout_s: float = 30.0) -> int:
    """How many block files `directory` holds once it holds `count` (or after `timeout_s`:
    the background writer gets a bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while (found := len(list(directory.glob("*.kv")))) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_a_process_killed_without_closing_leaves_its_blocks_on_disk(model, reference,
                                                                     tmp_path):
    arch = "llama"
    prompts = make_prompts(11)
    directory = tmp_path / "kv"
    script = tmp_path / "killed.py"
    script.write_text(KILLED_PROCESS)
    child = subprocess.Popen(
        [sys.executable, str(script), str(model(arch)), f"{directory}:64MiB",
         json.dumps(prompts)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        line = child.stdout.readline()
        assert line, child.stderr.read()[-2000:]
        stats = json.loads(line)
        disk_files(directory, stats["blocks_stored"])
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    llm = offload_llm(model(arch), kv_offload_disk=f"{directory}:64MiB")
    outputs = llm.generate(prompts, GREEDY)
    assert tokens_of(outputs) == reference(arch, prompts)
    assert [out.cached_tokens_by_tier["disk"] for out in outputs] == \
        device_hits(model(arch), prompts), "the killed process's blocks are not on disk"


@pytest.mark.parametrize("budget", ["written_through", "no_write_through"])
def test_a_dropped_llm_leaves_its_blocks_on_disk(budget, model, reference, tmp_path):
    """`del llm` without close(): the blocks written through are on disk, and the rest (none
    here is written through with a budget of 0) are written when the LLM is collected."""
    arch = "llama"
    prompts = make_prompts(12)
    disk = f"{tmp_path / 'kv'}:64MiB"
    llm = offload_llm(model(arch), kv_offload_disk=disk)
    if budget == "no_write_through":
        llm.engine.connector.write_through_bytes = 0
    llm.generate(prompts, GREEDY)
    skipped = llm.offload_stats().get("write_through_skipped", 0)
    del llm
    gc.collect()
    again = offload_llm(model(arch), kv_offload_disk=disk)
    outputs = again.generate(prompts, GREEDY)
    assert tokens_of(outputs) == reference(arch, prompts)
    assert [out.cached_tokens_by_tier["disk"] for out in outputs] == \
        device_hits(model(arch), prompts)
    assert (skipped > 0) == (budget == "no_write_through")


def test_an_llm_as_a_context_manager_closes_on_exit(model, tmp_path):
    arch = "llama"
    prompts = make_prompts(13)
    disk = f"{tmp_path / 'kv'}:64MiB"
    with offload_llm(model(arch), kv_offload_disk=disk) as llm:
        llm.engine.connector.write_through_bytes = 0  # only close() writes the disk
        llm.generate(prompts, GREEDY)
        assert not list((tmp_path / "kv").glob("*.kv"))
    assert llm.engine._closed
    assert len(list((tmp_path / "kv").glob("*.kv"))) == llm.offload_stats()["blocks_stored"]
    assert llm.generate(prompts, GREEDY)[0].finish_reason == "length"  # still usable


def test_write_through_keeps_the_evict_policy_for_the_cpu_tier(model, reference, tmp_path):
    """CPU over disk, policy evict: every filled block goes to the disk at once and to the
    CPU tier only when the device evicts it."""
    arch = "llama"
    prompts = make_prompts(14)
    llm = offload_llm(model(arch), kv_offload_cpu="64MiB",
                      kv_offload_disk=f"{tmp_path / 'kv'}:64MiB")
    first = llm.generate(prompts, GREEDY)
    flush(llm)
    cpu, disk = llm.engine.connector.chain.tiers
    stats = llm.offload_stats()
    assert len(cpu) == 0 and len(disk) == stats["blocks_written_through"] > 0
    assert llm.reset_prefix_cache()
    second = llm.generate(prompts, GREEDY)
    check_cpu_round(first, second, reference(arch, prompts))
    assert tier_tokens(second, "disk") == 0
    books_clean(llm)


def test_an_evicted_block_reaches_the_cpu_tier_while_its_disk_write_is_pending(
        model, reference, tmp_path):
    """Policy evict over a slow disk: a block written through to the disk and evicted from
    the device before that write is done still goes to the CPU tier (the pending disk
    copy covers the disk only). The engine does not wait on the disk meanwhile: its steps'
    lookups and the CPU tier's buffers do not queue behind the write (the disk holds its
    first write until the steps are done; a stalled engine would see it give up)."""
    import threading

    from hybridkv.connector.offload.disk_tier import DiskTier

    arch = "llama"
    prompts = make_prompts(14)
    llm = offload_llm(model(arch), kv_offload_cpu="64MiB",
                      kv_offload_disk=f"{tmp_path / 'kv'}:64MiB")
    cpu, disk = llm.engine.connector.chain.tiers
    assert isinstance(disk, DiskTier)
    release = threading.Event()
    gave_up: list[bool] = []
    put = disk.put

    def slow_put(items):  # the disk is behind
        if not release.wait(60):
            gave_up.append(True)
            return [False] * len(items)
        return put(items)

    disk.put = slow_put
    try:
        first = llm.generate(prompts, GREEDY)
        assert llm.reset_prefix_cache()  # evicted while their disk writes are queued
        llm.engine.step()  # copies the evicted blocks out
    finally:
        release.set()
    flush(llm)
    assert not gave_up, "the engine's steps waited on the disk's write"
    assert len(cpu) > 0
    second = llm.generate(prompts, GREEDY)
    check_cpu_round(first, second, reference(arch, prompts))
    books_clean(llm)


# ---------------------------------------------------------------- faults


def filled_disk(model_dir: Path, directory: Path, **options) -> LLM:
    """A disk-only engine whose tier holds every block of round 1 of make_prompts(9)."""
    llm = offload_llm(model_dir, kv_offload_disk=f"{directory}:64MiB",
                      kv_offload_store="fill", **options)
    llm.generate(make_prompts(9), GREEDY)
    flush(llm)
    assert list(directory.glob("*.kv"))
    return llm


def flip_payload(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # the payload ends the file
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def damage_all(directory: Path, how: str) -> int:
    files = sorted(directory.glob("*.kv"))
    if how == "swapped":
        # Every file gets the next one's bytes: a whole, valid file of another key.
        contents = [f.read_bytes() for f in files]
        for f, data in zip(files, contents[1:] + contents[:1], strict=True):
            f.write_bytes(data)
    else:
        for f in files:
            {"flipped": flip_payload, "truncated": truncate}[how](f)
    return len(files)


@pytest.mark.parametrize("how", ["flipped", "truncated", "swapped"])
def test_damaged_disk_files_are_misses_and_recomputed(how, model, reference, tmp_path,
                                                      caplog):
    arch = "nemotron_h"
    prompts = make_prompts(9)
    llm = filled_disk(model(arch), tmp_path)
    damage_all(tmp_path, how)
    assert llm.reset_prefix_cache()
    with caplog.at_level(logging.WARNING):
        outputs = llm.generate(prompts, GREEDY)
    assert tokens_of(outputs) == reference(arch, prompts)
    assert tier_tokens(outputs, "disk") == 0  # every file was damaged: nothing served
    stats = llm.offload_stats()
    [disk] = stats["tiers"]
    assert disk["rejected"] > 0 and disk["hits"] == 0
    assert stats["blocks_failed"] == disk["rejected"]
    assert max(warnings_per_kind(caplog).values(), default=0) <= 1
    # The damaged files were removed; round 2 stored its blocks afresh, and round 3 hits.
    flush(llm)
    assert llm.reset_prefix_cache()
    third = llm.generate(prompts, GREEDY)
    assert tokens_of(third) == reference(arch, prompts)
    assert tier_tokens(third, "disk") > 0
    books_clean(llm)


def test_the_directory_deleted_mid_run(model, reference, tmp_path, caplog):
    arch = "llama"
    prompts = make_prompts(9)
    llm = filled_disk(model(arch), tmp_path / "kv")
    shutil.rmtree(tmp_path / "kv")
    assert llm.reset_prefix_cache()
    with caplog.at_level(logging.WARNING):
        outputs = llm.generate(prompts, GREEDY)
        new = llm.generate(make_prompts(10), GREEDY)  # stores into the missing directory
        flush(llm)
    assert tokens_of(outputs) == reference(arch, prompts)
    assert tokens_of(new) == reference(arch, make_prompts(10))
    assert tier_tokens(outputs, "disk") == 0
    stats = llm.offload_stats()
    assert stats["tiers"][0]["errors"] > 0
    assert stats["blocks_failed"] > 0
    kinds = warnings_per_kind(caplog)
    assert max(kinds.values()) == 1
    assert any("directory missing" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "kv").exists()  # not recreated behind the user's back
    books_clean(llm)


def test_a_read_only_directory(model, reference, tmp_path, caplog, monkeypatch):
    arch = "llama"
    prompts = make_prompts(9)
    directory = tmp_path / "kv"
    llm = filled_disk(model(arch), directory)
    if os.geteuid() == 0:
        # chmod does not stop root: fail the calls a read-only mount fails.
        def read_only(*args: object, **kwargs: object) -> None:
            raise OSError(errno.EROFS, "Read-only file system")

        monkeypatch.setattr(disk_tier.os, "replace", read_only)
        monkeypatch.setattr(disk_tier.os, "remove", read_only)
    else:
        directory.chmod(0o555)
    try:
        assert llm.reset_prefix_cache()
        with caplog.at_level(logging.WARNING):
            outputs = llm.generate(prompts, GREEDY)  # reads still work
            new = llm.generate(make_prompts(10), GREEDY)  # its stores fail
            flush(llm)
    finally:
        directory.chmod(0o755)
        monkeypatch.undo()
    assert tokens_of(outputs) == reference(arch, prompts)
    assert tokens_of(new) == reference(arch, make_prompts(10))
    assert tier_tokens(outputs, "disk") > 0
    [disk] = llm.offload_stats()["tiers"]
    assert disk["errors"] > 0
    kinds = warnings_per_kind(caplog)
    assert max(kinds.values()) == 1
    assert any("not writable" in r.getMessage() for r in caplog.records)
    books_clean(llm)


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_a_full_tier_evicts_and_stays_correct(tier, model, reference, tmp_path):
    arch = "gemma3"
    prompts = make_prompts(11, (41, 75, 100, 57, 90))
    probe = offload_llm(model(arch))
    budget = 3 * block_bytes(probe) + 1000  # three blocks (and a disk file's header)
    del probe
    option = {"cpu": {"kv_offload_cpu": budget},
              "disk": {"kv_offload_disk": f"{tmp_path}:{budget}"}}[tier]
    llm = offload_llm(model(arch), **option)
    first, second = two_rounds(llm, prompts)
    expected = reference(arch, prompts)
    assert tokens_of(first) == expected
    assert tokens_of(second) == expected
    [stats] = llm.offload_stats()["tiers"]
    assert stats["evictions"] > 0
    chain = llm.engine.connector.chain
    assert chain.tiers[0].used_bytes <= budget
    chain.tiers[0].check_integrity()
    books_clean(llm)


def test_a_load_timeout_recomputes_without_hanging(model, reference, caplog):
    arch = "nemotron_h"
    prompts = make_prompts(12)
    llm = offload_llm(model(arch), kv_offload_cpu="64MiB", kv_offload_load_timeout_s=1e-6)
    llm.generate(prompts, GREEDY)
    worker = llm.engine.runner.connector
    load_block = worker._load_block

    def slow_load_block(*args):
        time.sleep(0.01)  # far beyond the timeout: every load is given up on
        return load_block(*args)

    worker._load_block = slow_load_block
    assert llm.reset_prefix_cache()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        outputs = llm.generate(prompts, GREEDY)
    assert time.monotonic() - started < 30
    assert tokens_of(outputs) == reference(arch, prompts)
    stats = llm.offload_stats()
    assert stats["load_timeouts"] > 0
    assert max(warnings_per_kind(caplog).values()) == 1
    books_clean(llm)


@pytest.mark.parametrize("when", ["in_flight", "landed"])
def test_abort_while_loading_frees_every_block(when, model, reference):
    arch = "qwen3_next"
    prompts = make_prompts(13)
    llm = offload_llm(model(arch), kv_offload_cpu="64MiB")
    llm.generate(prompts, GREEDY)
    assert llm.reset_prefix_cache()
    engine = llm.engine
    worker = engine.runner.connector
    gate = threading.Event()
    load_block = worker._load_block

    def gated_load_block(*args):
        assert gate.wait(timeout=30), "the test never opened the gate"
        return load_block(*args)

    worker._load_block = gated_load_block
    other = make_prompts(14, (50,))[0]  # nothing of it is cached: it computes meanwhile
    engine.add_request("victim", prompts[2], GREEDY)
    engine.add_request("other", other, GREEDY)
    for _ in range(20):
        engine.step()
        if "victim" in engine.scheduler.loading:
            break
    assert "victim" in engine.scheduler.loading
    if when == "landed":
        gate.set()
        flush(llm)  # the load is done; the scheduler has not seen it yet
    engine.abort_request("victim")
    gate.set()
    finished = {}
    for _ in range(100):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if not engine.has_unfinished:
            break
    assert set(finished) == {"other"}
    assert tokens_of([finished["other"]]) == reference(arch, [other])
    books_clean(llm)
    # The engine goes on: the aborted prompt is served from the tier (or the device).
    assert tokens_of(llm.generate([prompts[2]], GREEDY)) == reference(arch, [prompts[2]])
    books_clean(llm)


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(("options", "says"), [
    (dict(kv_offload_cpu="1KiB"), "smaller than one block"),
    (dict(kv_offload_disk="{tmp}/kv:1KiB"), "smaller than one block"),
    (dict(kv_offload_disk="{tmp}/file/kv:64MiB"), "kv_offload_disk"),
    (dict(kv_offload_cpu="64MiB", kv_offload_store="lazy"), "kv_offload_store"),
    (dict(kv_offload_cpu="64MiB", kv_offload_load_timeout_s=0), "kv_offload_load_timeout_s"),
    (dict(kv_offload_cpu="64MiB", kv_offload_load_timeout_s=-1.0),
     "kv_offload_load_timeout_s"),
    (dict(kv_offload_cpu="64MiB", kv_offload_load_timeout_s=float("nan")),
     "kv_offload_load_timeout_s"),
    (dict(kv_offload_cpu="64MiB", enable_prefix_caching=False), "enable_prefix_caching"),
    (dict(kv_offload_cpu="8 gigs"), "kv_offload_cpu"),
    (dict(kv_offload_cpu=0), "kv_offload_cpu"),
    (dict(kv_offload_disk="{tmp}/kv"), "has no size"),
    (dict(kv_offload_disk="{tmp}/kv:lots"), "kv_offload_disk"),
    (dict(kv_offload_disk=42), "kv_offload_disk"),
], ids=["cpu_below_a_block", "disk_below_a_block", "dir_under_a_file", "unknown_policy",
        "zero_timeout", "negative_timeout", "nan_timeout", "no_prefix_caching",
        "unparsable_size", "zero_cpu", "disk_without_size", "disk_bad_size", "disk_not_str"])
def test_bad_offload_configuration_is_one_line(options, says, model, tmp_path):
    (tmp_path / "file").write_text("a regular file, not a directory")
    options = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v
               for k, v in options.items()}
    with pytest.raises(ValueError) as e:
        offload_llm(model("llama"), **options)
    assert says in str(e.value)
    assert "\n" not in str(e.value)


def test_another_model_on_the_same_directory_never_hits(model, reference, tmp_path):
    """The keys carry the model's identity (its config and weights): the same architecture
    with other weights finds none of the first model's blocks, and answers as itself."""
    prompts = make_prompts(10)
    disk = f"{tmp_path / 'kv'}:64MiB"
    first = offload_llm(model("llama"), kv_offload_disk=disk, kv_offload_store="fill")
    first.generate(prompts, GREEDY)
    first.close()
    assert list((tmp_path / "kv").glob("*.kv"))
    other_dir = tmp_path / "other"
    build_tiny_model("llama", other_dir)
    weights = other_dir / "model.safetensors"
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(weights))
    save_file({k: v * 1.01 for k, v in tensors.items()}, str(weights), metadata={"format": "pt"})
    other = offload_llm(other_dir, kv_offload_disk=disk)
    outputs = other.generate(prompts, GREEDY)
    assert tier_tokens(outputs, "disk") == 0
    expected = LLM(str(other_dir), **{**COMMON, "kv_cache_memory": "4MiB"},
                   enable_prefix_caching=False).generate(prompts, GREEDY)
    assert tokens_of(outputs) == tokens_of(expected)
