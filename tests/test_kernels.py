"""Pallas kernels (interpret mode on CPU) against the XLA reference path.

Operators come from every family's own pure functions on random weights (tiny
configs), so the cores are exactly what the models produce. Tile 8 with L = 37 gives
5 x 5 tiles (a ragged last tile, tiles between row and column tiles); L = 1 and
batch 2 are covered too.
"""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from implicit_attn import kernels
from implicit_attn.families import griffin, mamba, mamba2, rwkv
from implicit_attn.kernels import pallas
from implicit_attn.operator import ImplicitOperator, ScalarDecayCore, resolve_impl

B, L, TILE = 2, 37, 8
HOWS = ("mean", "abs_mean", "pos_mean", "weighted")


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.fixture(scope="module", autouse=True)
def small_tile():
    old = pallas.DEFAULT_TILE
    pallas.DEFAULT_TILE = TILE
    yield
    pallas.DEFAULT_TILE = old


def _mamba(L_=L):
    cfg = mamba.Config(vocab_size=8, hidden_size=4, state_size=4, num_hidden_layers=1, conv_kernel=4)
    p = mamba.init_params(cfg, jax.random.PRNGKey(1))["layers"][0]["mixer"]
    h = jax.random.normal(jax.random.PRNGKey(2), (B, L_, 4))
    return mamba.block.mixer_operator_jit(p, h, cfg=cfg)


def _mamba2():
    cfg = mamba2.Config(vocab_size=8, hidden_size=4, num_heads=2, head_dim=3, state_size=4, n_groups=2,
                        expand=2, chunk_size=8)
    p = mamba2.init_params(cfg, jax.random.PRNGKey(1))["layers"][0]["mixer"]
    h = jax.random.normal(jax.random.PRNGKey(2), (B, L, 4))
    return mamba2.block.mixer_operator_jit(p, h, cfg=cfg)


def _griffin_cfg():
    return griffin.Config(vocab_size=8, hidden_size=8, intermediate_size=4, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, lru_width=6,
                          block_types=("recurrent", "attention"))


def _griffin(L_=L, restart=True):
    cfg = _griffin_cfg()
    params = griffin.init_params(cfg, jax.random.PRNGKey(1))
    p = params["layers"][0]["temporal_block"]
    h = jax.random.normal(jax.random.PRNGKey(2), (B, L_, 8))
    pos = np.tile(np.arange(L_), (B, 1))
    if restart and L_ > 20:  # a second packed document in batch row 1
        pos[1, 20:] = np.arange(L_ - 20)
    return griffin.block.recurrent_operator_jit(p, h, jnp.asarray(pos), cfg=cfg)


def _rwkv():
    cfg = rwkv.Config(vocab_size=8, hidden_size=4, attention_hidden_size=4, intermediate_size=4,
                      num_hidden_layers=1)
    att = rwkv.init_params(cfg, jax.random.PRNGKey(1))["layers"][0]["attention"]
    att["time_decay"] = jnp.array([-3.0, -0.5, 0.5, 1.6])  # slow to fast decays
    h = jax.random.normal(jax.random.PRNGKey(2), (B, L, 4))
    return rwkv.block.time_mix_operator_jit(att, h, cfg=cfg)


def _scalar_lowrank():
    """A generic ScalarDecayCore with q k^T groups, a diagonal, both scalings, a reset, a conv."""
    r = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
    C, G, N = 5, 2, 3
    la = -jnp.abs(f(B, G, L))
    la = la.at[0, 1, 17].set(-jnp.inf)
    core = ScalarDecayCore(log_a=la, group=jnp.array([1, 0, 0, 1, 1]), q=f(B, G, L, N), k=f(B, G, L, N),
                           left=f(B, C, L), right=f(B, C, L), diag=f(B, C, L), conv_w=f(C, 3))
    v = f(B, C, L)
    return ImplicitOperator(values=v, offset=jnp.zeros_like(v), output=v, core=core)


BUILDERS = {"mamba": _mamba, "mamba2": _mamba2, "griffin": _griffin, "rwkv": _rwkv,
            "scalar_lowrank": _scalar_lowrank}


@pytest.fixture(scope="module")
def ops():
    return {k: f() for k, f in BUILDERS.items()}


@pytest.mark.parametrize("family", list(BUILDERS))
def test_materialize_and_reduce_match_xla(ops, family):
    op = ops[family]
    C = op.shape[1]
    chans = [C - 1, 0, 2]  # a subset, out of order
    ref = op.materialize(chans, impl="xla")
    out = op.materialize(chans, impl="pallas")
    assert out.shape == (B, 3, L, L)
    assert rel(out, ref) <= 1e-5, rel(out, ref)
    assert np.all(np.triu(np.asarray(out), 1) == 0)  # exact zeros above the diagonal
    if family != "scalar_lowrank":  # the model's own output, through the pallas operator
        idx = jnp.asarray(chans)
        y = jnp.einsum("bcij,bcj->bci", out, op.values[:, idx]) + op.offset[:, idx]
        assert rel(y, op.output[:, idx]) <= 1e-5
    w = jax.random.normal(jax.random.PRNGKey(3), (B, C, L))
    kw = jax.random.normal(jax.random.PRNGKey(4), (B, C, L))
    for how in HOWS:
        kwargs = dict(weights=w, key_weights=kw) if how == "weighted" else {}
        a = op.reduce(how, impl="pallas", **kwargs)
        b = op.reduce(how, impl="xla", **kwargs)
        assert a.shape == (B, L, L)
        assert rel(a, b) <= 1e-5, (how, rel(a, b))


def test_document_mask_zeroes_cross_document_entries(ops):
    """The Griffin operator packs two documents in batch row 1: no entry crosses the start."""
    op = ops["griffin"]
    assert type(op.core).__name__ == "DocumentMaskedCore"
    H = np.asarray(op.materialize([0, 5], impl="pallas"))
    assert np.all(H[1, :, 20:, :20] == 0) and np.any(H[0, :, 20:, :20] != 0)


def test_length_one_and_single_tile():
    op = _griffin(L_=1)
    for chans in ([3], None):
        a, b = op.materialize(chans, impl="pallas"), op.materialize(chans, impl="xla")
        assert a.shape[-2:] == (1, 1) and rel(a, b) <= 1e-5
    assert rel(op.reduce("abs_mean", impl="pallas"), op.reduce("abs_mean", impl="xla")) <= 1e-5


def test_tile_larger_than_length_and_blocked_materialize(ops):
    """L = 37 in one 64-wide tile (ragged), and block_channels splitting the channels."""
    op = ops["mamba"]
    ref = op.materialize(impl="xla")
    a = kernels.pallas_dense(op.core, np.arange(op.shape[1]), tile=64)
    assert rel(a, ref) <= 1e-5
    b = op.materialize(impl="pallas", block_channels=3)
    assert rel(b, ref) <= 1e-5


def test_materialize_gradient_matches_xla(ops):
    """custom_vjp (backward through the XLA reference) equals the XLA path's gradient."""
    op = ops["griffin"]
    R = jax.random.normal(jax.random.PRNGKey(5), (B, 2, L, L))

    def loss(core, impl):
        o = ImplicitOperator(op.values, op.offset, op.output, core)
        return jnp.sum(o.materialize([1, 4], impl=impl) * R)

    gp = jax.jit(jax.grad(lambda c: loss(c, "pallas"), allow_int=True))(op.core)
    gx = jax.jit(jax.grad(lambda c: loss(c, "xla"), allow_int=True))(op.core)
    for name in ("log_a", "left", "right", "conv_w"):
        a, b = getattr(gp.inner, name), getattr(gx.inner, name)
        assert np.any(np.asarray(b) != 0) and rel(a, b) <= 1e-5, name


def test_reduce_gradient_matches_xla(ops):
    op = ops["rwkv"]
    C = op.shape[1]
    w = jax.random.normal(jax.random.PRNGKey(6), (B, C, L))

    def loss(core, w, impl):
        o = ImplicitOperator(op.values, op.offset, op.output, core)
        return jnp.sum(o.reduce("weighted", weights=w, impl=impl) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    gp = grad(op.core, w, "pallas")
    gx = grad(op.core, w, "xla")
    for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(gx)):
        assert rel(a, b) <= 1e-5


def test_attention_core_has_no_kernel_and_auto_is_xla_on_cpu():
    cfg = _griffin_cfg()
    params = griffin.init_params(cfg, jax.random.PRNGKey(1))
    p = params["layers"][1]["temporal_block"]
    h = jax.random.normal(jax.random.PRNGKey(2), (1, 5, 8))
    op = griffin.block.attention_operator_jit(p, h, jnp.arange(5)[None], cfg=cfg)
    with pytest.raises(TypeError, match="AttentionCore"):
        op.materialize(impl="pallas")
    with pytest.raises(TypeError, match="AttentionCore"):
        op.reduce(impl="pallas")
    assert not pallas.has_kernel(op.core)
    assert jax.default_backend() == "cpu"
    assert resolve_impl("auto", op.core) == "xla"
    assert resolve_impl("auto", _scalar_lowrank().core) == "xla"  # CPU: XLA even with a kernel
    assert resolve_impl("pallas", _scalar_lowrank().core) == "pallas"
    with pytest.raises(ValueError, match="impl must be one of"):
        op.materialize(impl="triton")


def test_bad_arguments_fail_loudly(ops):
    core = ops["griffin"].core
    with pytest.raises(ValueError, match="tile must be a positive int"):
        kernels.pallas_dense(core, [0], tile=0)
    with pytest.raises(ValueError, match="conv width 4 needs a tile of at least 3"):
        kernels.pallas_dense(core, [0], tile=2)
    with pytest.raises(ValueError, match="how must be one of"):
        kernels.pallas_reduce(core, [0], "max", jnp.ones((B, 1, L)), jnp.ones((B, 1, L)))
