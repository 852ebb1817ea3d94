"""The C++ tile loops (attention/cpu/native.py): the same maths as the PyTorch tile functions they
stand in for, forward and backward, on tiles small enough that rows cross several of them (and
causal tiles whose rows see a prefix), and the switch and fallbacks around them."""

from __future__ import annotations

import os
import stat
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from methods import LOOPS
from precision import assert_close
from sharpattn.attention.cpu import native
from sharpattn.attention.cpu.fused import softmax_entropy
from sharpattn.attention.cpu.tiles import Grid
from sharpattn.attention.dispatch.fast import FAST, path_of
from sharpattn.attention.masking import Masking
from sharpattn.normalizers import get

pytestmark = pytest.mark.numerical

BLOCKS = (16, 8)
# (name, lq, lk, hkv, mask, causal): every key visible, causal prefixes (Lq < Lk, Lq > Lk with
# rows that see nothing), and masks the loops leave to PyTorch
CASES = [
    ("plain", 37, 45, 2, None, False),
    ("causal", 40, 40, 2, None, True),
    ("gqa_causal_prefix", 29, 45, 1, None, True),
    ("causal_lq_gt_lk", 40, 27, 2, None, True),
    ("padding", 33, 41, 2, "pad", False),
]
METHODS = [(m, p) for m, p, loops in LOOPS if loops == "normalised"]  # tests/methods.py


@pytest.fixture(autouse=True)
def needs_the_library():
    if native.compiler() is None:
        pytest.skip("no C++ compiler on the PATH: the loops are not built here")
    assert native.library() is not None, "a C++ compiler is here, but the loops did not build"


def inputs(case, scale=1.0, seed=0):
    _, lq, lk, hkv, kind, causal = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, lq, 8, generator=g) * scale
    k = torch.randn(2, hkv, lk, 8, generator=g)
    v = torch.randn(2, hkv, lk, 5, generator=g)
    mask = torch.rand(2, 1, 1, lk, generator=g) < 0.7 if kind == "pad" else None
    return q, k, v, mask, causal


def both(monkeypatch, fn, *tensors):
    """fn's value and gradients with the loops (auto), then in plain PyTorch (0)."""
    results = []
    for mode in ("auto", "0"):
        monkeypatch.setenv("SHARPATTN_COMPILE", mode)
        xs = [t.detach().clone().requires_grad_() for t in tensors]
        out = fn(*xs)
        g = torch.Generator().manual_seed(1)
        out.backward(torch.randn(out.shape, generator=g))
        results.append((out.detach(), *(x.grad for x in xs)))
    return results


def counting(monkeypatch, name):
    calls = []
    real = getattr(native, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(native, name, counted)
    return calls


ELEMENTWISE = [(m, p) for m, p, loops in LOOPS if loops == "elementwise"]

# (method, params, the loops' name in attention/cpu/native.py)
KERNELS = [(m, p, "normalised") for m, p in METHODS] + [
    (m, p, "elementwise") for m, p in ELEMENTWISE
]


@pytest.mark.parametrize("scale", [1.0, 25.0], ids=["scores_O1", "scores_beyond_60"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("method,params,loops", KERNELS, ids=str)
def test_kernel_loops_equal_the_pytorch_tiles(monkeypatch, method, params, loops, case, scale):
    q, k, v, mask, causal = inputs(case, scale)
    masking = Masking.build(mask, causal, q.shape[2], k.shape[2], "cpu")
    forward = counting(monkeypatch, f"{loops}_forward")
    backward = counting(monkeypatch, f"{loops}_backward")

    def f(q, k, v):
        return path_of(get(method))(q, k, v, masking, 8**-0.5, False, blocks=BLOCKS, **params)[0]

    (out, *grads), (out0, *grads0) = both(monkeypatch, f, q, k, v)
    assert (len(forward) > 0 and len(backward) > 0) == (mask is None)
    # the same maths in another order (row sums over the tile's keys, a polynomial exp, σ from
    # it, powers by products): within a few ulps of each value's scale, per the n keys summed
    # (measured: at most 1.4e-6 relative)
    for got, want in zip((out, *grads), (out0, *grads0), strict=True):
        assert_close(got, want, n=k.shape[2], ulps=16)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_entropy_loops_equal_the_pytorch_tiles(monkeypatch, case):
    q, k, _, mask, causal = inputs(case, scale=3.0)
    masking = Masking.build(mask, causal, q.shape[2], k.shape[2], "cpu")
    forward = counting(monkeypatch, "entropy_forward")
    backward = counting(monkeypatch, "entropy_backward")

    def f(q, k):
        return softmax_entropy(q, k, masking, 8**-0.5, blocks=BLOCKS)[0]

    (h, *grads), (h0, *grads0) = both(monkeypatch, f, q, k)
    assert (len(forward) > 0 and len(backward) > 0) == (mask is None)
    for got, want in zip((h, *grads), (h0, *grads0), strict=True):
        assert_close(got, want, n=k.shape[2], ulps=16)


def test_adaptive_through_attend_equals_plain_pytorch(monkeypatch):
    """The whole adaptive path (statistics pass, β, flash pass) with and without the loops."""
    from sharpattn import attend

    q, k, v, _, _ = inputs(CASES[1], scale=2.0)
    k, v = k.repeat(1, 2 // k.shape[1], 1, 1), v.repeat(1, 2 // v.shape[1], 1, 1)

    def f(q, k, v):
        return attend(q, k, v, "adaptive", causal=True, impl="fused", check_finite=False)

    (out, *grads), (out0, *grads0) = both(monkeypatch, f, q, k, v)
    # β is a polynomial of the entropy: the entropy's rounding (a few ulps of its scale) reaches
    # the weights through dβ/dH·s, a few times more
    for got, want in zip((out, *grads), (out0, *grads0), strict=True):
        assert_close(got, want, n=k.shape[2], ulps=32)


def test_loading_the_loops_leaves_subnormal_numbers_alone():
    """The library is built with -ffast-math but not linked with it (crtfastmath.o would set the
    process's flush-to-zero mode when it loads, for torch, NumPy and Python alike)."""
    import numpy as np

    assert native.library() is not None
    tiny = float(np.float64(2.2250738585072014e-308))  # the smallest normal double
    assert tiny / 4 > 0
    assert float(torch.tensor(1e-38, dtype=torch.float32) / 100) > 0
    assert np.float32(1e-38) / np.float32(100) > 0


def test_when_the_loops_run(monkeypatch):
    q = torch.zeros(1, 1, 4, 2)
    masking = Masking.build(None, False, 4, 4, "cpu")
    monkeypatch.setenv("SHARPATTN_COMPILE", "auto")
    assert Grid(q, q, q, masking, 1.0).native
    assert not Grid(q.double(), q.double(), q.double(), masking, 1.0).native  # float32 only
    assert native.wanted(torch.device("cpu"), torch.float32)
    assert not native.wanted(torch.device("meta"), torch.float32)
    monkeypatch.setenv("SHARPATTN_COMPILE", "0")  # plain PyTorch everywhere
    assert not Grid(q, q, q, masking, 1.0).native


@pytest.fixture
def broken_compiler(monkeypatch, tmp_path):
    """A C++ compiler that always fails (``CXX``), a fresh cache, the library not loaded yet;
    afterwards the next test finds the real compiler again."""
    fake = tmp_path / "broken-c++"
    fake.write_text("#!/bin/sh\necho 'broken: cannot compile' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    native.library.cache_clear()
    yield
    native.library.cache_clear()


def test_a_compiler_that_fails_warns_once_and_leaves_pytorch(
    monkeypatch, tmp_path, broken_compiler
):
    with pytest.warns(RuntimeWarning, match="could not be built or loaded"):
        assert native.library() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert not native.wanted(torch.device("cpu"), torch.float32)
    monkeypatch.setenv("CXX", "")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no compiler at all: quietly
    native.library.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.library() is None


def test_the_fallback_under_warnings_as_errors_is_one_line(capsys, broken_compiler):
    """``PYTHONWARNINGS=error`` turns every warning into an exception: the fallback to PyTorch
    is no error, so it is said once on stderr instead, and the work goes on."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.library() is None
        assert not native.wanted(torch.device("cpu"), torch.float32)
    err = capsys.readouterr().err
    assert err.count("could not be built or loaded") == 1 and "Traceback" not in err


def test_a_home_folder_that_does_not_exist_is_not_created(monkeypatch, tmp_path):
    """``HOME`` naming a folder that does not exist: the cache is this user's private folder
    under the temporary directory (a folder of that name that others may write to is not used),
    matplotlib's a private temporary one, and the home folder is not made."""
    from sharpattn.lab import report

    home, tmp = tmp_path / "no" / "home", tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setenv("MPLCONFIGDIR", "unset below")
    monkeypatch.delenv("MPLCONFIGDIR")  # restored as it was after the test
    native._private_temp.cache_clear()
    try:
        folder = native.cache_dir()
        assert folder == tmp / f"sharpattn-cache-{os.getuid()}"
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        report.matplotlib_config()
        assert Path(os.environ["MPLCONFIGDIR"]).parent == tmp
        assert not (tmp_path / "no").exists()
        folder.chmod(0o777)  # others may write there: not trusted with a library
        native._private_temp.cache_clear()
        other = native.cache_dir()
        assert other != folder and other.parent == tmp
        assert stat.S_IMODE(other.stat().st_mode) == 0o700
    finally:
        native._private_temp.cache_clear()


SPARSE = [
    ("sparsemax", {}),
    ("entmax15", {}),
    ("entmax", {"alpha": 1.3}),
    ("entmax", {"alpha": 1.7}),
    ("asentmax", {}),
]


@pytest.mark.parametrize("scale", [0.2, 1.0, 4.0], ids=lambda s: f"gain{s}")
@pytest.mark.parametrize("mask", [None, "pad", "causal"], ids=str)
@pytest.mark.parametrize("method,params", SPARSE, ids=str)
def test_sparse_threshold_loops_equal_the_pytorch_solver(monkeypatch, method, params, mask, scale):
    """τ's Newton steps and the final weights of the entmax family: rows of 300 keys (the
    candidates' threshold is only a start there), wide and narrow supports."""
    from sharpattn import attend

    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, 40, 8, generator=g) * scale
    k, v = torch.randn(2, 2, 300, 8, generator=g), torch.randn(2, 2, 300, 5, generator=g)
    pad = torch.rand(2, 1, 1, 300, generator=g) < 0.7 if mask == "pad" else None
    calls = counting(monkeypatch, "sparse_solve")

    def f(q, k, v):
        return attend(
            *(q, k, v, method),
            **dict(mask=pad, causal=mask == "causal", impl="fused", check_finite=False, **params),
        )

    (out, *grads), (out0, *grads0) = both(monkeypatch, f, q, k, v)
    assert calls
    # the same τ to a few ulps; the gradient's u = t^{1/(α−1) − 1} is steep near the threshold
    # for α > 1.5 (measured: at most 1e-5 relative at α = 1.7)
    ulps = 64 if params.get("alpha", 1.5) > 1.5 else 16
    for got, want in zip((out, *grads), (out0, *grads0), strict=True):
        assert_close(got, want, n=300, ulps=ulps)


STICK_CASES = [
    ("causal", 40, 40, 2, None, True),
    ("gqa_causal_prefix", 29, 45, 1, None, True),
    ("causal_lq_gt_lk", 40, 27, 2, None, True),
    ("padding_inside_causal", 33, 41, 2, "pad", True),
]


@pytest.mark.parametrize("scale", [1.0, 25.0], ids=["scores_O1", "scores_beyond_60"])
@pytest.mark.parametrize("attend_current", [False, True], ids=["before", "current"])
@pytest.mark.parametrize("case", STICK_CASES, ids=[c[0] for c in STICK_CASES])
def test_stick_breaking_loops_equal_the_pytorch_tiles(monkeypatch, case, attend_current, scale):
    """Stick-breaking's log-space running sums across reversed key tiles, forward (with the
    entropy and mass) and backward."""
    q, k, v, mask, causal = inputs(case, scale)
    masking = Masking.build(mask, causal, q.shape[2], k.shape[2], "cpu")
    forward = counting(monkeypatch, "stick_forward")
    backward = counting(monkeypatch, "stick_backward")
    stats = []

    def f(q, k, v):
        out, st = FAST["stick_breaking"](
            q, k, v, masking, 8**-0.5, True, attend_current=attend_current, blocks=BLOCKS
        )
        stats.append((st.entropy, st.mass))
        return out

    (out, *grads), (out0, *grads0) = both(monkeypatch, f, q, k, v)
    assert (len(forward) > 0 and len(backward) > 0) == (mask is None)
    # a polynomial exp and log σ, the same running sums in the same order: a few ulps per key
    for got, want in zip((out, *grads, *stats[0]), (out0, *grads0, *stats[1]), strict=True):
        assert_close(got, want, n=k.shape[2], ulps=16)


TOPK_CASES = [*CASES[:4], ("causal_lq_lt_lk_wide", 12, 300, 2, None, True)]


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("top_k", [1, 5, 64], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("case", TOPK_CASES, ids=[c[0] for c in TOPK_CASES])
def test_topk_selection_equals_the_slab_path(monkeypatch, case, top_k, ties):
    """Top-k from the C++ selection (kept keys gathered, backward from them) against the slab
    path's threshold and ties: causal rows with fewer than k keys, scores on a coarse grid
    (many ties, broken in key order), k = 1 and k above the keys there are."""
    q, k, v, mask, causal = inputs(case, scale=2.0)
    if ties:
        q, k = q.round(), k.round()
    masking = Masking.build(mask, causal, q.shape[2], k.shape[2], "cpu")
    select = counting(monkeypatch, "topk_select")
    stats = []

    def f(q, k, v):
        out, st = FAST["topk_tiled"](q, k, v, masking, 0.5, True, top_k=top_k)
        stats.append((st.entropy, st.mass))
        return out

    (out, *grads), (out0, *grads0) = both(monkeypatch, f, q, k, v)
    assert len(select) > 0
    # terms summed: top_k per output and dq row, up to every query (G·Lq) per dk and dv row
    sums = (top_k, top_k, q.shape[1] * q.shape[2], q.shape[1] * q.shape[2], top_k, top_k)
    for got, want, n in zip(
        (out, *grads, *stats[0]), (out0, *grads0, *stats[1]), sums, strict=True
    ):
        # at the scale of the terms (randn dO, v, k: O(1)), not of the result: with k = 1 the
        # gradients of q and k are 0 exactly, and both paths give rounding noise
        size = max(1.0, float(want.abs().max()))
        assert_close(got, want, n=n, ulps=16, magnitude=size)


def test_topk_selection_gradcheck_in_float64(monkeypatch):
    """The selected path's backward (gathers and scatters) by finite differences: float64 runs
    the slab path, so the float32 call's selection is replayed in float64 through the same
    Function."""
    from sharpattn.attention.cpu import sparse_tiled

    monkeypatch.setenv("SHARPATTN_COMPILE", "auto")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64) for _ in range(3))
    k = k[:, :1].repeat(1, 1, 2, 1)[:, :, :11]  # one key head (GQA), 11 keys
    v = v[:, :1].repeat(1, 1, 2, 1)[:, :, :11]
    masking = Masking.build(None, True, 9, 11, "cpu")
    real = native.topk_select

    def select64(s, ends, kk):  # the selection of float32 scores, values in float64
        vals, idx, count = real(s.float().contiguous(), ends, kk)
        return s.gather(-1, idx), idx, count

    monkeypatch.setattr(native, "topk_select", select64)

    def f(q, k, v):
        return sparse_tiled._TopkSelected.apply(q, k, v, 3, masking, 0.5, False)[0]

    xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(f, xs, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_topk_selection_with_empty_values(causal):
    """Values of width 0 (allowed by attend): empty outputs and gradients, as the naive path."""
    from sharpattn import attend

    q, k = torch.randn(1, 2, 5, 8, requires_grad=True), torch.randn(1, 2, 7, 8, requires_grad=True)
    v = torch.randn(1, 2, 7, 0, requires_grad=True)
    out = attend(q, k, v, "topk", causal=causal)
    out.sum().backward()
    assert out.shape == (1, 2, 5, 0) and not q.grad.any() and k.grad.shape == k.shape


@pytest.mark.skipif(
    __import__("platform").machine() not in ("x86_64", "AMD64"), reason="x86 targets only"
)
def test_a_build_without_avx512_gives_the_same_answers(monkeypatch, tmp_path):
    """The loops built for an x86-64 CPU without AVX-512 (``-march=x86-64-v3``: AVX2, the
    generic branch of the sparse solver's copy of the keys above its bound) against this
    machine's build: the entmax threshold, top-k's selection and stick-breaking's sums."""
    flags = tuple(
        "-march=x86-64-v3" if f == "-march=native" else f
        for f in native.FLAGS
        if f != "-mprefer-vector-width=512"
    )
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    portable = native.load(native.build(native.compiler(), flags))
    here = native.library()
    g = torch.Generator().manual_seed(5)
    s = torch.randn(6, 301, generator=g) * 2.0
    y = ((s - s.amax(-1, keepdim=True)) * 0.3).clamp(min=-2.0)  # α = 1.3's slab
    lo = torch.full((6, 1), -1.0)
    hi = torch.zeros(6, 1)
    ends = torch.tensor([301, 17, 0], dtype=torch.int32)  # causal rows: all, a prefix, none
    results = []
    for lib in (here, portable):
        monkeypatch.setattr(native, "library", lambda lib=lib: lib)
        solved = native.sparse_solve("entmax", 1 / 0.3, y.clone(), lo.clone(), lo, hi, 6)
        vals, idx, count = native.topk_select(s.clone(), ends, 7)
        carry, ent, mass = torch.zeros(6, 1), torch.zeros(6, 1), torch.zeros(6, 1)
        w = native.stick_forward(s.clone(), ends, carry, ent, mass)
        results.append((solved, (vals, idx, count), (w, carry, ent, mass)))
    (solved, top, stick), (solved0, top0, stick0) = results
    for got, want in zip((*solved, *stick), (*solved0, *stick0), strict=True):
        assert_close(got, want, n=301, ulps=16, magnitude=max(1.0, float(want.abs().max())))
    assert all(torch.equal(a, b) for a, b in zip(top, top0, strict=True))  # a selection: exact


@pytest.mark.parametrize("case", CASES[:4], ids=[c[0] for c in CASES[:4]])
@pytest.mark.parametrize("most", [10**6, 2 * 16 * 4], ids=["whole_rows", "rows_cut"])
def test_forward_over_whole_rows_equals_square_tiles(monkeypatch, case, most):
    """The loops' kernels' default forward runs on tiles of whole rows
    (tiles.row_tiles; of ROW_TILE_ROWS rows and fewer keys where a slab exceeds ROW_TILE_MAX,
    attention/policy.py):
    the same as on small square tiles, whose rows cross several of them."""
    from sharpattn.attention import policy

    monkeypatch.setenv("SHARPATTN_COMPILE", "auto")  # the loops, whatever the environment says
    monkeypatch.setattr(policy, "ROW_TILE_ELEMENTS", 4 * 16 * 45)
    monkeypatch.setattr(policy, "ROW_TILE_ROWS", 4)
    monkeypatch.setattr(policy, "ROW_TILE_MAX", most)
    q, k, v, _, causal = inputs(case, scale=3.0)
    masking = Masking.build(None, causal, q.shape[2], k.shape[2], "cpu")
    normalised = counting(monkeypatch, "normalised_forward")
    elementwise = counting(monkeypatch, "elementwise_forward")
    for method, params in METHODS + ELEMENTWISE:
        rows = path_of(get(method))(q, k, v, masking, 8**-0.5, False, **params)[0]
        square = path_of(get(method))(q, k, v, masking, 8**-0.5, False, blocks=BLOCKS, **params)[0]
        assert_close(rows, square, n=k.shape[2], ulps=16)
    assert normalised and elementwise


# (method, params, a loop of attention/cpu/native.py that its path calls)
THREADED = [
    ("adaptive", {}, "adaptive_forward"),
    ("power", {}, "normalised_forward"),
    ("softpick", {}, "normalised_backward"),
    ("sigmoid", {}, "elementwise_forward"),
    ("relu", {"p": 2.0}, "elementwise_backward"),
    ("entmax15", {}, "sparse_solve"),
    ("entmax", {"alpha": 1.3}, "sparse_prepare"),
    ("stick_breaking", {}, "stick_backward"),
    ("topk", {"top_k": 5}, "topk_select"),
]


@pytest.mark.parametrize("method,params,loop", THREADED, ids=lambda x: str(x))
def test_the_loops_give_the_same_answers_on_any_number_of_threads(
    monkeypatch, method, params, loop
):
    """`make test` gives each pytest worker one torch thread; the loops share a tile's rows
    among torch's OpenMP threads, so here they run on one and on three (rows not a multiple of
    three, causal rows of every length), through ``attend``, forward and backward."""
    from sharpattn import attend
    from sharpattn.lab.runner import threads

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 301, 8, generator=g) for _ in range(3))
    calls = counting(monkeypatch, loop)
    monkeypatch.setenv("SHARPATTN_COMPILE", "auto")
    results = []
    for n in (1, 3):
        with threads(n):
            xs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = attend(*xs, method, causal=True, check_finite=False, **params)
            out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
            results.append((out.detach(), *(x.grad for x in xs)))
    assert calls, f"{method} did not reach the {loop} loop"
    for got, want in zip(results[1], results[0], strict=True):
        assert_close(got, want, n=k.shape[2], ulps=16)
