"""Packed documents, sliding windows, padding as lengths and decoding steps on every path.

A call with structure (``documents``/``cu_seqlens``, ``window``, ``lengths``) must equal:

* packed: each document attended on its own and the outputs concatenated (outputs and every
  gradient), for every method on every path and dtype;
* window and lengths: the same call with the explicit boolean mask, built here from the
  definitions in `attend`'s docstring;
* a decoding step (a few query rows over a longer cache): the last rows of the full call.

The fast paths never hold an ``[Lq, Lk]`` tensor for such calls (watched op by op).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import layouts
import sharpattn
from precision import assert_close
from sharpattn import attend
from sharpattn import normalizers as nz
from structure import explicit_mask

pytestmark = pytest.mark.numerical

METHODS = nz.available()
CAUSAL_ONLY = {"stick_breaking"}
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def paths(method):
    return ("naive", "chunked", "fused") if nz.get(method).fused else ("naive", "chunked")


def _inputs(lq, lk, dtype=torch.float64, b=2, h=4, hkv=2, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, lk, d + 1, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v)]


def _call(method, q, k, v, impl, **kw):
    """(output, [dq, dk, dv]) of one call with a fixed cotangent."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v, method, impl=impl, block_size=3 if impl == "chunked" else None, **kw)
    cot = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape).to(out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), cot, allow_unused=True)
    return out.detach(), [
        torch.zeros_like(t) if g is None else g for t, g in zip((q, k, v), grads, strict=True)
    ]


def _same(got, ref, dtype, what, lk):
    out, grads = got
    r_out, r_grads = ref
    # a fast path against naive in float64 (stick-breaking's weights are products over the keys)
    ulps = 64 * (lk if "stick" in what else 1)
    assert_close(out, r_out, dtype=dtype, n=lk, magnitude=4.0, ulps=ulps, msg=f"{what} output")
    for name, g, r in zip("qkv", grads, r_grads, strict=True):
        assert_close(g, r, dtype=dtype, n=lk, magnitude=40.0, ulps=4 * ulps, msg=f"{what} d{name}")


def _precision(method, dtype):
    # adaptive's fused path uses the exact entropy, naive the reference code's: float32's ε
    return torch.float32 if method == "adaptive" and dtype == torch.float64 else dtype


# -- packed documents ------------------------------------------------------------------------

#: document lengths: an empty document, one of length 1, one document
PACKINGS = ([4, 0, 1, 6], [11], [1, 1, 3, 2, 0, 4])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("lengths", PACKINGS, ids=lambda x: "-".join(map(str, x)))
def test_packed_equals_documents_attended_separately(method, lengths):
    lk = sum(lengths)
    q, k, v = _inputs(lk, lk)
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    for causal in (True,) if method in CAUSAL_ONLY else (False, True):
        # the reference: each document on its own (naive), concatenated
        outs = [
            attend(q[:, :, a:z], k[:, :, a:z], v[:, :, a:z], method, causal=causal, impl="naive")
            for a, z in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)
            if z > a
        ]
        ref_out = torch.cat(outs, dim=2)
        for impl in paths(method):
            got, _ = _call(method, q, k, v, impl, causal=causal, cu_seqlens=cu)
            assert_close(
                got,
                ref_out,
                dtype=_precision(method, q.dtype),
                n=lk,
                magnitude=4.0,
                ulps=64,
                msg=f"{impl} causal={causal}",
            )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_gradients_on_every_path_and_dtype(method, dtype):
    """Per-batch ids ([B, Lk], different packings in each row), GQA heads: every path's output
    and gradients against the naive path of the explicit mask in float64."""
    lk = 9
    ids = torch.tensor([[0, 0, 0, 1, 2, 2, 2, 2, 3], [5, 5, 5, 5, 5, 7, 7, 8, 8]])
    q, k, v = _inputs(lk, lk)
    causal = True
    m = explicit_mask(lk, lk, 2, causal=causal, ids=ids)
    ref = _call(method, q, k, v, "naive", mask=m, causal=causal)
    low = [t.to(dtype) for t in (q, k, v)]
    for impl in paths(method):
        if dtype in (torch.float16, torch.bfloat16) and impl == "naive":
            continue  # the low-precision naive path is not what is tested here
        got = _call(method, *low, impl, causal=causal, documents=ids)
        _same(got, ref, _precision(method, dtype), f"{method} {impl}", lk)


# -- windows and lengths ---------------------------------------------------------------------

WINDOWS = ((2, 0), (None, 1), (3, 2), (0, None))


@pytest.mark.parametrize("method", METHODS)
def test_window_and_lengths_equal_the_explicit_mask(method):
    cases = itertools.product(
        ((9, 9), (3, 9), (1, 9)),  # prefill and decoding steps
        (False, True),
        WINDOWS + (None,),
        (None, torch.tensor([9, 5]), torch.tensor([[2, 9], [0, 6]])),  # right and left padding
        (None, torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3])),
    )
    for (lq, lk), causal, window, lengths, ids in cases:
        if (window, lengths, ids) == (None, None, None) or (method in CAUSAL_ONLY and not causal):
            continue
        q, k, v = _inputs(lq, lk)
        m = explicit_mask(lq, lk, 2, causal=causal, ids=ids, window=window, lengths=lengths)
        ref = attend(q, k, v, method, mask=m, causal=causal, impl="naive")
        for impl in paths(method):
            got = attend(
                q,
                k,
                v,
                method,
                causal=causal,
                documents=ids,
                window=window,
                lengths=lengths,
                impl=impl,
            )
            what = f"{impl} {lq}x{lk} causal={causal} window={window} lengths={lengths} ids={ids}"
            assert_close(
                got, ref, dtype=_precision(method, q.dtype), n=lk, magnitude=4.0, ulps=64, msg=what
            )


@pytest.mark.parametrize("method", METHODS)
def test_a_decoding_step_equals_the_last_rows_of_the_full_call(method):
    lk = 12
    q, k, v = _inputs(lk, lk)
    ids = torch.tensor([0] * 5 + [1] * 7)
    for kw in ({}, {"documents": ids}, {"window": (4, 0)}, {"documents": ids, "window": (2, 0)}):
        full = attend(q, k, v, method, causal=True, impl="naive", **kw)
        for lq, impl in itertools.product((1, 3), paths(method)):
            step = attend(q[:, :, -lq:], k, v, method, causal=True, impl=impl, **kw)
            assert_close(
                step,
                full[:, :, -lq:],
                dtype=_precision(method, q.dtype),
                n=lk,
                magnitude=4.0,
                ulps=64,
                msg=f"{impl} Lq={lq} {kw}",
            )


@pytest.mark.parametrize("method", [m for m in METHODS if nz.get(m).fused])
@pytest.mark.parametrize("layout", [x for x in layouts.LAYOUTS if x != "contiguous"])
def test_structure_in_any_layout(method, layout):
    q, k, v = _inputs(10, 10)
    kw = dict(causal=True, documents=torch.tensor([0] * 4 + [1] * 6), window=(3, 0))
    ref = _call(method, q, k, v, "fused", **kw)
    g = torch.Generator().manual_seed(1)
    laid = [layouts.laid_out(t, layout, g) for t in (q, k, v)]
    if layout in ("expanded", "overlapping"):  # new values: compare with their own copies
        ref = _call(method, *(t.contiguous() for t in laid), "fused", **kw)
    got = _call(method, *laid, "fused", **kw)
    _same(got, ref, q.dtype, f"{method} {layout}", 10)


def test_statistics_count_only_the_keys_of_the_row():
    q, k, v = _inputs(9, 9)
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3])
    m = explicit_mask(9, 9, 2, causal=True, ids=ids, window=(1, 0))
    for method in ("softmax", "ssmax", "adaptive", "sink", "entmax15"):
        if method not in METHODS:
            continue
        _, ref = attend(q, k, v, method, mask=m, causal=True, impl="naive", return_stats=True)
        for impl in paths(method)[1:]:
            _, st = attend(
                q,
                k,
                v,
                method,
                causal=True,
                documents=ids,
                window=(1, 0),
                impl=impl,
                return_stats=True,
            )
            assert torch.equal(st.visible, ref.visible), impl
            assert_close(st.entropy, ref.entropy, dtype=torch.float32, n=9, msg=impl)
            assert_close(st.mass, ref.mass, dtype=torch.float32, n=9, msg=impl)


def test_gradcheck_through_the_pieces():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 7, 3, generator=g, dtype=torch.float64) for _ in range(3))
    for method, kw in (
        ("sigmoid", dict(causal=True, window=(2, 0))),
        ("softmax", dict(cu_seqlens=torch.tensor([0, 2, 2, 5, 7]))),
        ("entmax15", dict(lengths=torch.tensor([[1, 6]]), window=(1, 1))),
    ):
        f = lambda q, k, v, m=method, kw=kw: attend(q, k, v, m, impl="fused", **kw)  # noqa: E731
        inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
        assert torch.autograd.gradcheck(f, inputs), method


# -- memory: no [Lq, Lk] tensor --------------------------------------------------------------


class _Largest(TorchDispatchMode):
    """The largest tensor any op makes (entries), op by op, forward and backward."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if torch.is_tensor(t):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("method", [m for m in METHODS if nz.get(m).fused])
@pytest.mark.parametrize("kind", ["packed", "window"])
def test_no_tensor_of_lq_by_lk_entries(method, kind):
    n = 1024
    q, k, v = (t.float().requires_grad_() for t in _inputs(n, n, b=1, h=1, hkv=1, d=8))
    if kind == "packed":
        kw = dict(cu_seqlens=torch.arange(0, n + 1, n // 8))  # 8 documents of 128
    else:
        kw = dict(window=(63, 0))
    with _Largest() as watch:
        out = attend(q, k, v, method, causal=True, impl="fused", **kw)
        out.sum().backward()
    # the pieces hold at most (rows of a piece)·(its keys): 128·128 here, 64·127 for the window
    assert watch.largest < n * n // 8, f"{method} {kind}: a tensor of {watch.largest} entries"


# -- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        dict(documents=torch.tensor([0, 0, 1])),  # not one id per key
        dict(documents=torch.tensor([0, 1, 0, 1, 1, 1])),  # a document in two runs
        dict(documents=torch.tensor([0.0, 0, 0, 1, 1, 1])),  # not integers
        dict(documents=torch.zeros(3, 6, dtype=torch.int64)),  # 3 batch rows of 2
        dict(cu_seqlens=torch.tensor([0, 2, 5])),  # does not end at Lk
        dict(cu_seqlens=torch.tensor([0, 4, 2, 6])),  # decreasing
        dict(cu_seqlens=torch.tensor([0, 6]), documents=torch.zeros(6, dtype=torch.int64)),
        dict(window=(-1, 0)),
        dict(window=3),
        dict(window=(1.5, 0)),
        dict(window=(True, 0)),
        dict(lengths=torch.tensor([7, 2])),  # beyond Lk
        dict(lengths=torch.tensor([3])),  # not one per batch row
        dict(lengths=torch.tensor([[4, 2], [0, 6]])),  # end before first
    ],
)
def test_malformed_structure_is_refused_in_one_sentence(kw):
    q, k, v = _inputs(6, 6)
    for impl in ("naive", "chunked", "fused"):
        with pytest.raises(ValueError) as err:
            attend(q, k, v, "softmax", impl=impl, **kw)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("method", ["softmax", "sigmoid", "entmax15", "stick_breaking"])
@pytest.mark.parametrize("selective", [None, "q"])
def test_multihead_attention_packed_equals_documents_apart(method, selective):
    """Rotary positions restart in each document; selective temperatures count each row's own
    keys."""
    torch.manual_seed(0)
    kw = {} if selective is None else {"selective": selective}
    m = sharpattn.MultiheadAttention(16, 4, method=method, rotary=True, causal=True, **kw).double()
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    spans = ((0, 3), (3, 4), (4, 10))
    out = m(x, cu_seqlens=torch.tensor([0, 3, 4, 10]))
    ref = torch.cat([m(x[:, a:z]) for a, z in spans], 1)
    assert_close(out, ref, dtype=torch.float64, n=10, magnitude=float(ref.detach().abs().max()))
