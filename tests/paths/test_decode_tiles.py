"""A decoding step of the element-wise and row-normalised maps on the CPU (`tiled._decode`: at
most `tiled.DECODE_ROWS` query rows, no gradient wanted, the C++ loops): the sums of the tile
walk on one tile of every key, without the walk. Its output equals the tile walk's (the same
call with a gradient wanted) and the float64 naive path, for every such built-in map, one and
several rows, causal and not, Lq > Lk, grouped heads, float16 inputs and transposed layouts;
each test checks the step was taken."""

from __future__ import annotations

import itertools

import pytest
import torch

import layouts
from precision import assert_close
from sharpattn import attend
from sharpattn import normalizers as nz
from sharpattn.attention.cpu import native, tiled

MAPS = [
    n
    for n in nz.available()
    if getattr(nz.get(n).family, "kernel", None) is not None
    and nz.get(n).family.kernel.cpp
    and nz.get(n).family.kernel.tiles is not None
]


@pytest.fixture(autouse=True)
def needs_the_library():
    if native.compiler() is None:
        pytest.skip("no C++ compiler on the PATH: the loops are not built here")


@pytest.fixture
def steps(monkeypatch):
    """How many calls took `tiled._decode`."""
    count = [0]
    real = tiled._decode

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(tiled, "_decode", counted)
    return count


def test_the_maps_are_found():
    assert {"sigmoid", "relu", "softpick", "stablemax"} <= set(MAPS)


@pytest.mark.parametrize("method", MAPS)
def test_a_decoding_step_equals_the_tile_walk_and_naive(method, steps):
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
            walk = attend(low[0].requires_grad_(), *low[1:], method, causal=causal, impl="fused")
            what = f"{method} Lq={lq} Lk={lk} causal={causal} Hkv={hkv} {dtype}"
            # the same sums on the same tile (one product per key head instead of per head)
            assert_close(step, walk.detach(), dtype=dtype, n=max(lk, 8), magnitude=4.0, msg=what)
            assert_close(step, ref, dtype=dtype, n=max(lk, 8), magnitude=4.0, ulps=32, msg=what)


@pytest.mark.parametrize("layout", [x for x in layouts.LAYOUTS if x != "contiguous"])
def test_a_decoding_step_in_any_layout(layout, steps):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g) for n in (3, 40, 40))
    laid = [layouts.laid_out(t, layout, g) for t in (q, k, v)]
    plain = [t.contiguous() for t in laid]
    for method in ("sigmoid", "softpick"):
        got = attend(*laid, method, causal=True)
        assert_close(got, attend(*plain, method, causal=True), n=40, msg=f"{method} {layout}")
    assert steps[0] == 4
