"""Bad mixer/block inputs shared by the family tests: each must fail with a clear error."""
import numpy as np

BAD_BLOCK_INPUTS = {  # (shape from d_model, dtype, message)
    "integer": (lambda D: (1, 4, D), np.int32, "floating point"),
    "rank": (lambda D: (4, D), np.float32, "got rank 2"),
    "width": (lambda D: (1, 4, D + 1), np.float32, "last dimension"),
    "empty": (lambda D: (1, 0, D), np.float32, "length >= 1"),
}
