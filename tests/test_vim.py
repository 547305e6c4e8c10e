"""Vision Mamba (``models.vim``): the model, its bidirectional operator and every variant against
an independent float64 torch reference written from the equations (a recurrence loop, explicit
conv taps, ``F.conv2d`` patches), and the converter of official checkpoints."""
import argparse
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicit_attn import cli
from implicit_attn.convert import convert_checkpoint
from implicit_attn.explain import vision
from implicit_attn.models import vim
from implicit_attn.nn.checkpoint import CheckpointError
from implicit_attn.operator import resolve_impl

torch = pytest.importorskip("torch")
F = torch.nn.functional
T64 = torch.float64

CFG = vim.Config(image_size=8, patch_size=2, hidden_size=8, num_labels=5, num_channels=2, num_hidden_layers=2,
                 state_size=3, conv_kernel=3, time_step_rank=2)


def perturbed(cfg, seed=0):
    """Random params with D, the conv biases and the norms away from their defaults."""
    p = vim.init_params(cfg, seed)
    g = np.random.default_rng(seed + 1)
    for layer in p["layers"]:
        layer["norm"] = layer["norm"] + 0.2 * jnp.asarray(g.standard_normal(layer["norm"].shape), jnp.float32)
        for k in ("D", "D_b", "conv1d.bias", "conv1d_b.bias"):
            layer["mixer"][k] = layer["mixer"][k] + jnp.asarray(0.3 * g.standard_normal(layer["mixer"][k].shape),
                                                                jnp.float32)
    p["cls_token"] = p["cls_token"] * 20
    p["pos_embed"] = p["pos_embed"] * 20
    return p


def images(cfg, n=2, seed=0):
    g = np.random.default_rng(100 + seed)
    return jnp.asarray(g.standard_normal((n, cfg.num_channels, cfg.image_size, cfg.image_size)), jnp.float32)


# ----------------------------------------------------------------------------- float64 reference

def t(a):
    return torch.tensor(np.asarray(a, np.float64), dtype=T64)


def ref_rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def ref_direction(p, h, cfg, back: bool):
    """One Mamba direction (names with ``_b`` when ``back``) on ``h (B, L, D)``, step by step.
    Returns the output before out_proj ``(B, L, C)`` and the pieces of the operator."""
    s = "_b" if back else ""
    C, N, R, K = cfg.expand * cfg.hidden_size, cfg.state_size, cfg.time_step_rank, cfg.conv_kernel
    xz = h @ p["in_proj.weight"].T
    x, z = xz[..., :C], xz[..., C:]
    w, b = p[f"conv1d{s}.weight"][:, 0], p[f"conv1d{s}.bias"]   # (C, K), (C,)
    Bn, L, _ = x.shape
    xc = torch.zeros_like(x) + b
    for i in range(L):
        for k in range(K):  # tap k reads x[i - (K - 1 - k)] (causal padding K - 1)
            j = i - (K - 1 - k)
            if j >= 0:
                xc[:, i] += w[:, k] * x[:, j]
    u = xc * torch.sigmoid(xc)
    dbl = u @ p[f"x_proj{s}.weight"].T
    dt = F.softplus(dbl[..., :R] @ p[f"dt_proj{s}.weight"].T + p[f"dt_proj{s}.bias"])
    Bm, Cm = dbl[..., R:R + N], dbl[..., R + N:]
    A = -torch.exp(p["A_b_log" if back else "A_log"])
    D = p[f"D{s}"]
    state = torch.zeros(Bn, C, N, dtype=T64)
    ys = []
    for i in range(L):
        state = torch.exp(dt[:, i, :, None] * A) * state + (dt[:, i] * u[:, i])[..., None] * Bm[:, i, None, :]
        ys.append((state * Cm[:, i, None, :]).sum(-1) + D * u[:, i])
    y = torch.stack(ys, 1) * (z * torch.sigmoid(z))
    return y, dict(x=x, z=z, xc=xc, u=u, dt=dt, Bm=Bm, Cm=Cm, A=A, D=D, w=w)


def ref_direction_matrix(q, variant: str):
    """``(B, C, L, L)`` of one direction: ``alpha`` and its wrappers written out entry by entry."""
    Bn, L, C = q["x"].shape
    S = torch.cumsum(q["dt"], 1)
    alpha = torch.zeros(Bn, C, L, L, dtype=T64)
    for i in range(L):
        for j in range(i + 1):
            dec = torch.exp(q["A"][None] * (S[:, i] - S[:, j])[..., None])   # (B, C, N)
            alpha[:, :, i, j] = (q["Cm"][:, i, None, :] * dec * q["Bm"][:, j, None, :]).sum(-1) * q["dt"][:, j]
    if variant == "s6_only":
        return alpha
    alpha = alpha + torch.diag_embed(q["D"].expand(Bn, L, C).transpose(1, 2))
    K = q["w"].shape[1]
    M = torch.zeros(C, L, L, dtype=T64)
    for i in range(L):
        for k in range(K):
            if i - (K - 1 - k) >= 0:
                M[:, i, i - (K - 1 - k)] = q["w"][:, k]
    gate = (q["z"] * torch.sigmoid(q["z"])).transpose(1, 2)[..., None]
    sig = torch.sigmoid(q["xc"]).transpose(1, 2)[:, :, None, :]
    H = {"full": gate * alpha * sig, "no_conv": gate * alpha * sig, "no_gate": alpha * sig,
         "no_act": gate * alpha}[variant]
    return H if variant == "no_conv" else H @ M


def ref_mixer(p, h, cfg):
    """``(inner output (B, L, C), out_proj output (B, L, D))`` of the bidirectional block."""
    y_f, _ = ref_direction(p, h, cfg, False)
    y_b, _ = ref_direction(p, torch.flip(h, [1]), cfg, True)
    y = (0.5 if cfg.divide_out else 1.0) * (y_f + torch.flip(y_b, [1]))
    return y, y @ p["out_proj.weight"].T


def ref_operator(p, h, cfg, variant):
    """``scale (H_f + J H_b J)`` (``s6_only``: the plain sum)."""
    _, qf = ref_direction(p, h, cfg, False)
    _, qb = ref_direction(p, torch.flip(h, [1]), cfg, True)
    scale = 1.0 if variant == "s6_only" or not cfg.divide_out else 0.5
    return scale * (ref_direction_matrix(qf, variant) + torch.flip(ref_direction_matrix(qb, variant), [-2, -1]))


def ref_model(params, imgs, cfg, taps=None):
    """Logits ``(B, classes)`` and each block's mixer input; ``taps``: optional ``(B, C, L)``
    tensors added to each block's output before out_proj."""
    P = {k: t(v) for k, v in params.items() if k not in ("layers",)}
    x = F.conv2d(t(imgs), P["patch_embed.proj.weight"], P["patch_embed.proj.bias"], stride=cfg.patch_size)
    x = x.flatten(2).transpose(1, 2)
    c = cfg.cls_index
    x = torch.cat([x[:, :c], P["cls_token"].expand(x.shape[0], 1, -1), x[:, c:]], 1) + P["pos_embed"]
    inputs = []
    for i, layer in enumerate(params["layers"]):
        m = {k: t(v) for k, v in layer["mixer"].items()}
        hn = ref_rms(x, t(layer["norm"]), cfg.layer_norm_epsilon)
        inputs.append(hn)
        y = ref_mixer(m, hn, cfg)[0]
        if taps is not None:
            y = y + taps[i].transpose(1, 2)
        x = x + y @ m["out_proj.weight"].T
    x = ref_rms(x, P["norm_f"], cfg.layer_norm_epsilon)
    return x[:, c] @ P["head.weight"].T + P["head.bias"], inputs


def close(a, b, tol):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)
    assert err < tol, err


# ----------------------------------------------------------------------------- tests

DEEP = pytest.mark.deep  # repeats of a default-tier check (the default tier's time budget)


@pytest.mark.parametrize("cls_position,divide_out", [("middle", True), pytest.param("start", False, marks=DEEP),
                                                     pytest.param("end", True, marks=DEEP)])
def test_logits_match_reference(cls_position, divide_out):
    cfg = dataclasses.replace(CFG, cls_position=cls_position, divide_out=divide_out)
    p, x = perturbed(cfg), images(cfg)
    ref, _ = ref_model(p, x, cfg)
    close(vim.forward_jit(p, x, cfg=cfg), ref.numpy(), 1e-5)
    # the CLS token sits where the config says: moving it changes the logits
    other = dataclasses.replace(cfg, cls_position="start" if cls_position != "start" else "end")
    assert np.max(np.abs(np.asarray(vim.forward_jit(p, x, cfg=other)) - ref.numpy())) > 1e-3


@DEEP
def test_one_patch_and_large_batch():
    """``N = 1`` (L = 2: the patch and CLS at N // 2 = 0) with a batch of 5."""
    cfg = dataclasses.replace(CFG, image_size=2)
    p, x = perturbed(cfg), images(cfg, n=5)
    ref, _ = ref_model(p, x, cfg)
    close(vim.forward_jit(p, x, cfg=cfg), ref.numpy(), 1e-5)
    assert all(op.relative_error() < 1e-5 for op in vim.operators_jit(p, x, cfg=cfg))


@pytest.fixture(scope="module")
def setup():
    p, x = perturbed(CFG), images(CFG)
    _, inputs = ref_model(p, x, CFG)
    return p, x, inputs


def test_mixer_inner_matches_reference(setup):
    p, x, inputs = setup
    for layer, hn in zip(p["layers"], inputs):
        m = {k: t(v) for k, v in layer["mixer"].items()}
        y, out = ref_mixer(m, hn, CFG)
        h = jnp.asarray(hn.numpy(), jnp.float32)
        close(vim.mixer_inner(layer["mixer"], h, CFG), y.numpy(), 1e-5)
        close(vim.mixer_forward_jit(layer["mixer"], h, cfg=CFG), out.numpy(), 1e-5)


@pytest.mark.parametrize("variant", [v if v in ("full", "s6_only") else pytest.param(v, marks=DEEP)
                                     for v in vim.VARIANTS])
def test_operator_matches_reference(setup, variant):
    p, x, inputs = setup
    ops = vim.operators_jit(p, x, cfg=CFG, variant=variant)
    for layer, hn, op in zip(p["layers"], inputs, ops):
        m = {k: t(v) for k, v in layer["mixer"].items()}
        H = op.materialize()
        close(H, ref_operator(m, hn, CFG, variant).numpy(), 2e-5)
        # non-causal: entries above the diagonal carry the backward scan
        assert np.abs(np.asarray(H)[..., 0, -1]).max() > 0
        # output is the block's own, whatever the variant
        close(op.output, np.swapaxes(ref_mixer(m, hn, CFG)[0].numpy(), 1, 2), 1e-5)
        if variant == "full":  # H x + offset reproduces the block
            assert op.relative_error() < 1e-5
            close(op.values, np.swapaxes(hn.numpy() @ np.asarray(layer["mixer"]["in_proj.weight"]).T, 1, 2)
                  [:, :CFG.expand * CFG.hidden_size], 1e-5)
        else:
            assert op.relative_error() > 1e-2  # an ablation: must not reproduce it
        if variant in ("full", "no_conv"):  # each direction on its own values is exact
            assert op.forward.relative_error() < 1e-5 and op.backward.relative_error() < 1e-5


@pytest.mark.parametrize("impl", ["cpu", "pallas"])
def test_kernels_take_both_directions(setup, impl):
    """The fused CPU kernels and the Pallas kernels (interpreted here) form each direction's
    matrices (flipped and summed by XLA): ``materialize`` and the blocked ``reduce`` against the
    float64 operator; ``auto`` takes the CPU kernels on CPU."""
    p, x, inputs = setup
    op = vim.operators_jit(p, x, cfg=CFG)[1]
    H = ref_operator({k: t(v) for k, v in p["layers"][1]["mixer"].items()}, inputs[1], CFG, "full").numpy()
    close(op.materialize([5, 0, 2], impl=impl), H[:, [5, 0, 2]], 2e-5)
    close(op.reduce("abs_mean", impl=impl), np.abs(H).mean(1), 2e-5)
    if jax.default_backend() == "cpu":
        assert resolve_impl("auto", op.core) == "cpu"


@DEEP
def test_reduce_and_channel_selection(setup):
    p, x, _ = setup
    op = vim.operators_jit(p, x, cfg=CFG)[0]
    H = np.asarray(op.materialize())
    close(op.reduce("mean"), H.mean(1), 1e-5)
    close(op.reduce("abs_mean"), np.abs(H).mean(1), 1e-5)
    close(op.materialize([3, 1]), H[:, [3, 1]], 1e-6)


def test_bad_inputs():
    p = vim.init_params(CFG, 0)
    with pytest.raises(ValueError, match="variant"):
        vim.mixer_operator(p["layers"][0]["mixer"], jnp.zeros((1, CFG.seq_len, CFG.hidden_size)), CFG, "nope")
    with pytest.raises(ValueError, match="images must have shape"):
        vim.forward(p, jnp.zeros((1, 1, 8, 8)), CFG)
    with pytest.raises(ValueError, match="cls_position"):
        vim.Config(image_size=8, patch_size=2, hidden_size=8, num_labels=2, cls_position="left")
    with pytest.raises(ValueError, match="multiple of patch_size"):
        vim.Config(image_size=9, patch_size=2, hidden_size=8, num_labels=2)


def test_module_save_load_roundtrip(tmp_path, setup):
    p, x, inputs = setup
    model = vim.ViM(CFG, p)
    vim.save(tmp_path / "m", model)
    back = vim.load(tmp_path / "m")
    assert back.config == CFG
    np.testing.assert_array_equal(np.asarray(back(x)), np.asarray(model(x)))
    # the module's mixer: the block's forward and operator on its input
    h = jnp.asarray(inputs[1].numpy(), jnp.float32)
    mixer = back.layers[1].mixer
    close(mixer(h), ref_mixer({k: t(v) for k, v in p["layers"][1]["mixer"].items()}, inputs[1], CFG)[1].numpy(), 1e-5)
    assert mixer.as_operator(h).relative_error() < 1e-5
    with pytest.raises(ValueError, match="ViM variant"):
        back.operators(x, "nope")
    with pytest.raises(ValueError, match="mixer input"):
        mixer.as_operator(h[0])


def official_state_dict(cfg, params):
    """The official ``VisionMamba.state_dict()`` layout, as torch tensors."""
    return {k: torch.tensor(np.asarray(v)) for k, v in vim.from_params(cfg, params).items()}


def test_convert_official_checkpoint(tmp_path, capsys):
    cfg = dataclasses.replace(CFG, cls_position="end", divide_out=False)
    p = perturbed(cfg, seed=3)
    src = tmp_path / "vim_t.pth"
    torch.save({"model": official_state_dict(cfg, p), "epoch": 3, "args": argparse.Namespace(lr=1e-3)}, src)
    assert cli.main(["convert", str(src), str(tmp_path / "out"), "--vim-cls", "end", "--vim-sum-out"]) == 0
    assert "model_type vim" in capsys.readouterr().out
    model = vim.load(tmp_path / "out")
    assert model.config == cfg
    x = images(cfg)
    close(model(x), ref_model(p, x, cfg)[0].numpy(), 1e-5)
    config = convert_checkpoint(src, tmp_path / "mid")   # the defaults: middle CLS, divide_out
    assert config["model_type"] == "vim" and config["time_step_rank"] == cfg.time_step_rank
    assert vim.load(tmp_path / "mid").config == dataclasses.replace(cfg, cls_position="middle", divide_out=True)
    with pytest.raises(CheckpointError, match="official ViM"):
        convert_checkpoint(src, tmp_path / "x", model_type="mamba")
    # a missing tensor is named; a pickled object that would run code is refused
    sd = official_state_dict(cfg, p)
    del sd["layers.1.mixer.D_b"]
    torch.save({"model": sd}, tmp_path / "bad.pth")
    with pytest.raises(CheckpointError, match="D_b"):
        convert_checkpoint(tmp_path / "bad.pth", tmp_path / "out2")
    torch.save({"model": official_state_dict(cfg, p), "hook": math.floor}, tmp_path / "evil.pth")
    with pytest.raises(CheckpointError, match="refused"):
        convert_checkpoint(tmp_path / "evil.pth", tmp_path / "out3")


# ----------------------------------------------------------------------------- explanations

def ref_rollout(maps, cls):
    """float64 rollout ``(I + A_{N-1}) ... (I + A_0)``, row ``cls``: ``(B, L)``."""
    L = maps.shape[-1]
    rho = np.broadcast_to(np.eye(L), maps.shape[1:]).copy()
    for A in maps:
        rho = (np.eye(L) + A) @ rho
    return rho[:, cls]


def drop(row, cfg):
    return np.delete(row, cfg.cls_index, axis=1)


@pytest.mark.parametrize("variant", ["full", pytest.param("s6_only", marks=DEEP)])
def test_cls_relevance_matches_float64(setup, variant):
    p, x, inputs = setup
    H = [ref_operator({k: t(v) for k, v in layer["mixer"].items()}, hn, CFG, variant).numpy()
         for layer, hn in zip(p["layers"], inputs)]
    maps = np.stack([np.abs(h).mean(1) for h in H])      # abs_mean over channels
    c = CFG.cls_index
    target = np.array([1, 3])
    got = vision.cls_relevances_jit(p, x, cfg=CFG, variant=variant, target=target)
    close(got["raw"], drop(maps.mean(0)[:, c], CFG), 2e-5)
    close(got["rollout"], drop(ref_rollout(maps, c), CFG), 2e-5)
    # attribution: gradients of the target logit w.r.t. each block's output, by torch autograd
    C, L = CFG.expand * CFG.hidden_size, CFG.seq_len
    taps = [torch.zeros(2, C, L, dtype=T64, requires_grad=True) for _ in p["layers"]]
    logits, _ = ref_model(p, x, CFG, taps)
    logits[torch.arange(2), torch.tensor(target)].sum().backward()
    gbar = np.stack([tp.grad.numpy().mean(1) for tp in taps])   # (layers, B, L)
    amaps = np.maximum(gbar[..., :, None] * maps, 0.0)
    close(got["attribution"], drop(ref_rollout(amaps, c), CFG), 2e-5)
    close(vision.gradient_means(p, x, CFG, jnp.asarray(target)), gbar, 2e-5)


def test_relevance_image_and_distance_profile():
    r = np.random.default_rng(0).standard_normal((2, CFG.num_patches)).astype(np.float32)
    grid = vision.relevance_grid(r, CFG)
    np.testing.assert_array_equal(np.asarray(grid)[:, 1, 2], r[:, 1 * CFG.grid + 2])   # row-major patches
    up = torch.nn.functional.interpolate(torch.tensor(np.asarray(grid))[:, None], size=(8, 8), mode="bilinear",
                                         align_corners=False)[:, 0]
    close(vision.relevance_image(r, CFG), up.numpy(), 1e-6)
    with pytest.raises(ValueError, match="relevance must have shape"):
        vision.relevance_image(r[:, :-1], CFG)
    with pytest.raises(ValueError, match="methods must be among"):
        vision.cls_relevances(None, None, CFG, ("gradcam",))
    # middle CLS at index 8 of 17: patches 0..7 sit at distance 8..1, patches 8..15 at 1..8
    ds, m = vision.distance_profile(r, CFG)
    np.testing.assert_array_equal(ds, np.arange(1, 9))
    np.testing.assert_allclose(m[0], r[:, [7, 8]].mean(), rtol=1e-6)
    np.testing.assert_allclose(m[-1], r[:, [0, 15]].mean(), rtol=1e-6)
