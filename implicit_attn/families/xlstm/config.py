"""xLSTM configuration: the fields of transformers' ``xLSTMConfig`` (``model_type: "xlstm"``) with
its defaults, checked, and the values whose math we do not build refused by name.

Widths as the torch layer builds them (not the config's rounded ``qk_dim`` properties):
``qk_dim = int(hidden_size * qk_dim_factor)``, ``v_dim = int(hidden_size * v_dim_factor)``, split
over ``num_heads``; the feed-forward width is ``hidden_size * ffn_proj_factor`` rounded up to a
multiple of ``ffn_round_up_to_multiple_of``.

What the reference computes (transformers without the ``xlstm`` package: its own native kernels,
whatever the kernel names say): in ``mode="inference"`` the chunk-wise kernel on the longest prefix
that is a multiple of ``chunk_size`` and the step-by-step kernel on the rest, in pieces of
``max_inference_chunksize`` positions when the input is longer. Refused (``ValueError`` naming the
field): ``chunkwise_kernel="parallel--native_autograd"`` (transformers runs the chunk-wise kernel
anyway, the ``xlstm`` package a parallel one with another stabiliser), ``mode="train_with_padding"``
(transformers' layer cannot run it), ``mode="train"`` with ``return_last_states=false`` (likewise),
``inference_state_dtype`` other than float32 (a state in half precision),
``norm_reduction_force_float32=false`` (norm statistics in the checkpoint dtype; ours are float32),
``add_out_norm=false`` (transformers applies the output norm anyway, the ``xlstm`` package does
not), ``tie_word_embeddings=true`` (transformers' xLSTM never ties its head), an ``embedding_dim``
other than ``hidden_size`` and a ``num_blocks`` other than ``num_hidden_layers``.
``autocast_kernel_dtype`` and ``use_cache`` change nothing in a full forward and are kept as given.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from ...nn import HFConfig
from ...nn.config import MAX_LAYERS

MODES = ("inference", "train")
STATE_DTYPES = ("float32",)
AUTOCAST_DTYPES = ("float32", "bfloat16", "float16")
WEIGHT_MODES = ("single", "fused")


def round_up(x: float, multiple: int) -> int:
    """``x`` rounded up to a multiple of ``multiple`` (as transformers rounds the feed-forward width)."""
    return int(((x + multiple - 1) // multiple) * multiple)


@dataclasses.dataclass(frozen=True)
class Config(HFConfig):
    """transformers ``xLSTMConfig`` (its defaults); see the module docstring for what is refused."""

    model_type: ClassVar[str] = "xlstm"
    architecture: ClassVar[str] = "xLSTMForCausalLM"
    label: ClassVar[str] = "xLSTM"

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int = 32
    num_heads: int = 8
    use_bias: bool = False
    norm_reduction_force_float32: bool = True
    tie_word_embeddings: bool = False
    add_out_norm: bool = True
    norm_eps: float = 1e-6
    qk_dim_factor: float = 0.5
    v_dim_factor: float = 1.0
    chunkwise_kernel: str = "chunkwise--native_autograd"
    sequence_kernel: str = "native_sequence__native"
    step_kernel: str = "native"
    mode: str = "inference"
    chunk_size: int = 64
    return_last_states: bool = True
    autocast_kernel_dtype: str = "bfloat16"
    eps: float = 1e-6
    inference_state_dtype: str = "float32"
    ffn_proj_factor: float = 2.667
    ffn_round_up_to_multiple_of: int = 64
    gate_soft_cap: float = 15.0
    output_logit_soft_cap: float = 30.0
    weight_mode: str = "single"
    max_inference_chunksize: int = 16384

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        """``embedding_dim`` / ``num_blocks`` (transformers' aliases) must agree with ``hidden_size`` /
        ``num_hidden_layers`` where both are given, and stand in for them where not."""
        for alias, name in (("embedding_dim", "hidden_size"), ("num_blocks", "num_hidden_layers")):
            if d.get(alias) is None:
                continue
            if name in kw and kw[name] != d[alias]:
                raise ValueError(f"xLSTM {alias} ({d[alias]}) differs from {name} ({kw[name]}): not supported")
            kw[name] = d[alias]
        return kw

    def write_hf(self, d: dict) -> dict:
        d.update(embedding_dim=self.hidden_size, num_blocks=self.num_hidden_layers)
        return d

    def __post_init__(self):
        """Validate every field (``ValueError`` naming the field and its value)."""
        self.check_ints("vocab_size", "hidden_size", "num_heads", "chunk_size", "ffn_round_up_to_multiple_of",
                        "max_inference_chunksize")
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        self.check_bools("use_bias", "norm_reduction_force_float32", "tie_word_embeddings", "add_out_norm",
                         "return_last_states")
        self.check_floats("norm_eps", "eps", low=0.0)
        self.check_floats("qk_dim_factor", "v_dim_factor", "ffn_proj_factor", "gate_soft_cap",
                          "output_logit_soft_cap", above=0.0)
        self.check_choice("chunkwise_kernel", ("chunkwise--native_autograd",), self.label)
        self.check_choice("sequence_kernel", ("native_sequence__native",), self.label)
        self.check_choice("step_kernel", ("native",), self.label)
        self.check_choice("mode", MODES, self.label)
        self.check_choice("inference_state_dtype", STATE_DTYPES, self.label)
        self.check_choice("autocast_kernel_dtype", AUTOCAST_DTYPES, self.label)
        self.check_choice("weight_mode", WEIGHT_MODES, self.label)
        if self.mode == "train" and not self.return_last_states:
            raise ValueError("xLSTM mode 'train' with return_last_states false is not supported (transformers' "
                             "layer cannot unpack the kernel's output)")
        for name, why in (("norm_reduction_force_float32", "norm statistics in the checkpoint dtype are not "
                           "implemented (ours are float32)"),
                          ("add_out_norm", "transformers applies the output norm whatever it says, the xlstm "
                           "package does not")):
            if not getattr(self, name):
                raise ValueError(f"xLSTM {name} false is not supported: {why}")
        if self.tie_word_embeddings:
            raise ValueError("xLSTM tie_word_embeddings true is not supported: transformers' xLSTMForCausalLM "
                             "never ties lm_head to the embeddings")
        for name, width in (("qk_dim", self.qk_dim), ("v_dim", self.v_dim)):
            if width < 1 or width % self.num_heads:
                raise ValueError(f"xLSTM {name} ({width} = int(hidden_size x {name}_factor)) must be a positive "
                                 f"multiple of num_heads ({self.num_heads})")

    @property
    def qk_dim(self) -> int:
        return int(self.hidden_size * self.qk_dim_factor)

    @property
    def v_dim(self) -> int:
        return int(self.hidden_size * self.v_dim_factor)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_dim // self.num_heads

    @property
    def v_head_dim(self) -> int:
        return self.v_dim // self.num_heads

    @property
    def ffn_size(self) -> int:
        """The feed-forward width (``up_proj_dim``)."""
        return round_up(self.hidden_size * self.ffn_proj_factor, self.ffn_round_up_to_multiple_of)

    @property
    def norm_bias(self) -> bool:
        """Whether the block norms carry a bias (``use_bias``; the output norm never does)."""
        return self.use_bias

    @property
    def norm_first(self) -> bool:
        """No norm of the embeddings before layer 0 (for ``rwkv.checkpoint.blocks_checkpoint``)."""
        return False

    @property
    def segment(self) -> int:
        """The piece length of the reference's forward (``max_inference_chunksize``)."""
        return self.max_inference_chunksize


__all__ = ["Config", "round_up", "MODES", "WEIGHT_MODES"]
