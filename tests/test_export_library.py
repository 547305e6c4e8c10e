"""Everything but the Pallas kernels exports for accelerators from this (CPU) machine.

For a tiny random model of every registered family, each function below goes through
``jax.export.export(jax.jit(f), platforms=[p])`` for ``p`` in ("cuda", "tpu"):

* the forward pass (logits), and the model call the faithfulness metrics make (a batch of
  ``batch_size`` perturbed inputs, logits at the query);
* ``model.operators``: every operator's fields, ``materialize`` / ``reduce`` by XLA and by
  ``impl="auto"``, a weighted ``reduce``, ``materialize`` of traced channels, ``apply``
  and (Mamba-2) ``head_matrices``;
* the explain functions that take arrays: ``model_maps`` (every ``how``, min-max),
  ``operator_map``, ``channel_maps``, ``head_maps`` (layers with heads), ``position_mean``,
  ``minmax_normalize``, ``output_gradients`` (argmax and given target), ``raw_attention``,
  ``rollout``, ``attribution_maps``, ``contribution_map``, and each ``explain`` method's
  relevance composed from them as ``explain`` does.

Each exported module must be for ``p`` alone, hold no host callback and no custom call
(these paths are plain XLA; above all not the C++ CPU kernel's FFI target; only on a
machine of platform ``p`` may ``impl="auto"`` add a compiled Pallas kernel), and take
the token ids (Griffin: and its document positions, the traced channels) as arguments,
not baked constants. ``explain`` itself and the metrics are host (numpy) drivers around
these pieces and are not jitted. Last, the choices ``"auto"`` makes on this machine follow
the platform lowered for: the sequential scan and the CPU kernel for CPU, the parallel
scan and XLA for accelerators (``dispatch.default_platform`` names the platform the
default backend lowers for).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicit_attn.explain import (attribution_maps, channel_maps, contribution_map, head_maps, iter_operators,
                                   minmax_normalize, model_maps, operator_map, output_gradients, position_mean,
                                   raw_attention, rollout)
from implicit_attn.explain.maps import HOWS, num_heads
from implicit_attn.families import griffin, mamba
from implicit_attn.kernels import cpu
from implicit_attn.operator import Mamba2Operator
from implicit_attn.operator.dispatch import default_platform
from implicit_attn.registry import FAMILIES

PLATFORMS = ("cuda", "tpu")
B, L = 2, 8
SCORER_BATCH = 16  # the metrics' default batch_size: every model call they make has this shape
# The compiled Pallas kernels' calls; a Triton call exports only with its check off.
KERNEL_CALLS = {"cuda": {"__gpu$xla.gpu.triton"}, "tpu": {"tpu_custom_call"}, "cpu": {"implicit_attn_selective_scan"}}
TRITON = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
# A CPU export may hold the forward's scan kernel (where it pays off); jax.export takes it only
# with its check off, and the module then runs where this library has registered it.
CPU_SCAN = jax.export.DisabledSafetyCheck.custom_call("implicit_attn_selective_scan")
CUSTOM_CALL = re.compile(r'stablehlo\.custom_call"?\s*@?([\w.$-]*)|call_target_name\s*=\s*"([^"]+)"')


def code(text: str) -> str:
    """A module's text without its source locations (file and function names)."""
    return "\n".join(line for line in text.splitlines() if not line.startswith("#loc"))


def custom_calls(text: str) -> set[str]:
    """The custom-call targets of a StableHLO module's text."""
    return {a or b for a, b in CUSTOM_CALL.findall(code(text))}


def exported(f, platform, *args):
    """``jax.export`` of ``jit(f)`` for ``platform``, checked: that platform only, no host
    callback, no custom call but the platform's kernels (``KERNEL_CALLS``), and every argument an
    input of the module."""
    exp = jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=[TRITON, CPU_SCAN])(*args)
    text = exp.mlir_module()
    assert exp.platforms == (platform,)
    assert "callback" not in code(text).lower(), "a host callback is in the exported module"
    # impl="auto" uses a kernel only where the code runs on the platform JAX runs on here
    # (on a GPU machine, a cuda export may hold the verified Pallas kernels).
    allowed = KERNEL_CALLS.get(platform, set()) if platform == default_platform() else set()
    assert custom_calls(text) <= allowed, f"custom calls in the exported module: {sorted(custom_calls(text))}"
    want = [(tuple(np.shape(a)), jnp.asarray(a).dtype) for a in jax.tree_util.tree_leaves(args)]
    assert [(a.shape, a.dtype) for a in exp.in_avals] == want
    return exp


def out_shapes(exp) -> list[tuple]:
    return [a.shape for a in exp.out_avals]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def fam(request):
    """``(model, ids (B, L) int32, extra)``: ``extra`` is ``(segment_pos,)`` (two documents
    per row) for families that take positions, else ``()``."""
    spec = FAMILIES[request.param]
    cfg = spec.config.from_hf(spec.tiny)
    model = spec.lm(cfg, spec.init_params(cfg, 0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (B, L)), jnp.int32)
    extra = ()
    if model.takes_segment_pos:
        extra = (jnp.asarray(np.tile(np.r_[np.arange(3), np.arange(L - 3)], (B, 1)), jnp.int32),)
    return model, ids, extra


def kwargs(extra) -> dict:
    return {"segment_pos": extra[0]} if extra else {}


@pytest.mark.parametrize("platform", PLATFORMS)
def test_forward_exports(fam, platform):
    model, ids, extra = fam
    V = model.config.vocab_size
    exp = exported(lambda i, *e: model(i, **kwargs(e)), platform, ids, *extra)
    assert out_shapes(exp) == [(B, L, V)]
    batch = jnp.tile(ids, (SCORER_BATCH // B, 1))
    ex = tuple(jnp.tile(e, (SCORER_BATCH // B, 1)) for e in extra)
    exp = exported(lambda i, *e: model(i, **kwargs(e))[:, -1], platform, batch, *ex)
    assert out_shapes(exp) == [(SCORER_BATCH, V)]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_operators_export(fam, platform):
    model, ids, extra = fam
    ops = model.operators(ids, **kwargs(extra))
    channels = jnp.asarray([1, 0], jnp.int32)

    def f(i, ch, *e):
        out = []
        for op in model.operators(i, **kwargs(e)):
            C = op.shape[1]
            r = {"fields": jax.tree_util.tree_leaves(op),
                 "materialize_xla": op.materialize(impl="xla"),
                 "reduce_xla": op.reduce("mean", impl="xla"),
                 "materialize_auto": op.materialize(),
                 "reduce_auto": op.reduce("abs_mean"),
                 "weighted": op.reduce("weighted", weights=jnp.linspace(-1.0, 1.0, C)),
                 "traced_channels": op.materialize(ch),
                 "apply": op.apply()}
            if isinstance(op, Mamba2Operator):
                r["alpha"] = op.head_matrices("alpha")
                r["head_mean"] = op.head_matrices("mean")
            out.append(r)
        return out

    exp = exported(f, platform, ids, channels, *extra)
    shapes = jax.tree_util.tree_unflatten(exp.out_tree, out_shapes(exp))
    assert len(shapes) == len(ops) == len(model.layers)
    for op, s in zip(ops, shapes):
        assert s["fields"] == [x.shape for x in jax.tree_util.tree_leaves(op)]
        assert s["materialize_xla"] == s["materialize_auto"] == op.shape
        assert s["reduce_xla"] == s["reduce_auto"] == s["weighted"] == (B, L, L)
        assert s["traced_channels"] == (B, 2, L, L)
        assert s["apply"] == op.output.shape
        if isinstance(op, Mamba2Operator):
            assert s["alpha"] == s["head_mean"] == (B, op.core.num_heads, L, L)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_explain_maps_export(fam, platform):
    model, ids, extra = fam
    N = len(model.layers)
    ops = model.operators(ids, **kwargs(extra))

    def f(i, *e):
        kw = kwargs(e)
        out = {"model_maps": [model_maps(model, i, how=h, **kw) for h in HOWS],
               "minmax": model_maps(model, i, how="abs_mean", normalize="minmax", **kw), "layers": []}
        for _, op in iter_operators(model, i, **kw):
            r = {"operator_map": operator_map(op, "pos_mean", channels=[0, 1]),
                 "channel_maps": channel_maps(op, channels=[0], absolute=True, normalize="minmax"),
                 "position_mean": position_mean(op.output),
                 "minmax_normalize": minmax_normalize(op.reduce("mean"))}
            if num_heads(op) is not None:
                r["head_maps"] = head_maps(op, how="mean")
            out["layers"].append(r)
        return out

    exp = exported(f, platform, ids, *extra)
    s = jax.tree_util.tree_unflatten(exp.out_tree, out_shapes(exp))
    assert s["model_maps"] == [(N, B, L, L)] * len(HOWS) and s["minmax"] == (N, B, L, L)
    for op, r in zip(ops, s["layers"], strict=True):
        assert r["operator_map"] == r["minmax_normalize"] == (B, L, L)
        assert r["channel_maps"] == (B, 1, L, L) and r["position_mean"] == (B, L)
        assert ("head_maps" in r) == (num_heads(op) is not None)
        if "head_maps" in r:
            assert r["head_maps"] == (B, num_heads(op), L, L)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("target", [None, [3, 5]], ids=["argmax", "given"])
def test_explain_methods_export(fam, platform, target):
    """Each method's relevance as ``explain`` composes it (the target, when given, is
    validated on the host, so it is a constant of the module)."""
    model, ids, extra = fam
    N = len(model.layers)

    def f(i, *e):
        kw = kwargs(e)
        maps = model_maps(model, i, **kw)
        grads, q, t = output_gradients(model, i, query=-1, target=target, **kw)
        raw = raw_attention(maps, exclude=(0,))
        roll = rollout(maps, normalize_rows=True, exclude=(0,))
        attr = attribution_maps(maps, jnp.stack([position_mean(grads[l]) for l in range(N)]))
        contribs = jnp.stack([contribution_map(op, grads[l]) for l, op in iter_operators(model, i, **kw)])
        return {"target": jnp.asarray(t), "grads": [grads[l] for l in range(N)],
                "raw": raw[:, q], "rollout": roll[:, q], "attribution": rollout(attr)[:, q],
                "contributions": jnp.mean(jnp.sum(contribs, axis=2), axis=0), "attribution_maps": attr}

    exp = exported(f, platform, ids, *extra)
    s = jax.tree_util.tree_unflatten(exp.out_tree, out_shapes(exp))
    assert s["target"] == (B,)
    assert s["grads"] == [op.output.shape for op in model.operators(ids, **kwargs(extra))]
    assert s["raw"] == s["rollout"] == s["attribution"] == s["contributions"] == (B, L)
    assert s["attribution_maps"] == (N, B, L, L)


@pytest.mark.parametrize("platform", ("cpu",) + PLATFORMS)
def test_auto_scan_follows_the_lowering_platform(platform):
    """``method="auto"``: one sequential ``lax.scan`` (a while loop) when lowered for CPU (for
    Mamba's scan the fused kernel's call instead, where ``scan_pays_off``: here, at the suite's
    threshold 0), the associative scan (no loop, no call) for an accelerator, wherever it is
    traced."""
    rng = np.random.default_rng(1)
    u, dt = (jnp.asarray(rng.random((B, L, 4)), jnp.float32) for _ in range(2))
    A = -jnp.asarray(rng.random((4, 3)), jnp.float32)
    Bm, Cm = (jnp.asarray(rng.random((B, L, 3)), jnp.float32) for _ in range(2))
    for f, args in ((mamba.selective_scan, (u, dt, A, Bm, Cm)), (griffin.rglru_scan, (dt, u))):
        kernel = platform == "cpu" and f is mamba.selective_scan and cpu.scan_pays_off(u, A)
        text = exported(f, platform, *args).mlir_module()
        assert ("stablehlo.while" in text) == (platform == "cpu" and not kernel), (f.__name__, platform)
        assert custom_calls(text) == ({"implicit_attn_selective_scan"} if kernel else set()), (f.__name__, platform)


def test_default_platform_is_what_jit_lowers_for():
    """``impl="auto"`` keys its kernel on ``default_platform()``: it must be the name the
    default backend lowers for (``"cuda"``, not ``"gpu"``), or no lowering would match."""
    assert jax.export.export(jax.jit(jnp.sin))(jnp.ones(3)).platforms == (default_platform(),)


def test_auto_keeps_the_cpu_kernel_when_lowered_for_cpu():
    """On a CPU machine ``impl="auto"`` still runs the fused CPU kernel (its FFI custom call)
    where the code is lowered for the CPU; the exports above show XLA for accelerators."""
    if jax.default_backend() != "cpu" or not cpu.available():
        pytest.skip("the fused CPU kernel runs only on JAX's CPU backend with a C++ compiler")
    spec = FAMILIES["mamba"]
    cfg = spec.config.from_hf(spec.tiny)
    model = spec.lm(cfg, spec.init_params(cfg, 0))
    ids = jnp.zeros((B, L), jnp.int32)
    f = lambda i: [op.reduce("mean") for op in model.operators(i)]
    scan = cpu.scan_pays_off(jnp.zeros((B, L, cfg.intermediate_size)), jnp.zeros((cfg.intermediate_size, cfg.state_size)))
    assert custom_calls(jax.jit(f).lower(ids).as_text()) == {"implicit_attn_state_decay_reduce"} | (
        {"implicit_attn_selective_scan"} if scan else set())
    assert not custom_calls(exported(f, "cuda", ids).mlir_module())
