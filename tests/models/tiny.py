"""Tiny random Hugging Face models, built and saved by the tests themselves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=256, max_position_embeddings=512, initializer_range=0.1,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=None, pad_token_id=0)

ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name: (config class, model class, overrides)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=2)),
    "qwen3_swa": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_hidden_layers=2,
                                                            sliding_window=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_hidden_layers=4, sliding_window=16, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, query_pre_attn_scalar=16)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=6, sliding_window=16, sliding_window_pattern=3,
        query_pre_attn_scalar=16)),
    # gpt-oss keeps its default YaRN RoPE; 4 experts, top-2.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_hidden_layers=4, sliding_window=16, num_local_experts=4, num_experts_per_tok=2)),
    # Chunks of 16 on RoPE layers, every 4th layer NoPE/global, MoE on every other layer.
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        num_hidden_layers=4, attention_chunk_size=16, intermediate_size_mlp=128,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
        floor_scale=8)),
}


PERTURB_CONSTANTS = {"gemma3n", "gemma4_text"}
# Per architecture, what to set after the noise that it cannot give (integer tables).
INIT_HOOKS: dict[str, Any] = {}


def build_tiny_model(name: str, out_dir: Path, **extra: Any) -> Path:
    """Save a tiny random model of architecture `name` (seeded) to `out_dir`; `extra`
    overrides config fields."""
    import torch
    import transformers

    config_cls, model_cls, overrides = ARCHS[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    if name in PERTURB_CONSTANTS:
        # Weights that start constant (norm scales of 1, AltUp's output scale of 0 that
        # would switch per-layer inputs off, layer scalars) get noise, so that a model that
        # ignored them could not agree with transformers by luck.
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for tensor in model.state_dict().values():
                if tensor.is_floating_point() and bool((tensor == tensor.flatten()[0]).all()):
                    tensor.add_(0.1 * torch.randn(tensor.shape, generator=gen))
    if name in INIT_HOOKS:
        with torch.no_grad():
            INIT_HOOKS[name](model)
    model.generation_config.eos_token_id = None
    model.save_pretrained(out_dir)
    return out_dir

# NemotronH: Mamba2, attention (no RoPE), relu² MLP; 2 groups of 4 heads in the mixer.
ARCHS["nemotron_h"] = ("NemotronHConfig", "NemotronHForCausalLM", dict(
    num_hidden_layers=5, hybrid_override_pattern="M*M-M", mamba_num_heads=8,
    mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16))

# Bamba: Mamba2 + attention with RoPE on half of each head, SwiGLU after every mixer.
ARCHS["bamba"] = ("BambaConfig", "BambaForCausalLM", dict(
    num_hidden_layers=4, attn_layer_indices=[1, 3], mamba_n_heads=8, mamba_d_head=16,
    mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=16))

# Granite 4.0-H: Mamba2 + NoPE attention, top-2 of 4 experts + shared MLP, µP multipliers.
ARCHS["granitemoehybrid"] = ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
    num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"],
    intermediate_size=32, shared_intermediate_size=64, mamba_n_heads=8, mamba_d_head=16,
    mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=16, num_local_experts=4,
    num_experts_per_tok=2, embedding_multiplier=2.0, attention_multiplier=0.3,
    residual_multiplier=0.5, logits_scaling=4.0))

# Jamba: Mamba1 + attention (no positions) every 2nd layer, MoE (top-2 of 4) every 2nd layer.
ARCHS["jamba"] = ("JambaConfig", "JambaForCausalLM", dict(
    num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
    expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=16,
    mamba_dt_rank=8, use_mamba_kernels=False))

# Falcon-H1: attention and Mamba2 in parallel in every layer; non-trivial µP multipliers.
ARCHS["falcon_h1"] = ("FalconH1Config", "FalconH1ForCausalLM", dict(
    num_hidden_layers=3, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16,
    mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=16,
    ssm_multipliers=[1.5, 0.5, 1.2, 0.8, 1.1], mlp_multipliers=[0.7, 1.3],
    key_multiplier=0.9, attention_in_multiplier=1.1, attention_out_multiplier=0.8,
    ssm_in_multiplier=1.2, ssm_out_multiplier=0.6, embedding_multiplier=2.0,
    lm_head_multiplier=0.5))

# Qwen3-Next: 3 Gated DeltaNet layers (2 key heads, 4 value heads) + 1 gated attention layer,
# MoE (top-2 of 4) with a shared expert everywhere.
ARCHS["qwen3_next"] = ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
    num_hidden_layers=4, full_attention_interval=4, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2))

# Gemma 3n: 3 sliding + 1 full layers writing KV, then 4 layers reading layers 2 (sliding)
# and 3 (full); AltUp over 4 copies, Laurel rank 8, per-layer inputs of 8 (a per-layer
# vocabulary smaller than the main one), sparse MLP gates in the first two layers.
ARCHS["gemma3n"] = ("Gemma3nTextConfig", "Gemma3nForCausalLM", dict(
    num_hidden_layers=8, sliding_window=16, num_kv_shared_layers=4,
    layer_types=["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3
    + ["full_attention"], hidden_size_per_layer_input=8, vocab_size_per_layer_input=200,
    laurel_rank=8, altup_num_inputs=4, activation_sparsity_pattern=[0.95, 0.95] + [0.0] * 6,
    final_logit_softcapping=30.0))

# Gemma 4: 3 sliding + 1 full layers writing KV (full layers: head size 32, one KV head,
# values = keys, proportional RoPE on a quarter of the angles), then 4 layers reading them
# with double-width MLPs; an MoE block (top-2 of 4) beside every MLP; per-layer inputs of 8.
ARCHS["gemma4_text"] = ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
    num_hidden_layers=8, sliding_window=16, num_kv_shared_layers=4,
    layer_types=["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3
    + ["full_attention"], global_head_dim=32, num_global_key_value_heads=1,
    attention_k_eq_v=True, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=256, enable_moe_block=True, num_experts=4, top_k_experts=2,
    moe_intermediate_size=32, final_logit_softcapping=30.0))


def planner_minimum(model_dir: Path, *, max_model_len: int, batch: int,
                    caching: bool = True, kv_cache_dtype: str = "auto",
                    kv_sharing: bool = False, checkpoint_tail: int | None = None) -> int:
    """The smallest KV budget (to 1 KiB) the planner accepts for a saved model: tests that
    want memory pressure scale it. `kv_cache_dtype`: its pages so stored; `kv_sharing`:
    layers reading another's KV own no pages (as the engine plans them);
    `checkpoint_tail`: state checkpoints at a prompt's end (None: the engine's default)."""
    from hybridkv.kv.cache_dtype import apply_cache_dtype
    from hybridkv.kv.plan import plan_kv_cache
    from hybridkv.models.layer_mix import kv_layout_from_config, load_hf_config

    layout = kv_layout_from_config(load_hf_config(str(model_dir)), kv_dtype="float32")
    specs = apply_cache_dtype(layout.layer_specs, kv_cache_dtype)
    for kib in range(1, 4096):
        try:
            plan_kv_cache(specs, kib * 1024, max_model_len=max_model_len,
                          max_num_batched_tokens=batch, enable_caching=caching,
                          kv_sharing=layout.kv_sharing if kv_sharing else None,
                          **({} if checkpoint_tail is None else
                             {"checkpoint_tail": checkpoint_tail}))
        except ValueError:
            continue
        return kib * 1024
    raise AssertionError("no budget up to 4 MiB plans")

# ---- issue 16: sliding + full attention families, dense and MoE decoders (add below) ----

# Mixtral: top-2 of 4 experts (checkpoint names block_sparse_moe / w1 w2 w3), all sliding.
ARCHS["mixtral"] = ("MixtralConfig", "MixtralForCausalLM", dict(
    num_hidden_layers=2, sliding_window=16, num_local_experts=4, num_experts_per_tok=2))

# Qwen2: q/k/v biases, no o_proj bias; the top 2 of 4 layers slide (max_window_layers).
ARCHS["qwen2"] = ("Qwen2Config", "Qwen2ForCausalLM", dict(
    num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2))

# Qwen2-MoE: top-2 of 4 experts + gated shared expert; layer 1 is a dense MLP.
ARCHS["qwen2_moe"] = ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
    num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, mlp_only_layers=[1]))

# Qwen3-MoE: q/k norms, top-2 of 4 experts renormalised, every layer sliding.
ARCHS["qwen3_moe"] = ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
    num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    norm_topk_prob=True, use_sliding_window=True, sliding_window=16))

# Windows placed by max_window_layers < num_hidden_layers, as each family places them: Qwen3-MoE
# ignores it (every layer slides); Qwen2-MoE slides the even layers below it (0 and 2 here).
ARCHS["qwen3_moe_swa"] = ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
    ARCHS["qwen3_moe"][2], num_hidden_layers=4, max_window_layers=2))
ARCHS["qwen2_moe_swa"] = ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
    ARCHS["qwen2_moe"][2], num_hidden_layers=4, use_sliding_window=True, sliding_window=16,
    max_window_layers=3))

# Phi-3: fused qkv_proj and gate_up_proj, RoPE on half of each head, every layer sliding.
ARCHS["phi3"] = ("Phi3Config", "Phi3ForCausalLM", dict(
    num_hidden_layers=2, sliding_window=16, partial_rotary_factor=0.5))

# StarCoder 2: biased LayerNorms, c_fc/c_proj MLP with biases, every layer sliding.
ARCHS["starcoder2"] = ("Starcoder2Config", "Starcoder2ForCausalLM", dict(
    num_hidden_layers=2, sliding_window=16))

# PhiMoE: biased LayerNorms, SparseMixer top-2 of 4 experts, attention and lm_head biases.
ARCHS["phimoe"] = ("PhimoeConfig", "PhimoeForCausalLM", dict(
    num_hidden_layers=2, sliding_window=16, num_local_experts=4, attention_bias=True,
    lm_head_bias=True, router_jitter_noise=0.3))

# Ministral: Mistral with a per-layer mix of sliding and full layers.
ARCHS["ministral"] = ("MinistralConfig", "MinistralForCausalLM", dict(
    num_hidden_layers=4, sliding_window=16,
    layer_types=["sliding_attention", "full_attention"] * 2))

# SmolLM3: layers 1 and 3 without RoPE (no_rope_layers), and those slide.
ARCHS["smollm3"] = ("SmolLM3Config", "SmolLM3ForCausalLM", dict(
    num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0], use_sliding_window=True,
    sliding_window=16))

# Cohere 2: 3 sliding layers (pairwise RoPE) + 1 NoPE full layer, parallel blocks, tied
# embedding scaled logits.
ARCHS["cohere2"] = ("Cohere2Config", "Cohere2ForCausalLM", dict(
    num_hidden_layers=4, sliding_window=16, tie_word_embeddings=True, logit_scale=0.5))

# EXAONE 4: post-norms, per-head q/k norms, 3 sliding layers + 1 NoPE full layer.
ARCHS["exaone4"] = ("Exaone4Config", "Exaone4ForCausalLM", dict(
    num_hidden_layers=4, sliding_window=16, sliding_window_pattern=4))

# OLMo 3: post-norms, q/k norms over all heads, RoPE per layer type (3 sliding + 1 full).
ARCHS["olmo3"] = ("Olmo3Config", "Olmo3ForCausalLM", dict(
    num_hidden_layers=4, sliding_window=16, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 500000.0}}))

# Granite SWA: per-head sinks, a RoPE base per layer (layer 0 NoPE), µP multipliers.
GRANITE_SWA: dict[str, Any] = dict(
    num_hidden_layers=4, sliding_window=16, layer_rope_theta=[0.0, 10000.0, 10000.0, 50000.0],
    embedding_multiplier=2.0, attention_multiplier=0.3, residual_multiplier=0.5,
    logits_scaling=4.0)
ARCHS["granite_swa"] = ("GraniteSWAConfig", "GraniteSWAForCausalLM", GRANITE_SWA)

# Granite MoE SWA: the same, with top-2 of 4 stacked experts and a shared MLP.
ARCHS["granitemoe_swa"] = ("GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM", dict(
    GRANITE_SWA, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
    shared_intermediate_size=48))

# VaultGemma: Gemma 2 without the post-sublayer norms; alternating sliding / full layers.
ARCHS["vaultgemma"] = ("VaultGemmaConfig", "VaultGemmaForCausalLM", dict(
    num_hidden_layers=4, sliding_window=16, query_pre_attn_scalar=16))

# Ministral 3: YaRN RoPE, queries scaled up with position past a (tiny) original length of
# 16, every layer sliding.
ARCHS["ministral3"] = ("Ministral3Config", "Ministral3ForCausalLM", dict(
    num_hidden_layers=2, sliding_window=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
        "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}))

# dots.llm1: layer 0 dense, then top-2 of 8 experts in 4 groups (2 groups kept) with a
# correction bias, plus a shared expert; 2 sliding + 1 full layers.
ARCHS["dots1"] = ("Dots1Config", "Dots1ForCausalLM", dict(
    num_hidden_layers=3, sliding_window=16,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
    moe_intermediate_size=32, first_k_dense_replace=1, norm_topk_prob=True,
    routed_scaling_factor=2.5))

# EXAONE MoE: layer 0 dense, then grouped routed experts + a shared one; 3 sliding layers
# and a NoPE full one.
ARCHS["exaone_moe"] = ("ExaoneMoeConfig", "ExaoneMoeForCausalLM", dict(
    num_hidden_layers=4, sliding_window=16, num_experts=8, num_experts_per_tok=2, n_group=2,
    topk_group=1, num_shared_experts=1, moe_intermediate_size=32))
# Their routers' correction biases start at zero: noise makes them matter.
PERTURB_CONSTANTS.update({"dots1", "exaone_moe"})

# Cohere 2 MoE: a dense full layer with RoPE (prefix pattern 1), then 2 sliding + 1 NoPE full
# layers of top-2 of 4 experts (sigmoid, renormalised) averaged with a shared expert.
ARCHS["cohere2_moe"] = ("Cohere2MoeConfig", "Cohere2MoeForCausalLM", dict(
    num_hidden_layers=4, sliding_window=16, sliding_window_pattern=3, first_k_dense_replace=1,
    num_experts=4, num_experts_per_tok=2, num_shared_experts=1, expert_selection_fn="sigmoid",
    intermediate_size=32, prefix_dense_intermediate_size=96, logit_scale=0.5))

# AFMoE: 3 sliding layers (RoPE) + 1 NoPE full layer, output-gated attention, sandwich norms,
# layer 0 dense, then top-2 of 4 experts (sigmoid, bias-steered) + a shared expert; µP.
ARCHS["afmoe"] = ("AfmoeConfig", "AfmoeForCausalLM", dict(
    num_hidden_layers=4, sliding_window=16, num_experts=4, num_experts_per_tok=2,
    num_shared_experts=1, moe_intermediate_size=32, route_scale=1.5, mup_enabled=True))
PERTURB_CONSTANTS.add("afmoe")

# Gemma 4 unified text: Gemma 4's attention (full layers: head size 32 via per_layer_config,
# proportional RoPE) with plain MLPs; 2 sliding + 1 full layers writing KV, then 3 reading it
# with double-width MLPs.
ARCHS["gemma4_unified_text"] = ("Gemma4UnifiedTextConfig", "Gemma4UnifiedForCausalLM", dict(
    num_hidden_layers=6, sliding_window=16, global_head_dim=32, num_kv_shared_layers=3,
    layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
    + ["full_attention"], use_double_wide_mlp=True, final_logit_softcapping=30.0))
PERTURB_CONSTANTS.add("gemma4_unified_text")

# MiMo-V2-Flash: 1 full + 3 sliding layers; sliding layers with 4 KV heads (full: 2) and
# sinks; keys 32 wide, values 16 (scaled); RoPE on half of each head, a base per layer type;
# layer 0 dense, then top-2 of 8 grouped experts.
ARCHS["mimo_v2_flash"] = ("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", dict(
    num_hidden_layers=4, sliding_window=16, num_attention_heads=4, head_dim=32, v_head_dim=16,
    attention_value_scale=0.7, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
    topk_group=1, moe_intermediate_size=32, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 500000.0,
                           "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.5}}))
PERTURB_CONSTANTS.add("mimo_v2_flash")

# ---- issue 16: linear attention, SSM, convolution and recurrence families (add below) ----

# Qwen3.5: Qwen3-Next's mix with the DeltaNet projections stored apart; dense MLPs.
ARCHS["qwen3_5_text"] = ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
    num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16))

# Qwen3.5 MoE: top-2 of 4 experts with a gated shared expert in every layer.
ARCHS["qwen3_5_moe_text"] = ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
    num_hidden_layers=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2))

# Pure SSMs (no attention group at all). Mamba: 2 Mamba1 layers, dt rank 8.
ARCHS["mamba"] = ("MambaConfig", "MambaForCausalLM", dict(
    num_hidden_layers=2, state_size=16, time_step_rank=8, use_associative_scan=False))

# Falcon-Mamba: Mamba1 with weightless RMS norms on dt, B and C. Like Falcon-Mamba-7B's
# config, `expand` disagrees with the saved intermediate_size (128), which wins.
ARCHS["falcon_mamba"] = ("FalconMambaConfig", "FalconMambaForCausalLM", dict(
    num_hidden_layers=2, state_size=16, time_step_rank=8, use_associative_scan=False,
    expand=4))

# Mamba2: 8 heads of 16 in 2 groups, chunks of 16.
ARCHS["mamba2"] = ("Mamba2Config", "Mamba2ForCausalLM", dict(
    num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16, n_groups=2,
    chunk_size=16))

# LFM2: short convolutions (kernel 3) with attention on layers 1 and 3; the MLP width is
# adjusted from intermediate_size (2/3, rounded up to a multiple of 32).
ARCHS["lfm2"] = ("Lfm2Config", "Lfm2ForCausalLM", dict(
    num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"],
    conv_L_cache=3, block_multiple_of=32))

# LFM2-MoE: a dense first layer, then top-2 of 4 experts chosen by sigmoid scores plus a
# selection bias (perturbed from its zero start, so that ignoring it could not pass).
ARCHS["lfm2_moe"] = ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(
    num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3,
    num_dense_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    routed_scaling_factor=1.5))
PERTURB_CONSTANTS.add("lfm2_moe")

# LFM3: conv layers with a full (layer 2) and a sliding (layer 4, window 16) attention
# layer, per-head sigmoid gates, sandwich norms and proportional RoPE on the full layer.
ARCHS["lfm3"] = ("Lfm3Config", "Lfm3ForCausalLM", dict(
    num_hidden_layers=6, conv_L_cache=4, sliding_window=16))

# RecurrentGemma: recurrent, recurrent, local attention (window 16), twice; one KV head.
# Its norms start at zero ((1 + w) form): perturbed so that ignoring them could not pass.
ARCHS["recurrent_gemma"] = ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", dict(
    num_hidden_layers=6, lru_width=64, attention_window_size=16, conv1d_width=4,
    num_key_value_heads=1))
PERTURB_CONSTANTS.add("recurrent_gemma")

# MiniMax: lightning attention on layers 0 and 2, softmax attention on 1 and 3 (prefill
# blocks of 16 in the reference), top-2 of 4 experts, non-trivial residual scales.
ARCHS["minimax"] = ("MiniMaxConfig", "MiniMaxForCausalLM", dict(
    num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
    num_local_experts=4, num_experts_per_tok=2, block_size=16, full_attn_alpha_factor=1.5,
    full_attn_beta_factor=0.7, linear_attn_alpha_factor=1.2, linear_attn_beta_factor=0.9,
    mlp_alpha_factor=1.1, mlp_beta_factor=0.8))

# OLMo Hybrid: Gated DeltaNet (2 key heads, 4 value heads, beta scaled by 2) on layers 0, 2
# and 3, post-norm attention with whole-projection q/k norms on layer 1. Its norms start at
# one: perturbed so that ignoring them could not pass.
ARCHS["olmo_hybrid"] = ("OlmoHybridConfig", "OlmoHybridForCausalLM", dict(
    num_hidden_layers=4, layer_types=["linear_attention", "full_attention",
                                      "linear_attention", "linear_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16))
PERTURB_CONSTANTS.add("olmo_hybrid")

# Zamba2: Mamba2 (8 heads of 16 in 2 groups, chunks of 16); layers 1, 3 and 4 run shared
# attention blocks A, B, A (num_mem_blocks 2, tied as in the released models), RoPE, LoRA
# adapters on q/k/v and the MLP per use; each use writes its own KV cache.
ARCHS["zamba2"] = ("Zamba2Config", "Zamba2ForCausalLM", dict(
    num_hidden_layers=6, layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid",
                                            "mamba"],
    num_key_value_heads=4, head_dim=32, n_mamba_heads=8, mamba_d_state=16, mamba_ngroups=2,
    chunk_size=16, num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=8,
    use_mem_rope=True, tie_word_embeddings=True))
PERTURB_CONSTANTS.add("zamba2")

# Zamba: multi-head Mamba1 (2 heads, dt rank 8); layers 1 and 4 run the one shared block
# (tied), attention heads of 16 (attention_head_dim) over 2 KV heads, no positions.
ARCHS["zamba"] = ("ZambaConfig", "ZambaForCausalLM", dict(
    num_hidden_layers=5, layers_block_type=["mamba", "hybrid", "mamba", "mamba", "hybrid"],
    n_mamba_heads=2, mamba_d_state=16, mamba_dt_rank=8, tie_word_embeddings=True))
PERTURB_CONSTANTS.add("zamba")

# Kimi Linear: KDA (4 heads of 16, conv 4) on layers 0 and 2, latent attention without RoPE
# (latent 32 + 8, queries through a rank-24 bottleneck) on 1 and 3; layer 0 dense, then top-2
# of 8 grouped experts + a shared one. Norm scales and the router bias get noise.
ARCHS["kimi_linear"] = ("KimiLinearConfig", "KimiLinearForCausalLM", dict(
    num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
    num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, linear_num_heads=4, linear_head_dim=16,
    num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32))
PERTURB_CONSTANTS.add("kimi_linear")

# RWKV-4 (no attention at all): 4 blocks, halved after every 2nd at inference (rescale_every).
# Its LayerNorms and time_first start constant: perturbed so that ignoring them could not pass.
ARCHS["rwkv"] = ("RwkvConfig", "RwkvForCausalLM", dict(
    num_hidden_layers=4, attention_hidden_size=64, rescale_every=2))
PERTURB_CONSTANTS.add("rwkv")

# Ling 3.0 (Bailing hybrid): KDA (4 heads of 16, bounded gate) on layers 0-2, latent
# attention with interleaved RoPE on 8 of 24 query dims and a head gate on layer 3; layer 0
# dense, then top-2 of 8 grouped experts + a shared one. Constants get noise as for Kimi.
ARCHS["bailing_hybrid"] = ("BailingHybridConfig", "BailingHybridForCausalLM", dict(
    num_hidden_layers=4, layer_group_size=4, num_key_value_heads=4, kv_lora_rank=32,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_experts=8,
    num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
    first_k_dense_replace=1, num_mtp_layers=0, rope_theta=10000.0))
PERTURB_CONSTANTS.add("bailing_hybrid")

# xLSTM (no attention at all): 3 mLSTM blocks of 4 heads (q/k 16 wide, v 32; transformers'
# cache needs widths that are multiples of 64), gates and logits soft-capped, float32 kernels.
# Its gate weights start at zero and its norms at one: perturbed so that ignoring them could
# not pass.
ARCHS["xlstm"] = ("xLSTMConfig", "xLSTMForCausalLM", dict(
    hidden_size=128, num_hidden_layers=3, num_heads=4, qk_dim_factor=0.5, v_dim_factor=1.0,
    autocast_kernel_dtype="float32", chunk_size=16, gate_soft_cap=15.0,
    output_logit_soft_cap=30.0))
PERTURB_CONSTANTS.add("xlstm")

# CWM: Llama layers, full attention every 4th layer from layer 0, llama3 RoPE scaling.
ARCHS["cwm"] = ("CwmConfig", "CwmForCausalLM", dict(num_hidden_layers=4, sliding_window=16))

# Flint: NoPE full layers, a sink logit per head, layer 0 dense, then top-2 of 4 sigmoid-routed
# experts + an ungated shared expert.
ARCHS["flint"] = ("FlintConfig", "FlintForCausalLM", dict(
    num_hidden_layers=4, sliding_window=16, layer_types=["sliding_attention",
                                                         "full_attention"] * 2,
    mlp_only_layers=[0], moe_intermediate_size=32, shared_expert_intermediate_size=48,
    num_experts=4, num_experts_per_tok=2))

# Kolibri 1: NoPE full layer, sandwich norms, top-2 of 4 experts chosen on logits + bias
# (the bias, a zero buffer, and the norms get noise) + shared experts on every layer.
ARCHS["kolibri1"] = ("Kolibri1Config", "Kolibri1ForCausalLM", dict(
    num_hidden_layers=4, sliding_window=16, layer_types=["sliding_attention"] * 2 + [
        "full_attention", "sliding_attention"], moe_intermediate_size=32,
    shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
    norm_topk_prob=True))
PERTURB_CONSTANTS.add("kolibri1")

# Laguna: 4 / 2 query heads by layer, softplus head gates, RoPE on half of each full layer's
# head, layer 0 dense, then top-2 of 4 experts (sigmoid + bias, soft-capped logits, scaled)
# + a shared expert. Constants get noise as for Kolibri.
ARCHS["laguna"] = ("LagunaConfig", "LagunaForCausalLM", dict(
    num_hidden_layers=4, sliding_window=16, layer_types=["sliding_attention",
                                                         "full_attention"] * 2,
    num_attention_heads_per_layer=[4, 2, 4, 2], moe_intermediate_size=32,
    shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
    moe_router_logit_softcapping=3.0, moe_routed_scaling_factor=1.5))
PERTURB_CONSTANTS.add("laguna")

# Mellum: RoPE θ per layer type, layer 0 dense, then top-2 of 4 softmax-routed experts.
ARCHS["mellum"] = ("MellumConfig", "MellumForCausalLM", dict(
    num_hidden_layers=4, sliding_window=16, layer_types=["sliding_attention",
                                                         "full_attention"] * 2,
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], moe_intermediate_size=32,
    num_experts=4, num_experts_per_tok=2))

# ModernBERT-Decoder: windows of 16 (half of local_attention) on layers 1-2, LayerNorms, a
# prediction head before the biased decoder, tied to the embedding. Its attention has no
# grouped KV heads (the config's num_key_value_heads is not read: 2 here, 4 in effect).
ARCHS["modernbert_decoder"] = ("ModernBertDecoderConfig", "ModernBertDecoderForCausalLM", dict(
    num_hidden_layers=4, local_attention=32, layer_types=[
        "full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    tie_word_embeddings=True, cls_token_id=2, sep_token_id=3))
PERTURB_CONSTANTS.add("modernbert_decoder")

# Beam: RoPE on the sliding layers, NoPE with position-scaled queries on the full ones,
# biased sigmoid gates, depth-scaled residuals; layer 0 dense, then top-2 of 8 experts in
# 2 groups (1 kept) with a correction bias, scaled by 2.5; logits soft-capped at 30. The
# gate and router biases (zeros) get noise.
ARCHS["beam"] = ("BeamConfig", "BeamForCausalLM", dict(
    num_hidden_layers=4, sliding_window=16, layer_types=["sliding_attention",
                                                         "full_attention"] * 2,
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], moe_intermediate_size=32,
    num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1))
PERTURB_CONSTANTS.add("beam")

# Zaya: CCA attention (q/k convs and delayed values: a state beside each layer's KV cache),
# sliding and full layers, RoPE on half of each head, a top-1 router over 4 experts and a
# skip class whose hidden state passes from layer to layer. Constants (residual scales,
# the key temperature at zero) get noise.
ARCHS["zaya"] = ("ZayaConfig", "ZayaForCausalLM", dict(
    num_hidden_layers=4, sliding_window=16, layer_types=["hybrid_sliding", "hybrid"] * 2,
    moe_intermediate_size=32, num_experts=4, num_experts_per_tok=1, router_hidden_size=32))
PERTURB_CONSTANTS.add("zaya")

# Doge: every layer sliding (window 16), a learned bias per key from its values (A, zero
# at init, gets noise with the other constants: per-channel residual scales).
ARCHS["doge"] = ("DogeConfig", "DogeForCausalLM", dict(num_hidden_layers=2,
                                                        sliding_window=16))
PERTURB_CONSTANTS.add("doge")

# dots3_note: MLA everywhere; layers 0-1 with a lightning indexer choosing the top 8
# positions per query (4 heads of 16), layers 2-3 sliding (window 16) with their own MLA
# sizes (latent 40 + 8); layer 0 dense, then top-2 of 8 experts in 2 groups (1 kept) with
# a correction bias, plus a shared expert. Norm scales and the router bias get noise.
ARCHS["dots3_note"] = ("Dots3NoteTextConfig", "Dots3NoteForCausalLM", dict(
    num_hidden_layers=4, num_key_value_heads=4, sliding_window=16, q_lora_rank=24,
    kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
    moe_intermediate_size=32, shared_experts_intermediate_size=32, index_topk=8,
    index_head_dim=16, index_n_heads=4, swa_num_attention_heads=4, swa_num_key_value_heads=4,
    swa_q_lora_rank=24, swa_kv_lora_rank=40, swa_head_dim=24, swa_qk_nope_head_dim=16,
    swa_v_head_dim=16))
PERTURB_CONSTANTS.add("dots3_note")

# Qwen4-Exp: Gated DeltaNet on layers 0 and 2 (2 key heads, 4 value heads), gated attention
# over a QSA indexer's choice on 1 and 3 (4 heads of 16; keys averaged per 4 positions, the
# top 2 blocks plus the unfinished one), RoPE on half of each head; top-2 of 4 experts and a
# gated shared expert everywhere; 2 hyper-connection copies of the stream. Norm scales
# (zero-centred) get noise.
ARCHS["qwen4_exp"] = ("Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", dict(
    num_hidden_layers=4, layer_types=["linear_attention", "indexed_attention"] * 2,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    num_experts=4, num_experts_per_tok=2, hc_count=2, hc_lowrank=16, indexer_n_heads=4,
    indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                     "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}))
PERTURB_CONSTANTS.add("qwen4_exp")

# Inkling: no RoPE; every layer's attention adds a relative bias per query (its relative
# states mixed over a bank of bias-vs-distance profiles, zero past rel_extent = 24 on full
# layers, the window on sliding ones), short convs (kernel 4) with a residual on k, v and
# both residual branches (their last inputs: a state beside the KV cache), sliding layers
# (window 16) with their own head sizes, log-scaled queries from position 32 on full layers;
# layer 0 dense, then top-2 of 4 experts with a shared expert scored beside them. Norm and
# expert scales and the router bias get noise.
ARCHS["inkling"] = ("InklingTextConfig", "InklingForCausalLM", dict(
    num_hidden_layers=4, layer_types=["hybrid_sliding", "hybrid"] * 2,
    sliding_window_size=16, swa_num_attention_heads=4, swa_num_key_value_heads=1,
    swa_head_dim=8, d_rel=4, rel_extent=24, log_scaling_n_floor=32,
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], moe_intermediate_size=32,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    logits_mup_width_multiplier=2.0))
PERTURB_CONSTANTS.add("inkling")

# Inkling 2: Inkling's relative bias and convs, plus a sink logit per token and head, an
# output gate, L2-clipped q / k / relative states (thresholds low enough to clip) and
# RMS-normed values; full layers' k/v convs take per-token taps from their own inputs and
# their q/k/v inputs come from three learned queries over the block summaries (attention
# residuals, blocks of 2 layers); softcapped SwiGLU experts (top-2 of 4), logits softcapped
# and cut to 250 of 256 (intermediate_size: its alias of the experts' width). Zero-initialised
# taps, queries and scales get noise.
ARCHS["inkling2"] = ("Inkling2TextConfig", "Inkling2ForCausalLM", dict(
    num_hidden_layers=4, layer_types=["hybrid_sliding", "hybrid"] * 2,
    sliding_window_size=16, swa_num_attention_heads=4, swa_num_key_value_heads=1,
    swa_head_dim=8, d_rel=4, rel_extent=24, log_scaling_n_floor=32,
    qk_l2_clip_threshold=3.0, rel_l2_clip_threshold=0.5, n_layers_per_attn_res_block=2,
    intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
    mlp_gate_softcap=0.5, mlp_up_softcap=1.0, final_logit_softcapping=2.0,
    unpadded_vocab_size=250))
PERTURB_CONSTANTS.add("inkling2")

# DeepSeek-V4: a sliding layer, then CSA (entries per 4 tokens, the indexer's top 4 of them;
# 2 heads of 16), HCA (per 8 tokens) and CSA again, window 16, RoPE on half of each head;
# hash-routed MoE on the first two layers (a random token -> experts table), top-2 of 4 with
# a correction bias after; 2 hyper-connection streams. Sinks, position biases, norm scales
# and the hyper-connections' constants get noise.
ARCHS["deepseek_v4"] = ("DeepseekV4Config", "DeepseekV4ForCausalLM", dict(
    num_hidden_layers=4, num_key_value_heads=1, q_lora_rank=32, partial_rotary_factor=0.5,
    layer_types=["sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention", "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    sliding_window=16, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16,
    index_topk=4, hc_mult=2, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, intermediate_size=32))
PERTURB_CONSTANTS.add("deepseek_v4")


def _v4_hash_tables(model: Any) -> None:
    import torch

    gen = torch.Generator().manual_seed(2)
    for layer in model.model.layers:
        gate = layer.mlp.gate
        if hasattr(gate, "tid2eid"):
            gate.tid2eid.copy_(torch.randint(0, gate.num_experts, gate.tid2eid.shape,
                                             generator=gen))


INIT_HOOKS["deepseek_v4"] = _v4_hash_tables
