"""xLSTM beyond the conformance suite: the stabiliser and the normaliser's floor against transformers'
torch forward at lengths above and not divisible by ``chunk_size`` (chunk-wise rows and a
step-wise tail), rows where ``exp(-m)`` wins the max and rows where it does not, large input gates
(where ``eps exp(m)`` matters, so a wrong stabiliser shows), the pieces of ``max_inference_chunksize``,
the soft caps, the "fused" weight layout, biases, ``mode="train"``, and the refused config values."""
from __future__ import annotations

import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.families import xlstm
from implicit_attn.families.xlstm.block import mixer_parts, recurrence
from implicit_attn.families.xlstm.naive import naive_stabiliser
from implicit_attn.ops import mlstm_matrix, mlstm_rule, mlstm_stabiliser
from conftest import torch_or_skip
from weights_convert import CheckpointError, read_hf_dir, write_hf_dir

testing = pytest.importorskip("implicit_attn.testing")
rel = testing.max_rel_error

# chunks of 16, 53 = 3 chunks + a 5-step tail; input gates up to 12 (a stabiliser near 12) and down to
# -8 (the floor exp(-m) wins), forget gates from fast to nearly 1; eps 1e-3, so that the stabiliser,
# which cancels in h except through eps e^m, visibly matters
LONG = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=4, chunk_size=16, ffn_proj_factor=1.5,
            ffn_round_up_to_multiple_of=16, eps=1e-3)


def build(config, path=None, seed=0, gates=None):
    """The torch model of ``config`` (``hf_setup``), its input and forget gate biases set to ``gates``
    (two lists, one value per head) when given."""
    torch, _ = torch_or_skip()
    tm = testing.build_hf_model("xlstm", config, seed)
    if gates is not None:
        with torch.no_grad():
            for block in tm.backbone.blocks:
                block.mlstm_layer.igate_preact.bias.copy_(torch.tensor(gates[0]))
                block.mlstm_layer.fgate_preact.bias.copy_(torch.tensor(gates[1]))
    if path is not None:
        testing.save_hf_model(tm, path)
    return tm


@pytest.fixture(scope="module")
def long_case(tmp_path_factory):
    path = tmp_path_factory.mktemp("xlstm_long")
    tm = build(LONG, path, gates=([12.0, 4.0, -2.0, -8.0], [8.0, 3.0, 1.0, -1.0]))
    ids = np.random.default_rng(0).integers(0, 64, (2, 53))
    return tm, ia.load(path), ids


def test_long_odd_length_matches_torch_with_both_floors(long_case):
    tm, model, ids = long_case
    r = testing.assert_hf_parity(tm, input_ids=ids, jax_model=model, atol=1e-4, rtol=1e-5, exact_tol=1e-5)
    assert r["logits"] <= 1e-4 and max(r["mixers"]) <= 1e-5
    x = model.mixer_inputs(ids, [0])[0]
    q = mixer_parts(model.layers[0].mixer.arrays(), x, model.config)
    # the stabilised normaliser |sum_j e^(F[i, j] + i_j - m_i) q_i k_j| against the floor e^-m_i
    f = {k: np.asarray(q[k], np.float64) for k in ("q", "k", "log_f", "log_i", "m")}
    c = np.cumsum(f["log_f"], -1)
    logw = c[..., :, None] - c[..., None, :] + f["log_i"][..., None, :] - f["m"][..., :, None]
    causal = np.tril(np.ones((ids.shape[1],) * 2, bool))
    den = np.abs(np.where(causal, np.exp(np.where(causal, logw, 0.0)), 0.0)
                 * np.einsum("bhid,bhjd->bhij", f["q"], f["k"])).sum(-1)
    m = f["m"]
    wins = den < np.exp(-m)
    assert wins.any() and (~wins).any()
    assert wins[:, 3].mean() > 0.5  # input gates near -8: the floor wins in most rows
    assert m.max() > 9.0  # large input gates: a large stabiliser


def test_stabiliser_is_the_torch_forward_s_and_a_wrong_one_fails(long_case):
    """Our stabiliser equals the float64 schedule of the torch kernels (chunk-wise rows, the step-wise
    tail); with ``m = 0`` instead, the layer output moves far beyond the tolerance."""
    tm, model, ids = long_case
    cfg = model.config
    _, io = testing.torch_forward(tm, ids)
    x, y = io[0]
    p = model.layers[0].mixer.arrays()
    q = mixer_parts(p, x, cfg)
    ref_m = naive_stabiliser(np.asarray(q["log_f"], np.float64), np.asarray(q["log_i"], np.float64),
                             cfg.chunk_size, cfg.max_inference_chunksize)
    np.testing.assert_allclose(np.asarray(q["m"]), ref_m, atol=2e-5)
    ok = rel(model.layers[0].mixer(x), y)
    wrong = {**q, "m": np.zeros_like(np.asarray(q["m"]))}
    h_wrong, _ = mlstm_rule(wrong["q"], wrong["k"], wrong["v"], wrong["log_f"], wrong["log_i"], wrong["m"],
                            cfg.eps)
    h_ok, _ = recurrence(q, cfg)
    assert ok <= 1e-5 and rel(h_wrong, h_ok) > 0.1  # measured: 0.23


def test_long_operator_equals_the_float64_reference(long_case):
    _, model, ids = long_case
    x = model.mixer_inputs(ids[:1], [0])[0]
    H = np.asarray(model.layers[0].mixer.as_operator(x).materialize())
    ref = xlstm.naive_operator(model.layers[0].mixer.arrays(), np.asarray(x), model.config, 0)
    assert rel(H, ref) <= 1e-5


def test_pieces_of_max_inference_chunksize_match_torch(tmp_path):
    """Longer than ``max_inference_chunksize`` (20, not a multiple of the chunk 8): the torch forward
    runs pieces of 20 (16 chunk-wise + 4 step-wise, then the 5-step rest) carrying the state. Its
    cache needs widths that are multiples of 64, and is float32 only with ``use_cache``."""
    torch, _ = torch_or_skip()
    cfg = dict(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_heads=2, qk_dim_factor=1.0,
               chunk_size=8, max_inference_chunksize=20, ffn_proj_factor=1.0, ffn_round_up_to_multiple_of=16)
    tm = build(cfg, tmp_path, gates=([6.0, -3.0], [5.0, 0.5]))
    ids = np.random.default_rng(1).integers(0, 64, (2, 45))
    with torch.no_grad():
        ref = tm(torch.tensor(ids), use_cache=True).logits.numpy()
    model = ia.load(tmp_path)
    assert np.abs(np.asarray(model(ids)) - ref).max() <= 1e-4
    assert max(op.relative_error() for op in model.operators(ids)) <= 1e-5


@pytest.mark.parametrize("caps", [dict(output_logit_soft_cap=1.5), dict(gate_soft_cap=2.0)])
def test_soft_caps(caps, tmp_path):
    tm = build({**xlstm.SPEC.tiny, **caps}, tmp_path)
    model = ia.load(tmp_path)
    ids = np.random.default_rng(2).integers(0, 64, (2, 11))
    testing.assert_hf_parity(tm, input_ids=ids, jax_model=model)
    logits = np.asarray(model(ids))
    assert np.abs(logits).max() < model.config.output_logit_soft_cap
    if "output_logit_soft_cap" in caps:  # capped hard: without the cap the logits would differ a lot
        loose = xlstm.LM(type(model.config)(**{**model.config.__dict__, "output_logit_soft_cap": 1e4}),
                         model.params())
        assert np.abs(np.asarray(loose(ids)) - logits).max() > 0.1


def test_biases_everywhere_but_the_output_norm(tmp_path):
    tm = build({**xlstm.SPEC.tiny, "use_bias": True}, tmp_path)
    names = set(read_hf_dir(tmp_path)[1])
    assert "backbone.blocks.0.mlstm_layer.multihead_norm.bias" in names and "backbone.out_norm.bias" not in names
    testing.assert_hf_parity(tm, input_ids=np.random.default_rng(3).integers(0, 64, (2, 11)),
                             jax_model=ia.load(tmp_path))


def fused_tensors(tensors: dict, n_layers: int) -> dict:
    """A "single" checkpoint's tensors in the "fused" layout (rows q, k, v, o; i, f; gate, up)."""
    t = dict(tensors)
    cat = lambda names: np.concatenate([t.pop(n) for n in names])
    for i in range(n_layers):
        p, f = f"backbone.blocks.{i}.mlstm_layer.", f"backbone.blocks.{i}.ffn."
        t[p + "qkv_opreact.weight"] = cat([p + n + ".weight" for n in ("q", "k", "v", "ogate_preact")])
        for kind in ("weight", "bias"):
            t[p + "ifgate_preact." + kind] = cat([p + n + "." + kind for n in ("igate_preact", "fgate_preact")])
        t[f + "proj_up_gate_z.weight"] = cat([f + "proj_up_gate.weight", f + "proj_up.weight"])
    return t


def test_fused_weight_mode_matches_torch(tmp_path, monkeypatch):
    """transformers 5.23 cannot build a "fused" xLSTM (its weight init indexes the fused gate bias with
    mismatched shapes), so the torch model is built with the init switched off and the "single"
    model's weights loaded in the fused layout; both torch models give the same logits."""
    torch, _ = torch_or_skip()
    single = build(xlstm.SPEC.tiny, tmp_path / "single")
    config, tensors = read_hf_dir(tmp_path / "single")
    fused = fused_tensors(tensors, config["num_hidden_layers"])
    write_hf_dir(tmp_path / "fused", {**config, "weight_mode": "fused"}, fused)
    cls = testing.reference_class("xLSTMForCausalLM")
    base = next(c for c in cls.__mro__ if "_init_weights" in c.__dict__)  # xLSTMPreTrainedModel
    monkeypatch.setattr(base, "_init_weights", lambda self, module: None)
    tm = cls(testing.reference_class("xLSTMConfig")(**{**xlstm.SPEC.tiny, "weight_mode": "fused"})).eval()
    tm.load_state_dict({k: torch.tensor(v) for k, v in fused.items()})
    ids = np.random.default_rng(4).integers(0, 64, (2, 11))
    model = ia.load(tmp_path / "fused")
    assert model.config.weight_mode == "fused"
    r = testing.assert_hf_parity(tm, input_ids=ids, jax_model=model)
    assert r["logits"] <= 1e-4
    with torch.no_grad():
        same = single(torch.tensor(ids), use_cache=False).logits.numpy()
    assert np.abs(np.asarray(model(ids)) - same).max() <= 1e-4


def test_train_mode_runs_whole_chunks_only(tmp_path):
    tm = build({**xlstm.SPEC.tiny, "mode": "train"}, tmp_path)
    model = ia.load(tmp_path)
    ids = np.random.default_rng(5).integers(0, 64, (2, 8))
    testing.assert_hf_parity(tm, input_ids=ids, jax_model=model)
    with pytest.raises(ValueError, match="multiples of chunk_size"):
        model(ids[:, :7])


BASE = {"vocab_size": 64, "hidden_size": 32, "num_heads": 2}


@pytest.mark.parametrize("change, field", [
    ({"chunkwise_kernel": "parallel--native_autograd"}, "chunkwise_kernel"),
    ({"chunkwise_kernel": "chunkwise--triton_xl_chunk"}, "chunkwise_kernel"),
    ({"sequence_kernel": "native_sequence__triton"}, "sequence_kernel"),
    ({"step_kernel": "triton"}, "step_kernel"),
    ({"mode": "train_with_padding"}, "mode"),
    ({"mode": "train", "return_last_states": False}, "return_last_states"),
    ({"inference_state_dtype": "bfloat16"}, "inference_state_dtype"),
    ({"norm_reduction_force_float32": False}, "norm_reduction_force_float32"),
    ({"add_out_norm": False}, "add_out_norm"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"weight_mode": "split"}, "weight_mode"),
    ({"embedding_dim": 48}, "embedding_dim"),
    ({"num_blocks": 3, "num_hidden_layers": 2}, "num_blocks"),
    ({"num_heads": 3}, "qk_dim"),
    ({"gate_soft_cap": 0.0}, "gate_soft_cap"),
    ({"chunk_size": 0}, "chunk_size"),
])
def test_refused_config_values_name_the_field(change, field, tmp_path):
    with pytest.raises(ValueError, match=field):
        xlstm.Config.from_hf({**BASE, **change})
    params = xlstm.init_params(xlstm.Config.from_hf(BASE), 0)
    config, tensors = xlstm.from_params(xlstm.Config.from_hf(BASE), params)
    write_hf_dir(tmp_path, {**config, **change}, tensors)
    with pytest.raises((ValueError, CheckpointError), match=field):
        ia.load(tmp_path)


def test_aliases_and_widths():
    cfg = xlstm.Config.from_hf({"vocab_size": 64, "embedding_dim": 96, "num_blocks": 3, "num_heads": 4,
                                "qk_dim_factor": 0.5, "v_dim_factor": 1.0, "ffn_proj_factor": 2.667})
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (96, 3)
    # the torch layer's widths (int(96 * 0.5), not the config's multiple-of-64 rounding), FFN rounded up
    assert (cfg.qk_dim, cfg.v_dim, cfg.qk_head_dim, cfg.v_head_dim, cfg.ffn_size) == (48, 96, 12, 24, 256)
    back = cfg.to_hf()
    assert back["embedding_dim"] == 96 and back["num_blocks"] == 3 and xlstm.Config.from_hf(back) == cfg


def float64_recurrence(q, k, v, log_f, log_i, eps):
    """The step-by-step mLSTM in float64 (its own stabiliser ``m_t = max(f_t + m_{t-1}, i_t)``):
    ``h (H, L, d_v)`` for ``q, k (H, L, d_k)``, ``v (H, L, d_v)``, ``log_f, log_i (H, L)``, and each
    row's condition ``sum_j w_j |q|.|k_j| / normaliser`` (``(H, L)``: how much the normaliser's sum
    and its dot products cancel; float32 rounding alone moves a row by about 1e-7 times it)."""
    H, L, dk = q.shape
    C, n, m = np.zeros((H, dk, v.shape[-1])), np.zeros((H, dk)), np.zeros(H)
    out, cond = np.zeros((H, L, v.shape[-1])), np.zeros((H, L))
    c = np.cumsum(log_f, -1)
    for t in range(L):
        m_new = np.maximum(log_f[:, t] + m, log_i[:, t])
        a, b = np.exp(log_f[:, t] + m - m_new), np.exp(log_i[:, t] - m_new)
        C = a[:, None, None] * C + b[:, None, None] * np.einsum("hd,he->hde", k[:, t], v[:, t])
        n = a[:, None] * n + b[:, None] * k[:, t]
        den = np.maximum(np.abs(np.einsum("hd,hd->h", q[:, t], n)), np.exp(-m_new)) + eps
        out[:, t] = np.einsum("hd,hde->he", q[:, t], C) / den[:, None]
        w = np.exp(c[:, t:t + 1] - c[:, :t + 1] + log_i[:, :t + 1] - m_new[:, None])
        cond[:, t] = (w * np.einsum("hjd,hd->hj", np.abs(k[:, :t + 1]), np.abs(q[:, t]))).sum(-1) / den
        m = m_new
    return out, cond


def test_long_input_is_finite_and_matches_float64():
    """L = 4099 (64 chunks and a 3-step tail): forget gates from e^-3 to nearly 1 a step, input gates
    over the soft-capped range; the chunk-wise read-out against a float64 recurrence (row by row,
    within 1e-5 plus what the row's own conditioning and its chunk's float32 decay sums make of
    float32 rounding), and the matrix of the first 1000 rows times ``v`` equal to it."""
    g = np.random.default_rng(7)
    H, L, dk, dv = 3, 4099, 8, 8
    f32 = lambda a: np.asarray(a, np.float32)
    q, k = f32(g.standard_normal((2, H, L, dk)) / np.sqrt(dk))
    v = f32(g.standard_normal((H, L, dv)))
    log_f = f32(-np.logaddexp(0.0, -(np.array([-3.0, 2.0, 9.0])[:, None] + g.standard_normal((H, L)))))
    log_i = f32(15.0 * np.tanh(g.uniform(-20, 20, (H, L)) / 15.0))
    chunk = 64
    m = mlstm_stabiliser(log_f, log_i, chunk)
    h, norm = mlstm_rule(q, k, v, log_f, log_i, m, 1e-6, chunk)
    assert np.isfinite(np.asarray(h)).all()
    d = lambda a: np.asarray(a, np.float64)
    ref, cond = float64_recurrence(d(q), d(k), d(v), d(log_f), d(log_i), 1e-6)
    err = np.abs(d(h) - ref).max(-1) / np.abs(ref).max(-1)  # per row
    # float32 exponents: a chunk's cumulative log forget gate X carries about X 2^-24 of rounding,
    # which every decay built from it inherits (head 0's chunks reach X ~ 200: 2e-5 on an EPYC)
    X = np.abs(log_f[:, :L // chunk * chunk].reshape(H, -1, chunk).sum(-1)).max(-1, keepdims=True)
    bound = 1e-5 + 1e-6 * cond + 2.0 ** -22 * X
    assert np.all(err <= bound), (err / bound).max()
    assert np.median(err) <= 1e-6
    n = 1000
    M = mlstm_matrix(q[:, :n], k[:, :n], log_f[:, :n], log_i[:, :n], m[:, :n], norm=norm[:, :n])
    assert rel(np.einsum("hij,hjv->hiv", np.asarray(M), v[:, :n]), np.asarray(h)[:, :n]) <= 1e-5
