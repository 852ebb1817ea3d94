"""The stick-breaking Triton kernels (``attention/triton_stick.py``) against the naive path in
float64: outputs and the gradients of q, k and v, causal with Lq = Lk, Lq < Lk and Lq > Lk,
padding, per-row and 2-D masks inside the causal one (an all-padded batch item, an empty row),
``attend_current``, GQA, Dv != D, head dims padded up to 128, sizes that are not multiples of
the blocks, and scores of ±30 and ±1e4.

On the CPU they run in Triton's interpreter, float32 and float16 (the interpreter's bfloat16
products are wrong): ``TRITON_INTERPRET=1`` must be set before triton is imported, which
``tests/conftest.py`` does. With ``SHARPATTN_TEST_DEVICE=cuda`` the same tests run the compiled
kernels on the GPU, bfloat16 too. The kernels run through the registry's fast path
(``FAST["stick_breaking"]``) with `devices.triton_ready` made to say yes for CPU tensors (but
float64), so that its gate (`devices.backend` of the map's kernel record) sends them there.
"""

from __future__ import annotations

import math

import pytest
import torch

from devices import DEVICE
from precision import assert_close, tolerance

pytest.importorskip("triton", reason="the Triton kernels need triton (the gpu or dev extra)")

from sharpattn import normalizers as nz  # noqa: E402
from sharpattn.attention import attend, devices  # noqa: E402
from sharpattn.attention import triton as TRITON  # noqa: E402
from sharpattn.attention.dispatch.fast import FAST  # noqa: E402
from sharpattn.attention.masking import Masking  # noqa: E402
from sharpattn.attention.triton import stick as KERNELS  # noqa: E402

# Not marked `numerical`: the interpreter computes in NumPy, not in torch's CPU kernels (as
# tests/paths/test_triton.py).

if DEVICE.type == "cpu" and type(KERNELS._forward_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it)",
        allow_module_level=True,
    )
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
BLOCKS = (16, 16)  # query rows, keys per block: several blocks of each at n <= 45

# name: (B, H, Hkv, Lq, Lk, D, Dv, mask, params); every case is causal
CASES = {
    "causal": (1, 2, 2, 40, 40, 16, 16, None, {}),  # Lq = Lk, D = Dv, no GQA
    "lq_lt_lk": (1, 2, 1, 21, 45, 8, 5, None, {}),  # rows see Lk − Lq more keys; GQA, Dv != D
    "lq_gt_lk": (1, 2, 1, 45, 27, 8, 5, None, {}),  # the first 19 rows see nothing
    "padding": (2, 1, 1, 19, 37, 8, 5, "pad", {}),  # batch 1 all padding: empty rows
    "per_row": (1, 2, 1, 33, 34, 8, 5, "rows", {}),  # row 4 empty
    "2d": (1, 2, 2, 29, 35, 8, 12, "2d", {}),
    "attend_current": (1, 2, 1, 37, 37, 8, 5, "pad", {"attend_current": True}),
    "wide_heads": (1, 2, 1, 24, 30, 72, 40, None, {}),  # D, Dv padded to 128, 64
    # the score shift b_i = 0.5 − log(position): one more head column of q and k
    "shift": (1, 2, 1, 30, 36, 8, 5, None, {"shift": 0.5, "shift_log_position": -1.0}),
}


@pytest.fixture
def on_triton(monkeypatch):
    """The stick-breaking fast path takes the Triton kernels for the CPU tensors here (the one
    readiness check says yes but for float64, as on a GPU; statistics still take the tiles)."""
    monkeypatch.setattr(devices, "triton_ready", lambda device, dtype: dtype != torch.float64)


def inputs(case: str, dtype: torch.dtype, seed: int = 0, gain: float = 1.0):
    """(q, k, v, mask, params) in ``dtype``, leaves requiring grad; q times ``gain``."""
    b, h, hkv, lq, lk, d, dv, kind, params = CASES[case]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g) * gain
    k = torch.randn(b, hkv, lk, d, generator=g)
    v = torch.randn(b, hkv, lk, dv, generator=g)
    mask = None
    if kind == "pad":
        mask = torch.rand(b, 1, 1, lk, generator=g) < 0.7
        mask[1:] = False
    elif kind == "rows":
        mask = torch.rand(b, h, lq, lk, generator=g) < 0.6
        mask[:, :, 4] = False
    elif kind == "2d":
        mask = torch.rand(lq, lk, generator=g) < 0.6
    q, k, v = (t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v))
    return q, k, v, (mask if mask is None else mask.to(DEVICE)), dict(params)


def run(path, q, k, v, mask, params):
    """(output, gradients of q, k, v) of one path for a fixed output gradient."""
    if path == "triton":
        masking = Masking.build(mask, True, q.shape[2], k.shape[2], q.device)
        scale = 1 / math.sqrt(q.shape[-1])
        out, stats = FAST["stick_breaking"](q, k, v, masking, scale, False, blocks=BLOCKS, **params)
        assert stats is None
    else:
        out = attend(q, k, v, "stick_breaking", mask=mask, causal=True, impl="naive", **params)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    return out.detach(), torch.autograd.grad(out, (q, k, v), g)


def _as(dtype, q, k, v):
    return [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]


def _sees_a_key(q, k, mask, params) -> torch.Tensor:
    """[B, H, Lq] whether each query row takes a share of some key (its own only with
    ``attend_current``)."""
    lq, lk = q.shape[2], k.shape[2]
    last = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
    if not params.get("attend_current"):
        last = last - 1
    allowed = torch.arange(lk, device=q.device) <= last
    if mask is not None:
        allowed = allowed & Masking.build(mask, False, lq, lk, q.device).mask
    return allowed.expand(q.shape[0], q.shape[1], lq, lk).any(-1)


NAMES = ("out", "dq", "dk", "dv")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_triton_stick_equals_the_float64_naive_path(on_triton, case, dtype):
    q, k, v, mask, params = inputs(case, dtype)
    out, grads = run("triton", q, k, v, mask, params)
    assert out.dtype == dtype
    assert [g.dtype for g in grads] == [dtype] * 3
    ref = run("naive", *_as(torch.float64, q, k, v), mask, params)
    lq, lk, d = q.shape[2], k.shape[2], q.shape[-1]
    if dtype != torch.float32:
        # within 4x the error of the same computation eagerly in 16 bits (weights rounded to
        # 16 bits before the products, as both do), plus a quarter of the rounding of the
        # largest entry
        eager = run("naive", *_as(dtype, q, k, v), mask, params)
    for i, (what, got, want) in enumerate(
        zip(NAMES, (out, *grads), (ref[0], *ref[1]), strict=True)
    ):
        assert torch.isfinite(got).all(), what
        if dtype == torch.float32:
            # as tests/paths/test_stick_tiled.py: a gradient sums Lk d-sized products and two
            # running sums (Σ w·g from the diagonal, D − that): 16 ulps
            n = lk if i == 0 else max(lk, lq * q.shape[1] // k.shape[1]) * d
            assert_close(got, want, n=n, ulps=8 if i == 0 else 16, msg=what)
            continue
        ours = float((got.double() - want).abs().max())
        theirs = float((eager[0] if i == 0 else eager[1][i - 1]).double().sub(want).abs().max())
        floor = tolerance(dtype, magnitude=float(want.abs().max()), ulps=0.25)
        assert ours <= 4 * theirs + floor, f"{what}: {ours:.3g} against eager {theirs:.3g}"
    empty = ~_sees_a_key(q, k, mask, params)
    if case in ("lq_gt_lk", "padding", "per_row"):
        assert empty.any()
    assert (out[empty] == 0).all()
    assert (grads[0][empty] == 0).all()


# ---------------------------------------------------------------------------------------------
# large scores


@pytest.mark.parametrize("gain", [30.0, 1e4], ids=["q_x30", "q_x1e4"])
def test_large_scores_stay_finite_and_exact(on_triton, gain):
    """Scores past 100 (q times 30: log σ(−s) of −100 next to keys of weight near 1) and of
    ±1e4 (no NaN, no overflow: log w <= 0 everywhere). A gradient is held to the size of its terms: dq_i sums
    ds_ij·scale·k_j and dk_j sums ds_ij·scale·q_i, with |ds| up to 2·max |dO_i·v_j| (where σ(s)
    is 0 or 1, dq itself is 0 up to rounding: D − Σ w·g cancels)."""
    q, k, v, mask, params = inputs("per_row", torch.float32, gain=gain)
    scale = 1 / math.sqrt(q.shape[-1])
    s = q.detach() @ k.detach().repeat_interleave(2, 1).transpose(-1, -2) * scale
    assert float(s.abs().max()) > 3 * gain
    out, grads = run("triton", q, k, v, mask, params)
    ref = run("naive", *_as(torch.float64, q, k, v), mask, params)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)  # run's dO
    dp = float((g @ v.detach().repeat_interleave(2, 1).transpose(-1, -2)).abs().max())
    sizes = (
        float(v.detach().abs().max()),
        2 * dp * scale * float(k.detach().abs().max()),
        2 * dp * scale * float(q.detach().abs().max()),
        float(g.abs().max()),
    )
    n = (k.shape[2], k.shape[2] * q.shape[-1], 2 * q.shape[2] * q.shape[-1], 2 * q.shape[2])
    for what, got, want, size, m in zip(
        NAMES, (out, *grads), (ref[0], *ref[1]), sizes, n, strict=True
    ):
        assert torch.isfinite(got).all(), what
        # two running sums in a row (the log carry, Σ w·g from the diagonal): 16 ulps
        assert_close(got, want, n=m, magnitude=size, ulps=16, msg=f"{gain} {what}")


def test_strided_inputs_and_the_default_blocks(on_triton):
    """q seq-major (its heads interleaved), k with a non-unit last stride (copied), v a slice
    (Dv = 24, stride 2); blocks the tiles would take, (3, 4), are not the kernels' sizes: the
    kernels take their defaults (one block of 64 here)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 20, 2, 16, generator=g).to(DEVICE).transpose(1, 2)  # [1, 2, 20, 16]
    k = torch.randn(1, 1, 16, 30, generator=g).to(DEVICE).transpose(-1, -2)  # last stride 30
    v = torch.randn(1, 1, 30, 48, generator=g).to(DEVICE)[..., ::2]
    assert q.stride(-2) != 16 and k.stride(-1) != 1 and v.stride(-1) == 2
    mask = torch.rand(1, 1, 1, 30, generator=g).to(DEVICE) < 0.8
    masking = Masking.build(mask, True, 20, 30, q.device)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, _ = FAST["stick_breaking"](*leaves, masking, 0.25, False, blocks=(3, 4))
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    ref64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attend(*ref64, "stick_breaking", mask=mask, causal=True, impl="naive")
    want = torch.autograd.grad(ref, ref64, torch.ones_like(ref))
    for what, a, b in zip(NAMES, (out, *grads), (ref, *want), strict=True):
        assert_close(a, b.detach(), n=30 * 16, ulps=16, msg=what)


# ---------------------------------------------------------------------------------------------
# dispatch


def where(device: torch.device, dtype: torch.dtype, want_stats: bool = False) -> str:
    """Where a stick-breaking call runs (`devices.backend` of the map's kernel record)."""
    return devices.backend(nz.get("stick_breaking").family.kernel, device, dtype, want_stats)


def test_triton_is_wanted_for_cuda_tensors_without_statistics(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert where(cuda, dtype) == "triton"
    assert where(cuda, torch.float64) == "tiles"  # float64: the tiles
    assert where(cuda, torch.float32, True) == "tiles"  # statistics: the tiles
    assert where(cpu, torch.float32) != "triton"
    monkeypatch.setenv("SHARPATTN_TRITON", "0")
    assert where(cuda, torch.float16) == "tiles"


def test_attend_takes_the_kernels_on_the_triton_route_and_the_tiles_otherwise(monkeypatch):
    """CPU tensors never reach the kernels; with `devices.triton_ready` saying yes, ``attend``'s
    fused path does (and agrees with the tiles), except for ``return_stats``."""
    calls = []
    real = TRITON.stick_attention  # as the stick-breaking path reaches it
    monkeypatch.setattr(TRITON, "stick_attention", lambda *a: calls.append(1) or real(*a))
    q, k, v, mask, _ = inputs("lq_lt_lk", torch.float32)
    cpu = [t.detach().cpu() for t in (q, k, v)]  # CPU tensors on a GPU run too
    tiles = attend(*cpu, "stick_breaking", causal=True, impl="fused")
    assert not calls
    monkeypatch.setattr(devices, "triton_ready", lambda device, dtype: dtype != torch.float64)
    attend(*cpu, "stick_breaking", causal=True, impl="fused", return_stats=True)
    assert not calls
    out = attend(q, k, v, "stick_breaking", causal=True, impl="fused")
    assert calls
    assert_close(out, tiles, n=k.shape[2])  # compared on the CPU


@pytest.mark.parametrize(("lq", "lk"), [(1, 700), (48, 400)])
def test_long_rows_keep_the_gradients_within_a_few_times_the_eager_error(on_triton, lq, lk):
    """dq, dk and dv of the kernels in float32 against float64, within 16× the eager float32
    path's error, on rows of hundreds of keys with q times 3 (many far keys with σ(s) of order
    1, where A_k = D − Σ_{j>k} w·g is tiny): D from the backward's own first walk, in float64
    (D = dO·out in float32 left its rounding in every far key's ds, dq's error growing as Lk)."""
    g = torch.Generator().manual_seed(5)
    q = 3 * torch.randn(1, 2, lq, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, lk, 16, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(1, 2, lq, 16, generator=g, dtype=torch.float64)
    leaves64 = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attend(*leaves64, "stick_breaking", causal=True, impl="naive")
    want = torch.autograd.grad(ref, leaves64, dout)
    leaves = [t.float().to(DEVICE).requires_grad_() for t in (q, k, v)]
    masking = Masking.build(None, True, lq, lk, DEVICE)
    out, _ = FAST["stick_breaking"](*leaves, masking, 0.25, False, blocks=(16, 32))
    fast = torch.autograd.grad(out, leaves, dout.float().to(DEVICE))
    eager_out = attend(*leaves, "stick_breaking", causal=True, impl="naive")
    eager = torch.autograd.grad(eager_out, leaves, dout.float().to(DEVICE))
    for what, a, b, w in zip(("dq", "dk", "dv"), fast, eager, want, strict=True):
        err_fast = (a.double().cpu() - w).abs().max()
        err_eager = (b.double().cpu() - w).abs().max()
        floor = 1e-7 * float(w.abs().max())
        assert err_fast <= 16 * max(float(err_eager), floor), (what, err_fast, err_eager)
