"""Stick-breaking's whole-row path for decoding (attention/cpu/stick_tiled.py, `_rows_forward`,
`_rows_backward`): a few query rows (at most ``DECODE_ROWS``) over every key they see, keys in
their own order, in the C++ loops (``native.stick_forward_rows``/``stick_backward_rows``,
float32) or in PyTorch (float64, user masks, ``SHARPATTN_COMPILE=0``). Held against the naive
normalizer in float64, against the tile walk (``blocks`` given), and to gradcheck."""

from __future__ import annotations

import math

import pytest
import torch

from precision import assert_close
from sharpattn import attend
from sharpattn.attention.cpu import native, stick_tiled
from sharpattn.attention.dispatch.fast import FAST
from sharpattn.attention.masking import Masking

pytestmark = [pytest.mark.numerical, pytest.mark.usefixtures("one_thread")]

PATH = FAST["stick_breaking"]


@pytest.fixture(autouse=True)
def rows_at_any_length(monkeypatch):
    """The whole-row path on the short caches here too (it starts at `DECODE_MIN_KEYS`)."""
    monkeypatch.setattr(stick_tiled, "DECODE_MIN_KEYS", 1)


def qkv(b=1, h=2, hkv=2, lq=3, lk=9, d=4, dv=3, dtype=torch.float64, gain=2.0, seed=0, t=False):
    """q, k, v requiring grad; ``t``: laid out ``[B, L, H, D]`` and transposed (not contiguous)."""
    g = torch.Generator().manual_seed(seed)

    def make(heads, n, dd, mult=1.0):
        if t:
            x = torch.randn(b, n, heads, dd, generator=g, dtype=torch.float64).transpose(1, 2)
        else:
            x = torch.randn(b, heads, n, dd, generator=g, dtype=torch.float64)
        return (mult * x).to(dtype).detach().requires_grad_()

    return make(h, lq, d, gain), make(hkv, lk, d), make(hkv, lk, dv)


def fast(q, k, v, mask=None, blocks=None, want_stats=False, **params):
    masking = Masking.build(mask, True, q.shape[2], k.shape[2], q.device)
    return PATH(q, k, v, masking, q.shape[-1] ** -0.5, want_stats, blocks=blocks, **params)


def naive(q, k, v, mask=None, **params):
    out, stats = attend(
        q, k, v, "stick_breaking", mask=mask, causal=True, impl="naive", return_stats=True, **params
    )
    return out, stats


def masks(kind, b, h, lq, lk, seed=3):
    g = torch.Generator().manual_seed(seed)
    if kind == "pad":  # padding of the keys, one row per batch entry
        return torch.rand(b, 1, 1, lk, generator=g) < 0.7
    if kind == "row":  # a mask per head and query, one row seeing nothing
        m = torch.rand(b, h, lq, lk, generator=g) < 0.6
        m[:, :, lq // 2] = False
        return m
    return None


def grads(out, xs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.autograd.grad(out, xs, g.to(out.dtype))


def counting(monkeypatch, name, owner=native):
    """The calls of ``owner.name`` from now on (one entry each)."""
    calls = []
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


# ---------------------------------------------------------------------------------------------
# gradcheck of the new backward (float64: the PyTorch formulas of the whole-row path)

# (name, lq, lk, h, hkv, mask, params)
GRADCHECK = [
    ("one_row", 1, 9, 2, 2, None, {}),
    ("rows", 4, 9, 2, 2, None, {}),
    ("lq_gt_lk", 6, 4, 2, 2, None, {}),  # the first rows see nothing
    ("padding", 3, 10, 2, 2, "pad", {}),
    ("row_mask", 4, 8, 2, 2, "row", {}),
    ("gqa_current", 3, 9, 4, 2, None, {"attend_current": True}),
    ("offset_shift", 3, 9, 2, 1, "pad", {"query_offset": 4, "shift": 0.5}),
]


@pytest.mark.cpu_independent
@pytest.mark.parametrize("case", GRADCHECK, ids=[c[0] for c in GRADCHECK])
def test_gradcheck_float64(case):
    _, lq, lk, h, hkv, kind, params = case
    q, k, v = qkv(h=h, hkv=hkv, lq=lq, lk=lk)
    mask = masks(kind, 1, h, lq, lk)
    if params.get("query_offset") is not None:  # inside the offset's causal rule too
        allowed = torch.arange(lk) <= torch.arange(lq).unsqueeze(-1) + params["query_offset"] - 1
        mask = allowed if mask is None else mask & allowed

    def f(q, k, v):
        return fast(q, k, v, mask, **params)[0]

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# against the naive path in float64, and the whole-row path against the tiles


@pytest.mark.parametrize("attend_current", [False, True], ids=["before", "current"])
@pytest.mark.parametrize("kind", [None, "pad", "row"], ids=["causal", "padding", "row_mask"])
@pytest.mark.parametrize("lq,lk", [(1, 300), (2, 37), (7, 300), (16, 120), (16, 5)])
def test_float64_equals_naive_and_the_tiles(lq, lk, kind, attend_current):
    b, h, hkv = 2, 4, 2
    q, k, v = qkv(b=b, h=h, hkv=hkv, lq=lq, lk=lk, d=8, dv=5, t=(lq == 7))
    mask = masks(kind, b, h, lq, lk)
    out, st = fast(q, k, v, mask, want_stats=True, attend_current=attend_current)
    ref, r_st = naive(q, k, v, mask, attend_current=attend_current)
    vmax = float(v.detach().abs().max())
    assert_close(out, ref, n=lk, magnitude=vmax, msg="output")
    assert_close(st.mass, r_st.mass, n=lk, magnitude=1.0, msg="mass")
    assert_close(st.entropy, r_st.entropy, n=lk, magnitude=math.log(lk + 1), msg="entropy")
    assert torch.equal(st.visible, r_st.visible)
    got, want = grads(out, (q, k, v)), grads(ref, (q, k, v))
    mag = max(float(r.abs().max()) for r in want)
    for name, g_, r in zip("qkv", got, want, strict=True):
        assert_close(g_, r, n=lk * q.shape[-1], magnitude=mag, msg=f"d/d{name}")
    # the tile walk (tiny tiles, several per row) gives the same
    tiles, t_st = fast(q, k, v, mask, blocks=(3, 8), want_stats=True, attend_current=attend_current)
    assert_close(out, tiles, n=lk, magnitude=vmax, msg="rows vs tiles")
    assert_close(st.entropy, t_st.entropy, n=lk, magnitude=math.log(lk + 1), msg="tiles entropy")
    for name, g_, r in zip("qkv", got, grads(tiles, (q, k, v)), strict=True):
        assert_close(g_, r, n=lk * q.shape[-1], magnitude=mag, msg=f"tiles d/d{name}")


# ---------------------------------------------------------------------------------------------
# float32: the C++ loops on whole rows, against naive float64 and the PyTorch rows


@pytest.mark.parametrize("attend_current", [False, True], ids=["before", "current"])
@pytest.mark.parametrize(
    "lq,lk,h,hkv,t",
    [(1, 300, 4, 2, False), (16, 300, 2, 2, True), (16, 9, 2, 1, False), (5, 64, 4, 4, False)],
    ids=["one_row_gqa", "sixteen_transposed", "lq_gt_lk", "five"],
)
def test_float32_loops_against_naive_and_pytorch(monkeypatch, lq, lk, h, hkv, t, attend_current):
    if not native.wanted(torch.device("cpu"), torch.float32):
        pytest.skip("no C++ loops here")
    q, k, v = qkv(b=2, h=h, hkv=hkv, lq=lq, lk=lk, d=16, dv=8, dtype=torch.float32, t=t)
    results = []
    for mode in ("auto", "0"):
        monkeypatch.setenv("SHARPATTN_COMPILE", mode)
        forward = counting(monkeypatch, "stick_forward_rows")
        backward = counting(monkeypatch, "stick_backward_rows")
        tiles = counting(monkeypatch, "stick_forward")
        out, st = fast(q, k, v, want_stats=True, attend_current=attend_current)
        results.append((out, st.entropy, st.mass, *grads(out, (q, k, v))))
        assert (len(forward), len(backward)) == ((1, 1) if mode == "auto" else (0, 0))
        assert not tiles
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, r_st = naive(q64, k64, v64, attend_current=attend_current)
    want = grads(ref, (q64, k64, v64))
    vmax = float(v.detach().abs().max())
    mag = max(float(r.abs().max()) for r in want)
    for res in results:
        out, ent, mass, *got = res
        # the log-space running sum over a row's keys in float32 (as test_stick_tiled's n = 300)
        assert_close(out, ref, n=lk, magnitude=vmax, msg="output")
        assert_close(mass, r_st.mass, n=lk, magnitude=1.0, msg="mass")
        assert_close(ent, r_st.entropy, n=lk, magnitude=math.log(lk + 1), msg="entropy")
        for name, g_, r in zip("qkv", got, want, strict=True):
            # the backward's second running sum, D − Σ w·g: 16 ulps (as test_stick_tiled)
            assert_close(g_, r, n=lk * q.shape[-1], magnitude=mag, ulps=16, msg=f"d/d{name}")
    for got, want_ in zip(results[0], results[1], strict=True):
        assert_close(got, want_, n=lk, ulps=16, msg="loops vs PyTorch")


def test_sixteen_bit_inputs_compute_in_float32():
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = qkv(b=1, h=4, hkv=2, lq=3, lk=200, d=16, dv=8, dtype=dtype)
        out, _ = fast(q, k, v)
        assert out.dtype == dtype
        q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
        ref, _ = fast(q32, k32, v32)
        assert_close(out, ref, dtype=dtype, magnitude=float(v32.detach().abs().max()))
        dq, dk, dv = grads(out, (q, k, v))
        assert dq.dtype == dk.dtype == dv.dtype == dtype
        for g_, r in zip((dq, dk, dv), grads(ref, (q32, k32, v32)), strict=True):
            assert_close(g_, r, dtype=dtype, n=200, magnitude=float(r.abs().max()))


# ---------------------------------------------------------------------------------------------
# dispatch and chunks


def test_decoding_takes_whole_rows_and_the_rest_takes_tiles(monkeypatch):
    if not native.wanted(torch.device("cpu"), torch.float32):
        pytest.skip("no C++ loops here")
    monkeypatch.undo()  # the real DECODE_MIN_KEYS
    rows, tiles = (
        counting(monkeypatch, "stick_forward_rows"),
        counting(monkeypatch, "stick_forward"),
    )
    top, lk = stick_tiled.DECODE_ROWS, stick_tiled.DECODE_MIN_KEYS
    for lq, keys, blocks, want in [
        (1, lk, None, "rows"),
        (top, 4 * lk, None, "rows"),
        (top + 1, 4 * lk, None, "tiles"),
        (1, lk - 1, None, "tiles"),  # a short cache: one small tile either way
        (1, 4 * lk, (4, 16), "tiles"),  # tiles asked for
    ]:
        n_rows, n_tiles = len(rows), len(tiles)
        q, k, v = qkv(lq=lq, lk=keys, dtype=torch.float32)
        if blocks is None:
            attend(q, k, v, "stick_breaking", causal=True, check_finite=False)
        else:
            fast(q, k, v, blocks=blocks)
        took = "rows" if len(rows) > n_rows else "tiles" if len(tiles) > n_tiles else None
        assert took == want, (lq, keys, blocks)


@pytest.mark.parametrize("kind", [None, "pad", "row"], ids=["causal", "padding", "row_mask"])
def test_chunks_over_batch_and_heads_equal_one_chunk(monkeypatch, kind):
    b, h, hkv, lq, lk = 2, 6, 3, 4, 50
    mask = masks(kind, b, h, lq, lk)
    for dtype in (torch.float64, torch.float32):
        q, k, v = qkv(b=b, h=h, hkv=hkv, lq=lq, lk=lk, dtype=dtype)
        whole, w_st = fast(q, k, v, mask, want_stats=True)
        want = grads(whole, (q, k, v))
        # two key heads' rows a chunk: (b0, heads 0-1), (b0, head 2), (b1, heads 0-1), ...
        with monkeypatch.context() as m:
            m.setattr(stick_tiled, "DECODE_ELEMENTS", 2 * (h // hkv) * lq * lk)
            calls = counting(m, "matmul", torch)
            out, st = fast(q, k, v, mask, want_stats=True)
            assert len(calls) == 2 * 4  # q·kᵀ and w·v in each of the 4 chunks
            got = grads(out, (q, k, v))
            assert len(calls) == 7 * 4  # and 5 products a chunk in the backward
        # the same sums per row; the products differ only in how many heads a call holds
        chunked, one = (out, st.entropy, st.mass, *got), (whole, w_st.entropy, w_st.mass, *want)
        for x, y in zip(chunked, one, strict=True):
            assert_close(x, y, n=lk)
