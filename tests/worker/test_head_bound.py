"""The LM head's 8-bit greedy pre-pass (worker/head/bound.py): the kernel computes what
its copy holds (AVX2 and portable code alike), both error bounds hold for every logit, the
selection keeps exactly the tokens the bounds cannot rule out, and the argmax it returns is
the full logits' argmax (first id among equal values), on float heads and quantized ones of
every kind; in the engine, greedy tokens equal those of the full logits."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv.worker.head import bound as hb  # noqa: E402
from hybridkv.worker.head.bound import HeadBound, quantize_blocks, quantized_x  # noqa: E402
from hybridkv.worker.linear import quant as quant_linear  # noqa: E402
from hybridkv.worker.linear.quant import QuantizedWeight  # noqa: E402

if not quant_linear.available() or not hb.available():
    pytest.skip("no pre-pass kernel here (needs a C compiler and AVX2)",
                allow_module_level=True)

Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14


def hidden(n: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Rows with a few large channels, as a real model's final hidden states have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cols, generator=g)
    x[:, :: max(1, cols // 7)] *= 12.0
    return x


def float_head(vocab: int, cols: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, cols, generator=g) * 0.05


def quantized_head(qtype: int, vocab: int, cols: int) -> QuantizedWeight:
    """Random rows in `qtype` blocks (the tests' GGUF writer: gguf-py's quantizers, or
    random K-quant blocks with small scales)."""
    import gguf
    import numpy as np

    from tests.models.gguf_writer import _quantize

    raw = _quantize(float_head(vocab, cols).numpy(), gguf.GGMLQuantizationType(qtype),
                    np.random.default_rng(0))
    return QuantizedWeight.from_numpy(np.ascontiguousarray(raw), qtype, vocab, cols)


def head_and_bound(kind: str, vocab: int, cols: int) -> tuple[torch.Tensor, HeadBound]:
    if kind == "float":
        w = float_head(vocab, cols)
        bound = HeadBound.of_float(w)
    else:
        qtype = {"Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_1": Q4_1, "Q4_K": Q4_K, "Q6_K": Q6_K}[kind]
        qw = quantized_head(qtype, vocab, cols)
        w = quant_linear.dequantize(qw.data, qtype, cols)
        bound = HeadBound.of_quantized(qw)
    assert bound is not None
    return w, bound


@pytest.mark.parametrize("half_scales", [False, True])
def test_the_copy_holds_the_values_it_reports(half_scales):
    w = float_head(70, 96)
    w[3] = 0.0  # zero blocks: scale 0, values 0
    q, d, values = quantize_blocks(w, half_scales=half_scales)
    assert torch.equal(q.float().view(70, 3, 32) * d[:, :, None], values.view(70, 3, 32))
    assert (q[3] == 0).all() and (d[3] == 0).all()
    assert (w - values).abs().max() <= w.abs().max() / 127 * 0.51
    assert q.abs().max() == 127
    if half_scales:  # what the kernel reads: the scales are halves exactly
        assert torch.equal(d.to(torch.float16).to(torch.float32), d)


@pytest.mark.parametrize("rows", [1, 3])
def test_one_call_prepares_x_as_the_tensor_code_does(rows):
    """The C step that rounds x and measures its error: the same values and scales as
    quantize_blocks, the same error terms as error_terms (norms to float rounding)."""
    _, bound = head_and_bound("float", 40, 96)
    x = hidden(rows, 96, seed=7)
    x[0, 32:64] = 0.0  # a block of zeros: scale 0
    prepared = hb.prepare(x)
    assert prepared is not None
    q, d, terms = prepared
    q_ref, d_ref, values = quantize_blocks(x)
    assert torch.equal(q, q_ref) and torch.equal(d, d_ref)
    ref = bound.error_terms(x, values)
    for name in ("a", "b", "eb", "xb", "slack"):
        torch.testing.assert_close(getattr(terms, name), getattr(ref, name),
                                   rtol=1e-5, atol=1e-6)
    x[rows - 1, 7] = float("nan")
    assert hb.prepare(x) is None


def test_a_q8_0_head_keeps_its_own_values():
    w, bound = head_and_bound("Q8_0", 64, 64)
    assert bound.dnorm is None and bound.dblock is None  # no weight error at all
    torch.testing.assert_close(bound.wnorm, torch.linalg.vector_norm(w, dim=1))


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 70])
def test_the_kernel_computes_what_the_copy_and_x_hold(rows, portable):
    # 300 tokens: the last group of 8 is part padding; 70 rows: two calls' worth.
    w, bound = head_and_bound("float", 300, 96)
    x = hidden(rows, 96, seed=rows)
    wq = quantize_blocks(w, half_scales=True)[2]  # the head's copy: x's rounding, half scales
    hb.force_portable(portable)
    try:
        approx = bound.approx(x)
    finally:
        hb.force_portable(False)
    assert approx.shape == (rows, 304)
    torch.testing.assert_close(approx[:, :300], quantized_x(x) @ wq.T, rtol=1e-5, atol=1e-5)
    assert (approx[:, 300:] == 0).all()


@pytest.mark.parametrize("kind", ["float", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_every_logit_is_within_both_bounds(kind):
    cols = 256
    w, bound = head_and_bound(kind, 300, cols)
    x = hidden(9, cols)
    exact = x @ w.T
    err = (bound.approx(x)[:, :300] - exact).abs()
    whole, block = bounds(bound, x)
    assert (err <= whole).all() and (err <= block).all()
    assert (block <= whole * (1 + 1e-5)).all()  # the block bound is the tighter one
    assert err.max() > 0  # the pre-pass really is approximate


def bounds(bound: HeadBound, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, vocab]: each logit's whole-row and block bound, as HeadBound.error_terms states
    them."""
    t = bound.error_terms(x)
    whole = t.a[:, None] * bound.wnorm[None, :]
    block = t.eb @ bound.wblock.T + t.slack[:, None] * bound.wnorm[None, :]
    if bound.dnorm is not None:
        whole = whole + t.b[:, None] * bound.dnorm[None, :]
        block = block + t.xb @ bound.dblock.T + t.slack[:, None] * bound.dnorm[None, :]
    return whole, block


@pytest.mark.parametrize("k", [1, 3])
def test_the_selection_keeps_what_the_bounds_cannot_rule_out(k):
    # The oracle: the whole-row stage's k-th largest lower end over the vocabulary, then
    # the block bound's among the tokens that stage keeps.
    cols, vocab = 128, 3000
    w, bound = head_and_bound("float", vocab, cols)
    x = hidden(6, cols, seed=5)
    approx = bound.approx(x)[:, :vocab]
    whole, block = bounds(bound, x)
    found = bound.candidates(x, bound.approx(x), k)
    firsts = kepts = 0
    for r in range(x.shape[0]):
        first = approx[r] + whole[r] >= torch.topk(approx[r] - whole[r], k).values[-1]
        low = torch.where(first, approx[r] - block[r], float("-inf"))
        kept = first & (approx[r] + block[r] >= torch.topk(low, k).values[-1])
        assert torch.equal(found[r], torch.nonzero(kept).flatten())
        firsts, kepts = firsts + int(first.sum()), kepts + int(kept.sum())
    assert kepts < firsts  # the block bound rules out more


def test_heads_whose_rows_do_not_fit_get_no_pre_pass():
    assert HeadBound.of_float(torch.zeros(64, 40)) is None  # 40 columns: no 32-value blocks
    w = float_head(64, 32)
    w[5, :] = 3e38  # its norm overflows
    assert HeadBound.of_float(w) is None


@pytest.mark.parametrize("rows", [1, 3, 24, 70])
def test_the_argmax_is_the_full_logits_argmax(rows):
    cols, vocab = 128, 5000
    w = float_head(vocab, cols)
    x = hidden(rows, cols, seed=rows)
    # Row 0's best two tokens are equal: the first id wins, as torch.argmax takes it.
    w[4000] = w[17] = x[0] / x[0].norm() * 3
    for bound, head in [(HeadBound.of_float(w), w)]:
        ids, values = bound.top(x)
        full = x @ head.T
        assert torch.equal(ids[:, 0], torch.argmax(full, dim=1))
        assert ids[0, 0] == 17
        torch.testing.assert_close(values[:, 0], full.max(dim=1).values, rtol=1e-5,
                                   atol=1e-5)
        # The 8 best in order, equal values by id (as the blocked head's top-k keeps them).
        ids8, values8 = bound.top(x, 8)
        order = torch.sort(full, dim=1, descending=True, stable=True)
        assert torch.equal(ids8, order.indices[:, :8])
        assert ids8[0, 0] == 17 and ids8[0, 1] == 4000
        torch.testing.assert_close(values8, order.values[:, :8], rtol=1e-5, atol=1e-5)


def test_many_candidates_get_more_room(monkeypatch):
    # 300 equal rows: each is a candidate, over a first selection's room of 8.
    monkeypatch.setattr(hb, "_CAP", 8)
    cols = 64
    w = float_head(1000, cols)
    w[100:400] = w[100]
    x = w[100:101].clone() * 50
    bound = HeadBound.of_float(w)
    assert len(bound.candidates(x, bound.approx(x))[0]) >= 300
    ids, _ = bound.top(x)
    assert int(ids[0, 0]) == int(torch.argmax(x @ w.T, dim=1)[0]) == 100


def test_more_candidates_than_the_vocabulary():
    bound = HeadBound.of_float(float_head(5, 32))
    ids, values = bound.top(hidden(2, 32), 8)
    assert (ids[:, 5:] == -1).all() and torch.isinf(values[:, 5:]).all()
    assert sorted(ids[0, :5].tolist()) == [0, 1, 2, 3, 4]


def test_a_row_that_is_not_finite_is_left_to_the_full_logits():
    bound = HeadBound.of_float(float_head(100, 64))
    x = hidden(2, 64)
    x[1, 3] = float("nan")
    assert bound.top(x) is None


def test_greedy_tokens_in_the_engine_equal_the_full_logits(tmp_path, monkeypatch):
    from hybridkv import LLM, SamplingParams
    from hybridkv.models.base import CausalLM
    from tests.hooks import record_logits
    from tests.models.tiny import build_tiny_model

    monkeypatch.setattr(CausalLM, "HEAD_BOUND_WEIGHTS", 1)
    model_dir = build_tiny_model("llama", tmp_path, tie_word_embeddings=True)
    options = dict(dtype="float32", device="cpu", max_model_len=64, kv_cache_memory="4MiB",
                   linear_kernel="cpu")
    fast, slow = LLM(str(model_dir), **options), LLM(str(model_dir), **options)
    record_logits(slow)  # every step takes the full logits and the sampler
    bound = fast.engine.runner.model.head_bound
    assert bound is not None
    calls = []
    found = bound.head_candidates
    monkeypatch.setattr(bound, "head_candidates", lambda x, k, scale:
                        calls.append(x.shape[0]) or found(x, k, scale))
    prompts = [[5, 9, 17, 33, 65] * 4, [7] * 11, [3, 1, 4, 1, 5, 9, 2, 6]]
    params = SamplingParams(max_tokens=10)
    assert [o.token_ids for o in fast.generate(prompts, params)] == \
        [o.token_ids for o in slow.generate(prompts, params)]
    assert calls and max(calls) == 3


def test_a_quantized_head_with_a_row_that_is_not_finite_gets_no_pre_pass():
    qw = quantized_head(Q8_0, 64, 64)
    data = qw.data.clone()
    data[7, 0:2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # scale +inf (float16)
    assert HeadBound.of_quantized(QuantizedWeight(data, Q8_0, 64, 64)) is None
    assert HeadBound.of_quantized(qw) is not None
