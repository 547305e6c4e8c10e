"""Float64 references of Nemotron-H's mixers (for tests): the Mamba-2 formula of
``mamba2.naive`` and the softmax attention formula of ``griffin.naive`` (full window, no
RoPE), dispatched per layer as for Bamba."""
from ..bamba.naive import naive_operator

__all__ = ["naive_operator"]
