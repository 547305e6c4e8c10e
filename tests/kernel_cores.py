"""Operators for the kernel tests: every core type with a Pallas kernel, built from each
family's (or model's) own pure functions on random weights (tiny configs), so the cores are
exactly what the models produce, plus a generic ``ScalarDecayCore`` with every optional part.
Each builder takes the length ``L_`` and batch ``B``. ``NoKernelCore`` is a core type no backend
has a kernel for (each of the library's core types has one in at least one backend)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from implicit_attn.families import (falcon_h1, griffin, kimi_linear, lfm2, mamba, mamba2, qwen3_next, rwkv, rwkv6,
                                    rwkv7, xlstm, zamba)
from implicit_attn.models import las, vim
from implicit_attn.operator import (DocumentMaskedCore, ImplicitOperator, OperatorCore, ScalarDecayCore,
                                    pytree_dataclass)

B, L = 2, 37


def mamba_op(L_=L, B=B):
    cfg = mamba.Config(vocab_size=8, hidden_size=4, state_size=4, num_hidden_layers=1, conv_kernel=4)
    p = mamba.init_params(cfg, jax.random.PRNGKey(1))["layers"][0]["mixer"]
    h = jax.random.normal(jax.random.PRNGKey(2), (B, L_, 4))
    return mamba.block.mixer_operator_jit(p, h, cfg=cfg)


def mamba2_op(L_=L, B=B):
    cfg = mamba2.Config(vocab_size=8, hidden_size=4, num_heads=2, head_dim=3, state_size=4, n_groups=2,
                        expand=2, chunk_size=8)
    p = mamba2.init_params(cfg, jax.random.PRNGKey(1))["layers"][0]["mixer"]
    h = jax.random.normal(jax.random.PRNGKey(2), (B, L_, 4))
    return mamba2.block.mixer_operator_jit(p, h, cfg=cfg)


def griffin_cfg():
    return griffin.Config(vocab_size=8, hidden_size=8, intermediate_size=4, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, lru_width=6,
                          block_types=("recurrent", "attention"))


def griffin_op(L_=L, B=B, restart=True):
    cfg = griffin_cfg()
    params = griffin.init_params(cfg, jax.random.PRNGKey(1))
    p = params["layers"][0]["temporal_block"]
    h = jax.random.normal(jax.random.PRNGKey(2), (B, L_, 8))
    pos = np.tile(np.arange(L_), (B, 1))
    if restart and L_ > 20 and B > 1:  # a second packed document in batch row 1
        pos[1, 20:] = np.arange(L_ - 20)
    return griffin.block.recurrent_operator_jit(p, h, jnp.asarray(pos), cfg=cfg)


def local_attention_op(L_=L, B=B):
    """Griffin's local attention with a window of 11 (no multiple of the tiles), 4 query heads
    reading 2 key heads, and a second packed document in batch row 1 (``AttentionCore``)."""
    cfg = dataclasses.replace(griffin_cfg(), num_attention_heads=4, num_key_value_heads=2,
                              lru_width=8, attention_window_size=11)
    p = griffin.init_params(cfg, jax.random.PRNGKey(1))["layers"][1]["temporal_block"]
    h = jax.random.normal(jax.random.PRNGKey(2), (B, L_, 8))
    pos = np.tile(np.arange(L_), (B, 1))
    if L_ > 20 and B > 1:
        pos[1, 20:] = np.arange(L_ - 20)
    return griffin.block.attention_operator_jit(p, h, jnp.asarray(pos), cfg=cfg)


def rwkv_op(L_=L, B=B):
    cfg = rwkv.Config(vocab_size=8, hidden_size=4, attention_hidden_size=4, intermediate_size=4,
                      num_hidden_layers=1)
    att = rwkv.init_params(cfg, jax.random.PRNGKey(1))["layers"][0]["attention"]
    att["time_decay"] = jnp.array([-3.0, -0.5, 0.5, 1.6])  # slow to fast decays
    h = jax.random.normal(jax.random.PRNGKey(2), (B, L_, 4))
    return rwkv.block.time_mix_operator_jit(att, h, cfg=cfg)


def delta_op(L_=L, B=B, family=qwen3_next):
    """A delta-rule layer of a tiny model (Qwen3-Next: one decay per head; 2 key heads serve 4
    value heads; conv, gate and norm folded in)."""
    spec = family.SPEC
    cfg = spec.config.from_hf(dict(spec.tiny))
    p = spec.init_params(cfg, jax.random.PRNGKey(1))["layers"][0]["mixer"]
    h = jax.random.normal(jax.random.PRNGKey(2), (B, L_, cfg.hidden_size))
    return family.block.mixer_operator_jit(p, h, cfg=cfg, kind="delta")


def kda_op(L_=L, B=B):
    """Kimi Delta Attention: one decay per key dimension."""
    return delta_op(L_, B, family=kimi_linear)


def dplr_op(L_=L, B=B):
    """An RWKV-7 time mix (layer 1: the value residual; DPLR transition read after the update, the
    ``r_k`` diagonal outside the norm), 2 heads of 8 channels."""
    spec = rwkv7.SPEC
    cfg = spec.config(**spec.tiny)
    p = spec.init_params(cfg, jax.random.PRNGKey(1))["layers"][1]["attn"]
    x = jax.random.normal(jax.random.PRNGKey(2), (B, L_, cfg.hidden_size + cfg.value_width))
    return rwkv7.block.time_mix_operator_jit(p, x, cfg=cfg)


def dplr_before_op(L_=L, B=B):
    """An RWKV-6 time mix (read before the update, the bonus ``u`` on the diagonal), decays from
    slow down to ``e^-20`` a step."""
    spec = rwkv6.SPEC
    cfg = spec.config(**spec.tiny)
    p = dict(spec.init_params(cfg, jax.random.PRNGKey(1))["layers"][0]["attn"])
    p["w_proj.linear.lora.2.bias"] = jnp.linspace(-5.0, 3.0, cfg.key_dim)
    x = jax.random.normal(jax.random.PRNGKey(2), (B, L_, cfg.hidden_size))
    return rwkv6.block.time_mix_operator_jit(p, x, cfg=cfg)


def tiny_mixer_params(spec, L_, B, mixer="mixer"):
    """``(cfg, layer 0's mixer params, random mixer input (B, L_, d))`` of the family's tiny model."""
    cfg = spec.config.from_hf(dict(spec.tiny))
    p = spec.init_params(cfg, jax.random.PRNGKey(1))["layers"][0][mixer]
    return cfg, p, jax.random.normal(jax.random.PRNGKey(2), (B, L_, cfg.hidden_size))


def mlstm_op(L_=L, B=B):
    """An xLSTM mLSTM layer (2 heads; the stabiliser and normaliser of the layer's forward; inputs
    scaled by 3, so the input gates span about -8 to 10 of the soft cap's +-15)."""
    cfg, p, h = tiny_mixer_params(xlstm.SPEC, L_, B, "mlstm_layer")
    return xlstm.block.mixer_operator_jit(p, 3.0 * h, cfg=cfg)


def zamba_op(L_=L, B=B):
    """A Zamba Mamba layer: a ``ParallelCore`` of two Mamba-1 heads, each with its own B and C."""
    cfg, p, h = tiny_mixer_params(zamba.SPEC, L_, B)
    return zamba.block.mamba_operator_jit(p, h, cfg=cfg.mixer_config)


def falcon_h1_op(L_=L, B=B):
    """A Falcon-H1 layer: a ``ParallelCore`` of a Mamba-2 core and 4 attention heads (each repeated
    over its 8 value features), the attention part without a Pallas kernel."""
    cfg, p, h = tiny_mixer_params(falcon_h1.SPEC, L_, B)
    return falcon_h1.block.mixer_operator_jit(p, h, cfg=cfg)


def short_conv_op(L_=L, B=B):
    """An LFM2 short-convolution layer (``ShortConvCore``: the banded conv matrix, gated both sides)."""
    cfg, p, h = tiny_mixer_params(lfm2.SPEC, L_, B)
    return lfm2.block.mixer_operator_jit(p, h, cfg=cfg, kind="conv")


def vim_op(L_=L, B=B):
    """A Vision Mamba block (``BidirectionalCore``: Mamba-1 forward and backward, not causal)."""
    cfg = vim.Config(image_size=8, patch_size=2, hidden_size=8, num_labels=5, num_channels=2, num_hidden_layers=1,
                     state_size=3, conv_kernel=3, time_step_rank=2)
    p = vim.init_params(cfg, 1)["layers"][0]["mixer"]
    return vim.mixer_operator_jit(p, jax.random.normal(jax.random.PRNGKey(2), (B, L_, 8)), cfg=cfg)


def las_op(L_=L, B=B):
    """A LaS attention layer (``LaSCore``) with every part: ELD and ALiBi, pooling ``P = 3`` centered
    (a key window reaching both neighbouring tiles), LaS-chunk blocks of 16 (no multiple of the
    tiles, and not dividing 37)."""
    cfg = las.Config(vocab_size=8, hidden_size=8, num_attention_heads=4, num_hidden_layers=1, B=0.9, alibi=True,
                     pool=3, pool_align="centered", chunk=16)
    p = las.init_params(cfg, 1)["layers"][0]["mixer"]
    return las.mixer_operator(p, jax.random.normal(jax.random.PRNGKey(2), (B, L_, 8)), cfg)


@pytree_dataclass(static=("B", "L"))
class NoKernelCore(OperatorCore):
    """A core type no backend registers: every channel the causal mask times its ``scale (C,)``,
    ``B`` examples of length ``L``."""

    scale: object
    B: int = 1
    L: int = 5

    @property
    def num_channels(self) -> int:
        return self.scale.shape[0]

    def dense(self, idx):
        mask = jnp.tril(jnp.ones((self.L, self.L), jnp.float32))
        return jnp.broadcast_to(jnp.take(self.scale, idx)[None, :, None, None] * mask,
                                (self.B, len(idx), self.L, self.L))


def scalar_lowrank_op(L_=L, B=B):
    """A generic ScalarDecayCore with q k^T groups, a diagonal, both scalings, a reset, a conv."""
    r = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
    C, G, N = 5, 2, 3
    la = -jnp.abs(f(B, G, L_))
    if L_ > 17:
        la = la.at[0, 1, 17].set(-jnp.inf)
    core = ScalarDecayCore(log_a=la, group=jnp.array([1, 0, 0, 1, 1]), q=f(B, G, L_, N), k=f(B, G, L_, N),
                           left=f(B, C, L_), right=f(B, C, L_), diag=f(B, C, L_), conv_w=f(C, 3))
    v = f(B, C, L_)
    return ImplicitOperator(values=v, offset=jnp.zeros_like(v), output=v, core=core)


def document_ids(B_, L_):
    """``(B_, L_)`` int32 document ids: the last batch row three documents (from ``L_ // 3`` and
    ``L_ // 2``), the others one."""
    seg = np.zeros((B_, L_), np.int32)
    seg[-1, L_ // 3:] = 1
    seg[-1, L_ // 2:] = 2
    return jnp.asarray(seg)


def documents_op(L_=L, B=B):
    """Mamba-2's operator with packed documents (``document_ids``): a ``DocumentMaskedCore`` over a
    core whose kernel takes no document ids (no family builds one)."""
    op = mamba2_op(L_, B)
    masked = DocumentMaskedCore(inner=op.core, seg=document_ids(B, L_))
    return ImplicitOperator(values=op.values, offset=op.offset, output=op.output, core=masked)


BUILDERS = {"mamba": mamba_op, "mamba2": mamba2_op, "griffin": griffin_op, "rwkv": rwkv_op,
            "scalar_lowrank": scalar_lowrank_op, "delta": delta_op, "kda": kda_op,
            "dplr": dplr_op, "dplr_before": dplr_before_op, "mlstm": mlstm_op, "attention": local_attention_op,
            "short_conv": short_conv_op, "zamba": zamba_op, "falcon_h1": falcon_h1_op, "vim": vim_op, "las": las_op,
            "documents": documents_op}
# Builders whose operators are not causal (ViM reads both directions).
NOT_CAUSAL = {"vim"}
# Builders whose operators are not a model's (their output is not H v + offset).
SYNTHETIC = {"scalar_lowrank", "documents"}
