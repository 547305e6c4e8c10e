"""Nemotron-H configuration (HF ``NemotronHConfig`` fields) and the Mamba-2 config its Mamba
layers run with.

HF's Nemotron-H layers each hold one mixer, ``h + mixer(rms_norm(h))``: Mamba-2
(``"linear_attention"``, pattern ``M``), attention (``"full_attention"``, ``*``), an MLP
(``"mlp"``, ``-``) or a mixture of experts (``"moe"``, ``E``). Our layers are the
token-mixing ones: layer ``k`` is the ``k``-th Mamba or attention layer together with the
MLP / MoE layers that follow it up to the next token-mixing layer (``Config.blocks`` lists
the HF layer indices of each).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

from ...nn import HFConfig
from ...nn.attention import NoPositionFields
from ...nn.config import float_to_json
from ..bamba.config import Mamba2Fields
from ..mamba2.config import MixerConfig, family_mixer_config

# HF layer-type names (and the legacy ones HF remaps) -> ours.
LAYER_NAMES = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention",
               "attention": "attention", "mlp": "mlp", "moe": "moe"}
HF_LAYER_NAMES = {"mamba": "linear_attention", "attention": "full_attention", "mlp": "mlp", "moe": "moe"}
# ``hybrid_override_pattern`` characters (HF's legacy form of the layer types).
PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
TOKEN_MIXERS = ("mamba", "attention")
DEFAULT_LAYERS = ("mamba", "moe", "attention", "mlp")  # HF's default layers_block_type
# Legacy keyword names HF's config renames on load.
LEGACY = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_min": "time_step_min",
          "mamba_dt_limit": "time_step_limit", "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size",
          "num_local_experts": "n_routed_experts"}
# Mamba-2 config fields -> the Nemotron-H fields they come from (for error messages).
MAMBA_FIELDS = {"num_heads": "mamba_num_heads", "head_dim": "mamba_head_dim", "state_size": "ssm_state_size",
                "hidden_act": "mamba_hidden_act", "time_step_limit": "time_step_limit"}


@dataclasses.dataclass(frozen=True)
class Config(NoPositionFields, HFConfig):
    """The fields of HF ``NemotronHConfig`` the forward pass needs.

    ``layers_block_type`` holds HF's layer kinds, ``"mamba"`` / ``"attention"`` / ``"mlp"`` /
    ``"moe"`` per HF layer (read from ``layers_block_type``, ``layer_types`` or
    ``hybrid_override_pattern`` as HF does); it must start with a token-mixing layer. The
    Mamba layers clamp ``dt`` to ``time_step_limit`` (default ``(0, inf)``, as HF from transformers
    5.25; 5.24 clamped it below at ``time_step_min``, which now only sets the initial ``dt_bias``);
    attention has no positional encoding and no biases; the MLPs and experts are
    ``down(relu(up x)^2)``; the router is sigmoid group-limited top-k with a score correction
    bias, and every MoE adds a shared expert. HF never ties the output head.
    """

    model_type: ClassVar[str] = "nemotron_h"
    architecture: ClassVar[str] = "NemotronHForCausalLM"
    label: ClassVar[str] = "Nemotron-H"
    norm_weight_in_float32: ClassVar[bool] = True  # HF applies the norms' weight before the cast
    attention_bias: ClassVar[bool] = False  # HF's q/k/v/o have no biases whatever the config says
    tie_word_embeddings: ClassVar[bool] = False  # HF never ties lm_head

    vocab_size: int
    hidden_size: int
    layers_block_type: tuple | None = None
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int = 128
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    ssm_state_size: int = 128
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    mamba_hidden_act: str = "silu"
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    use_bias: bool = False
    time_step_min: float = 0.001
    time_step_limit: tuple = (0.0, float("inf"))
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self):
        """Validate every field (``ValueError`` naming it); resolve ``num_key_value_heads=None``
        and ``layers_block_type=None`` (HF's default four layers)."""
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        self.check_layer_kinds("layers_block_type", LAYER_NAMES, DEFAULT_LAYERS)
        types = self.layers_block_type
        if types[0] not in TOKEN_MIXERS:
            raise ValueError(f"Nemotron-H layers_block_type must start with a token-mixing layer (mamba or attention; "
                             f"implicit_attn groups each mlp/moe layer with the token-mixing layer before it), got "
                             f"{types[0]!r} first")
        self.check_ints("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                        "intermediate_size", "ssm_state_size", "mamba_num_heads", "mamba_head_dim", "n_groups",
                        "conv_kernel", "chunk_size", "n_routed_experts", "num_experts_per_tok",
                        "moe_intermediate_size", "moe_shared_expert_intermediate_size", "n_group", "topk_group")
        if self.moe_latent_size is not None:
            self.check_ints("moe_latent_size")
        self.check_floats("layer_norm_epsilon", low=0.0)
        self.check_floats("time_step_min", low=0.0)
        if isinstance(self.time_step_limit, list):
            object.__setattr__(self, "time_step_limit", tuple(self.time_step_limit))
        self.check_floats("routed_scaling_factor")
        self.check_bools("mlp_bias", "use_conv_bias", "use_bias", "norm_topk_prob")
        self.check_choice("mlp_hidden_act", ("relu2",), self.label)
        if "moe" in types:
            E = self.n_routed_experts
            if E % self.n_group or E // self.n_group < 2:
                raise ValueError(f"n_routed_experts ({E}) must be n_group ({self.n_group}) groups of at least 2 "
                                 f"experts (the router sums each group's two best scores)")
            if self.topk_group > self.n_group:
                raise ValueError(f"topk_group ({self.topk_group}) must be at most n_group ({self.n_group})")
            if self.num_experts_per_tok > self.topk_group * (E // self.n_group):
                kept = self.topk_group * (E // self.n_group)
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the {kept} experts of "
                                 f"the topk_group ({self.topk_group}) kept groups")
        self.check_attention_fields()
        self.mixer_config  # validates the Mamba-2 fields with their messages

    @property
    def blocks(self) -> tuple[tuple[int, ...], ...]:
        """Per layer of ours, the HF layer indices it holds: a token-mixing layer, then the
        MLP / MoE layers up to the next one."""
        out = []
        for i, t in enumerate(self.layers_block_type):
            if t in TOKEN_MIXERS:
                out.append([i])
            else:
                out[-1].append(i)
        return tuple(tuple(b) for b in out)

    @property
    def layer_types(self) -> tuple[str, ...]:
        """``"mamba"`` or ``"attention"`` per layer of ours."""
        return tuple(self.layers_block_type[b[0]] for b in self.blocks)

    @property
    def num_hidden_layers(self) -> int:
        """The number of our layers (token-mixing layers); HF's is ``len(layers_block_type)``."""
        return len(self.blocks)

    @property
    def rms_norm_eps(self) -> float:
        return self.layer_norm_epsilon

    @property
    def mamba_channels(self) -> int:
        """Operator channels of a Mamba layer (``mamba_num_heads * mamba_head_dim``)."""
        return self.mamba_num_heads * self.mamba_head_dim

    @functools.cached_property  # built once per config (its fields are frozen)
    def mixer_config(self) -> MixerConfig:
        """The Mamba-2 config of the Mamba layers (HF ``NemotronHMamba2Mixer``: ``dt`` clamped
        to ``time_step_limit``, gated-norm eps ``layer_norm_epsilon``)."""
        return family_mixer_config(
            MixerConfig, self.label, MAMBA_FIELDS, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            num_heads=self.mamba_num_heads, head_dim=self.mamba_head_dim, state_size=self.ssm_state_size,
            n_groups=self.n_groups, conv_kernel=self.conv_kernel, chunk_size=self.chunk_size,
            layer_norm_epsilon=self.layer_norm_epsilon, use_bias=self.use_bias, use_conv_bias=self.use_conv_bias,
            hidden_act=self.mamba_hidden_act, time_step_limit=self.time_step_limit)

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        for old, new in LEGACY.items():
            if new not in kw and d.get(old) is not None:
                kw[new] = d[old]
        if "layers_block_type" not in kw:
            if d.get("layer_types") is not None:
                kw["layers_block_type"] = d["layer_types"]  # HF's alias
            elif d.get("hybrid_override_pattern") is not None:
                pattern = d["hybrid_override_pattern"]
                bad = sorted(set(str(pattern)) - set(PATTERN)) if isinstance(pattern, str) else [pattern]
                if bad:
                    raise ValueError(f"hybrid_override_pattern must be a string of {''.join(PATTERN)}, got "
                                     f"{pattern!r}")
                kw["layers_block_type"] = [PATTERN[c] for c in pattern]
        return Mamba2Fields.read_time_step_limit(kw)

    def write_hf(self, d: dict) -> dict:
        d["layers_block_type"] = [HF_LAYER_NAMES[t] for t in self.layers_block_type]
        d["time_step_limit"] = [float_to_json(t) for t in self.time_step_limit]
        return d


__all__ = ["Config", "LAYER_NAMES", "HF_LAYER_NAMES", "PATTERN", "TOKEN_MIXERS"]
