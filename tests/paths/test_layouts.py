"""Every method on every path takes q, k, v (and masks) in any memory layout (tests/layouts.py):
the answer and the gradients equal those of the same call on contiguous copies, in every dtype.

Real model code hands attention heads-last views, transposed keys and expanded tensors; the
private CPU flash kernel misread a non-contiguous last dimension, silently (errors 0.6-27),
until the fused paths copied such tensors. The adversarial suite draws layouts too
(tests/contract/test_adversarial.py); this file tries each one on each tensor, deterministically.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import layouts
from precision import assert_close
from sharpattn import attend
from sharpattn import normalizers as nz

pytestmark = pytest.mark.numerical

METHODS = nz.available()
LAID_OUT = [name for name in layouts.LAYOUTS if name != "contiguous"]


def _paths(method):
    return ("naive", "chunked", "fused", "auto") if nz.get(method).fused else ("naive", "chunked")


def _run(method, impl, q, k, v, mask, causal):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v, method, mask=mask, causal=causal, impl=impl, block_size=3)
    cot = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape).to(out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), cot, allow_unused=True)
    pairs = zip((q, k, v), grads, strict=True)
    return out.detach(), [torch.zeros_like(t) if g is None else g for t, g in pairs]


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 5, 6, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 7, 6, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 7, 6, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v)], g


def _same(got, ref, dtype, what):
    out, grads = got
    r_out, r_grads = ref
    # the same path on the same values: only the order of a few sums may differ
    assert_close(out, r_out, dtype=dtype, n=7, magnitude=3.0, ulps=16, msg=f"{what} output")
    for name, gr, r_gr in zip("qkv", grads, r_grads, strict=True):
        assert_close(gr, r_gr, dtype=dtype, n=7, magnitude=30.0, ulps=16, msg=f"{what} d/d{name}")


@pytest.mark.parametrize("method", METHODS)
def test_every_layout_of_q_k_v_gives_the_contiguous_answer(method):
    causal_only = method == "stick_breaking"
    for dtype, causal in ((torch.float32, False), (torch.float64, True)):
        causal = causal or causal_only
        (q, k, v), g = _inputs(dtype)
        for impl, which, layout in itertools.product(_paths(method), range(3), LAID_OUT):
            args = [q, k, v]
            args[which] = layouts.laid_out(args[which], layout, g)
            what = f"{method} {impl} {dtype} causal={causal} {'qkv'[which]} {layout}"
            ref = _run(method, impl, *(a.contiguous() for a in args), None, causal)
            _same(_run(method, impl, *args, None, causal), ref, dtype, what)


@pytest.mark.parametrize("method", [m for m in METHODS if nz.get(m).fused])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_non_contiguous_last_dimension_in_16_bit(method, dtype):
    (q, k, v), g = _inputs(dtype, seed=1)
    causal = True
    for impl, which, layout in itertools.product(
        ("fused", "naive"), range(3), ("d_major", "sliced")
    ):
        args = [q, k, v]
        args[which] = layouts.laid_out(args[which], layout, g)
        ref = _run(method, impl, *(a.contiguous() for a in args), None, causal)
        _same(
            _run(method, impl, *args, None, causal), ref, dtype, f"{impl} {'qkv'[which]} {layout}"
        )


@pytest.mark.parametrize("method", METHODS)
def test_masks_in_any_layout(method):
    (q, k, v), g = _inputs(torch.float32, seed=2)
    mask = torch.rand(2, 4, 5, 7, generator=g) < 0.7
    views = {
        "transposed": mask.transpose(-1, -2).contiguous().transpose(-1, -2),
        "expanded": mask[:1, :1].expand(2, 4, 5, 7),
        "sliced": torch.stack([mask, ~mask], -1)[..., 0],
    }
    causal = method == "stick_breaking"
    for impl, (name, m) in itertools.product(_paths(method), views.items()):
        ref = _run(method, impl, q, k, v, m.contiguous(), causal)
        _same(_run(method, impl, q, k, v, m, causal), ref, torch.float32, f"{impl} mask {name}")


def test_the_transposed_key_reproducer_gives_zero():
    torch.manual_seed(0)
    q = torch.randn(1, 1, 4, 8)
    k = torch.randn(1, 1, 8, 4).transpose(-1, -2)
    v = torch.randn(1, 1, 4, 8)
    for impl in ("auto", "fused", "chunked", "naive"):
        assert torch.equal(attend(q, k, v, impl=impl), attend(q, k.contiguous(), v, impl=impl))


@pytest.mark.parametrize("method", METHODS)
def test_inference_tensors_and_tensors_that_need_grad_in_part(method):
    """Tensors made under ``torch.inference_mode``, a call inside it, and only one of q, k, v
    requiring grad: the answer of plain tensors, and a gradient for the one that asked."""
    causal = True
    with torch.inference_mode():
        (qi, ki, vi), _ = _inputs(torch.float32, seed=3)
    (q, k, v), _ = _inputs(torch.float32, seed=3)
    for impl in _paths(method):
        ref = attend(q, k, v, method, causal=causal, impl=impl)
        assert torch.equal(attend(qi, ki, vi, method, causal=causal, impl=impl), ref), impl
        with torch.inference_mode():
            assert torch.equal(attend(q, k, v, method, causal=causal, impl=impl), ref), impl
        for which in range(3):
            args = [t.detach() for t in (q, k, v)]
            args[which].requires_grad_()
            out = attend(*args, method, causal=causal, impl=impl)
            if not out.requires_grad:  # hardmax: piecewise constant in q and k
                assert method == "hardmax" and which < 2, (impl, which)
                continue
            (grad,) = torch.autograd.grad(out.sum(), args[which])
            assert bool(torch.isfinite(grad).all()), (impl, which)


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64, torch.bool, torch.float8_e4m3fn])
def test_q_k_v_of_a_dtype_attention_does_not_take_are_refused_in_one_sentence(dtype):
    q = torch.ones(1, 1, 2, 4).to(dtype)
    for impl in ("auto", "naive", "chunked"):
        with pytest.raises(ValueError, match=r"takes float16, bfloat16, float32 or float64"):
            attend(q, q, q, impl=impl)
