"""Kernels behind ``impl=``: tiled Pallas kernels (``pallas``, GPU/TPU; interpret mode on
CPU) and fused C++ CPU kernels (``cpu``). Importing this package registers both with
``implicit_attn.operator.dispatch``, each for the core types it takes."""
from . import cpu, pallas
from .cpu import CpuKernelUnavailable
from .pallas import DEFAULT_TILE, on_accelerator, pallas_dense, pallas_reduce

__all__ = ["cpu", "pallas", "CpuKernelUnavailable", "pallas_dense", "pallas_reduce", "on_accelerator",
           "DEFAULT_TILE"]
