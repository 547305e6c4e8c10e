"""Models the project defines itself (not Hugging Face families, not in the registry):
built from the shared parts (``nn``), with the operator interface and the hooks of
``nn.LanguageModel``, so that ``explain`` runs on them unchanged.

* ``las``: the causal LaS-attention transformer (LM and classifier) of Zimerman & Wolf.
* ``vim``: Vision Mamba (bidirectional Mamba blocks on image patches with a CLS token) and its
  non-causal operator.
"""
from . import las, vim

__all__ = ["las", "vim"]
