"""Hypothesis strategies for property tests: valid small HF configs of every registered
family, and token ids for them.

Needs the ``test`` extra (hypothesis): ``pip install implicit-attn[test]``.

A config is a dict of keyword arguments of the family's HF config class
(``FamilySpec.hf_config_class``), e.g. ``transformers.MambaConfig(**config)``; it starts
from the family's tiny test config and varies widths, heads, state sizes, depth, conv
widths, biases, and (RecurrentGemma) the layer pattern and attention window, always
within what both HF and ``implicit_attn`` accept. Sizes stay small: every new shape is a
new XLA compilation.
"""
from __future__ import annotations

from ..registry import FAMILIES, family
from ..registry import model_types as registered_types
from .deps import require

require("hypothesis")
import hypothesis.extra.numpy as hnp  # noqa: E402
import numpy as np  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

VOCAB = st.sampled_from([32, 61, 64])


def divisors(n: int, limit: int | None = None) -> list[int]:
    """Divisors of ``n`` (at most ``limit``), ascending."""
    return [d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit)]


@st.composite
def mamba_configs(draw) -> dict:
    """``MambaConfig`` kwargs: width, state size, depth, conv width, expansion, dt rank, biases."""
    return {**family("mamba").tiny,
            "vocab_size": draw(VOCAB), "hidden_size": draw(st.sampled_from([8, 12, 16])),
            "state_size": draw(st.integers(1, 6)), "num_hidden_layers": draw(st.integers(1, 3)),
            "conv_kernel": draw(st.integers(1, 4)), "expand": draw(st.sampled_from([1, 2])),
            "time_step_rank": draw(st.integers(1, 4)), "use_conv_bias": draw(st.booleans()),
            "use_bias": draw(st.booleans()), "tie_word_embeddings": draw(st.booleans())}


@st.composite
def falcon_mamba_configs(draw) -> dict:
    """``FalconMambaConfig`` kwargs: Mamba's, and the eps of the norm on dt, B and C."""
    return {**draw(mamba_configs()), "mixer_rms_eps": draw(st.sampled_from([1e-6, 1e-3]))}


@st.composite
def mamba2_configs(draw) -> dict:
    """``Mamba2Config`` kwargs with ``num_heads * head_dim == expand * hidden_size`` (HF's
    layout) and ``n_groups`` dividing ``num_heads``; chunk sizes below and above ``L``."""
    hidden = draw(st.sampled_from([8, 12, 16]))
    expand = draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from(divisors(expand * hidden, 8)[1:]))
    heads = expand * hidden // head_dim
    return {**family("mamba2").tiny,
            "vocab_size": draw(VOCAB), "hidden_size": hidden, "expand": expand, "head_dim": head_dim,
            "num_heads": heads, "n_groups": draw(st.sampled_from(divisors(heads, 4))),
            "state_size": draw(st.integers(1, 6)), "num_hidden_layers": draw(st.integers(1, 3)),
            "conv_kernel": draw(st.integers(1, 4)), "chunk_size": draw(st.sampled_from([4, 8, 16])),
            "use_conv_bias": draw(st.booleans()), "use_bias": draw(st.booleans()),
            "tie_word_embeddings": draw(st.booleans())}


@st.composite
def recurrent_gemma_configs(draw) -> dict:
    """``RecurrentGemmaConfig`` kwargs: heads (``num_key_value_heads`` dividing them), head
    width a multiple of 4 (even rotary half), LRU width a multiple of the heads, the
    ``block_types`` pattern and depth, attention window, conv width, soft cap, biases."""
    heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([4, 8]))
    return {**family("recurrent_gemma").tiny,
            "vocab_size": draw(VOCAB), "hidden_size": heads * head_dim, "num_attention_heads": heads,
            "num_key_value_heads": draw(st.sampled_from(divisors(heads))),
            "lru_width": heads * draw(st.sampled_from([2, 4, 6])),
            "intermediate_size": 2 * draw(st.integers(4, 16)), "num_hidden_layers": draw(st.integers(1, 4)),
            "block_types": draw(st.lists(st.sampled_from(["recurrent", "attention"]), min_size=1, max_size=3)),
            "attention_window_size": draw(st.integers(1, 8)), "conv1d_width": draw(st.integers(1, 4)),
            "logits_soft_cap": draw(st.sampled_from([30.0, 5.0])), "attention_bias": draw(st.booleans()),
            "rope_parameters": dict(rope_type="default", rope_theta=draw(st.sampled_from([10000.0, 100.0])),
                                    partial_rotary_factor=0.5)}


@st.composite
def bamba_configs(draw) -> dict:
    """``BambaConfig`` kwargs: attention heads (KV heads dividing them, head width a multiple
    of 4 for the half-width RoPE), Mamba-2 heads dividing ``mamba_expand * hidden_size`` and
    groups dividing the heads, the attention layers, depth, state, conv width, chunk, biases."""
    heads = draw(st.sampled_from([1, 2, 4]))
    hidden = heads * draw(st.sampled_from([4, 8]))
    expand = draw(st.sampled_from([1, 2]))
    m_heads = draw(st.sampled_from(divisors(expand * hidden, 8)))
    layers = draw(st.integers(1, 3))
    return {**family("bamba").tiny,
            "vocab_size": draw(VOCAB), "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": draw(st.sampled_from(divisors(heads))),
            "intermediate_size": draw(st.sampled_from([8, 16, 24])), "num_hidden_layers": layers,
            "attn_layer_indices": draw(st.lists(st.integers(0, layers - 1), max_size=layers, unique=True)),
            "mamba_n_heads": m_heads, "mamba_n_groups": draw(st.sampled_from(divisors(m_heads, 4))),
            "mamba_expand": expand, "mamba_d_state": draw(st.integers(1, 6)), "mamba_d_conv": draw(st.integers(1, 4)),
            "mamba_chunk_size": draw(st.sampled_from([4, 8, 16])), "mamba_conv_bias": draw(st.booleans()),
            "mamba_proj_bias": draw(st.booleans()), "attention_bias": draw(st.booleans()),
            "mlp_bias": draw(st.booleans()), "tie_word_embeddings": draw(st.booleans())}


@st.composite
def granite_configs(draw) -> dict:
    """``GraniteMoeHybridConfig`` kwargs: Bamba's sizes, plus the layer types, experts (0 is
    a dense model) and how many each token takes, the shared MLP, RoPE or none, and the
    four muP multipliers."""
    b = draw(bamba_configs())
    layers = b["num_hidden_layers"]
    attn = set(b.pop("attn_layer_indices"))
    for k in ("mlp_bias", "intermediate_size"):
        b.pop(k)
    experts = draw(st.sampled_from([0, 1, 4]))
    mult = st.floats(0.25, 4.0)
    return {**family("granitemoehybrid").tiny, **b,
            "layer_types": ["attention" if i in attn else "mamba" for i in range(layers)],
            "intermediate_size": draw(st.sampled_from([4, 8])),
            "shared_intermediate_size": draw(st.sampled_from([8, 16])),
            "num_local_experts": experts, "num_experts_per_tok": draw(st.integers(1, max(experts, 1))),
            "position_embedding_type": draw(st.sampled_from(["rope", "nope"])),
            "embedding_multiplier": draw(mult), "logits_scaling": draw(mult), "residual_multiplier": draw(mult),
            "attention_multiplier": draw(st.floats(0.05, 1.0))}


@st.composite
def jamba_configs(draw) -> dict:
    """``JambaConfig`` kwargs: attention heads (KV heads dividing them), the attention and
    expert layer patterns (period, offset below it), experts (1: no MoE) and how many each
    token takes, Mamba state, conv width, dt rank, expand, biases, depth."""
    heads = draw(st.sampled_from([1, 2, 4]))
    experts = draw(st.sampled_from([1, 2, 4]))
    attn_period, expert_period = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    return {**family("jamba").tiny,
            "vocab_size": draw(VOCAB), "hidden_size": heads * draw(st.sampled_from([4, 8])),
            "num_attention_heads": heads, "num_key_value_heads": draw(st.sampled_from(divisors(heads))),
            "intermediate_size": draw(st.sampled_from([8, 16])), "num_hidden_layers": draw(st.integers(1, 4)),
            "attn_layer_period": attn_period, "attn_layer_offset": draw(st.integers(0, attn_period - 1)),
            "expert_layer_period": expert_period, "expert_layer_offset": draw(st.integers(0, expert_period - 1)),
            "num_experts": experts, "num_experts_per_tok": draw(st.integers(1, experts)),
            "mamba_d_state": draw(st.integers(1, 6)), "mamba_d_conv": draw(st.integers(1, 4)),
            "mamba_dt_rank": draw(st.integers(1, 4)), "mamba_expand": draw(st.sampled_from([1, 2])),
            "mamba_conv_bias": draw(st.booleans()), "mamba_proj_bias": draw(st.booleans()),
            "tie_word_embeddings": draw(st.booleans())}


@st.composite
def nemotron_h_configs(draw) -> dict:
    """``NemotronHConfig`` kwargs: the layer pattern (a token-mixing layer first), attention
    heads (KV heads dividing them) and head width, Mamba-2 heads, head width, groups, state,
    conv width and chunk, the MLP, the experts (groups of at least 2, kept groups, experts
    per token, latent width or none, scaling, normalisation), biases."""
    mixers = draw(st.lists(st.sampled_from(["M", "*"]), min_size=1, max_size=3))
    pattern = "".join(m + "".join(draw(st.lists(st.sampled_from(["-", "E"]), max_size=2))) for m in mixers)
    heads = draw(st.sampled_from([1, 2, 4]))
    m_heads = draw(st.sampled_from([2, 4]))
    n_group = draw(st.sampled_from([1, 2]))
    experts = n_group * draw(st.sampled_from([2, 3]))
    topk_group = draw(st.integers(1, n_group))
    return {**family("nemotron_h").tiny,
            "vocab_size": draw(VOCAB), "hidden_size": draw(st.sampled_from([8, 16])), "hybrid_override_pattern": pattern,
            "num_attention_heads": heads, "num_key_value_heads": draw(st.sampled_from(divisors(heads))),
            "head_dim": draw(st.sampled_from([4, 8])), "intermediate_size": draw(st.sampled_from([8, 24])),
            "mamba_num_heads": m_heads, "mamba_head_dim": draw(st.sampled_from([2, 4])),
            "n_groups": draw(st.sampled_from(divisors(m_heads))), "ssm_state_size": draw(st.integers(1, 6)),
            "conv_kernel": draw(st.integers(1, 4)), "chunk_size": draw(st.sampled_from([4, 8, 16])),
            "use_conv_bias": draw(st.booleans()), "use_bias": draw(st.booleans()), "mlp_bias": draw(st.booleans()),
            "time_step_min": draw(st.sampled_from([1e-4, 0.001, 0.05])),  # HF initialises dt from its log
            "time_step_limit": [draw(st.sampled_from([0.0, 1e-3, 0.05])), draw(st.sampled_from([float("inf"), 5.0]))],
            "n_routed_experts": experts, "n_group": n_group, "topk_group": topk_group,
            "num_experts_per_tok": draw(st.integers(1, topk_group * experts // n_group)),
            "moe_intermediate_size": draw(st.sampled_from([4, 8])),
            "moe_shared_expert_intermediate_size": draw(st.sampled_from([4, 12])),
            "moe_latent_size": draw(st.sampled_from([None, 4])), "routed_scaling_factor": draw(st.floats(0.5, 3.0)),
            "norm_topk_prob": draw(st.booleans())}


@st.composite
def falcon_h1_configs(draw) -> dict:
    """``FalconH1Config`` kwargs: attention heads (KV heads dividing them) and head width,
    the Mamba width (free of ``hidden_size``), heads and groups, state, conv width, chunk,
    the output norm (none, before or after the gate), biases, depth, and every muP
    multiplier."""
    heads = draw(st.sampled_from([1, 2, 4]))
    m_heads = draw(st.sampled_from([2, 4]))
    mult = st.floats(0.25, 2.0)
    return {**family("falcon_h1").tiny,
            "vocab_size": draw(VOCAB), "hidden_size": draw(st.sampled_from([8, 16])),
            "intermediate_size": draw(st.sampled_from([8, 24])), "num_hidden_layers": draw(st.integers(1, 3)),
            "num_attention_heads": heads, "num_key_value_heads": draw(st.sampled_from(divisors(heads))),
            "head_dim": draw(st.sampled_from([2, 4, 8])), "mamba_n_heads": m_heads,
            "mamba_d_ssm": m_heads * draw(st.sampled_from([2, 3, 4])),
            "mamba_n_groups": draw(st.sampled_from(divisors(m_heads))), "mamba_d_state": draw(st.integers(1, 6)),
            "mamba_d_conv": draw(st.integers(1, 4)), "mamba_chunk_size": draw(st.sampled_from([4, 8, 16])),
            "mamba_rms_norm": draw(st.booleans()), "mamba_norm_before_gate": draw(st.booleans()),
            "mamba_conv_bias": draw(st.booleans()), "mamba_proj_bias": draw(st.booleans()),
            "projectors_bias": draw(st.booleans()), "attention_bias": draw(st.booleans()),
            "mlp_bias": draw(st.booleans()), "tie_word_embeddings": draw(st.booleans()),
            "embedding_multiplier": draw(mult), "lm_head_multiplier": draw(mult), "key_multiplier": draw(mult),
            "attention_in_multiplier": draw(mult), "attention_out_multiplier": draw(mult),
            "ssm_in_multiplier": draw(mult), "ssm_out_multiplier": draw(mult),
            "mlp_multipliers": draw(st.lists(mult, min_size=2, max_size=2)),
            "ssm_multipliers": draw(st.lists(mult, min_size=5, max_size=5))}


@st.composite
def zamba2_configs(draw) -> dict:
    """``Zamba2Config`` kwargs: the HF layer kinds (Mamba / hybrid), shared blocks, attention
    heads (with or without q/k/v adapters: adapters need as many KV heads as heads), RoPE,
    adapter rank, Mamba heads and groups, state, conv width, chunk, biases and ``dt`` floor
    (positive: HF's initialisation takes its log)."""
    types = draw(st.lists(st.sampled_from(["mamba", "hybrid"]), min_size=1, max_size=4))
    heads = draw(st.sampled_from([1, 2, 4]))
    adapters = draw(st.booleans())
    m_heads = draw(st.sampled_from([2, 4]))
    return {**family("zamba2").tiny,
            "vocab_size": draw(VOCAB), "hidden_size": draw(st.sampled_from([8, 16])),
            "intermediate_size": draw(st.sampled_from([8, 24])), "num_hidden_layers": len(types),
            "layers_block_type": types, "num_mem_blocks": draw(st.integers(1, 3)),
            "num_attention_heads": heads,
            "num_key_value_heads": heads if adapters else draw(st.sampled_from(divisors(heads))),
            "use_shared_attention_adapter": adapters, "adapter_rank": draw(st.integers(1, 4)),
            "use_mem_rope": draw(st.booleans()), "n_mamba_heads": m_heads,
            "mamba_ngroups": draw(st.sampled_from(divisors(m_heads))), "mamba_d_state": draw(st.integers(1, 6)),
            "mamba_d_conv": draw(st.integers(1, 4)), "chunk_size": draw(st.sampled_from([4, 8, 16])),
            "add_bias_linear": draw(st.booleans()), "time_step_min": draw(st.sampled_from([1e-4, 0.001, 0.05])),
            "tie_word_embeddings": draw(st.booleans())}


@st.composite
def zamba_configs(draw) -> dict:
    """``ZambaConfig`` kwargs: the HF layer kinds (Mamba / hybrid), attention heads (KV heads
    dividing them) and head width, Mamba heads, state, conv width, ``dt`` rank, biases (HF
    cannot build a tied model with exactly one hybrid layer: its tie pattern matches nothing)."""
    types = draw(st.lists(st.sampled_from(["mamba", "hybrid"]), min_size=1, max_size=4))
    tie = draw(st.booleans()) and types.count("hybrid") != 1
    heads = draw(st.sampled_from([1, 2, 4]))
    return {**family("zamba").tiny,
            "vocab_size": draw(VOCAB), "hidden_size": draw(st.sampled_from([8, 16])),
            "intermediate_size": draw(st.sampled_from([8, 24])), "num_hidden_layers": len(types),
            "layers_block_type": types, "num_attention_heads": heads,
            "num_key_value_heads": draw(st.sampled_from(divisors(heads))),
            "attention_head_dim": draw(st.sampled_from([None, 2, 4])), "n_mamba_heads": draw(st.sampled_from([1, 2, 4])),
            "mamba_d_state": draw(st.integers(1, 6)), "mamba_d_conv": draw(st.integers(1, 4)),
            "mamba_dt_rank": draw(st.integers(1, 4)), "mamba_conv_bias": draw(st.booleans()),
            "mamba_proj_bias": draw(st.booleans()), "tie_word_embeddings": tie}


@st.composite
def qwen3_next_configs(draw) -> dict:
    """``Qwen3NextConfig`` kwargs: layer kinds (Gated DeltaNet / attention), key and value heads
    (value heads a multiple of key heads) and widths, conv width, attention heads (KV heads
    dividing them) and head width, RoPE fraction, experts (0: dense MLPs), MLP-only layers,
    sparse step, ``norm_topk_prob``, tie."""
    types = draw(st.lists(st.sampled_from(["linear_attention", "full_attention"]), min_size=1, max_size=3))
    n = len(types)
    k_heads = draw(st.sampled_from([1, 2]))
    heads = draw(st.sampled_from([1, 2, 4]))
    experts = draw(st.sampled_from([0, 4]))
    return {**family("qwen3_next").tiny,
            "vocab_size": draw(VOCAB), "hidden_size": draw(st.sampled_from([8, 16])),
            "intermediate_size": draw(st.sampled_from([8, 24])), "num_hidden_layers": n, "layer_types": types,
            "linear_num_key_heads": k_heads, "linear_num_value_heads": k_heads * draw(st.sampled_from([1, 2])),
            "linear_key_head_dim": draw(st.sampled_from([2, 4, 8])),
            "linear_value_head_dim": draw(st.sampled_from([2, 3, 6])),
            "linear_conv_kernel_dim": draw(st.integers(1, 4)), "num_attention_heads": heads,
            "num_key_value_heads": draw(st.sampled_from(divisors(heads))), "head_dim": draw(st.sampled_from([8, 16])),
            "partial_rotary_factor": draw(st.sampled_from([0.25, 0.5, 1.0])), "num_experts": experts,
            "num_experts_per_tok": draw(st.integers(1, 4)), "mlp_only_layers": draw(st.lists(st.integers(0, n - 1),
                                                                                              max_size=n)),
            "decoder_sparse_step": draw(st.integers(1, 2)), "norm_topk_prob": draw(st.booleans()),
            "tie_word_embeddings": draw(st.booleans())}


@st.composite
def qwen3_5_configs(draw) -> dict:
    """``Qwen3_5TextConfig`` kwargs: Qwen3-Next's draw without the fields HF's class deletes."""
    return {k: v for k, v in draw(qwen3_next_configs()).items() if k not in family("qwen3_5_text").config.ignored}


@st.composite
def qwen3_5_moe_configs(draw) -> dict:
    """``Qwen3_5MoeTextConfig`` kwargs: Qwen3-Next's draw without the fields HF's class deletes,
    experts in every layer."""
    ignored = family("qwen3_5_moe_text").config.ignored
    return {**{k: v for k, v in draw(qwen3_next_configs()).items() if k not in ignored}, "num_experts": 4}


@st.composite
def olmo_hybrid_configs(draw) -> dict:
    """``OlmoHybridConfig`` kwargs: layer kinds (both present, as HF requires), key and value heads
    and widths, conv width, attention heads (KV heads dividing them), RoPE or none, write
    strengths in [0, 1] or [0, 2], tie."""
    kinds = ["linear_attention", "full_attention"]
    types = draw(st.permutations(kinds + draw(st.lists(st.sampled_from(kinds), max_size=1))))
    k_heads = draw(st.sampled_from([1, 2]))
    heads = draw(st.sampled_from([1, 2, 4]))
    return {**family("olmo_hybrid").tiny,
            "vocab_size": draw(VOCAB), "hidden_size": draw(st.sampled_from([8, 16])),
            "intermediate_size": draw(st.sampled_from([8, 24])), "num_hidden_layers": len(types),
            "layer_types": list(types), "linear_num_key_heads": k_heads,
            "linear_num_value_heads": k_heads * draw(st.sampled_from([1, 2])),
            "linear_key_head_dim": draw(st.sampled_from([2, 4, 8])),
            "linear_value_head_dim": draw(st.sampled_from([2, 3, 6])),
            "linear_conv_kernel_dim": draw(st.integers(1, 4)), "num_attention_heads": heads,
            "num_key_value_heads": draw(st.sampled_from(divisors(heads))),
            "rope_parameters": {"rope_type": "default", "rope_theta": draw(st.sampled_from([None, 10000.0]))},
            "linear_allow_neg_eigval": draw(st.booleans()), "tie_word_embeddings": draw(st.booleans())}


@st.composite
def lara_mini_configs(draw) -> dict:
    """``LaraMiniConfig`` kwargs: layer kinds (Gated DeltaNet / sliding / full attention), key and
    value heads and widths, conv width, attention heads (KV heads dividing them) and head width,
    window (below and above the ids' length), RoPE base, attention biases, experts per token,
    renormalisation, tie."""
    types = draw(st.lists(st.sampled_from(["linear_attention", "sliding_attention", "full_attention"]), min_size=1,
                          max_size=3))
    k_heads = draw(st.sampled_from([1, 2]))
    heads = draw(st.sampled_from([1, 2, 4]))
    return {**family("lara_mini").tiny,
            "vocab_size": draw(VOCAB), "hidden_size": draw(st.sampled_from([8, 16])),
            "num_hidden_layers": len(types), "layer_types": types, "linear_num_key_heads": k_heads,
            "linear_num_value_heads": k_heads * draw(st.sampled_from([1, 2])),
            "linear_key_head_dim": draw(st.sampled_from([2, 4, 8])),
            "linear_value_head_dim": draw(st.sampled_from([2, 3, 6])),
            "linear_conv_kernel_dim": draw(st.integers(1, 4)), "num_attention_heads": heads,
            "num_key_value_heads": draw(st.sampled_from(divisors(heads))), "head_dim": draw(st.sampled_from([4, 8])),
            "sliding_window": draw(st.sampled_from([1, 3, 64])),
            "rope_parameters": {"rope_type": "default", "rope_theta": draw(st.sampled_from([10000.0, 100.0]))},
            "attention_bias": draw(st.booleans()), "num_experts_per_tok": draw(st.integers(1, 4)),
            "norm_topk_prob": draw(st.booleans()), "tie_word_embeddings": draw(st.booleans())}


@st.composite
def kimi_linear_configs(draw) -> dict:
    """``KimiLinearConfig`` kwargs: layer kinds (KDA / MLA) and feed-forward kinds (dense /
    sparse), KDA heads and width, conv width, MLA heads, latent ranks (``q_lora_rank`` None or
    not) and head widths (the shared RoPE-free part possibly 0), expert groups, experts per
    token, renormalisation, scaling, shared experts, tie."""
    n = draw(st.integers(1, 3))
    types = draw(st.lists(st.sampled_from(["linear_attention", "full_attention"]), min_size=n, max_size=n))
    mlps = draw(st.lists(st.sampled_from(["dense", "sparse"]), min_size=n, max_size=n))
    groups = draw(st.sampled_from([1, 2]))
    top_groups = draw(st.integers(1, groups))
    experts = groups * draw(st.sampled_from([2, 4]))
    return {**family("kimi_linear").tiny,
            "vocab_size": draw(VOCAB), "hidden_size": draw(st.sampled_from([8, 16])),
            "intermediate_size": draw(st.sampled_from([8, 24])), "moe_intermediate_size": draw(st.sampled_from([4, 8])),
            "num_hidden_layers": n, "layer_types": types, "mlp_layer_types": mlps,
            "linear_num_heads": draw(st.sampled_from([1, 2])), "linear_head_dim": draw(st.sampled_from([2, 4, 6])),
            "linear_conv_kernel_dim": draw(st.integers(1, 4)),
            "num_attention_heads": (heads := draw(st.sampled_from([1, 2, 4]))), "num_key_value_heads": heads,
            "kv_lora_rank": draw(st.sampled_from([4, 8])), "q_lora_rank": draw(st.sampled_from([None, 6])),
            "qk_rope_head_dim": draw(st.sampled_from([0, 2])), "qk_nope_head_dim": draw(st.sampled_from([2, 4])),
            "v_head_dim": draw(st.sampled_from([2, 4])), "n_group": groups, "topk_group": top_groups,
            "num_local_experts": experts,
            "num_experts_per_tok": draw(st.integers(1, top_groups * experts // groups)),
            "norm_topk_prob": draw(st.booleans()), "routed_scaling_factor": draw(st.sampled_from([1.0, 2.5])),
            "n_shared_experts": draw(st.integers(1, 2)), "tie_word_embeddings": draw(st.booleans())}


@st.composite
def bailing_hybrid_configs(draw) -> dict:
    """``BailingHybridConfig`` kwargs: Kimi-Linear's draw (the q latent included) with Bailing's
    constraints (the KDA heads are the attention heads, of ``head_dim``, and ``qk_rope_head_dim =
    head_dim``),
    the bounded forget gate on or off and its bound, RoPE's base."""
    kw = {k: v for k, v in draw(kimi_linear_configs()).items()
          if k not in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim")}
    d = draw(st.sampled_from([2, 4]))
    return {**family("bailing_hybrid").tiny, **kw, "head_dim": d, "qk_rope_head_dim": d,
            "short_conv_kernel_size": draw(st.integers(1, 4)), "kda_safe_gate": draw(st.booleans()),
            "kda_lower_bound": draw(st.sampled_from([-5.0, -1.0])), "rope_theta": draw(st.sampled_from([1e4, 6e6]))}


@st.composite
def minimax_configs(draw) -> dict:
    """``MiniMaxConfig`` kwargs: layer kinds (lightning / softmax attention; one layer included, where
    HF's slope factor is ``1 + 1e-5``), heads (KV heads dividing them) and head width (None: from
    ``hidden_size``), HF's block length, a sliding window or none, experts and experts per token,
    the residual factors, tie."""
    n = draw(st.integers(1, 3))
    types = draw(st.lists(st.sampled_from(["linear_attention", "full_attention"]), min_size=n, max_size=n))
    heads = draw(st.sampled_from([1, 2, 4]))
    experts = draw(st.integers(1, 4))
    factor = st.sampled_from([1.0, 0.5, 2.0])
    return {**family("minimax").tiny,
            "vocab_size": draw(VOCAB), "hidden_size": draw(st.sampled_from([8, 16])),
            "intermediate_size": draw(st.sampled_from([4, 8])), "num_hidden_layers": n, "layer_types": types,
            "num_attention_heads": heads, "num_key_value_heads": draw(st.sampled_from(divisors(heads))),
            "head_dim": draw(st.sampled_from([None, 4, 6])), "block_size": draw(st.sampled_from([2, 3, 4, 16])),
            "sliding_window": draw(st.sampled_from([None, 2, 5])), "num_local_experts": experts,
            "num_experts_per_tok": draw(st.integers(1, experts)),
            **{name: draw(factor) for name in ("full_attn_alpha_factor", "full_attn_beta_factor",
                                                "linear_attn_alpha_factor", "linear_attn_beta_factor",
                                                "mlp_alpha_factor", "mlp_beta_factor")},
            "tie_word_embeddings": draw(st.booleans())}


@st.composite
def rwkv_configs(draw) -> dict:
    """``RwkvConfig`` kwargs: widths of the residual stream, attention and feed-forward,
    depth (at least 2: HF's initialisation divides by ``num_hidden_layers - 1``), and eval
    rescaling (``rescale_every`` 0 is none)."""
    return {**family("rwkv").tiny,
            "vocab_size": draw(VOCAB), "hidden_size": draw(st.sampled_from([8, 12, 16])),
            "attention_hidden_size": draw(st.sampled_from([4, 8, 12, 16])),
            "intermediate_size": draw(st.sampled_from([8, 16, 24])), "num_hidden_layers": draw(st.integers(2, 4)),
            "rescale_every": draw(st.sampled_from([0, 1, 2, 6])), "tie_word_embeddings": draw(st.booleans())}


@st.composite
def rwkv5_configs(draw) -> dict:
    """The RWKV team's ``Rwkv5Config`` kwargs: width, head size, channel-mix width (or the 3.5x
    rounding, from width 16), depth, eval rescaling (``rescale_every`` 0 is none; only half
    precision rescales), the group norm's divisor (the official 8, the earlier port's 1), tie."""
    C = draw(st.sampled_from([8, 16]))
    return {**family("rwkv5").tiny,
            "vocab_size": draw(VOCAB), "hidden_size": C, "head_size": draw(st.sampled_from([2, 4, 8])),
            "intermediate_size": draw(st.sampled_from([8, 24] + ([None] if C >= 16 else []))),
            "num_hidden_layers": draw(st.integers(1, 4)), "rescale_every": draw(st.sampled_from([0, 1, 2, 6])),
            "head_size_divisor": draw(st.sampled_from([1, 8])), "tie_word_embeddings": draw(st.booleans())}


@st.composite
def rwkv6_configs(draw) -> dict:
    """fla ``RWKV6Config`` kwargs: width, heads (dividing the key and value widths), key and value
    expansions, LoRA ranks, channel-mix width (or fla's ``hidden_ratio`` rounding), depth, the
    output norm's eps (fla's or the official 64e-5), norm biases, ``norm_first``, tie."""
    C = draw(st.sampled_from([8, 16]))
    heads = draw(st.sampled_from([1, 2, 4]))
    return {**family("rwkv6").tiny,
            "vocab_size": draw(VOCAB), "hidden_size": C, "num_heads": heads,
            "expand_k": draw(st.sampled_from([0.5, 1.0])), "expand_v": draw(st.sampled_from([0.5, 1.0, 1.5])),
            "proj_low_rank_dim": draw(st.sampled_from([2, 4])), "gate_low_rank_dim": draw(st.sampled_from([3, 8])),
            "intermediate_size": draw(st.sampled_from([None, 8, 24])), "num_hidden_layers": draw(st.integers(1, 3)),
            "g_norm_eps": draw(st.sampled_from([None, 64e-5])), "norm_bias": draw(st.booleans()),
            "norm_first": draw(st.booleans()), "tie_word_embeddings": draw(st.booleans())}


@st.composite
def rwkv7_configs(draw) -> dict:
    """fla ``RWKV7Config`` kwargs: width, head width, value width (a multiple of the width), LoRA
    ranks, channel-mix width (or fla's rounding), depth (the value residual from layer 2 on),
    ``norm_eps``, the removal key's normalisation (``fuse_norm``), norm biases, ``norm_first``, tie."""
    C = draw(st.sampled_from([8, 16]))
    n = draw(st.integers(1, 3))
    return {**family("rwkv7").tiny,
            "vocab_size": draw(VOCAB), "hidden_size": C, "head_dim": draw(st.sampled_from([4, 8])),
            "value_dim": draw(st.sampled_from([None, 2 * C])), "decay_low_rank_dim": draw(st.sampled_from([2, 4])),
            "a_low_rank_dim": draw(st.sampled_from([2, 4])), "v_low_rank_dim": draw(st.sampled_from([2, 3])),
            "gate_low_rank_dim": draw(st.sampled_from([3, 6])), "intermediate_size": draw(st.sampled_from([None, 24])),
            "num_hidden_layers": n, "norm_eps": draw(st.sampled_from([1e-5, 1e-3])),
            "fuse_norm": draw(st.booleans()), "norm_bias": draw(st.booleans()), "norm_first": draw(st.booleans()),
            "tie_word_embeddings": draw(st.booleans())}


LFM_KINDS = st.sampled_from(["conv", "full_attention"])


def lfm_common(draw, model_type: str, kinds=LFM_KINDS) -> dict:
    """Kwargs every LFM generation draws: width, heads, depth and layer kinds, conv width and
    biases, RoPE base, tie."""
    n = draw(st.integers(1, 4))
    heads = draw(st.sampled_from([1, 2, 4]))
    return {**family(model_type).tiny,
            "vocab_size": draw(VOCAB), "hidden_size": draw(st.sampled_from([8, 16])), "num_attention_heads": heads,
            "num_key_value_heads": draw(st.sampled_from(divisors(heads))), "num_hidden_layers": n,
            "layer_types": draw(st.lists(kinds, min_size=n, max_size=n)),
            "conv_L_cache": draw(st.sampled_from([2, 3, 5])), "conv_bias": draw(st.booleans()),
            "rope_parameters": {"rope_type": "default", "rope_theta": draw(st.sampled_from([100.0, 1e6]))},
            "tie_word_embeddings": draw(st.booleans())}


@st.composite
def lfm2_configs(draw) -> dict:
    """``Lfm2Config`` kwargs: the shared LFM ones, the SwiGLU width rule (adjusted or not, the
    multiplier and rounding)."""
    return {**lfm_common(draw, "lfm2"), "intermediate_size": draw(st.sampled_from([12, 24, 48])),
            "block_auto_adjust_ff_dim": draw(st.booleans()), "block_multiple_of": draw(st.sampled_from([4, 16])),
            "block_ffn_dim_multiplier": draw(st.sampled_from([0.5, 1.0, 1.5]))}


@st.composite
def lfm2_moe_configs(draw) -> dict:
    """``Lfm2MoeConfig`` kwargs: the shared LFM ones, dense layers, experts and routing (the
    expert bias on or off, renormalised or not, scaled)."""
    E = draw(st.sampled_from([2, 4]))
    return {**lfm_common(draw, "lfm2_moe"), "num_dense_layers": draw(st.integers(0, 2)), "num_experts": E,
            "num_experts_per_tok": draw(st.integers(1, E)), "moe_intermediate_size": draw(st.sampled_from([4, 8])),
            "use_expert_bias": draw(st.booleans()), "norm_topk_prob": draw(st.booleans()),
            "routed_scaling_factor": draw(st.sampled_from([1.0, 2.5]))}


@st.composite
def lfm3_configs(draw) -> dict:
    """``Lfm3Config`` kwargs: the shared LFM ones with sliding layers, head width, window, the
    sandwich norms and head gate on or off, biases, full attention's RoPE (proportional with a
    factor, or default)."""
    kw = lfm_common(draw, "lfm3", st.sampled_from(["conv", "full_attention", "sliding_attention"]))
    full = draw(st.sampled_from([{"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
                                 {"rope_type": "proportional", "rope_theta": 500.0, "partial_rotary_factor": 0.25,
                                  "factor": 2.0},
                                 {"rope_type": "default", "rope_theta": 1e4}]))
    kw["rope_parameters"] = {"full_attention": full, "sliding_attention": kw["rope_parameters"]}
    return {**kw, "head_dim": draw(st.sampled_from([4, 8])), "sliding_window": draw(st.integers(1, 6)),
            "use_sandwich_norm": draw(st.booleans()), "use_attention_gate": draw(st.booleans()),
            "attention_bias": draw(st.booleans())}


@st.composite
def xlstm_configs(draw) -> dict:
    """transformers ``xLSTMConfig`` kwargs: width, heads, query-key and value widths, biases, chunk
    size (mostly below the test lengths: chunk-wise rows and step-wise tails), gate and logit soft
    caps, the normaliser's and the norms' eps, feed-forward width, depth. Always
    ``weight_mode="single"``: transformers 5.23 cannot build a "fused" model (its weight init fails;
    ``tests/test_xlstm.py`` checks "fused" against a torch model built around that), and always the
    default ``max_inference_chunksize`` (its pieces need widths that are multiples of 64)."""
    return {**family("xlstm").tiny,
            "vocab_size": draw(VOCAB), "hidden_size": draw(st.sampled_from([16, 32])),
            "num_heads": draw(st.sampled_from([1, 2, 4])), "qk_dim_factor": draw(st.sampled_from([0.5, 1.0])),
            "v_dim_factor": draw(st.sampled_from([0.5, 1.0, 1.5])),
            "use_bias": draw(st.booleans()), "chunk_size": draw(st.sampled_from([2, 4, 64])),
            "gate_soft_cap": draw(st.sampled_from([15.0, 3.0])),
            "output_logit_soft_cap": draw(st.sampled_from([30.0, 2.0])), "eps": draw(st.sampled_from([1e-6, 1e-2])),
            "norm_eps": draw(st.sampled_from([1e-6, 1e-3])), "ffn_proj_factor": draw(st.sampled_from([1.0, 2.667])),
            "ffn_round_up_to_multiple_of": draw(st.sampled_from([8, 16])), "num_hidden_layers": draw(st.integers(1, 2))}


CONFIGS = {"mamba": mamba_configs, "mamba2": mamba2_configs, "recurrent_gemma": recurrent_gemma_configs,
           "rwkv": rwkv_configs, "falcon_mamba": falcon_mamba_configs,
           "bamba": bamba_configs, "granitemoehybrid": granite_configs,
           "jamba": jamba_configs, "nemotron_h": nemotron_h_configs,
           "falcon_h1": falcon_h1_configs, "zamba2": zamba2_configs, "zamba": zamba_configs,
           "qwen3_next": qwen3_next_configs, "qwen3_5_text": qwen3_5_configs,
           "qwen3_5_moe_text": qwen3_5_moe_configs, "olmo_hybrid": olmo_hybrid_configs,
           "lara_mini": lara_mini_configs,
           "kimi_linear": kimi_linear_configs, "bailing_hybrid": bailing_hybrid_configs, "minimax": minimax_configs,
           "rwkv5": rwkv5_configs, "rwkv6": rwkv6_configs, "rwkv7": rwkv7_configs,
           "lfm2": lfm2_configs, "lfm2_moe": lfm2_moe_configs, "lfm3": lfm3_configs, "xlstm": xlstm_configs}


def model_types():
    """Strategy of every registered ``model_type`` that has a config strategy here."""
    return st.sampled_from([t for t in registered_types() if t in CONFIGS])


def configs(model_type: str | None = None):
    """Strategy of valid small HF config dicts (kwargs of ``FamilySpec.hf_config_class``)
    of ``model_type`` (None: of any registered family, drawn with ``model_types()``)."""
    if model_type is None:
        return model_types().flatmap(configs)
    family(model_type)  # ValueError naming the supported types
    if model_type not in CONFIGS:
        raise NotImplementedError(f"no config strategy for {model_type!r} yet (registered: {sorted(FAMILIES)}); "
                                  f"add one to implicit_attn.testing.strategies.CONFIGS")
    return CONFIGS[model_type]()


def as_strategy(x):
    """``x`` if it is a strategy, else ``just(x)``."""
    return x if isinstance(x, st.SearchStrategy) else st.just(x)


def input_ids(vocab_size: int, batch=st.integers(1, 2), length=st.integers(1, 12)):
    """Strategy of ``(batch, length)`` int64 token id arrays in ``[0, vocab_size)``;
    ``batch`` and ``length`` are ints or integer strategies."""
    return st.tuples(as_strategy(batch), as_strategy(length)).flatmap(
        lambda bl: hnp.arrays(np.int64, bl, elements=st.integers(0, vocab_size - 1)))


@st.composite
def model_inputs(draw, model_type: str | None = None, batch=st.integers(1, 2), length=st.integers(1, 12)):
    """Strategy of ``(model_type, config, ids (B, L))`` drawn together (ids within the
    config's vocabulary); ``model_type`` None draws the family too."""
    t = draw(as_strategy(model_type) if model_type is not None else model_types())
    config = draw(configs(t))
    return t, config, draw(input_ids(config["vocab_size"], batch, length))


__all__ = ["configs", "model_types", "input_ids", "model_inputs", "mamba_configs", "mamba2_configs",
           "recurrent_gemma_configs", "rwkv_configs", "CONFIGS", "divisors"]
