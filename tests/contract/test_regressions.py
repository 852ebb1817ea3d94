"""Regressions: one test per reproducer found by probing the library with hostile input, and the
checks of normalizer parameters generated from the registry's ``Param``s.

The broad, property-based version of these checks (every method × every path × hostile inputs)
is ``test_adversarial.py``; this file keeps each reported reproducer, so a regression names its
item.
"""

import inspect
import math
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import reference as ref
from precision import assert_close
from sharpattn import attend
from sharpattn import normalizers as nz
from sharpattn.attention.masking import Masking
from sharpattn.attention.stats import stats_from_weights

pytestmark = pytest.mark.numerical

FUSED = [n for n in nz.available() if nz.get(n).fused]
#: methods that refuse a query seeing a later key: their cases here run with causal=True
CAUSAL_ONLY = {"stick_breaking"}
PATHS = ("auto", "fused", "chunked", "naive")


def _paths(method):
    return PATHS if nz.get(method).fused else ("auto", "chunked", "naive")


# 1. the flash kernel kills the process (SIGFPE) on Lq = 0 or Lk = 0 ---------------------------


def test_item1_empty_dims_on_fused_paths_do_not_kill_the_process():
    # In a child process: a regression would take the interpreter (here: pytest) down.
    code = textwrap.dedent(
        f"""
        import torch, sharpattn
        for method in {FUSED!r}:
            for impl in ("auto", "fused"):
                for shapes in (((1,1,4,8), (1,1,0,8)), ((1,1,0,8), (1,1,3,8)),
                               ((0,1,4,8), (0,1,3,8))):
                    q = torch.randn(*shapes[0], requires_grad=True)
                    k = torch.randn(*shapes[1], requires_grad=True)
                    v = torch.randn(*shapes[1], requires_grad=True)
                    out, st = sharpattn.attend(q, k, v, method, impl=impl, return_stats=True)
                    out.sum().backward()
                    assert out.shape == (*shapes[0][:3], 8) and not out.any()
        print("ok")
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-2000:]}"
    assert run.stdout.strip() == "ok"


@pytest.mark.parametrize("method", FUSED)
def test_item1_reproducer_gives_zero_rows(method):
    out = attend(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 0, 8), torch.randn(1, 1, 0, 8), method)
    assert torch.equal(out, torch.zeros(1, 1, 4, 8))


# 2. fused paths returned NaN where naive/chunked raise ----------------------------------------


@pytest.mark.parametrize("impl", PATHS)
def test_item2_overflowing_product_raises_on_every_path(impl):
    q = k = torch.full((1, 1, 2, 4), 1e30)  # finite, but q·kᵀ = 4e60 is not a float32
    with pytest.raises(ValueError, match="overflow"):
        attend(q, k, torch.randn(1, 1, 2, 4), impl=impl)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_item2_16bit_scores_beyond_the_dtype_are_computed_in_float32_on_every_path(dtype):
    # fp16 q = k = 300: q·kᵀ = 360000 > 65504. Decided: every path computes scores in float32
    # (as the flash kernel does), so this is no error anywhere and all paths agree.
    g = torch.Generator().manual_seed(0)
    q = k = torch.full((1, 1, 2, 4), 300.0, dtype=dtype)
    v = torch.randn(1, 1, 2, 4, generator=g).to(dtype)
    expect = ref.attention(
        q.double().numpy(), k.double().numpy(), v.double().numpy(), ref.softmax
    )  # equal scores: the mean of v
    for impl in PATHS:
        out = attend(q, k, v, impl=impl)
        assert out.dtype == dtype and bool(torch.isfinite(out).all()), impl
        assert_close(out, expect, n=2, magnitude=float(v.abs().max()), msg=impl)


@pytest.mark.parametrize("method", FUSED)
def test_item2_huge_finite_scores_are_not_nan_on_fused_paths(method):
    # Scores 2e30 are finite in float32, but the kernel's forward (β·s) or backward (products of
    # 1e15-sized q, k and 2e30-sized scores) overflows: attend takes the block path instead.
    q = torch.full((1, 1, 2, 4), 1e15, requires_grad=True)
    k = torch.full((1, 1, 2, 4), 1e15, requires_grad=True)
    v = torch.randn(1, 1, 2, 4, generator=torch.Generator().manual_seed(1))
    params = {"temperature": 1e-9} if method == "softmax" else {}
    causal = method in CAUSAL_ONLY
    outs = {impl: attend(q, k, v, method, impl=impl, causal=causal, **params) for impl in PATHS}
    for impl, out in outs.items():
        assert bool(torch.isfinite(out).all()), impl
        assert_close(out, outs["naive"], n=2, magnitude=float(v.abs().max()), msg=impl)
        if not out.requires_grad:  # hardmax: piecewise constant in q and k, no graph
            continue
        gq, gk = torch.autograd.grad(out.sum(), (q, k))
        assert not bool(gq.isnan().any() or gk.isnan().any()), impl


def test_item2_kernel_nan_from_a_tiny_temperature_is_recomputed():
    # Moderate inputs, θ = 1e-39: 1/θ is beyond float32, q/θ is inf inside the kernel (NaN);
    # attend recomputes on the chunked path and gets the arg-max limit, as the other paths do.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=g).requires_grad_() for _ in range(3))
    outs = {impl: attend(q, k, v, temperature=1e-39, impl=impl) for impl in PATHS}
    for impl, out in outs.items():
        assert torch.equal(out, outs["naive"]), impl  # one-hot rows: exactly a row of v
        (gq,) = torch.autograd.grad(out.sum(), q)
        assert bool(torch.isfinite(gq).all()), impl


@pytest.mark.parametrize("method", ["softmax", "relu"])
def test_item2_non_finite_inputs_raise_on_every_path_even_where_masked(method):
    # found by the adversarial suite: naive checked only the scores it used, so an inf in a
    # masked key (or in q when Lq rows were all masked) passed there and raised on the others
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 2, 4, generator=g) for _ in range(3))
    mask = torch.tensor([True, False])
    for name, t in (("k", k), ("v", v)):
        bad = t.clone()
        bad[0, 0, 1, 2] = float("inf")  # key 1 is masked
        args = {"q": q, "k": k, "v": v, name: bad}
        for impl in _paths(method):
            with pytest.raises(
                ValueError, match=rf"{name} contains a non-finite value at \(0, 0, 1, 2\)"
            ):
                attend(**args, method=method, mask=mask, impl=impl)


def test_item2_an_output_beyond_the_dtype_raises_on_every_path():
    # relu's weights grow with the scores: 1e2·1e4-sized q·kᵀ / n is beyond float16's 65504
    # (computed in float32, finite there: the cast back to float16 made it inf)
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(1, 1, 3, 4, generator=g) * 1e2).half()
    k = (torch.randn(1, 1, 4, 4, generator=g) * 1e4).half()
    v = torch.randn(1, 1, 4, 4, generator=g).half()
    for impl in ("chunked", "naive"):
        with pytest.raises(ValueError, match="relu attention output at .* beyond the range of"):
            attend(q, k, v, "relu", impl=impl)


def test_item2_fused_paths_leave_the_kernel_beyond_its_safe_range():
    from sharpattn.attention.functional import _check_ranges

    q, k, v = torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4)
    assert _check_ranges(q, k, v, 0.5, torch.float32) == (1.0, 1.0, 1.0, 2.0)
    with pytest.raises(ValueError, match=r"can overflow torch.float32: D·max\|q\|"):
        _check_ranges(q * 1e19, k * 1e19, v, 0.5, torch.float32)
    # in range for the error rule, beyond the kernel's: attend gives naive's answer, gradients
    q, k = q * 1e10, k.clone().requires_grad_()
    for impl in PATHS:
        out = attend(q, k, v, "adaptive", impl=impl)
        assert torch.equal(out, torch.ones_like(out)), impl
        (gk,) = torch.autograd.grad(out.sum(), k)
        assert not bool(gk.isnan().any()), impl


# 3. entmax: NaN output and gradients at |s| >= 1e8 ---------------------------------------------


@pytest.mark.parametrize("dtype, big", [(torch.float32, 1e8), (torch.float64, 1e300)])
def test_item3_entmax_large_scores_finite_with_finite_gradients(dtype, big):
    s = torch.tensor([[big, 0.0, -big]], dtype=dtype, requires_grad=True)
    w = nz.get("entmax").fn(s)
    assert torch.equal(w.detach(), torch.tensor([[1.0, 0.0, 0.0]], dtype=dtype))
    (w * torch.tensor([1.0, 2.0, 3.0], dtype=dtype)).sum().backward()
    assert bool(torch.isfinite(s.grad).all())


@pytest.mark.parametrize("method", ["entmax", "entmax15", "sparsemax"])
def test_item3_sparse_maps_are_shift_invariant_at_large_offsets(method):
    # A support of three keys 1e8 above zero (float64 holds the offsets exactly).
    s = torch.tensor([[0.5, 0.2, -0.1, -3.0]], dtype=torch.float64)
    w0 = nz.get(method).fn(s)
    w1 = nz.get(method).fn(s + 1e8)
    # 1e8 + s rounds s to ε·1e8 = 2.2e-8: the weights move by that much times the map's slope
    assert_close(w1, w0, n=4, magnitude=1e8)
    assert int((w0 > 0).sum()) >= 2  # the test is about a real support, not a one-hot row


# 4. sparsemax / entmax15 rows summing to 0.5 when a key is masked ------------------------------


@pytest.mark.parametrize("method", ["sparsemax", "entmax15", "entmax"])
def test_item4_masked_fill_does_not_tie_a_large_maximum(method):
    w = nz.get(method).fn(torch.tensor([[1e8, 0.0, 5.0]]), torch.tensor([[True, True, False]]))
    assert torch.equal(w, torch.tensor([[1.0, 0.0, 0.0]]))


# 5. Lk = 0 raised IndexError in six methods ----------------------------------------------------


@pytest.mark.parametrize("method", nz.available())
def test_item5_empty_key_axis_gives_an_empty_result(method):
    s = torch.randn(2, 3, 0, requires_grad=True)
    w = nz.get(method).fn(s)
    assert w.shape == (2, 3, 0) and w.dtype == s.dtype
    w.sum().backward()  # connected to the graph
    assert s.grad.shape == s.shape
    mask = torch.ones(2, 3, 0, dtype=torch.bool)
    assert nz.get(method).fn(s, mask).shape == (2, 3, 0)
    with pytest.raises(ValueError, match="boolean"):  # the mask is still checked
        nz.get(method).fn(s, mask.float())


@pytest.mark.parametrize("method", nz.available())
def test_item5_empty_key_axis_on_every_path(method):
    for impl in _paths(method):
        q = torch.randn(1, 2, 3, 4, requires_grad=True)
        k = torch.randn(1, 2, 0, 4, requires_grad=True)
        out = attend(q, k, k, method, impl=impl)
        assert torch.equal(out, torch.zeros(1, 2, 3, 4)), impl
        out.sum().backward()
        assert torch.equal(q.grad, torch.zeros_like(q)), impl


@pytest.mark.parametrize("method", nz.available())
def test_item5_empty_input_checks_parameters_in_o_of_batch_times_heads_memory(method):
    # B = 0 with 10^6 x 10^6 rows/keys: a full-size stand-in for the parameter check would need
    # 8 TB; per-head tensor parameters ([1, H, 1, 1], as MultiheadAttention passes) broadcast
    s = torch.empty(0, 2, 10**6, 10**6)
    params = {p.name: torch.full((1, 2, 1, 1), float(p.default)) for p in nz.get(method).learnable}
    assert nz.get(method).fn(s, **params).shape == s.shape


BAD_PARAMS = {
    "softmax": {"temperature": -1.0},
    "adaptive": {"coefficients": "nope"},
    "length_scaled": {"c": -1.0},
    "relu": {"p": 0.5},
    "power": {"p": 0.5},
    "topk": {"top_k": 0},
    "entmax": {"alpha": 1.0},
    "llama4_temperature": {"floor_scale": -1},
    "logn": {"train_length": 0.5},
    "asentmax": {"delta": -1.0},
}


@pytest.mark.parametrize("method", list(BAD_PARAMS))
def test_item5_parameters_are_checked_on_empty_input_too(method):
    # an empty input must not turn a bad parameter into a silent empty result on some paths
    kw = BAD_PARAMS[method]
    for shape in ((2, 3, 4), (2, 3, 0), (2, 0, 4)):
        with pytest.raises(ValueError):
            nz.get(method).fn(torch.randn(shape), **kw)
    for impl in _paths(method):
        with pytest.raises(ValueError):
            attend(
                torch.randn(1, 1, 3, 4),
                torch.randn(1, 1, 0, 4),
                torch.randn(1, 1, 0, 4),
                method,
                impl=impl,
                **kw,
            )


# 6. wrong exception types -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "qs, ks, needle",
    [
        ((1, 2, 3, 4), (1, 0, 3, 4), r"k has 0 heads \(shape \(1, 0, 3, 4\)"),
        ((1, 0, 3, 4), (1, 1, 3, 4), r"q has 0 heads \(shape \(1, 0, 3, 4\)"),
        ((1, 1, 3, 0), (1, 1, 3, 0), r"head size D = 0 \(shape \(1, 1, 3, 0\)"),
    ],
)
@pytest.mark.parametrize("impl", PATHS)
def test_item6_zero_heads_or_head_size_raise_value_error_naming_the_shape(qs, ks, needle, impl):
    with pytest.raises(ValueError, match=needle):
        attend(torch.randn(qs), torch.randn(ks), torch.randn(ks), impl=impl)


def test_item6_stick_breaking_on_1d_scores_raises_value_error():
    with pytest.raises(ValueError, match=r"\[\.\.\., Lq, Lk\].*\(5,\)"):
        nz.get("stick_breaking").fn(torch.randn(5))


# 7. return_stats: lse of empty rows, signed entropy ---------------------------------------------


@pytest.mark.parametrize("method", FUSED)
@pytest.mark.parametrize("dv", [4, 3])  # 3: value size != key size, the kernel's fallback
def test_item7_lse_is_minus_inf_on_rows_without_keys(method, dv):
    mask = torch.tensor([True, False, True])[:, None].expand(3, 5)  # row 1 sees no key
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 3, 4, generator=g), torch.randn(1, 2, 5, 4, generator=g)
    v = torch.randn(1, 2, 5, dv, generator=g)
    causal = method in CAUSAL_ONLY
    _, st = attend(q, k, v, method, mask=mask, causal=causal, impl="fused", return_stats=True)
    if st.lse is not None:  # the softmax family's paths (lse is theirs only)
        assert torch.equal(st.lse[..., 1], torch.full((1, 2), float("-inf")))
        assert bool(torch.isfinite(st.lse[..., [0, 2]]).all())
    assert torch.equal(st.entropy[..., 1], torch.zeros(1, 2))
    assert torch.equal(st.mass[..., 1], torch.zeros(1, 2))


@pytest.mark.parametrize("impl", ["chunked", "naive"])
def test_item7_signed_entropy_is_the_entropy_of_the_magnitudes(impl):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    _, w = attend(q, k, v, "signed", impl="naive", return_weights=True)
    assert bool((w < 0).any())  # the case the item is about
    _, st = attend(q, k, v, "signed", impl=impl, return_stats=True)
    a = w.abs().numpy()
    expect = -(a * np.log(np.where(a > 0, a, 1.0))).sum(-1)
    assert_close(st.entropy, expect, n=3)
    assert_close(st.mass, w.sum(-1).numpy(), n=3)  # the signed sum, as documented
    ent, _ = stats_from_weights(w)
    assert bool(torch.isfinite(ent).all())


# 8. ssmax in float64 was float32-precise ---------------------------------------------------------


def test_item8_visible_keys_in_the_requested_dtype():
    m = Masking.build(None, True, 5, 7, torch.device("cpu"))
    assert m.visible_keys(dtype=torch.float64).dtype == torch.float64
    assert m.visible_keys().dtype == torch.float32
    assert m.visible_keys(dtype=torch.float64).flatten().tolist() == [3, 4, 5, 6, 7]


@pytest.mark.parametrize("method", ["ssmax", "length_scaled", "sink"])
def test_item8_fused_float64_is_float64_precise(method):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    params = {"c": 0.7} if method == "length_scaled" else {}
    params = {"bias_log_n": 0.5} if method == "sink" else params
    fused = attend(q, k, v, method, impl="fused", causal=True, **params)
    naive = attend(q, k, v, method, impl="naive", causal=True, **params)
    assert_close(fused, naive, n=5, magnitude=float(v.abs().max()))  # ε = float64's


# 9. extreme parameters ---------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-9, 1e-39])  # 1/1e-39 is beyond float32
def test_item9_tiny_temperature_gives_the_argmax_limit_not_nan(temperature):
    s = torch.tensor([[1e30, 0.0, -1e30]], requires_grad=True)
    w = nz.get("softmax").fn(s, temperature=temperature)
    assert torch.equal(w.detach(), torch.tensor([[1.0, 0.0, 0.0]]))
    w2 = nz.get("softmax").fn(torch.tensor([[0.5, 2.0, -1.0]]), temperature=temperature)
    assert torch.equal(w2, torch.tensor([[0.0, 1.0, 0.0]]))
    (w * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert bool(torch.isfinite(s.grad).all())


def test_item9_relu_power_beyond_the_dtype_raises_or_is_inf_when_unchecked():
    s = torch.tensor([[1e30, 0.0, -1e30]])
    with pytest.raises(ValueError, match=r"overflow.*\(0, 0\)"):
        nz.get("relu").fn(s, p=2)
    w = nz.get("relu").fn(s, p=2, check_finite=False)
    assert w[0, 0] == float("inf") and torch.equal(w[0, 1:], torch.zeros(2))
    assert torch.equal(nz.get("relu").fn(s, p=1), torch.tensor([[1e30 / 3, 0.0, 0.0]]))
    half = torch.tensor([[1000.0, 1.0]], dtype=torch.float16)  # 1000² / 2 is beyond float16
    with pytest.raises(ValueError, match=r"overflow torch.float16 at position \(0, 0\)"):
        nz.get("relu").fn(half, p=2)


# Normalizer parameters: one validation of the registry's Params, on every path -----------------
#
# The cases are generated from each method's registry Params (kind, range, finiteness, tensors),
# so a method or parameter registered later is covered by the same tests.


def _bad_values(p: nz.Param) -> list:
    """Values ``p`` must refuse, read off its own spec: NaN, infinities it does not take, the
    bounds it excludes (or one beyond), the wrong types, tensors holding such values."""
    kind = p.value_kind
    if kind == "bool":
        return ["yes", 1, None]
    if kind == "choice":
        return ["nosuch", 1.5] + ([] if p.optional else [None])
    if kind == "any":  # validated by its own function only (adaptive's coefficients)
        return []
    bad = [math.nan, "1", True] + ([] if p.optional else [None])
    if kind == "int":
        bad.append(1.5)
    if p.finite or kind == "int" or p.high is not None:
        bad.append(math.inf)
    if p.finite or kind == "int" or p.low is not None:
        bad.append(-math.inf)
    if p.low is not None:
        bad.append(p.low if p.low_open else p.low - 1)
    if p.high is not None:
        bad.append(p.high if p.high_open else p.high + 1)
    if p.accepts_tensor:
        bad.append(torch.full((1, 1, 1, 1), math.nan))
        if p.finite:
            bad.append(torch.full((1, 1, 1, 1), math.inf))
        if p.low is not None and not p.clamped:
            bad.append(torch.full((1, 1, 1, 1), p.low if p.low_open else p.low - 1.0))
    elif kind == "real":
        bad.append(torch.tensor(0.5))  # a number-only parameter refuses tensors
    return bad


def _good_values(p: nz.Param) -> list:
    """Values ``p`` accepts: its default, the edge of its range, inf where it takes it, a
    per-head tensor where it takes tensors."""
    kind = p.value_kind
    good = [p.default]
    if kind == "bool":
        good.append(not p.default)
    if kind in ("real", "int") and p.low is not None:
        step = 0.5 if kind == "real" else 1
        good.append(p.low + step if p.low_open else p.low)
    if kind == "real" and not p.finite:
        good.append(math.inf)
    if p.accepts_tensor:
        good.append(torch.full((1, 2, 1, 1), float(p.default)))
    return good


def _show(value) -> str:
    if torch.is_tensor(value):
        return f"tensor({value.flatten()[0].item()})"
    return repr(value)


def _param_cases(values):
    return [
        pytest.param(method, p.name, value, id=f"{method}-{p.name}={_show(value)}")
        for method in nz.available()
        for p in nz.get(method).params
        for value in values(p)
    ]


BAD_PARAM_CASES = _param_cases(_bad_values)
GOOD_PARAM_CASES = _param_cases(_good_values)


def _refused(method: str, name: str):
    """The one sentence: the method, the parameter, what it accepts."""
    return pytest.raises(ValueError, match=rf"^the {method} parameter {name} must be .+, got .+\.$")


def _qkv(requires_grad=False):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def test_the_generated_cases_hold_the_reported_reproducers():
    cases = {(c.values[0], c.values[1], _show(c.values[2])) for c in BAD_PARAM_CASES}
    reported = [
        ("ssmax", "s", "nan"),
        ("length_scaled", "c", "inf"),
        ("sink", "bias", "inf"),
        ("adaptive", "floor", "nan"),
        ("entmax", "n_iter", "0"),
        ("asentmax", "beta_pre", "nan"),
        ("entmax", "alpha", "inf"),
        ("power", "p", "inf"),
    ]
    assert not [r for r in reported if r not in cases]


@pytest.mark.parametrize(
    ("method", "name", "value", "impl"),
    [
        pytest.param(*case.values, impl, id=f"{case.id}-{impl}")
        for case in BAD_PARAM_CASES
        for impl in _paths(case.values[0])
    ],
)
def test_bad_parameters_are_refused_by_name_on_every_path(method, name, value, impl):
    q, k, v = _qkv()
    causal = method in CAUSAL_ONLY
    # numbers are checked whatever check_finite is; a tensor's values only with check_finite
    for check_finite in (True,) if torch.is_tensor(value) else (True, False):
        with _refused(method, name):
            attend(
                q,
                k,
                v,
                method,
                impl=impl,
                causal=causal,
                check_finite=check_finite,
                **{name: value},
            )


@pytest.mark.parametrize(("method", "name", "value"), BAD_PARAM_CASES)
def test_bad_parameters_are_refused_by_the_normalizer_and_multihead_attention(method, name, value):
    from sharpattn.attention import MultiheadAttention

    scores = torch.randn(2, 3, 3)
    with _refused(method, name):
        nz.get(method)(scores, **{name: value})
    with _refused(method, name):  # the module-level function is the registered one
        getattr(nz, method)(scores, **{name: value})
    if name in inspect.signature(MultiheadAttention).parameters:
        return  # the layer's own option of that name (sink's bias): its own test below
    with _refused(method, name):  # at construction: no forward needed, no host sync in it
        MultiheadAttention(8, 2, method, **{name: value})


def test_multihead_attention_options_are_refused_by_name():
    from sharpattn.attention import MultiheadAttention
    from sharpattn.attention.mha import OPTIONS

    for option in OPTIONS:
        for value in _bad_values(option):
            with _refused("MultiheadAttention", option.name):
                MultiheadAttention(8, 2, "sink", **{option.name: value})


@pytest.mark.parametrize(("method", "name", "value"), GOOD_PARAM_CASES)
def test_legitimate_parameters_work_on_every_path_with_finite_gradients(method, name, value):
    causal = method in CAUSAL_ONLY
    for impl in _paths(method):
        q, k, v = _qkv(requires_grad=True)
        p = value.clone().requires_grad_() if torch.is_tensor(value) else value
        out = attend(q, k, v, method, impl=impl, causal=causal, **{name: p})
        out.pow(2).sum().backward()
        grads = [t.grad for t in (q, k, v, p) if torch.is_tensor(t) and t.grad is not None]
        assert bool(torch.isfinite(out).all()), f"{method} {name}={_show(value)} {impl}: output"
        assert all(bool(torch.isfinite(g).all()) for g in grads), f"{impl}: gradients"


def test_a_typo_in_a_parameter_name_is_a_value_error_on_every_path():
    q, k, v = _qkv()
    for impl in PATHS:
        with pytest.raises(ValueError, match="has no parameter.*temprature.*temperature"):
            attend(q, k, v, "softmax", impl=impl, temprature=0.5)
    with pytest.raises(ValueError, match="check_finite must be True or False"):
        attend(q, k, v, "softmax", check_finite="no")


@pytest.mark.parametrize(
    "method", [m for m in nz.available() if any(p.learnable for p in nz.get(m).params)]
)
def test_multihead_attention_trains_its_learnable_parameters_without_nan(method):
    from sharpattn.attention import MultiheadAttention

    torch.manual_seed(0)
    layer = MultiheadAttention(8, 2, method, causal=method in CAUSAL_ONLY)
    out = layer(torch.randn(2, 5, 8))
    out.pow(2).sum().backward()
    for name, p in layer.normalizer_params.items():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name
    with torch.no_grad():  # a parameter trained into NaN is refused by name (check_finite)
        next(iter(layer.normalizer_params.values()))[0] = math.nan
    first = next(iter(layer.normalizer_params))
    with _refused(method, first):
        layer(torch.randn(2, 5, 8))


@pytest.mark.parametrize("method", nz.available())
def test_hf_apply_refuses_bad_parameters_by_name(method):
    pytest.importorskip("transformers")
    import tiny_hf
    from sharpattn import hf

    model = tiny_hf.llama()
    before = model.config._attn_implementation
    for p in nz.get(method).params:
        for value in _bad_values(p):
            with _refused(method, p.name):
                hf.apply(model, method, **{p.name: value})
    assert model.config._attn_implementation == before  # refused before anything changed


def test_selective_options_are_refused_by_name_in_multihead_attention_and_hf_apply():
    pytest.importorskip("transformers")
    import tiny_hf
    from sharpattn import hf
    from sharpattn.attention import MultiheadAttention
    from sharpattn.attention.selective import OPTIONS, SelectiveConfig

    model = tiny_hf.llama()
    hf_options = inspect.signature(hf._apply_selective).parameters
    for option in OPTIONS:
        for value in _bad_values(option):
            with _refused("selective attention", option.name):
                SelectiveConfig(**{option.name: value})
            if option.name in hf_options:
                with _refused("selective attention", option.name):
                    hf.apply(model, "selective", **{option.name: value})
    with _refused("selective attention", "sharing"):  # the reported reproducer
        hf.apply(model, "selective", sharing="yes")
    with _refused("selective attention", "sharing"):
        MultiheadAttention(8, 2, selective="qv", sharing="yes")
    for targets in ("", "qq", "x", 5):
        with pytest.raises(ValueError, match="selective targets must name some of q, k, v"):
            SelectiveConfig(targets=targets)


# 10. tensors on two devices: a CPU tensor beside CUDA ones failed deep inside a path or reached a
# Triton kernel as a pointer; attend and MultiheadAttention refuse them by name, before any path.
# The odd one out is on "meta" (no data), which the CPU-only test machine has.


def _on_meta(odd: str):
    """attend's arguments (sigmoid with a per-head bias tensor and a mask) with ``odd`` on meta."""
    g = torch.Generator().manual_seed(0)
    args = {
        "q": torch.randn(1, 2, 3, 4, generator=g),
        "k": torch.randn(1, 2, 5, 4, generator=g),
        "v": torch.randn(1, 2, 5, 4, generator=g),
        "mask": torch.rand(3, 5, generator=g) < 0.7,
        "bias": torch.zeros(1, 2, 1, 1),
    }
    args[odd] = args[odd].to("meta")
    return args


@pytest.mark.parametrize("check_finite", [True, False])
@pytest.mark.parametrize("odd", ["q", "k", "v", "mask", "bias"])
def test_item10_tensors_on_two_devices_are_refused_by_name_on_every_path(odd, check_finite):
    others = ", ".join(n for n in ("q", "k", "v", "mask", "bias") if n != odd)
    for impl in PATHS:
        a = _on_meta(odd)
        with pytest.raises(ValueError, match="^attend takes its tensors on one device") as err:
            attend(
                a.pop("q"),
                a.pop("k"),
                a.pop("v"),
                "sigmoid",
                impl=impl,
                check_finite=check_finite,
                **a,
            )
        assert f" {others} on cpu" in str(err.value) and f" {odd} on meta" in str(err.value)


@pytest.mark.parametrize("odd", ["query", "key_mask", "mask", "module"])
def test_item10_multihead_attention_refuses_tensors_on_two_devices_by_name(odd):
    from sharpattn.attention import MultiheadAttention

    layer = MultiheadAttention(8, 2, "sigmoid", device="meta" if odd == "module" else None)
    inputs = {
        "query": torch.randn(2, 5, 8),
        "key_mask": torch.ones(2, 5, dtype=torch.bool),
        "mask": torch.ones(5, 5, dtype=torch.bool),
    }
    if odd != "module":
        inputs[odd] = inputs[odd].to("meta")
    with pytest.raises(ValueError, match="^MultiheadAttention takes its tensors on one") as err:
        layer(inputs.pop("query"), **inputs)
    on_meta = "query, key, value" if odd == "query" else odd  # self-attention: key = value = query
    assert f" {on_meta} on meta" in str(err.value) and " on cpu" in str(err.value)


# 11. stick-breaking's query_offset on the chunked path ----------------------------------------
#
# Each query block got the caller's offset instead of offset + the block's first row: a spurious
# "causal only" error, or weights 1.3-3.5 off with check_finite=False.


def _stick_qkv(lq, lk, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64) for n in (lq, lk, lk))


@pytest.mark.parametrize("check_finite", [True, False])
@pytest.mark.parametrize(("lq", "lk"), [(11, 11), (9, 14)])
@pytest.mark.parametrize("explicit_mask", [False, True])
def test_item11_stick_breaking_query_offset_agrees_with_naive_on_every_path(
    lq, lk, explicit_mask, check_finite
):
    q, k, v = _stick_qkv(lq, lk)
    i, j = torch.arange(lq).unsqueeze(-1), torch.arange(lk)
    for offset in sorted({0, 2, lk - lq, lk - lq + 3}):
        # the causal mask with this offset (then every offset is causal), or attend's own one
        kw = {"mask": j <= i + offset} if explicit_mask else {"causal": True}
        run = dict(kw, query_offset=offset, check_finite=check_finite)
        late = not explicit_mask and offset < lk - lq  # keys past the query's own position
        if late and check_finite:
            for impl in ("naive", "chunked", "auto"):
                with pytest.raises(ValueError, match="causal"):
                    attend(q, k, v, "stick_breaking", impl=impl, block_size=3, **run)
            continue
        want = attend(q, k, v, "stick_breaking", impl="naive", **run)
        assert want.abs().max() > 0.1
        for impl, blocks in (("chunked", 3), ("chunked", 4), ("chunked", None), ("auto", None)):
            if late and impl == "auto":
                # the tiles refuse a visible key past the query's position from the sizes alone
                with pytest.raises(ValueError, match="causal"):
                    attend(q, k, v, "stick_breaking", impl=impl, **run)
                continue
            got = attend(q, k, v, "stick_breaking", impl=impl, block_size=blocks, **run)
            assert_close(got, want, n=lk, msg=f"offset {offset} {impl} blocks {blocks}")


def test_item11_stick_breaking_query_offset_gradients_agree_on_the_chunked_path():
    lq, lk, offset = 9, 14, 7
    grads = {}
    for impl in ("naive", "chunked"):
        q, k, v = (t.requires_grad_() for t in _stick_qkv(lq, lk, seed=1))
        run = dict(causal=True, query_offset=offset, shift_log_position=-1.0)
        out = attend(q, k, v, "stick_breaking", impl=impl, block_size=2, **run)
        out.pow(2).sum().backward()
        grads[impl] = (out, q.grad, k.grad, v.grad)
    for got, want in zip(grads["chunked"], grads["naive"], strict=True):
        assert_close(got, want, n=lk)


# 12. entmax's α near 1 and large -------------------------------------------------------------
#
# float32 α = 1 + 1e-7 was 0.24 off a converged float64 result, 1 + 1e-9 3.4 off, α = 10 0.76 off;
# float64 with 50 bisection steps 1.0 off at α = 30. α is now refused outside its numerically
# safe range, [1.01, 2.5] (measurements in normalizers/_entmax.py, SAFE_ALPHA), and the bisection
# takes the steps the dtype needs.

ALPHA_LOW, ALPHA_HIGH = nz.get("entmax").params[0].low, nz.get("entmax").params[0].high
ALPHAS = [1 + 1e-9, 1 + 1e-7, 1 + 1e-4, 1.0099, 1.01, 1.3, 1.5, 2.0, 2.5, 2.51, 3.0, 10.0, 30.0]


def _entmax_reference_row(x, alpha):
    """α-entmax of one row in float64, written as p_i = exp(log1p(ε·(z_i − μ))/ε), ε = α − 1,
    z = x − max x, where 1 + ε·(z_i − μ) > 0 (so no power of a rounded number near 1), μ by
    bisection to the last bit (Σ p is decreasing in μ; μ in [0, (1 − n^{−ε})/ε])."""
    eps = alpha - 1.0
    z = x - x.max()

    def weights(mu):
        a = eps * (z - mu)
        inside = a > -1.0
        return np.where(inside, np.exp(np.log1p(np.where(inside, a, 0.0)) / eps), 0.0)

    lo, hi = 0.0, -np.expm1(-eps * np.log(max(len(z), 2))) / eps
    while True:
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if weights(mid).sum() >= 1.0 else (lo, mid)
    w = weights(lo)
    return w / w.sum()


def _entmax_reference(q, k, v, g, alpha, scale):
    """(output, dq, dk, dv) of α-entmax attention and of the loss Σ output·g, float64 NumPy:
    the gradient by the closed-form Jacobian, ds_j = u_j·(dw_j − Σ u·dw / Σ u), u = p^{2−α} on
    the support (Peters et al. 2019)."""
    q, k, v, g = (t.detach().double().numpy() for t in (q, k, v, g))
    alphas = np.broadcast_to(np.asarray(alpha, dtype=np.float64).reshape(1, -1, 1), q.shape[:3])
    s = scale * q @ k.swapaxes(-1, -2)
    w = np.zeros_like(s)
    for idx in np.ndindex(*s.shape[:3]):
        w[idx] = _entmax_reference_row(s[idx], alphas[idx])
    dw = g @ v.swapaxes(-1, -2)
    u = np.where(w > 0, np.maximum(w, 1e-300) ** (2.0 - alphas[..., None]), 0.0)
    ds = u * (dw - (u * dw).sum(-1, keepdims=True) / u.sum(-1, keepdims=True))
    out = torch.from_numpy(w @ v)
    grads = (scale * ds @ k, scale * ds.swapaxes(-1, -2) @ q, w.swapaxes(-1, -2) @ g)
    return (out, *(torch.from_numpy(x) for x in grads))


def _alpha_inputs(dtype, lk=24):
    gen = torch.Generator().manual_seed(11)
    q, k, v, g = (
        torch.randn(1, 2, n, 8, generator=gen, dtype=torch.float64) for n in (20, lk, lk, 20)
    )
    return 2.0 * q, k, v, g  # scores of a few units: supports of several keys for every α


def _refused_alpha(method="entmax"):
    return pytest.raises(ValueError, match=rf"^the {method} parameter alpha must be .+, got .+\.$")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("alpha", ALPHAS, ids=repr)
def test_item12_entmax_alpha_is_within_precision_or_refused_on_every_path(alpha, dtype):
    q0, k0, v0, g = _alpha_inputs(dtype)
    scale = 8**-0.5
    inside = ALPHA_LOW <= alpha <= ALPHA_HIGH
    want = _entmax_reference(q0, k0, v0, g, alpha, scale) if inside else None
    for impl in ("naive", "chunked", "auto"):
        for check_finite in (True, False):
            q, k, v = (t.to(dtype).clone().requires_grad_() for t in (q0, k0, v0))
            run = dict(alpha=alpha, impl=impl, block_size=7, check_finite=check_finite)
            if not inside:
                with _refused_alpha():
                    attend(q, k, v, "entmax", **run)
                continue
            out = attend(q, k, v, "entmax", **run)
            (out * g.to(dtype)).sum().backward()
            what = f"α={alpha!r} {impl} check_finite={check_finite}"
            assert_close(out, want[0], n=24, magnitude=float(v0.abs().max()), msg=what)
            for name, got, exact in zip("qkv", (q.grad, k.grad, v.grad), want[1:], strict=True):
                # a gradient sums over the keys and the query rows of a key: 64 ulps, not 8
                size = float(exact.abs().max())
                assert_close(got, exact, n=24, magnitude=size, ulps=64, msg=f"{what} d{name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_item12_a_per_head_alpha_is_within_precision_on_every_path(dtype):
    q0, k0, v0, g = _alpha_inputs(dtype)
    scale = 8**-0.5
    for pair in ((ALPHA_LOW, 1.5), (1.3, ALPHA_HIGH), (2.0, 1.01)):
        want = _entmax_reference(q0, k0, v0, g, np.array(pair), scale)
        alpha = torch.tensor(pair, dtype=dtype).view(1, 2, 1, 1)
        for impl in ("naive", "chunked", "auto"):
            for check_finite in (True, False):
                out = attend(
                    *(t.to(dtype) for t in (q0, k0, v0)),
                    "entmax",
                    alpha=alpha,
                    impl=impl,
                    block_size=7,
                    check_finite=check_finite,
                )
                what = f"α={pair} {impl} check_finite={check_finite}"
                assert_close(out, want[0], n=24, magnitude=float(v0.abs().max()), msg=what)


@pytest.mark.parametrize("method", ["entmax", "asentmax"])
@pytest.mark.parametrize("bad", [1.0 + 1e-7, 1.0099, 2.51, 30.0])
def test_item12_a_per_head_alpha_out_of_range_is_refused_with_check_finite(method, bad):
    q, k, v = _qkv()
    alpha = torch.tensor([1.5, bad], dtype=torch.float64).view(1, 2, 1, 1)
    for impl in ("naive", "chunked", "auto"):
        with _refused_alpha(method):
            attend(q, k, v, method, alpha=alpha, impl=impl)
        with _refused_alpha(method):
            attend(q, k, v, method, alpha=float(bad), impl=impl, check_finite=False)


def test_item12_bisection_steps_come_from_the_dtype():
    from sharpattn.normalizers import _entmax

    # the mantissa's bits, plus (α − 1)·log2(n) for |τ| >= n^{1−α}, plus 2
    assert _entmax.bisect_steps(torch.float32, 16, 1.5) == 23 + 2 + 2
    assert _entmax.bisect_steps(torch.float64, 4096, 2.5) == 52 + 18 + 2
    s = torch.randn(3, 40, dtype=torch.float64) * 3
    for alpha in (1.01, 1.3, 2.5):
        want = torch.from_numpy(np.stack([_entmax_reference_row(r, alpha) for r in s.numpy()]))
        assert_close(nz.entmax(s, alpha=alpha), want, n=40)


# 13. scale never validated; per-row parameter tensors of the wrong shape ----------------------
#
# scale=nan gave finite numbers on every fast path (naive refused), scale='abc' named nothing, and
# a scale <= 0 with causal=True, check_finite=False gave NaN from torch's CPU flash kernel (so a
# row-scaled plug-in with its legal β <= 0 died at its first training step). scale is now checked
# once before any path (a finite number or None), and the fast paths carry a scale <= 0 on q.
# A stick-breaking shift of shape [H], [Lq] or per key was added as extra columns on the fused
# path (each row got the sum of the shifts) and a raw error elsewhere; an entmax α of shape [H]
# or [Lq] was a raw error: a tensor parameter is now checked against one value per row,
# [B|1, H|1, Lq|1, 1], from its shape alone (whatever check_finite is).

SCALES_BAD = [math.nan, math.inf, -math.inf, True, "abc", torch.tensor(0.5), [1.0]]
SHAPE_B, SHAPE_H, SHAPE_LQ, SHAPE_LK = 2, 3, 5, 7


def _beta(n, *, beta=1.0):
    """β of the row-scaled test plug-in: the parameter itself, of any sign (β = 0: uniform)."""
    return beta


SIGNED_BETA = nz.Normalizer(
    "test_signed_beta",
    nz.families.RowScaled(_beta, counts=False).weights,
    "softmax(β·s), β of any sign",
    "-",
    True,
    params=(nz.Param("beta", 1.0, "β, any sign", tensor=True),),
    family=nz.families.RowScaled(_beta, counts=False),
)


def _inputs(dtype=torch.float64, lq=SHAPE_LQ, lk=SHAPE_LK, seed=13):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(SHAPE_B, SHAPE_H, n, 4, generator=g, dtype=torch.float64).to(dtype)
        for n in (lq, lk, lk)
    )


@pytest.mark.parametrize("value", SCALES_BAD, ids=_show)
@pytest.mark.parametrize("impl", ["auto", "chunked", "naive"])
def test_item13_scale_is_refused_unless_a_finite_number(value, impl):
    q, k, v = _inputs()
    for causal in (False, True):
        for check_finite in (True, False):
            with pytest.raises(
                ValueError,
                match=r"^the attend parameter scale must be a finite number or None, "
                r"got .+\.$",
            ):
                attend(q, k, v, impl=impl, scale=value, causal=causal, check_finite=check_finite)


def _paths_of(method):
    return (
        ("auto", "fused", "chunked", "naive")
        if nz.get(method).fused
        else ("auto", "chunked", "naive")
    )


#: parameters that make a path use the scale otherwise (stick-breaking's shift rides on q as
#: shift/scale; sink's logit)
SCALE_EXTRA = {"stick_breaking": {"shift": 0.4}, "sink": {"bias": 0.5}}


@pytest.mark.parametrize(
    ("method", "extra"),
    [(m, {}) for m in nz.available()] + list(SCALE_EXTRA.items()),
    ids=list(nz.available()) + [f"{m}-{'-'.join(p)}" for m, p in SCALE_EXTRA.items()],
)
def test_item13_a_non_positive_scale_agrees_with_naive_on_every_path(method, extra):
    q0, k0, v0 = _inputs()
    for causal in (True,) if method in CAUSAL_ONLY else (False, True):
        for scale in (-0.8, 0.0, 2):
            want = attend(q0, k0, v0, method, impl="naive", causal=causal, scale=scale, **extra)
            for impl in _paths_of(method):
                for check_finite in (True, False):
                    q, k, v = (t.float() for t in (q0, k0, v0))
                    run = dict(impl=impl, causal=causal, scale=scale, check_finite=check_finite)
                    out = attend(q, k, v, method, **run, **extra)
                    what = f"{method} scale={scale} causal={causal} {impl} {check_finite}"
                    assert_close(out, want, n=SHAPE_LK, magnitude=float(v0.abs().max()), msg=what)


@pytest.mark.parametrize("beta", [-1.5, 0.0, "per-head"])
def test_item13_a_row_scaled_plug_in_with_beta_at_most_zero_trains_on_every_path(
    beta, register_normalizer
):
    name = register_normalizer(SIGNED_BETA)
    q0, k0, v0 = _inputs()
    g = torch.randn(SHAPE_B, SHAPE_H, SHAPE_LQ, 4, dtype=torch.float64)
    if beta == "per-head":  # β <= 0 on every head, one of them 0
        beta = torch.tensor([-2.0, 0.0, -0.3], dtype=torch.float64).view(1, SHAPE_H, 1, 1)
    for causal in (False, True):
        qr, kr, vr = (t.clone().requires_grad_() for t in (q0, k0, v0))
        want = attend(qr, kr, vr, name, impl="naive", causal=causal, beta=beta)
        (want * g).sum().backward()
        for impl in ("auto", "fused", "chunked", "naive"):
            for check_finite in (True, False):
                q, k, v = (t.float().requires_grad_() for t in (q0, k0, v0))
                b = beta.float() if torch.is_tensor(beta) else beta
                run = dict(impl=impl, causal=causal, beta=b, check_finite=check_finite)
                out = attend(q, k, v, name, **run)
                (out * g.float()).sum().backward()
                what = f"β={_show(beta)} causal={causal} {impl} {check_finite}"
                assert_close(out, want, n=SHAPE_LK, magnitude=float(v0.abs().max()), msg=what)
                for t, r in ((q, qr), (k, kr), (v, vr)):
                    size = float(r.grad.abs().max())
                    assert_close(t.grad, r.grad, n=SHAPE_LK * SHAPE_LQ, magnitude=size, msg=what)


def _shape_refused(method, name, shape):
    shown = re.escape(str(list(shape)))
    return pytest.raises(
        ValueError,
        match=rf"^the {method} parameter {name} takes one value per row of the scores, a tensor "
        rf"of shape \[B\|1, H\|1, Lq\|1, 1\] .*got shape {shown}\.$",
    )


PER_ROW = (SHAPE_B, SHAPE_H, SHAPE_LQ, 1)
BAD_SHAPES = [
    ("stick_breaking", "shift", 0.4, (SHAPE_H,)),
    ("stick_breaking", "shift", 0.4, (SHAPE_LQ,)),
    ("stick_breaking", "shift", 0.4, (SHAPE_LK,)),
    ("stick_breaking", "shift", 0.4, (1, SHAPE_H, SHAPE_LQ, SHAPE_LK)),
    ("entmax", "alpha", 1.5, (SHAPE_H,)),
    ("entmax", "alpha", 1.5, (SHAPE_LQ,)),
    ("asentmax", "alpha", 1.5, (SHAPE_H,)),
    ("asentmax", "alpha", 1.5, (SHAPE_LQ,)),
    ("softmax", "temperature", 0.7, (1, SHAPE_H, 1, SHAPE_LK)),
    ("softmax", "temperature", 0.7, (SHAPE_B + 1, SHAPE_H, 1, 1)),
    ("sink", "bias", 0.3, (1, SHAPE_H + 1, 1, 1)),
    ("sink", "bias", 0.3, (1, *PER_ROW)),
]
GOOD_SHAPES = [(), (1,), (1, SHAPE_H, 1, 1), (SHAPE_H, 1, 1), (SHAPE_B, 1, SHAPE_LQ, 1), PER_ROW]


def _per_row(value: float, shape, dtype=torch.float64) -> torch.Tensor:
    """A tensor of ``shape`` whose entries differ (value · 0.9 ... value · 1.1, in order)."""
    n = math.prod(shape)
    spread = torch.linspace(0.9, 1.1, n, dtype=dtype) if n > 1 else torch.ones(n, dtype=dtype)
    return (value * spread).reshape(shape)


@pytest.mark.parametrize(
    ("method", "name", "value", "shape"),
    BAD_SHAPES,
    ids=[f"{m}-{n}-{list(s)}" for m, n, _, s in BAD_SHAPES],
)
def test_item13_a_parameter_tensor_of_the_wrong_shape_is_refused_on_every_path(
    method, name, value, shape
):
    q, k, v = _inputs()
    bad = _per_row(value, shape)
    causal = method in CAUSAL_ONLY
    for impl in _paths_of(method):
        for check_finite in (True, False):  # shapes only: refused without reading a value
            with _shape_refused(method, name, shape):
                attend(
                    q,
                    k,
                    v,
                    method,
                    impl=impl,
                    causal=causal,
                    check_finite=check_finite,
                    **{name: bad},
                )
    with _shape_refused(method, name, shape):  # the one check, called directly
        nz.get(method).check_params({name: bad}, check_values=False, rows=PER_ROW[:3])


@pytest.mark.parametrize("shape", [(SHAPE_H,), (SHAPE_LQ,), (1, SHAPE_H, SHAPE_LQ, SHAPE_LK)])
def test_item13_multihead_attention_and_hf_apply_refuse_a_wrong_shaped_shift(shape):
    from sharpattn.attention import MultiheadAttention

    bad = _per_row(0.4, shape, torch.float32)
    with _shape_refused("stick_breaking", "shift", shape):  # at construction
        MultiheadAttention(12, SHAPE_H, "stick_breaking", causal=True, shift=bad)
    wrong_heads = _per_row(0.4, (1, SHAPE_H + 1, 1, 1), torch.float32)
    with _shape_refused("stick_breaking", "shift", wrong_heads.shape):
        MultiheadAttention(12, SHAPE_H, "stick_breaking", causal=True, shift=wrong_heads)
    pytest.importorskip("transformers")
    import tiny_hf
    from sharpattn import hf

    with _shape_refused("stick_breaking", "shift", shape):
        hf.apply(tiny_hf.llama(), "stick_breaking", shift=bad)


def test_item13_multihead_attention_takes_a_per_head_shift():
    from sharpattn.attention import MultiheadAttention

    torch.manual_seed(0)
    shift = _per_row(0.4, (1, SHAPE_H, 1, 1), torch.float32)
    layer = MultiheadAttention(12, SHAPE_H, "stick_breaking", causal=True, shift=shift)
    x = torch.randn(SHAPE_B, SHAPE_LQ, 12)
    want = layer(x, impl="naive")
    for impl in ("auto", "chunked"):
        assert_close(layer(x, impl=impl), want, n=SHAPE_LQ * 12, msg=impl)


@pytest.mark.parametrize("shape", GOOD_SHAPES, ids=lambda s: str(list(s)))
@pytest.mark.parametrize(
    ("method", "name", "value"),
    [("stick_breaking", "shift", 0.4), ("entmax", "alpha", 1.4), ("softmax", "temperature", 0.7)],
)
def test_item13_a_parameter_tensor_of_a_right_shape_agrees_with_naive_on_every_path(
    method, name, value, shape
):
    q0, k0, v0 = _inputs()
    causal = method in CAUSAL_ONLY
    p0 = _per_row(value, shape)
    want = attend(q0, k0, v0, method, impl="naive", causal=causal, **{name: p0})
    # the tensor's meaning, one value per row: each row as a number on its own
    full = p0.reshape(torch.broadcast_shapes(p0.shape, (1, 1, 1, 1))).expand(*PER_ROW)
    for b, h, i in [(0, 0, 0), (SHAPE_B - 1, SHAPE_H - 1, SHAPE_LQ - 1), (1, 1, 2)]:
        one = attend(
            q0[b : b + 1, h : h + 1],
            k0[b : b + 1, h : h + 1],
            v0[b : b + 1, h : h + 1],
            method,
            impl="naive",
            causal=causal,
            **{name: float(full[b, h, i, 0])},
        )
        assert_close(want[b, h, i], one[0, 0, i], n=SHAPE_LK, msg=f"row {(b, h, i)}")
    for impl in _paths_of(method):
        for check_finite in (True, False):
            q, k, v = (t.float() for t in (q0, k0, v0))
            run = dict(impl=impl, causal=causal, check_finite=check_finite)
            out = attend(q, k, v, method, **run, **{name: p0.float()})
            what = f"{method} {name} {list(shape)} {impl} {check_finite}"
            assert_close(out, want, n=SHAPE_LK, magnitude=float(v0.abs().max()), msg=what)


# messages that named the wrong culprit for a user's method --------------------------------------


def test_a_nan_from_a_users_hook_is_said_to_come_from_the_method(register_normalizer):
    """A NaN that a user's method makes (here its family's β hook, on rows of more than 8 keys,
    which the contract's probe does not reach) comes from the method's function: the message
    says so, not "scale q or k down" (sharpattn's own methods keep that message, above)."""
    from sharpattn.normalizers.families import RowScaled

    def beta(n, **_):
        return torch.where(n > 8, torch.full_like(n, math.nan), torch.ones_like(n))

    family = RowScaled(beta)
    entry = nz.Normalizer("nan_hook", family.weights, "softmax(β·s)", "-", True, family=family)
    name = register_normalizer(entry)
    assert not nz.registry.is_built_in(nz.get(name))
    assert all(nz.registry.is_built_in(nz.get(m)) for m in ("softmax", "relu", "asentmax"))
    q = torch.randn(1, 1, 16, 4, generator=torch.Generator().manual_seed(0))
    for impl in PATHS:
        with pytest.raises(ValueError, match="came from the method's function") as err:
            attend(q, q, q, name, impl=impl)
        assert "scale q or k" not in str(err.value), impl


def test_a_users_sparse_family_names_its_alpha_as_the_methods(register_normalizer):
    """A user's `Sparse` family whose α (from the method's own parameter ``a``) is out of range:
    the message names the method and its family's alpha, not "the entmax parameter"."""
    from sharpattn.normalizers.families import Sparse

    family = Sparse(alpha=lambda a=1.5, **_: a)
    param = nz.Param("a", 1.5, "a number in [1, 5]", low=1.0, high=5.0)
    entry = nz.Normalizer(
        "alpha_of_a", family.weights, "α-entmax", "-", True, params=(param,), family=family
    )
    name = register_normalizer(entry)
    q = torch.randn(1, 1, 16, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"method 'alpha_of_a': its family's alpha") as err:
        attend(q, q, q, name, a=3.0, impl="fused")
    assert "entmax parameter" not in str(err.value)
