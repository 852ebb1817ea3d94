"""Adaptive temperature on slabs of whole rows (attention/cpu/adaptive_tiled.py): against the naive
path and an independent float64 NumPy reference on inputs that cross slab edges and every mask,
its backward by float64 gradcheck (β's gradient included), its C++ loops against its PyTorch
form, the groups of heads a large call is cut into, and when ``attend`` takes it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import reference
from precision import assert_close
from sharpattn.attention import attend, policy
from sharpattn.attention.cpu import adaptive_tiled as at
from sharpattn.attention.cpu import native
from sharpattn.attention.masking import Masking
from sharpattn.normalizers.softmax import resolve_coefficients
from slab_inputs import masks, qkv

pytestmark = pytest.mark.numerical

ICML = tuple(resolve_coefficients("icml"))


# (name, lq, lk, hkv, mask, causal)
CASES = [
    ("plain", 9, 11, 2, None, False),
    ("causal", 9, 9, 4, None, True),
    ("padding", 5, 7, 2, "pad", False),
    ("row_mask_empty_row", 5, 7, 4, "row", False),
    ("causal_lq_lt_lk", 4, 7, 2, None, True),
    ("causal_lq_gt_lk", 7, 4, 2, None, True),  # the first 3 rows see nothing
    ("gqa_row_causal", 6, 6, 1, "row", True),
]
# (coefficients, threshold, floor, detach_beta): the paper's rule; β's gradient cut; a floor
# below 0 with a polynomial that goes negative (β < 0: the weights peak at the row's minimum)
RULES = [
    (ICML, 0.5, 1.0, False),
    (ICML, 0.5, 1.0, True),
    ((-1.0, 0.3), 0.2, -4.0, False),
]


@pytest.fixture
def two_row_slabs(monkeypatch):
    """Slabs of 2 rows: the backward accumulates dk, dv over slabs, a causal slab stops at its
    own last key."""
    monkeypatch.setattr(policy, "ADAPTIVE_SLAB_ELEMENTS", 1)
    monkeypatch.setattr(policy, "ADAPTIVE_MIN_ROWS", 2)


def run(q, k, v, mask, causal, rule, scale=0.7):
    masking = Masking.build(mask, causal, q.shape[2], k.shape[2], "cpu")
    return at.adaptive_slabs(q, k, v, masking, scale, rule)


def exact(q, k, v, mask, causal, rule, scale=0.7):
    """Fig. 4's rule on the whole score matrix in float64 with the exact entropy −Σ p·log p
    (the naive path's reference-code −Σ p·log(p + 1e-9) differs from it by up to n·1e-9: a
    definition, not rounding), differentiable."""
    coef, threshold, floor, detach = rule
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = scale * q @ k.transpose(-2, -1)
    lq, lk = s.shape[-2:]
    allowed = torch.ones_like(s, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask
    if causal:
        allowed = allowed & (torch.arange(lk) <= torch.arange(lq).unsqueeze(-1) + lk - lq)
    hidden = -1e30  # exp(hidden − max) is 0 exactly; a row with no key is zeroed below
    p = torch.softmax(s.masked_fill(~allowed, hidden), -1)
    h = -(p * torch.log(torch.where(p > 0, p, 1.0))).sum(-1, keepdim=True)
    poly = torch.zeros_like(h)
    for c in coef:
        poly = poly * h + c
    beta = torch.where(h > threshold, poly.clamp_min(floor), torch.ones_like(h))
    if detach:
        beta = beta.detach()
    w = torch.softmax((beta * s).masked_fill(~allowed, hidden), -1) * allowed.any(-1, True)
    return w @ v


@pytest.mark.cpu_independent
@pytest.mark.parametrize("rule", [RULES[0], RULES[2]], ids=["icml", "negative_beta"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gradcheck_of_the_slab_backward(two_row_slabs, case, rule):
    _, lq, lk, hkv, kind, causal = case
    q, k, v = qkv(lq=lq, lk=lk, hkv=hkv, gain=2.0)
    mask = masks(kind, 2, 4, lq, lk)  # (detach_beta's gradient is not the derivative: it is
    assert torch.autograd.gradcheck(  # held to the naive path's below)
        lambda q, k, v: run(q, k, v, mask, causal, rule), (q, k, v), atol=1e-6, rtol=1e-5
    )


@pytest.mark.parametrize("rule", RULES, ids=["icml", "detached", "negative_beta"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_slabs_equal_the_whole_matrix_with_gradients(two_row_slabs, case, rule):
    _, lq, lk, hkv, kind, causal = case
    q, k, v = qkv(lq=lq, lk=lk, hkv=hkv, gain=3.0, seed=1)
    mask = masks(kind, 2, 4, lq, lk)
    out = run(q, k, v, mask, causal, rule)
    want = exact(q, k, v, mask, causal, rule)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), g)
    want_grads = torch.autograd.grad(want, (q, k, v), g)
    # β(H) is a polynomial of a sum over the keys: dβ/dH·s carries its rounding, a few times more
    assert_close(out, want, n=lk, ulps=16)
    for got, exp in zip(grads, want_grads, strict=True):
        assert_close(got, exp, n=lk, ulps=64)


def test_slabs_equal_an_independent_numpy_reference(two_row_slabs):
    """The paper's reference maths in NumPy (tests/reference.py), causal, long rows with high
    entropy (β > 1) and a peaked head (β = 1)."""
    q, k, v = qkv(b=1, h=2, hkv=2, lq=40, lk=40, d=8, dv=5, seed=4)
    with torch.no_grad():
        q[:, 1] *= 12.0  # one peaked head: H below the threshold for many rows
        out = run(q, k, v, None, True, (ICML, 0.5, 1.0, False), scale=1.0)

    def row(x):  # Fig. 4's rule with the exact entropy (the figure's log(p + 1e-9) is below
        p = np.exp(x - x.max())  # it by up to n·1e-9, which moves β by more than rounding)
        p /= p.sum()
        h = -np.sum(p * np.log(p))
        beta = max(np.polyval(ICML, h), 1.0) if h > 0.5 else 1.0
        w = np.exp(beta * (x - x.max()))
        return w / w.sum()

    def weights(s, mask):
        return reference.row_wise(s, mask, row)

    want = reference.attention(
        q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), weights, causal=True, scale=1.0
    )
    assert_close(out, np.asarray(want), n=40, ulps=16)


def test_huge_scores_are_finite():
    """Scores of 1e30: one key per row (β = 1), no overflow or NaN, forward and backward."""
    q, k, v = qkv(lq=6, lk=6, dtype=torch.float32)
    with torch.no_grad():
        q.mul_(1e15)
        k.mul_(1e15)
    out = run(q, k, v, None, True, (ICML, 0.5, 1.0, False))
    out.sum().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(x.grad).all() for x in (q, k, v))


@pytest.mark.parametrize("rule", RULES, ids=["icml", "detached", "negative_beta"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_loops_equal_the_pytorch_slabs(monkeypatch, case, rule):
    """The C++ loops (adaptive_forward, tempered_backward) against the same slabs in PyTorch;
    tiles with a mask other than causal stay in PyTorch either way."""
    if native.compiler() is None:
        pytest.skip("no C++ compiler on the PATH: the loops are not built here")
    monkeypatch.setattr(policy, "ADAPTIVE_SLAB_ELEMENTS", 1)
    monkeypatch.setattr(policy, "ADAPTIVE_MIN_ROWS", 3)
    _, lq, lk, hkv, kind, causal = case
    lq, lk = 5 * lq, 5 * lk
    q, k, v = qkv(lq=lq, lk=lk, hkv=hkv, d=8, gain=3.0, seed=5, dtype=torch.float32)
    mask = masks(kind, 2, 4, lq, lk)
    calls = []
    real = native.adaptive_forward
    monkeypatch.setattr(native, "adaptive_forward", lambda *a: calls.append(1) or real(*a))
    results = []
    for mode in ("auto", "0"):
        monkeypatch.setenv("SHARPATTN_COMPILE", mode)
        xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = run(*xs, mask, causal, rule)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
        results.append((out.detach(), *(x.grad for x in xs)))
    assert (len(calls) > 0) == (mask is None)
    for got, want in zip(*results, strict=True):
        assert_close(got, want, n=lk, ulps=32)


def test_groups_of_heads_equal_one_call(monkeypatch):
    """A call whose slab would exceed ADAPTIVE_SLAB_MAX is cut into groups of items, then of key heads
    (with their query heads); the pieces give the same output and gradients."""
    if native.compiler() is None:
        pytest.skip("no C++ compiler on the PATH: the slab path is not taken here")
    q, k, v = qkv(b=3, h=6, hkv=3, lq=20, lk=24, d=8, dtype=torch.float32, gain=2.0)
    masking = Masking.build(None, True, 20, 24, "cpu")
    results = []
    for most in (
        policy.ADAPTIVE_SLAB_MAX,
        6 * 20 * 24,
        2 * 20 * 24,
    ):  # whole, items, pairs of query heads
        monkeypatch.setattr(policy, "ADAPTIVE_MIN_ROWS", 20)
        monkeypatch.setattr(policy, "ADAPTIVE_SLAB_MAX", most)
        expect = {policy.ADAPTIVE_SLAB_MAX: 1, 6 * 20 * 24: 3, 2 * 20 * 24: 9}[most]
        assert len(at._head_groups(q, k)) == expect
        xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, _ = at.adaptive(*xs, masking, 0.5, False)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
        results.append((out.detach(), *(x.grad for x in xs)))
    for other in results[1:]:
        for got, want in zip(other, results[0], strict=True):
            assert torch.equal(got, want)


def test_which_calls_take_the_slabs(monkeypatch):
    if native.compiler() is None:
        pytest.skip("no C++ compiler on the PATH: the slab path is not taken here")
    taken = []
    real = at.adaptive_slabs
    monkeypatch.setattr(at, "adaptive_slabs", lambda *a: taken.append(1) or real(*a))
    # more query rows than a decoding step (`decoding.ROWS`), which runs its own pass
    q, k, v = (x.detach() for x in qkv(lq=24, lk=8, dtype=torch.float32))

    def took(**kw):
        taken.clear()
        attend(q, k, v, "adaptive", check_finite=False, **kw)
        return bool(taken)

    assert took() and took(causal=True)
    assert not took(mask=torch.ones(24, 8, dtype=torch.bool))  # a user mask: two passes
    assert not took(return_stats=True)  # statistics: two passes (they need the flash lse)
    monkeypatch.setenv("SHARPATTN_COMPILE", "0")  # no loops: two passes
    assert not took()
    monkeypatch.setenv("SHARPATTN_COMPILE", "auto")
    monkeypatch.setattr(policy, "ADAPTIVE_SLAB_MAX", 4 * 8)  # one head's slab too large: two passes
    assert not took()
