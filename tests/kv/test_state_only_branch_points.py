"""Branch points and checkpoint hits of models with no full-attention group (pure Mamba;
RecurrentGemma's sliding windows + state), against an oracle over token lists.

With full attention, its lookup tells a request how far it matched earlier requests (its
branch point, where it saves a state checkpoint for the next one). Without it, the state
manager remembers the hashes of computed blocks instead. For random
requests that share random prefixes, run one after another (look up, compute the prompt,
free):

    branch point  = the longest block-aligned common prefix with any earlier prompt
    checkpoints   = each earlier request's branch point and the block boundaries in its
                    prompt's last `tail` blocks of tokens, its end included
    hit           = the longest such checkpoint whose prefix the request starts with, short
                    of its last token
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kv.toy import BLOCK, admit, full, mamba, request, sliding, toy_manager


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@st.composite
def prompt_lists(draw: st.DrawFn) -> list[list[int]]:
    prompts: list[list[int]] = []
    for _ in range(draw(st.integers(2, 7))):
        prefix: list[int] = []
        if prompts and draw(st.booleans()):
            base = draw(st.sampled_from(prompts))
            prefix = base[:draw(st.integers(0, len(base)))]
        tail = draw(st.lists(st.integers(1, 3), min_size=1, max_size=14))
        prompts.append(prefix + tail)
    return prompts


@settings(max_examples=150, deadline=None)
@given(prompt_lists(), st.booleans(), st.integers(1, 3))
def test_branch_points_and_hits_match_the_oracle(prompts: list[list[int]],
                                                 with_window: bool, tail: int) -> None:
    # State alone (Mamba), or beside a sliding window (RecurrentGemma): no full-attention
    # group either way. Nothing is evicted, so a window before a checkpoint is cached too.
    specs = (sliding(8), mamba()) if with_window else (mamba(),)
    m = toy_manager(*specs, num_pages=800, checkpoint_tail=tail)
    state = m.managers[-1]
    checkpoints: set[tuple[int, ...]] = set()
    for i, tokens in enumerate(prompts):
        req = request(f"r{i}", tokens)
        earlier = prompts[:i]
        branch = max((min(common_prefix(p, tokens), len(p)) // BLOCK * BLOCK
                      for p in earlier), default=0)
        hit = max((c for c in range(0, len(tokens), BLOCK)
                   if tuple(tokens[:c]) in checkpoints), default=0)
        assert admit(m, req) == hit, f"request {i}"
        assert state.branch_points[req.request_id] == branch, f"request {i}"
        ends = range(BLOCK, len(tokens) + 1, BLOCK)
        for position in [p for p in ends if p >= len(tokens) - tail * BLOCK] + [branch]:
            if position:
                checkpoints.add(tuple(tokens[:position]))
        m.free(req)
        m.check_integrity()


def test_with_an_attention_group_the_state_group_remembers_nothing() -> None:
    m = toy_manager(full(), mamba(), num_pages=60)
    admit(m, request("a", list(range(1, 13))))
    assert m.managers[1].seen is None  # the attention lookup finds branch points


def test_the_remembered_hashes_are_bounded(monkeypatch) -> None:
    import hybridkv.kv.managers.mamba as mamba_manager

    monkeypatch.setattr(mamba_manager, "SEEN_CAPACITY", 3)
    m = toy_manager(mamba(), num_pages=60)
    tokens = list(range(1, 30))  # 7 full blocks
    admit(m, request("a", tokens))
    seen = m.managers[0].seen
    assert seen is not None and len(seen) == 3
    # The oldest blocks are forgotten: a request sharing only the first block finds nothing.
    b = request("b", tokens[:BLOCK] + [99] * 9)
    m.get_computed_blocks(b)
    assert m.managers[0].branch_points["b"] == 0
    m.check_integrity()
