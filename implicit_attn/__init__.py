"""implicit_attn: the implicit attention of gated linear RNNs, exactly.

    import implicit_attn as ia
    model = ia.load("path/to/hf_dir")
    logits = model(input_ids)                      # (B, L, vocab)
    ops = model.operators(input_ids)               # one operator per layer
    H = ops[0].materialize(channels=[0, 1])        # (B, 2, L, L)
    A = ops[0].reduce("abs_mean")                  # (B, L, L)

Layers, each importing only those before it: ``ops`` (pure math) <- ``operator`` (operator
types, cores, dispatch) <- ``kernels``, ``nn`` (shared model parts) <- ``families``, ``models``
(our own models, not in the registry: ``models.las``) <- ``registry`` <- ``io``, ``explain``, ``demo``,
``analyze`` (batch analysis into a Zarr store; ``implicit_attn.analyze`` is its function), ``cli``.
"""
from __future__ import annotations

import gc
import sys

# Importing jax, flax and our modules creates about 200,000 long-lived objects and no garbage;
# the cyclic collector's passes over them during the import cost 0.3-0.5 s of a 2-3 s import
# on a 2-core CPU, so it pauses until the import is done. freeze + unfreeze then moves every
# object straight to the oldest generation, where only a full collection looks at it, instead
# of one pass of the youngest and one of the middle generation over all of them (0.35-0.4 s).
# Nothing is kept from the collector: objects alive before the import just age faster.
_collecting = gc.isenabled()
gc.disable()
# flax asks IPython, at import, whether it runs in a notebook shell. Where IPython is not
# imported yet no shell exists, so the answer is no; importing IPython and prompt_toolkit to
# hear it took 0.3-0.6 s of a 3-4 s import on a 2-core CPU. While our imports run, an
# `import IPython` fails as if IPython were absent (flax then answers no itself); the block
# is lifted afterwards.
_block_ipython = "IPython" not in sys.modules
if _block_ipython:
    sys.modules["IPython"] = None
try:
    from .version import __version__
    from . import kernels  # registers the Pallas and CPU kernels with operator.dispatch
    from .analyze import analyze
    from .io import family_of, hub_cache_dir, load, load_tokenizer, resolve, save, tokenize
    from .nn import AttentionEdit
    from .nn.checkpoint import CheckpointError
    from .operator import (AttentionOperator, ImplicitOperator, Mamba2Operator, OperatorCore, ScalarDecayCore,
                           StateDecayCore)
    from .registry import FAMILIES, family, model_types
finally:
    if _block_ipython and "IPython" in sys.modules and sys.modules["IPython"] is None:
        del sys.modules["IPython"]
    gc.freeze()
    gc.unfreeze()
    if _collecting:
        gc.enable()

__all__ = ["AttentionEdit", "load", "save", "family_of", "load_tokenizer", "tokenize", "resolve", "hub_cache_dir", "family",
           "model_types", "FAMILIES", "CheckpointError",
           "ImplicitOperator", "Mamba2Operator", "AttentionOperator", "OperatorCore", "ScalarDecayCore",
           "StateDecayCore", "kernels", "analyze", "__version__"]
