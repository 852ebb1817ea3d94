"""The adversarial property suite (issue 16): every registered method × every path × hostile input.

Methods come from the registry at collection time, so a newly registered method inherits every
check. Paths: ``naive`` (the reference), ``chunked`` (with small blocks, so rows cross block
edges) and, where the registry names a fused path, ``fused`` and ``auto``. Hypothesis draws the
input: zero-size B/Lq/Lk, magnitudes up to 1e30 (finite inputs whose product overflows
included), −inf scores and all-masked rows (normalizer level), one key, causal with Lq ≠ Lk,
grouped-query heads, float16/bfloat16/float32/float64, per-row and broadcast masks, and each of
q, k, v (and the mask) in its own memory layout (:data:`LAYOUTS`: heads-last views, a transposed
or sliced last dimension, a storage offset, expanded batch and heads, rows overlapping in memory). Each case asserts:

* no crash: every path returns, or every path raises the same exception type (ValueError);
* no NaN: outputs (and, with gradients, gradients) are finite where the contract promises it;
* the same answer on every path, within the bound of ``precision.py``;
* the contract on the weights: masked entries exactly 0, empty rows 0, rows summing to one for
  methods whose registry entry says so.

Deterministic for CI (``derandomize=True``, 60 examples per method and test, about 15 s on one
core); the seed of the random tensors is drawn, not the floats, so every example is cheap. To
explore further: ``ADV_RANDOM=1 ADV_EXAMPLES=500 pytest tests/contract/test_adversarial.py``.

On another device: ``SHARPATTN_TEST_DEVICE=cuda pytest tests/contract/test_adversarial.py`` draws
the same cases, runs every path there (the naive reference too), and also holds that device's
naive path against the CPU's.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import test_family_hooks
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import layouts
from devices import DEVICE  # where the cases run (the tensors are drawn on the CPU, then moved)
from precision import assert_close
from sharpattn import attend, causal_mask
from sharpattn import normalizers as nz
from structure import explicit_mask

pytestmark = pytest.mark.numerical

METHODS = nz.available()

SETTINGS = settings(
    max_examples=int(os.environ.get("ADV_EXAMPLES", 60)),
    deadline=None,
    derandomize=not os.environ.get("ADV_RANDOM"),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def paths(method: str) -> tuple[str, ...]:
    """The paths to hold against ``naive``."""
    return ("chunked", "fused", "auto") if nz.get(method).fused else ("chunked",)


# ---------------------------------------------------------------------------------------------
# Cases


def weighted(*options):
    """A strategy over ``(value, weight)`` pairs, the first the simplest (hypothesis shrinks to
    it): plain ``sampled_from`` would spend most examples on the rare, erroring corners."""
    table = [value for value, weight in options for _ in range(weight)]
    return st.sampled_from(table)


DTYPES = weighted((torch.float32, 3), (torch.float64, 2), (torch.float16, 1), (torch.bfloat16, 1))
#: sizes of q and k: mostly ordinary (the paths' answers are compared), sometimes hostile
MAGNITUDES = weighted((1.0, 6), (1e2, 2), (1e4, 2), (1e8, 1), (1e15, 1), (1e30, 1))


#: memory layouts of q, k, v (tests/layouts.py), the plain one most often
LAYOUTS = weighted(
    *(
        (name, 6 if name == "contiguous" else 2 if name == "heads_last" else 1)
        for name in layouts.LAYOUTS
    )
)


@st.composite
def attention_cases(draw):
    """Keyword arguments of one hostile ``attend`` call (q, k, v built by :func:`build`)."""
    zero = draw(weighted((None, 12), ("b", 1), ("lq", 1), ("lk", 1), ("h", 1), ("d", 1)))
    hkv = 0 if zero == "h" else draw(st.sampled_from([1, 2]))  # H = 0: a ValueError
    d = 0 if zero == "d" else draw(st.sampled_from([4, 1]))  # D = 0: a ValueError
    return dict(
        seed=draw(st.integers(0, 2**31 - 1)),
        b=0 if zero == "b" else draw(st.sampled_from([1, 2])),
        hkv=hkv,
        h=hkv * draw(st.sampled_from([1, 2])),  # grouped-query heads when > hkv
        lq=0 if zero == "lq" else draw(st.sampled_from([3, 1, 5, 2])),
        lk=0 if zero == "lk" else draw(st.sampled_from([4, 1, 7, 2])),  # 1: one key; 2 over Lq = 1
        d=d,
        dv_other=draw(st.booleans()),  # value size != key size: the fused paths' fallback
        dtype=draw(DTYPES),
        q_mag=draw(MAGNITUDES),
        k_mag=draw(MAGNITUDES),
        mask=draw(st.sampled_from([None, "padding", "rows", "broadcast"])),
        causal=draw(st.booleans()),
        layouts=tuple(draw(LAYOUTS) for _ in "qkv"),
        mask_transposed=draw(st.booleans()),  # a mask seen through a transpose
        block=draw(st.sampled_from([1, 2, None])),
    )


def build(c):
    """(q, k, v, mask) for a case from :func:`attention_cases`; float tensors need grad."""
    g = torch.Generator().manual_seed(c["seed"])
    dv = c["d"] + 1 if c["dv_other"] else c["d"]

    def tensor(heads, length, size, mag, layout):
        x = torch.randn(c["b"], heads, length, size, generator=g, dtype=torch.float64)
        x = layouts.laid_out((x * mag).to(DEVICE, c["dtype"]), layout, g)
        return x.requires_grad_(True)

    lq_, lk_, lv_ = c["layouts"]
    q = tensor(c["h"], c["lq"], c["d"], c["q_mag"], lq_)
    k = tensor(c["hkv"], c["lk"], c["d"], c["k_mag"], lk_)
    v = tensor(c["hkv"], c["lk"], dv, 1.0, lv_)
    mask = None
    b, h, lq, lk = c["b"], c["h"], c["lq"], c["lk"]
    if c["mask"] == "padding":
        mask = torch.rand(b, 1, 1, lk, generator=g) < 0.7
    elif c["mask"] == "rows":  # per-row, some rows all False
        mask = torch.rand(b, h, lq, lk, generator=g) < 0.6
        mask &= torch.rand(b, h, lq, 1, generator=g) < 0.7
    elif c["mask"] == "broadcast":
        mask = torch.rand(lq, lk, generator=g) < 0.6
    if mask is not None and c["mask_transposed"]:
        mask = mask.transpose(-1, -2).contiguous().transpose(-1, -2)
    return q, k, v, None if mask is None else mask.to(DEVICE)


def run(method, impl, q, k, v, mask, c, /, **kw):
    """attend(...) as (output, stats, grads) or the exception it raised."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    try:
        out, stats = attend(
            q,
            k,
            v,
            method,
            mask=mask,
            causal=c["causal"],
            impl=impl,
            return_stats=True,
            block_size=c["block"] if impl == "chunked" else None,
            **kw,
        )
    except Exception as err:  # noqa: BLE001 - the exception type is what is compared
        return err
    g = torch.Generator().manual_seed(c["seed"] + 1)
    cotangent = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), cotangent, allow_unused=True)
    grads = tuple(
        torch.zeros_like(t) if gr is None else gr for t, gr in zip((q, k, v), grads, strict=True)
    )
    return out.detach(), stats, grads


def refused(impl, got, ref) -> bool:
    """Whether ``impl``'s result ``got`` or naive's ``ref`` is an exception, after holding that
    both are the same ValueError type (a user's input: one sentence on every path)."""
    if not (isinstance(ref, Exception) or isinstance(got, Exception)):
        return False
    assert type(got) is type(ref), f"{impl}: {got!r} but naive: {ref!r}"
    assert isinstance(ref, ValueError) and "\n" not in str(ref), repr(ref)
    return True


def score_size(q, k) -> float:
    """Bound on |s_ij| = |scale·q_i·k_j| (Cauchy–Schwarz), in float64."""
    if q.numel() == 0 or k.numel() == 0:
        return 0.0
    qn = q.detach().double().norm(dim=-1).max()
    kn = k.detach().double().norm(dim=-1).max()
    return float(qn * kn) / math.sqrt(q.shape[-1])


# ---------------------------------------------------------------------------------------------
# attend: every path against naive


@pytest.mark.parametrize("method", METHODS)
@given(c=attention_cases())
@SETTINGS
def test_every_path_agrees_with_naive_on_hostile_input(method, c):
    q, k, v, mask = build(c)
    ref = run(method, "naive", q, k, v, mask, c)
    for impl in paths(method):
        got = run(method, impl, q, k, v, mask, c)
        if refused(impl, got, ref):  # the same error on every path
            continue
        _check_result(method, impl, got, ref, q, k, v, c)
    if not isinstance(ref, Exception):
        _check_contract(method, q, k, v, mask, c, ref)
    if DEVICE.type != "cpu":  # this device's reference against the CPU's
        cpu = [None if t is None else t.detach().cpu() for t in (q, k, v, mask)]
        on_cpu = run(method, "naive", *cpu, c)
        if isinstance(ref, Exception) or isinstance(on_cpu, Exception):
            assert type(on_cpu) is type(ref), f"{DEVICE}: {ref!r} but cpu: {on_cpu!r}"
        else:
            _check_result(method, f"naive on {DEVICE}", _on_cpu(ref), on_cpu, *cpu[:3], c)


def _on_cpu(result):
    """``run``'s (output, stats, grads) with every tensor moved to the CPU."""
    out, stats, grads = result
    moved = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    moved = {n: t.cpu() if torch.is_tensor(t) else t for n, t in moved.items()}
    return out.cpu(), dataclasses.replace(stats, **moved), tuple(g.cpu() for g in grads)


def _check_result(method, impl, got, ref, q, k, v, c):
    out, stats, grads = got
    r_out, r_stats, r_grads = ref
    shape = (c["b"], c["h"], c["lq"], v.shape[-1])
    assert out.shape == shape and out.dtype == q.dtype, impl
    assert bool(torch.isfinite(out).all()), f"{impl}: non-finite output"
    # Tolerance: the paths round q·kᵀ differently (fused kernel, blocked and whole matmuls), by
    # ε·|s| per score; a normalizer moves a weight by at most its slope (≤ 1 per unit of β·s
    # for the softmax family, β ≤ ~4 here) times that, and the output by that times |v|. So the
    # magnitude is |v|·(1 + |s|), over a reduction of max(Lk, D) terms; 16 ulps, not 8: β and the
    # two roundings (of the scores, then of the weighted sum) compound.
    s_max = score_size(q, k)
    v_max = float(v.detach().double().abs().max()) if v.numel() else 0.0
    n = max(c["lk"], c["d"])
    # stick_breaking's weights are products of up to Lk factors, each moved by its score's rounding
    mag = v_max * (1.0 + s_max) * (c["lk"] if method == "stick_breaking" else 1.0)
    dt = q.dtype  # for the statistics too: the naive path's are of weights rounded to it
    if method == "adaptive" and impl != "chunked" and dt == torch.float64:
        # documented model gap (README): the fused path's β uses the exact entropy, naive's the
        # reference code's −Σ p·log(p + 1e-9), up to Lk·1e-9 lower: within float32's ε, not
        # float64's
        dt = torch.float32
    if s_max < 1e4:  # beyond, one rounding of a score is ≥ 1e-3: weights are ties of rounding
        assert_close(out, r_out, dtype=dt, n=n, magnitude=mag, ulps=16, msg=f"{impl} output")
    # stats: the exact things are exact; entropy and mass within the same bound
    assert torch.equal(stats.visible, r_stats.visible), impl
    if nz.get(method).sums_to_one:  # every path's rows that see a key sum to one
        mass = stats.mass[stats.visible > 0]
        assert_close(mass, torch.ones_like(mass), dtype=dt, n=max(c["lk"], 1), msg=f"{impl} Σ w")
    if s_max < 1e2:
        mag = (1.0 + s_max) * max(1.0, math.log(max(c["lk"], 1)))
        # fused entropy is lse − Σ p·s: one more subtraction of s-sized terms
        assert_close(
            stats.entropy, r_stats.entropy, dtype=dt, n=n, magnitude=mag, ulps=32, msg=impl
        )
        assert_close(
            stats.mass, r_stats.mass, dtype=dt, n=n, magnitude=1 + s_max, ulps=16, msg=impl
        )
    if stats.lse is not None:
        empty = stats.visible == 0
        assert bool((stats.lse[empty] == float("-inf")).all()), f"{impl}: lse of empty rows"
        assert not bool(torch.isnan(stats.lse).any()), impl
    # gradients: never NaN; finite where the true gradient fits the dtype; the same on every path
    for name, gr, r_gr in zip("qkv", grads, r_grads, strict=True):
        assert not bool(torch.isnan(gr).any()), f"{impl}: NaN in d/d{name}"
        if c["dtype"] in (torch.float32, torch.float64) and s_max < 1e15:
            assert bool(torch.isfinite(gr).all()), f"{impl}: non-finite d/d{name}"
        if s_max < 10 and c["dtype"] in (torch.float32, torch.float64):
            # d/dq, d/dk carry a factor |k|, |q| and the normalizer's second-order slope
            mag = (1.0 + s_max) ** 2 * max(1.0, v_max) * max(c["q_mag"], c["k_mag"])
            ulps = 64 if method != "stick_breaking" else 64 * max(c["lk"], 1)
            assert_close(gr, r_gr, dtype=dt, n=n, magnitude=mag, ulps=ulps, msg=f"{impl} d/d{name}")


def _check_contract(method, q, k, v, mask, c, ref):
    """The naive path's weights: masked 0, empty rows 0, rows summing to one where promised."""
    out = ref[0]
    assert bool(torch.isfinite(out).all()), "naive: non-finite output"
    _, w = attend(
        q.detach(),
        k.detach(),
        v.detach(),
        method,
        mask=mask,
        causal=c["causal"],
        impl="naive",
        return_weights=True,
    )
    visible = torch.ones(w.shape, dtype=torch.bool, device=w.device)
    if mask is not None:
        visible &= mask
    if c["causal"]:
        visible &= causal_mask(c["lq"], c["lk"], device=w.device)
    assert bool((w[~visible] == 0).all()), "masked weights must be exactly 0"
    empty = ~visible.any(-1)
    assert bool((w[empty] == 0).all()), "rows with no visible key must be 0"
    if nz.get(method).sums_to_one:
        sums = w.double().sum(-1)[~empty]
        assert_close(sums, torch.ones_like(sums), dtype=w.dtype, n=max(c["lk"], 1), msg="Σ w")


# ---------------------------------------------------------------------------------------------
# Normalizers directly: −inf scores, all-masked rows, any magnitude, any dtype


@st.composite
def score_cases(draw):
    return dict(
        seed=draw(st.integers(0, 2**31 - 1)),
        shape=draw(st.sampled_from([(3, 5), (2, 3, 4), (4, 1), (1, 6), (0, 3), (3, 0), (2, 0, 4)])),
        dtype=draw(DTYPES),
        mag=draw(MAGNITUDES),
        neg_inf=draw(st.booleans()),  # some −inf scores and one all −inf row
        mask=draw(st.sampled_from([None, "full", "rows", "broadcast"])),
        contiguous=draw(st.booleans()),
    )


@pytest.mark.parametrize("method", METHODS)
@given(c=score_cases())
@SETTINGS
def test_normalizer_contract_on_hostile_scores(method, c):
    g = torch.Generator().manual_seed(c["seed"])
    shape = c["shape"]
    x = torch.randn(shape[::-1], generator=g, dtype=torch.float64) * c["mag"]
    x = x.permute(*reversed(range(len(shape))))  # non-contiguous: a transposed buffer
    if c["contiguous"]:
        x = x.contiguous()
    allowed = torch.ones(shape, dtype=torch.bool)
    if c["neg_inf"] and x.numel():
        x = x.masked_fill(torch.rand(shape, generator=g) < 0.3, float("-inf"))
        x[..., 0, :] = float("-inf")  # an all −inf row
    allowed &= x != float("-inf")
    mask = None
    if c["mask"] == "full":
        mask = torch.rand(shape, generator=g) < 0.6
        if x.numel():
            mask[..., -1, :] = False  # an all-masked row
    elif c["mask"] == "rows":
        mask = torch.rand(*shape[:-1], 1, generator=g) < 0.7
    elif c["mask"] == "broadcast":
        mask = torch.rand(shape[-1], generator=g) < 0.7
    if mask is not None:
        allowed &= mask
    x, allowed = x.to(DEVICE), allowed.to(DEVICE)
    mask = None if mask is None else mask.to(DEVICE)
    s = x.to(c["dtype"]).requires_grad_(True)
    allowed &= s.detach() != float("-inf")  # magnitudes beyond the dtype round to ±inf
    if bool((s.detach() == float("inf")).any()):  # +inf at an allowed position is an error
        if bool(((s.detach() == float("inf")) & allowed).any()):
            with pytest.raises(ValueError, match=r"\+inf"):
                nz.get(method).fn(s, mask)
            return
    try:
        w = nz.get(method).fn(s, mask)
    except ValueError as err:  # a causal-only method (stick_breaking): fold the causal mask in
        if "causal" not in str(err):
            raise
        causal = causal_mask(shape[-2], shape[-1], device=DEVICE)
        mask = causal if mask is None else mask & causal
        allowed &= causal
        w = nz.get(method).fn(s, mask)
    assert w.shape == s.shape and w.dtype == s.dtype
    assert bool(torch.isfinite(w).all()), "non-finite weights"
    assert bool((w[~allowed] == 0).all()), "masked and −inf entries must be exactly 0"
    empty = ~allowed.any(-1)
    assert bool((w[empty] == 0).all()), "empty rows must be 0"
    if nz.get(method).sums_to_one and w.numel():
        sums = w.double().sum(-1)[~empty]
        assert_close(sums, torch.ones_like(sums), dtype=w.dtype, n=shape[-1], msg="Σ w")
    if not w.requires_grad:  # hardmax: piecewise constant, no graph
        return
    cot = torch.randn(w.shape, generator=g, dtype=torch.float64).to(w.device, w.dtype)
    (grad,) = torch.autograd.grad(w, s, cot, allow_unused=True)
    if grad is not None:
        assert not bool(torch.isnan(grad).any()), "NaN gradient"
        if c["dtype"] in (torch.float32, torch.float64):
            assert bool(torch.isfinite(grad).all()), "non-finite gradient"


# ---------------------------------------------------------------------------------------------
# Bad masks: the same error type on every path and directly


#: made on DEVICE: only what is wrong with them should be refused
BAD_MASKS = {
    "float": lambda: torch.ones(1, 1, 3, 4, device=DEVICE),
    "int": lambda: torch.ones(1, 1, 3, 4, dtype=torch.int64, device=DEVICE),
    "uint8": lambda: torch.ones(3, 4, dtype=torch.uint8, device=DEVICE),
    "wrong Lk": lambda: torch.ones(1, 1, 3, 5, dtype=torch.bool, device=DEVICE),
    "wrong Lq": lambda: torch.ones(2, 4, dtype=torch.bool, device=DEVICE),
    "too many dims": lambda: torch.ones(1, 1, 1, 3, 4, dtype=torch.bool, device=DEVICE),
    "bigger batch": lambda: torch.ones(3, 1, 3, 4, dtype=torch.bool, device=DEVICE),
    "list": lambda: [[True] * 4] * 3,
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bad", list(BAD_MASKS))
def test_bad_masks_raise_value_error_on_every_path(method, bad):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 4, generator=g).to(DEVICE) for n in (3, 4, 4))
    for impl in ("naive", *paths(method)):
        with pytest.raises(ValueError, match="mask"):
            attend(q, k, v, method, mask=BAD_MASKS[bad](), impl=impl)
    scores = torch.randn(2, 2, 3, 4, generator=g).to(DEVICE)
    with pytest.raises(ValueError, match="mask"):
        nz.get(method).fn(scores, BAD_MASKS[bad]())


# ---------------------------------------------------------------------------------------------
# Extreme and mis-shaped parameters, query offsets: the same answer or the same refusal


def _number_params(method):
    """The parameters of ``method`` that take a number (query_offset has its own test)."""
    return [
        p
        for p in nz.get(method).params
        if p.value_kind in ("real", "int") and p.name != "query_offset"
    ]


PARAM_METHODS = [m for m in METHODS if _number_params(m)]


@st.composite
def extreme_value(draw, p):
    """A value of ``p``: log-uniform over its whole legal range (magnitudes 1e-30 to 1e30 where
    it is unbounded, either sign where it allows), or one of its bounds."""
    lo = -1e30 if p.low is None else p.low
    hi = 1e30 if p.high is None else p.high
    if p.value_kind == "int":
        return draw(st.integers(int(max(lo, -(10**6))), int(min(hi, 10**6))))
    if draw(st.booleans()):  # a bound, or just inside an open one
        edge = draw(st.sampled_from([lo, hi]))
        inside = (edge == lo and p.low_open) or (edge == hi and p.high_open)
        return edge + (1 if edge == lo else -1) * max(abs(edge), 1.0) * 1e-6 if inside else edge
    signs = [s for s in (1.0, -1.0) if (hi > 0 if s > 0 else lo < 0)]
    sign = draw(st.sampled_from(signs))
    top = math.log10(hi if sign > 0 else -lo) if (hi if sign > 0 else -lo) > 0 else -30
    bottom = math.log10(max(lo if sign > 0 else -hi, 1e-30)) if sign > 0 or hi < 0 else -30
    return sign * 10 ** draw(st.floats(min(bottom, top), top))


@st.composite
def param_cases(draw, method):
    """An ordinary attention case with one parameter of ``method`` at an extreme value, as a
    number or a tensor of one of several shapes (one value per head or per row: accepted; per
    key, a bare [H] or [Lq], transposed: refused on every path)."""
    c = draw(attention_cases())
    c.update(q_mag=1.0, k_mag=1.0)  # the parameter is the hostile part
    p = draw(st.sampled_from(_number_params(method)))
    value = draw(extreme_value(p))
    shape = None
    if p.accepts_tensor:
        shape = draw(st.sampled_from([None, None, "head", "row", "key", "bare_h", "bare_lq"]))
    c.update(param=p.name, value=value, shape=shape)
    return c


def _param_value(c):
    """The case's parameter: its number, or a float64 tensor of it in the case's shape."""
    b, h, lq, lk = c["b"], c["h"], c["lq"], c["lk"]
    shape = {
        None: None,
        "head": (1, h, 1, 1),
        "row": (b, h, lq, 1),
        "key": (1, 1, 1, lk),
        "bare_h": (h,),
        "bare_lq": (lq,),
    }[c["shape"]]
    if shape is None:
        return c["value"]
    return torch.full(shape, float(c["value"]), dtype=torch.float64, device=DEVICE)


@pytest.mark.parametrize("method", PARAM_METHODS)
@given(data=st.data())
@settings(SETTINGS, max_examples=max(SETTINGS.max_examples // 3, 1))
def test_extreme_and_mis_shaped_parameters_give_one_answer_or_one_refusal(method, data):
    """Every path returns the same result or raises the same ValueError; a result is finite
    and its gradients are never NaN; where the call is well conditioned (β·|s| small) every
    path equals naive within precision."""
    c = data.draw(param_cases(method))
    q, k, v, mask = build(c)
    kw = {c["param"]: _param_value(c)}
    ref = run(method, "naive", q, k, v, mask, c, **kw)
    for impl in paths(method):
        got = run(method, impl, q, k, v, mask, c, **kw)
        if refused(impl, got, ref):
            continue
        out, _, grads = got
        assert bool(torch.isfinite(out).all()), f"{impl}: non-finite output"
        for name, gr in zip("qkv", grads, strict=True):
            assert not bool(torch.isnan(gr).any()), f"{impl}: NaN in d/d{name}"
        if c["dtype"] in (torch.float32, torch.float64) and _well_conditioned(method, kw, q, k, c):
            v_max = float(v.detach().double().abs().max()) if v.numel() else 0.0
            n = max(c["lk"], c["d"])
            assert_close(
                out, ref[0], dtype=q.dtype, n=n, magnitude=v_max * 4, ulps=16, msg=f"{impl} output"
            )


def _well_conditioned(method, kw, q, k, c) -> bool:
    """Whether rounding a score moves a weight by much less than one: the parameter's own
    factor on the scores (β of the softmax family, 1 elsewhere) times |s| stays below 4, and
    the parameter is a plain size (not beyond 1e3 in magnitude)."""
    from sharpattn.attention.dispatch.fast import beta_bound

    entry = nz.get(method)
    full = {p.name: p.default for p in entry.params} | kw
    beta = beta_bound(entry, full, max(c["lk"], 1))
    size = abs(float(c["value"]))
    return beta is not None and beta * (1.0 + score_size(q, k)) < 4 and size <= 1e3


@given(c=attention_cases(), offset=st.integers(-8, 8), current=st.booleans())
@SETTINGS
def test_stick_breaking_query_offset_is_one_answer_on_every_path(c, offset, current):
    """stick_breaking's ``query_offset`` (the first query's key position) on every path: the
    same weights, or the same causal-only ValueError (a key past a query's position)."""
    c.update(q_mag=1.0, k_mag=1.0)
    q, k, v, mask = build(c)
    kw = dict(query_offset=offset, attend_current=current)
    ref = run("stick_breaking", "naive", q, k, v, mask, c, **kw)
    for impl in paths("stick_breaking"):
        got = run("stick_breaking", impl, q, k, v, mask, c, **kw)
        if refused(impl, got, ref):
            continue
        if c["dtype"] in (torch.float32, torch.float64):
            v_max = float(v.detach().double().abs().max()) if v.numel() else 0.0
            n = max(c["lk"], c["d"])
            assert_close(
                got[0],
                ref[0],
                dtype=q.dtype,
                n=n,
                ulps=16 * max(c["lk"], 1),
                magnitude=v_max * (1 + score_size(q, k)),
                msg=f"{impl} output",
            )


# ---------------------------------------------------------------------------------------------
# A user's family with a hostile hook: the same refusal on every path


@pytest.fixture(scope="module")
def hostile_methods():
    """The hostile families of tests/contract/test_family_hooks.py, registered for this module."""
    entries = [test_family_hooks.entry(h, f) for h, (f, _) in test_family_hooks.REFUSED.items()]
    for e in entries:
        nz.register(e)
    yield
    for e in entries:
        nz.unregister(e.name)


@pytest.mark.parametrize("hook", list(test_family_hooks.REFUSED))
@given(c=attention_cases())
@settings(SETTINGS, max_examples=max(SETTINGS.max_examples // 6, 1))
def test_a_hostile_hook_is_one_refusal_on_every_path(hook, c, hostile_methods):
    """A user's family whose hook returns what the family cannot use (tests/contract/
    test_family_hooks.py) raises the same ValueError on every path, or, on an input where the
    hook is never asked (no score at all), gives the same empty or all-zero result."""
    method = f"test_hook_{hook}"
    c.update(q_mag=1.0, k_mag=1.0)
    q, k, v, mask = build(c)
    ref = run(method, "naive", q, k, v, mask, c)
    for impl in paths(method):
        got = run(method, impl, q, k, v, mask, c)
        if not refused(impl, got, ref):  # no score: the hook was never asked
            assert 0 in (c["b"], c["lq"], c["lk"]), f"{impl}: a result from {hook}"
            assert torch.equal(got[0], ref[0]) and not bool(got[0].any()), impl


# ---------------------------------------------------------------------------------------------
# Structure: packed documents, windows, padding as lengths


def _cuts(data, lk: int) -> list[int]:
    """Document boundaries of Lk keys: empty documents, length-1 documents, one document."""
    inner = data.draw(st.lists(st.integers(0, lk), max_size=4))
    return [0, *sorted(inner), lk]


def _structure(data, c) -> dict:
    """Structure keywords for a case: cu_seqlens (with empty documents), per-row document ids,
    a window, lengths (right or left padding), or several at once."""
    b, lk = c["b"], c["lk"]
    kinds = data.draw(
        st.sets(st.sampled_from(["cu_seqlens", "documents", "window", "lengths"]), min_size=1)
    )
    if {"cu_seqlens", "documents"} <= kinds:
        kinds.discard("cu_seqlens")
    kw = {}
    if "cu_seqlens" in kinds:
        kw["cu_seqlens"] = torch.tensor(_cuts(data, lk))
    if "documents" in kinds:
        rows = []
        for _ in range(b if data.draw(st.booleans()) else 1):
            cu = torch.tensor(_cuts(data, lk))
            rows.append(torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff()))
        kw["documents"] = torch.stack(rows) if rows else torch.zeros(0, lk, dtype=torch.int64)
    if "window" in kinds:
        sides = st.sampled_from([None, 0, 1, 2, 5])
        kw["window"] = (data.draw(sides), data.draw(sides))
    if "lengths" in kinds:
        ends = [data.draw(st.integers(0, lk)) for _ in range(b)]
        if data.draw(st.booleans()):
            kw["lengths"] = torch.tensor(ends, dtype=torch.int64)
        else:
            firsts = [data.draw(st.integers(0, e)) for e in ends]
            kw["lengths"] = torch.tensor(list(zip(firsts, ends, strict=True))).view(b, 2)
    return kw


@pytest.mark.parametrize("method", METHODS)
@given(c=attention_cases(), data=st.data())
@settings(SETTINGS, max_examples=max(SETTINGS.max_examples // 2, 1))
def test_structure_is_one_answer_on_every_path(method, c, data):
    """Every path with structure equals naive with it, and naive with it equals naive with the
    explicit mask of its definition (tests/structure.py)."""
    kw = _structure(data, c)
    q, k, v, mask = build(c)
    ref = run(method, "naive", q, k, v, mask, c, **kw)
    for impl in paths(method):
        got = run(method, impl, q, k, v, mask, c, **kw)
        if refused(impl, got, ref):
            continue
        _check_result(method, impl, got, ref, q, k, v, c)
    if isinstance(ref, Exception) or min(c["b"], c["h"], c["d"]) == 0:
        return
    ids = kw.get("documents")
    if "cu_seqlens" in kw:
        ids = torch.repeat_interleave(
            torch.arange(len(kw["cu_seqlens"]) - 1), kw["cu_seqlens"].diff()
        )
    dense = explicit_mask(
        c["lq"], c["lk"], c["b"], ids=ids, window=kw.get("window"), lengths=kw.get("lengths")
    ).to(DEVICE)
    both = dense if mask is None else dense & mask
    plain = run(method, "naive", q, k, v, both, c)
    _check_result(method, "naive (explicit mask)", ref, plain, q, k, v, c)
