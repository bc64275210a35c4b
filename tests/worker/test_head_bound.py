"""The LM head's 8-bit greedy pre-pass (worker/head_bound.py): the error bound holds for
every logit, and the argmax it returns is the full logits' argmax (first id among equal
values), on float heads (through their Q8_0 copy) and quantized heads read as they are;
in the engine, greedy tokens equal those of the full logits."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv.worker import head_bound as hb  # noqa: E402
from hybridkv.worker import quant_linear  # noqa: E402
from hybridkv.worker.head_bound import HeadBound, quantize_q8_0, quantized_x  # noqa: E402
from hybridkv.worker.quant_linear import QuantizedWeight  # noqa: E402

if not quant_linear.available() or not hb._int_rows(hb.Q8_0):
    pytest.skip("no integer kernel here (needs a C compiler and AVX2)",
                allow_module_level=True)

Q4_0, Q6_K = 2, 14


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


def test_q8_0_copy_holds_the_values_it_reports():
    w = float_head(70, 96)
    w[3] = 0.0  # a zero block: scale 0, values 0
    blocks, values = quantize_q8_0(w)
    assert torch.equal(quant_linear.dequantize(blocks, hb.Q8_0, 96), values)
    assert (w - values).abs().max() <= w.abs().max() / 127 * 0.51


def test_the_kernel_reads_x_as_quantized_x_says():
    # An identity head: each logit is one value of x as the kernel rounded it.
    cols = 64
    blocks, values = quantize_q8_0(torch.eye(cols))
    x = hidden(5, cols)
    out = torch.empty(5, cols)
    quant_linear.library().hkv_quant_matmul_int8(
        x.data_ptr(), 5, cols, blocks.data_ptr(), blocks.stride(0), hb.Q8_0, cols, cols,
        out.data_ptr(), cols)
    torch.testing.assert_close(out, quantized_x(x) * values.diagonal(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["float", "Q8_0", "Q4_0", "Q6_K"])
def test_every_logit_is_within_its_bound(kind):
    cols = 256
    if kind == "float":
        w = float_head(300, cols)
        bound = HeadBound.of_float(w)
    else:
        qw = quantized_head({"Q8_0": hb.Q8_0, "Q4_0": Q4_0, "Q6_K": Q6_K}[kind], 300, cols)
        w = quant_linear.dequantize(qw.data, qw.qtype, cols)
        bound = HeadBound.of_quantized(qw)
    assert bound is not None
    x = hidden(9, cols)
    exact = x @ w.T
    approx = bound.approx(x)
    a, b = bound.error_terms(x)
    limit = a[:, None] * bound.wnorm[None, :]
    if bound.dnorm is not None:
        limit = limit + b[:, None] * bound.dnorm[None, :]
    err = (approx - exact).abs()
    assert (err <= limit).all()
    assert err.max() > 0  # the pre-pass really is approximate


def test_heads_with_a_min_get_no_pre_pass():
    assert HeadBound.of_quantized(quantized_head(3, 64, 64)) is None  # Q4_1
    assert HeadBound.of_float(torch.zeros(64, 40)) is None  # 40 columns: no Q8_0 rows


@pytest.mark.parametrize("rows", [1, 3, 24])
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


def test_a_head_past_float16_scales_gets_no_copy():
    w = float_head(64, 32)
    w[5, 3] = 1e7  # a scale of 1e7 / 127 overflows float16
    assert HeadBound.of_float(w) is None


def test_a_quantized_head_with_a_row_that_is_not_finite_gets_no_pre_pass():
    qw = quantized_head(hb.Q8_0, 64, 64)
    data = qw.data.clone()
    data[7, 0:2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # scale +inf (float16)
    assert HeadBound.of_quantized(QuantizedWeight(data, hb.Q8_0, 64, 64)) is None
    assert HeadBound.of_quantized(qw) is not None
