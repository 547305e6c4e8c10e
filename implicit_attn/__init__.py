"""implicit_attn: the implicit attention of gated linear RNNs, exactly.

    import implicit_attn as ia
    model = ia.load("path/to/hf_dir")
    logits = model(input_ids)                      # (B, L, vocab)
    ops = model.operators(input_ids)               # one ImplicitOperator per layer
    H = ops[0].materialize(channels=[0, 1])        # (B, 2, L, L)
    A = ops[0].reduce("abs_mean")                  # (B, L, L)
"""
from __future__ import annotations

__version__ = "0.1.0"

from .io import load, save, family_of
from .operator import ImplicitOperator, ScalarDecayCore, StateDecayCore

__all__ = ["load", "save", "family_of", "ImplicitOperator", "ScalarDecayCore", "StateDecayCore",
           "__version__"]
