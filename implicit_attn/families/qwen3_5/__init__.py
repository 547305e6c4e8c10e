"""Qwen3.5 (HF ``Qwen3_5ForCausalLM``, ``model_type: "qwen3_5_text"``, and
``Qwen3_5MoeForCausalLM``, ``"qwen3_5_moe_text"``): Qwen3-Next's Gated DeltaNet and gated
attention layers (``qwen3_next.block``, its exact operator and variants), with the DeltaNet's
input projections stored as four plain matrices, and a SwiGLU MLP (dense) or a mixture of experts
with a gated shared expert (MoE) in every layer. Two specs: ``SPEC`` and ``MOE_SPEC``.

The released checkpoints are the vision-language types ``qwen3_5`` and ``qwen3_5_moe``
(``Qwen3_5ForConditionalGeneration``): their language model (``text_config``, tensors under
``model.language_model.``) loads as the text family; the vision tower and the
multi-token-prediction head (``mtp.``, which transformers does not read either) are not read.
So do MiniCPM-V 4.6 / 4.7 and MiniCPM-OCR (``minicpmv4_6``, ``minicpmv4_7``, ``minicpm_ocr``),
vision-language models on Qwen3.5's text model. A text checkpoint whose tensors keep the
vision-language names (``model.language_model.``) loads too, as transformers reads it.
"""
from ...nn import FamilySpec
from ...nn.checkpoint import Container, vision_language
from ..qwen3_next import EXACT_VARIANTS, VARIANTS, hf_setup, naive_operator, unread_tensors
from ..qwen3_next import SPEC as QWEN3_NEXT
from ..qwen3_next.checkpoint import STATE_DICT_NAMES
from .checkpoint import MOE, TEXT
from .config import Config, MoeConfig
from .modules import LM, AttentionMixer, DeltaMixer, MoeLM, Qwen3_5Layer

def family_spec(config, lm, checkpoint, hf_class: str, hf_config_class: str,
                containers: tuple[Container, ...], state_dict_names=None) -> FamilySpec:
    """Qwen3-Next's spec with Qwen3.5's config, classes and checkpoint (Qwen3-Next's tiny and bench
    keys without the fields the HF config class deletes, ``config.ignored``), read from its own
    checkpoints and from ``containers``' (and under transformers' ``state_dict()`` names,
    ``state_dict_names``)."""
    keep = lambda d: {k: v for k, v in d.items() if k not in config.ignored}
    return FamilySpec(
        model_type=config.model_type, label=config.label, config=config, lm=lm, variants=VARIANTS,
        exact_variants=EXACT_VARIANTS, to_params=checkpoint.to_params, from_params=checkpoint.from_params,
        expected_shapes=checkpoint.expected_shapes, init_params=checkpoint.init_params,
        naive_operator=naive_operator, hf_class=hf_class, hf_config_class=hf_config_class,
        tiny=keep(QWEN3_NEXT.tiny), hf_setup=hf_setup, hf_mixer=QWEN3_NEXT.hf_mixer, has_heads=True,
        bench={k: keep(v) for k, v in QWEN3_NEXT.bench.items()}, containers=containers,
        unread_tensors=unread_tensors, tensor_prefixes=(("model.language_model.", "model."),),
        state_dict_names=state_dict_names)


# the vision tower is not read (nor the multi-token-prediction head: ``unread_tensors``), nor the
# vision side of OpenBMB's MiniCPM-V 4.6 / 4.7 and MiniCPM-OCR, built on Qwen3.5's text model
NOT_READ = ("model.visual.",)
MINICPM_NOT_READ = ("model.vision_tower.", "model.merger.")
SPEC = family_spec(Config, LM, TEXT, "Qwen3_5ForCausalLM", "Qwen3_5TextConfig",
                   (vision_language("qwen3_5", NOT_READ, tied=False),
                    vision_language("minicpmv4_6", MINICPM_NOT_READ, tied=False),
                    vision_language("minicpmv4_7", MINICPM_NOT_READ, tied=False),
                    vision_language("minicpm_ocr", MINICPM_NOT_READ, tied=True)))
MOE_SPEC = family_spec(MoeConfig, MoeLM, MOE, "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig",
                       (vision_language("qwen3_5_moe", NOT_READ, tied=False),), STATE_DICT_NAMES)

__all__ = ["SPEC", "MOE_SPEC", "Config", "MoeConfig", "LM", "MoeLM", "DeltaMixer", "AttentionMixer",
           "Qwen3_5Layer", "family_spec", "NOT_READ", "MINICPM_NOT_READ"]
