"""The split-K decoding forward of the Triton kernels whose rows need the whole cache: stick-
breaking (its reverse scan: each split's own stick, combined from the nearest split back,
``attention/triton/stick.py``), top-k and hardmax (the k largest over every split, ``topk.py``)
and the entmax family (the threshold τ over every split, ``sparse.py``). A decoding call, a few
query rows against many keys, walks the keys in several programs per row block; the output
equals the float64 naive path and the unsplit kernel, and the gradients (the backward reads
what the split forward stored) equal the unsplit kernel's. Causal and not, padding, per-row and
2-D masks, a mask that hides whole splits, GQA, Lq 1, 3 and 16; each test checks that the split
ran. Small shapes force the split (the thresholds monkeypatched, 16 keys per block: the
interpreter is slow); a few cases at 1,100-2,100 keys take the real thresholds.

On the CPU the kernels run in Triton's interpreter, float32 and float16 (tests/conftest.py sets
``TRITON_INTERPRET=1``), routed there as tests/paths/test_triton.py does. With
``SHARPATTN_TEST_DEVICE=cuda`` the compiled kernels run, bfloat16 too.
"""

from __future__ import annotations

import math

import pytest
import torch

from devices import DEVICE
from precision import assert_close
from triton_decoding import (
    BLOCKS,
    CASES,
    DTYPES,
    SPARSE,
    STICK,
    TEMPLATE,
    TOPK,
    copies,
    force_split,
    inputs,
    run,
    visible,
)
from triton_decoding import on_triton as route
from triton_decoding import params_of as tensors

#: method: (registry name, parameters, the module whose `_split_forward` runs)
METHODS = {
    "stick_breaking": ("stick_breaking", {}, STICK),
    "topk": ("topk", {"top_k": 5}, TOPK),
    "topk_wide": ("topk", {"top_k": 20}, TOPK),  # a list of 32: wider than a key block
    "hardmax": ("hardmax", {}, TOPK),
    "sparsemax": ("sparsemax", {}, SPARSE),
    "entmax15": ("entmax15", {}, SPARSE),
    "entmax": ("entmax", {"alpha": 1.3}, SPARSE),  # e = 1/(α − 1) not an integer
    "asentmax": ("asentmax", {"beta_pre": "tensor"}, SPARSE),  # θ per head, learnable
    "entmax_heads": ("entmax", {"alpha": "tensor"}, SPARSE),  # α per head, learnable
}
#: methods that refuse a query seeing past its own position: every case causal
CAUSAL_ONLY = {"stick_breaking"}
#: the 16-bit case of each method (the interpreter is slow); every case in float32 but where
#: ``ONLY`` names fewer
SHORT = {"stick_breaking": "lq16_rows", "topk": "lq3_hole", "hardmax": "lq1", "topk_wide": ""}
ONLY = {
    "stick_breaking": tuple(c for c in CASES if c != "lq3_ties"),
    "topk": ("lq1", "lq3_causal_pad", "lq16_rows", "lq3_hole", "lq3_ties", "lq3_layout"),
    "topk_wide": ("lq3_ties",),
    "hardmax": ("lq1", "lq16_rows", "lq3_ties"),
    "entmax_heads": ("lq1", "lq3_causal_pad", "lq3_hole", "lq3_ties"),
    "asentmax": ("lq1", "lq16_rows", "lq3_2d"),
    "entmax": tuple(c for c in CASES if c != "lq3_layout"),
}


@pytest.fixture
def on_triton(monkeypatch):
    """The kernels with small blocks; the split counts of every split forward that ran."""
    return route(monkeypatch, {m for *_, m in METHODS.values()})


def params_of(name: str, h: int, dtype: torch.dtype) -> dict:
    return tensors(METHODS[name][1], h, dtype)


def _pairs():
    """Every case of ``ONLY`` (or all) in float32 and the ``SHORT`` one in 16 bits; on a GPU
    (each case compiles kernels of its own) the ``SHORT`` one in every dtype."""
    for name in METHODS:
        cases = ONLY.get(name, CASES)
        if DEVICE.type == "cuda":
            cases = (SHORT.get(name) or cases[0],)
        for case in cases:
            for dtype in DTYPES:
                if (
                    dtype != torch.float32
                    and case != SHORT.get(name, "lq16_rows")
                    and DEVICE.type != "cuda"
                ):
                    continue
                yield pytest.param(name, case, dtype, id=f"{name}-{case}-{dtype}")


@pytest.mark.parametrize(("name", "case", "dtype"), list(_pairs()))
def test_the_split_forward_equals_the_naive_path_and_the_unsplit_kernel(
    on_triton, monkeypatch, name, case, dtype
):
    """Output: against the float64 naive path on the same values (the dtype's tolerance over
    Lk terms) and against the unsplit kernel (float32 rounding: the order of the sums differs);
    gradients against the unsplit kernel's; rows that see no key give 0 and zero dq."""
    method = METHODS[name][0]
    q, k, v, mask, causal = inputs(case, dtype)
    causal = causal or method in CAUSAL_ONLY
    params = params_of(name, q.shape[1], torch.float32)
    lk = k.shape[2]
    force_split(monkeypatch)
    out, grads = run(method, q, k, v, mask, causal, params)
    # a split per key block (top-k's block is as wide as its list at least)
    width = max(BLOCKS[1], 2 ** math.ceil(math.log2(max(2, params.get("top_k", 1)))))
    assert on_triton and on_triton[-1] == math.ceil(lk / width), on_triton
    force_split(monkeypatch, on=False)
    before = len(on_triton)
    (q1, k1, v1), p1 = copies(dtype, q, k, v, params)
    whole, whole_grads = run(method, q1, k1, v1, mask, causal, p1)
    assert len(on_triton) == before  # the unsplit kernel
    (q64, k64, v64), p64 = copies(torch.float64, q, k, v, params)
    ref, _ = run(method, q64, k64, v64, mask, causal, p64, naive=True)
    assert out.dtype == dtype and [g.dtype for g in grads[:3]] == [dtype] * 3
    assert_close(out, ref, n=lk, msg="out against float64")
    assert_close(out, whole, n=lk if dtype == torch.float32 else 1, msg="out against unsplit")
    n = max(lk, q.shape[2] * q.shape[1] // k.shape[1])
    for what, a, b in zip(("dq", "dk", "dv", "dparam"), grads, whole_grads, strict=False):
        assert_close(a, b, n=n, msg=f"{what} against unsplit")
    empty = ~visible(mask, causal, q, k)
    assert (out[empty] == 0).all()
    assert (grads[0][empty] == 0).all()


# name: (method, Lq, Lk, mask kind, causal): the real thresholds (`SPLIT_MIN_LK` = 1,024), B 1,
# H 4, Hkv 2, D 16, 32 keys per block, q times 3 (sharper rows: top-k's and entmax's supports
# a few keys, stick-breaking's weight on the nearest ones)
LONG = {
    "stick_breaking-lq1": ("stick_breaking", 1, 1100, None, True),
    "topk-lq3": ("topk", 3, 1500, "pad", False),
    "entmax15-lq16": ("entmax15", 16, 2100, None, True),
}


@pytest.mark.parametrize("name", LONG)
def test_decoding_shapes_split_at_the_real_thresholds(on_triton, monkeypatch, name):
    """Lk of 1,100-2,100 with the default thresholds and 32 keys per block: the forward splits
    (35-66 key blocks, 4 heads: 7-14 splits) and equals the float64 naive path, gradients
    too (float32: √Lk of its rounding)."""
    method, lq, lk, kind, causal = LONG[name]
    for attr in ("BLOCKS_16BIT", "BLOCKS_FLOAT32"):
        monkeypatch.setattr(TEMPLATE, attr, (16, 32))
    g = torch.Generator().manual_seed(4)
    q = 3 * torch.randn(1, 4, lq, 16, generator=g)
    k, v = (torch.randn(1, 2, lk, 16, generator=g) for _ in range(2))
    mask = None if kind is None else (torch.rand(1, 1, 1, lk, generator=g) < 0.7).to(DEVICE)
    q, k, v = (t.to(DEVICE).requires_grad_() for t in (q, k, v))
    out, grads = run(method, q, k, v, mask, causal, {}, blocks=(16, 32))
    assert on_triton and on_triton[-1] >= 7, on_triton
    (q64, k64, v64), _ = copies(torch.float64, q, k, v, {})
    ref, want = run(method, q64, k64, v64, mask, causal, {}, naive=True)
    assert_close(out, ref, n=lk, msg="out")
    for what, a, b in zip(("dq", "dk", "dv"), grads, want, strict=True):
        assert_close(a, b, n=lk, msg=what)


def test_a_split_call_is_one_query_block():
    """The top-k and entmax split forwards write the block support with `SPLIT_BLOCK_M` rows a
    query block and the backward reads it with its own: both are one block only while a split
    call has at most `SPLIT_BLOCK_M` rows (and every block of the backward at least 16)."""
    assert TEMPLATE.SPLIT_MAX_LQ <= TEMPLATE.SPLIT_BLOCK_M
    assert min(TEMPLATE.BLOCKS_16BIT + TEMPLATE.BLOCKS_FLOAT32) >= 16
