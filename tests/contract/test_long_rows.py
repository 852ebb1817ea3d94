"""Every registered method's fast path (``impl="auto"``) on long rows, in float32, against the
float64 naive path: each gradient within 16× the error of the eager float32 naive path.

The shared tolerances grow as √n with the reduction length, so an error that grows as n (a
running sum subtracted from a total whose rounding every key then takes again) passes them at the
short lengths the other tests use and shows only on long rows. q times 3 sharpens the rows
(sparse supports of a few keys, stick-breaking's far keys with σ(s) of order 1). Shapes: one
query against 2,048 keys (a decoding step's whole-row paths) and 64 × 1,024 (the tiles).
"""

from __future__ import annotations

import pytest
import torch

from sharpattn import attend
from sharpattn import normalizers as nz

pytestmark = [pytest.mark.numerical, pytest.mark.usefixtures("one_thread")]

SHAPES = [(1, 2048), (64, 1024)]


def _grads(method, leaves, d, impl):
    out = attend(*leaves, method, causal=True, impl=impl)
    return torch.autograd.grad(out, leaves, d, allow_unused=True)  # hardmax: no dq, dk


@pytest.mark.parametrize(("lq", "lk"), SHAPES, ids=[f"{a}x{b}" for a, b in SHAPES])
@pytest.mark.parametrize("method", nz.available())
def test_gradients_on_long_rows_within_a_few_times_the_eager_error(method, lq, lk):
    g = torch.Generator().manual_seed(5)
    q = 3 * torch.randn(1, 2, lq, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, lk, 16, generator=g, dtype=torch.float64) for _ in range(2))
    d = torch.randn(1, 2, lq, 16, generator=g, dtype=torch.float64)
    want = _grads(method, [t.clone().requires_grad_() for t in (q, k, v)], d, "naive")
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    fast = _grads(method, leaves, d.float(), "auto")
    eager = _grads(method, leaves, d.float(), "naive")
    for what, a, b, w in zip(("dq", "dk", "dv"), fast, eager, want, strict=True):
        if w is None:
            assert a is None or not a.any(), what
            continue
        err_fast = float((a.double() - w).abs().max())
        err_eager = float((b.double() - w).abs().max())
        floor = 1e-7 * float(w.abs().max())  # a float32 rounding of the largest entry
        assert err_fast <= 16 * max(err_eager, floor), (what, err_fast, err_eager)
