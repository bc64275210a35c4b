"""A model's last layers computed for the sampled rows only (CausalLM._cut_layer): the last
attention layer still writes every token's K/V, and its attention, o_proj and MLP, and any
per-row layers after it, run for the rows whose logits are read. Against the same engine
with the cut off: the same tokens and logits, in steps that mix a prompt's last chunk, a
chunk that samples nothing and decodes; and where the cut must not happen (a state mixer
last, q4 pages) every row goes on."""

from __future__ import annotations

import pytest
import torch

from hybridkv import LLM, SamplingParams
from hybridkv.models.base import CausalLM
from tests.hooks import record_logits
from tests.models.tiny import build_tiny_model

# name: (architecture, config overrides, LLM options, whether the last layer cuts)
CASES = {
    "llama": ("llama", {}, {}, True),
    # Windows of 16 under 40-token prompts, q/k and sandwich norms, a soft-capped head.
    "gemma3": ("gemma3", dict(sliding_window=16), {}, True),
    "llama_int8_pages": ("llama", {}, dict(kv_cache_dtype="int8"), True),
    # q4 pages keep a layer call's full-precision keys: the layer runs whole.
    "llama_q4_pages": ("llama", {}, dict(kv_cache_dtype="q4"), False),
    # NemotronH: attention, then an MLP layer on the cut rows.
    "nemotron_h_attention_mlp": ("nemotron_h", dict(num_hidden_layers=4,
                                                    hybrid_override_pattern="M-*-"), {}, True),
    # A Mamba mixer is the last to mix tokens: the cut starts at the MLP after it.
    "nemotron_h_mamba_mlp": ("nemotron_h", dict(num_hidden_layers=4,
                                                hybrid_override_pattern="*-M-"), {}, True),
}
PROMPTS = [[(7 * i + 3 * j) % 90 + 5 for j in range(n)] for i, n in enumerate((40, 9, 27))]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    arch, overrides, options, cuts = CASES[request.param]
    model_dir = build_tiny_model(arch, tmp_path_factory.mktemp(request.param), **overrides)
    # 16 tokens a step: the 40-token prompt's first chunks sample nothing, and later steps
    # mix its last chunk with the others' decodes.
    llm = LLM(str(model_dir), dtype="float32", enable_prefix_caching=False,
              max_num_batched_tokens=16, max_num_seqs=4, **options)
    yield llm, cuts
    llm.close()


def _generate(llm, cut: bool, monkeypatch) -> tuple[list[list[int]], list[torch.Tensor], int]:
    """(tokens, logits per prompt, steps whose last layers ran on the sampled rows only)."""
    calls = []
    cut_rows = CausalLM._cut_rows

    def counted(*args):
        out = cut_rows(*args)
        calls.append(out is not None)
        return out

    with monkeypatch.context() as m:
        m.setattr(CausalLM, "_cut_rows", staticmethod(counted))
        if not cut:
            m.setattr(CausalLM, "_cut_layer", property(lambda self: None))
        logits = record_logits(llm)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6,
                                                   ignore_eos=True), use_tqdm=False)
    return ([o.token_ids for o in outs], [torch.stack(logits[o.request_id]) for o in outs],
            sum(calls))


def test_the_last_layer_on_sampled_rows_equals_the_whole_layer(case, monkeypatch):
    llm, cuts = case
    tokens, logits, cut_steps = _generate(llm, True, monkeypatch)
    ref_tokens, ref_logits, ref_cut_steps = _generate(llm, False, monkeypatch)
    assert ref_cut_steps == 0
    # Prefill steps only (a pure decode step has no row to cut): at least the 40-token
    # prompt's three chunks.
    assert (cut_steps >= 3) if cuts else cut_steps == 0
    assert tokens == ref_tokens
    for got, want in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_state_mixer_last_keeps_every_row(tmp_path):
    """NemotronH's pattern ending in a Mamba mixer: no layer may cut."""
    model_dir = build_tiny_model("nemotron_h", tmp_path)  # "M*M-M"
    with LLM(str(model_dir), dtype="float32") as llm:
        assert llm.engine.runner.model._cut_layer is None
