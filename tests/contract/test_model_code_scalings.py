"""ASEntmax, Llama 4's temperature tuning and Qwen's log-n scaling against their model codes, beyond
the family tests: per-query parameters, the authors' log-position, large logits, one key, masked rows.

References are NumPy float64 transcriptions of the model codes' lines (cited per function).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import brentq

from precision import assert_close
from sharpattn import normalizers as nz
from sharpattn.attention import attend, causal_mask
from sharpattn.normalizers._contract import visible_keys
from sharpattn.normalizers.scaled import llama4_beta, logn_beta
from sharpattn.normalizers.sparse import asentmax_scale

pytestmark = [pytest.mark.numerical, pytest.mark.usefixtures("one_thread")]


def np_entmax(z, alpha):
    """α-entmax of one row by root finding on τ (Peters et al. 2019, Eq. of p*)."""
    z = (alpha - 1.0) * (z - z.max())

    def excess(tau):
        return (np.clip(z - tau, 0, None) ** (1.0 / (alpha - 1.0))).sum() - 1.0

    tau = brentq(excess, -1.0 - 1e-9, 0.0, xtol=1e-15, rtol=1e-15, maxiter=500)
    return np.clip(z - tau, 0, None) ** (1.0 / (alpha - 1.0))


def np_asentmax_rows(s, allowed, b, c, delta=1.0, gamma_max=2.0, alpha=1.5):
    """deep-spin/asentmax (sparse_gemma.py, adapt-softplus-tanh): θ_i = δ + softplus(b_i)·
    log(n_i + 1)^{γ_max·tanh(c_i)} per row, α-entmax of θ_i·s_i over the row's allowed keys."""
    out = np.zeros_like(s)
    for idx in np.ndindex(*s.shape[:-1]):
        ok = allowed[idx]
        if not ok.any():
            continue
        n = ok.sum()
        theta = delta + np.logaddexp(0.0, b[idx]) * math.log(n + 1) ** (
            gamma_max * math.tanh(c[idx])
        )
        out[idx + (ok,)] = np_entmax(theta * s[idx + (ok,)], alpha)
    return out


def test_asentmax_scale_is_the_authors_log_position():
    # the authors' buffer: log_position = log(arange(2, max_seq_len + 2)) for 0-based positions,
    # i.e. log(n + 1) with n = position + 1, the keys a causal query sees
    length = 50
    n = visible_keys(causal_mask(length, length), dtype=torch.float64)  # (1, 1, L, 1)
    b = torch.linspace(-3, 3, length, dtype=torch.float64).view(1, 1, length, 1)
    c = torch.linspace(-2, 2, length, dtype=torch.float64).view(1, 1, length, 1)
    got = asentmax_scale(n, b, c, delta=1.0, gamma_max=2.0)
    log_pos = np.log(np.arange(2, length + 2, dtype=np.float64))
    want = 1.0 + np.logaddexp(0.0, b.flatten().numpy()) * log_pos ** (
        2.0 * np.tanh(c.flatten().numpy())
    )
    # a few operations (softplus, tanh, log, pow) on values up to |θ| ~ 40
    assert_close(got.flatten(), want, magnitude=float(np.abs(want).max()))


@pytest.mark.parametrize("alpha", [1.5, 1.3])
def test_asentmax_per_query_parameters_match_numpy(alpha):
    g = torch.Generator().manual_seed(0)
    b_, h, lq, lk = 2, 3, 6, 6
    s = torch.randn(b_, h, lq, lk, generator=g, dtype=torch.float64) * 3
    s[0, 0, 3, 1] = 1e4  # large logits: a one-hot row, and its negative
    s[1, 2, 5, :3] = -1e4
    mask = causal_mask(lq, lk) & torch.tensor([True] * lk)  # row 0: n = 1
    mask = mask.expand(b_, h, lq, lk).clone()
    mask[1, 1, 4] = False  # a masked (empty) row
    mask[0, 2, 5, 2:5] = False  # padding in the middle: n < position + 1
    beta_pre = torch.randn(b_, h, lq, 1, generator=g, dtype=torch.float64)
    gamma_pre = torch.randn(b_, h, lq, 1, generator=g, dtype=torch.float64)
    w = nz.asentmax(s, mask, beta_pre=beta_pre, gamma_pre=gamma_pre, alpha=alpha)
    ref = np_asentmax_rows(
        s.numpy(), mask.numpy(), beta_pre[..., 0].numpy(), gamma_pre[..., 0].numpy(), alpha=alpha
    )
    # a weight's error is that of θ·s: θ ≤ 1 + softplus(3)·log(7)^2 ≈ 12, |s| up to 1e4 (the
    # one-hot rows are exact); the bisection (α ≠ 1.5) adds 2^-50 of its unit bracket
    mag = 12 * float(s[s.abs() < 1e3].abs().max())
    assert_close(w, ref, n=lk, magnitude=mag)
    assert (w[~mask] == 0).all() and (w[1, 1, 4] == 0).all()
    assert torch.equal(w[..., 0, 0], torch.ones(b_, h, dtype=torch.float64))  # n = 1
    assert (w[0, 0, 3] == torch.eye(lk, dtype=torch.float64)[1]).all()  # the 1e4 logit wins


def test_asentmax_per_query_parameters_through_every_path():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 7, 8, generator=g, dtype=torch.float64) for _ in range(3))
    beta_pre = torch.randn(2, 4, 7, 1, generator=g, dtype=torch.float64, requires_grad=True)
    gamma_pre = torch.randn(1, 4, 7, 1, generator=g, dtype=torch.float64, requires_grad=True)
    pad = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    pad[1, ..., :2] = False
    outs, grads = {}, {}
    for impl in ("naive", "chunked"):  # chunked cuts the per-query parameters into its blocks
        out = attend(
            q,
            k,
            v,
            "asentmax",
            mask=pad,
            causal=True,
            impl=impl,
            block_size=3,
            beta_pre=beta_pre,
            gamma_pre=gamma_pre,
        )
        outs[impl] = out
        grads[impl] = torch.autograd.grad(out.pow(2).sum(), [beta_pre, gamma_pre])
    # the same operations on the same rows, only cut into blocks: float64 rounding over D = 8
    assert_close(outs["chunked"], outs["naive"], n=8, magnitude=float(v.abs().max()))
    for got, want in zip(grads["chunked"], grads["naive"], strict=True):
        assert (want != 0).any()
        assert_close(got, want, n=7 * 8, magnitude=float(want.abs().max()))


def test_asentmax_gradcheck_per_query_parameters():
    g = torch.Generator().manual_seed(2)
    s = torch.randn(1, 2, 4, 5, generator=g, dtype=torch.float64).requires_grad_()
    b = torch.randn(1, 2, 4, 1, generator=g, dtype=torch.float64).requires_grad_()
    c = torch.randn(1, 2, 4, 1, generator=g, dtype=torch.float64).requires_grad_()
    mask = causal_mask(4, 5)

    def f(s, b, c):
        return nz.asentmax(s, mask, beta_pre=b, gamma_pre=c)

    # gradcheck's own finite-difference tolerance (see test_normalizers_family.py)
    assert torch.autograd.gradcheck(f, (s, b, c), eps=1e-6, atol=1e-5)


def test_llama4_beta_is_transformers_formula_at_large_positions():
    # the line of transformers' Llama4TextAttention, transcribed with NumPy at the positions where
    # ⌊(position + 1) / 8192⌋ steps, up to 10^6 keys; β in float32 (the fused path's dtype)
    positions = np.array([0, 8190, 8191, 8192, 16382, 16383, 10**6 - 1], dtype=np.float64)
    want = np.log1p(np.floor((positions + 1.0) / 8192)) * 0.1 + 1.0
    n = torch.from_numpy(positions + 1.0)
    for dtype in (torch.float64, torch.float32):
        got = llama4_beta(n.to(dtype), 8192, 0.1)
        assert got.dtype == dtype
        assert_close(got, want, magnitude=1.0)
    beta = llama4_beta(n, 8192, 0.1)
    assert beta[:2].tolist() == [1.0, 1.0] and beta[2] > 1  # exactly softmax below 8192 keys


def test_logn_beta_is_qwens_logn_list():
    # Qwen's list, built as modeling_qwen.py builds it (i from 1), read at position p = n − 1
    length = 2048
    logn_list = [math.log(i, length) if i > length else 1 for i in range(1, 32768)]
    n = torch.tensor([1, 2, 2047, 2048, 2049, 4096, 32767], dtype=torch.float64)
    want = [logn_list[int(k) - 1] for k in n]
    got = logn_beta(n, length)
    assert_close(got, want, magnitude=1.0)
    assert got[:4].tolist() == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("method", "params", "beta"),
    [
        (
            "llama4_temperature",
            {"floor_scale": 2, "attn_scale": 1.5},
            lambda n: 1 + 1.5 * np.log1p(np.floor(n / 2)),
        ),
        (
            "logn",
            {"train_length": 2},
            lambda n: np.maximum(1, np.log(np.maximum(n, 1)) / np.log(2)),
        ),
    ],
)
def test_query_scalings_on_large_logits_and_masked_rows(method, params, beta):
    g = torch.Generator().manual_seed(3)
    s = torch.randn(2, 2, 9, 9, generator=g, dtype=torch.float64) * 4
    s[0, 1, 6] = 0.0
    s[0, 1, 6, 2] = 5e3  # large logits: β·s up to ~1.5e4, exp would overflow unshifted
    s[1, 0, 8, :4] = -5e3
    mask = causal_mask(9, 9).expand(2, 2, 9, 9).clone()  # n = 1 … 9 by row
    mask[1, 1, 3] = False  # an empty row
    w = nz.get(method)(s, mask, **params)
    a = mask.numpy()
    n = a.sum(-1, keepdims=True).astype(np.float64)
    z = np.where(a, beta(n) * s.numpy(), -np.inf)
    m = np.where(a.any(-1, keepdims=True), z.max(-1, keepdims=True), 0.0)
    e = np.where(a, np.exp(z - m), 0.0)
    ref = e / np.where(e.sum(-1, keepdims=True) > 0, e.sum(-1, keepdims=True), 1.0)
    # weights: the error of β·s relative to 1, with |β·s| ≤ 2.5·20 off the large-logit rows (those
    # are one-hot to the last bit)
    assert_close(w, ref, n=9, magnitude=50.0)
    assert torch.equal(w[1, 1, 3], torch.zeros(9, dtype=torch.float64))
    assert w[0, 1, 6, 2] == 1.0 and (w[:, :, 0, 0] == 1.0).all()
