"""Falcon-Mamba (HF ``FalconMambaForCausalLM``, ``model_type: "falcon_mamba"``): the Mamba
block with a weightless RMSNorm on ``dt``, ``B`` and ``C`` (``Config.mixer_rms_eps``).

Everything else is Mamba's: block math, operator and variants (``mamba.block`` reads the
norm from the config), checkpoint names, init, float64 reference.
"""
from ...nn import FamilySpec
from ..mamba import VARIANTS, hf_setup, init_params, naive_operator
from ..mamba import SPEC as MAMBA
from .checkpoint import expected_shapes, from_params, to_params
from .config import Config
from .modules import LM, FalconMambaBlock, FalconMambaMixer

SPEC = FamilySpec(
    model_type="falcon_mamba", label="Falcon-Mamba", config=Config, lm=LM, variants=VARIANTS,
    exact_variants=MAMBA.exact_variants, to_params=to_params, from_params=from_params,
    expected_shapes=expected_shapes, init_params=init_params, naive_operator=naive_operator,
    hf_class="FalconMambaForCausalLM", hf_config_class="FalconMambaConfig",
    tiny={**MAMBA.tiny, "mixer_rms_eps": 1e-5},
    hf_setup=hf_setup, hf_mixer=MAMBA.hf_mixer,
    bench={k: {**v, "mixer_rms_eps": 1e-6} for k, v in MAMBA.bench.items()})

__all__ = ["SPEC", "Config", "LM", "FalconMambaMixer", "FalconMambaBlock", "VARIANTS", "to_params",
           "from_params", "expected_shapes", "init_params", "naive_operator"]
