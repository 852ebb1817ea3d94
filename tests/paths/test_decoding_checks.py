"""`attend`'s input checks on a decoding step that reads the cache once (`decoding.step`):
q is checked before the step, k and v from the magnitudes the step read, and the call is
refused, or routed to the exact chunked path, exactly as when every input is read first.

Each case is run twice: as `attend` runs it, and with the step's report switched off
(`fast.decodes` False: every input read before any path); both must refuse with the same
sentence or give the same route and an answer within precision."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from precision import assert_close
from sharpattn import attend
from sharpattn import normalizers as nz
from sharpattn.attention import functional
from sharpattn.attention.cpu import decoding, native
from sharpattn.normalizers.families import Adaptive, RowScaled

METHODS = [
    "softmax",
    "ssmax",
    "sink",
    "sigmoid",
    "relu",
    "softpick",
    "stablemax",
    "power",
    "adaptive",
]


@pytest.fixture(autouse=True)
def needs_the_library():
    if native.compiler() is None:
        pytest.skip("no C++ compiler on the PATH: the loops are not built here")


def _inputs(lq=1, lk=700, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 2, n, 8, generator=g) for n in (lq, lk, lk))


def _both(monkeypatch, *args, **kwargs):
    """(outcome as attend runs the call, outcome with every input read first): each an
    output tensor or the ValueError's sentence; also whether each went to the chunked path."""
    outcomes = []
    real = functional.chunked_attend
    for deferred in (True, False):
        chunked = [0]

        def counted(*a, chunked=chunked, **kw):
            chunked[0] += 1
            return real(*a, **kw)

        with monkeypatch.context() as m:
            m.setattr(functional, "chunked_attend", counted)
            if not deferred:
                m.setattr(functional, "decodes", lambda *a, **kw: False)
            try:
                result = attend(*args, **kwargs)
            except ValueError as err:
                result = str(err)
        outcomes.append((result, chunked[0]))
    return outcomes


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_input_is_refused_in_the_same_sentence(method, where, bad, monkeypatch):
    q, k, v = _inputs()
    t = {"q": q, "k": k, "v": v}[where]
    t[0, 1, 0 if where == "q" else 5, 3] = bad
    (got, _), (want, _) = _both(monkeypatch, q, k, v, method, causal=True)
    assert isinstance(want, str) and got == want


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("size", [1.0, 1e2, 1e4, 1e8, 1e12, 1e18, 1e36, 3e38])
def test_large_inputs_take_the_same_route(method, size, monkeypatch):
    """From ordinary scores to |k| near float32's largest number: the same refusal (q·kᵀ could
    overflow), or the same route (the fused step, or the chunked path where the fused kernel's
    range test says so), and answers within precision of each other. The row-scaled family's
    test of |β|·|s| reads the largest |β·s| the step computed where every input read first
    bounds it by max ‖q_i‖·max ‖k_j‖: the step goes to the chunked path only where that bound
    does too."""
    q, k, v = _inputs(lq=3, seed=1)
    k[0, 0, 7] *= size
    v[0, 1, 9] *= size
    (got, got_route), (want, want_route) = _both(monkeypatch, q, k, v, method, causal=True)
    if isinstance(want, str):
        assert got == want
        return
    assert not isinstance(got, str), got
    if isinstance(nz.get(method).family, (RowScaled, Adaptive)):
        assert got_route <= want_route, f"{method} at {size:g}: chunked with the exact scores"
    else:
        assert got_route == want_route, f"{method} at {size:g}: another route"
    assert_close(got, want, dtype=torch.float32, n=700, ulps=64, msg=f"{method} at {size:g}")


class _Reads(TorchDispatchMode):
    """The ATen ops that read a tensor of the cache's size (k or v)."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.ops = size, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for a in args:
            if torch.is_tensor(a) and a.numel() == self.size and func.__name__ not in _VIEWS:
                self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


_VIEWS = {"view.default", "expand.default", "transpose.int", "slice.Tensor", "t.default"}


@pytest.mark.parametrize("method", METHODS)
def test_the_cache_is_read_once(method, monkeypatch):
    """No op of PyTorch reads k or v (the check's max |k| and |v|, and ssmax's largest |β·s|,
    come from the step, which reads them in C++), and the step was taken; with every input read
    first, the check's ops read them."""
    q, k, v = _inputs(lk=2048)
    steps = [0]
    for name in ("step", "adaptive_step", "scores"):
        real = getattr(decoding, name)

        def counted(*args, real=real, **kwargs):
            steps[0] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(decoding, name, counted)
    with _Reads(k.numel()) as reads:
        attend(q, k, v, method, causal=True)
    assert reads.ops == [] and steps[0] == 1, f"{method}: {reads.ops}"
    monkeypatch.setattr(functional, "decodes", lambda *a, **kw: False)
    with _Reads(k.numel()) as reads:
        attend(q, k, v, method, causal=True)
    assert "aminmax.default" in reads.ops


def test_a_step_that_is_not_taken_still_checks(monkeypatch):
    """Where `fast.decodes` and the path disagree (the path took no step), the inputs are
    read after the path and refused all the same."""
    monkeypatch.setattr(decoding, "applies", lambda *a, **kw: False)
    monkeypatch.setattr(functional, "decodes", lambda *a, **kw: True)
    q, k, v = _inputs()
    k[0, 0, 3, 3] = float("nan")
    with pytest.raises(ValueError, match="k contains a non-finite value at"):
        attend(q, k, v, "sigmoid", causal=True)


def test_the_input_check_reads_a_large_float32_tensor_in_cpp():
    """`attend`'s max |x| of a large contiguous float32 CPU tensor (`native.abs_max`): the
    largest magnitude, or NaN / infinity wherever one is, the last partial block included."""
    import math

    n = functional.NATIVE_MAX_ABS * 3 + 17
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    assert functional._max_abs(x) == float(x.abs().max())
    for at in (0, functional.NATIVE_MAX_ABS + 1, n - 1):
        for bad in (float("nan"), float("inf"), -float("inf")):
            y = x.clone()
            y[at] = bad
            got = functional._max_abs(y)
            assert math.isnan(got) if bad != bad else got == math.inf, (at, bad, got)
        y = x.clone()
        y[at] = -3e38
        assert functional._max_abs(y) == float(y.abs().max())
