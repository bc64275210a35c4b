import pytest

from hybridkv.kv.plan import (
    choose_large_page_bytes,
    format_bytes,
    parse_bytes,
    plan_kv_cache,
)
from hybridkv.kv.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from hybridkv.models.layer_mix import kv_layout_from_config, load_hf_config

GiB = 1 << 30


def plan_model(name, memory=40 * GiB, max_model_len=131072, mnbt=512, hybrid=True, **kw):
    layout = kv_layout_from_config(load_hf_config(name), kv_dtype="bf16")
    return plan_kv_cache(layout.layer_specs, memory, max_model_len=max_model_len,
                         max_num_batched_tokens=mnbt, hybrid=hybrid,
                         kv_sharing=layout.kv_sharing, **kw)


@pytest.mark.parametrize("name", ["gemma-3-27b-it", "gpt-oss-120b", "gpt-oss-20b",
                                  "Llama-4-Scout-17B-16E-Instruct"])
def test_max_concurrency_is_within_one_percent_of_the_physical_limit(name):
    plan = plan_model(name)
    layout = kv_layout_from_config(load_hf_config(name), kv_dtype="bf16")
    # The physical limit, computed here from first principles: every layer holds exactly
    # what it needs at max_model_len.
    ideal = 0
    for spec in layout.layer_specs.values():
        tokens = min(131072, getattr(spec, "sliding_window", None)
                     or getattr(spec, "attention_chunk_size", None) or 131072)
        ideal += tokens * spec.bytes_per_token
    physical = 40 * GiB / ideal
    assert plan.max_concurrency >= 0.99 * physical
    assert plan.ideal_fraction == pytest.approx(plan.max_concurrency / physical)
    assert plan.padding_bytes == 0


def test_gemma3_27b_groups_all_layers_of_a_kind_with_no_padding():
    plan = plan_model("gemma-3-27b-it")
    sliding, full = plan.config.groups
    assert (sliding.spec.kind, len(sliding.layer_names)) == ("sliding_window", 52)
    assert (full.spec.kind, len(full.layer_names)) == ("full", 10)
    # 10 and 52 layers of 128 KiB pages: the large page is their LCM, 260 pages.
    assert plan.config.large_page_bytes == 260 * 128 * 1024
    assert (full.blocks_per_large_page, sliding.blocks_per_large_page) == (26, 5)
    assert all(g.block_size == 16 for g in plan.config.groups)


def test_hybrid_beats_no_hybrid_and_no_hybrid_reports_why():
    hybrid = plan_model("gpt-oss-20b")
    full = plan_model("gpt-oss-20b", hybrid=False)
    assert [g.spec.kind for g in full.config.groups] == ["full"]
    assert hybrid.max_concurrency > 1.9 * full.max_concurrency
    small = plan_model("gemma-3-27b-it", hybrid=False, strict=False)
    assert small.warnings and "too small for one request" in small.warnings[0]


def test_state_layers_keep_the_attention_block_size():
    plan = plan_model("Nemotron-H-8B-Base-8K")
    kinds = {g.spec.kind: g for g in plan.config.groups}
    assert kinds["full"].block_size == 16
    assert len(kinds["mamba"].layer_names) == 24
    assert plan.ideal_fraction >= 0.99


def test_large_page_is_the_lcm_when_small_and_padded_when_not():
    assert choose_large_page_bytes([6, 4], 100) == 12
    # LCM of 1000 and 999 is 999000, over the cap: a multiple of the largest block with the
    # least waste for the other.
    size = choose_large_page_bytes([1000, 999], 10_000)
    assert size % 1000 == 0 and size <= 10_000
    assert (size % 999) / size < 0.01


def test_padding_is_reported_when_block_bytes_do_not_divide():
    specs = {"f": FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="fp32"),
             "m": MambaSpec(block_size=16, shapes=((1000,),), dtypes=("fp32",))}
    plan = plan_kv_cache(specs, 10_000_000, max_model_len=1024, max_num_batched_tokens=64,
                         max_large_page_bytes=4000)
    [full, mamba] = plan.config.groups
    assert plan.config.large_page_bytes == 4000
    assert full.padding_bytes_per_large_page(4000) == 4000 - 3 * 1024
    assert mamba.padding_bytes_per_large_page(4000) == 0
    assert plan.padding_bytes > 0


def test_kv_shared_layers_get_no_pages():
    plan = plan_model("gemma-3n-E4B-it", max_model_len=32768)
    sliding, full = plan.config.groups
    assert (len(sliding.layer_names), len(sliding.shared_layer_names)) == (16, 12)
    assert (len(full.layer_names), len(full.shared_layer_names)) == (4, 3)


def test_bad_budgets_get_one_line_errors():
    with pytest.raises(ValueError, match="must be positive"):
        plan_model("gpt-oss-20b", memory=0)
    with pytest.raises(ValueError, match="too small for one request of 131072 tokens"):
        plan_model("gpt-oss-20b", memory=GiB)


def test_block_size_above_max_model_len_warns():
    specs = {"f": FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=8)}
    plan = plan_kv_cache(specs, 1 << 20, max_model_len=32, max_num_batched_tokens=32)
    assert any("prefix cache can never hit" in w for w in plan.warnings)


def test_summary_has_the_documented_keys():
    summary = plan_model("gpt-oss-20b").summary()
    for key in ("groups", "block_size", "large_page_bytes", "padding_bytes", "capacity_tokens",
                "ideal_bytes_per_token", "ideal_fraction", "max_concurrency"):
        assert key in summary


def test_memory_sizes_parse_and_print():
    assert parse_bytes("40GiB") == 40 * GiB
    assert parse_bytes("512MB") == 512_000_000
    assert parse_bytes("12345") == 12345
    assert parse_bytes(" 1.5 KiB") == 1536
    for bad in ("40XB", "", "-1", "GiB"):
        with pytest.raises(ValueError, match="cannot read"):
            parse_bytes(bad)
    assert format_bytes(40 * GiB) == "40.00 GiB"


def test_sliding_window_spec_example_plan_is_exact():
    # 2 full + 2 sliding layers of 4 KiB pages: one large page per block.
    attn = dict(block_size=16, num_kv_heads=1, head_size=64, dtype="fp16")
    specs = {"f0": FullAttentionSpec(**attn), "s0": SlidingWindowSpec(sliding_window=64, **attn),
             "f1": FullAttentionSpec(**attn), "s1": SlidingWindowSpec(sliding_window=64, **attn)}
    plan = plan_kv_cache(specs, 100 * 8192, max_model_len=1024, max_num_batched_tokens=64)
    assert [g.layer_names for g in plan.config.groups] == [("f0", "f1"), ("s0", "s1")]
    assert plan.config.large_page_bytes == 8192
    assert plan.config.num_large_pages == 100


def minimum_memory(specs, **kw):
    """The smallest budget the planner accepts (it is monotone in the budget)."""
    lo, hi = 1, 1 << 30
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            plan_kv_cache(specs, mid, **kw)
            hi = mid
        except ValueError:
            lo = mid + 1
    return lo


@pytest.mark.parametrize("caching", [True, False])
def test_one_request_of_max_model_len_runs_alone_at_the_planners_minimum(caching):
    """Anything the planner accepts runs one request of max_model_len alone, checkpoints
    included. With caching the request takes the most state blocks one step can take: it
    resumes from a checkpoint (256) while attention matched further (288, the branch point),
    and its one prefill step crosses the branch point and every checkpoint of its prompt's
    tail (the default, DEFAULT_CHECKPOINT_TAIL blocks)."""
    from hybridkv.kv.manager import KVCacheManager
    from hybridkv.kv.request import KVRequest

    attn = dict(block_size=16, num_kv_heads=2, head_size=32, dtype="bf16")
    specs = {"m0": MambaSpec(block_size=16, shapes=((4, 384), (8, 16, 32)),
                             dtypes=("bf16", "fp32")),
             "a1": FullAttentionSpec(**attn), "m2": MambaSpec(
                 block_size=16, shapes=((4, 384), (8, 16, 32)), dtypes=("bf16", "fp32")),
             "a3": FullAttentionSpec(**attn)}
    limits = dict(max_model_len=512, max_num_batched_tokens=512, enable_caching=caching)
    memory = minimum_memory(specs, **limits)
    config = plan_kv_cache(specs, memory, **limits).config
    m = KVCacheManager(config, max_model_len=512, enable_caching=caching)

    def run(rid, prompt, total):
        req = KVRequest(rid, prompt, hash_block_size=16)
        hit = m.get_computed_blocks(req)
        assert m.allocate_slots(req, req.num_tokens - hit.num_computed_tokens,
                                hit.num_computed_tokens, hit.blocks) is not None
        req.num_computed_tokens = req.num_tokens
        while req.num_tokens < total:
            req.append_token_ids([7])
            assert m.allocate_slots(req, 1) is not None, f"{rid} stalled at {req.num_tokens}"
            req.num_computed_tokens += 1
        m.check_integrity()
        m.free(req)
        return hit.num_computed_tokens

    shared = list(range(1, 257))
    # State checkpoints up to 256 (a prompt's tail), attention blocks up to 368 and state
    # checkpoints only from 320 (the second prompt's tail), which "long" parts from at 288.
    run("warm", shared, 256)
    run("warm2", shared + [7] * 32 + [5] * 84, 376)
    # 464 tokens (whole blocks: five tail checkpoints, 400 to 464), decoded to 512.
    prompt = shared + [7] * 32 + list(range(1000, 1176))
    assert run("long", prompt, 512) == (256 if caching else 0)
    assert all(gs.num_used == 0 for gs in m.pool.groups)
    m.check_integrity()


def test_a_manager_for_80_gib_of_a_real_model_is_built_without_making_its_blocks():
    """Blocks and large pages are made when first handed out: construction is O(pages)
    with a tiny constant (2.4 s before for gemma-3-270m at 80 GiB; 2 M blocks)."""
    import time

    from hybridkv.kv.manager import KVCacheManager

    plan = plan_model("gemma-3-27b-it", memory=80 * GiB, max_model_len=8192, mnbt=8192)
    start = time.perf_counter()
    m = KVCacheManager(plan.config, max_model_len=8192)
    assert time.perf_counter() - start < 0.1
    assert all(page is None for page in m.pool.pages[1:])
    assert [b.block_id for b in m.pool.null_blocks] == [0, 0]
    m.check_integrity()


def test_short_requests_reserve_no_window_widening_beyond_their_own_peak():
    """Gemma 3 270M in 16 MiB at max_model_len 256 with a 2,048-token step budget: a step's
    chunks could widen the sliding windows by 129 blocks of 480 KiB, more than the arena,
    but a 256-token request holds at most one block more than its steady 16. The plan once
    said 0 concurrent requests (and servers 0 blocks) here, though one request fits."""
    layout = kv_layout_from_config(load_hf_config("gemma-3-270m"), kv_dtype="float32")
    plan = plan_kv_cache(layout.layer_specs, 16 << 20, max_model_len=256,
                         max_num_batched_tokens=2048, kv_sharing=layout.kv_sharing)
    sliding, full = plan.config.groups
    assert (sliding.blocks_per_large_page, full.blocks_per_large_page) == (1, 5)
    usable = plan.config.num_large_pages - 1  # in large pages
    # Each request: 16 sliding blocks + 1 while a chunk widens its window, 16 full blocks
    # (a fifth of a page each).
    assert plan.max_concurrency == pytest.approx(usable / (16 + 1 + 16 / 5))
    assert plan.capacity_tokens // 16 == 26
    # Long requests are still bounded by the step's budget, as before.
    long = plan_kv_cache(layout.layer_specs, 1 << 30, max_model_len=8192,
                         max_num_batched_tokens=2048, kv_sharing=layout.kv_sharing)
    page = long.config.large_page_bytes
    per = {g.spec.kind: page / g.blocks_per_large_page for g in long.config.groups}
    steady = 33 * per["sliding_window"] + 512 * per["full"]
    transient = 129 * per["sliding_window"]
    usable = (long.config.num_large_pages - 1) * page
    assert long.max_concurrency == pytest.approx((usable - transient) / steady)
