"""A decoding step on the CPU (`decoding.step`: at most `decoding.ROWS` query rows, no gradient
wanted, float32 compute with the C++ loops): one pass over the cache in one parallel region,
the keys split into runs combined per row. The element-wise and row-normalised maps, the
row-scaled softmax family and the sinks take it. Its output equals the tile walk's or the flash
kernel's (the same call with a gradient wanted) and the float64 naive path, for every such
method, one and several rows, causal and not, Lq > Lk, grouped heads, float16 inputs, many runs
and every memory layout; each test checks the step was taken.

The pass also reports the largest |k|, |v| and ‖k_j‖ it read, and `attend` checks k and v from
that instead of reading the cache again (`tests/paths/test_decoding_checks.py`)."""

from __future__ import annotations

import itertools

import pytest
import torch

import layouts
from precision import assert_close
from sharpattn import attend
from sharpattn import normalizers as nz
from sharpattn.attention.cpu import decoding, native
from sharpattn.normalizers.families import RowScaled, Sink

MAPS = [
    n
    for n in nz.available()
    if getattr(nz.get(n).family, "kernel", None) is not None
    and nz.get(n).family.kernel.cpp
    and nz.get(n).family.kernel.tiles is not None
]
SOFTMAX = [n for n in nz.available() if isinstance(nz.get(n).family, (RowScaled, Sink))]
METHODS = [*MAPS, *SOFTMAX, "adaptive"]


@pytest.fixture(autouse=True)
def needs_the_library():
    if native.compiler() is None:
        pytest.skip("no C++ compiler on the PATH: the loops are not built here")


@pytest.fixture
def steps(monkeypatch):
    """How many calls took `decoding.step`, `decoding.adaptive_step` or `decoding.scores`."""
    count = [0]
    for name in ("step", "adaptive_step", "scores"):
        real = getattr(decoding, name)

        def counted(*args, real=real, **kwargs):
            count[0] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(decoding, name, counted)
    return count


def test_the_methods_are_found():
    assert {"sigmoid", "relu", "softpick", "stablemax"} <= set(MAPS)
    assert {"softmax", "ssmax", "length_scaled", "sink"} <= set(SOFTMAX)
    assert nz.get("adaptive").fused == "adaptive"


@pytest.mark.parametrize("method", METHODS)
def test_a_decoding_step_equals_the_other_paths_and_naive(method, steps):
    shapes = itertools.product((1, 5, 16), (1, 9, 300), (False, True), (1, 2))
    for lq, lk, causal, hkv in shapes:
        g = torch.Generator().manual_seed(lq * 1000 + lk)
        q = torch.randn(2, 4, lq, 8, generator=g, dtype=torch.float64)
        k = torch.randn(2, hkv, lk, 8, generator=g, dtype=torch.float64)
        v = torch.randn(2, hkv, lk, 5, generator=g, dtype=torch.float64)
        ref = attend(q, k, v, method, causal=causal, impl="naive")
        for dtype in (torch.float32, torch.float16):
            low = [t.to(dtype) for t in (q, k, v)]
            before = steps[0]
            step = attend(*low, method, causal=causal, impl="fused")
            assert steps[0] == before + 1, f"{method} {lq}x{lk}: the step was not taken"
            other = attend(low[0].requires_grad_(), *low[1:], method, causal=causal, impl="fused")
            assert steps[0] == before + 1, f"{method}: a gradient wanted, and the step was taken"
            what = f"{method} Lq={lq} Lk={lk} causal={causal} Hkv={hkv} {dtype}"
            assert_close(step, other.detach(), dtype=dtype, n=max(lk, 8), magnitude=4.0, msg=what)
            assert_close(step, ref, dtype=dtype, n=max(lk, 8), magnitude=4.0, ulps=32, msg=what)


@pytest.mark.parametrize(
    "method", ["softmax", "sink", "sigmoid", "relu", "power", "softpick", "adaptive"]
)
def test_many_runs_combine_to_one(method, monkeypatch):
    """The keys split into many runs (as on a many-core machine): the runs' sums, rescaled to
    each row's largest reference (adaptive: its moments, for the entropy), give the one-run
    answer; a run of keys no row sees (causal with Lq > Lk leaves early rows without keys)
    adds nothing."""
    g = torch.Generator().manual_seed(1)
    for lq, lk, causal in ((1, 1000, True), (16, 777, True), (3, 2, True), (7, 64, False)):
        q = torch.randn(1, 4, lq, 16, generator=g, dtype=torch.float64) * 3
        k = torch.randn(1, 1, lk, 16, generator=g, dtype=torch.float64)
        v = torch.randn(1, 1, lk, 16, generator=g, dtype=torch.float64)
        ref = attend(q, k, v, method, causal=causal, impl="naive")
        low = [t.float() for t in (q, k, v)]
        with monkeypatch.context() as m:
            m.setattr(decoding, "MIN_RUN", 1)
            m.setattr(torch, "get_num_threads", lambda: 64)
            assert decoding._runs(1, 1, lk) == min(256, lk)
            many = attend(*low, method, causal=causal)
        what = f"{method} Lq={lq} Lk={lk}"
        assert_close(many, ref, dtype=torch.float32, n=lk, magnitude=4.0, ulps=32, msg=what)


def test_the_runs_follow_the_threads_and_the_keys(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert decoding._runs(1, 8, 65536) == 4  # 32 units for 8 threads
    assert decoding._runs(1, 1, 65536) == 32
    assert decoding._runs(1, 1, 1000) == 1  # no run under MIN_RUN keys
    assert decoding._runs(4, 8, 65536) == 1


@pytest.mark.parametrize("layout", [x for x in layouts.LAYOUTS if x != "contiguous"])
def test_a_decoding_step_in_any_layout(layout, steps):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g) for n in (3, 40, 40))
    laid = [layouts.laid_out(t, layout, g) for t in (q, k, v)]
    plain = [t.contiguous() for t in laid]
    for method in ("sigmoid", "softpick", "softmax", "sink", "adaptive"):
        got = attend(*laid, method, causal=True)
        ref = attend(*[t.double() for t in plain], method, causal=True, impl="naive")
        assert_close(got, ref, dtype=torch.float32, n=40, msg=f"{method} {layout}")
    assert steps[0] == 5


def test_what_takes_the_step():
    """Gradients, statistics, a user mask, structure, more than `ROWS` rows or float64 take
    the other paths."""
    q, k, v = torch.randn(1, 2, 2, 8), torch.randn(1, 2, 50, 8), torch.randn(1, 2, 50, 8)
    from sharpattn.attention.masking import Masking

    plain = Masking.build(None, True, 2, 50, "cpu")
    assert decoding.applies(q, k, v, plain, False, ())
    assert not decoding.applies(q, k, v, plain, True, ())
    assert not decoding.applies(q.requires_grad_(), k, v, plain, False, ())
    assert not decoding.applies(
        q.detach(), k, v, plain, False, (torch.ones(1, requires_grad=True),)
    )
    with torch.no_grad():
        assert decoding.applies(q, k, v, plain, False, ())
    masked = Masking.build(torch.ones(50, dtype=torch.bool), False, 2, 50, "cpu")
    assert not decoding.applies(q.detach(), k, v, masked, False, ())
    big = torch.randn(1, 2, decoding.ROWS + 1, 8)
    assert not decoding.applies(big, k, v, Masking.build(None, False, 17, 50, "cpu"), False, ())
    assert not decoding.applies(q.detach().double(), k.double(), v.double(), plain, False, ())


def test_the_step_reports_what_it_read():
    """max |k| and max |v| over the whole cache (GQA heads, several runs, a causal step) and the
    largest |score| it computed, against PyTorch; a NaN or an infinity anywhere is reported
    as not finite."""
    import math

    from sharpattn.attention.masking import Masking

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 3, 64, generator=g)
    k, v = (torch.randn(2, 2, 1500, 64, generator=g) * 3 for _ in range(2))
    masking = Masking.build(None, True, 3, 1500, "cpu")
    with decoding.collected() as read:
        decoding.step("softmax", 0.0, 0.0, q, k, v, masking, 0.7)
    s = 0.7 * torch.matmul(q.view(2, 2, 6, 64), k.transpose(-2, -1))
    assert read.k == float(k.abs().max()) and read.v == float(v.abs().max())
    assert_close(read.score, float(s.abs().max()), dtype=torch.float32, n=64)
    for bad in (float("nan"), float("inf")):
        k2, v2 = k.clone(), v.clone()
        k2[1, 0, 1499, 63], v2[0, 1, 0, 0] = bad, bad
        with decoding.collected() as read:
            decoding.step("sigmoid", 0.0, 0.0, q, k2, v2, masking, 0.7, torch.zeros(1, 1, 1, 1))
        assert not math.isfinite(read.k) and not math.isfinite(read.v)
        with decoding.collected() as read:  # the two products of the paths with a row rule
            decoding.values(decoding.scores(q, k2, 0.7).softmax(-1), v2)
        assert read.complete and not math.isfinite(read.k) and not math.isfinite(read.v)


@pytest.mark.parametrize("beta", ["negative", "floor", "threshold"])
def test_adaptive_steps_follow_the_rule(beta, steps):
    """β(H) where the polynomial is negative (the shift c from the row's smallest score), at
    its floor, and below its entropy threshold (β = 1), against naive float64."""
    params = {
        "negative": {"coefficients": [-0.5, -1.0], "floor": -2.0},
        "floor": {"floor": 3.0},
        "threshold": {"threshold": 100.0},
    }[beta]
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 2, 32, generator=g, dtype=torch.float64) * 2
    k, v = (torch.randn(1, 2, 900, 32, generator=g, dtype=torch.float64) for _ in range(2))
    ref = attend(q, k, v, "adaptive", causal=True, impl="naive", **params)
    got = attend(q.float(), k.float(), v.float(), "adaptive", causal=True, **params)
    assert steps[0] == 1
    assert_close(got, ref, dtype=torch.float32, n=900, magnitude=4.0, ulps=32, msg=beta)


def test_the_two_products_equal_matmul():
    """`decoding.scores` and `decoding.values` (GQA heads, several runs, D ≠ Dv, zero weights,
    a strided cache) against float64 matmul, and their report of what they read."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 5, 24, generator=g)
    k = torch.randn(2, 2, 1200, 24, generator=g)
    v = layouts.laid_out(torch.randn(2, 2, 1200, 40, generator=g), "heads_last")
    with decoding.collected() as read:
        s = decoding.scores(q, k, 0.3)
        w = torch.relu(s)  # many zero weights
        out = decoding.values(w, v)
    qg = q.double().view(2, 2, 10, 24)
    want_s = 0.3 * torch.matmul(qg, k.double().transpose(-2, -1))
    assert_close(s, want_s.view(2, 4, 5, 1200), dtype=torch.float32, n=24)
    want = torch.matmul(w.double().view(2, 2, 10, 1200), v.double()).view(2, 4, 5, 40)
    assert_close(out, want, dtype=torch.float32, n=1200)
    assert read.complete and read.k == float(k.abs().max()) and read.v == float(v.abs().max())


#: the paths with a row rule of their own, which take the step's two products (`decoding.scores`
#: and `decoding.values`) while `attend` collects what they read
ROW_RULES = ["sparsemax", "entmax15", "entmax", "asentmax", "stick_breaking", "topk"]


@pytest.mark.parametrize("method", ROW_RULES)
def test_a_step_with_a_row_rule_reads_the_cache_in_two_products(method, steps):
    """With `attend`'s checks (which collect what the passes read) the step's products come
    from `decoding.scores` and `decoding.values`; the answer equals the path's own products
    (``check_finite=False``) and naive float64, one and several rows, grouped heads, float16."""
    shapes = itertools.product((1, 5, 16), (64, 300, 1500), (1, 2))
    for lq, lk, hkv in shapes:
        g = torch.Generator().manual_seed(lq * 1000 + lk)
        q = torch.randn(2, 4, lq, 8, generator=g, dtype=torch.float64)
        k = torch.randn(2, hkv, lk, 8, generator=g, dtype=torch.float64)
        v = torch.randn(2, hkv, lk, 5, generator=g, dtype=torch.float64)
        ref = attend(q, k, v, method, causal=True, impl="naive")
        for dtype in (torch.float32, torch.float16):
            low = [t.to(dtype) for t in (q, k, v)]
            before = steps[0]
            got = attend(*low, method, causal=True)
            assert steps[0] == before + 1, f"{method} {lq}x{lk}: the products were not taken"
            own = attend(*low, method, causal=True, check_finite=False)
            assert steps[0] == before + 1
            what = f"{method} Lq={lq} Lk={lk} Hkv={hkv} {dtype}"
            assert_close(got, own, dtype=dtype, n=lk, magnitude=4.0, msg=what)
            assert_close(got, ref, dtype=dtype, n=lk, magnitude=4.0, ulps=32, msg=what)
