"""The O(n)-memory sparse paths (attention/cpu/sparse_tiled.py): sparsemax, 1.5-entmax, α-entmax,
ASEntmax and top-k against the naive path and independent float64 NumPy references, with
inputs that cross query-block and candidate-chunk edges; their backward by gradcheck."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from precision import assert_close
from sharpattn.attention import attend, policy
from sharpattn.attention.cpu import native
from sharpattn.attention.cpu import sparse_tiled as st
from sharpattn.normalizers import get
from slab_inputs import masks, qkv

pytestmark = pytest.mark.numerical


# (name, lq, lk, hkv, mask, causal)
CASES = [
    ("padding", 5, 7, 2, "pad", False),
    ("row_mask_empty_row", 5, 7, 4, "row", False),
    ("causal_lq_lt_lk", 4, 7, 2, None, True),
    ("causal_lq_gt_lk", 7, 4, 2, None, True),  # the first 3 rows see nothing
    ("gqa_row_causal", 6, 6, 1, "row", True),
]

PER_HEAD_ALPHA = torch.tensor([1.3, 1.5, 1.8, 2.0], dtype=torch.float64).view(1, 4, 1, 1)
#: a head with α > 2: the tiles all the same (a tensor α is never read on the host)
PER_HEAD_ALPHA_ABOVE_2 = torch.tensor([1.3, 1.5, 2.0, 2.5], dtype=torch.float64).view(1, 4, 1, 1)

# (method, params) whose backward is checked by gradcheck
METHODS = [
    ("sparsemax", {}),
    ("entmax15", {}),
    ("entmax", {"alpha": 1.3}),
    ("entmax", {"alpha": 2.5}),  # the query-block path
    ("entmax", {"alpha": PER_HEAD_ALPHA}),
    ("entmax", {"alpha": PER_HEAD_ALPHA_ABOVE_2}),
    ("topk", {"top_k": 3}),
    ("asentmax", {}),
]


@pytest.fixture
def two_row_blocks(monkeypatch):
    """Query blocks of 2 rows: the backward accumulates dk, dv over blocks and cuts per-row
    parameters (per-query θ) at block edges."""
    monkeypatch.setattr(policy, "SPARSE_SLAB_ELEMENTS", 1)
    monkeypatch.setattr(policy, "SPARSE_MIN_ROWS", 2)


@pytest.mark.cpu_independent
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("method,params", METHODS, ids=lambda x: str(x))
def test_gradcheck_of_the_tiled_backward(two_row_blocks, method, params, case):
    _, lq, lk, hkv, kind, causal = case
    q, k, v = qkv(lq=lq, lk=lk, hkv=hkv, gain=2.0)
    mask = masks(kind, 2, 4, lq, lk)

    def f(q, k, v):
        return attend(q, k, v, method, mask=mask, causal=causal, impl="fused", **params)

    assert torch.autograd.gradcheck(f, (q, k, v), atol=1e-6, rtol=1e-5)


@pytest.mark.cpu_independent
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("per", ["head", "query"])
def test_gradcheck_asentmax_parameters(two_row_blocks, per, case):
    _, lq, lk, hkv, kind, causal = case
    q, k, v = qkv(lq=lq, lk=lk, hkv=hkv, gain=2.0)
    mask = masks(kind, 2, 4, lq, lk)
    g = torch.Generator().manual_seed(5)
    shape = (1, 4, 1, 1) if per == "head" else (2, 4, lq, 1)
    beta = (0.5 * torch.randn(shape, generator=g, dtype=torch.float64)).requires_grad_()
    gamma = (0.5 * torch.randn(shape, generator=g, dtype=torch.float64)).requires_grad_()

    def f(q, k, v, beta, gamma):
        return attend(
            q,
            k,
            v,
            "asentmax",
            mask=mask,
            causal=causal,
            impl="fused",
            beta_pre=beta,
            gamma_pre=gamma,
        )

    assert torch.autograd.gradcheck(f, (q, k, v, beta, gamma), atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Against the naive path on inputs that cross tile edges


@pytest.fixture
def small_tiles(monkeypatch):
    """Query blocks of a few rows and 8 candidates (chunks of ~37 keys at n = 300): rows cross
    block edges, and the candidates' threshold is rarely exact, so the Newton steps matter."""
    monkeypatch.setattr(policy, "SPARSE_SLAB_ELEMENTS", 2**13)
    monkeypatch.setattr(st, "CANDIDATES", 8)


LONG = [
    ("plain", 300, 300, None, False),
    ("causal", 300, 300, None, True),
    ("causal_lq_lt_lk", 130, 300, "pad", True),
    ("causal_lq_gt_lk", 300, 170, None, True),
    ("row_mask", 200, 300, "row", False),
]

FAST_METHODS = [
    ("sparsemax", {}),
    ("entmax15", {}),
    ("entmax", {"alpha": 1.3}),
    ("entmax", {"alpha": PER_HEAD_ALPHA.float()}),
    ("entmax", {"alpha": PER_HEAD_ALPHA_ABOVE_2.float()}),
    ("topk", {"top_k": 5}),
    ("asentmax", {"beta_pre": torch.tensor([0.3, -0.2, 0.0, 1.0]).view(1, 4, 1, 1)}),
]


def _run(method, impl, q, k, v, mask, causal, params):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, stats = attend(
        q, k, v, method, mask=mask, causal=causal, impl=impl, return_stats=True, **params
    )
    cot = torch.cos(torch.arange(out.numel(), dtype=torch.float64)).view_as(out).to(out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), cot)
    return out.detach(), stats, grads


@pytest.mark.parametrize("case", LONG, ids=[c[0] for c in LONG])
@pytest.mark.parametrize("method,params", FAST_METHODS, ids=lambda x: str(x))
def test_tiled_path_matches_naive_across_tile_edges(small_tiles, method, params, case):
    _, lq, lk, kind, causal = case
    q, k, v = qkv(b=1, h=4, hkv=2, lq=lq, lk=lk, d=16, dv=8, dtype=torch.float32)
    mask = masks(kind, 1, 4, lq, lk)
    if kind == "pad":
        mask[0, ..., :] = torch.rand(lk, generator=torch.Generator().manual_seed(9)) > 0.3
    out, stats, grads = _run(method, "fused", q, k, v, mask, causal, params)
    r_out, r_stats, r_grads = _run(method, "naive", q, k, v, mask, causal, params)
    vmax = float(v.detach().abs().max())
    # outputs: sums of Lk terms of size ≤ |v|; the paths' weights differ by the rounding of the
    # scores (blocked and whole GEMMs) and of τ (Newton vs bisection/sort); 16 ulps as in the
    # adversarial suite, where the same two roundings compound
    assert_close(out, r_out, n=lk, magnitude=vmax, ulps=16, msg="output")
    assert torch.equal(stats.visible, r_stats.visible)
    assert_close(stats.mass, r_stats.mass, n=lk, ulps=16, msg="mass")
    assert_close(stats.entropy, r_stats.entropy, n=lk, magnitude=np.log(lk), ulps=32, msg="H")
    mag = max(float(r.abs().max()) for r in r_grads)
    for name, g, r in zip("qkv", grads, r_grads, strict=True):
        # a gradient is a sum over keys of head-dimension products, through the Jacobian's
        # Σ u g / Σ u: the adversarial suite's 64 ulps
        assert_close(g, r, n=lk * 16, magnitude=mag, ulps=64, msg=f"d/d{name}")


# ---------------------------------------------------------------------------------------------
# Independent float64 NumPy references (sort-based), n ≈ 300 with small tiles


def np_sparse(s, allowed, alpha):
    """sparsemax (α = 2) or 1.5-entmax by sorting each row's allowed scores (float64)."""
    out = np.zeros_like(s)
    for idx in np.ndindex(*s.shape[:-1]):
        keep = allowed[idx]
        if not keep.any():
            continue
        x = s[idx][keep] * (alpha - 1.0)
        x = x - x.max()
        z = np.sort(x)[::-1]
        r = np.arange(1, len(z) + 1)
        if alpha == 2.0:
            tau_r = (np.cumsum(z) - 1.0) / r
            ks = np.nonzero(z > tau_r)[0].max()
        else:
            mean = np.cumsum(z) / r
            ss = r * (np.cumsum(z * z) / r - mean**2)
            tau_r = mean - np.sqrt(np.maximum((1.0 - ss) / r, 0.0))
            ks = np.nonzero(tau_r <= z)[0].max()
        p = np.maximum(x - tau_r[ks], 0.0) ** (1.0 / (alpha - 1.0))
        row = np.zeros(s.shape[-1])
        row[keep] = p
        out[idx] = row
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("method,alpha", [("sparsemax", 2.0), ("entmax15", 1.5)])
def test_tiled_path_matches_numpy_sort_reference(small_tiles, method, alpha, causal):
    lq, lk = 260, 300
    q, k, v = qkv(b=1, h=4, hkv=2, lq=lq, lk=lk, d=16, dv=8, dtype=torch.float32, gain=0.5)
    mask = masks("pad", 1, 4, lq, lk)
    out = attend(q, k, v, method, mask=mask, causal=causal, impl="fused")
    qn, kn, vn = (t.detach().double().numpy() for t in (q, k, v))
    kn, vn = np.repeat(kn, 2, axis=1), np.repeat(vn, 2, axis=1)
    s = qn @ np.swapaxes(kn, -1, -2) / 4.0
    allowed = np.broadcast_to(mask.numpy(), s.shape).copy()
    if causal:
        allowed &= np.arange(lk)[None, :] <= np.arange(lq)[:, None] + (lk - lq)
    ref = np_sparse(s, allowed, alpha) @ vn
    assert_close(out, ref, n=lk, magnitude=float(np.abs(vn).max()), ulps=16)


# ---------------------------------------------------------------------------------------------
# top-k ties, dtypes, the solver's corners


def test_topk_breaks_ties_by_key_order_on_every_path(small_tiles):
    # integer scores: many ties at the k-th place
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-2, 3, (1, 2, 40, 4), generator=g).float()
    k = torch.randint(-2, 3, (1, 2, 50, 4), generator=g).float()
    v = torch.eye(50).expand(1, 2, 50, 50)  # the output is the weights
    w = get("topk").fn(q @ k.transpose(-1, -2), top_k=4)
    kept = w > 0
    assert bool((kept.sum(-1) == 4).all())
    # the kept keys: every score above the 4th largest, then the lowest indices at it
    s = q @ k.transpose(-1, -2)
    tau = s.topk(4, dim=-1).values[..., -1:]
    ties = (s == tau) & kept
    first = (s == tau).cumsum(-1) <= ties.sum(-1, keepdim=True)
    assert torch.equal(kept, (s > tau) | ((s == tau) & first))
    fused = attend(q, k, v, "topk", top_k=4, scale=1.0, impl="fused")
    assert torch.equal(fused > 0, kept)
    assert_close(fused, w, n=50)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["sparsemax", "entmax15", "topk"])
def test_16_bit_inputs_compute_in_float32(method, dtype):
    q, k, v = qkv(b=1, lq=20, lk=30, d=8, dtype=dtype)
    out = attend(q, k, v, method, causal=True, impl="fused")
    ref = attend(q, k, v, method, causal=True, impl="naive")
    assert out.dtype == dtype
    assert_close(out, ref, n=30, magnitude=float(v.detach().abs().max()))
    (gq,) = torch.autograd.grad(out.float().sum(), q)
    assert gq.dtype == dtype and bool(torch.isfinite(gq).all())


@pytest.mark.parametrize("alpha", [1.01, 1.1, 1.3, 2.0, 2.5])
def test_entmax_threshold_of_any_alpha(alpha):
    """α in the convex (α <= 2: Newton here) and concave (α > 2: the query-block path's
    bisection) regimes of f(τ), rows of 2,000 keys: the bisection's answer."""
    q, k, v = qkv(b=1, h=2, hkv=2, lq=16, lk=2000, d=16, dtype=torch.float64)
    out = attend(q, k, v, "entmax", alpha=alpha, n_iter=200, impl="fused")
    ref = attend(q, k, v, "entmax", alpha=alpha, n_iter=200, impl="naive")
    # float64 weights from a τ exact to ~1e-13 (bisection's 200 halvings and Newton's steps
    # each stop at rounding of y ∈ [−1, 0]); α near 1 amplifies τ's error by 1/(α−1)
    assert_close(out, ref, n=2000, magnitude=float(v.detach().abs().max()), ulps=16 / (alpha - 1))


def test_learnable_alpha_takes_the_differentiable_block_path():
    q, k, v = qkv(lq=6, lk=9)
    alpha = torch.full((1, 4, 1, 1), 1.4, dtype=torch.float64, requires_grad=True)
    out = attend(q, k, v, "entmax", alpha=alpha, impl="fused")
    ref = attend(q, k, v, "entmax", alpha=alpha, impl="naive")
    assert_close(out, ref, n=9, magnitude=float(v.detach().abs().max()))
    (ga,) = torch.autograd.grad(out.sum(), alpha)
    (ra,) = torch.autograd.grad(ref.sum(), alpha)
    assert_close(ga, ra, n=9, ulps=64)


def test_alpha_at_most_one_is_refused():
    q, k, v = qkv()
    for alpha in (1.0, torch.tensor([1.5, 1.0, 2.0, 3.0]).view(1, 4, 1, 1)):
        with pytest.raises(ValueError, match="alpha"):
            attend(q, k, v, "entmax", alpha=alpha, impl="fused")


def test_huge_scores_give_the_arg_max():
    q, k, v = qkv(b=1, lq=8, lk=64, d=4, dtype=torch.float32)
    for method in ("sparsemax", "entmax15", "asentmax", "topk"):
        out = attend(q * 1e15, k * 1e15, v, method, impl="fused", check_finite=False)
        ref = attend(q * 1e15, k * 1e15, v, method, impl="naive", check_finite=False)
        assert bool(torch.isfinite(out).all()), method
        assert_close(out, ref, n=64, magnitude=float(v.detach().abs().max()), msg=method)


def test_fused_is_the_auto_path_of_the_sparse_methods():
    for method in ("sparsemax", "entmax15", "entmax", "asentmax", "topk"):
        assert get(method).fused == f"{method}_tiled"


def test_which_alpha_takes_the_tiled_path(monkeypatch):
    """A number α up to 2 and a tensor α (never read on the host) run the tiled solver; a
    learnable α or a number α > 2 the query-block path (exact bisection, gradient in α)."""
    calls = []
    real = st._EntmaxAttention.apply
    monkeypatch.setattr(st._EntmaxAttention, "apply", lambda *a: calls.append(1) or real(*a))
    q, k, v = qkv(lq=4, lk=6)
    cases = [
        (1.3, True),
        (2.0, True),
        (PER_HEAD_ALPHA, True),
        (2.5, False),
        (PER_HEAD_ALPHA_ABOVE_2, True),
        (PER_HEAD_ALPHA.clone().requires_grad_(), False),
    ]
    for alpha, tiled in cases:
        calls.clear()
        attend(q, k, v, "entmax", alpha=alpha, impl="fused")
        assert bool(calls) == tiled, alpha


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("alpha", [1.3, 1.75, 2.6])
def test_compiled_powers_equal_pow(alpha, dtype):
    """The form of (t^e, t^{e−1}) a user's ``torch.compile`` takes (2^{e·log₂ t}, `st._powers`)
    against float64 ``pow`` on t = 0 (both 0, also where e − 1 < 0), subnormal, tiny and large
    t."""
    if native.compiler() is None or os.environ.get("ATEN_CPU_CAPABILITY", "").strip():
        pytest.skip("Inductor compiles on torch's own CPU path with a C++ compiler only")
    e = 1.0 / (alpha - 1.0)
    t = torch.tensor([0.0, 1e-40, 1e-30, 1e-6, 1e-3, 0.3, 0.5, 1.0, 1.5, 2.0], dtype=dtype)
    fn = torch.compile(lambda x: st._powers(x.clone(), e), fullgraph=True, dynamic=False)
    p, p1 = fn(t)
    ref = t.double()
    want_p = ref.pow(e)
    want_p1 = torch.where(ref > 0, ref.pow(e - 1.0), 0.0)
    eps = torch.finfo(dtype).eps
    for got, want in ((p, want_p), (p1, want_p1)):
        assert torch.isfinite(got).all()
        assert got[0] == 0  # t = 0
        # relative error of 2^{e·log₂ t}: ~ε·(1 + e·|log₂ t|·ln 2)
        bound = eps * (4 + 2 * e * ref.clamp_min(1e-300).log2().abs())
        rel = (got.double() - want).abs() / want.clamp_min(torch.finfo(dtype).tiny)
        keep = want > torch.finfo(dtype).tiny  # normal results (subnormals lose bits anyway)
        assert (rel[keep] <= bound[keep]).all(), (rel, bound)
