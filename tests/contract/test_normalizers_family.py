"""Every normalizer behind the one contract (issue 3): formulas against independent NumPy float64
references, masks, row sums, shift invariance, extreme logits, gradients, attend / MHA, training.
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch

from methods import CASES as ALL_CASES
from methods import TABLE, H, case_id, reference
from precision import assert_close, tolerance
from sharpattn import normalizers as nz
from sharpattn.attention import MultiheadAttention, attend, causal_mask

# every registered method but softmax and adaptive (test_normalizers.py's): new registry entries
# are picked up here, and fail test_every_method_is_in_the_table until tests/methods.py has them;
# the references and parameter cases are its table's
NEW = [m for m in nz.available() if m not in ("softmax", "adaptive")]
CAUSAL_ONLY = {m.name for m in TABLE.values() if m.causal_only}

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


def test_every_method_is_in_the_table():
    assert sorted(TABLE) == sorted(nz.available())


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

    kind = TABLE[method].row_sum
    if nz.get(method).sums_to_one:
        close(total, nonempty.to(total.dtype), "rows sum to 1")
    elif kind == "sink":  # < 1, the rest is the null attention
        b = params.get("bias", 0.0)
        lse = torch.logsumexp(s.masked_fill(~allowed, -math.inf), -1)
        null = torch.exp(b - torch.logaddexp(torch.full_like(lse, b), lse))
        assert (total < 1).all()
        close(nz.null_attention(w), null, "null attention")
    elif kind in ("in (0, 1)", ">= 0"):  # unnormalised, element-wise
        assert (w >= 0).all()
        if kind == "in (0, 1)":
            assert (w[allowed] > 0).all() and (w < 1).all()
    elif kind == "1 or 0":  # 1 if any allowed score is positive, else 0
        close(total, pos.to(total.dtype), "rows sum to 1 or 0")
    elif kind == "Σ|w| = 1":
        close(w.abs().sum(-1), nonempty.to(total.dtype), "Σ|w| = 1")
    elif kind == "softpick":  # <= 1; = 1 iff no allowed score is negative; 0 without positives
        assert (total <= 1 + tolerance(torch.float64, n=n, magnitude=mag)).all()
        none_neg = ~((s < 0) & allowed).any(-1) & pos
        close(total[none_neg], torch.ones_like(total[none_neg]), "rows without negatives sum to 1")
        assert (total[~pos] == 0).all()
    elif kind == "< 1":  # stick-breaking: 1 − Π(1 − σ(s)) over the pieces
        assert (total < 1).all() and (w >= 0).all()
    else:
        raise AssertionError(f"no documented row-sum property for {method} (tests/methods.py)")


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

SHIFT_INVARIANT = {m.name for m in TABLE.values() if m.shift_invariant}


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
        ("entmax", {"alpha": 1.0}, "alpha must be a finite number in \\[1.01, 2.5\\]"),
        ("llama4_temperature", {"floor_scale": 0}, "floor_scale must be a finite number > 0"),
        ("llama4_temperature", {"attn_scale": math.inf}, "attn_scale must be a finite number"),
        ("logn", {"train_length": 1}, "train_length must be a finite number > 1"),
        ("asentmax", {"delta": -0.5}, "delta must be a finite number >= 0"),
        ("asentmax", {"alpha": 1.0}, "alpha must be a finite number in \\[1.01, 2.5\\]"),
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
    plain = [p for p in TABLE[method].cases if not any(torch.is_tensor(v) for v in p.values())]
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
