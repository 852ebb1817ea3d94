"""The split-K ("flash-decoding") forward of the shared Triton template (``attention/triton/
template.py``: `key_splits`, `_split_forward`, `_combine_kernel`): a decoding call, a few query
rows against many keys, walks the keys in several programs per row block and combines their
partial sums. For every element-wise and row-normalised map with Triton kernels (from the
registry, as tests/paths/test_triton.py takes them), sigmoid's learnable bias and the softmax
kernel with its log-sum-exp: the output against the float64 naive path, and the output and the
gradients (the backward reads the combined m and Z) against the unsplit kernel; causal and not,
padding, per-row and 2-D masks, a mask that hides whole splits, GQA, Lq 1, 3 and 16; each test
checks that the split path ran. Small shapes force the split (the thresholds monkeypatched, 16
keys per block: the interpreter is slow); a few cases at 1,100-2,100 keys take the real
thresholds.

On the CPU the kernels run in Triton's interpreter, float32 and float16 (tests/conftest.py sets
``TRITON_INTERPRET=1``; the interpreter's bfloat16 products are wrong), routed there as
tests/paths/test_triton.py does (`devices.triton_ready` says yes for CPU tensors but float64).
With ``SHARPATTN_TEST_DEVICE=cuda`` the compiled kernels run, bfloat16 too.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from devices import DEVICE
from precision import assert_close
from sharpattn import normalizers as nz
from sharpattn.attention import attend
from sharpattn.attention.masking import Masking
from triton_decoding import (
    BLOCKS,
    DTYPES,
    KERNELS,
    TEMPLATE,
    copies,
    force_split,
    inputs,
    run,
    visible,
)
from triton_decoding import on_triton as route
from triton_decoding import params_of as tensors


def kernel_of(name: str):
    return getattr(nz.get(name).family, "kernel", None)


#: the element-wise and row-normalised maps with Triton kernels (tile maths of their own), as
#: tests/paths/test_triton.py derives them from the registry
MAPS = [
    n
    for n in nz.available()
    if kernel_of(n) is not None and kernel_of(n).triton and kernel_of(n).tiles is not None
]
#: each map at its defaults; sigmoid with a learnable per-head bias (the row tensor, with a
#: gradient); the softmax kernel with its log-sum-exp (``lse``: what sink and adaptive take)
METHODS = {**{n: (n, {}) for n in MAPS}, "sigmoid_bias": ("sigmoid", {"bias": "tensor"})}

#: the cases (tests/triton_decoding.py) every map runs in float32
CASES = ("lq1", "lq3_causal_pad", "lq16_causal", "lq16_rows", "lq3_2d", "lq3_hole")
#: the cases of each method in 16 bits (on the CPU the interpreter is slow; on a GPU each case
#: compiles its own kernel variants, and the GPU check's bfloat16 step has 80 s for every file);
#: every case in float32
SHORT = {
    "sigmoid": ("lq16_rows",),
    "sigmoid_bias": ("lq3_causal_pad",),
    "relu": ("lq1",),
    "power": ("lq3_hole",),
    "signed": ("lq16_causal",),
    "softpick": ("lq3_2d",),
}


@pytest.fixture
def on_triton(monkeypatch):
    """The kernels with small blocks; the split counts of the template's split forwards."""
    return route(monkeypatch, [TEMPLATE])


def params_of(name: str, h: int, dtype: torch.dtype) -> dict:
    return tensors(METHODS[name][1], h, dtype)


def _pairs():
    for name in METHODS:
        for case in CASES:
            for dtype in DTYPES:
                if dtype != torch.float32 and case not in SHORT.get(name, ("lq16_rows",)):
                    continue
                yield pytest.param(name, case, dtype, id=f"{name}-{case}-{dtype}")


@pytest.mark.parametrize(("name", "case", "dtype"), list(_pairs()))
def test_the_split_forward_equals_the_naive_path_and_the_unsplit_kernel(
    on_triton, monkeypatch, name, case, dtype
):
    """Output: against the float64 naive path on the same values (the kernels' dtype's
    tolerance over Lk terms) and against the unsplit kernel (float32 rounding: only the order
    of the sums differs); gradients, through the combined m and Z, against the unsplit
    kernel's; rows that see no key give 0 and zero dq."""
    method = METHODS[name][0]
    q, k, v, mask, causal = inputs(case, dtype)
    params = params_of(name, q.shape[1], torch.float32)
    lk = k.shape[2]
    force_split(monkeypatch)
    out, grads = run(method, q, k, v, mask, causal, params)
    assert on_triton and on_triton[-1] == math.ceil(lk / BLOCKS[1]), on_triton  # split
    force_split(monkeypatch, on=False)
    before = len(on_triton)
    (q1, k1, v1), p1 = copies(dtype, q, k, v, params)
    whole, whole_grads = run(method, q1, k1, v1, mask, causal, p1)
    assert len(on_triton) == before  # the unsplit kernel
    (q64, k64, v64), p64 = copies(torch.float64, q, k, v, params)
    ref, _ = run(method, q64, k64, v64, mask, causal, p64, naive=True)
    assert out.dtype == dtype and [g.dtype for g in grads[:3]] == [dtype] * 3
    assert_close(out, ref, n=lk, msg="out against float64")
    # float32 sums in another order; in 16 bits both are then rounded to ``dtype``: a rounding
    # apart at most
    assert_close(out, whole, n=lk if dtype == torch.float32 else 1, msg="out against unsplit")
    n = max(lk, q.shape[2] * q.shape[1] // k.shape[1])
    for what, a, b in zip(("dq", "dk", "dv", "dbias"), grads, whole_grads, strict=False):
        assert_close(a, b, n=n, msg=f"{what} against unsplit")
    empty = ~visible(mask, causal, q, k)
    assert (out[empty] == 0).all()
    assert (grads[0][empty] == 0).all()


@pytest.mark.parametrize("case", ["lq1", "lq16_rows", "lq3_hole"])
def test_the_split_softmax_kernel_with_its_log_sum_exp(on_triton, monkeypatch, case):
    """The softmax kernel that sink and adaptive take: out and lse (−inf on rows that see no
    key) against the float64 naive softmax and log-sum-exp, and out, lse and the gradients
    (through both, lse's too) against the unsplit kernel."""
    q, k, v, mask, causal = inputs(case, torch.float32)
    lq, lk = q.shape[2], k.shape[2]
    masking = Masking.build(mask, causal, lq, lk, q.device)
    scale = q.shape[-1] ** -0.5
    gen = torch.Generator().manual_seed(2)
    g_out = torch.randn(*q.shape[:3], v.shape[-1], generator=gen).to(DEVICE)
    g_lse = torch.randn(*q.shape[:3], 1, generator=gen).to(DEVICE)

    def once(leaves):
        out, lse = KERNELS.softmax_attention(*leaves, masking, scale, BLOCKS)
        seen = torch.isfinite(lse)
        loss = (out * g_out).sum() + (torch.where(seen, lse, 0.0) * g_lse).sum()
        return out.detach(), lse.detach(), torch.autograd.grad(loss, leaves)

    force_split(monkeypatch)
    out, lse, grads = once([q, k, v])
    assert on_triton and on_triton[-1] == math.ceil(lk / BLOCKS[1])
    force_split(monkeypatch, on=False)
    before = len(on_triton)
    whole, whole_lse, whole_grads = once(copies(torch.float32, q, k, v, {})[0])
    assert len(on_triton) == before
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    ref = attend(q64, k64, v64, mask=mask, causal=causal, impl="naive")
    s = q64 @ k64.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) * scale
    allowed = masking.dense()  # None: every key
    s = s if allowed is None else s.masked_fill(~allowed, -math.inf)
    want_lse = torch.logsumexp(s, -1, keepdim=True)
    assert_close(out, ref, n=lk, msg="out")
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    assert_close(lse[finite], want_lse[finite], n=lk, msg="lse")
    assert_close(out, whole, n=lk, msg="out against unsplit")
    assert torch.equal(torch.isinf(lse), torch.isinf(whole_lse))
    assert_close(lse[finite], whole_lse[finite], n=lk, msg="lse against unsplit")
    for what, a, b in zip(("dq", "dk", "dv"), grads, whole_grads, strict=True):
        assert_close(a, b, n=lk, msg=f"{what} against unsplit")


# name: (method, Lq, Lk, mask kind, causal): the real thresholds (`SPLIT_MIN_LK` = 1,024), B 1,
# H 4, Hkv 2, D 16, 32 keys per block
LONG = {
    "sigmoid-lq1": ("sigmoid", 1, 1100, None, True),
    "power-lq3": ("power", 3, 1500, "pad", False),
    "softpick-lq16": ("softpick", 16, 2100, None, True),
}


@pytest.mark.parametrize("name", LONG)
def test_decoding_shapes_split_at_the_real_thresholds(on_triton, monkeypatch, name):
    """Lk of 1,100-2,100 with the default thresholds and 32 keys per block: the forward splits
    (35-66 key blocks, 4 heads: 7-14 splits) and equals the float64 naive path; the gradients
    equal the naive path's too (float32: √Lk of its rounding)."""
    method, lq, lk, kind, causal = LONG[name]
    monkeypatch.setattr(TEMPLATE, "BLOCKS_16BIT", (16, 32))
    monkeypatch.setattr(TEMPLATE, "BLOCKS_FLOAT32", (16, 32))
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, lq, 16, generator=g)
    k, v = (torch.randn(1, 2, lk, 16, generator=g) for _ in range(2))
    mask = None if kind is None else (torch.rand(1, 1, 1, lk, generator=g) < 0.7).to(DEVICE)
    q, k, v = (t.to(DEVICE).requires_grad_() for t in (q, k, v))
    out, grads = run(method, q, k, v, mask, causal, {})
    assert on_triton and on_triton[-1] >= 7, on_triton
    (q64, k64, v64), _ = copies(torch.float64, q, k, v, {})
    ref, want = run(method, q64, k64, v64, mask, causal, {}, naive=True)
    assert_close(out, ref, n=lk, msg="out")
    for what, a, b in zip(("dq", "dk", "dv"), grads, want, strict=True):
        assert_close(a, b, n=lk, msg=what)


def test_how_many_splits():
    """`key_splits` on an H200's decoding shapes (64 keys per block): a few hundred programs,
    each split at least 4 key blocks; no split at Lq > 16, Lk < 1,024 or where B·H fills the
    GPU already."""

    def splits(b, h, lq, lk, bn=64):
        return TEMPLATE.key_splits(types.SimpleNamespace(b=b, h=h, lq=lq, lk=lk, blocks=(64, bn)))

    assert splits(1, 8, 1, 4096) == 16  # 64 blocks: 4 per split, 128 programs
    assert splits(1, 8, 16, 16384) == 32  # 256 programs of 8 blocks
    assert splits(1, 8, 1, 65536) == 32  # 256 programs of 32 blocks
    assert splits(1, 32, 1, 65536) == 8
    assert splits(1, 8, 17, 65536) == 1  # not decoding
    assert splits(1, 8, 1, 1000) == 1  # too short
    assert splits(16, 32, 1, 65536) == 1  # 512 programs already
    assert splits(1, 1, 1, 1024 + 64) == 4  # 17 blocks: splits of 5, 5, 5 and 2
    for b, h, lk in ((1, 8, 4096), (2, 16, 16384), (1, 4, 3000), (1, 1, 100_000)):
        n = splits(b, h, 1, lk)
        blocks = math.ceil(lk / 64)
        per = math.ceil(blocks / n)
        assert per >= TEMPLATE.SPLIT_MIN_BLOCKS and (n - 1) * per < blocks  # none empty
        assert b * h * n <= 2 * TEMPLATE.SPLIT_PROGRAMS
