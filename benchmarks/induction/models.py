"""The five model configurations of Table 2 as pure functions.

``mamba2`` / ``mamba1``: Hugging Face ``MambaForCausalLM`` (``implicit_attn.families.mamba``),
2 or 1 blocks, D 64, N 16, conv width 4, expand 2 -- saved and loaded in HF layout.

The simplified models of the paper's Fig. 2b keep only the token-mixing parts of one
block and are not HF-loadable (no in_proj, gate, out_proj, residual). For ids ``(B, L)``:

    h  = E[ids]                                   (B, L, D)      E: (V, D)
    xc = conv(h)  (depthwise causal, width W)     if "conv" in parts, else h
    y  = S6(xc) with dt, B, C from xc (Mamba's x_proj/dt_proj, A = -exp(A_log), D skip)
                                                  if "ssm" in parts, else xc
    logits = rms_norm(y) W_head^T                 (B, L, V)

``conv_ssm`` (W 2), ``conv`` (W 2), ``ssm``. The SSM width is D (no expansion); dt is
per channel (Mamba's low-rank dt_proj) where the paper writes a scalar dt (its footnote 1
notes the vector form). The math reuses ``causal_conv``, ``selective_scan`` and
``rms_norm`` and the initialisation of ``mamba.init_params``, so the HF path is unchanged.

``transformer_*`` (not in Table 2): the causal softmax transformer of ``models.las`` as a
language model (2 layers, width D, 4 heads, pre-norm, tied head, no positional embeddings),
with the attention flags of ``las.VARIANTS[attention]``: ``transformer_alibi`` (ALiBi's
distance bias gives it the relative positions a previous-token head needs) and
``transformer_vanilla`` (position from the causal mask alone). Trained by the same
``train.py`` on the same task, it is the transformer of the Mamba-vs-transformer maps
(``compare_maps.py``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from implicit_attn.demo.induction import VOCAB_SIZE
from implicit_attn.families import mamba
from implicit_attn.models import las
from implicit_attn.ops import causal_conv


@dataclasses.dataclass(frozen=True)
class Spec:
    """One Table-2 row: ``kind`` "mamba" (HF Mamba with ``layers`` blocks) or "simple"
    with ``parts`` among ("conv", "ssm"); ``d`` = D, ``n`` = N, ``w`` = conv width. Or a
    ``kind`` "transformer": the LaS transformer with ``layers``, ``heads`` and the flags of
    ``las.VARIANTS[attention]``."""

    name: str
    kind: str
    layers: int = 1
    parts: tuple = ()
    d: int = 64
    n: int = 16
    w: int = 4
    paper_key: float | None = None      # Table 2 accuracy with the key token (%)
    paper_nokey: float | None = None    # ... without it (%)
    heads: int = 4                      # transformer only
    attention: str = ""                 # transformer only: a las.VARIANTS name

    def las_config(self) -> las.Config:
        """The LaS transformer config of a "transformer" spec."""
        if self.kind != "transformer":
            raise ValueError(f"{self.name} is not a transformer")
        return las.Config.variant(self.attention, vocab_size=VOCAB_SIZE, hidden_size=self.d,
                                  num_hidden_layers=self.layers, num_attention_heads=self.heads)

    def mamba_config(self) -> mamba.Config:
        """The HF Mamba config (for "simple": the config whose mixer parameters are reused,
        expand 1 so that the SSM width is D)."""
        if self.kind == "mamba":
            return mamba.Config(vocab_size=VOCAB_SIZE, hidden_size=self.d, state_size=self.n,
                                num_hidden_layers=self.layers, conv_kernel=self.w, expand=2)
        return mamba.Config(vocab_size=VOCAB_SIZE, hidden_size=self.d, state_size=self.n,
                            num_hidden_layers=1, conv_kernel=max(self.w, 1), expand=1,
                            tie_word_embeddings=False)


SPECS = {
    "mamba2": Spec("Mamba block x2", "mamba", layers=2, w=4, paper_key=100.0, paper_nokey=94.8),
    "mamba1": Spec("Mamba block x1", "mamba", layers=1, w=4, paper_key=100.0, paper_nokey=92.9),
    "conv_ssm": Spec("Conv+SSM", "simple", parts=("conv", "ssm"), w=2, paper_key=100.0, paper_nokey=90.3),
    "conv": Spec("Conv only", "simple", parts=("conv",), w=2, paper_key=12.7, paper_nokey=21.8),
    "ssm": Spec("SSM only", "simple", parts=("ssm",), w=2, paper_key=8.50, paper_nokey=20.8),
    "transformer_alibi": Spec("Transformer x2 (ALiBi)", "transformer", layers=2, attention="alibi"),
    "transformer_vanilla": Spec("Transformer x2 (no positions)", "transformer", layers=2, attention="vanilla"),
}


def get_spec(name: str) -> Spec:
    if name not in SPECS:
        raise ValueError(f"unknown configuration {name!r}; choose one of {sorted(SPECS)}")
    return SPECS[name]


def init(spec: Spec, key) -> dict:
    """Trainable parameters (no ``None`` leaves) for ``spec``."""
    if spec.kind == "transformer":
        return las.init_params(spec.las_config(), key)
    cfg = spec.mamba_config()
    p = mamba.init_params(cfg, key)
    if spec.kind == "mamba":
        return {k: v for k, v in p.items() if v is not None}
    m = p["layers"][0]["mixer"]
    out = {"embeddings": p["embeddings"], "norm_f": p["norm_f"], "lm_head": p["lm_head"]}
    if "conv" in spec.parts:
        out["conv1d.weight"], out["conv1d.bias"] = m["conv1d.weight"], m["conv1d.bias"]
    if "ssm" in spec.parts:
        for k in ("x_proj.weight", "dt_proj.weight", "dt_proj.bias", "A_log", "D"):
            out[k] = m[k]
    return out


def simple_forward(p: dict, ids, spec: Spec):
    """Fig. 2b model: ``ids (B, L) -> logits (B, L, V)`` float32 (see module doc)."""
    cfg = spec.mamba_config()
    h = p["embeddings"][ids]
    if "conv" in spec.parts:
        h = causal_conv(h, p["conv1d.weight"][:, 0, :], p["conv1d.bias"])
    if "ssm" in spec.parts:
        N, R = cfg.state_size, cfg.time_step_rank
        xdbl = h @ p["x_proj.weight"].T
        dt_in, Bm, Cm = xdbl[..., :R], xdbl[..., R:R + N], xdbl[..., R + N:]
        dt = jax.nn.softplus(dt_in @ p["dt_proj.weight"].T + p["dt_proj.bias"])
        A = -jnp.exp(p["A_log"])
        h = mamba.selective_scan(h, dt, A, Bm, Cm, p["D"])
    h = mamba.rms_norm(h, p["norm_f"], cfg.layer_norm_epsilon)
    return (h @ p["lm_head"].T).astype(jnp.float32)


def forward(p: dict, ids, spec: Spec):
    """Logits ``(B, L, V)`` float32 of any Table-2 model."""
    if spec.kind == "mamba":
        return mamba.lm_forward(p, ids, spec.mamba_config())[0]
    if spec.kind == "transformer":
        return las.lm_forward(p, ids, spec.las_config())[0]
    return simple_forward(p, ids, spec)


def to_lm(p: dict, spec: Spec):
    """The HF-layout ``mamba.LM`` of a trained "mamba" model (for ``ia.save``), or the
    ``las.LaSLM`` of a "transformer" (for ``las.save``)."""
    if spec.kind == "transformer":
        return las.LaSLM(spec.las_config(), p)
    if spec.kind != "mamba":
        raise ValueError(f"{spec.name} is not a Hugging Face Mamba or a transformer; only mamba1/mamba2 and "
                         f"transformer_* can be saved")
    return mamba.LM(spec.mamba_config(), {**p, "lm_head": None})
