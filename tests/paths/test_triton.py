"""The Triton kernels (``attention/triton/``: the element-wise maps, sigmoid and
relu, and the row-normalised ones, power, signed, softpick, stablemax: every built-in map whose
kernel record has Triton kernels, `triton_methods`) against the naive path in float64: outputs and every
gradient (q, k, v and sigmoid's learnable per-head bias), masks of every kind, GQA, Dv != D,
sizes that are not multiples of the blocks, scores large enough to overflow without the
normalised kernels' running reference and small enough to need softpick's expm1. The softmax
kernel with its differentiable log-sum-exp, which `sink` and `adaptive` take on CUDA (the sink
as out·σ(lse − b), adaptive's entropy from one call with the keys as values), likewise, and the
statistics (`return_stats`) that come from it.

On the CPU they run in Triton's interpreter, float32 and float16 (the interpreter's bfloat16
products are wrong): ``TRITON_INTERPRET=1`` must be set before triton is imported, which
``tests/conftest.py`` does. With ``SHARPATTN_TEST_DEVICE=cuda`` the same tests run the compiled
kernels on the GPU, bfloat16 too. The kernels run through the registry's fast paths
(`fast.path_of`) with `devices.triton_ready` made to say yes for CPU tensors (but float64), so
that every gate (`devices.backend`) sends them there and the row tensors are built as on a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from devices import DEVICE
from precision import assert_close, tolerance

pytest.importorskip("triton", reason="the Triton kernels need triton (the gpu or dev extra)")

from sharpattn import normalizers as nz  # noqa: E402
from sharpattn.attention import attend, devices
from sharpattn.attention import triton as KERNELS  # noqa: E402
from sharpattn.attention.cpu import tiled  # noqa: E402
from sharpattn.attention.dispatch.fast import FAST, path_of  # noqa: E402
from sharpattn.attention.masking import Masking  # noqa: E402
from sharpattn.attention.triton import sparse as SPARSE  # noqa: E402
from sharpattn.attention.triton import template as TEMPLATE  # noqa: E402
from sharpattn.normalizers.families import RowNormalised  # noqa: E402

# Not marked `numerical`: Triton's interpreter computes the kernels in NumPy, not in torch's
# vectorised CPU kernels, so the other ATEN_CPU_CAPABILITY paths (tests/cpu_paths.py) would
# only repeat these tests (a minute each) with the same numbers.

if DEVICE.type == "cpu" and type(TEMPLATE._forward_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it)",
        allow_module_level=True,
    )
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
BLOCKS = (16, 32)  # query rows, keys per block: several blocks of each at n <= 45
DEFAULT_BLOCKS = (TEMPLATE.BLOCKS_16BIT, TEMPLATE.BLOCKS_FLOAT32)


def kernel_of(name: str):
    """The kernel record of the registry's method ``name`` (None: a family without one)."""
    return getattr(nz.get(name).family, "kernel", None)


def triton_methods() -> list[str]:
    """The registry's methods with Triton kernels, as their kernel records say."""
    return [n for n in nz.available() if kernel_of(n) is not None and kernel_of(n).triton]


#: the maps with tile maths of their own (element-wise and row-normalised) and Triton kernels
MAPS = [n for n in triton_methods() if kernel_of(n).tiles is not None]
#: the row-normalised ones of them
NORMALISED = [n for n in MAPS if isinstance(nz.get(n).family, RowNormalised)]
#: the methods ``tiled.py`` runs on the Triton kernels, which take ``blocks``: the maps and
#: `tiled.hardmax`
TILED = [n for n in triton_methods() if n in MAPS or kernel_of(n).name in tiled.TILED]

# name: (B, H, Hkv, Lq, Lk, D, Dv, mask, causal)
CASES = {
    "plain": (1, 2, 2, 37, 45, 16, 16, None, False),  # no mask, no GQA, D = Dv
    "causal": (1, 4, 2, 40, 40, 8, 5, None, True),
    "causal_lq_lt_lk": (1, 4, 2, 21, 45, 8, 5, None, True),  # rows see Lk − Lq more keys
    "causal_lq_gt_lk": (1, 4, 2, 45, 27, 8, 5, None, True),  # the first 18 rows see nothing
    "padding": (2, 4, 2, 19, 37, 8, 5, "pad", False),  # batch 1 all padding: empty rows
    # row 4 empty; Lk = Lq + 1 puts causal edges on block edges (the first and last blocks)
    "per_row": (1, 4, 2, 33, 34, 8, 5, "rows", True),
    "2d": (1, 4, 2, 29, 35, 8, 12, "2d", False),
}
# name: (method, params); "bias": "tensor" is a learnable per-head bias [1, H, 1, 1]. Settings
# of a map past its defaults (power's default p = 3), each after its map's defaults
SETTINGS = {
    "sigmoid": {
        "sigmoid_bias": {"bias": "tensor"},
        "sigmoid_no_log_n": {"bias": 0.5, "subtract_log_n": False},
    },
    "relu": {"relu_p2": {"p": 2.0}},
    "power": {"power_p2": {"p": 2.0}},
}
# every map with Triton kernels at its defaults (a new one is covered as it is registered), then
# its settings
METHODS = {}
for _map in MAPS:
    METHODS[_map] = (_map, {})
    METHODS.update({name: (_map, params) for name, params in SETTINGS.get(_map, {}).items()})
# the methods whose fast path takes the softmax kernel with its log-sum-exp on CUDA
LSE_METHODS = {
    "sink_bias": ("sink", {"bias": "tensor", "bias_log_n": 0.5}),
    "adaptive": ("adaptive", {}),
}
# the entmax family's kernel (a threshold from Newton passes over the keys, then one pass);
# "beta_pre": "tensor" is ASEntmax's learnable per-head parameter
ENTMAX_METHODS = {
    "sparsemax": ("sparsemax", {}),
    "entmax15": ("entmax15", {}),
    "entmax_1.3": ("entmax", {"alpha": 1.3}),
    "asentmax": ("asentmax", {"beta_pre": "tensor", "gamma_pre": 0.3}),
    "entmax_heads": ("entmax", {"alpha": "tensor"}),  # a learnable α per head
}
# top-k's kernel (the k largest scores kept per row as the key blocks pass, then one pass)
TOPK_METHODS = {
    "topk": ("topk", {}),  # k = 8
    "topk_3": ("topk", {"top_k": 3}),
    "hardmax": ("hardmax", {}),  # k = 1: no gradient in q and k
}
EVERY = {**METHODS, **LSE_METHODS, **ENTMAX_METHODS, **TOPK_METHODS}


@pytest.fixture
def on_triton(monkeypatch):
    """The fast paths take the Triton kernels for the CPU tensors here: the one readiness check
    says yes (but for float64, as on a GPU), so every gate follows (`devices.backend`: the maps,
    hardmax, top-k, the entmax family, and the softmax passes that need the log-sum-exp: sink,
    adaptive, statistics); statistics still stay on the tiles."""
    monkeypatch.setattr(devices, "triton_ready", lambda device, dtype: dtype != torch.float64)
    # small blocks for the kernels called without ``blocks`` (the interpreter's sort is slow)
    monkeypatch.setattr(TEMPLATE, "BLOCKS_16BIT", BLOCKS)
    monkeypatch.setattr(TEMPLATE, "BLOCKS_FLOAT32", BLOCKS)


def inputs(case: str, dtype: torch.dtype, seed: int = 0, gain: float = 1.0):
    """(q, k, v, mask, causal) in ``dtype``, leaves requiring grad; q times ``gain``."""
    b, h, hkv, lq, lk, d, dv, kind, causal = CASES[case]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g) * gain
    k = torch.randn(b, hkv, lk, d, generator=g)
    v = torch.randn(b, hkv, lk, dv, generator=g)
    mask = None
    if kind == "pad":
        mask = torch.rand(b, 1, 1, lk, generator=g) < 0.7
        mask[1] = False
    elif kind == "rows":
        mask = torch.rand(b, h, lq, lk, generator=g) < 0.6
        mask[:, :, 4] = False
    elif kind == "2d":
        mask = torch.rand(lq, lk, generator=g) < 0.6
    q, k, v = (t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v))
    return q, k, v, (mask if mask is None else mask.to(DEVICE)), causal


#: a learnable per-head parameter's values ("tensor" in a method's parameters)
PER_HEAD = {
    "bias": [0.3, -0.5, 1.2, 0.0],
    "beta_pre": [0.3, -0.5, 1.2, 0.0],
    "alpha": [1.2, 1.5, 1.8, 2.0],
}


def params_of(name: str, h: int, dtype: torch.dtype) -> dict:
    params = dict(EVERY[name][1])
    for key, values in PER_HEAD.items():
        if params.get(key) == "tensor":
            x = torch.tensor(values[:h], dtype=dtype, device=DEVICE)
            params[key] = x.view(1, h, 1, 1).requires_grad_()
    return params


def run(path, method, q, k, v, mask, causal, params):
    """(output, gradients of q, k, v[, bias]) of one path for a fixed output gradient."""
    if path == "triton":
        lq, lk = q.shape[2], k.shape[2]
        masking = Masking.build(mask, causal, lq, lk, q.device)
        scale = 1 / math.sqrt(q.shape[-1])
        blocks = {"blocks": BLOCKS} if method in TILED else {}  # else the kernels' defaults
        path = path_of(nz.get(method))
        out, stats = path(q, k, v, masking, scale, False, **blocks, **params)
        assert stats is None
    else:
        out = attend(q, k, v, method, mask=mask, causal=causal, impl="naive", **params)
    leaves = [q, k, v] + [p for p in params.values() if torch.is_tensor(p)]
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    return out.detach(), _grads(out, leaves, g)


def _grads(out, leaves, g):
    """The gradients of ``out`` in ``leaves`` for the output gradient ``g``; 0 for a leaf the
    output does not depend on (hardmax's q and k on the naive path)."""
    grads = torch.autograd.grad(out, leaves, g, allow_unused=True)
    return [torch.zeros_like(x) if d is None else d for x, d in zip(leaves, grads, strict=True)]


def _as(dtype, q, k, v, params):
    """Copies of the inputs (already rounded to the tested dtype) in ``dtype``, requiring grad."""
    conv = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    p = {
        n: (x.detach().to(dtype).requires_grad_() if torch.is_tensor(x) else x)
        for n, x in params.items()
    }
    return (*conv, p)


NAMES = ("out", "dq", "dk", "dv", "dbias")


#: (method, case) pairs that run in 16 bits as well as float32 on the CPU, where the interpreter
#: is slow (a case takes seconds): each method and setting in at least one case, the mask kinds
#: and causal shapes of the element-wise and normalised maps spread over their methods (each
#: case in 16 bits at least once; they share one kernel, `_forward_kernel`), and of the others
#: (several passes or a selection per key block) the cases whose 16-bit rounding is hardest
#: (masks, empty rows, ASEntmax's θ over padded keys). On a GPU every pair runs in every dtype.
SHORT = {
    "sigmoid": ("plain", "per_row"),
    "sigmoid_bias": ("per_row",),  # the bias gradient: Lk float32 terms, the largest error
    "sigmoid_no_log_n": ("causal",),
    "relu": ("causal_lq_gt_lk", "padding"),
    "relu_p2": ("2d",),
    "power": ("causal_lq_lt_lk", "per_row"),
    "power_p2": ("padding",),
    "signed": ("causal", "2d"),
    "softpick": ("causal_lq_lt_lk", "padding", "per_row"),  # expm1 and its shifted form
    **dict.fromkeys((*LSE_METHODS, "sparsemax", "topk"), ("causal_lq_lt_lk", "per_row")),
    **dict.fromkeys(("entmax15", "entmax_1.3", "entmax_heads", "topk_3", "hardmax"), ("per_row",)),
    "asentmax": ("padding", "per_row"),
}
# a map without an entry (one registered since: stablemax): a causal shape and a mask
SHORT.update({name: ("causal_lq_lt_lk", "per_row") for name in METHODS if name not in SHORT})
#: the cases in float32 of the methods past the first of each kernel and map (a setting of
#: one: a bias, p = 2, no log n; another α; ASEntmax; top-k's other k): three (the mask kinds,
#: causal with Lq > Lk); the first of each runs every case
FEWER = ("causal_lq_gt_lk", "padding", "per_row")
#: the methods that run every case in float32
FULL = (*MAPS, "sink_bias", "adaptive", "sparsemax", "topk")


def _pairs():
    for name in EVERY:
        for case in CASES:
            for dtype in DTYPES:
                if DEVICE.type == "cpu":
                    if dtype == torch.float32 and name not in FULL and case not in FEWER:
                        continue
                    if dtype != torch.float32 and case not in SHORT[name]:
                        continue
                yield pytest.param(name, case, dtype, id=f"{name}-{case}-{dtype}")


@pytest.mark.parametrize(("name", "case", "dtype"), list(_pairs()))
def test_triton_kernels_equal_the_float64_naive_path(on_triton, name, case, dtype):
    method = EVERY[name][0]
    q, k, v, mask, causal = inputs(case, dtype)
    params = params_of(name, q.shape[1], torch.float32)
    out, grads = run("triton", method, q, k, v, mask, causal, params)
    assert out.dtype == dtype
    assert [g.dtype for g in grads[:3]] == [dtype] * 3
    *qkv64, params64 = _as(torch.float64, q, k, v, params)
    ref = run("naive", method, *qkv64, mask, causal, params64)
    lq, lk = q.shape[2], k.shape[2]
    if dtype != torch.float32:
        # within 4x the error of the same computation eagerly in 16 bits (weights rounded to
        # 16 bits before the products, as both do; measured: at most 3.2x, sigmoid's bias
        # gradient, a sum of Lk float32 terms the eager path takes differently), plus a quarter
        # of the rounding of the largest entry
        *qkv16, _ = _as(dtype, q, k, v, params)
        eager = run("naive", method, *qkv16, mask, causal, _as(torch.float32, q, k, v, params)[3])
    pairs = zip(NAMES, (out, *grads), (ref[0], *ref[1]), strict=False)
    for i, (what, got, want) in enumerate(pairs):
        if dtype == torch.float32:
            # sums of Lk (dk, dv: Lq·G) terms: √n of float32's rounding
            assert_close(got, want, n=max(lk, lq * q.shape[1] // k.shape[1]), msg=what)
            continue
        ours = float((got.double() - want).abs().max())
        theirs = float((eager[0] if i == 0 else eager[1][i - 1]).double().sub(want).abs().max())
        floor = tolerance(dtype, magnitude=float(want.abs().max()), ulps=0.25)
        assert ours <= 4 * theirs + floor, f"{what}: {ours:.3g} against eager {theirs:.3g}"
    empty = ~_visible(mask, causal, q, k)
    assert (out[empty] == 0).all()
    assert (grads[0][empty] == 0).all()


def _visible(mask, causal, q, k) -> torch.Tensor:
    """[B, H, Lq] whether each query row sees a key."""
    masking = Masking.build(mask, causal, q.shape[2], k.shape[2], q.device)
    n = masking.visible_keys().expand(q.shape[0], q.shape[1], q.shape[2], 1)
    return n[..., 0] > 0


# ---------------------------------------------------------------------------------------------
# dispatch


def where(name: str, device: torch.device, dtype: torch.dtype, want_stats: bool = False) -> str:
    """Where a call of the registry's method ``name`` runs (`devices.backend`)."""
    return devices.backend(kernel_of(name), device, dtype, want_stats)


def test_triton_is_wanted_for_cuda_tensors_of_the_methods_with_kernels():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert {"sigmoid", "relu", "power", "signed", "softpick"} <= set(MAPS)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for name in triton_methods():
            assert where(name, cuda, dtype) == "triton", (name, dtype)
    assert where("sigmoid", cuda, torch.float64) == "tiles"  # float64: the tiles
    assert where("sigmoid", cuda, torch.float32, True) == "tiles"  # statistics: the tiles
    assert where("sigmoid", cpu, torch.float32) != "triton"
    assert where("power", cuda, torch.float64) == "tiles"
    assert where("softpick", cuda, torch.float32, True) == "tiles"
    without = [n for n in nz.available() if n not in triton_methods()]  # no kernel
    assert "softmax" in without
    for name in without:
        assert where(name, cuda, torch.float32) == "tiles", name


def test_sharpattn_triton_0_keeps_cuda_on_the_tiles(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setenv("SHARPATTN_TRITON", "0")
    assert where("sigmoid", cuda, torch.float16) == "tiles"
    monkeypatch.setenv("SHARPATTN_TRITON", "1")
    assert where("sigmoid", cuda, torch.float16) == "triton"


def test_the_cpu_fast_paths_stay_on_the_tiles(monkeypatch):
    """Without the fixture, CPU tensors never reach the kernels."""

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton kernels ran for CPU tensors")

    monkeypatch.setattr(KERNELS, "attention", refuse)
    q, k, v = (t.detach().cpu() for t in inputs("causal", torch.float32)[:3])  # on a GPU too
    for method in TILED:
        attend(q, k, v, method, causal=True, impl="fused")


def test_float64_and_statistics_fall_back_to_the_tiles(monkeypatch):
    """On a (pretended) CUDA device float64 inputs and return_stats take the tiles."""
    real = devices.triton_ready
    monkeypatch.setattr(devices, "triton_ready", lambda dev, dt: real(torch.device("cuda"), dt))

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton kernels ran")

    monkeypatch.setattr(KERNELS, "attention", refuse)
    q, k, v, mask, causal = inputs("causal", torch.float64)
    attend(q, k, v, "sigmoid", causal=True, impl="fused")
    attend(q, k, v, "softpick", causal=True, impl="fused")
    q, k, v, mask, causal = inputs("causal", torch.float32)
    attend(q, k, v, "relu", causal=True, impl="fused", return_stats=True)
    attend(q, k, v, "power", causal=True, impl="fused", return_stats=True)


# ---------------------------------------------------------------------------------------------
# layouts, head sizes, any p, the default blocks


def test_strided_inputs_padded_head_sizes_any_p_and_default_blocks(on_triton, monkeypatch):
    """q seq-major (its heads interleaved), k with a non-unit last stride (copied), v a slice;
    D = 40 and Dv = 24 padded to 64 and 32 by load masks; relu and power with p = 1.5
    (exp2/log2), sigmoid with a per-row bias tensor, the other maps (signed, softpick,
    stablemax) at their defaults; the default block sizes."""
    monkeypatch.setattr(TEMPLATE, "BLOCKS_16BIT", DEFAULT_BLOCKS[0])
    monkeypatch.setattr(TEMPLATE, "BLOCKS_FLOAT32", DEFAULT_BLOCKS[1])
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 20, 2, 40, generator=g).to(DEVICE).transpose(1, 2)  # [1, 2, 20, 40]
    k = torch.randn(1, 1, 40, 30, generator=g).to(DEVICE).transpose(-1, -2)  # last stride 30
    v = torch.randn(1, 1, 30, 48, generator=g).to(DEVICE)[..., ::2]  # Dv = 24, stride 2
    assert q.stride(-2) != 40 and k.stride(-1) != 1 and v.stride(-1) == 2
    mask = torch.rand(1, 1, 1, 30, generator=g).to(DEVICE) < 0.8
    masking = Masking.build(mask, True, 20, 30, q.device)
    bias = torch.randn(1, 1, 20, 1, generator=g).to(DEVICE)  # a per-row tensor
    settings = {"relu": {"p": 1.5}, "sigmoid": {"bias": bias}, "power": {"p": 1.5}}
    for method in MAPS:  # the others (signed, softpick, stablemax) at their defaults
        params = settings.get(method, {})
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, _ = path_of(nz.get(method))(*leaves, masking, 40**-0.5, False, **params)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
        ref64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
        p64 = {n: (x.double() if torch.is_tensor(x) else x) for n, x in params.items()}
        ref = attend(*ref64, method, mask=mask, causal=True, impl="naive", **p64)
        want = torch.autograd.grad(ref, ref64, torch.ones_like(ref))
        for what, a, b in zip(NAMES, (out, *grads), (ref, *want), strict=False):
            assert_close(a, b.detach(), n=30 * 40, msg=f"{method} {what}")


# ---------------------------------------------------------------------------------------------
# the normalised kernels at extreme score sizes


def _against_float64(method, params, case, gain):
    """The kernels (float32) against the float64 naive path, q times ``gain``."""
    q, k, v, mask, causal = inputs(case, torch.float32, gain=gain)
    out, grads = run("triton", method, q, k, v, mask, causal, params)
    *qkv64, params64 = _as(torch.float64, q, k, v, params)
    ref = run("naive", method, *qkv64, mask, causal, params64)
    n = max(k.shape[2], q.shape[2] * q.shape[1] // k.shape[1])
    for what, got, want in zip(NAMES, (out, *grads), (ref[0], *ref[1]), strict=False):
        assert torch.isfinite(got).all(), what
        assert_close(got, want, n=n, msg=f"{method} {what}")


@pytest.mark.parametrize("name", [n for n, (m, _) in METHODS.items() if m in NORMALISED])
def test_large_scores_stay_finite_and_exact(on_triton, name):
    """Scores past 100 (q times 30): e^{|s|} overflows float32 without the running reference
    and softpick's row references pass 60 (its shifted form, c = m). Within the default
    tolerance (measured: at most 2.6 ulps, signed's dk)."""
    method, params = METHODS[name]
    q, k, *_ = inputs("per_row", torch.float32, gain=30.0)
    s = q.detach() @ k.detach().repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(8)
    assert float(s.abs().max()) > 100.0
    _against_float64(method, params, "per_row", 30.0)


def test_softpick_keeps_its_precision_at_scores_near_zero(on_triton):
    """Scores ~1e-3: e^{s} − 1 formed as a difference would lose ε/|s| ~ 1e-4 of each weight
    (1,000 ulps); the kernels' expm1 keeps the default tolerance (measured: 0.2 ulps)."""
    _against_float64("softpick", {}, "padding", 1e-3)


# ---------------------------------------------------------------------------------------------
# the softmax kernel with its log-sum-exp: sink, adaptive and statistics on CUDA


@pytest.mark.parametrize("name", LSE_METHODS)
def test_sink_and_adaptive_take_the_softmax_kernel_at_large_scores(on_triton, monkeypatch, name):
    """The kernel runs (once for the sink, once for adaptive's entropy) and stays exact with
    scores past 100: the sink's σ(lse − b) and adaptive's H = lse − Σ p·s (measured: within
    the default tolerance)."""
    calls = []
    real = KERNELS.softmax_attention
    monkeypatch.setattr(KERNELS, "softmax_attention", lambda *a: calls.append(1) or real(*a))
    method, _ = LSE_METHODS[name]
    params = params_of(name, 4, torch.float32)
    _against_float64(method, params, "per_row", 30.0)
    assert calls


def test_statistics_from_the_softmax_kernel_equal_the_naive_ones(on_triton):
    """return_stats of softmax, sink and adaptive on the kernel route: entropy and mass against
    the float64 naive path, lse against a float64 log-sum-exp, adaptive's softmax entropy
    against softmax's (rows that see no key: lse −inf, mass and entropy 0)."""
    q, k, v, mask, causal = inputs("per_row", torch.float32)
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    masking = Masking.build(mask, causal, q.shape[2], k.shape[2], q.device)
    s = q64 @ k64.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(s.masked_fill(~masking.dense(), -math.inf), -1)
    _, softmax = attend(q64, k64, v64, mask=mask, causal=causal, impl="naive", return_stats=True)
    for method in ("softmax", "sink", "adaptive"):
        _, got = attend(q, k, v, method, mask=mask, causal=causal, impl="fused", return_stats=True)
        _, want = attend(
            q64, k64, v64, method, mask=mask, causal=causal, impl="naive", return_stats=True
        )
        pairs = [("entropy", got.entropy, want.entropy), ("mass", got.mass, want.mass)]
        if method == "adaptive":  # its lse is the β-scaled rows'; the entropy that gives β
            pairs.append(("softmax_entropy", got.softmax_entropy, softmax.entropy))
        else:
            pairs.append(("lse", got.lse, lse))
        for field, a, b in pairs:
            assert torch.equal(torch.isinf(a), torch.isinf(b)), (method, field)
            finite = torch.isfinite(b)
            assert_close(a[finite], b[finite], n=k.shape[2], msg=f"{method} {field}")


@pytest.mark.parametrize("top_k", [1, 2, 5])
def test_topk_breaks_ties_in_key_order_like_the_naive_path(on_triton, top_k):
    """Whole-number q and k: many keys tie at the k-th score; the kept ties are the first in key
    order, across key blocks (BLOCKS cut 40 keys in two), forward and backward."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 20, 8, generator=g).round() for _ in range(3))
    k, v = (torch.randn(1, 2, 40, 8, generator=g).round() for _ in range(2))
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    masking = Masking.build(None, False, 20, 40, DEVICE)
    method = "hardmax" if top_k == 1 else "topk"
    params = {} if top_k == 1 else {"top_k": top_k}
    out, _ = path_of(nz.get(method))(*leaves, masking, 1.0, False, **params)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    ref64 = [t.detach().double().requires_grad_() for t in leaves]
    ref = attend(*ref64, method, scale=1.0, impl="naive", **params)
    want = _grads(ref, ref64, torch.ones_like(ref))
    for what, a, b in zip(NAMES, (out, *grads), (ref, *want), strict=False):
        assert_close(a, b.detach(), n=40, msg=f"{method} {what}")


# ---------------------------------------------------------------------------------------------
# block support: the entmax and top-k backward visit only the blocks that hold a weight


def _support_of(monkeypatch):
    """A list that receives every block support table the kernels allocate."""
    tables = []
    make = TEMPLATE.Launch.support_table

    def record(self, device):
        tables.append(make(self, device))
        return tables[-1]

    monkeypatch.setattr(TEMPLATE.Launch, "support_table", record)
    return tables


def _block_flags(w: torch.Tensor, blocks: tuple[int, int]) -> torch.Tensor:
    """[B·H, query blocks, key blocks]: whether the block of ``w`` [B, H, Lq, Lk] has a weight."""
    bm, bn = blocks
    b, h, lq, lk = w.shape
    pad = torch.nn.functional.pad(w.abs(), (0, -lk % bn, 0, -lq % bm))
    tiles = pad.reshape(b * h, pad.shape[2] // bm, bm, pad.shape[3] // bn, bn)
    return tiles.amax((2, 4)) > 0


@pytest.mark.parametrize("method", ["sparsemax", "entmax15", "topk"])
def test_block_support_marks_every_block_with_a_weight_and_the_backward_skips_the_rest(
    on_triton, monkeypatch, method
):
    """Local rows (key j is (cos jω, sin jω) over 8 frequencies ω, query i is 2 times key i +
    80: scores fall with the distance |i + 80 − j|; 128 keys in 8 blocks, causal): the
    forward's block support holds every block where the float64 naive weights are nonzero,
    top-k's exactly those, and the backward skips the others (most of the blocks below the
    causal edge); outputs and gradients equal the float64 naive path."""
    tables = _support_of(monkeypatch)
    g = torch.Generator().manual_seed(5)
    angle = torch.arange(128.0)[:, None] * torch.logspace(-1.5, 0, 8)[None, :]
    k = torch.cat([angle.cos(), angle.sin()], -1).expand(1, 2, 128, 16)
    k = k + 0.01 * torch.randn(1, 2, 128, 16, generator=g)  # no ties
    q = k[:, :, 80:] * 2.0
    v = torch.randn(1, 2, 128, 8, generator=g)
    blocks = (16, 16)
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    masking = Masking.build(None, True, 48, 128, DEVICE)
    kernel = KERNELS.topk_attention if method == "topk" else KERNELS.entmax_attention
    arg = 8 if method == "topk" else {"sparsemax": 2.0, "entmax15": 1.5}[method]
    out = kernel(*leaves, masking, 0.25, arg, blocks=blocks)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    ref64 = [t.detach().double().requires_grad_() for t in leaves]
    params = {"top_k": 8} if method == "topk" else {}
    ref = attend(*ref64, method, scale=0.25, causal=True, impl="naive", **params)
    want = _grads(ref, ref64, torch.ones_like(ref))
    for what, a, b in zip(NAMES, (out, *grads), (ref, *want), strict=False):
        assert_close(a, b.detach(), n=128, msg=f"{method} {what}")
    # the weights themselves: the identity as values
    eye = torch.eye(128, dtype=torch.float64, device=DEVICE).expand(1, 2, 128, 128)
    w = attend(
        *(t.detach() for t in ref64[:2]),
        eye,
        method,
        scale=0.25,
        causal=True,
        impl="naive",
        **params,
    )
    (sup,) = tables
    truth = _block_flags(w, blocks).cpu()
    flagged = sup.cpu() > 0
    assert bool((flagged | ~truth).all()), "a block with a weight was skipped"
    assert torch.equal(flagged, truth)  # (entmax's margin of a few roundings: none here)
    visited = _block_flags(torch.ones(1, 2, 48, 128).tril(80), blocks)
    assert int(flagged.sum()) < 0.6 * int(visited.sum())  # the backward skips blocks


def test_the_entmax_kernels_alpha_gradient_equals_float64_finite_differences(on_triton):
    """dL/dα per head (α = 1.25, 1.6, 1.9, 2.0, learnable) from the kernel's dL/dc1 and dL/de
    against central differences (h = 1e-5) of the float64 naive path with 100 bisection
    steps: an independent check of ∂w/∂e = w·ln t − u·Σ w·ln t / Σ u."""
    q, k, v, mask, causal = inputs("per_row", torch.float32)
    alpha = torch.tensor([1.25, 1.6, 1.9, 2.0], device=DEVICE).view(1, 4, 1, 1)
    g = torch.randn(q.shape[:3] + (v.shape[-1],), generator=torch.Generator().manual_seed(2))
    g = g.to(DEVICE)
    a = alpha.clone().requires_grad_()
    out, _ = FAST["entmax_tiled"](
        q, k, v, Masking.build(mask, causal, 33, 34, q.device), 8**-0.5, False, alpha=a
    )
    (got,) = torch.autograd.grad(out, a, g)
    qkv = [t.detach().double() for t in (q, k, v)]

    def loss(al):
        o = attend(*qkv, "entmax", mask=mask, causal=causal, impl="naive", alpha=al, n_iter=100)
        return float((o * g.double()).sum())

    want = torch.zeros(4, dtype=torch.float64)
    for h in range(4):
        step = torch.zeros(1, 4, 1, 1, dtype=torch.float64, device=DEVICE)
        step[0, h] = 1e-5
        a64 = alpha.double()
        want[h] = (loss(a64 + step) - loss(a64 - step)) / 2e-5
    assert_close(got.flatten().cpu(), want.float(), n=34 * 33, msg="dL/dalpha")


@pytest.mark.parametrize("alpha", [2.0, 1.5, 1.3])
def test_the_entmax_kernel_equals_the_entmax_package_in_float64(on_triton, alpha):
    """Weights from the kernel (the identity as values) against the ``entmax`` package's
    sparsemax, entmax15 and entmax_bisect (Peters, Niculae & Martins) on the float64 scores,
    causal rows of 40 keys: an implementation independent of ours."""
    entmax = pytest.importorskip("entmax")
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(1, 2, 40, 8, generator=g) * 2, torch.randn(1, 2, 40, 8, generator=g)
    eye = torch.eye(40).expand(1, 2, 40, 40)
    masking = Masking.build(None, True, 40, 40, DEVICE)
    got = KERNELS.entmax_attention(*(t.to(DEVICE) for t in (q, k, eye)), masking, 8**-0.5, alpha)
    s = (q.double() @ k.double().transpose(-1, -2) * 8**-0.5).tril()
    s = s.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    fn = {2.0: entmax.sparsemax, 1.5: entmax.entmax15}.get(alpha)
    want = fn(s, dim=-1) if fn else entmax.entmax_bisect(s, alpha, dim=-1, n_iter=100)
    assert_close(got.cpu(), want.float(), n=40)


@pytest.mark.parametrize("alpha", [1.01, (1.01, 2.5)], ids=["1.01", "heads-1.01-2.5"])
def test_the_entmax_kernel_at_the_ends_of_alphas_range(on_triton, alpha):
    """Weights from the kernel (the identity as values) at the ends of α's range, [1.01, 2.5]
    (a number up to 2, a tensor anywhere in it: never read on the host), against the float64
    row reference of tests/methods.py on the float64 scores, causal rows of 40 keys."""
    import numpy as np

    from methods import entmax_row

    g = torch.Generator().manual_seed(8)
    q, k = torch.randn(1, 2, 40, 8, generator=g) * 2, torch.randn(1, 2, 40, 8, generator=g)
    eye = torch.eye(40).expand(1, 2, 40, 40)
    masking = Masking.build(None, True, 40, 40, DEVICE)
    a = torch.tensor(alpha).view(1, 2, 1, 1).to(DEVICE) if isinstance(alpha, tuple) else alpha
    got = KERNELS.entmax_attention(*(t.to(DEVICE) for t in (q, k, eye)), masking, 8**-0.5, a)
    s = (q.double() @ k.double().transpose(-1, -2) * 8**-0.5).numpy()
    want = np.zeros_like(s)
    for h in range(2):
        al = alpha[h] if isinstance(alpha, tuple) else alpha
        for i in range(40):
            want[0, h, i, : i + 1] = entmax_row(s[0, h, i, : i + 1], al)
    assert_close(got.cpu(), torch.from_numpy(want).float(), n=40)


@pytest.mark.parametrize("name", ["sigmoid", "power", "softmax"])
def test_linear_position_bias_columns_on_the_kernels(on_triton, name):
    """ALiBi's two extra columns of q and k (D + 2 against Dv = D, queries at the last Lq of
    Lk) through the kernels: the explicit bias matrix in float64, forward and gradients."""
    from sharpattn.attention.positions import alibi_slopes, bias_columns

    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 20, 8, generator=g).to(DEVICE).requires_grad_()
    k = torch.randn(1, 2, 37, 8, generator=g).to(DEVICE).requires_grad_()
    v = torch.randn(1, 2, 37, 8, generator=g).to(DEVICE).requires_grad_()
    slopes, scale = [4 * m for m in alibi_slopes(2)], 8**-0.5
    qa, ka = bias_columns(q, k, slopes, scale)
    masking = Masking.build(None, True, 20, 37, q.device)
    blocks = {"blocks": BLOCKS} if name in TILED else {}
    out, _ = path_of(nz.get(name))(qa, ka, v, masking, scale, False, **blocks)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    p = torch.arange(20, dtype=torch.float64, device=DEVICE)[:, None] + 17
    j = torch.arange(37, dtype=torch.float64, device=DEVICE)
    m = torch.tensor(slopes, dtype=torch.float64, device=DEVICE).view(1, 2, 1, 1)
    scores = q64 @ k64.transpose(-1, -2) * scale - m * (p - j)
    allowed = j <= p
    w = nz.get(name).fn(scores.masked_fill(~allowed, -math.inf), allowed)
    ref = w @ v64
    want = torch.autograd.grad(ref, (q64, k64, v64), torch.ones_like(ref))
    for what, a, b in zip(NAMES, (out, *grads), (ref, *want), strict=False):
        assert_close(a, b.detach(), n=37 * 10, msg=f"{name} {what}")


@pytest.mark.skipif(DEVICE.type == "cuda", reason="counts the interpreter's calls of the helpers")
def test_the_entmax_forward_stops_when_converged_and_skips_blocks_below_every_threshold(
    on_triton, monkeypatch
):
    """Local rows (as in the block-support test, 256 keys in 16 blocks): the Newton passes stop
    before the cap once no row's τ moves, and the passes after the first skip key blocks, so
    fewer block products are made than passes × blocks; the output equals the float64 path."""
    calls = []
    for name in ("_newton", "block_scores"):  # as the entmax forward kernel calls them
        inner = getattr(SPARSE, name)
        monkeypatch.setattr(
            SPARSE, name, lambda *a, _f=inner, _n=name, **kw: (calls.append(_n), _f(*a, **kw))[1]
        )
    angle = torch.arange(256.0)[:, None] * torch.logspace(-2, 0, 8)[None, :]
    k = torch.cat([angle.cos(), angle.sin()], -1).view(1, 1, 256, 16)
    q, v = (
        k[:, :, -16:] * 3.0,
        torch.randn(1, 1, 256, 4, generator=torch.Generator().manual_seed(0)),
    )
    masking = Masking.build(None, True, 16, 256, q.device)
    out = KERNELS.entmax_attention(q, k, v, masking, 0.25, 2.0, blocks=(16, 16))
    passes, products = calls.count("_newton"), calls.count("block_scores")
    assert passes < SPARSE.ENTMAX_STEPS[2.0]
    assert products < (passes + 2) * 16
    want = attend(
        q.double(), k.double(), v.double(), "sparsemax", scale=0.25, causal=True, impl="naive"
    )
    assert_close(out, want.float(), n=256)
