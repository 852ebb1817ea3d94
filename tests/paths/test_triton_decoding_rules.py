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

pytest.importorskip("triton", reason="the Triton kernels need triton (the gpu or dev extra)")

from sharpattn import normalizers as nz  # noqa: E402
from sharpattn.attention import attend, devices  # noqa: E402
from sharpattn.attention.dispatch.fast import path_of  # noqa: E402
from sharpattn.attention.masking import Masking  # noqa: E402
from sharpattn.attention.triton import sparse as SPARSE  # noqa: E402
from sharpattn.attention.triton import stick as STICK  # noqa: E402
from sharpattn.attention.triton import template as TEMPLATE  # noqa: E402
from sharpattn.attention.triton import topk as TOPK  # noqa: E402

if DEVICE.type == "cpu" and type(TEMPLATE._forward_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it)",
        allow_module_level=True,
    )
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
BLOCKS = (16, 16)  # query rows, keys per block: a split per block

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
#: the per-head values of the tensor parameters (the first H of them)
TENSORS = {"alpha": [1.2, 2.0, 1.5, 2.4], "beta_pre": [0.3, -0.5, 1.2, 0.0]}

# name: (B, H, Hkv, Lq, Lk, D, Dv, mask, causal)
CASES = {
    "lq1": (1, 4, 2, 1, 70, 8, 5, None, False),  # GQA, Dv != D, a last block of 6 keys
    "lq3_causal_pad": (2, 4, 2, 3, 61, 8, 5, "pad", True),  # batch 1 all padding: empty rows
    "lq16_causal": (1, 2, 2, 16, 40, 16, 16, None, True),  # the last split: rows >= 8 only
    "lq16_rows": (1, 4, 2, 16, 50, 8, 5, "rows", True),  # row 4 empty
    "lq3_2d": (1, 2, 1, 3, 64, 8, 12, "2d", False),
    "lq3_hole": (1, 2, 2, 3, 64, 8, 5, "hole", False),  # keys 16-47 hidden: whole splits empty
    # 4 keys repeated: every score tied 16 times, 4 times in each split of 16 keys, so the top
    # k's ties at τ span splits and are taken in key order
    "lq3_ties": (1, 2, 2, 3, 64, 8, 5, "ties", False),
    # q, k and v as [B, L, H, D] memory seen as [B, H, L, D] (no unit stride along L)
    "lq3_layout": (1, 4, 2, 3, 64, 8, 8, "layout", True),
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


def inputs(case: str, dtype: torch.dtype, seed: int = 0):
    """(q, k, v, mask, causal) in ``dtype``, leaves requiring grad."""
    b, h, hkv, lq, lk, d, dv, kind, causal = CASES[case]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g)
    k = torch.randn(b, hkv, lk, d, generator=g)
    if kind == "layout":
        q, k = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k))
    if kind == "ties":
        k = k[:, :, :4].repeat(1, 1, lk // 4, 1)
    v = torch.randn(b, hkv, lk, dv, generator=g)
    if kind == "layout":
        v = v.transpose(1, 2).contiguous().transpose(1, 2)
    mask = None
    if kind == "pad":
        mask = torch.rand(b, 1, 1, lk, generator=g) < 0.7
        mask[1] = False
    elif kind == "rows":
        mask = torch.rand(b, h, lq, lk, generator=g) < 0.6
        mask[:, :, 4] = False
    elif kind == "2d":
        mask = torch.rand(lq, lk, generator=g) < 0.6
    elif kind == "hole":
        mask = torch.ones(1, 1, 1, lk, dtype=torch.bool)
        mask[..., 16:48] = False
    q, k, v = (t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v))
    if kind == "layout":
        assert all(t.stride(2) != t.shape[-1] for t in (q, k, v))
    return q, k, v, (mask if mask is None else mask.to(DEVICE)), causal


@pytest.fixture
def on_triton(monkeypatch):
    """The fast paths take the Triton kernels for the CPU tensors (but float64) with small
    blocks; returns the list of the split counts of every split forward that ran, by module."""
    monkeypatch.setattr(devices, "triton_ready", lambda device, dtype: dtype != torch.float64)
    monkeypatch.setattr(TEMPLATE, "BLOCKS_16BIT", BLOCKS)
    monkeypatch.setattr(TEMPLATE, "BLOCKS_FLOAT32", BLOCKS)
    splits = []
    for module in {m for *_, m in METHODS.values()}:
        real = module._split_forward

        def recorded(*args, _real=real):
            splits.append(args[-1])  # every `_split_forward` takes the split count last
            return _real(*args)

        monkeypatch.setattr(module, "_split_forward", recorded)
    return splits


def force_split(monkeypatch, on: bool = True):
    """Small shapes split (every key block its own split, up to 64 programs), or nothing does."""
    monkeypatch.setattr(TEMPLATE, "SPLIT_MIN_LK", 32 if on else 10**9)
    monkeypatch.setattr(TEMPLATE, "SPLIT_MIN_BLOCKS", 1)
    monkeypatch.setattr(TEMPLATE, "SPLIT_PROGRAMS", 64)


def params_of(name: str, h: int, dtype: torch.dtype) -> dict:
    """The method's parameters, a per-head tensor leaf in ``dtype`` where METHODS says so."""
    params = dict(METHODS[name][1])
    for key, value in params.items():
        if value == "tensor":
            x = torch.tensor(TENSORS[key][:h], dtype=dtype, device=DEVICE)
            params[key] = x.view(1, h, 1, 1).requires_grad_()
    return params


def run(method, q, k, v, mask, causal, params, naive=False, blocks=BLOCKS):
    """(output, gradients of q, k, v and of the tensor parameters) for a fixed output
    gradient: the fast path (the kernels) or the naive path."""
    if naive:
        out = attend(q, k, v, method, mask=mask, causal=causal, impl="naive", **params)
    else:
        masking = Masking.build(mask, causal, q.shape[2], k.shape[2], q.device)
        scale = q.shape[-1] ** -0.5
        if method == "stick_breaking":
            params = dict(params, blocks=blocks)
        out, stats = path_of(nz.get(method))(q, k, v, masking, scale, False, **params)
        assert stats is None
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    leaves = [q, k, v] + [x for x in params.values() if torch.is_tensor(x)]
    grads = torch.autograd.grad(out, leaves, g, allow_unused=True)  # hardmax: no dq, dk
    grads = [torch.zeros_like(x) if d is None else d for x, d in zip(leaves, grads, strict=True)]
    return out.detach(), grads


def _copies(dtype, q, k, v, params):
    """Fresh leaves of q, k, v in ``dtype`` and of the tensor parameters (float64 with a
    float64 ``dtype``, else their own)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    own = {
        n: x.detach().to(dtype if dtype == torch.float64 else x.dtype).requires_grad_()
        if torch.is_tensor(x)
        else x
        for n, x in params.items()
    }
    return leaves, own


def _visible(mask, causal, q, k) -> torch.Tensor:
    masking = Masking.build(mask, causal, q.shape[2], k.shape[2], q.device)
    n = masking.visible_keys().expand(q.shape[0], q.shape[1], q.shape[2], 1)
    return n[..., 0] > 0


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
    (q1, k1, v1), p1 = _copies(dtype, q, k, v, params)
    whole, whole_grads = run(method, q1, k1, v1, mask, causal, p1)
    assert len(on_triton) == before  # the unsplit kernel
    (q64, k64, v64), p64 = _copies(torch.float64, q, k, v, params)
    ref, _ = run(method, q64, k64, v64, mask, causal, p64, naive=True)
    assert out.dtype == dtype and [g.dtype for g in grads[:3]] == [dtype] * 3
    assert_close(out, ref, n=lk, msg="out against float64")
    assert_close(out, whole, n=lk if dtype == torch.float32 else 1, msg="out against unsplit")
    n = max(lk, q.shape[2] * q.shape[1] // k.shape[1])
    for what, a, b in zip(("dq", "dk", "dv", "dparam"), grads, whole_grads, strict=False):
        assert_close(a, b, n=n, msg=f"{what} against unsplit")
    empty = ~_visible(mask, causal, q, k)
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
    (q64, k64, v64), _ = _copies(torch.float64, q, k, v, {})
    ref, want = run(method, q64, k64, v64, mask, causal, {}, naive=True)
    assert_close(out, ref, n=lk, msg="out")
    if method == "stick_breaking":
        # its backward (the unsplit kernel's, unchanged by the split) takes A_ik = D_i −
        # Σ_{j>k} w_ij·g_ij, ~0 at the far keys but for D's float32 rounding, which every far
        # key's σ(s_ik)·A_ik takes again: dq's error grows as Lk, not √Lk (here 2.9e-5, 570
        # float32 ulps of max |dq|, against 1.2e-7 eager). The split's claim is the unsplit
        # kernel's gradients
        monkeypatch.setattr(TEMPLATE, "SPLIT_MIN_LK", 10**9)
        (q1, k1, v1), _ = _copies(torch.float32, q, k, v, {})
        _, want = run(method, q1, k1, v1, mask, causal, {}, blocks=(16, 32))
    for what, a, b in zip(("dq", "dk", "dv"), grads, want, strict=True):
        assert_close(a, b, n=lk, msg=what)


def test_a_split_call_is_one_query_block():
    """The top-k and entmax split forwards write the block support with `SPLIT_BLOCK_M` rows a
    query block and the backward reads it with its own: both are one block only while a split
    call has at most `SPLIT_BLOCK_M` rows (and every block of the backward at least 16)."""
    assert TEMPLATE.SPLIT_MAX_LQ <= TEMPLATE.SPLIT_BLOCK_M
    assert min(TEMPLATE.BLOCKS_16BIT + TEMPLATE.BLOCKS_FLOAT32) >= 16
