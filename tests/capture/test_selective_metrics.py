"""Fig. 2 of Zhang et al. (Selective Attention): spikiness ‖s‖₁/(‖s‖₂²·L) and the operator norm of
W_q·W_kᵀ, against NumPy float64; and the language-model measure built on them (lm_fig2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from precision import assert_close
from reference import transformer_internals
from sharpattn.diagnostics import qk_operator_norm, spikiness
from sharpattn.experiments.selective_lm import lm_fig2
from sharpattn.models.transformer import Transformer, TransformerConfig


def _spikiness_np(w: np.ndarray, visible) -> np.ndarray:
    w = np.asarray(w, dtype=np.float64)
    return np.abs(w).sum(-1) / ((w**2).sum(-1) * np.asarray(visible, dtype=np.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_spikiness_matches_numpy_and_its_extremes(dtype):
    rng = np.random.default_rng(0)
    lk = 37
    for sharp in (0.0, 0.5, 3.0, 30.0):  # uniform .. nearly one-hot rows
        s = torch.from_numpy(rng.standard_normal((3, 5, lk)) * sharp).to(dtype)
        w = torch.softmax(s, -1)
        # float64 sums of lk terms of the (exactly converted) weights
        assert_close(spikiness(w), _spikiness_np(w.double().numpy(), lk), dtype=torch.float64, n=lk)
    assert_close(spikiness(torch.full((4, lk), 1 / lk, dtype=dtype)), np.ones(4), dtype=dtype)
    one_hot = torch.zeros(4, lk, dtype=dtype)
    one_hot[:, 3] = 1
    assert torch.equal(spikiness(one_hot), torch.full((4,), 1 / lk, dtype=torch.float64))


def test_spikiness_counts_visible_keys_under_a_causal_mask():
    """Causal rows: L = keys the row sees (masked weights are 0), so a uniform causal row is 1."""
    t = 12
    scores = torch.randn(2, 3, t, t, dtype=torch.float64)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    w = torch.softmax(scores, -1)
    visible = torch.arange(1, t + 1)
    assert_close(spikiness(w, visible), _spikiness_np(w.numpy(), np.arange(1, t + 1)), n=t)
    uniform = torch.ones(t, t, dtype=torch.float64).tril()
    uniform = uniform / uniform.sum(-1, keepdim=True)
    assert_close(spikiness(uniform, visible), np.ones(t), n=t)
    with pytest.raises(ValueError, match="at least one visible key"):
        spikiness(w, torch.arange(0, t))


def test_qk_operator_norm_matches_numpy():
    rng = np.random.default_rng(1)
    for d, hd, heads in ((8, 8, 1), (16, 4, 3), (5, 2, 2)):
        wq = rng.standard_normal((heads, d, hd)).astype(np.float32)
        wk = rng.standard_normal((heads, d, hd)).astype(np.float32)
        expected = [
            np.linalg.norm(wq[h].astype(np.float64) @ wk[h].T.astype(np.float64), 2)
            for h in range(heads)
        ]
        # float64 SVD of a float64 product of float32 inputs: d-term dot products, then an SVD
        got = qk_operator_norm(torch.from_numpy(wq), torch.from_numpy(wk))
        assert_close(got, expected, dtype=torch.float64, n=d * hd, ulps=64)
    with pytest.raises(ValueError, match="one shape"):
        qk_operator_norm(torch.zeros(2, 4, 2), torch.zeros(2, 4, 3))


def test_lm_fig2_matches_numpy_on_the_model_weights():
    """Spikiness and ‖W_q,h·W_k,hᵀ‖ of every layer, recomputed by hand in NumPy from the weights
    (tests/reference.py's forward pass of the same Transformer)."""
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=11,
        n_out=11,
        max_len=64,
        d_model=16,
        n_heads=2,
        layers=("tf", "tf"),
        init_std=0.3,
    )
    m = Transformer(cfg).eval()
    val = torch.randint(0, 11, (200,))
    got = lm_fig2(m, val, context=32, tokens=100)  # 4 windows of 32
    x = torch.stack([val[i * 32 : (i + 1) * 32] for i in range(4)])
    ref, _ = transformer_internals(m, x)
    spiky = [_spikiness_np(ref[i]["weights"], np.arange(1, 33)).mean() for i in range(2)]
    # float32 model vs float64 reference: weights agree to ~1e-6 relative, sums of 32 terms
    assert_close(got["spikiness_by_layer"], spiky, dtype=torch.float32, n=32, ulps=64)
    norms = []
    for i in range(2):
        wq = m.layers[i].attn.q_proj.weight.detach().double().numpy().reshape(2, 8, 16)
        wk = m.layers[i].attn.k_proj.weight.detach().double().numpy().reshape(2, 8, 16)
        norms.append(np.mean([np.linalg.norm(wq[h].T @ wk[h], 2) for h in range(2)]))
    assert_close(got["qk_norm_by_layer"], norms, dtype=torch.float64, n=16 * 8, ulps=64)
    assert got["effective_qk_norm_by_layer"] == got["qk_norm_by_layer"]  # no τ_q: τ = 1


def test_lm_fig2_effective_norm_and_spikiness_follow_the_query_temperature():
    """A constant τ_q = 1 + tanh(c) (token term only, output bias c) multiplies the effective norm
    by τ_q and gives the spikiness of the same model with q_proj scaled by τ_q."""
    torch.manual_seed(1)
    base = dict(
        vocab_size=11,
        n_out=11,
        d_model=16,
        n_heads=2,
        layers=("tf",),
        positions="rotary",
        init_std=0.3,
    )
    sel = Transformer(TransformerConfig(**base, selective="q", selective_terms="token")).eval()
    c = 0.7
    tau = 1 + np.tanh(c)
    with torch.no_grad():
        sel.layers[0].attn.selective["q"].fc2.bias.fill_(c)
    plain = Transformer(TransformerConfig(**base)).eval()
    missing, _ = plain.load_state_dict(sel.state_dict(), strict=False)
    with torch.no_grad():
        plain.layers[0].attn.q_proj.weight.mul_(tau)
    val = torch.randint(0, 11, (100,))
    got, ref = lm_fig2(sel, val, 24, 48), lm_fig2(plain, val, 24, 48)
    # τ is computed in float32 (tanh and 1 + ·), the product and mean in float64
    assert_close(got["effective_qk_norm"], tau * got["qk_norm"], dtype=torch.float32)
    assert_close(ref["qk_norm"], tau * got["qk_norm"], dtype=torch.float32, n=16, ulps=32)
    # the same logits up to float32 rounding of q·τ vs (τ·W_q)·x: sums of 24 weights
    assert_close(got["spikiness"], ref["spikiness"], dtype=torch.float32, n=24, ulps=64)
