"""Families on the registry (normalizers/families.py): a method that declares its family gets that
family's fast path, whoever registers it, and the path equals the family's maths on the whole
matrix (its naive function) with every gradient, the parameters' included.

A user's row-scaled method (β = 1 + γ·log n, γ learnable), a user's adaptive temperature (β = 1 +
a·H, a learnable) and a user's sink (b = a·tanh(log n), a learnable) ride the flash kernel; a
user's
element-wise one (softplus(s + b − log n), b learnable; ReLU(s)^p·r with a constant p) walks the
tiles with autograd for f′. A user's row-normalised one (signed |s|^p with a row reference;
softplus(s)/Σ softplus) walks the tiles in two passes, a user's top-2 and a user's length-scaled
1.25-entmax (θ = 1 + γ·log n, γ learnable) take the top-k and entmax tile paths, and a user's
stick-breaking the stick-breaking tiles. All are pinned to independent float64 NumPy formulas,
and every built-in member of the new families (row-normalised, top-k, entmax, stick-breaking) is
its family's maths, checked against the table of references (tests/methods.py) on scores of
±1e4, ties, masked and empty rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import methods
from precision import assert_close
from sharpattn import attend
from sharpattn import normalizers as nz
from sharpattn.attention.dispatch.fast import FAMILY_PATHS, FAST, path_of
from sharpattn.attention.masking import Masking
from sharpattn.normalizers.families import (
    Adaptive,
    Elementwise,
    RowNormalised,
    RowScaled,
    Sink,
    Sparse,
    StickBreaking,
    TopK,
    log_n,
)

pytestmark = pytest.mark.numerical


# The user's hooks (module-level functions, as a plug-in module would write them)
def grown_beta(n, gamma=0.5, **_):
    return 1.0 + gamma * log_n(n)


def entropy_beta(h, a=0.4, **_):
    return 1.0 + a * h


def tanh_sink(n, strength=0.5, **_):
    return strength * torch.tanh(log_n(n))


def softplus_f(s, r):
    return F.softplus(s + r)


def shift_row(n, bias=0.0, **_):
    return bias - log_n(n)


def relu_power_f(s, r, p=2.0):
    return torch.relu(s) ** p * r


def inverse_n(n, **_):
    return 1.0 / n.clamp_min(1.0)


def signed_power_u(s, m, p=2.0):
    return torch.sign(s) * signed_power_a(s, m, p)


def signed_power_a(s, m, p=2.0):
    return (s.abs() / torch.where(m > 0, m, torch.ones_like(m))) ** p


def softplus_u(s, m):
    return F.softplus(s)


def two(**_):
    return 2


def alpha_125(**_):
    return 1.25


def grown_theta(n, gamma=0.5, **_):
    return 1.0 + F.softplus(gamma) * log_n(n)


GROWN = RowScaled(grown_beta)
TANH_SINK = Sink(tanh_sink)
BY_ENTROPY = Adaptive(entropy_beta)
SOFTPLUS = Elementwise(softplus_f, shift_row)
RELU_POWER = Elementwise(relu_power_f, inverse_n, constants=("p",))
SIGNED_POWER = RowNormalised(signed_power_u, signed_power_a, ref=torch.abs, constants=("p",))
SOFTPLUS_SHARE = RowNormalised(softplus_u)
TOP2 = TopK(two)
GROWN_ENTMAX = Sparse(alpha_125, scale=grown_theta)
STICK = StickBreaking()

ENTRIES = {
    "grown": nz.Normalizer(
        "test_grown",
        GROWN.weights,
        "softmax((1 + γ·log n)·s)",
        "-",
        True,
        params=(nz.Param("gamma", 0.5, "γ", learnable=True),),
        family=GROWN,
    ),
    "by_entropy": nz.Normalizer(
        "test_by_entropy",
        BY_ENTROPY.weights,
        "softmax((1 + a·H)·s)",
        "-",
        True,
        params=(nz.Param("a", 0.4, "a", learnable=True),),
        family=BY_ENTROPY,
    ),
    "tanh_sink": nz.Normalizer(
        "test_tanh_sink",
        TANH_SINK.weights,
        "sink b = a·tanh(log n)",
        "-",
        False,
        params=(nz.Param("strength", 0.5, "a", learnable=True),),
        family=TANH_SINK,
    ),
    "softplus": nz.Normalizer(
        "test_softplus",
        SOFTPLUS.weights,
        "softplus(s + b − log n)",
        "-",
        False,
        params=(nz.Param("bias", 0.0, "b", learnable=True),),
        family=SOFTPLUS,
    ),
    "relu_power": nz.Normalizer(
        "test_relu_power",
        RELU_POWER.weights,
        "ReLU(s)^p / n",
        "-",
        False,
        params=(nz.Param("p", 2.0, "p", low=1.0),),
        family=RELU_POWER,
    ),
    "signed_power": nz.Normalizer(
        "test_signed_power",
        SIGNED_POWER.weights,
        "sign(s)|s|^p / Σ|s|^p",
        "-",
        False,
        params=(nz.Param("p", 2.0, "p", low=1.0),),
        family=SIGNED_POWER,
    ),
    "softplus_share": nz.Normalizer(
        "test_softplus_share",
        SOFTPLUS_SHARE.weights,
        "softplus(s) / Σ softplus(s)",
        "-",
        True,
        family=SOFTPLUS_SHARE,
    ),
    "top2": nz.Normalizer(
        "test_top2", TOP2.weights, "softmax over the top 2", "-", True, family=TOP2
    ),
    "grown_entmax": nz.Normalizer(
        "test_grown_entmax",
        GROWN_ENTMAX.weights,
        "1.25-entmax((1 + softplus(γ)·log n)·s)",
        "-",
        True,
        params=(nz.Param("gamma", 0.5, "γ", learnable=True),),
        family=GROWN_ENTMAX,
    ),
}
STICK_ENTRY = nz.Normalizer(
    "test_stick",
    STICK.weights,
    "stick-breaking",
    "-",
    False,
    params=(nz.Param("attend_current", False, "own key"),),
    family=STICK,
)


def np_rows(name, s, n, params):
    """The weights of a row's allowed scores ``s`` (n of them), float64, by the formula."""
    log = math.log(max(n, 1))
    if name == "grown":
        x = (1.0 + params["gamma"] * log) * s
        e = np.exp(x - x.max())
        return e / e.sum()
    if name == "by_entropy":
        p = np.exp(s - s.max())
        p /= p.sum()
        h = -np.sum(p * np.log(np.where(p > 0, p, 1.0)))
        x = (1.0 + params["a"] * h) * s
        e = np.exp(x - x.max())
        return e / e.sum()
    if name == "tanh_sink":
        b = params["strength"] * math.tanh(log)
        top = max(s.max(), b)
        e = np.exp(s - top)
        return e / (e.sum() + math.exp(b - top))
    if name == "softplus":
        return np.logaddexp(0.0, s + params["bias"] - log)
    if name == "signed_power":
        r = np.abs(s) ** params["p"]
        return np.sign(s) * r / r.sum() if r.sum() > 0 else r
    if name == "softplus_share":
        r = np.logaddexp(0.0, s)
        return r / r.sum()
    if name == "top2":
        keep = np.isin(np.arange(len(s)), np.argsort(-s, kind="stable")[:2])
        e = np.where(keep, np.exp(s - s.max()), 0.0)
        return e / e.sum()
    if name == "grown_entmax":
        theta = 1.0 + math.log1p(math.exp(params["gamma"])) * log
        return methods.entmax_row(theta * s, 1.25)
    return np.maximum(s, 0.0) ** params["p"] / max(n, 1)


def inputs(dtype=torch.float64, seed=0, lq=6, lk=9):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, lq, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, lk, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, lk, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(2, 1, 1, lk, generator=g) < 0.8
    mask[1, ..., :] = False  # batch 1 sees nothing: zero rows
    return [t.to(dtype) for t in (q, k, v)], mask


@pytest.mark.parametrize("name", list(ENTRIES))
def test_a_declared_family_gets_its_fast_path(register_normalizer, name):
    method = register_normalizer(ENTRIES[name])
    entry = nz.get(method)
    assert entry.fused == entry.family.path and path_of(entry) is not None


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", list(ENTRIES))
def test_every_path_equals_the_formula_with_gradients(register_normalizer, name, causal):
    method = register_normalizer(ENTRIES[name])
    (q, k, v), mask = inputs()
    learn = {
        p.name: torch.tensor([0.3, -0.2, 0.7, 0.1], dtype=torch.float64).view(1, 4, 1, 1)
        for p in nz.get(method).learnable
    }
    consts = {"p": 2.5} if name in ("relu_power", "signed_power") else {}
    plain = {n: t.flatten().tolist() for n, t in learn.items()}
    # the formula, float64, head by head
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)).numpy() / math.sqrt(8)
    allowed = np.broadcast_to(mask.numpy(), s.shape).copy()
    if causal:
        allowed &= np.tril(np.ones(s.shape[-2:], dtype=bool), k=s.shape[-1] - s.shape[-2])
    w = np.zeros_like(s)
    for idx in np.ndindex(s.shape[:-1]):
        a = allowed[idx]
        if a.any():
            row = {n: vals[idx[1]] for n, vals in plain.items()} | consts
            w[idx][a] = np_rows(name, s[idx][a], int(a.sum()), row)
    want = w @ v.repeat_interleave(2, 1).numpy()
    results = {}
    for impl in ("naive", "chunked", "fused"):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        pp = {n: t.clone().requires_grad_() for n, t in learn.items()}
        out = attend(
            qq, kk, vv, method, mask=mask, causal=causal, impl=impl, block_size=2, **pp, **consts
        )
        # 1.25-entmax: the weights are t^4 of the threshold's gap t, so its rounding counts 4×
        ulps = 64 if name == "grown_entmax" else 16
        assert_close(out, torch.from_numpy(want), n=9, ulps=ulps, msg=f"{impl} output")
        grads = torch.autograd.grad(out.square().sum(), [qq, kk, vv, *pp.values()])
        results[impl] = grads
    for impl in ("chunked", "fused"):
        names = ["q", "k", "v", *learn]
        for name_, g, ref in zip(names, results[impl], results["naive"], strict=True):
            assert_close(g, ref, n=9, ulps=2 * ulps, msg=f"{impl} d/d{name_}")


@pytest.mark.cpu_independent
@pytest.mark.parametrize("name", ["softplus", "relu_power", "signed_power", "softplus_share"])
def test_the_tile_paths_of_user_maps_pass_gradcheck(register_normalizer, name):
    """float64 gradcheck of the user's element-wise and row-normalised paths on small tiles (rows
    cross tile edges: the row-normalised reference pass and sums span several)."""
    method = register_normalizer(ENTRIES[name])
    (q, k, v), mask = inputs(lq=5, lk=7)
    fast = path_of(nz.get(method))
    masking = Masking.build(mask, True, 5, 7, "cpu")
    extra = {"bias": torch.tensor([0.3, -0.2, 0.7, 0.1], dtype=torch.float64).view(1, 4, 1, 1)}
    if name in ("relu_power", "signed_power"):
        extra = {"p": 2.0}
    elif name == "softplus_share":
        extra = {}

    def f(q, k, v, *b):
        params = {"bias": b[0]} if b else extra
        return fast(q, k, v, masking, 0.4, False, blocks=(2, 3), **params)[0]

    if name in ("signed_power", "softplus_share"):  # two query heads on one key head: GQA still
        q, k, v = q[:, :2], k[:, :1], v[:, :1]
    args = [t.clone().requires_grad_() for t in (q, k, v)]
    if name == "softplus":
        args.append(extra["bias"].clone().requires_grad_())
    assert torch.autograd.gradcheck(f, args)


def test_a_user_row_normalised_map_stays_finite_on_huge_scores(register_normalizer):
    """Scores of ±1e4: the reference pass keeps (|s|/m)^p in [0, 1] on the tiles, as the naive
    path does on the whole matrix."""
    method = register_normalizer(ENTRIES["signed_power"])
    (q, k, v), mask = inputs()
    q = q * 3e3
    naive = attend(q, k, v, method, mask=mask, impl="naive", check_finite=False)
    fused = attend(q, k, v, method, mask=mask, impl="fused", check_finite=False)
    assert torch.isfinite(fused).all()
    assert_close(fused, naive, n=9, magnitude=float(v.abs().max()) * 1e4)


@pytest.mark.parametrize("attend_current", [False, True])
def test_a_user_stick_breaking_takes_the_stick_tiles(register_normalizer, attend_current):
    method = register_normalizer(STICK_ENTRY)
    assert nz.get(method).fused == "stick_breaking" and path_of(nz.get(method)) is not None
    (q, k, v), mask = inputs(lk=6)
    outs = {}
    for impl in ("naive", "fused"):
        qq = q.clone().requires_grad_()
        out = attend(
            qq, k, v, method, mask=mask, causal=True, impl=impl, attend_current=attend_current
        )
        outs[impl] = (out, *torch.autograd.grad(out.square().sum(), qq))
    for got, want in zip(outs["fused"], outs["naive"], strict=True):
        assert_close(got, want, n=6, ulps=16)
    with pytest.raises(ValueError, match="causal only"):
        attend(q, k, v, method, impl="fused")


SHIFTED_STICK = nz.Normalizer(
    "test_shifted_stick",
    STICK.weights,
    "stick-breaking, shifted",
    "-",
    False,
    family=STICK,
    params=(nz.Param("shift", -1.0, "b0", tensor=True), nz.Param("shift_log_position", -1.0, "b1")),
)


@pytest.mark.parametrize("causal", [False, True])
def test_a_user_stick_breaking_gets_its_shift_and_positions_on_every_path(
    register_normalizer, causal
):
    """The family's parameters (a score shift) reach the tiles, and the query blocks of the
    chunked path are told their key position (the entry takes query_offset without declaring
    it), with a causal flag or a causal mask."""
    method = register_normalizer(SHIFTED_STICK)
    assert "query_offset" in {p.name for p in nz.get(method).params}
    (q, k, v), _ = inputs(lq=40, lk=40)
    mask = None if causal else torch.ones(40, 40, dtype=torch.bool).tril()
    shift = torch.tensor([-0.5, 0.0, 0.5, 1.0], dtype=torch.float64).view(1, 4, 1, 1)
    outs = {}
    for impl in ("naive", "fused", "chunked"):
        qq = q.clone().requires_grad_()
        extra = {"block_size": 16} if impl == "chunked" else {}
        out = attend(qq, k, v, method, mask=mask, causal=causal, impl=impl, shift=shift, **extra)
        outs[impl] = (out, *torch.autograd.grad(out.square().sum(), qq))
    for impl in ("fused", "chunked"):
        for got, want in zip(outs[impl], outs["naive"], strict=True):
            assert_close(got, want, n=40, ulps=16)


# every built-in member of the new families, each parameter case of the method table
NEW_FAMILIES = (RowNormalised, TopK, Sparse, StickBreaking)
MEMBERS = [
    (m.name, p)
    for m in methods.TABLE.values()
    if isinstance(nz.get(m.name).family, NEW_FAMILIES)
    for p in m.cases
]


def hostile_scores():
    """float64 scores ``[2, 3, 7, 7]`` with ±1e4 (several maxima in a row, a row of all −1e4),
    exact ties, and a causal mask with padding: the first row of batch 1 and its last row see
    nothing."""
    g = torch.Generator().manual_seed(4)
    s = torch.randn(2, 3, 7, 7, generator=g, dtype=torch.float64) * 3
    s[0, 0, :, 0] = 1e4
    s[0, 1, :, 1] = -1e4
    s[1, 0, :, ::2] = 1e4
    s[1, 2, 4] = -1e4
    s[0, 2, :, :4] = 0.5  # ties
    mask = torch.ones(2, 1, 7, 7, dtype=torch.bool).tril()
    mask[1, :, :, 0] = False
    mask[1, :, -1] = False
    return s, mask


@pytest.mark.parametrize("case", MEMBERS, ids=methods.case_id)
def test_each_new_family_is_its_members_maths_on_hostile_scores(case):
    method, params = case
    s, mask = hostile_scores()
    entry = nz.get(method)
    w = entry.family.weights(s, mask, **({p.name: p.default for p in entry.params} | params))
    allowed = mask.expand_as(s)
    ref = methods.reference(method, s, allowed, params)
    # ±1e4 scores: a weight's error is its logit's, ε·1e4 relative
    assert_close(w, ref, n=7, magnitude=1e4, msg=method)
    assert (w[~allowed] == 0).all() and (w[~allowed.any(-1)] == 0).all()
    registered = entry(s, mask, **params)
    assert torch.equal(registered.detach(), w.detach())


def test_statistics_of_a_user_family_come_from_its_tiles(register_normalizer):
    method = register_normalizer(ENTRIES["softplus"])
    (q, k, v), mask = inputs(dtype=torch.float32)
    _, fast = attend(q, k, v, method, mask=mask, impl="fused", return_stats=True)
    _, naive = attend(q, k, v, method, mask=mask, impl="naive", return_stats=True)
    assert_close(fast.mass, naive.mass, n=9, msg="mass")
    assert_close(fast.entropy, naive.entropy, n=9, ulps=32, msg="entropy")


def test_built_in_families_name_their_own_paths():
    assert nz.get("ssmax").family is not None and nz.get("ssmax").fused == "row_scaled"
    sigmoid, adaptive = nz.get("sigmoid"), nz.get("adaptive")
    assert sigmoid.family.kernel.name == "sigmoid" and sigmoid.fused == "sigmoid"
    assert nz.get("sink").fused == "sink" and isinstance(nz.get("sink").family, Sink)
    assert adaptive.family.kernel.name == "adaptive" and adaptive.fused == "adaptive"
    names = ("softmax", "ssmax", "length_scaled", "llama4_temperature", "logn", "sink", "sigmoid")
    names += ("relu", "adaptive")
    kernels = {
        "power": RowNormalised,
        "signed": RowNormalised,
        "softpick": RowNormalised,
        "stablemax": RowNormalised,
        "topk": TopK,
        "hardmax": TopK,
        "sparsemax": Sparse,
        "entmax15": Sparse,
        "entmax": Sparse,
        "asentmax": Sparse,
        "stick_breaking": StickBreaking,
    }
    for name, family in kernels.items():
        entry = nz.get(name)
        kernel = entry.family.kernel
        assert isinstance(entry.family, family) and entry.fused == kernel.name, name
        if kernel.tiles is None:  # a path of its own
            assert path_of(entry) is FAST[kernel.name], name
        else:  # its family's runner, which takes the record's tile maths and kernels
            assert path_of(entry).func is FAMILY_PATHS[family.path], name
    names += tuple(kernels)
    for name in names:
        assert path_of(nz.get(name)) is not None, name


@pytest.mark.parametrize(
    "family, params, needle",
    [
        ("not a family", (), "family must be one of"),
        (RowScaled(beta=3.0), (), "beta must be a function"),
        (Elementwise(softplus_f, 1.0), (), "row must be a function"),
        (Elementwise(relu_power_f, inverse_n, constants=("q",)), (), "constant 'q'"),
        (
            Elementwise(relu_power_f, inverse_n, constants=("p",)),
            (nz.Param("p", 2.0, "p", learnable=True),),
            "learnable parameter p",
        ),
        (RowNormalised(signed_power_u, ref=1.0), (), "ref must be a function or None"),
        (
            RowNormalised(signed_power_u, constants=("p",)),
            (nz.Param("p", 2.0, "p", learnable=True),),
            "this family has no learnable ones",
        ),
        (TopK(count=2), (), "count must be a function"),
        (Sparse(alpha=1.0), (), "alpha must be a number in \\[1.01, 2.5\\]"),
        (Sparse(alpha=3.0), (), "alpha must be a number in \\[1.01, 2.5\\]"),
        (Sparse(scale=2.0), (), "scale must be a function or None"),
    ],
)
def test_a_family_that_cannot_run_is_refused_in_one_sentence(family, params, needle):
    entry = nz.Normalizer("test_bad", softplus_f, "-", "-", False, params=params, family=family)
    with pytest.raises(ValueError, match=needle) as err:
        nz.register(entry)
    assert "test_bad" in str(err.value) and "\n" not in str(err.value)
    assert "test_bad" not in nz.available()
