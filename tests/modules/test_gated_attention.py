"""Gated attention (Qiu et al. 2025) in MultiheadAttention and TransformerConfig, and the
query-dependent parameters of ASEntmax (issue 14): formulas against NumPy float64, gate=None
unchanged, gradients, every method."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from precision import assert_close
from sharpattn import normalizers as nz
from sharpattn.attention import MultiheadAttention, attend
from sharpattn.models.transformer import Transformer, TransformerConfig

pytestmark = [pytest.mark.numerical, pytest.mark.usefixtures("one_thread")]


def _np(t):
    return t.detach().double().numpy()


def np_softmax_attention(q, k, v):
    """Causal softmax attention of [B, H, L, D] arrays."""
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    lq = s.shape[-1]
    s = np.where(np.tril(np.ones((lq, lq), dtype=bool)), s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_gate_is_sigmoid_of_the_input_times_the_head_outputs(gate):
    torch.manual_seed(0)
    d, h = 12, 3
    mha = MultiheadAttention(d, h, causal=True, gate=gate, dtype=torch.float64)
    x = torch.randn(2, 5, d, dtype=torch.float64)
    out = mha(x)
    # by hand: q, k, v projections, softmax attention per head, Y ⊙ σ(x·W_θ), output projection
    xn = _np(x)

    def heads(lin):
        y = xn @ _np(lin.weight).T + _np(lin.bias)
        return y.reshape(2, 5, h, d // h).transpose(0, 2, 1, 3)

    y = np_softmax_attention(heads(mha.q_proj), heads(mha.k_proj), heads(mha.v_proj))
    y = y.transpose(0, 2, 1, 3)  # (B, L, H, hd)
    w_theta = _np(mha.gate_proj.weight)  # (H or H·hd, d), no bias
    assert mha.gate_proj.bias is None
    assert w_theta.shape == ((h, d) if gate == "headwise" else (d, d))
    g = 1.0 / (1.0 + np.exp(-(xn @ w_theta.T)))
    y = y * g.reshape(2, 5, h, -1)
    ref = y.reshape(2, 5, d) @ _np(mha.out_proj.weight).T + _np(mha.out_proj.bias)
    # float64: dot products over d = 12 inside sums over 5 keys
    assert_close(out, ref, n=5 * d, magnitude=float(np.abs(ref).max()) + 1)


def test_gate_none_is_the_ungated_layer_bit_for_bit():
    torch.manual_seed(0)
    mha = MultiheadAttention(16, 4, "ssmax", num_kv_heads=2, causal=True)
    assert mha.gate is None and not hasattr(mha, "gate_proj")
    assert not any("gate" in k or "projections" in k for k in mha.state_dict())
    x = torch.randn(2, 7, 16)
    # the layer's computation as it was before the gate existed: projections, attend, out_proj
    q = mha.q_proj(x).view(2, 7, 4, 4).transpose(1, 2)
    k = mha.k_proj(x).view(2, 7, 2, 4).transpose(1, 2)
    v = mha.v_proj(x).view(2, 7, 2, 4).transpose(1, 2)
    s = mha.normalizer_params["s"].view(1, 4, 1, 1)
    y = attend(q, k, v, "ssmax", causal=True, s=s)
    want = mha.out_proj(y.transpose(1, 2).reshape(2, 7, 16))
    assert torch.equal(mha(x), want)


@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_gate_gradients_flow(gate):
    torch.manual_seed(0)
    mha = MultiheadAttention(16, 4, causal=True, gate=gate)
    mha(torch.randn(2, 6, 16)).pow(2).mean().backward()
    for name, p in mha.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and (p.grad != 0).any(), name


@pytest.mark.parametrize("method", nz.available())
def test_gate_works_with_every_method(method):
    torch.manual_seed(0)
    params = {"straight_through": True} if method == "hardmax" else {}
    mha = MultiheadAttention(
        16, 4, method, num_kv_heads=2, causal=True, gate="elementwise", **params
    )
    x = torch.randn(2, 6, 16)
    key_mask = torch.ones(2, 6, dtype=torch.bool)
    key_mask[1, :2] = False
    out = mha(x, key_mask=key_mask)
    assert out.shape == (2, 6, 16) and torch.isfinite(out).all()
    out.pow(2).mean().backward()
    g = mha.gate_proj.weight.grad
    assert torch.isfinite(g).all() and (g != 0).any()
    for name, p in mha.normalizer_params.items():
        assert torch.isfinite(p.grad).all() and (p.grad != 0).any(), name


def test_bad_gate_is_one_sentence():
    with pytest.raises(ValueError, match="gate must be one of None, 'headwise', 'elementwise'"):
        MultiheadAttention(8, 2, gate="sigmoid")
    with pytest.raises(ValueError, match="gate must be one of"):
        TransformerConfig(gate="per-token")


@pytest.mark.parametrize("gate", [None, "headwise"])
def test_transformer_config_passes_the_gate_to_every_attention_layer(gate):
    torch.manual_seed(0)
    cfg = TransformerConfig(d_model=16, n_heads=2, layers=("tf", "tf"), gate=gate)
    model = Transformer(cfg)
    assert [layer.attn.gate for layer in model.layers] == [gate, gate]
    assert cfg.to_dict()["gate"] == gate
    logits = model(torch.randint(0, 65, (2, 9)))
    logits.pow(2).mean().backward()
    if gate:
        assert all((layer.attn.gate_proj.weight.grad != 0).any() for layer in model.layers)


def test_transformer_without_gate_is_unchanged():
    torch.manual_seed(0)
    cfg = TransformerConfig(d_model=16, n_heads=2)
    assert cfg.gate is None
    model = Transformer(cfg)
    assert not any("gate" in k for k in model.state_dict())


# ---------------------------------------------------------------------------------------------
# ASEntmax's query-dependent parameters: p_{h,i} = p_h + w_h·x_i


def test_asentmax_parameters_depend_on_the_query_input():
    torch.manual_seed(0)
    d, h = 8, 2
    mha = MultiheadAttention(d, h, "asentmax", causal=True, dtype=torch.float64)
    assert sorted(mha.normalizer_projections) == ["beta_pre", "gamma_pre"]
    for proj in mha.normalizer_projections.values():
        assert torch.equal(proj.weight, torch.zeros(h, d, dtype=torch.float64))  # per head at init
        torch.nn.init.normal_(proj.weight, std=0.5)
    with torch.no_grad():
        mha.normalizer_params["beta_pre"].copy_(torch.tensor([0.3, -0.4]))
        mha.normalizer_params["gamma_pre"].copy_(torch.tensor([-0.2, 0.6]))
    x = torch.randn(2, 6, d, dtype=torch.float64)
    out, w = mha(x, return_weights=True)
    xn = _np(x)
    q = (xn @ _np(mha.q_proj.weight).T + _np(mha.q_proj.bias)).reshape(2, 6, h, 4)
    k = (xn @ _np(mha.k_proj.weight).T + _np(mha.k_proj.bias)).reshape(2, 6, h, 4)
    s = np.einsum("bihd,bjhd->bhij", q, k) / 2.0
    # β_{h,i} = softplus(b_h + w_h·x_i), γ_{h,i} = 2·tanh(c_h + u_h·x_i) (the authors' Linear
    # with bias), θ = 1 + β·log(n + 1)^γ, n = i + 1 (causal)
    pre_b = (
        _np(mha.normalizer_params["beta_pre"])
        + xn @ _np(mha.normalizer_projections["beta_pre"].weight).T
    )
    pre_c = (
        _np(mha.normalizer_params["gamma_pre"])
        + xn @ _np(mha.normalizer_projections["gamma_pre"].weight).T
    )
    ref = np.zeros_like(s)
    for b in range(2):
        for hh in range(h):
            for i in range(6):
                theta = 1 + np.logaddexp(0, pre_b[b, i, hh]) * math.log(i + 2) ** (
                    2 * math.tanh(pre_c[b, i, hh])
                )
                z = 0.5 * theta * (s[b, hh, i, : i + 1] - s[b, hh, i, : i + 1].max())
                # 1.5-entmax of one row: [z_j − τ]², Σ = 1, τ by bisection on the sum
                lo, hi = -1.0, 0.0
                for _ in range(200):
                    tau = (lo + hi) / 2
                    lo, hi = (tau, hi) if (np.clip(z - tau, 0, None) ** 2).sum() > 1 else (lo, tau)
                ref[b, hh, i, : i + 1] = np.clip(z - (lo + hi) / 2, 0, None) ** 2
    # float64 weights of θ·s (θ ≤ ~10, |s| ≲ 5), a sum over 6 keys
    assert_close(w, ref, n=6, magnitude=50.0)
    out.pow(2).mean().backward()
    for module in (mha.normalizer_params, mha.normalizer_projections):
        for name, p in module.named_parameters():
            assert torch.isfinite(p.grad).all() and (p.grad != 0).any(), name


def test_asentmax_in_multihead_attention_trains():
    torch.manual_seed(0)
    mha = MultiheadAttention(16, 4, "asentmax", causal=True)
    opt = torch.optim.Adam(mha.parameters(), lr=1e-2)
    x = torch.randn(8, 10, 16)
    target = torch.roll(x, 1, dims=1)  # copy the previous token
    losses = []
    for _ in range(40):
        loss = (mha(x) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    assert (mha.normalizer_params["beta_pre"].detach() != 0).all()  # the scale itself was trained


def test_transformer_keeps_the_zero_init_of_query_dependent_maps():
    # the model's normal(0, 0.02) init of every Linear skips ASEntmax's maps (per head at start)
    torch.manual_seed(0)
    model = Transformer(
        TransformerConfig(d_model=16, n_heads=2, method="asentmax", gate="headwise")
    )
    attn = model.layers[0].attn
    assert all(
        torch.equal(m.weight, torch.zeros(2, 16)) for m in attn.normalizer_projections.values()
    )
    assert attn.gate_proj.weight.std() > 0  # the gate is initialised as the model's other linears
    model(torch.randint(0, 65, (2, 9))).pow(2).mean().backward()
    assert all((m.weight.grad != 0).any() for m in attn.normalizer_projections.values())
