"""Float64 references of GraniteMoeHybrid's mixers (for tests): Bamba's (the Mamba-2
formula and softmax attention, here with Granite's scale and RoPE from the config)."""
from ..bamba.naive import naive_operator

__all__ = ["naive_operator"]
