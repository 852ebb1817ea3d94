"""The tiled fast paths (sigmoid, relu, power, signed, softpick, hardmax; adaptive's entropy pass)
against independent float64 NumPy transcriptions, with tiles small enough that every row crosses
several of them (running maxima rescaled, causal tiles skipped, diagonal tiles masked), and a
float64 gradcheck of every backward."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from methods import TABLE
from precision import assert_close
from sharpattn.attention.cpu.fused import softmax_entropy
from sharpattn.attention.dispatch.fast import path_of
from sharpattn.attention.masking import Masking
from sharpattn.normalizers import get

pytestmark = pytest.mark.numerical

BLOCKS = (16, 8)  # query rows, key columns per tile


# the kernels on the tiles and their settings, and the float64 row references: the method
# table's (tests/methods.py)
PARAMS = {m.name: list(m.tiles) for m in TABLE.values() if m.tiles}

# (name, lq, lk, hkv, mask, causal)
CASES = [
    ("plain", 37, 45, 2, None, False),
    ("gqa_causal_prefix", 29, 45, 1, None, True),  # Lq < Lk: rows see Lk − Lq more keys
    ("causal_lq_gt_lk", 40, 27, 2, None, True),  # the first 13 rows see nothing
    ("padding", 33, 41, 2, "pad", False),
    ("rows_causal", 35, 35, 2, "rows", True),  # per-row mask with an empty row
]


def inputs(case, dtype=torch.float64, seed=0):
    _, lq, lk, hkv, kind, causal = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, lq, 8, generator=g, dtype=dtype)
    k = torch.randn(2, hkv, lk, 8, generator=g, dtype=dtype)
    v = torch.randn(2, hkv, lk, 5, generator=g, dtype=dtype)
    mask = None
    if kind == "pad":
        mask = torch.rand(2, 1, 1, lk, generator=g) < 0.7
    elif kind == "rows":
        mask = torch.rand(2, 2, lq, lk, generator=g) < 0.6
        mask[:, :, 4] = False
    return q, k, v, mask, causal


def small(q, k, v, mask, causal):
    """12 queries, 20 keys of a case (Lq != Lk), requiring grad: for gradcheck."""
    q, (k, v) = q[:1, :, :12], (t[:1, :, :20] for t in (k, v))
    if mask is not None:
        mask = mask[:1, :, :12, :20] if mask.shape[-2] > 1 else mask[:1, ..., :20]
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    return q, k, v, mask, causal


def np_weights(method, params, q, k, mask, causal):
    """(weights [B, H, Lq, Lk], allowed) from the row formulas, float64."""
    qn, kn = q.double().numpy(), k.double().numpy()
    kn = np.repeat(kn, qn.shape[1] // kn.shape[1], axis=1)
    s = qn @ np.swapaxes(kn, -1, -2) / math.sqrt(qn.shape[-1])
    lq, lk = s.shape[-2:]
    allowed = np.ones(s.shape, dtype=bool)
    if mask is not None:
        allowed &= np.broadcast_to(mask.numpy(), s.shape)
    if causal:
        allowed &= np.arange(lk)[None, :] <= np.arange(lq)[:, None] + (lk - lq)
    w = np.zeros_like(s)
    for idx in np.ndindex(s.shape[:-1]):
        a = allowed[idx]
        if a.any():
            w[idx][a] = TABLE[method].ref(s[idx][a], params)
    return w, allowed


def run_fast(method, params, q, k, v, mask, causal, want_stats=False):
    masking = Masking.build(mask, causal, q.shape[2], k.shape[2], q.device)
    return path_of(get(method))(
        q, k, v, masking, 1 / math.sqrt(q.shape[-1]), want_stats, blocks=BLOCKS, **params
    )


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("method,params", [(m, p) for m, ps in PARAMS.items() for p in ps], ids=str)
def test_tiled_path_equals_the_float64_formula(method, params, case):
    q, k, v, mask, causal = inputs(case, dtype=torch.float32)
    out, st = run_fast(method, params, q, k, v, mask, causal, want_stats=True)
    w, allowed = np_weights(method, params, q, k, mask, causal)
    vn = np.repeat(v.double().numpy(), q.shape[1] // v.shape[1], axis=1)
    lk = k.shape[2]
    # scores are rounded in float32 (|s| <= ~10 here) and the weights' slope is <= ~1·|w| per
    # unit of score (relu p = 2: 2·|s|), so the magnitude is |v|·(1 + |s|)
    smax = float(np.abs(q.numpy()).max() * np.abs(k.numpy()).max()) * math.sqrt(8)
    mag = float(v.abs().max()) * (1 + smax) * (1 + smax if params.get("p", 1) > 1 else 1)
    assert out.dtype == q.dtype
    assert_close(out, w @ vn, n=lk, magnitude=mag, ulps=16)
    absw = np.abs(w)
    ent = -(np.where(absw > 0, absw * np.log(np.where(absw > 0, absw, 1)), 0)).sum(-1)
    assert_close(st.entropy, ent, n=lk, magnitude=(1 + smax) * math.log(lk), ulps=32)
    assert_close(st.mass, w.sum(-1), n=lk, magnitude=1 + smax, ulps=16)
    assert torch.equal(st.visible, torch.from_numpy(allowed.sum(-1)).to(st.visible.dtype))
    empty = ~allowed.any(-1)
    assert (out.detach().numpy()[empty] == 0).all()


@pytest.mark.cpu_independent
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize(
    "method,params",
    [(m, p) for m, ps in PARAMS.items() for p in ps if m != "hardmax"],
    ids=str,
)
def test_tiled_backward_gradcheck_float64(method, params, case):
    q, k, v, mask, causal = small(*inputs(case))
    extra = {}
    if method == "sigmoid":  # the learnable per-head bias, as MultiheadAttention passes it
        extra["bias"] = torch.tensor([0.3, -0.5], dtype=torch.float64).view(1, 2, 1, 1)
        extra["bias"].requires_grad_()

    def f(q, k, v, *bias):
        p = dict(params, **({"bias": bias[0]} if bias else {}))
        return run_fast(method, p, q, k, v, mask, causal)[0]

    args = (q, k, v, *extra.values())
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7)


def test_hardmax_first_maximum_across_tiles_and_value_gradient():
    # ties across tile edges: keys 3 and 11 (different tiles of 8) hold the same largest score
    q = torch.ones(1, 1, 2, 4, dtype=torch.float64)
    k = torch.zeros(1, 1, 16, 4, dtype=torch.float64)
    k[0, 0, [3, 11]] = 1.0
    v = torch.randn(1, 1, 16, 3, dtype=torch.float64, requires_grad=True)
    out, _ = run_fast("hardmax", {}, q, k, v, None, False)
    assert torch.equal(out.detach(), v.detach()[:, :, [3, 3]])
    (gv,) = torch.autograd.grad(out.sum(), v)
    expect = torch.zeros_like(gv)
    expect[0, 0, 3] = 2.0
    assert torch.equal(gv, expect)


def test_hardmax_straight_through_has_softmax_gradients():
    q, k, v, mask, causal = inputs(CASES[1])
    q, k = q.requires_grad_(), k.requires_grad_()
    out, _ = run_fast("hardmax", {"straight_through": True}, q, k, v, mask, causal)
    soft = path_of(get("softmax"))(
        q, k, v, Masking.build(mask, causal, 29, 45, "cpu"), 8**-0.5, False
    )[0]
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k), g)
    want = torch.autograd.grad(soft, (q, k), g)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b, n=45 * 8)


# ---------------------------------------------------------------------------------------------
# adaptive's entropy pass


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_entropy_pass_equals_the_float64_entropy(case):
    q, k, _, mask, causal = inputs(case, dtype=torch.float32)
    q = q * 3  # sharper rows too
    masking = Masking.build(mask, causal, q.shape[2], k.shape[2], "cpu")
    h, lse = softmax_entropy(q, k, masking, 1 / math.sqrt(8), blocks=BLOCKS)
    qn, kn = q.double().numpy(), np.repeat(k.double().numpy(), 2 // k.shape[1], axis=1)
    s = qn @ np.swapaxes(kn, -1, -2) / math.sqrt(8)
    _, allowed = np_weights("signed", {}, q, k, mask, causal)
    z = np.where(allowed, s, -np.inf)
    m = np.where(allowed.any(-1, keepdims=True), z.max(-1, keepdims=True), 0.0)
    e = np.where(allowed, np.exp(z - m), 0.0)
    tot = e.sum(-1, keepdims=True)
    p = e / np.where(tot > 0, tot, 1)
    ent = -(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0)).sum(-1)
    ref_lse = np.where(tot[..., 0] > 0, m[..., 0] + np.log(np.where(tot > 0, tot, 1))[..., 0], 0)
    smax = float(np.abs(s).max())
    assert_close(h.squeeze(-1), ent, n=k.shape[2], magnitude=1 + smax)
    assert_close(lse.squeeze(-1), ref_lse, n=k.shape[2], magnitude=1 + smax)


@pytest.mark.cpu_independent
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_entropy_pass_gradcheck_float64(case):
    q, k, _, mask, causal = small(*inputs(case))
    masking = Masking.build(mask, causal, 12, 20, "cpu")
    assert torch.autograd.gradcheck(
        lambda q, k: softmax_entropy(q, k, masking, 0.35, blocks=(8, 8))[0], (q, k), eps=1e-6
    )


# ---------------------------------------------------------------------------------------------
# the switch around the C++ loops (attention/cpu/native.py), and the loops inside a user's graph


@pytest.fixture
def compile_mode(monkeypatch):
    """set(mode): SHARPATTN_COMPILE for the test."""
    return lambda mode: monkeypatch.setenv("SHARPATTN_COMPILE", mode)


def test_compile_mode_and_when_the_loops_are_wanted(compile_mode):
    from sharpattn.attention.cpu import native

    cpu = torch.device("cpu")
    built = native.library() is not None
    compile_mode("0")
    assert native.mode() == "0" and not native.wanted(cpu, torch.float32)
    for mode in ("1", ""):
        compile_mode(mode)
        assert native.mode() == (mode or "auto")
        assert native.wanted(cpu, torch.float32) == built
        assert not native.wanted(cpu, torch.float64)
        assert not native.wanted(torch.device("meta"), torch.float32)
    compile_mode("yes")
    with pytest.raises(ValueError, match="SHARPATTN_COMPILE must be 0, 1 or auto"):
        native.mode()


@pytest.mark.parametrize(
    ("method", "op"),
    [
        ("adaptive", "adaptive_forward"),
        ("softpick", "normalised_forward"),
        ("sigmoid", "elementwise_forward"),
        ("sparsemax", "sparse_prepare"),
        ("topk", "topk_select"),
    ],
)
def test_a_users_compiled_graph_calls_the_loops(compile_mode, method, op):
    """torch.compile(attend, fullgraph=True): the C++ loops are operators
    (``torch.ops.sharpattn``, with fake tensors for tracing), so the captured graph calls them,
    and gives the eager result."""
    from sharpattn import attend
    from sharpattn.attention.cpu import native

    if native.library() is None:
        pytest.skip("no C++ compiler on the PATH: the loops are not built here")
    compile_mode("auto")
    q, k, v, _, _ = inputs(CASES[0], dtype=torch.float32)
    k, v = k.repeat(1, 2 // k.shape[1], 1, 1), v.repeat(1, 2 // v.shape[1], 1, 1)
    seen = set()

    def backend(gm, _inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def run(q, k, v):
        return attend(q, k, v, method=method, impl="fused", check_finite=False)

    torch._dynamo.reset()
    got = torch.compile(run, fullgraph=True, backend=backend)(q, k, v)
    assert f"sharpattn.{op}.default" in seen, sorted(seen)
    assert_close(got, run(q, k, v), n=k.shape[2], magnitude=float(v.abs().max()))


@pytest.mark.parametrize("causal", [False, True])
def test_a_reused_score_buffer_gives_every_tile_its_own_scores(causal):
    """Grid(reuse=True) writes every score tile into one buffer (edge tiles and causal prefixes
    are smaller views of it): the same scores as fresh tiles, the buffer really shared, a fresh
    tensor again where autograd records the product (a view of a buffer cannot be an out=), and
    each named buffer separate from the others."""
    from sharpattn.attention.cpu.tiles import Grid

    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 4, n, 8) for n in (37, 29, 29))
    k, v = k[:, :2], v[:, :2]  # grouped heads
    masking = Masking.build(None, causal, 37, 29, q.device)
    fresh, reused = (Grid(q, k, v, masking, 0.3, 16, 8, reuse=r) for r in (False, True))
    shapes, storages = set(), set()
    for r0, r1 in fresh.row_blocks():
        qa, qb = fresh.q_rows(r0, r1), reused.q_rows(r0, r1)
        for t in fresh.tiles(r0, r1):
            want, got = fresh.scores(qa, t), reused.scores(qb, t)
            assert torch.equal(got, want)
            shapes.add(tuple(got.shape))
            storages.add(got.untyped_storage().data_ptr())
    assert len(shapes) > 1 and len(storages) == 1
    with torch.enable_grad():
        qg = q.clone().requires_grad_()
        g = Grid(qg, k, v, masking, 0.3, 16, 8, reuse=True)
        t = next(g.tiles(0, 16))
        s = g.scores(g.q_rows(0, 16), t)
        assert s.requires_grad and not g._buffers
    # every named buffer is its own: a weight tile written beside the scores leaves them intact
    t = next(reused.tiles(0, 16))
    s = reused.scores(reused.q_rows(0, 16), t)
    kept = s.clone()
    reused.buffer("w", s.shape, s).fill_(7.0)
    assert torch.equal(s, kept) and len(reused._buffers) == 2


def test_tiles_on_other_devices_hold_more_scores(monkeypatch):
    """The CPU keeps every budget; other devices multiply it (GPU tiles cost launches, not
    entries), by DEVICE_TILE_FACTOR or SHARPATTN_DEVICE_TILES; a bad override is ignored."""
    from sharpattn.attention import policy
    from sharpattn.attention.cpu import tiles

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("SHARPATTN_DEVICE_TILES", raising=False)
    assert tiles.device_budget(2**20, cpu) == 2**20
    assert tiles.device_budget(2**20, gpu) == 2**20 * policy.DEVICE_TILE_FACTOR
    monkeypatch.setenv("SHARPATTN_DEVICE_TILES", "4")
    assert tiles.device_budget(2**18, gpu) == 2**20
    assert tiles.device_budget(2**18, cpu) == 2**18
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("SHARPATTN_DEVICE_TILES", bad)
        assert tiles.device_budget(2**18, gpu) == 2**18 * policy.DEVICE_TILE_FACTOR
