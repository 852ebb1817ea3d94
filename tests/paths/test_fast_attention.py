"""Fused, chunked and naive attention paths: the same numbers, with O(n)-memory paths exact.

References are independent float64 NumPy computations of the formulas (issue 3's table and
Veličković et al. Fig. 4), on inputs that could break them: empty rows, one key, causal with
Lq != Lk (both ways), padding and per-row masks, GQA, logits of ±1e4, bfloat16.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from precision import assert_close
from sharpattn.attention import AttentionStats, MultiheadAttention, attend, causal_mask, functional
from sharpattn.attention.cpu import fused as fused_mod
from sharpattn.attention.cpu.fused import softmax_entropy
from sharpattn.attention.dispatch import fast as fast_mod
from sharpattn.attention.dispatch.fast import path_of, scores_in_range
from sharpattn.attention.masking import Masking
from sharpattn.attention.selective import query_positions
from sharpattn.normalizers import COEFFICIENTS, Normalizer, Param, available, get
from sharpattn.normalizers import _contract as contract
from sharpattn.normalizers import softmax as softmax_fn
from sharpattn.normalizers.families import Adaptive, RowScaled

pytestmark = pytest.mark.numerical

# ---------------------------------------------------------------------------------------------
# independent NumPy float64 references


def np_scores(q, k, scale):
    q, k = q.detach().double().numpy(), k.detach().double().numpy()
    g = q.shape[1] // k.shape[1]
    k = np.repeat(k, g, axis=1)
    return scale * q @ np.swapaxes(k, -1, -2)  # (B, H, Lq, Lk)


def np_allowed(shape, mask, causal):
    b, h, lq, lk = shape
    allowed = np.ones(shape, dtype=bool)
    if mask is not None:
        allowed &= np.broadcast_to(mask.numpy(), shape)
    if causal:
        i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
        allowed &= j <= i + (lk - lq)
    return allowed


def np_softmax(s, allowed):
    z = np.where(allowed, s, -np.inf)
    m = np.max(z, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(allowed, np.exp(z - m), 0.0)
    tot = e.sum(-1, keepdims=True)
    return np.where(tot > 0, e / np.where(tot > 0, tot, 1.0), 0.0)


def np_adaptive(s, allowed, coeffs=COEFFICIENTS["icml"], threshold=0.5, floor=1.0):
    p = np_softmax(s, allowed)
    h = -(p * np.log(p + 1e-9)).sum(-1, keepdims=True)
    beta = np.where(h > threshold, np.maximum(np.polyval(coeffs, h), floor), 1.0)
    return np_softmax(beta * s, allowed)


def np_output(w, v, h):
    v = v.detach().double().numpy()
    return w @ np.repeat(v, h // v.shape[1], axis=1)


def rel_err(a, b, floor=1e-3):
    """max |a − b| relative to max |b| (at least ``floor``): only to show two results DIFFER."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), floor))


def close_out(out, ref, v, **kw):
    """Attention outputs are sums over the Lk keys of terms of size ≤ max |v|."""
    lk = v.shape[-2]
    assert_close(out, ref, dtype=v.dtype, n=lk, magnitude=float(v.detach().abs().max()), **kw)


def close_grads(grads, refs, q, k, msg="", **kw):
    """Gradients: sums over keys of head-dimension dot products (n = Lk·D), each term of the
    size of the case's largest gradient (a per-tensor scale would demand exactness of a q-gradient
    that is 0 up to rounding, as with one key)."""
    mag = max(float(r.abs().max()) for r in refs)
    for i, (g, r) in enumerate(zip(grads, refs, strict=True)):
        assert torch.isfinite(g).all(), i
        assert_close(
            g,
            r,
            dtype=q.dtype,
            n=k.shape[-2] * q.shape[-1],
            magnitude=mag,
            msg=f"{msg} grad {i}",
            **kw,
        )


def make_qkv(b=2, h=4, hkv=2, lq=9, lk=12, d=8, dv=None, dtype=torch.float32, gain=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (gain * torch.randn(b, h, lq, d, generator=g, dtype=torch.float64)).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, lk, dv or d, generator=g, dtype=torch.float64).to(dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def padding_mask(b, lk, seed=1):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(b, 1, 1, lk, generator=g) > 0.35
    m[0, ..., :] = False  # batch 0: no visible key at all
    m[0, ..., 3] = True  # ... except one
    return m


def row_mask(b, h, lq, lk, seed=2):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(b, h, lq, lk, generator=g) > 0.4
    m[:, :, 0] = False  # an empty row
    return m


# (name, lq, lk, hkv, mask kind, causal)
CASES = [
    ("plain", 9, 12, 4, None, False),
    ("gqa", 9, 12, 2, None, False),
    ("causal_square", 10, 10, 2, None, True),
    ("causal_lq_gt_lk", 12, 7, 2, None, True),  # first 5 rows see nothing
    ("causal_prepend", 8, 13, 4, None, True),  # Lk − Lq <= Lq: dummy rows
    ("causal_decode", 3, 17, 2, None, True),  # Lk − Lq > Lq: explicit mask
    ("padding", 9, 12, 2, "pad", False),
    ("padding_causal", 9, 12, 1, "pad", True),
    ("row_mask_causal", 6, 11, 2, "row", True),
    ("one_key", 5, 1, 2, None, False),
]


def case_inputs(case, dtype=torch.float32, gain=1.0):
    name, lq, lk, hkv, kind, causal = case
    q, k, v = make_qkv(b=2, h=4, hkv=hkv, lq=lq, lk=lk, dtype=dtype, gain=gain)
    mask = None
    if kind == "pad":
        mask = padding_mask(2, lk)
    elif kind == "row":
        mask = row_mask(2, 4, lq, lk)
    return q, k, v, mask, causal


# ---------------------------------------------------------------------------------------------
# every registered method through every path it has


def _learnable(entry, h):
    return {
        p.name: torch.full((1, h, 1, 1), float(p.default), dtype=torch.float32).requires_grad_()
        for p in entry.learnable
    }


def _run(method, impl, q, k, v, mask, causal, params, block_size=4):
    out = attend(
        q, k, v, method, mask=mask, causal=causal, impl=impl, block_size=block_size, **params
    )
    weight = torch.cos(torch.arange(out.numel(), dtype=out.dtype).view_as(out))
    inputs = [q, k, v, *(p for p in params.values() if torch.is_tensor(p))]
    grads = torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True)
    return out, [
        torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads, strict=True)
    ]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("method", available())
def test_every_path_gives_the_naive_output_and_gradients(method, case):
    entry = get(method)
    q, k, v, mask, causal = case_inputs(case)
    params = _learnable(entry, q.shape[1])
    paths = ["chunked"] + (["fused"] if entry.fused else [])
    try:
        ref_out, ref_grads = _run(method, "naive", q, k, v, mask, causal, params)
    except ValueError:  # a method that refuses this input (e.g. causal-only) refuses it everywhere
        for impl in paths:
            with pytest.raises(ValueError):
                _run(method, impl, q, k, v, mask, causal, params)
        return
    # softpick's gradient is a difference of two terms of size |dP|·e^{s−m}/Z, Z = Σ_j |d_j|,
    # which can be << 1 (one key with s = 0.005: Z = 0.005): each path's rounding moves it by
    # ε·|dP|/Z, so the bound grows by 1/Z (the tiled path cancels exactly where naive does not)
    ulps = 8.0 * (_softpick_conditioning(q, k, mask, causal) if method == "softpick" else 1.0)
    for impl in paths:
        out, grads = _run(method, impl, q, k, v, mask, causal, params)
        close_out(out, ref_out, v, msg=impl)
        close_grads(grads, ref_grads, q, k, msg=impl, ulps=ulps)


SMALL_CAUSAL = [(lq, lk) for lq in (1, 2, 3) for lk in (1, 2, 3, 4)]


@pytest.mark.parametrize("method", available())
def test_every_path_on_every_small_causal_shape(method, monkeypatch):
    """Causal with Lq <= 3 and Lk <= 4, each combination, with no mask, a padding mask and a
    per-row mask: a query over fewer or more keys than it has rows (one query over two keys is
    a decoding step whose one dummy row is laid out like a broadcast row unless told apart),
    every path the naive one's shape and numbers, gradients included; sink also without the
    CPU kernel (what a CUDA tensor gets)."""
    entry = get(method)
    paths = ["chunked"] + (["fused"] if entry.fused else [])
    g = torch.Generator().manual_seed(3)
    for lq, lk in SMALL_CAUSAL:
        q, k, v = make_qkv(b=1, h=2, hkv=1, lq=lq, lk=lk, d=4, gain=2.0, seed=lq * 10 + lk)
        params = _learnable(entry, q.shape[1])
        pad = torch.rand(1, 1, 1, lk, generator=g) < 0.6
        pad[..., -1] = True  # every row sees the last key, so no row is empty by padding
        rows = torch.rand(1, 2, lq, lk, generator=g) < 0.6
        for mask in (None, pad, rows):
            ref_out, ref_grads = _run(method, "naive", q, k, v, mask, True, params)
            ulps = 8.0 * (_softpick_conditioning(q, k, mask, True) if method == "softpick" else 1)
            runs = [(impl, False) for impl in paths] + [("fused", True)] * (method == "sink")
            for impl, no_kernel in runs:
                with monkeypatch.context() as m:
                    if no_kernel:
                        m.setattr(fused_mod, "flash_available", lambda q, v: False)
                    out, grads = _run(method, impl, q, k, v, mask, True, params)
                msg = f"{impl}{' without the kernel' * no_kernel} {lq}x{lk}"
                assert out.shape == ref_out.shape, msg
                close_out(out, ref_out, v, msg=msg)
                close_grads(grads, ref_grads, q, k, msg=msg, ulps=ulps)


def _softpick_conditioning(q, k, mask, causal) -> float:
    """max(1, 1 / min Z) over rows with a positive score, Z = Σ_j |e^{s_j − m} − e^{−m}|."""
    s = np_scores(q, k, 1 / math.sqrt(q.shape[-1]))
    allowed = np_allowed(s.shape, mask, causal)
    m = np.maximum(np.where(allowed, s, -np.inf).max(-1, keepdims=True), 0.0)
    z = np.where(allowed, np.abs(np.exp(s - m) - np.exp(-m)), 0.0).sum(-1)
    positive = (allowed & (s > 0)).any(-1)
    return max(1.0, 1.0 / z[positive].min()) if positive.any() else 1.0


@pytest.mark.parametrize("method", available())
def test_auto_picks_fused_when_the_method_has_it(method, monkeypatch):
    entry = get(method)
    q, k, v = make_qkv(b=1, h=2, hkv=2, lq=4, lk=5)
    calls = []
    real = path_of(entry)
    assert (real is not None) == (entry.fused is not None)
    if real is not None:
        spy = lambda *a, **kw: calls.append(1) or real(*a, **kw)  # noqa: E731
        monkeypatch.setattr(functional, "path_of", lambda e: spy if e is entry else path_of(e))
    attend(q, k, v, method, causal=method == "stick_breaking")  # stick-breaking is causal only
    assert bool(calls) == (entry.fused is not None)


def plain_softmax() -> Normalizer:
    """Softmax registered without a fused path: attend() must take the naive or chunked path."""
    return Normalizer("plain_test", softmax_fn, "softmax", "-", True, fused=None)


def test_forcing_a_path_the_method_lacks_raises(register_normalizer):
    plain = register_normalizer(plain_softmax())
    q, k, v = make_qkv(lq=3, lk=4)
    with pytest.raises(ValueError, match="no fused path"):
        attend(q, k, v, plain, impl="fused")
    out = attend(q, k, v, plain, impl="chunked", block_size=2)
    close_out(out, attend(q, k, v, "softmax", impl="naive"), v)
    q, k, v = make_qkv(lq=3, lk=4)
    with pytest.raises(ValueError, match="impl must be one of"):
        attend(q, k, v, impl="flash")
    for impl in ("fused", "chunked"):
        with pytest.raises(ValueError, match="return_weights"):
            attend(q, k, v, "adaptive", impl=impl, return_weights=True)
    with pytest.raises(ValueError, match="block_size"):
        attend(q, k, v, impl="chunked", block_size=0)


# ---------------------------------------------------------------------------------------------
# adaptive temperature, streamed


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fused_adaptive_matches_numpy_reference(case):
    q, k, v, mask, causal = case_inputs(case, gain=3.0)  # gain 3: entropies across the threshold
    scale = 1 / math.sqrt(q.shape[-1])
    s = np_scores(q, k, scale)
    allowed = np_allowed(s.shape, mask, causal)
    ref = np_output(np_adaptive(s, allowed), v, q.shape[1])
    out = attend(q, k, v, "adaptive", mask=mask, causal=causal, impl="fused")
    close_out(out, ref, v)
    if not allowed.any(-1).all():
        assert (out.detach().numpy()[~allowed.any(-1)] == 0).all()  # empty rows: exactly 0


def test_streamed_entropy_against_the_reference_entropy():
    """Exact H = −Σ p·log p from lse − scale·q·Σ p·k; the reference −Σ p·log(p + 1e-9) is below it
    by Σ p·log(1 + ε/p) ∈ [0, n·ε]: largest for flat rows (p = 1/n)."""
    q, k, _ = make_qkv(b=1, h=2, hkv=2, lq=6, lk=2048, d=8, dtype=torch.float64, gain=0.0)
    with torch.no_grad():
        q[0, 0, 1:] = 4 * torch.randn(5, 8, dtype=torch.float64)  # sharp rows; row 0 flat
        q[0, 1] = torch.randn(6, 8, dtype=torch.float64)
    scale = 1 / math.sqrt(8)
    masking = Masking.build(None, False, 6, 2048, "cpu")
    h, lse = softmax_entropy(q, k, masking, scale)
    s = np_scores(q, k, scale)
    p = np_softmax(s, np.ones(s.shape, bool))
    exact = -(p * np.log(p)).sum(-1)
    ref = -(p * np.log(p + 1e-9)).sum(-1)
    n, eps = 2048, 1e-9
    # float64: lse − Σ p·s over 2048 keys of scores up to |s|
    assert_close(h.squeeze(-1), exact, n=2048, magnitude=np.abs(s).max())
    gap = exact - ref
    assert (gap >= 0).all() and (gap <= n * eps).all()
    assert gap[0, 0, 0] > 0.5 * n * eps  # the flat row comes close to the bound
    # float32: lse − Σ p·s cancels, so the error scales with the row's largest |score|
    h32, _ = softmax_entropy(q.float(), k.float(), masking, scale)
    h32 = h32.squeeze(-1)
    for idx in np.ndindex(exact.shape):
        row_mag = max(1.0, np.abs(s[idx]).max())
        assert_close(h32[idx], exact[idx], n=2048, magnitude=row_mag, msg=str(idx))


def test_fused_adaptive_gradients_gradcheck_float64():
    q, k, v = make_qkv(b=1, h=2, hkv=1, lq=4, lk=6, d=4, dtype=torch.float64, gain=2.0)
    pad = torch.tensor([True, True, False, True, True, True]).view(1, 1, 1, 6)

    def f(q, k, v):
        return attend(q, k, v, "adaptive", mask=pad, causal=True, impl="fused")

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_detach_beta_matches_naive_and_changes_the_gradient():
    q, k, v = make_qkv(gain=3.0)
    grads = {}
    for impl in ("naive", "fused", "chunked"):
        for detach in (False, True):
            out = attend(q, k, v, "adaptive", impl=impl, detach_beta=detach, block_size=3)
            grads[impl, detach] = torch.autograd.grad(out.square().sum(), q)[0]
    for impl in ("fused", "chunked"):
        for detach in (False, True):
            close_grads([grads[impl, detach]], [grads["naive", detach]], q, k)
    assert rel_err(grads["naive", True], grads["naive", False]) > 1e-3


def test_adaptive_huge_logits_and_bfloat16():
    q, k, v = make_qkv(lq=7, lk=9, gain=1.0)
    with torch.no_grad():
        q.mul_(1e4 / q.abs().max())  # scores up to ~±1e4·|k|/sqrt(d)
    ref = np_output(
        np_adaptive(np_scores(q, k, 1 / math.sqrt(8)), np.ones((2, 4, 7, 9), bool)), v, 4
    )
    out = attend(q, k, v, "adaptive", impl="fused")
    assert torch.isfinite(out).all()
    close_out(out, ref, v)
    (g,) = torch.autograd.grad(out.sum(), q)
    assert torch.isfinite(g).all()

    qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in make_qkv(gain=3.0))
    fused = attend(qb, kb, vb, "adaptive", causal=True, impl="fused")
    naive = attend(qb, kb, vb, "adaptive", causal=True, impl="naive")
    assert fused.dtype == torch.bfloat16
    close_out(fused, naive, vb)  # both bfloat16: the tolerance is bfloat16's
    (gb,) = torch.autograd.grad(fused.float().sum(), qb)
    assert torch.isfinite(gb.float()).all()


def test_fallback_without_the_private_kernel(monkeypatch):
    """Where torch lacks the flash-with-lse kernel the fused functions use query blocks."""
    q, k, v = make_qkv(gain=3.0)
    pad = padding_mask(2, 12)
    ref = {name: _run(name, "naive", q, k, v, pad, True, {}) for name in ("softmax", "adaptive")}
    sink_ref = _run_fused("sink", q, k, v, pad, True, bias=torch.tensor(0.3).requires_grad_())
    monkeypatch.setattr(fused_mod, "_FLASH", None)
    assert not fused_mod.flash_available(q, v)
    for name, (r_out, r_grads) in ref.items():
        out, grads = _run(name, "fused", q, k, v, pad, True, {})
        close_out(out, r_out, v, msg=name)
        close_grads(grads, r_grads, q, k, msg=name)
    out = _run_fused("sink", q, k, v, pad, True, bias=torch.tensor(0.3).requires_grad_())
    close_out(out[0], sink_ref[0], v, msg="sink")
    close_grads(out[1:], sink_ref[1:], q, k, msg="sink")


def test_value_size_differs_from_key_size():
    q, k, v = make_qkv(dv=5)
    for method in ("softmax", "adaptive"):
        ref = attend(q, k, v, method, causal=True, impl="naive")
        out = attend(q, k, v, method, causal=True, impl="fused")
        assert out.shape == ref.shape
        close_out(out, ref, v)


# ---------------------------------------------------------------------------------------------
# query scaling and sinks: the fused functions against issue 3's formulas


def _run_fused(name, q, k, v, mask, causal, **params):
    masking = Masking.build(mask, causal, q.shape[2], k.shape[2], q.device)
    out, _ = path_of(get(name))(q, k, v, masking, 1 / math.sqrt(q.shape[-1]), False, **params)
    inputs = [q, k, v, *(p for p in params.values() if torch.is_tensor(p))]
    grads = torch.autograd.grad(out.square().sum(), inputs)
    return [out.detach(), *grads]


def np_visible(allowed):
    return allowed.sum(-1, keepdims=True).astype(np.float64)


def np_torch_ref(fn_weights, q, k, v, mask, causal, params):
    """(output, gradients) of a float64 torch transcription of the formula, on the dense matrix."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    p64 = {n: p.detach().double().requires_grad_() for n, p in params.items()}
    g = q.shape[1] // k.shape[1]
    kk, vv = k64.repeat_interleave(g, 1), v64.repeat_interleave(g, 1)
    s = q64 @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = torch.from_numpy(np_allowed(tuple(s.shape), mask, causal))
    out = fn_weights(s, allowed, **p64) @ vv
    grads = torch.autograd.grad(out.square().sum(), [q64, k64, v64, *p64.values()])
    return [out.detach(), *grads]


def t_softmax(x, allowed):
    x = x.masked_fill(~allowed, -math.inf)
    e = torch.exp(x - x.amax(-1, keepdim=True).nan_to_num(0, 0, 0).clamp_min(-1e300))
    e = e.nan_to_num(0.0).masked_fill(~allowed, 0.0)
    return e / e.sum(-1, keepdim=True).clamp_min(1e-300)


def w_ssmax(s, allowed, s_param):  # softmax(s·log(n)·scores)
    n = allowed.sum(-1, keepdim=True).clamp_min(1)
    return t_softmax(s_param * torch.log(n.double()) * s, allowed)


def w_length_scaled(s, allowed, c):  # softmax((1 + c·log n)·scores)
    n = allowed.sum(-1, keepdim=True).clamp_min(1)
    return t_softmax((1 + c * torch.log(n.double())) * s, allowed)


def w_sink(s, allowed, bias, bias_log_n):  # exp(s_i) / (exp(b0 + b1·log n) + Σ_j exp(s_j))
    n = allowed.sum(-1, keepdim=True).clamp_min(1)
    bias = bias + bias_log_n * torch.log(n.double())
    e = torch.exp(s).masked_fill(~allowed, 0.0)
    return e / (torch.exp(bias) + e.sum(-1, keepdim=True))


def _per_head(values):
    return torch.tensor(values, dtype=torch.float32).view(1, -1, 1, 1).requires_grad_()


QS_CASES = [
    c
    for c in CASES
    if c[0]
    in (
        "gqa",
        "causal_lq_gt_lk",
        "causal_decode",
        "padding_causal",
        "row_mask_causal",
        "causal_prepend",
    )
]


@pytest.mark.parametrize("case", QS_CASES, ids=[c[0] for c in QS_CASES])
@pytest.mark.parametrize(
    "name, ref, params",
    [
        ("ssmax", w_ssmax, {"s": [0.43, 0.8, 1.2, 0.3]}),
        ("length_scaled", w_length_scaled, {"c": [0.0, 0.2, 0.5, 1.0]}),
        ("sink", w_sink, {"bias": [0.0, -1.0, 1.5, 0.5], "bias_log_n": [0.0, 0.3, 0.0, 1.0]}),
    ],
)
def test_fused_functions_match_the_issue_3_formulas(name, ref, params, case):
    q, k, v, mask, causal = case_inputs(case, gain=2.0)
    tensors = {n: _per_head(vals) for n, vals in params.items()}
    got = _run_fused(name, q, k, v, mask, causal, **tensors)
    ref_params = {("s_param" if n == "s" else n): t for n, t in tensors.items()}
    want = np_torch_ref(ref, q, k, v, mask, causal, ref_params)
    assert all(torch.isfinite(a).all() for a in got)
    close_out(got[0], want[0], v, msg=name)
    close_grads(got[1:], want[1:], q, k, msg=name)


def test_sink_gradcheck_float64():
    q, k, v = make_qkv(b=1, h=2, hkv=1, lq=5, lk=4, d=4, dtype=torch.float64)
    b = torch.tensor([0.2, -0.7], dtype=torch.float64).view(1, 2, 1, 1).requires_grad_()
    b1 = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, b, b1):
        masking = Masking.build(None, True, 5, 4, "cpu")
        return path_of(get("sink"))(q, k, v, masking, 0.5, False, bias=b, bias_log_n=b1)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, b, b1))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sink_without_the_cpu_kernel_matches_the_formula(case, monkeypatch):
    """What a CUDA tensor gets: the sink as one more key of torch's public SDPA where the masking
    allows it with O(n) memory, the query-block fallback elsewhere; both against the formula."""
    taken = []
    real = fused_mod.sink_as_key
    monkeypatch.setattr(fused_mod, "flash_available", lambda q, v: False)
    monkeypatch.setattr(fused_mod, "sink_as_key", lambda *a: taken.append(1) or real(*a))
    q, k, v, mask, causal = case_inputs(case, gain=2.0)
    params = {"bias": _per_head([0.0, -1.0, 1.5, 0.5]), "bias_log_n": _per_head([0, 0.3, 0, 1])}
    got = _run_fused("sink", q, k, v, mask, causal, **params)
    want = np_torch_ref(w_sink, q, k, v, mask, causal, params)
    fits = case[0] in (
        "plain",
        "gqa",
        "causal_square",
        "causal_lq_gt_lk",
        "causal_prepend",
        "padding",
        "one_key",
    )
    assert bool(taken) == fits
    assert all(torch.isfinite(a).all() for a in got)
    close_out(got[0], want[0], v, msg=case[0])
    close_grads(got[1:], want[1:], q, k, msg=case[0])


def test_sink_as_key_with_value_size_other_than_key_size_and_huge_bias():
    """Dv != D (the CPU kernel refuses it: this path is taken on the CPU too); a sink logit of
    1e4 takes all the mass (output 0, no NaN), as does 3e38 (b/scale overflows float32 unless
    clamped), one of −1e4 leaves softmax."""
    q, k, v = make_qkv(b=1, h=2, hkv=1, lq=6, lk=9, d=8, dv=5, gain=2.0)
    for b, ref in ((0.7, None), (1e4, "zero"), (-1e4, "softmax"), (3e38, "zero")):
        bias = torch.tensor(b)
        got = _run_fused("sink", q, k, v, None, True, bias=bias.clone().requires_grad_())
        if ref is None:
            want = np_torch_ref(w_sink, q, k, v, None, True, {"bias": bias, "bias_log_n": bias * 0})
        elif ref == "zero":
            want = [torch.zeros_like(got[0])]
        else:
            want = [attend(q, k, v, "softmax", causal=True).detach()]
        assert all(torch.isfinite(a).all() for a in got)
        close_out(got[0], want[0], v, msg=str(b))


def test_sink_as_key_gradcheck_float64():
    """SDPA's own backward through the extra key and b's column, causal with dummy rows and with
    a padding mask."""
    q, k, v = make_qkv(b=2, h=2, hkv=1, lq=4, lk=6, d=4, dtype=torch.float64)
    b = torch.tensor([0.2, -0.7], dtype=torch.float64).view(1, 2, 1, 1).requires_grad_()
    pad = torch.tensor([[True] * 6, [False, True, False, True, True, False]]).view(2, 1, 1, 6)
    for mask, causal in ((None, True), (pad, False)):
        masking = Masking.build(mask, causal, 4, 6, "cpu")
        assert fused_mod.sink_key_fits(masking)

        def f(q, k, v, b, masking=masking):
            return fused_mod.sink_as_key(q, k, v, masking, 0.5, b)

        assert torch.autograd.gradcheck(f, (q, k, v, b))


def test_softmax_per_head_temperature_and_plain_temperature():
    q, k, v = make_qkv(gain=2.0)
    theta = _per_head([0.5, 1.0, 2.0, 0.25])
    for temperature in (0.5, theta):
        ref = _run("softmax", "naive", q, k, v, None, True, {"temperature": temperature})
        out = _run("softmax", "fused", q, k, v, None, True, {"temperature": temperature})
        close_out(out[0], ref[0], v)
        close_grads(out[1], ref[1], q, k)
    with pytest.raises(ValueError, match="temperature"):
        attend(q, k, v, temperature=0.0)


# ---------------------------------------------------------------------------------------------
# extreme β: the fast paths keep their gradients at a tiny temperature, a large ssmax s,
# length_scaled c, adaptive floor and a user's β (attend takes the chunked path beyond the
# flash kernel's range, fast.scores_in_range)


def _user_grown(n, gain=1.0, **_):
    return gain * (1.0 + torch.log(n.clamp_min(1.0)))


def _user_by_entropy(h, gain=1.0, **_):
    return gain * (1.0 + h)


USER_GROWN = RowScaled(_user_grown)
USER_BY_ENTROPY = Adaptive(_user_by_entropy)
USER_BETA = {
    "user_row_scaled": Normalizer(
        "test_extreme_grown",
        USER_GROWN.weights,
        "softmax(g(1 + log n)·s)",
        "-",
        True,
        params=(Param("gain", 1.0, "g"),),
        family=USER_GROWN,
    ),
    "user_adaptive": Normalizer(
        "test_extreme_entropy",
        USER_BY_ENTROPY.weights,
        "softmax(g(1 + H)·s)",
        "-",
        True,
        params=(Param("gain", 1.0, "g"),),
        family=USER_BY_ENTROPY,
    ),
}
#: each method's parameters at β ≈ 1/t (t a temperature)
EXTREME_PARAMS = {
    "softmax": lambda t: {"temperature": t},
    "softmax_per_head": lambda t: {"temperature": _per_head([t, 2 * t])},
    "ssmax": lambda t: {"s": 0.43 / t},
    "length_scaled": lambda t: {"c": 1.0 / t},
    "adaptive": lambda t: {"floor": 1.0 / t},
    "user_row_scaled": lambda t: {"gain": 1.0 / t},
    "user_adaptive": lambda t: {"gain": 1.0 / t},
}
#: log-uniform from 1 to 1e-30, denser where the fused path hands over to the chunked one
TEMPERATURES = [1.0, 0.1, 0.03, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 1e-6, 1e-8, 1e-12, 1e-20, 1e-30]


@pytest.mark.parametrize("method", list(EXTREME_PARAMS))
def test_extreme_beta_keeps_outputs_and_gradients_on_every_path(method, register_normalizer):
    name = method.removesuffix("_per_head")
    if name in USER_BETA:
        name = register_normalizer(USER_BETA[name])
    q, k, v = make_qkv(b=1, h=2, hkv=2, lq=12, lk=12, d=8, gain=2.0)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    smax = float(np_scores(q, k, 8**-0.5).__abs__().max())
    entry = get(name)
    for t in TEMPERATURES:
        params = EXTREME_PARAMS[method](t)
        ref64 = {n: x.double() if torch.is_tensor(x) else x for n, x in params.items()}
        ref = _run_qkv(name, "naive", q64, k64, v64, ref64)
        # Any float32 path rounds s by about ε·|s|·√D, an error β multiplies: in the exponent
        # of every key but a row's largest (ε·β·|s| relative), and in dq, dk through
        # g_j − Σ p·g (rounded by ε·|g|, then times β·scale·|k|). Both vanish where β has
        # made the rows one-hot in float32 (1 − max_j p_ij below ε): there the rule is strict
        kw = dict(causal=True, impl="naive", return_weights=True, **ref64)
        weights = attend(q64, k64, v64, name, **kw)[1].detach()
        spread = float((1.0 - weights.amax(-1)).max()) / torch.finfo(torch.float32).eps
        beta = fast_mod.beta_bound(entry, {**_defaults(entry), **params}, 12)
        ulps = 8.0 * (1.0 + beta * smax * math.sqrt(8) * min(1.0, spread))
        for impl in ("auto", "chunked", "naive"):
            out, grads = _run_qkv(name, impl, q, k, v, params)
            msg = f"{method} t={t:g} {impl}"
            close_out(out, ref[0], v, msg=msg, ulps=ulps)
            close_grads(grads, ref[1], q, k, msg=msg, ulps=ulps)


def _run_qkv(name, impl, q, k, v, params):
    """`_run` with gradients for q, k and v only: a temperature's own gradient, β²·Σ p·s·…,
    leaves float32 long before β·s does (1/θ² at θ = 1e-20)."""
    params = {n: x.detach() if torch.is_tensor(x) else x for n, x in params.items()}
    out = attend(q, k, v, name, causal=True, impl=impl, block_size=4, **params)
    weight = torch.cos(torch.arange(out.numel(), dtype=out.dtype).view_as(out))
    return out, list(torch.autograd.grad((out * weight).sum(), (q, k, v)))


def _defaults(entry):
    return {p.name: p.default for p in entry.params}


def test_fused_range_decides_without_reading_a_tensor_beta_unless_checking():
    """The range test reads tensors only with check_finite: without it, a tensor β runs the
    fused path as before (tests/paths/test_no_sync.py holds it to no synchronisation)."""
    q, k, v = make_qkv(b=1, h=2, hkv=2, lq=6, lk=6, d=8)
    theta = _per_head([1.0, 1.0]).to(torch.float32)
    entry = get("softmax")
    assert scores_in_range(entry, {"temperature": theta}, q, k, 0.35, 10.0)
    assert not scores_in_range(entry, {"temperature": theta * 1e-6}, q, k, 0.35, 10.0)
    assert not scores_in_range(entry, {"temperature": 1e-30}, q, k, 0.35, 10.0)
    # a loose D·max|q|·max|k| bound alone does not send ordinary scores to the chunked path
    assert scores_in_range(entry, {"temperature": 1.0}, q, k, 0.35, 1e6)


# ---------------------------------------------------------------------------------------------
# statistics, chunking, masks, the module


@pytest.mark.parametrize("case", CASES[:8], ids=[c[0] for c in CASES[:8]])
@pytest.mark.parametrize("method", ["softmax", "adaptive"])
def test_return_stats_agree_across_paths_and_with_numpy(method, case):
    q, k, v, mask, causal = case_inputs(case, gain=3.0)
    s = np_scores(q, k, 1 / math.sqrt(q.shape[-1]))
    allowed = np_allowed(s.shape, mask, causal)
    w = np_softmax(s, allowed) if method == "softmax" else np_adaptive(s, allowed)
    ent = -(w * np.log(np.where(w > 0, w, 1.0))).sum(-1)
    _, weights, naive = attend(
        q,
        k,
        v,
        method,
        mask=mask,
        causal=causal,
        impl="naive",
        return_weights=True,
        return_stats=True,
    )
    for impl in ("naive", "chunked", "fused"):
        out, st = attend(
            q, k, v, method, mask=mask, causal=causal, impl=impl, return_stats=True, block_size=4
        )
        assert isinstance(st, AttentionStats)
        assert st.entropy.shape == st.mass.shape == st.visible.shape == q.shape[:3]
        # entropy = lse − Σ p·s: a sum over Lk keys of terms of the size of the scores
        lk, mag = s.shape[-1], max(1.0, np.abs(s).max())
        assert_close(st.entropy, ent, n=lk, magnitude=mag, msg=impl)
        assert_close(st.mass, w.sum(-1), n=lk, magnitude=1.0, msg=impl)
        assert (st.visible.numpy() == allowed.sum(-1)).all()
    assert_close(naive.mass, weights.sum(-1), n=s.shape[-1], magnitude=1.0)
    # fused extras: lse of the output logits, β, the uncorrected entropy
    beta_ref = np.ones(s.shape[:3])
    if method == "adaptive":
        p = np_softmax(s, allowed)
        h = -(p * np.log(np.where(p > 0, p, 1.0))).sum(-1)
        assert_close(st.softmax_entropy, h, n=lk, magnitude=mag)
        h_ref = -(p * np.log(p + 1e-9)).sum(-1)
        beta_ref = np.where(h_ref > 0.5, np.maximum(np.polyval(COEFFICIENTS["icml"], h_ref), 1), 1)
    # β = poly(H): H's error (above) times |dβ/dH| ≤ 5 on the entropies here
    beta_mag = 5 * mag
    assert_close(st.beta, beta_ref, dtype=q.dtype, n=lk, magnitude=beta_mag)
    logits = np.where(allowed, beta_ref[..., None] * s, -np.inf)
    with np.errstate(divide="ignore"):
        lse = np.log(np.exp(logits - logits.max(-1, keepdims=True, initial=-1e300)).sum(-1))
    lse = lse + np.where(allowed.any(-1), logits.max(-1, initial=-1e300), 0)
    lse = np.where(allowed.any(-1), lse, -np.inf)
    # lse of β·s: β's error times |s|, plus the log-sum over Lk keys
    assert_close(st.lse, lse, dtype=q.dtype, n=lk, magnitude=beta_mag * mag)


def test_sink_stats_report_the_missing_mass():
    q, k, v = make_qkv(gain=2.0)
    masking = Masking.build(padding_mask(2, 12), True, 9, 12, "cpu")
    _, st = path_of(get("sink"))(q, k, v, masking, 1 / math.sqrt(8), True, bias=0.7)
    s = np_scores(q, k, 1 / math.sqrt(8))
    allowed = np_allowed(s.shape, padding_mask(2, 12), True)
    e = np.where(allowed, np.exp(s), 0.0)
    a = e / (np.exp(0.7) + e.sum(-1, keepdims=True))
    a = np.where(allowed.any(-1, keepdims=True), a, 0.0)
    ent = -(a * np.log(np.where(a > 0, a, 1.0))).sum(-1)
    lk, mag = 12, max(1.0, np.abs(s).max())
    assert_close(st.mass, a.sum(-1), n=lk, magnitude=1.0)
    assert_close(st.leftover_mass, 1 - a.sum(-1), n=lk, magnitude=1.0)
    assert_close(st.entropy, ent, n=lk, magnitude=mag)  # a sum of p·s terms: the scores' size


@pytest.mark.parametrize("block_size", [1, 3, 5, 64])
def test_chunked_equals_unchunked(block_size):
    q, k, v, mask, causal = case_inputs(CASES[8], gain=3.0)
    for method in ("softmax", "adaptive"):
        ref, ref_g = _run(method, "naive", q, k, v, mask, causal, {})
        out, g = _run(method, "chunked", q, k, v, mask, causal, {}, block_size=block_size)
        close_out(out, ref, v, msg=method)
        close_grads(g, ref_g, q, k, msg=method)


@pytest.mark.parametrize("lq,lk", [(10, 10), (3, 10), (10, 4), (7, 1)])
def test_chunked_causal_blocks_stop_at_their_causal_edge(lq, lk):
    # keys hidden from every row of a causal query block are never scored: each block's scores
    # end at its last row's causal edge (at least one key), and the output still equals the
    # whole-matrix path, with a per-row user mask and GQA
    from sharpattn.attention.reference.chunked import run_blocks

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, lq, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, lk, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, lk, 8, generator=g, dtype=torch.float64)
    mask = row_mask(2, 4, lq, lk)
    masking = Masking.build(mask, True, lq, lk, "cpu")
    widths = []

    def weigh(scores, m, r0):
        widths.append(scores.shape[-1])
        assert m.shape[-1] == scores.shape[-1]
        return (contract.masked_softmax(scores, m.expand_as(scores)),)

    out = run_blocks(q, k, v, masking, 8**-0.5, 4, weigh)[0]
    want = [min(lk, max(1, min(r0 + 4, lq) + lk - lq)) for r0 in range(0, lq, 4)]
    assert widths == want
    ref = attend(q, k, v, mask=mask, causal=True, impl="naive")
    assert_close(out, ref, n=lk, magnitude=v.abs().max())


def test_visible_keys_count_without_the_matrix():
    for lq, lk in [(9, 12), (12, 7), (3, 17), (5, 5)]:
        for mask in (None, padding_mask(2, lk), row_mask(2, 4, lq, lk)):
            for causal in (False, True):
                m = Masking.build(mask, causal, lq, lk, "cpu")
                want = np_allowed((2, 4, lq, lk), mask, causal).sum(-1)
                got = m.visible_keys(block=2).expand(2, 4, lq, 1).squeeze(-1).numpy()
                assert (got == want).all(), (lq, lk, causal)
                dense = m.dense()
                if dense is not None:
                    assert (
                        dense.expand(2, 4, lq, lk).numpy()
                        == np_allowed((2, 4, lq, lk), mask, causal)
                    ).all()
    assert torch.equal(causal_mask(3, 5), Masking.build(None, True, 3, 5, "cpu").dense()[0, 0])


def test_one_count_of_visible_keys_for_every_caller():
    # n is counted in one place (normalizers._contract.visible_keys): attention's Masking,
    # selective's query positions and the normalizers' count of a dense mask agree with NumPy,
    # for causal masks with Lq != Lk, padding masks (one row for every query, with or without
    # the batch and head dimensions), keys broadcast and per-query masks, in float32 and float64.
    for lq, lk in [(9, 12), (12, 7), (3, 17), (5, 5), (1, 4), (0, 6)]:
        pad = padding_mask(2, lk)
        rows = row_mask(2, 4, lq, lk) if lq else torch.ones(2, 4, 0, lk, dtype=torch.bool)
        for mask in (None, pad, pad[1, 0], torch.ones(2, 1, 1, 1, dtype=torch.bool), rows):
            for causal in (False, True):
                allowed = np_allowed((2, 4, lq, lk), mask, causal)
                want = allowed.sum(-1)
                for dtype in (torch.float32, torch.float64):
                    m = Masking.build(mask, causal, lq, lk, "cpu")
                    n = m.visible_keys(block=2, dtype=dtype)
                    assert n.dtype == dtype and n.shape[-1] == 1
                    assert (n.expand(2, 4, lq, 1).squeeze(-1).numpy() == want).all(), (lq, lk)
                    dense = contract.visible_keys(torch.from_numpy(allowed), dtype=dtype)
                    assert (dense.squeeze(-1).numpy() == want).all(), (lq, lk, causal)
                q = query_positions(lq, lk, mask=mask, causal=causal)
                assert (q.expand(2, 4, lq).numpy() == want).all(), (lq, lk, causal)
    # the normalizers' scores may have any number of leading dimensions, or none
    assert contract.visible_keys(torch.tensor([True, False, True])).tolist() == [2.0]


@pytest.mark.parametrize("method", ["softmax", "adaptive"])
def test_multihead_attention_passes_impl_through(method):
    torch.manual_seed(0)
    mha = MultiheadAttention(16, 4, method, num_kv_heads=2, causal=True)
    x = torch.randn(2, 7, 16)
    key_mask = torch.ones(2, 7, dtype=torch.bool)
    key_mask[1, 5:] = False
    outs = {impl: mha(x, key_mask=key_mask, impl=impl) for impl in ("naive", "chunked", "fused")}
    for impl in ("chunked", "fused"):
        # after the output projection: a further sum over the 16 model dimensions
        assert_close(outs[impl], outs["naive"], n=7 * 16)
    outs["fused"].sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in mha.parameters())


def test_auto_runs_large_inputs_of_methods_without_a_fused_path_chunked(
    monkeypatch, register_normalizer
):
    from sharpattn.attention import functional, policy

    plain = register_normalizer(plain_softmax())
    calls = []
    real = functional.chunked_attend
    monkeypatch.setattr(
        functional, "chunked_attend", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    q, k, v = make_qkv(lq=3, lk=4)
    attend(q, k, v, plain)
    assert not calls  # small: naive
    monkeypatch.setattr(policy, "NAIVE_MAX_ELEMENTS", 8)
    out = attend(q, k, v, plain)
    assert calls
    close_out(out, attend(q, k, v), v)


def test_sink_bfloat16():
    q, k, v = make_qkv(gain=2.0)
    qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    got = _run_fused("sink", qb, kb, vb, None, True, bias=_per_head([0.0, 1.0, -1.0, 0.5]))
    want = _run_fused("sink", q, k, v, None, True, bias=_per_head([0.0, 1.0, -1.0, 0.5]))
    assert got[0].dtype == torch.bfloat16
    assert all(torch.isfinite(a.float()).all() for a in got)
    # bfloat16 against float32 from the same (rounded) inputs: bfloat16's precision
    close_out(got[0], want[0], vb)
    close_grads(got[1:], want[1:], qb, kb)


# ---------------------------------------------------------------------------------------------
# Llama 4's and Qwen's query scalings: pure β(n) factors, on the fused query-scaling path

#: (parameters, NumPy float64 β(n)): small floor_scale / train_length so that β varies across the
#: rows of every case (causal rows, padding, Lq != Lk); transcriptions of the model codes' lines
NP_QUERY_SCALINGS = {
    # transformers Llama4TextAttention: log1p(floor((position + 1) / floor_scale)) * attn_scale + 1
    "llama4_temperature": (
        {"floor_scale": 3, "attn_scale": 0.5},
        lambda n: np.log1p(np.floor(n / 3.0)) * 0.5 + 1.0,
    ),
    # Qwen modeling_qwen.py: math.log(i, seq_length) if i > seq_length else 1, i = position + 1
    "logn": (
        {"train_length": 3},
        lambda n: np.where(n > 3, np.log(np.maximum(n, 1.0)) / np.log(3.0), 1.0),
    ),
}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("method", list(NP_QUERY_SCALINGS))
def test_llama4_and_qwen_scalings_match_numpy_on_every_path(method, case):
    q, k, v, mask, causal = case_inputs(case, gain=2.0)
    params, beta = NP_QUERY_SCALINGS[method]
    assert path_of(get(method)) is not None  # auto takes the fused path: O(n) memory
    s = np_scores(q, k, 1 / math.sqrt(q.shape[-1]))
    allowed = np_allowed(s.shape, mask, causal)
    n = allowed.sum(-1, keepdims=True).astype(np.float64)
    ref = np_output(np_softmax(beta(n) * s, allowed), v, q.shape[1])
    naive_out, naive_grads = _run(method, "naive", q, k, v, mask, causal, params)
    for impl in ("naive", "chunked", "fused", "auto"):
        out, grads = _run(method, impl, q, k, v, mask, causal, params)
        # β ≤ 1.7 here: a weight's error is that of β·s, the output a sum over Lk keys of |v|
        close_out(out, ref, v, msg=impl)
        close_grads(grads, naive_grads, q, k, msg=impl)


@pytest.mark.parametrize("method", list(NP_QUERY_SCALINGS))
def test_llama4_and_qwen_scalings_are_softmax_within_their_length(method):
    # the defaults (floor_scale 8192, train_length 2048): β = 1 for every row of a 300-key causal
    # mask, so the result is softmax's bit for bit on the naive path
    q, k, v = make_qkv(b=1, h=2, hkv=2, lq=300, lk=300, dtype=torch.float64)
    got = attend(q, k, v, method, causal=True, impl="naive")
    assert torch.equal(got, attend(q, k, v, "softmax", causal=True, impl="naive"))
