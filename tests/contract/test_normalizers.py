"""The normalizer contract, softmax and adaptive temperature, pinned to NumPy float64."""

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import reference as ref
from precision import assert_close, tolerance
from sharpattn import normalizers as nz

pytestmark = pytest.mark.numerical

METHODS = ["softmax", "adaptive"]

finite = st.floats(-30, 30, allow_nan=False, width=64)


@st.composite
def scores_and_mask(draw, max_rows=4, max_keys=24, elements=finite):
    rows = draw(st.integers(1, max_rows))
    keys = draw(st.integers(1, max_keys))
    s = draw(hnp.arrays(np.float64, (rows, keys), elements=elements))
    mask = draw(hnp.arrays(np.bool_, (rows, keys)))
    return s, mask


# ---------------------------------------------------------------- the contract


@pytest.mark.parametrize("method", METHODS)
def test_masked_entries_are_zero_and_empty_rows_are_zero(method):
    s = torch.randn(2, 3, 5, 7, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 1, 5, 7) > 0.4
    mask[0, 0, 1] = False  # an empty row, in every head
    w = nz.get(method)(s, mask)
    assert torch.all(w[~mask.expand_as(w)] == 0)
    assert torch.all(w[0, :, 1] == 0)
    assert torch.isfinite(w).all()
    w.pow(2).sum().backward()
    assert torch.isfinite(s.grad).all()
    assert torch.all(s.grad[~mask.expand_as(s)] == 0)


@pytest.mark.parametrize("method", METHODS)
def test_minus_inf_counts_as_masked(method):
    s = torch.randn(4, 9, dtype=torch.float64)
    s[:, ::3] = float("-inf")
    s[2] = float("-inf")  # a row of only -inf is an empty row
    mask = s != float("-inf")
    w = nz.get(method)(s)
    assert torch.equal(w, nz.get(method)(s.masked_fill(~mask, 0.0), mask))
    assert torch.all(w[2] == 0)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_plus_inf_at_allowed_position_raises_naming_it(method, bad):
    s = torch.zeros(2, 3, 4)
    s[1, 2, 3] = bad
    with pytest.raises(ValueError, match=r"\(1, 2, 3\)"):
        nz.get(method)(s)
    mask = torch.ones(2, 3, 4, dtype=torch.bool)
    mask[1, 2, 3] = False  # the same value where it is masked is fine
    w = nz.get(method)(s, mask)
    assert w[1, 2, 3] == 0 and torch.isfinite(w).all()
    nz.get(method)(s, check_finite=False)  # the check can be turned off


def test_bad_mask_errors():
    s = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="boolean"):
        nz.softmax(s, torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="broadcast"):
        nz.softmax(s, torch.ones(5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="broadcast"):  # would enlarge the scores
        nz.softmax(s, torch.ones(7, 2, 3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="floating"):
        nz.softmax(torch.zeros(2, 3, dtype=torch.long))


def test_registry():
    assert {"softmax", "adaptive"} <= set(nz.available())
    entry = nz.get("adaptive")
    assert entry.sums_to_one and entry.citation and entry.formula
    assert entry.fn is nz.adaptive
    with pytest.raises(ValueError, match="softmax") as err:
        nz.get("sofmax")
    assert "adaptive" in str(err.value)  # the message lists the known methods
    with pytest.raises(ValueError, match="already registered"):
        nz.register(entry)


def test_every_built_in_method_is_exported_under_its_registry_name():
    import importlib

    package = importlib.import_module("sharpattn.normalizers")
    built_in = [n for n in nz.available() if nz.get(n).fn.__module__.startswith(package.__name__)]
    assert len(built_in) >= 16
    for name in built_in:
        assert name.isidentifier(), name
        assert name in package.__all__, name
        # `from sharpattn.normalizers import <name>` gives the function, not its module
        assert getattr(package, name) is nz.get(name).fn, name
    assert all(hasattr(package, name) for name in package.__all__)


# ---------------------------------------------------------------- softmax


@given(scores_and_mask(), st.floats(0.05, 20))
def test_softmax_matches_numpy(data, temperature):
    s, mask = data
    w = nz.softmax(torch.from_numpy(s), torch.from_numpy(mask), temperature=temperature)
    # a weight's relative error is that of its logit s/T: magnitude max|s|/T (+1 for the sum)
    mag = 1 + np.abs(s).max() / temperature
    assert_close(w, ref.softmax(s, mask, temperature), n=s.shape[-1], magnitude=mag)


@given(scores_and_mask(elements=st.floats(-1e4, 1e4, allow_nan=False, width=64)))
def test_rows_sum_to_one_and_shift_invariance(data):
    s, mask = data
    s, mask = torch.from_numpy(s), torch.from_numpy(mask)
    for method in METHODS:
        w = nz.get(method)(s, mask)
        sums = w.sum(-1)
        nonempty = mask.any(-1)
        assert_close(sums[nonempty], torch.ones_like(sums[nonempty]), n=s.shape[-1])
        assert torch.all(sums[~nonempty] == 0)
        shift = torch.randn(s.shape[0], 1, dtype=torch.float64) * 100
        # s + shift is rounded: each logit moves by ε·|s + shift|, each weight by that times itself
        n, mag = s.shape[-1], 1 + float((s.abs() + shift.abs()).max())
        assert_close(nz.get(method)(s + shift, mask), w, n=n, magnitude=mag)


@given(
    st.integers(1, 2000),
    st.floats(0.0, 5.0),
    st.floats(0.1, 5.0),
    st.integers(0, 2**31 - 1),
)
def test_lemma_2_1_bounds(n, delta, theta, seed):
    """(1/n)·e^{−δ/θ} <= α_k <= (1/n)·e^{δ/θ} for logits within a spread δ."""
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(n, generator=g, dtype=torch.float64) * delta - delta / 2
    w = nz.softmax(s, temperature=theta)
    spread = (s.max() - s.min()).item()
    lo, hi = math.exp(-spread / theta) / n, math.exp(spread / theta) / n
    rel = tolerance(torch.float64, n=n, magnitude=1 + spread / theta)  # rounding of exp(s/θ)/Σ
    assert torch.all(w >= lo * (1 - rel)) and torch.all(w <= hi * (1 + rel))


def test_temperature_must_be_positive():
    for theta in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature"):
            nz.softmax(torch.zeros(3), temperature=theta)
    with pytest.raises(ValueError, match="temperature"):
        nz.softmax(torch.zeros(2, 3), temperature=torch.tensor([[1.0], [0.0]]))


# ---------------------------------------------------------------- Proposition 3.2
# Prop. 3.2 (Veličković et al., proof in App. E): for logits e ∈ Rⁿ and the Boltzmann
# distribution p_i ∝ exp(−β·e_i), β ∈ R, the entropy H(β) = −Σ p_i·log p_i is monotonically
# non-increasing in |β| on each half-line, because dH/dβ = −β·Var_p(e) (≤ 0 for β ≥ 0, ≥ 0 for
# β ≤ 0). Extremes (the proof's first paragraph): β = 0 is the uniform row, H = log n, the
# maximum; β → +∞ puts all mass on the minimal logits and β → −∞ on the maximal ones. The proof
# calls that limit zero entropy; with k tied extreme logits it is log k (ties share the mass).
# β reaches the library as softmax_θ: β > 0 is softmax(−e) at θ = 1/β, β < 0 softmax(e) at
# θ = 1/|β|, β = 0 the θ = ∞ (uniform) row; β = ±1e300 is θ = 1e-300, the arg-max limit.

BETA_EXTREME = 1e300
# logits with frequent ties (small integers) as well as arbitrary floats
tied_or_not = st.one_of(finite, st.integers(-3, 3).map(float))
betas = st.one_of(
    st.floats(-50, 50, allow_nan=False),
    st.sampled_from([0.0, 1e-300, -1e-300, 1e-3, -1e-3, BETA_EXTREME, -BETA_EXTREME]),
)


def boltzmann(e: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """p ∝ exp(−β·e) over the allowed keys, through the library's softmax_θ."""
    if beta == 0:
        return nz.softmax(e, mask, temperature=math.inf)
    return nz.softmax(-math.copysign(1.0, beta) * e, mask, temperature=1.0 / abs(beta))


def entropy_slack(n: int) -> float:
    """Rounding of H = −Σ p·log p in float64, whatever β: p_i = e^{−x_i}/Z with x_i = |β|·|e_i −
    extreme| ≥ 0 rounded relatively (error ε·x_i), which moves the term x_i·e^{−x_i} by at most
    ε·x_i²·e^{−x_i} ≤ 0.6·ε; Z's relative rounding moves H by ε·log n."""
    return tolerance(torch.float64, n=n, magnitude=math.log(max(n, 2)) + 4)


@given(scores_and_mask(max_rows=1, max_keys=40, elements=tied_or_not), betas, betas)
def test_proposition_3_2_entropy_non_increasing_in_abs_beta(data, b1, b2):
    """On each half-line (both β ≥ 0 or both β ≤ 0), |β₁| ≤ |β₂| ⟹ H(β₂) ≤ H(β₁)."""
    s, mask = data
    assume(mask.any())
    s, mask = torch.from_numpy(s), torch.from_numpy(mask)
    sign = 1.0 if b1 >= 0 else -1.0  # both on b1's half-line
    lo, hi = sorted((abs(b1), abs(b2)))
    h_lo = nz.entropy(boltzmann(s, mask, sign * lo))
    h_hi = nz.entropy(boltzmann(s, mask, sign * hi))
    assert torch.all(h_hi <= h_lo + entropy_slack(int(mask.sum())))


@given(scores_and_mask(max_rows=1, max_keys=40, elements=tied_or_not), betas)
def test_proposition_3_2_beta_zero_is_uniform_and_the_maximum(data, beta):
    s, mask = data
    assume(mask.any())
    s, mask = torch.from_numpy(s), torch.from_numpy(mask)
    n = int(mask.sum())
    h0 = nz.entropy(boltzmann(s, mask, 0.0))
    assert_close(h0, np.full(h0.shape, math.log(n)), n=n, magnitude=math.log(max(n, 2)))
    assert torch.all(nz.entropy(boltzmann(s, mask, beta)) <= h0 + entropy_slack(n))


@given(scores_and_mask(max_rows=1, max_keys=40, elements=tied_or_not))
def test_proposition_3_2_extreme_beta_is_log_of_the_tied_extremes(data):
    """β → +∞: all mass on the minimal logits, β → −∞: on the maximal ones; H = log k for k tied
    extremes (0 without ties)."""
    s, mask = data
    assume(mask.any())
    allowed = s[mask]
    n_min = int((allowed == allowed.min()).sum())  # exact ties, counted in NumPy
    n_max = int((allowed == allowed.max()).sum())
    # the gap from each extreme to the nearest other value: at β = 1e300 the limit is reached
    # only where e^{−β·gap} underflows float64 (β·gap > 746); a gap of a subnormal 2e-309 gives
    # β·gap = 2e-9, and those keys are still tied in weight (hypothesis found [0, 0, 2.2e-309])
    rest_min, rest_max = allowed[allowed > allowed.min()], allowed[allowed < allowed.max()]
    gap_min = float(rest_min.min() - allowed.min()) if rest_min.size else math.inf
    gap_max = float(allowed.max() - rest_max.max()) if rest_max.size else math.inf
    s_t, mask_t = torch.from_numpy(s), torch.from_numpy(mask)
    for beta, k, gap in ((BETA_EXTREME, n_min, gap_min), (-BETA_EXTREME, n_max, gap_max)):
        if gap * BETA_EXTREME <= 746:
            continue  # not yet the β → ∞ limit at this β
        h = nz.entropy(boltzmann(s_t, mask_t, beta))
        assert_close(h, np.full(h.shape, math.log(k)), n=k, magnitude=math.log(max(k, 2)))


def test_proposition_3_2_extreme_beta_with_a_subnormal_gap_is_not_yet_the_limit():
    # the example hypothesis found: two zeros and 2.2e-309; β·gap = 2.2e-9, so at β = −1e300
    # the three keys keep equal weight to first order: H = log 3 − O((β·gap)²) = log 3 within
    # float64 rounding, not the arg-max limit's log 1
    s = torch.tensor([[0.0, 0.0, 2.22507386e-309]], dtype=torch.float64)
    h = nz.entropy(boltzmann(s, torch.ones_like(s, dtype=torch.bool), -BETA_EXTREME))
    assert_close(h, np.full(h.shape, math.log(3)), n=3, magnitude=math.log(3))


@given(
    hnp.arrays(np.float64, st.integers(1, 40), elements=st.floats(-5, 5, width=64)),
    st.floats(-20, 20, allow_nan=False),
)
def test_proposition_3_2_derivative_is_minus_beta_times_variance(e, beta):
    """App. E's identity dH/dβ = −β·Var_p(e): autograd through the library's softmax and entropy
    against the variance under p computed in NumPy float64."""
    b = torch.tensor(beta, dtype=torch.float64, requires_grad=True)
    h = nz.entropy(nz.softmax(-b * torch.from_numpy(e)))
    (grad,) = torch.autograd.grad(h, b)
    x = -beta * e
    p = np.exp(x - x.max())
    p /= p.sum()
    expect = -beta * (p @ e**2 - (p @ e) ** 2)
    # the derivative's terms are β·p_i·e_i² (≤ 25·|β|), each p_i with relative error
    # ε·(1 + |β|·δ) from rounding its exponent (δ ≤ 10, the logits' spread)
    delta = float(e.max() - e.min())
    mag = max(1.0, abs(beta)) * (1 + float(np.abs(e).max())) ** 2 * (1 + abs(beta) * delta)
    assert_close(grad, expect, n=e.size, magnitude=mag)
    # the sign: H falls as |β| grows on either half-line
    assert grad.item() * beta <= tolerance(torch.float64, n=e.size, magnitude=mag) * abs(beta)


# ---------------------------------------------------------------- adaptive


def close_adaptive(w, expect, s, coefficients=(ref.ICML, ref.ARXIV)):
    """Adaptive weights against the float64 transcription. H is a sum of n terms (error
    ε·√n·log n); β = poly(H) passes it on times |poly'(H)| ≤ D; a weight's relative error is then
    |s|·δβ plus the rounding of β·s: magnitude 1 + max|s|·(max β + D·log n)."""
    s = np.asarray(s, dtype=np.float64)
    n = s.shape[-1]
    h = np.linspace(0.0, math.log(max(n, 2)), 200)
    slope = max(np.abs(np.polyval(np.polyder(c), h)).max() for c in coefficients)
    beta = max(np.abs(np.polyval(c, h)).max() for c in coefficients)
    finite = np.abs(s[np.isfinite(s)])
    smax = finite.max() if finite.size else 0.0
    mag = 1 + smax * (beta + slope * math.log(max(n, 2)))
    assert_close(w, expect, n=n, magnitude=mag)


@given(scores_and_mask(elements=st.floats(-8, 8, allow_nan=False, width=64)))
def test_adaptive_matches_numpy_transcription(data):
    s, mask = data
    for name, coeffs in (("icml", ref.ICML), ("arxiv", ref.ARXIV)):
        w = nz.adaptive(torch.from_numpy(s), torch.from_numpy(mask), coefficients=name)
        close_adaptive(w, ref.adaptive(s, mask, coeffs), s)


def test_adaptive_matches_numpy_on_dispersed_rows():
    """Wide rows, where the entropy crosses the threshold and the polynomial matters."""
    g = torch.Generator().manual_seed(0)
    for n in (2, 16, 100, 1000, 5000):
        s = torch.rand(8, n, generator=g, dtype=torch.float64) * 4 - 2
        s[:, 0] += torch.linspace(0, 6, 8, dtype=torch.float64)
        w = nz.adaptive(s)
        close_adaptive(w, ref.adaptive(s.numpy()), s)
        beta = nz.adaptive_beta(s)
        assert beta.shape == (8, 1) and torch.all(beta >= 1)


def test_adaptive_custom_coefficients_threshold_floor_and_json(tmp_path):
    s = torch.randn(6, 50, dtype=torch.float64)
    custom = [0.1, 0.0, 1.5]
    close_adaptive(
        nz.adaptive(s, coefficients=custom, threshold=1.0, floor=1.2),
        ref.adaptive(s.numpy(), coefficients=custom, threshold=1.0, floor=1.2),
        s,
        coefficients=(custom,),
    )
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"coefficients": custom}))
    assert torch.equal(nz.adaptive(s, coefficients=str(path)), nz.adaptive(s, coefficients=custom))
    assert nz.resolve_coefficients("icml") == tuple(ref.ICML)
    with pytest.raises(ValueError, match="icml"):
        nz.adaptive(s, coefficients="nope")
    with pytest.raises(ValueError, match="finite"):
        nz.adaptive(s, coefficients=[1.0, float("nan")])


def test_polyval_equals_numpy():
    x = torch.linspace(-3, 9, 101, dtype=torch.float64)
    for c in (ref.ICML, ref.ARXIV, [2.0], [1.0, -2.0, 0.5]):
        # Horner: one rounding per coefficient, of terms up to Σ|c_i||x|^i
        mag = np.polyval(np.abs(c), np.abs(x.numpy())).max()
        assert_close(nz.polyval(c, x), np.polyval(c, x.numpy()), n=len(c), magnitude=mag)


def test_known_beta_values():
    """Errata: β(H=4) = 2.39 (icml) vs 1.57 (arxiv); at H=5 2.29 vs clipped to 1."""
    for h, icml, arxiv in ((4.0, 2.39, 1.57), (5.0, 2.29, None)):
        x = torch.tensor([h], dtype=torch.float64)
        # the errata give two decimals: the value rounds to them
        assert round(nz.polyval(ref.ICML, x).item(), 2) == icml
        if arxiv is not None:
            assert round(nz.polyval(ref.ARXIV, x).item(), 2) == arxiv
        else:
            assert nz.polyval(ref.ARXIV, x).item() < 1


def test_adaptive_never_increases_entropy_and_sharpens_dispersed_rows():
    g = torch.Generator().manual_seed(1)
    s = torch.rand(64, 200, generator=g, dtype=torch.float64) * 2 - 1
    s[:, 0] = 3.0
    h_soft = nz.entropy(nz.softmax(s))
    h_adapt = nz.entropy(nz.adaptive(s))
    slack = tolerance(torch.float64, n=200, magnitude=math.log(200) * 4 * 3.0)  # |s| ≤ 3, β < 4
    assert torch.all(h_adapt <= h_soft + slack)
    assert torch.all(h_adapt < h_soft - 0.1)  # these rows have H in (0.5, 6.3): β > 1


def test_adaptive_low_entropy_rows_unchanged():
    s = torch.tensor([[10.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    w = nz.adaptive(s)
    # H < 0.5: β = 1, and softmax(1·s) is the same computation as softmax(s)
    assert torch.equal(w[0], nz.softmax(s)[0])
    assert nz.adaptive_beta(s)[0].item() == 1.0


def test_detach_beta_changes_only_the_gradient():
    s = torch.randn(3, 30, dtype=torch.float64, requires_grad=True)
    s2 = s.detach().clone().requires_grad_(True)
    w_flow = nz.adaptive(s)
    w_stop = nz.adaptive(s2, detach_beta=True)
    assert torch.equal(w_flow, w_stop)  # detaching changes no forward value
    probe = torch.randn(3, 30, dtype=torch.float64)
    (w_flow * probe).sum().backward()
    (w_stop * probe).sum().backward()
    # With β detached the gradient is exactly that of softmax(β·s) for a constant β.
    beta = nz.adaptive_beta(s.detach())
    s3 = s.detach().clone().requires_grad_(True)
    (nz.softmax(s3 * beta) * probe).sum().backward()
    assert_close(s2.grad, s3.grad, n=s.shape[-1])  # two graphs of the same function
    # β's own gradient flows by default: the two gradients differ by far more than rounding
    diff = float((s.grad - s2.grad).abs().max())
    assert diff > 1e3 * tolerance(torch.float64, n=s.shape[-1], magnitude=float(s.grad.abs().max()))


@pytest.mark.parametrize("method", METHODS)
def test_gradcheck_float64(method):
    s = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 3, 6) > 0.3
    mask[0, 0] = False
    fn = nz.get(method)
    assert torch.autograd.gradcheck(lambda x: fn(x, mask), (s,))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_huge_logits_and_low_precision(method, dtype):
    g = torch.Generator().manual_seed(0)
    s = ((torch.rand(4, 33, generator=g) * 2 - 1) * 1e4).to(dtype).requires_grad_(True)
    if dtype == torch.float16:  # float16 cannot hold 1e4 exactly but can hold it
        assert torch.isfinite(s).all()
    mask = torch.rand(4, 33, generator=g) > 0.2
    mask[3] = False
    w = nz.get(method)(s, mask)
    assert w.dtype == dtype and torch.isfinite(w).all()
    sums = w.float().sum(-1)
    assert_close(
        sums[:3], torch.ones(3), dtype=dtype, n=33, magnitude=1.0
    )  # weights rounded to dtype
    assert torch.all(sums[3] == 0)
    w.float().pow(2).sum().backward()
    assert torch.isfinite(s.grad).all()
    # Low precision agrees with float64 on the same (rounded) inputs.
    w64 = nz.get(method)(s.detach().double(), mask)
    # computed in float32 (16-bit inputs are upcast) as softmax(β·(s − max s)): for every weight
    # not flushed to 0 the difference s − max s is exact, so the weights carry the rounding of a
    # 33-term softmax (the entropy behind β too) and, for 16-bit dtypes, one final rounding to
    # dtype; ε(dtype)·√n bounds both
    assert_close(w, w64, dtype=dtype, n=33, magnitude=1.0)


def test_one_key():
    for method in METHODS:
        w = nz.get(method)(torch.tensor([[3.5], [-1e4]]))
        assert torch.equal(w, torch.ones(2, 1))


# ---------------------------------------------------------------- statistics


def test_row_statistics():
    n = 8
    uniform = torch.full((1, n), 1 / n, dtype=torch.float64)
    onehot = torch.eye(n, dtype=torch.float64)[:1]
    empty = torch.zeros(1, n, dtype=torch.float64)
    p = torch.cat([uniform, onehot, empty])
    assert_close(nz.entropy(p), [math.log(n), 0.0, 0.0], n=n)
    assert_close(nz.effective_support(p), [n, 1.0, 0.0], n=n)
    assert torch.equal(nz.max_weight(p), torch.tensor([1 / n, 1.0, 0.0]).double())
    q = torch.tensor([[0.7, 0.2, 0.1]], dtype=torch.float64)
    expect = -(0.7 * math.log(0.7) + 0.2 * math.log(0.2) + 0.1 * math.log(0.1))
    assert_close(nz.entropy(q), [expect], n=3)
    assert_close(nz.effective_support(q), [1 / (0.49 + 0.04 + 0.01)], n=3)


@pytest.mark.parametrize(
    "name, coefficients, readme",
    [("icml", ref.ICML, {1.0: 5.94, 0.0: 6.27}), ("arxiv", ref.ARXIV, {1.0: 4.59, 0.0: 5.14})],
)
def test_entropy_crossings_against_brentq(name, coefficients, readme):
    """Where β = poly(H) crosses a level (1: the last crossing is where adaptive stops sharpening;
    0: where θ = 1/poly(H) would turn negative), against scipy's brentq on np.polyval bracketed by
    a sign scan of H in (0.5, 50); the README quotes the last crossing of each."""
    from scipy.optimize import brentq

    def poly(h, level):
        return np.polyval(coefficients, h) - level

    grid = np.linspace(0.5, 50.0, 49501)
    for level, quoted in readme.items():
        f = poly(grid, level)
        brackets = np.nonzero(np.sign(f[:-1]) != np.sign(f[1:]))[0]
        expect = [brentq(poly, grid[i], grid[i + 1], args=(level,), xtol=1e-15) for i in brackets]
        got = nz.entropy_crossings(name, level=level)
        assert len(got) == len(expect), (got, expect)
        for g, e in zip(got, expect, strict=True):
            # a root's error is the rounding of the polynomial there (terms Σ|c_i|h^i) over its slope
            slope = abs(np.polyval(np.polyder(coefficients), e))
            mag = np.polyval(np.abs(coefficients), e) / slope
            assert_close(g, e, dtype=torch.float64, n=len(coefficients), magnitude=mag)
        assert round(got[-1], 2) == quoted
