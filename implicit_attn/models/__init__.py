"""Model families. ``FAMILIES`` maps a checkpoint's ``model_type`` to its module;
each module defines ``Config`` (with ``from_hf``/``to_hf``) and ``LM`` (an NNX module
built by ``LM(config, params)``)."""
import importlib

FAMILIES = {
    "mamba": "implicit_attn.models.mamba",
    "mamba2": "implicit_attn.models.mamba2",
    "recurrent_gemma": "implicit_attn.models.griffin",
    "rwkv": "implicit_attn.models.rwkv",
}


def family_module(model_type: str):
    """The module implementing ``model_type``; a clear error for unknown types."""
    if model_type not in FAMILIES:
        raise ValueError(f"unknown model_type {model_type!r}; supported: {sorted(FAMILIES)}")
    try:
        return importlib.import_module(FAMILIES[model_type])
    except ModuleNotFoundError as e:
        if e.name == FAMILIES[model_type]:
            raise ValueError(f"model_type {model_type!r} is not implemented in this version") from e
        raise
