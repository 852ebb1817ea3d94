"""Every normalizer behind the one contract (issue 3): formulas against independent NumPy float64
references, masks, row sums, shift invariance, extreme logits, gradients, attend / MHA, training.
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
from scipy.optimize import brentq

from precision import assert_close, tolerance
from sharpattn import normalizers as nz
from sharpattn.attention import MultiheadAttention, attend, causal_mask

# every registered method but softmax and adaptive (test_normalizers.py's): new registry entries
# are picked up here, and fail test_every_method_has_a_reference until REFS and CASES cover them
NEW = [m for m in nz.available() if m not in ("softmax", "adaptive")]
CAUSAL_ONLY = {"stick_breaking"}
H = 3  # heads in the test tensors

# tiny tensors run faster (and steadier on a shared machine) on one thread
pytestmark = [pytest.mark.numerical, pytest.mark.usefixtures("one_thread")]


def close_weights(w, expect, s, *, n=None, values=None, msg=None):
    """Weights against a float64 reference: a weight's relative error is its logit's (ε·|s|,
    |s| up to 45 here) and the row's sums add √n·ε; an output multiplies by max |v|."""
    s = s.detach().double()
    finite = s[torch.isfinite(s)]
    mag = 1 + (float(finite.abs().max()) if finite.numel() else 0.0)
    if values is not None:
        mag *= float(values.abs().max())
    assert_close(w, expect, n=n or s.shape[-1], magnitude=mag, msg=msg)


# ---------------------------------------------------------------------------------------------
# Independent float64 references, one row at a time. x: the row's scores at its allowed keys
# (in key order), p: the row's parameters (per-head values already picked). Return the weights
# of those keys; the caller scatters them back and leaves disallowed keys at 0.
# ---------------------------------------------------------------------------------------------


def _softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def _entmax_ref(x, alpha):
    """α-entmax by root finding on τ: Σ_i [(α−1)x_i − τ]_+^{1/(α−1)} = 1 (Peters et al. 2019)."""
    z = (alpha - 1.0) * x

    def excess(tau):
        return (np.clip(z - tau, 0, None) ** (1.0 / (alpha - 1.0))).sum() - 1.0

    tau = brentq(excess, z.max() - 1.0 - 1e-9, z.max(), xtol=1e-15, rtol=1e-15, maxiter=500)
    return np.clip(z - tau, 0, None) ** (1.0 / (alpha - 1.0))


def _sparsemax_ref(x):
    """Martins & Astudillo 2016, Alg. 1: sort, support size k(z), threshold τ."""
    zs = np.sort(x)[::-1]
    cs = np.cumsum(zs)
    ks = np.arange(1, len(x) + 1)
    k = ks[1 + ks * zs > cs].max()
    tau = (cs[k - 1] - 1.0) / k
    return np.clip(x - tau, 0, None)


def _stick_ref(x):
    """x: the row's pieces in key order (the caller drops the query's own key unless kept)."""
    out = np.zeros_like(x)
    beta = 1.0 / (1.0 + np.exp(-x))
    for j in range(len(x)):
        out[j] = beta[j] * np.prod(1.0 - beta[j + 1 :])
    return out


def _sink_ref(x, b):
    m = max(x.max(), b)
    return np.exp(x - m) / (np.exp(b - m) + np.exp(x - m).sum())


def _llama4_ref(x, p):
    """transformers' Llama4TextAttention: attn_scales = log1p(floor((position + 1) / floor_scale))
    · attn_scale + 1 on the queries, position + 1 = n (the row's keys)."""
    n = len(x)
    beta = math.log1p(math.floor(n / p.get("floor_scale", 8192))) * p.get("attn_scale", 0.1) + 1
    return _softmax(beta * x)


def _logn_ref(x, p):
    """Qwen's modeling_qwen.py: logn_list = [math.log(i, L) if i > L else 1 for i in 1..],
    the query at position p scaled by logn_list[p], p + 1 = n."""
    n, length = len(x), p.get("train_length", 2048)
    return _softmax((math.log(n, length) if n > length else 1.0) * x)


def _asentmax_ref(x, p):
    """deep-spin/asentmax sparse_gemma.py (adapt-softplus-tanh): θ = δ + softplus(b)·
    log(position + 2)^{γ_max·tanh(c)}, position + 2 = n + 1; α-entmax of θ·scores."""
    n = len(x)
    beta = np.logaddexp(0.0, p.get("beta_pre", 0.0))  # softplus
    gamma = p.get("gamma_max", 2.0) * math.tanh(p.get("gamma_pre", 0.0))
    theta = p.get("delta", 1.0) + beta * math.log(n + 1) ** gamma
    return _entmax_ref(theta * (x - x.max()), p.get("alpha", 1.5))


def _softpick_ref(x):
    d = np.exp(x) - 1.0
    total = np.abs(d).sum()
    return np.maximum(d, 0) / total if total > 0 else np.zeros_like(x)


REFS = {
    "softmax": lambda x, p: _softmax(x / p.get("temperature", 1.0)),
    "ssmax": lambda x, p: _softmax(p.get("s", 0.43) * math.log(len(x)) * x),
    "length_scaled": lambda x, p: _softmax((1 + p.get("c", 0.0) * math.log(len(x))) * x),
    "sink": lambda x, p: _sink_ref(
        x, p.get("bias", 0.0) + p.get("bias_log_n", 0.0) * math.log(len(x))
    ),
    "sigmoid": lambda x, p: (
        1.0
        / (
            1.0
            + np.exp(
                -(
                    x
                    + p.get("bias", 0.0)
                    - (math.log(len(x)) if p.get("subtract_log_n", True) else 0.0)
                )
            )
        )
    ),
    "relu": lambda x, p: np.maximum(x, 0) ** p.get("p", 1.0) / len(x),
    "power": lambda x, p: (lambda r: r / r.sum() if r.sum() > 0 else r)(
        np.maximum(x, 0) ** p.get("p", 3.0)
    ),
    "signed": lambda x, p: np.sign(x) * _softmax(np.abs(x)),
    "topk": lambda x, p: (lambda keep: np.where(keep, _softmax(np.where(keep, x, -np.inf)), 0.0))(
        np.isin(np.arange(len(x)), np.argsort(-x, kind="stable")[: p.get("top_k", 8)])
    ),
    "hardmax": lambda x, p: np.eye(len(x))[np.argmax(x)],
    "sparsemax": lambda x, p: _sparsemax_ref(x),
    "entmax15": lambda x, p: _entmax_ref(x, 1.5),
    "entmax": lambda x, p: _entmax_ref(x, p.get("alpha", 1.5)),
    "stick_breaking": lambda x, p: _stick_ref(x),
    "softpick": lambda x, p: _softpick_ref(x),
    "llama4_temperature": _llama4_ref,
    "logn": _logn_ref,
    "asentmax": _asentmax_ref,
}


def reference(method, scores, allowed, params):
    """Apply ``REFS[method]`` row by row to float64 numpy arrays ``[B, H, Lq, Lk]``."""
    s = scores.detach().double().numpy()
    a = allowed.numpy()
    out = np.zeros_like(s)
    b_, h_, lq, lk = s.shape
    for b in range(b_):
        for h in range(h_):
            for i in range(lq):
                ok = a[b, h, i].copy()
                if method == "stick_breaking" and not params.get("attend_current", False):
                    ok &= np.arange(lk) < i + (lk - lq)  # the query's own key is not a piece
                if not ok.any():
                    continue
                p = {
                    k: (float(v.flatten()[h]) if torch.is_tensor(v) else v)
                    for k, v in params.items()
                }
                out[b, h, i, ok] = REFS[method](s[b, h, i, ok], p)
    return out


def per_head(*values):
    return torch.tensor(values, dtype=torch.float64).view(1, H, 1, 1)


# Parameter settings per method: defaults, non-defaults, and per-head tensors (as MHA passes).
CASES = {
    "softmax": [{}],
    "ssmax": [{}, {"s": 1.3}, {"s": per_head(0.2, 0.43, 2.0)}],
    "length_scaled": [{}, {"c": 0.7}, {"c": per_head(0.05, 0.5, 3.0)}],
    "sink": [
        {},
        {"bias": 1.5},
        {"bias": per_head(-1.0, 0.0, 2.0), "bias_log_n": per_head(0.5, -1.0, 0.0)},
    ],
    "sigmoid": [{}, {"bias": per_head(-1.0, 0.0, 2.0)}, {"subtract_log_n": False, "bias": 0.3}],
    "relu": [{}, {"p": 2.0}],
    "power": [{}, {"p": 1.0}, {"p": 5.0}],
    "signed": [{}],
    "topk": [{}, {"top_k": 1}, {"top_k": 3}],
    "hardmax": [{}, {"straight_through": True}],
    "sparsemax": [{}],
    "entmax15": [{}],
    "entmax": [{}, {"alpha": 2.0}, {"alpha": 1.2}, {"alpha": per_head(1.1, 1.5, 3.0)}],
    "stick_breaking": [{}, {"attend_current": True}],
    "softpick": [{}],
    # small floor_scale / train_length so that β(n) varies across the rows of a causal mask
    "llama4_temperature": [
        {},
        {"floor_scale": 3, "attn_scale": 0.5},
        {"floor_scale": 2, "attn_scale": 2.0},
    ],
    "logn": [{}, {"train_length": 3}, {"train_length": 2}],
    "asentmax": [
        {},
        {"beta_pre": 1.0, "gamma_pre": 0.5},
        {"beta_pre": per_head(-1.0, 0.5, 2.0), "gamma_pre": per_head(-2.0, 0.0, 1.5)},
        {"alpha": 2.0, "delta": 0.5, "gamma_max": 1.0, "beta_pre": 0.3, "gamma_pre": -0.7},
    ],
}
ALL_CASES = [(m, p) for m in CASES for p in CASES[m]]


def test_every_method_has_a_reference():
    assert sorted(REFS) == sorted(CASES) == sorted(["softmax", *NEW])


def case_id(case):
    m, p = case
    return m + "".join(f"-{k}={'tensor' if torch.is_tensor(v) else v}" for k, v in p.items())


def masks(lq, lk, causal_only=False):
    """(name, mask [B, 1|H, Lq, Lk]) pairs: padding, causal with Lq != Lk, causal + padding."""
    pad = torch.ones(2, 1, 1, lk, dtype=torch.bool)
    pad[1, ..., -2:] = False  # batch 1: last two keys are padding
    out = [
        ("causal", causal_mask(lq, lk).expand(2, 1, lq, lk)),
        ("causal+padding", causal_mask(lq, lk) & pad),
        ("causal Lq>Lk", causal_mask(lk + 2, lk).expand(2, 1, lk + 2, lk)),  # 2 empty rows
    ]
    if not causal_only:
        out += [("padding", pad.expand(2, 1, lq, lk)), ("none", None)]
    return out


def scores_for(shape, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).requires_grad_(False)


# ---------------------------------------------------------------------------------------------
# The formula of every method, against the NumPy reference, under every mask.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ALL_CASES, ids=case_id)
def test_formula_matches_numpy_reference_under_masks(case):
    method, params = case
    lq, lk = 4, 7
    for name, mask in masks(lq, lk, causal_only=method in CAUSAL_ONLY):
        rows = mask.shape[-2] if mask is not None else lq
        s = scores_for((2, H, rows, lk), seed=len(name))
        s[0, 0, 0, 0] = 45.0  # large logits inside the float64 range of the references
        s[1, 1, -1, 0] = -40.0
        w = nz.get(method)(s, mask, **params)
        full = torch.ones(2, H, rows, lk, dtype=torch.bool) if mask is None else mask
        allowed = full.expand(2, H, rows, lk)
        ref = reference(method, s, allowed, params)
        close_weights(w, ref, s, msg=name)
        assert (w[~allowed] == 0).all(), f"{name}: masked entries must be exactly 0"
        empty = ~allowed.any(-1)
        assert (w[empty] == 0).all(), f"{name}: empty rows must be all zeros"


@pytest.mark.parametrize("method", NEW)
def test_minus_inf_counts_as_masked_and_nan_raises(method):
    s = scores_for((1, 1, 5, 5), seed=1)
    mask = causal_mask(5, 5)
    fn = nz.get(method)
    s_inf = s.masked_fill(~mask, float("-inf"))
    assert torch.equal(fn(s_inf), fn(s, mask))
    bad = s.clone()
    bad[0, 0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"NaN at allowed position \(0, 0, 3, 1\)"):
        fn(bad, mask)


def test_one_key_rows():
    """n = 1: every softmax-family method gives weight 1; the others their own formula."""
    s = torch.tensor([[[2.0], [-3.0]]], dtype=torch.float64)
    for method in NEW:
        if method in CAUSAL_ONLY:
            continue
        ref = reference(method, s[None], torch.ones(1, 1, 2, 1, dtype=torch.bool), {})
        close_weights(nz.get(method)(s), ref[0], s, msg=method)


# ---------------------------------------------------------------------------------------------
# The documented row-sum property of each method.
# ---------------------------------------------------------------------------------------------


def _row_property(method, w, s, allowed, params):
    total = w.sum(-1)
    nonempty = allowed.any(-1)
    pos = (s.clamp_min(0) * allowed).amax(-1) > 0  # some allowed score > 0
    # a row sum adds Lk weights ≤ 1, each with its logit's relative error ε·|s|
    n, mag = s.shape[-1], 1 + float(s.abs().max())

    def close(actual, expect, msg):
        assert_close(actual, expect, n=n, magnitude=mag, msg=f"{method}: {msg}")

    if nz.get(method).sums_to_one:
        close(total, nonempty.to(total.dtype), "rows sum to 1")
    elif method == "sink":  # < 1, the rest is the null attention
        b = params.get("bias", 0.0)
        lse = torch.logsumexp(s.masked_fill(~allowed, -math.inf), -1)
        null = torch.exp(b - torch.logaddexp(torch.full_like(lse, b), lse))
        assert (total < 1).all()
        close(nz.null_attention(w), null, "null attention")
    elif method in ("sigmoid", "relu"):  # unnormalised, element-wise
        assert (w >= 0).all()
        if method == "sigmoid":
            assert (w[allowed] > 0).all() and (w < 1).all()
    elif method == "power":  # 1 if any allowed score is positive, else 0
        close(total, pos.to(total.dtype), "rows sum to 1 or 0")
    elif method == "signed":  # Σ|w| = 1
        close(w.abs().sum(-1), nonempty.to(total.dtype), "Σ|w| = 1")
    elif method == "softpick":  # <= 1; = 1 iff no allowed score is negative; 0 without positives
        assert (total <= 1 + tolerance(torch.float64, n=n, magnitude=mag)).all()
        none_neg = ~((s < 0) & allowed).any(-1) & pos
        close(total[none_neg], torch.ones_like(total[none_neg]), "rows without negatives sum to 1")
        assert (total[~pos] == 0).all()
    elif method == "stick_breaking":  # 1 − Π(1 − σ(s)) over the pieces, < 1
        assert (total < 1).all() and (w >= 0).all()
    else:
        raise AssertionError(f"no documented row-sum property for {method}")


@pytest.mark.parametrize("method", NEW)
def test_documented_row_sum_property(method):
    lq, lk = 5, 9
    for _name, mask in masks(lq, lk, causal_only=method in CAUSAL_ONLY):
        rows = mask.shape[-2] if mask is not None else lq
        s = scores_for((2, H, rows, lk), seed=7, scale=3.0)
        allowed = (torch.ones(2, H, rows, lk, dtype=torch.bool) if mask is None else mask).expand(
            2, H, rows, lk
        )
        _row_property(method, nz.get(method)(s, mask), s, allowed, {})
    # all-negative rows: power and softpick give zeros; signed gives Σ|w| = 1 with all w < 0
    neg = -torch.rand(1, 1, 2, 6, dtype=torch.float64) - 0.1
    mask = causal_mask(2, 6)
    allowed = mask.expand(1, 1, 2, 6)
    _row_property(method, nz.get(method)(neg, mask), neg, allowed, {})


def test_stick_breaking_total_is_one_minus_unbroken_stick():
    s = scores_for((1, 1, 6, 6), seed=3)
    for current in (False, True):
        w = nz.get("stick_breaking")(s, causal_mask(6, 6), attend_current=current)
        for i in range(6):
            pieces = s[0, 0, i, : i + 1 if current else i]
            rest = torch.prod(1 - torch.sigmoid(pieces))
            # a product and a sum of at most 6 terms ≤ 1
            assert_close(w[0, 0, i].sum(), 1 - rest, n=6, magnitude=1.0)


# ---------------------------------------------------------------------------------------------
# Shift invariance: holds for the softmax family, and must visibly fail for the others.
# ---------------------------------------------------------------------------------------------

SHIFT_INVARIANT = {
    "softmax",
    "adaptive",
    "ssmax",
    "length_scaled",
    "topk",
    "hardmax",
    "sparsemax",
    "entmax15",
    "entmax",
    "llama4_temperature",
    "logn",
    "asentmax",
}


@pytest.mark.parametrize("method", nz.available())
def test_shift_invariance_exactly_where_claimed(method):
    s = scores_for((2, H, 5, 8), seed=11)
    mask = causal_mask(5, 8)
    fn = nz.get(method)
    shifted = fn(s + 0.75, mask)
    # equal up to the rounding of s + 0.75 (a weight moves by its logit's error times itself)
    diff = (shifted - fn(s, mask)).abs().max().item()
    same = diff <= tolerance(torch.float64, n=8, magnitude=1 + float(s.abs().max()) + 0.75)
    assert same == (method in SHIFT_INVARIANT), method


# ---------------------------------------------------------------------------------------------
# Extreme logits, half precision, gradients.
# ---------------------------------------------------------------------------------------------


def _extreme_scores(dtype):
    g = torch.Generator().manual_seed(5)
    s = torch.randn(2, H, 6, 10, generator=g) * 3
    s[0, 0, :, 0] = 1e4
    s[0, 1, :, 1] = -1e4
    s[1, :, :, ::2] = 1e4  # several huge maxima in a row
    s[1, 2] = -1e4  # a head of all −1e4
    return s.to(dtype).requires_grad_(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ALL_CASES, ids=case_id)
def test_extreme_logits_finite_values_and_gradients(case, dtype):
    method, params = case
    params = {k: (v.to(torch.float32) if torch.is_tensor(v) else v) for k, v in params.items()}
    s = _extreme_scores(dtype)
    w = nz.get(method)(s, causal_mask(6, 10), **params)
    assert w.dtype == dtype
    assert torch.isfinite(w).all()
    if w.requires_grad:
        (w.float() * torch.linspace(-1, 1, 10)).sum().backward()
        assert torch.isfinite(s.grad).all()


def _grad_inputs(method, params, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(1, H, 4, 5, generator=g, dtype=torch.float64)
    s = s + 0.3 * torch.sign(s)  # away from 0 (kinks of ReLU, |s|, sign) and from ties
    learn = {k: v.clone().requires_grad_(True) for k, v in params.items() if torch.is_tensor(v)}
    return s.requires_grad_(True), learn


GRAD_CASES = [c for c in ALL_CASES if c[0] != "hardmax"]


@pytest.mark.parametrize("case", GRAD_CASES, ids=case_id)
def test_float64_gradcheck(case):
    method, params = case
    s, learn = _grad_inputs(method, params, seed=2)
    fixed = {k: v for k, v in params.items() if k not in learn}
    mask = causal_mask(4, 5)
    fn = nz.get(method)

    def f(scores, *tensors):
        return fn(scores, mask, **fixed, **dict(zip(learn, tensors, strict=True)))

    # a central difference with step 1e-6 has truncation error ~eps²·f''' and rounding ~ε/eps:
    # gradcheck's own tolerance for that, not a rounding bound of ours
    assert torch.autograd.gradcheck(f, (s, *learn.values()), eps=1e-6, atol=1e-5, fast_mode=True)


def test_hardmax_gradient_zero_or_straight_through():
    s = torch.randn(1, 1, 3, 5, dtype=torch.float64, requires_grad=True)
    mask = causal_mask(3, 5)
    assert not nz.get("hardmax")(s, mask).requires_grad  # no gradient: piecewise constant
    g = torch.randn(1, 1, 3, 5, dtype=torch.float64)
    (nz.get("hardmax")(s, mask, straight_through=True) * g).sum().backward()
    s2 = s.detach().clone().requires_grad_(True)
    (nz.get("softmax")(s2, mask) * g).sum().backward()
    # the straight-through gradient is softmax's: w·(g − Σ w·g) over 5 keys, terms ≤ max |g|
    assert_close(s.grad, s2.grad, n=5, magnitude=float(g.abs().max()))


def test_hardmax_ties_pick_the_first():
    s = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    mask = torch.tensor([True, False, True, True])
    w = nz.get("hardmax")(s, mask)
    assert w.tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]


def test_length_scaled_learnable_c_straight_through_below_zero():
    s = torch.randn(1, 1, 4, 6, dtype=torch.float64)
    c = torch.tensor(-0.5, dtype=torch.float64, requires_grad=True)
    w = nz.get("length_scaled")(s, c=c)
    assert torch.equal(w, nz.get("softmax")(s))  # acts as c = 0: exactly 1·s
    (w * torch.randn_like(w)).sum().backward()
    assert c.grad is not None and c.grad != 0  # ... but can come back


@pytest.mark.parametrize(
    ("method", "params", "match"),
    [
        ("length_scaled", {"c": -0.1}, "c must be a finite number >= 0"),
        ("relu", {"p": 0.5}, "p must be a finite number >= 1"),
        ("power", {"p": 0}, "p must be a finite number >= 1"),
        ("topk", {"top_k": 0}, "top_k must be an integer >= 1"),
        ("topk", {"top_k": 2.5}, "top_k must be an integer >= 1"),
        ("entmax", {"alpha": 1.0}, "alpha must be a finite number > 1"),
        ("llama4_temperature", {"floor_scale": 0}, "floor_scale must be a finite number > 0"),
        ("llama4_temperature", {"attn_scale": math.inf}, "attn_scale must be a finite number"),
        ("logn", {"train_length": 1}, "train_length must be a finite number > 1"),
        ("asentmax", {"delta": -0.5}, "delta must be a finite number >= 0"),
        ("asentmax", {"alpha": 1.0}, "alpha must be a finite number > 1"),
    ],
)
def test_bad_parameters_raise_one_sentence(method, params, match):
    with pytest.raises(ValueError, match=match):
        nz.get(method)(torch.randn(2, 3), **params)


def test_stick_breaking_refuses_non_causal_patterns():
    s = torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError, match="causal only"):
        nz.get("stick_breaking")(s)
    with pytest.raises(ValueError, match="causal only"):
        attend(s, s, s, "stick_breaking")  # attend without causal=True
    q = torch.randn(1, 2, 3, 4)
    attend(q, q, q, "stick_breaking", causal=True)  # fine


# ---------------------------------------------------------------------------------------------
# Through attend() and MultiheadAttention.
# ---------------------------------------------------------------------------------------------


def _fixed_params(method):
    """The non-default, non-tensor parameter case of a method (or its defaults)."""
    plain = [p for p in CASES[method] if not any(torch.is_tensor(v) for v in p.values())]
    return plain[-1]


@pytest.mark.parametrize("method", NEW)
def test_attend_equals_weights_times_values_with_gqa_and_padding(method):
    g = torch.Generator().manual_seed(0)
    b, h, hkv, lq, lk, d = 2, 4, 2, 3, 6, 8
    q = torch.randn(b, h, lq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64)
    pad = torch.ones(b, 1, 1, lk, dtype=torch.bool)
    pad[1, ..., 0] = False
    params = _fixed_params(method)
    out, w = attend(q, k, v, method, mask=pad, causal=True, return_weights=True, **params)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = q @ kk.transpose(-1, -2) / math.sqrt(d)
    allowed = (pad & causal_mask(lq, lk)).expand(b, h, lq, lk)
    ref = reference(method, scores, allowed, params)
    # the scores are width-d dot products (their error ε·√d·|q||k| passes to the weights)
    close_weights(w, ref, scores, n=lk * d)
    close_weights(out, ref @ vv.numpy(), scores, n=lk * d, values=vv)
    fast = attend(q, k, v, method, mask=pad, causal=True, **params)  # may take a fused path
    close_weights(fast, out, scores, n=lk * d, values=vv)


LEARNABLE = [m for m in NEW if nz.get(m).learnable]


def test_the_issue_learnable_parameters():
    learnable = {m: [p.name for p in nz.get(m).learnable] for m in LEARNABLE}
    assert learnable == {
        "ssmax": ["s"],
        "length_scaled": ["c"],
        "sink": ["bias", "bias_log_n"],
        "sigmoid": ["bias"],
        "asentmax": ["beta_pre", "gamma_pre"],
    }


@pytest.mark.parametrize("method", LEARNABLE)
def test_mha_learnable_parameters_are_per_head_and_get_gradients(method):
    torch.manual_seed(0)
    mha = MultiheadAttention(16, 4, method, num_kv_heads=2, causal=True)
    names = [p.name for p in nz.get(method).learnable]
    assert sorted(mha.normalizer_params) == sorted(names)
    defaults = {p.name: p.default for p in nz.get(method).learnable}
    for name in names:
        p = mha.normalizer_params[name]
        assert p.shape == (4,)
        assert torch.equal(p.detach(), torch.full((4,), float(defaults[name])))
    # different per-head values give different heads: the weights of head h use value h
    with torch.no_grad():
        for p in mha.normalizer_params.values():
            p.copy_(torch.tensor([0.1, 0.4, 0.9, 1.6]))
    x = torch.randn(2, 7, 16)
    out, w = mha(x, return_weights=True)
    for h in range(4):
        params = {n: mha.normalizer_params[n][h].item() for n in names}
        q = mha.q_proj(x).view(2, 7, 4, 4).transpose(1, 2)[:, h]
        k = mha.k_proj(x).view(2, 7, 2, 4).transpose(1, 2)[:, h // 2]
        ref = nz.get(method)(q @ k.transpose(-1, -2) / 2.0, causal_mask(7, 7), **params)
        close_weights(w[:, h], ref, q @ k.transpose(-1, -2) / 2.0, n=7 * 4)  # float32, both
    out.pow(2).mean().backward()
    for name in names:
        grad = mha.normalizer_params[name].grad
        assert grad is not None and torch.isfinite(grad).all() and (grad != 0).all(), name


@pytest.mark.parametrize("method", NEW)
def test_mha_runs_every_method_with_key_padding(method):
    torch.manual_seed(0)
    # a parameter named as one of the layer's own options (sink's and sigmoid's bias: the
    # projections' bias switch) can not be given to the layer; it starts at its default
    own = inspect.signature(MultiheadAttention).parameters
    params = {n: v for n, v in _fixed_params(method).items() if n not in own}
    mha = MultiheadAttention(8, 2, method, causal=True, **params)
    x = torch.randn(2, 5, 8)
    key_mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    out = mha(x, key_mask=key_mask)
    assert out.shape == (2, 5, 8) and torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------
# A tiny model with each method learns a toy task: predict the previous token (needs attention).
# ---------------------------------------------------------------------------------------------

TRAIN_PARAMS = {"hardmax": {"straight_through": True}}  # plain hardmax passes no gradient to q, k


class _PrevToken(torch.nn.Module):
    def __init__(self, method, vocab=8, length=8, d=32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(length, d) * 0.5)
        self.attn = MultiheadAttention(d, 2, method, causal=True, **TRAIN_PARAMS.get(method, {}))
        self.out = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos
        return self.out(x + self.attn(x))


@pytest.mark.parametrize("method", NEW)
def test_small_model_learns_previous_token_task(method):
    torch.manual_seed(0)
    vocab, length = 8, 8
    model = _PrevToken(method, vocab, length)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(60):
        tokens = torch.randint(vocab, (32, length), generator=data)
        logits = model(tokens)[:, 1:]  # position i predicts token i − 1
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, vocab), tokens[:, :-1].flatten()
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    start, end = losses[0], np.mean(losses[-10:])
    # Without attention the best loss is log(vocab) = 2.08; learning the task goes well below it.
    assert end < start and end < 0.25 * math.log(vocab), (method, start, end)
