"""Kimi-Linear configuration (HF ``KimiLinearConfig`` fields).

Layers are Kimi Delta Attention (``"linear_attention"``, ours ``"delta"``) or MLA full attention
without positional encoding (``"full_attention"``, ours ``"attention"``): from ``layer_types``, or
the checkpoint's ``linear_attn_config`` (``full_attn_layers`` / ``kda_layers``, numbered from 1),
or HF's default (attention at every layer ``i > 0`` with ``i % 4 == 0``). Each layer's
feed-forward part is a SwiGLU MLP (``"dense"``) or a sigmoid-routed mixture of experts with
shared experts (``"sparse"``): from ``mlp_layer_types``, else the first ``first_k_dense_replace``
(default 1) layers dense. ``linear_attn_config`` may also set the KDA's ``head_dim``,
``num_heads`` and ``short_conv_kernel_size``, as HF reads it.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from ...nn import HFConfig
from ...nn.config import MAX_LAYERS
from ..qwen3_next.config import HF_LAYER_NAMES, LAYER_NAMES, DeltaNetFields

MLP_KINDS = {"dense": "mlp", "sparse": "moe"}
# HF's ``attribute_map``: attribute name -> the name its config.json uses (HF reads either; our
# fields carry the config.json names, so a message names what the file holds)
JSON_NAMES = {"norm_topk_prob": "moe_renormalize", "n_group": "num_expert_group", "num_local_experts": "num_experts",
              "num_experts_per_tok": "num_experts_per_token", "n_shared_experts": "num_shared_experts"}
HF_MLP_KINDS = {"mlp": "dense", "moe": "sparse"}


def read_attribute_names(d: dict, kw: dict) -> dict:
    """``kw`` with the fields HF's config dict ``d`` gives under HF's attribute names
    (``JSON_NAMES``); ``ValueError`` naming both where the two names disagree."""
    for attr, ours in JSON_NAMES.items():
        if d.get(attr) is not None:
            if ours in kw and kw[ours] != d[attr]:
                raise ValueError(f"{attr} ({d[attr]!r}) and {ours} ({kw[ours]!r}) are the same field and disagree")
            kw[ours] = d[attr]
    return kw


@dataclasses.dataclass(frozen=True)
class Config(DeltaNetFields, HFConfig):
    """The fields of HF ``KimiLinearConfig`` the forward pass needs (HF's defaults)."""

    model_type: ClassVar[str] = "kimi_linear"
    architecture: ClassVar[str] = "KimiLinearForCausalLM"
    label: ClassVar[str] = "Kimi-Linear"
    projections: ClassVar[str] = "kda"
    delta_norm_name: ClassVar[str] = "o_norm.weight"
    delta_out_name: ClassVar[str] = "o_proj.weight"
    # the chains of projections giving the KDA's forget-gate input and output gate (low rank here)
    forget_projections: ClassVar[tuple] = ("f_a_proj.weight", "f_b_proj.weight")
    gate_projections: ClassVar[tuple] = ("g_a_proj.weight", "g_b_proj.weight")
    # the MLA's output projection, per-head output gate (none here) and the router's bias
    attention_out_name: ClassVar[str] = "o_proj"
    attention_head_gate: ClassVar[bool] = False
    router_bias_name: ClassVar[str] = "gate.e_score_correction_bias"

    vocab_size: int
    hidden_size: int
    intermediate_size: int = 9216
    moe_intermediate_size: int = 1024
    num_hidden_layers: int = 27
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    num_shared_experts: int = 1
    routed_scaling_factor: float = 2.446
    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    num_expert_group: int = 1
    topk_group: int = 1
    num_experts_per_token: int = 8
    moe_renormalize: bool = True
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts: int = 256
    mlp_layer_types: tuple | None = None
    layer_types: tuple | None = None
    linear_head_dim: int = 128
    linear_num_heads: int = 32
    linear_conv_kernel_dim: int = 4
    # not used by the forward pass; kept so that HF can build the model from the config we write
    pad_token_id: int | None = 163839

    def __post_init__(self):
        """Validate every field (``ValueError`` naming it)."""
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        self.check_ints("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                        "num_attention_heads", "num_key_value_heads", "kv_lora_rank", "v_head_dim",
                        "num_expert_group", "topk_group", "num_experts_per_token", "num_experts", "linear_head_dim",
                        "num_shared_experts",
                        "linear_num_heads", "linear_conv_kernel_dim")
        self.check_ints("qk_rope_head_dim", "qk_nope_head_dim", low=0)
        if self.q_lora_rank is not None:
            self.check_ints("q_lora_rank")
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        self.check_floats("rms_norm_eps", low=0.0)
        self.check_floats("routed_scaling_factor")
        self.check_bools("moe_renormalize", "tie_word_embeddings", "attention_bias")
        self.check_choice("hidden_act", ("silu",), self.label)
        if self.pad_token_id is not None:
            self.check_ints("pad_token_id", low=0)
            if self.pad_token_id >= self.vocab_size:
                raise ValueError(f"pad_token_id ({self.pad_token_id}) must be below vocab_size ({self.vocab_size})")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"num_key_value_heads ({self.num_key_value_heads}) must equal num_attention_heads "
                             f"({self.num_attention_heads}): MLA expands its latent into every head")
        if self.qk_head_dim < 1:
            raise ValueError("qk_nope_head_dim + qk_rope_head_dim must be at least 1")
        n = self.num_hidden_layers
        self.check_layer_kinds("layer_types", LAYER_NAMES,
                               tuple("attention" if i and i % 4 == 0 else "delta" for i in range(n)))
        self.check_layer_kinds("mlp_layer_types", MLP_KINDS, ("mlp",) + ("moe",) * (n - 1))
        for name in ("layer_types", "mlp_layer_types"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"num_hidden_layers ({n}) must equal the number of {name} "
                                 f"({len(getattr(self, name))})")
        if self.num_experts % self.num_expert_group:
            raise ValueError(f"num_experts ({self.num_experts}) must be a multiple of num_expert_group "
                             f"({self.num_expert_group})")
        if "moe" in self.mlp_layer_types:
            if not 1 <= self.topk_group <= self.num_expert_group:
                raise ValueError(f"topk_group ({self.topk_group}) must be in [1, num_expert_group "
                                 f"({self.num_expert_group})]")
            if self.num_experts // self.num_expert_group < 2:
                raise ValueError(f"each of the num_expert_group ({self.num_expert_group}) expert groups needs at "
                                 f"least 2 of the "
                                 f"num_experts ({self.num_experts}): groups are scored by their best two")
            if not 1 <= self.num_experts_per_token <= self.topk_group * (self.num_experts // self.num_expert_group):
                raise ValueError(f"num_experts_per_token ({self.num_experts_per_token}) must be in [1, the experts of "
                                 f"the topk_group ({self.topk_group}) chosen groups]")

    # the KDA's sizes under the names the Gated DeltaNet code reads (keys and values share heads and width)
    @property
    def linear_num_key_heads(self) -> int:
        return self.linear_num_heads

    @property
    def linear_num_value_heads(self) -> int:
        return self.linear_num_heads

    @property
    def linear_key_head_dim(self) -> int:
        return self.linear_head_dim

    @property
    def linear_value_head_dim(self) -> int:
        return self.linear_head_dim

    @property
    def gate_lower_bound(self) -> float | None:
        """None: log decays ``-exp(A_log) softplus(g)``; a number ``c``: ``c sigmoid(exp(A_log) g)``."""
        return None

    @property
    def mla_rope_theta(self) -> float | None:
        """None: MLA without positional encoding."""
        return None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def ffn_kinds(self) -> tuple[str, ...]:
        return self.mlp_layer_types

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        """The checkpoint forms HF reads: its ``attribute_map`` names, ``linear_attn_config`` and
        ``first_k_dense_replace``."""
        kw = read_attribute_names(d, kw)
        lin = d.get("linear_attn_config") or {}
        if not isinstance(lin, dict):
            raise ValueError(f"linear_attn_config must be an object, got {lin!r}")
        for ours, theirs in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                             ("linear_conv_kernel_dim", "short_conv_kernel_size")):
            if lin.get(theirs) is not None:
                kw[ours] = lin[theirs]
        n = kw.get("num_hidden_layers", cls.num_hidden_layers)
        if "layer_types" not in kw and "full_attn_layers" in lin and "kda_layers" in lin:
            types = [None] * n if isinstance(n, int) and 0 < n <= MAX_LAYERS else []
            for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
                for i in lin[key]:
                    if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= len(types):
                        raise ValueError(f"linear_attn_config.{key} holds {i!r}, not a layer number in "
                                         f"[1, num_hidden_layers {n}]")
                    types[i - 1] = kind
            kw["layer_types"] = types  # a layer in neither list is left None: a named error in __post_init__
        if "mlp_layer_types" not in kw and isinstance(n, int) and 0 < n <= MAX_LAYERS:
            k = d.get("first_k_dense_replace", 1)
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise ValueError(f"first_k_dense_replace must be a non-negative integer, got {k!r}")
            kw["mlp_layer_types"] = ["dense" if i < k else "sparse" for i in range(n)]
        if "pad_token_id" in d and d["pad_token_id"] is None:
            kw["pad_token_id"] = None
        return kw

    def write_hf(self, d: dict) -> dict:
        d["layer_types"] = [HF_LAYER_NAMES[t] for t in self.layer_types]
        d["mlp_layer_types"] = [HF_MLP_KINDS[t] for t in self.mlp_layer_types]
        return d


__all__ = ["Config", "MLP_KINDS", "HF_MLP_KINDS", "JSON_NAMES", "read_attribute_names"]
