"""Pure functions shared by all blocks: arrays in, arrays out."""
from .conv import causal_conv, conv_matrix, conv_right
from .materialize import scalar_decay_kernel, state_decay_kernel
from .scan import linear_scan
from .segsum import causal_mask, decay_matrix, segment_sum

__all__ = [
    "causal_conv", "conv_matrix", "conv_right", "scalar_decay_kernel",
    "state_decay_kernel", "linear_scan", "causal_mask", "decay_matrix", "segment_sum",
]
