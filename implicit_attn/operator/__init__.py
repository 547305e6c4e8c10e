"""Operator types and every operator core (layer 2: imports only ``ops``).

``ImplicitOperator`` / ``Mamba2Operator`` (recurrent mixers) and ``AttentionOperator``
(attention layers) share one interface: ``values``, ``offset``, ``output``, ``core``,
``materialize``, ``reduce``, ``apply``, ``relative_error``. Cores implement
``OperatorCore``; kernels register with ``dispatch``.
"""
from .attention import AttentionOperator
from .base import (BLOCK_BUDGET, MODES, REDUCTIONS, OperatorCore, apply_mode, block_size, channel_index,
                   channel_weights, pytree_dataclass)
from .cores import (AttentionCore, BidirectionalCore, DeltaRuleCore, DocumentMaskedCore, DplrCore, HeadMatrixCore,
                    LaSCore, Mamba2Core, MlstmCore, ParallelCore, RwkvCore, ScalarDecayCore, ShortConvCore,
                    StateDecayCore, channel_heads, span_heads)
from .dispatch import (KernelBackend, blocked_reduce, default_platform, impls, register_backend, register_core,
                       resolve_impl, with_xla_backward)
from .implicit import HEAD_MATRICES, ImplicitOperator, Mamba2Operator

__all__ = ["ImplicitOperator", "Mamba2Operator", "AttentionOperator", "OperatorCore", "StateDecayCore",
           "ScalarDecayCore", "DocumentMaskedCore", "Mamba2Core", "HeadMatrixCore", "DeltaRuleCore", "DplrCore",
           "MlstmCore", "RwkvCore", "ShortConvCore", "AttentionCore", "LaSCore", "ParallelCore", "BidirectionalCore",
           "KernelBackend", "default_platform", "register_backend", "register_core", "resolve_impl", "impls",
           "blocked_reduce", "with_xla_backward", "pytree_dataclass", "channel_index", "channel_weights", "block_size",
           "apply_mode", "MODES", "REDUCTIONS", "BLOCK_BUDGET", "HEAD_MATRICES", "channel_heads", "span_heads"]
