"""Speculative decoding with the target's multi-token-prediction head (`speculative_config`
method mtp) on tiny random Qwen3.5 / Qwen3-Next checkpoints given `mtp.*` tensors in the
names the released checkpoints use: greedy tokens with drafts equal the tokens without,
under prefix hits, chunked prefill and preemption; the head is fed the target's hidden state
of every position (checked against transformers' last hidden state); a head built to predict
what the target predicts has every draft accepted; a model without MTP weights is refused
in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.worker.spec.draft_model import DRAFT_PREFIX  # noqa: E402
from hybridkv.worker.spec.mtp import MTPDrafter  # noqa: E402
from tests.engine.test_spec_decode import ALPHABET, GREEDY, PROMPTS, engine  # noqa: E402
from tests.engine.test_spec_decode import narrow_head as narrow  # noqa: E402
from tests.engine.test_spec_draft_model import (  # noqa: E402
    LONG,
    SHARED_PROMPTS,
    counts,
    under_pressure,
)
from tests.models import llamacpp_convert  # noqa: E402
from tests.models.llamacpp_convert import add_mtp_layer  # noqa: E402
from tests.models.tiny import build_tiny_model  # noqa: E402

MTP = {"method": "mtp", "num_speculative_tokens": 3}


def mtp_model(name: str, factory: pytest.TempPathFactory) -> Path:
    """A tiny model with the MTP block released checkpoints carry (`mtp.*`: fc, its norms,
    one decoder layer shaped as the model's full-attention layer 3), random."""
    model_dir = narrow(build_tiny_model(name, factory.mktemp(name + "_mtp")))
    add_mtp_layer(model_dir, source_layer=3)
    return model_dir


def check_equal_with_mtp(model_dir: Path, prompts: list[list[int]] = PROMPTS,
                         params: SamplingParams = GREEDY, **options: object
                         ) -> tuple[list, LLM]:
    plain = engine(model_dir, **options).generate(prompts, params)
    spec_llm = engine(model_dir, speculative_config=MTP, **options)
    spec = spec_llm.generate(prompts, params)
    for p, s in zip(plain, spec, strict=True):
        assert s.token_ids == p.token_ids
    spec_llm.engine.kv_manager.check_integrity()
    return spec, spec_llm


@pytest.mark.parametrize("name, options", [
    ("qwen3_5_text", {}), ("qwen3_next", {}), ("qwen3_5_text", {"kv_cache_dtype": "int8"}),
])
def test_greedy_equal_with_the_mtp_head(name, options, tmp_path_factory):
    spec, llm = check_equal_with_mtp(mtp_model(name, tmp_path_factory), **options)
    accepted, drafts = counts(spec)
    assert 0 < accepted < drafts, (accepted, drafts)  # some kept, some rejected
    # The head's attention is a layer of the plan, in the target's full-attention group.
    [group] = [g for g in llm.engine.plan.config.groups if not g.spec.is_state]
    assert group.layer_names == ("model.layers.3.self_attn",
                                 DRAFT_PREFIX + "mtp.layers.0.self_attn")


def test_with_prefix_hits_chunked_prefill_and_preemption(tmp_path_factory):
    model_dir = mtp_model("qwen3_5_text", tmp_path_factory)
    spec, llm = check_equal_with_mtp(model_dir, SHARED_PROMPTS, LONG,
                                     **under_pressure(model_dir, 1.3))
    assert set(spec[0].token_ids[:4]) == set(ALPHABET)  # (the cycle)
    assert sum(s.num_cached_tokens for s in spec) > 0
    assert llm.engine.scheduler.num_preemptions > 0
    accepted, drafts = counts(spec)
    assert 0 < accepted < drafts, (accepted, drafts)


def recording(llm: LLM) -> list[tuple[str, list[int], list[int], torch.Tensor]]:
    """Every catch-up batch the head is fed with the target's hidden states: (request,
    positions, token ids, hidden rows), per request."""
    drafter = llm.engine.runner.draft  # type: ignore[attr-defined]
    assert isinstance(drafter, MTPDrafter)
    fed: list[tuple[str, list[int], list[int], torch.Tensor]] = []
    forward, step_done = drafter._forward, drafter.step_done
    catching_up = [False]

    def done(runner, result):
        catching_up[0] = True
        try:
            step_done(runner, result)
        finally:
            catching_up[0] = False

    def spy(runner, inputs, *extra):
        if catching_up[0]:  # (not the drafts: those are fed the head's own output)
            loc = inputs.query_start_loc
            for i, rid in enumerate(inputs.scheduled):
                fed.append((rid, inputs.positions[loc[i]:loc[i + 1]],
                            inputs.input_ids[loc[i]:loc[i + 1]], extra[0][loc[i]:loc[i + 1]]))
        return forward(runner, inputs, *extra)

    drafter._forward = spy  # type: ignore[method-assign]
    drafter.step_done = done  # type: ignore[method-assign]
    return fed


def test_the_head_reads_the_target_hidden_state_of_every_position(tmp_path_factory):
    # At each position p the head gets the target's final hidden state there (after its
    # final norm, as vLLM feeds it) and token p + 1: checked against transformers' forward
    # over each request's whole sequence, under hits, chunks, preemption and replays.
    import transformers

    model_dir = mtp_model("qwen3_5_text", tmp_path_factory)
    llm = engine(model_dir, speculative_config=MTP, **under_pressure(model_dir, 1.3))
    fed = recording(llm)
    ids = [f"r{i}" for i in range(len(SHARED_PROMPTS))]
    for rid, prompt in zip(ids, SHARED_PROMPTS, strict=True):
        llm.engine.add_request(rid, prompt, LONG)
    tokens = {rid: list(p) for rid, p in zip(ids, SHARED_PROMPTS, strict=True)}
    while llm.engine.has_unfinished:
        for out in llm.engine.step():
            tokens[out.request_id] = out.prompt_token_ids + out.token_ids
    assert llm.engine.scheduler.num_preemptions > 0
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    final: dict[tuple[str, int], tuple[int, torch.Tensor]] = {}  # the latest feed wins
    for rid, positions, token_ids, rows in fed:
        for p, t, row in zip(positions, token_ids, rows, strict=True):
            final[(rid, p)] = (t, row)
    firsts = []
    for rid, seq in tokens.items():
        with torch.no_grad():
            want = reference.model(torch.tensor([seq])).last_hidden_state[0]
        positions = sorted(p for r, p in final if r == rid)
        # Every position from the request's prefix hit on (the request that computed the
        # hit's blocks fed the head there: their pages are in the blocks).
        firsts.append(positions[0])
        assert positions == list(range(positions[0], len(seq) - 1))
        assert positions[0] % 16 == 0
        for p in positions:
            token, row = final[(rid, p)]
            assert token == seq[p + 1]
            torch.testing.assert_close(row, want[p], atol=2e-4, rtol=2e-4)
    assert 0 in firsts and max(firsts) > 0  # (a prefix hit)


def bigram(model_dir: Path) -> Path:
    """The target's layers all add nothing (their output projections zeroed): its token
    after t depends on t alone, through final_norm(embed(t)) and the head. An MTP head of
    fc = [I | 0], plain pre-norm, zeroed layer and the target's final norm computes that
    same state for its input token p + 1, so it predicts what the target will: every draft
    must be kept (one fed a wrong token or position would not be)."""
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    for name, tensor in tensors.items():
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            tensor.zero_()
    # The head picks the alphabet's next letter, cyclically (40 -> 41 -> 42 -> 43 -> 40):
    # its row of token b is the final state of the letter before b, and the letters'
    # embeddings are near orthogonal. (A fixed point would hide a head fed the wrong token.)
    embed, norm = tensors["model.embed_tokens.weight"], tensors["model.norm.weight"]
    head = tensors["lm_head.weight"]
    head.zero_()
    for a, b in zip(ALPHABET, ALPHABET[1:] + ALPHABET[:1], strict=True):
        head[b] = torch.nn.functional.rms_norm(embed[a], (embed.shape[1],), eps=1e-6) * (1 + norm)
    hidden = norm.shape[0]
    tensors["mtp.fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
    tensors["mtp.pre_fc_norm_embedding.weight"].zero_()
    tensors["mtp.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
    return model_dir


def test_a_head_that_predicts_the_target_keeps_every_draft(tmp_path_factory):
    model_dir = bigram(mtp_model("qwen3_5_text", tmp_path_factory))
    spec, llm = check_equal_with_mtp(model_dir, SHARED_PROMPTS, LONG,
                                     **under_pressure(model_dir, 1.3))
    assert set(spec[0].token_ids[:4]) == set(ALPHABET)  # (the cycle)
    assert sum(s.num_cached_tokens for s in spec) > 0
    assert llm.engine.scheduler.num_preemptions > 0
    accepted, drafts = counts(spec)
    assert drafts > 0 and accepted == drafts, (accepted, drafts)


def test_mtp_without_mtp_weights_fails_in_one_line(tmp_path):
    plain = build_tiny_model("qwen3_5_text", tmp_path / "plain")
    llama = build_tiny_model("llama", tmp_path / "llama")
    with_head = build_tiny_model("qwen3_5_text", tmp_path / "head")
    add_mtp_layer(with_head, source_layer=3)
    for model_dir, config, message in [
        (plain, MTP, "has no multi-token-prediction weights (no mtp.* tensors"),
        (llama, MTP, "is llama; multi-token-prediction heads run for qwen3_next"),
        (with_head, {**MTP, "model": str(llama)},
         "speculative_config model applies to method 'draft_model', not 'mtp'"),
    ]:
        with pytest.raises(ValueError) as e:
            engine(model_dir, speculative_config=config)
        assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="kv_cache_dtype 'q4' is not supported with an MTP"):
        engine(with_head, speculative_config=MTP, kv_cache_dtype="q4")


def drafted(llm: LLM, prompts: list[list[int]]) -> list[tuple[str, list[int]]]:
    """The drafts the head makes over `prompts`, per step and request, in order."""
    drafter = llm.engine.runner.draft  # type: ignore[attr-defined]
    made: list[tuple[str, list[int]]] = []
    propose = drafter.propose

    def spy(runner, out):
        drafts = propose(runner, out)
        made.extend(sorted(drafts.items()))
        return drafts

    drafter.propose = spy  # type: ignore[method-assign]
    llm.generate(prompts, GREEDY)
    return made


@pytest.mark.skipif(not llamacpp_convert.available(), reason="no llama.cpp source here")
@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_next"])
def test_the_head_loads_from_a_converter_written_gguf(name, tmp_path):
    # llama.cpp's converter writes the block as layer 4's nextn tensors (norms + 1, the
    # MoE's experts stacked): the head read from the f32 file drafts what the one read
    # from the directory drafts; from q8_0 blocks it drafts in exact greedy decoding.
    model_dir = build_tiny_model(name, tmp_path / "hf")
    llamacpp_convert.write_byte_tokenizer(model_dir)
    add_mtp_layer(narrow(model_dir), source_layer=3)
    from_dir = drafted(engine(model_dir, speculative_config=MTP), PROMPTS)
    f32 = llamacpp_convert.convert(model_dir, tmp_path / "f32.gguf", "f32")
    assert drafted(engine(f32, speculative_config=MTP), PROMPTS) == from_dir
    assert sum(len(d) for _, d in from_dir) > 0
    q8 = llamacpp_convert.convert(model_dir, tmp_path / "q8.gguf", "q8_0")
    spec, _ = check_equal_with_mtp(q8)
    accepted, drafts = counts(spec)
    assert 0 < accepted < drafts, (accepted, drafts)


def test_mtp_on_a_gguf_without_nextn_tensors_fails_in_one_line(tmp_path):
    if not llamacpp_convert.available():
        pytest.skip("no llama.cpp source here")
    model_dir = build_tiny_model("qwen3_5_text", tmp_path / "hf")
    llamacpp_convert.write_byte_tokenizer(model_dir)
    add_mtp_layer(model_dir, source_layer=3)
    path = llamacpp_convert.convert(model_dir, tmp_path / "m.gguf", "f32", "--no-mtp")
    with pytest.raises(ValueError) as e:
        engine(path, speculative_config=MTP)
    assert "has no multi-token-prediction weights (no nextn tensors" in str(e.value)
    assert "\n" not in str(e.value)
