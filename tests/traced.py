"""What a traced program asks of the hardware: the precision of its matrix products."""
from __future__ import annotations

import jax


def dot_precisions(jaxpr) -> list:
    """The ``precision`` of every dot_general in a jaxpr, nested ones (jit, scan, cond, custom
    derivatives, Pallas kernels) included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(eqn.params["precision"])
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                if hasattr(sub, "eqns"):
                    out += dot_precisions(sub)
                elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                    out += dot_precisions(sub.jaxpr)
    return out


def assert_full_float32_products(*fns):
    """The calls ``fn()`` trace at least one matrix product among them, and every one asks for
    HIGHEST (GPUs run the default float32 product in TF32, 10 mantissa bits)."""
    precisions = [pr for fn in fns for pr in dot_precisions(jax.make_jaxpr(fn)().jaxpr)]
    assert precisions, "no product traced"
    highest = jax.lax.Precision.HIGHEST
    assert all(pr is not None and all(x == highest for x in pr) for pr in precisions), precisions
