"""Stick-breaking's O(n)-memory path (attention/cpu/stick_tiled.py) against the naive normalizer and
an independent float64 NumPy transcription of the product formula, with tiles small enough that
every row crosses several of them (the carries across tiles are what could go wrong)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from precision import assert_close
from sharpattn import attend, causal_mask
from sharpattn.attention.dispatch.fast import FAST
from sharpattn.attention.masking import Masking
from sharpattn.normalizers import get

pytestmark = [pytest.mark.numerical, pytest.mark.usefixtures("one_thread")]

PATH = FAST["stick_breaking"]


def qkv(b=1, h=2, hkv=2, lq=9, lk=9, d=3, dv=None, dtype=torch.float64, gain=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (gain * torch.randn(b, h, lq, d, generator=g, dtype=torch.float64)).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, lk, dv or d, generator=g, dtype=torch.float64).to(dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def tiled(q, k, v, mask=None, causal=True, blocks=(3, 4), want_stats=False, **params):
    """The fast path with small tiles (``blocks`` = rows, keys per tile)."""
    masking = Masking.build(mask, causal, q.shape[2], k.shape[2], q.device)
    scale = 1.0 / math.sqrt(q.shape[-1])
    return PATH(q, k, v, masking, scale, want_stats, blocks=blocks, **params)


def naive(q, k, v, mask=None, causal=True, **params):
    return attend(q, k, v, "stick_breaking", mask=mask, causal=causal, impl="naive", **params)


def np_stick(q, k, v, mask, causal, attend_current=False, offset=None):
    """(output, weights) in float64 from the product formula, one row at a time:
    w_ij = σ(s_ij)·Π_{j<k<c_i} (1 − σ(s_ik)) over the allowed keys, c_i = i + Lk − Lq (the
    product and the keys run to c_i itself with ``attend_current``)."""
    q, k, v = (t.detach().double().numpy() for t in (q, k, v))
    b, h, lq, d = q.shape
    lk, g = k.shape[2], h // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(d)
    allowed = np.ones(s.shape, dtype=bool)
    if mask is not None:
        allowed &= np.broadcast_to(mask.numpy(), s.shape)
    if causal:
        allowed &= np.arange(lk)[None, :] <= np.arange(lq)[:, None] + (lk - lq)
    sig = 1.0 / (1.0 + np.exp(-s))
    w = np.zeros_like(s)
    off = lk - lq if offset is None else offset
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                last = i + off if attend_current else i + off - 1  # the row's last key
                keys = [j for j in range(lk) if allowed[bi, hi, i, j] and j <= last]
                for n, j in enumerate(keys):
                    later = keys[n + 1 :]
                    w[bi, hi, i, j] = sig[bi, hi, i, j] * np.prod(1.0 - sig[bi, hi, i, later])
    return w @ v, w


def grads(out, inputs, seed=3):
    g = torch.Generator().manual_seed(seed)
    cot = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad(out, inputs, cot)


# ---------------------------------------------------------------------------------------------
# the backward: float64 gradcheck, rows crossing several tiles


def _row_mask(b, h, lq, lk, seed=5):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(b, h, lq, lk, generator=g) < 0.6
    m[:, :, lq // 2] = False  # a row that sees nothing
    return m


def _padding(b, lk, seed=6):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, 1, 1, lk, generator=g) < 0.7


# (name, lq, lk, h, hkv, mask, params)
GRADCHECK = [
    ("square", 9, 9, 2, 2, None, {}),
    ("lq_lt_lk", 6, 11, 2, 2, None, {}),
    ("lq_gt_lk", 11, 6, 2, 2, None, {}),  # the first 5 rows see nothing
    ("padding", 9, 10, 2, 2, "pad", {}),
    ("row_mask", 9, 9, 2, 2, "row", {}),
    ("gqa", 8, 9, 4, 2, None, {}),
    ("attend_current", 9, 9, 2, 1, "pad", {"attend_current": True}),
]


@pytest.mark.cpu_independent
@pytest.mark.parametrize("case", GRADCHECK, ids=[c[0] for c in GRADCHECK])
def test_gradcheck_float64(case):
    _, lq, lk, h, hkv, kind, params = case
    q, k, v = qkv(b=1, h=h, hkv=hkv, lq=lq, lk=lk, dv=2, gain=2.0)
    mask = {"pad": _padding(1, lk), "row": _row_mask(1, h, lq, lk), None: None}[kind]

    def f(q, k, v):
        return tiled(q, k, v, mask, blocks=(3, 2), **params)[0]

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# n ≈ 300: against naive and NumPy, outputs, gradients and statistics


# (name, lq, lk, h, hkv, mask, params)
LARGE = [
    ("causal_padding_gqa", 300, 300, 4, 2, "pad", {}),
    ("decode_attend_current", 230, 300, 2, 2, "row", {"attend_current": True}),
    ("lq_gt_lk", 300, 260, 2, 1, None, {}),
]


@pytest.mark.parametrize("case", LARGE, ids=[c[0] for c in LARGE])
def test_against_naive_and_numpy_at_n_300(case):
    _, lq, lk, h, hkv, kind, params = case
    mask = {"pad": _padding(1, lk), "row": _row_mask(1, h, lq, lk), None: None}[kind]
    q, k, v = qkv(b=1, h=h, hkv=hkv, lq=lq, lk=lk, d=16, dv=8, dtype=torch.float32, gain=2.0)
    out, stats = tiled(q, k, v, mask, blocks=(64, 48), want_stats=True, **params)
    assert out.dtype == torch.float32
    ref_out, w = np_stick(q, k, v, mask, True, **params)
    # weights are products of up to Lk factors whose logs are summed in one running sum (the
    # log-space cumulative sum, float32): its rounding grows with the row, so the reduction
    # length is Lk and each term is of the size of the output's (max |v|)
    vmax = float(v.detach().abs().max())
    assert_close(out, ref_out, n=lk, magnitude=vmax, msg="output vs NumPy")
    mass = w.sum(-1)
    ent = -(np.where(w > 0, w * np.log(np.where(w > 0, w, 1.0)), 0.0)).sum(-1)
    assert_close(stats.mass, mass, n=lk, magnitude=1.0, msg="mass vs NumPy")
    # −Σ w·log w: each term's log w carries the running sum's rounding (size log of the row)
    assert_close(stats.entropy, ent, n=lk, magnitude=math.log(lk), msg="entropy vs NumPy")

    # gradients against autograd of the naive normalizer in float64 (the reference)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, r_stats = naive(q64, k64, v64, mask, return_stats=True, **params)
    assert torch.equal(stats.visible, r_stats.visible.float())
    assert_close(out, ref, n=lk, magnitude=vmax, msg="output vs naive")
    ref_grads = grads(ref, (q64, k64, v64))
    got = grads(out, (q, k, v))
    mag = max(float(r.abs().max()) for r in ref_grads)
    for name, gr, r in zip("qkv", got, ref_grads, strict=True):
        # a gradient is a sum over the keys of d-sized dot products of terms up to the largest
        # gradient (as tests/paths/test_fast_attention.py's close_grads); the running sums of
        # the backward (Σ w·g from the right, D − that) add one more subtraction: 16 ulps
        assert_close(gr, r, n=lk * q.shape[-1], magnitude=mag, ulps=16, msg=f"d/d{name}")

    # the fast path in float64 equals the naive one to float64 rounding
    out64, stats64 = tiled(q64, k64, v64, mask, blocks=(64, 48), want_stats=True, **params)
    assert_close(out64, ref_out, n=lk, magnitude=vmax, msg="float64 output vs NumPy")
    assert_close(stats64.mass, mass, n=lk, magnitude=1.0, msg="float64 mass")
    assert_close(stats64.entropy, ent, n=lk, magnitude=math.log(lk), msg="float64 entropy")
    for name, gr, r in zip("qkv", grads(out64, (q64, k64, v64)), ref_grads, strict=True):
        assert_close(gr, r, n=lk * q.shape[-1], magnitude=mag, msg=f"float64 d/d{name}")


def test_attend_dispatches_here_and_agrees_with_naive():
    q, k, v = qkv(b=2, h=4, hkv=2, lq=40, lk=50, d=8, dtype=torch.float32)
    assert get("stick_breaking").fused == "stick_breaking"
    for impl in ("auto", "fused"):
        out, stats = attend(q, k, v, "stick_breaking", causal=True, impl=impl, return_stats=True)
        ref, r_stats = attend(
            q, k, v, "stick_breaking", causal=True, impl="naive", return_stats=True
        )
        vmax = float(v.detach().abs().max())
        assert_close(out, ref, n=50, magnitude=vmax, msg=impl)
        assert_close(stats.mass, r_stats.mass, n=50, msg=impl)
        assert torch.equal(stats.visible, r_stats.visible)


# ---------------------------------------------------------------------------------------------
# the causal rule, hostile input


def test_a_mask_that_sees_later_keys_raises_like_naive():
    q, k, v = qkv(lq=6, lk=6)
    later = torch.ones(6, 6, dtype=torch.bool)  # every row sees every key
    for impl in ("naive", "fused", "auto"):
        with pytest.raises(ValueError, match="causal"):
            attend(q, k, v, "stick_breaking", impl=impl)  # no mask, no causal=True
        with pytest.raises(ValueError, match="causal"):
            attend(q, k, v, "stick_breaking", mask=later, impl=impl)
        # one query after all keys (decoding): no key is after it, no causal flag needed
        attend(q[:, :, -1:], k, v, "stick_breaking", impl=impl)


def test_a_mask_inside_the_causal_one_needs_no_causal_flag():
    q, k, v = qkv(b=2, h=2, lq=7, lk=10, d=4)
    inside = causal_mask(7, 10) & _row_mask(2, 2, 7, 10)
    out = attend(q, k, v, "stick_breaking", mask=inside, impl="fused")
    ref = attend(q, k, v, "stick_breaking", mask=inside, causal=True, impl="naive")
    assert_close(out, ref, n=10)
    one_late = inside.clone()
    one_late[1, 0, 2, 9] = True  # row 2 sits at key 5
    for impl in ("naive", "fused"):
        with pytest.raises(ValueError, match="causal"):
            attend(q, k, v, "stick_breaking", mask=one_late, impl=impl)


def test_no_host_synchronisation_on_the_causal_path(monkeypatch):
    """With causal=True nothing on the path reads a tensor's value on the host (forward,
    backward, statistics): torch.compile(fullgraph=True) and GPU streams need that."""
    q, k, v = qkv(b=2, h=4, hkv=2, lq=9, lk=12, dtype=torch.float32)
    mask = _padding(2, 12)

    def refuse(*args, **kwargs):
        raise AssertionError("host synchronisation")

    for name in ("__bool__", "item", "__float__", "__int__", "nonzero", "tolist", "any", "all"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    out, stats = tiled(q, k, v, mask, causal=True, want_stats=True)
    torch.autograd.grad(out.sum(), (q, k, v))
    monkeypatch.undo()
    assert torch.isfinite(out).all() and torch.isfinite(stats.entropy).all()


@pytest.mark.parametrize("zero", ["b", "lq", "lk"])
def test_empty_inputs(zero):
    sizes = {"b": 2, "lq": 5, "lk": 6}
    sizes[zero] = 0
    q, k, v = qkv(b=sizes["b"], lq=sizes["lq"], lk=sizes["lk"], dv=4)
    out, stats = tiled(q, k, v, causal=False, want_stats=True)  # nothing to see: no error
    assert out.shape == (sizes["b"], 2, sizes["lq"], 4)
    assert bool((out == 0).all())
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
    for gr in (gq, gk, gv):
        assert gr is None or bool((gr == 0).all())
    assert bool((stats.mass == 0).all())


def test_rows_without_keys_give_zero_output_and_gradient():
    q, k, v = qkv(lq=9, lk=5)  # causal, Lq > Lk: rows 0..3 see nothing
    mask = torch.ones(1, 1, 9, 5, dtype=torch.bool)
    mask[..., 6, :] = False  # and row 6 neither
    out, stats = tiled(q, k, v, mask, want_stats=True)
    empty = [0, 1, 2, 3, 4, 6]  # row 4 sees only its own key, which it does not take
    assert bool((out[:, :, empty] == 0).all())
    (gq,) = torch.autograd.grad(out.sum(), (q,))
    assert bool((gq[:, :, empty] == 0).all())
    assert bool((stats.entropy[:, :, empty] == 0).all())


def test_huge_scores_bfloat16_and_value_size():
    # scores up to ~1e30: log σ never overflows, the carries stay finite (inputs beyond the
    # fused kernel's range go to the chunked path inside attend, so the path is called here)
    q, k, v = qkv(b=1, h=2, lq=10, lk=10, d=4, dv=7, gain=1e15)
    k.data.mul_(1e15)
    out = tiled(q, k, v)[0]
    ref = naive(q, k, v, check_finite=False)
    assert torch.isfinite(out).all()
    assert_close(out, ref, n=10)
    gr = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(not torch.isnan(t).any() for t in gr)
    # 16-bit inputs compute in float32 and return their dtype
    qb, kb, vb = qkv(b=1, h=2, lq=20, lk=20, d=8, dv=5, dtype=torch.bfloat16)
    out = tiled(qb, kb, vb, blocks=(8, 8))[0]
    assert out.dtype == torch.bfloat16 and out.shape == (1, 2, 20, 5)
    ref = naive(*(t.detach().float() for t in (qb, kb, vb)))
    assert_close(out, ref, n=20, magnitude=float(vb.detach().float().abs().max()))
    gq, gk, gv = torch.autograd.grad(out.float().sum(), (qb, kb, vb))
    assert gq.dtype == gk.dtype == gv.dtype == torch.bfloat16


def test_the_score_shift_on_every_path_equals_a_float64_loop():
    """b_i = shift + shift_log_position·log(i + 1) (a learnable per-head shift, −log i) on the
    naive, chunked and fused paths against the stick broken key by key in float64, outputs and
    gradients of q, k, v and the shift."""
    g = torch.Generator().manual_seed(7)
    b, h, n, d = 1, 2, 24, 8
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    shift = torch.tensor([0.3, -0.7], dtype=torch.float64).view(1, 2, 1, 1)
    leaves = [t.requires_grad_() for t in (q, k, v, shift)]
    s = (
        q @ k.transpose(-1, -2) / math.sqrt(d)
        + shift
        - torch.log(torch.arange(1.0, n + 1, dtype=torch.float64))[:, None]
    )
    sig = torch.sigmoid(s)
    rows = []
    for i in range(n):  # key j < i takes σ(s_ij) of what the keys j < k < i left
        left = torch.ones(b, h, dtype=torch.float64)
        w = [None] * n
        for j in range(n - 1, -1, -1):
            w[j] = sig[..., i, j] * left if j < i else torch.zeros(b, h, dtype=torch.float64)
            if j < i:
                left = left * (1 - sig[..., i, j])
        rows.append(torch.stack(w, -1))
    ref = torch.stack(rows, -2) @ v
    want = torch.autograd.grad(ref.sum(), leaves)
    for impl in ("naive", "chunked", "fused"):
        out = attend(
            q, k, v, "stick_breaking", causal=True, impl=impl, shift=shift, shift_log_position=-1.0
        )
        got = torch.autograd.grad(out.sum(), leaves)
        assert_close(out, ref.detach(), n=n, msg=impl)
        for what, a, bb in zip(("dq", "dk", "dv", "dshift"), got, want, strict=True):
            assert_close(a, bb, n=n * n, msg=f"{impl} {what}")


@pytest.mark.parametrize(("lq", "lk"), [(1, 2048), (16, 1024), (64, 1024), (200, 600)])
def test_long_rows_keep_the_gradients_within_a_few_times_the_eager_error(lq, lk):
    """dq, dk and dv of the fast path (whole rows up to 16 query rows, else tiles) in float32
    against float64, within 16× the eager float32 path's error: with q times 3 many far keys
    have σ(s) of order 1, and A_k = Σ_{j<=k} w·g is tiny there; taken as D − Σ_{j>k} w·g with
    D = dO·out in float32, it kept D's rounding, which every far key's σ(s) took again (dq's
    error grew as Lk, about 1,000× the eager error at 1k-16k keys)."""
    q, k, v = qkv(b=1, h=2, hkv=2, lq=lq, lk=lk, d=16, gain=3.0, seed=5)
    g = torch.randn(1, 2, lq, 16, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    want = torch.autograd.grad(naive(q, k, v), (q, k, v), g)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    fast = torch.autograd.grad(attend(*leaves, "stick_breaking", causal=True), leaves, g.float())
    eager = torch.autograd.grad(naive(*leaves), leaves, g.float())
    for what, a, b, w in zip(("dq", "dk", "dv"), fast, eager, want, strict=True):
        err_fast, err_eager = (a.double() - w).abs().max(), (b.double() - w).abs().max()
        floor = 1e-7 * float(w.abs().max())
        assert err_fast <= 16 * max(float(err_eager), floor), (what, err_fast, err_eager)
