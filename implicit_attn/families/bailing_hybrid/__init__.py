"""Bailing-Hybrid (HF ``BailingHybridForCausalLM``, ``model_type: "bailing_hybrid"``, Ling 3.0):
Kimi-Linear's layers (``kimi_linear.block``, same exact KDA operator and variants) with a bounded
KDA forget gate and single-projection gates, MLA with RoPE on its shared key part and a per-head
output gate, DeepSeek-V3's mixture of experts; the checkpoint names as HF writes them.
"""
from ...nn import FamilySpec
from ..kimi_linear import EXACT_VARIANTS, VARIANTS, hf_setup, naive_operator
from .checkpoint import STATE_DICT_NAMES, expected_shapes, from_params, init_params, to_params
from .config import Config
from .modules import LM, AttentionMixer, BailingHybridLayer, DeltaMixer


def unread_tensors(config: dict) -> tuple[str, ...]:
    """The tensors HF's model does not read: the ``num_mtp_layers`` (HF's default 1; saved as
    ``num_nextn_predict_layers``) multi-token-prediction layers stored after the last layer
    (``layers.{n}.`` on), as HF's ``_keys_to_ignore_on_load_unexpected`` lists them; none where
    the two counts are not integers (the config check then names the field)."""
    n = config.get("num_hidden_layers", Config.num_hidden_layers)
    m = config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 1))
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (n, m)):
        return ()
    return tuple(rf"(^|\.)layers\.{i}\." for i in range(n, n + m))


SPEC = FamilySpec(
    model_type="bailing_hybrid", label="Bailing-Hybrid", config=Config, lm=LM, variants=VARIANTS,
    exact_variants=EXACT_VARIANTS, to_params=to_params, from_params=from_params, expected_shapes=expected_shapes,
    init_params=init_params, naive_operator=naive_operator, hf_class="BailingHybridForCausalLM",
    hf_config_class="BailingHybridConfig",
    # layers: KDA + MLP, MLA + MoE, KDA + MoE; 2 heads of 4 (KDA and MLA); 2 expert groups of 2;
    # the gate's bound at -1 (Ling's -5 forgets within a few steps at these sizes)
    tiny=dict(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=3,
              num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, qk_rope_head_dim=4, v_head_dim=4,
              qk_nope_head_dim=4, head_dim=4, n_group=2, topk_group=1, num_experts_per_tok=2, num_local_experts=4,
              routed_scaling_factor=2.0, kda_lower_bound=-1.0, rope_theta=10000.0, pad_token_id=None,
              bos_token_id=None, eos_token_id=None, num_mtp_layers=0,
              layer_types=["linear_attention", "full_attention", "linear_attention"],
              mlp_layer_types=["dense", "sparse", "sparse"]),
    hf_setup=hf_setup, hf_mixer="model.layers.{i}.self_attn", has_heads=True,
    # Ling 3.0's layout scaled down: MLA every sixth layer (so 6 layers), the first two dense
    bench={"full": dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=128,
                        num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=128,
                        qk_rope_head_dim=32, v_head_dim=32, qk_nope_head_dim=32, head_dim=32, n_group=4,
                        topk_group=2, num_experts_per_tok=4, num_local_experts=16, pad_token_id=None,
                        bos_token_id=None, eos_token_id=None, num_mtp_layers=0),
           "quick": dict(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                         qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16, head_dim=16, n_group=2,
                         topk_group=1, num_experts_per_tok=2, num_local_experts=4, layer_group_size=3,
                         pad_token_id=None, bos_token_id=None, eos_token_id=None, num_mtp_layers=0)},
    unread_tensors=unread_tensors, state_dict_names=STATE_DICT_NAMES)

__all__ = ["SPEC", "Config", "LM", "DeltaMixer", "AttentionMixer", "BailingHybridLayer", "VARIANTS",
           "EXACT_VARIANTS", "to_params", "from_params", "expected_shapes", "init_params", "naive_operator",
           "unread_tensors"]
