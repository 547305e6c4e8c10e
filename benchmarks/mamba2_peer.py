"""The JAX peer for Mamba-2: ``mamba2-jax`` (PyPI, pure JAX / Flax NNX) on the weights of
``benchmarks.forward``'s mamba2 row: logits parity with ours and HF, and its jitted forward's
first-call and steady-state times beside ours (issue 23: ours at least as fast, same logits).

mamba2-jax reads only the original ``state-spaces`` key names; our checkpoints are in
Hugging Face's layout, which differs only in the embedding's name (``backbone.embeddings``
there, ``backbone.embedding`` in state-spaces'). It supports one B/C group (``n_groups=1``)
and ties the head to the embedding unless told otherwise; both are read from config.json.

    python -m benchmarks.mamba2_peer [--quick]    # = python -m benchmarks.forward --only mamba2
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.forward import first_and_steady, main as forward_main, no_persistent_cache, random_ids

# HF Mamba2ForCausalLM name -> state-spaces name (every other key is the same in both)
HF_TO_STATE_SPACES = {"backbone.embeddings.weight": "backbone.embedding.weight"}


def state_spaces_weights(ckpt: str) -> dict:
    """The checkpoint's tensors (numpy) under state-spaces' key names."""
    from safetensors.numpy import load_file

    return {HF_TO_STATE_SPACES.get(k, k): v for k, v in load_file(str(Path(ckpt) / "model.safetensors")).items()}


def peer_config(ckpt: str):
    """``mamba2_jax.Mamba2Config`` for an HF-layout Mamba-2 checkpoint's config.json;
    ``ValueError`` for what mamba2-jax cannot express (several groups, heads that do not
    tile the inner width)."""
    import mamba2_jax

    c = json.loads((Path(ckpt) / "config.json").read_text())
    if c.get("n_groups", 1) != 1:
        raise ValueError(f"mamba2-jax supports n_groups=1 only, the checkpoint has n_groups={c['n_groups']}")
    inner = c.get("expand", 2) * c["hidden_size"]
    if c["num_heads"] * c["head_dim"] != inner:
        raise ValueError(f"mamba2-jax needs num_heads * head_dim == expand * hidden_size, got "
                         f"{c['num_heads']} * {c['head_dim']} != {inner}")
    lo, hi = c.get("time_step_limit", (0.0, float("inf")))
    hi = float("inf") if isinstance(hi, dict) else hi  # our writer's JSON spelling of infinity
    return mamba2_jax.Mamba2Config(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], state_size=c["state_size"],
        head_dim=c["head_dim"], chunk_size=c["chunk_size"], expand=c.get("expand", 2),
        conv_kernel=c["conv_kernel"], num_hidden_layers=c["num_hidden_layers"],
        layer_norm_epsilon=c["layer_norm_epsilon"], use_bias=c["use_bias"], use_conv_bias=c["use_conv_bias"],
        hidden_act=c["hidden_act"], time_step_limit=(lo, hi), residual_in_fp32=c["residual_in_fp32"],
        tie_word_embeddings=c["tie_word_embeddings"])


def peer_model(ckpt: str):
    """mamba2-jax's ``Mamba2ForCausalLM`` holding the checkpoint's weights (every tensor
    loaded, none left over: its loader's strict mode)."""
    import mamba2_jax

    cfg = peer_config(ckpt)
    model = mamba2_jax.create_random_model(cfg, seed=0)
    model, _, _ = mamba2_jax.load_pytorch_weights(model, state_spaces_weights(ckpt), strict=True)
    return model


def peer_forward(ckpt: str):
    """``(forward, vocab_size)``: mamba2-jax's forward on the checkpoint as one jitted program
    (``nnx.split`` once, ``nnx.merge`` inside the jit), ``forward(ids (B, L) int) -> logits
    (B, L, vocab)``. What the benchmark times and the tests check."""
    import jax
    from flax import nnx

    model = peer_model(ckpt)
    graph, state = nnx.split(model)
    fwd = jax.jit(lambda s, ids: nnx.merge(graph, s)(ids)["logits"])
    return (lambda ids: fwd(state, ids)), model.cfg.vocab_size


def case_peer(ckpt: str, L: int, out: str) -> dict:
    """mamba2-jax's jitted forward (``peer_forward``) on ``benchmarks.forward``'s ids:
    first-call and steady-state seconds; the last 8 rows of logits saved to ``out``."""
    import mamba2_jax
    import numpy as np

    no_persistent_cache()
    fwd, vocab_size = peer_forward(ckpt)
    ids = random_ids(vocab_size, L)
    first, t = first_and_steady(lambda: fwd(ids))
    np.save(out, np.asarray(fwd(ids))[0, -8:])
    return {"seconds": t, "first_s": first, "version": mamba2_jax.__version__}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    forward_main(ap.parse_args().quick, ["mamba2"])
