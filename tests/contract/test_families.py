"""Families on the registry (normalizers/families.py): a method that declares its family gets that
family's fast path, whoever registers it, and the path equals the family's maths on the whole
matrix (its naive function) with every gradient, the parameters' included.

A user's row-scaled method (β = 1 + γ·log n, γ learnable), a user's adaptive temperature (β = 1 +
a·H, a learnable) and a user's sink (b = a·tanh(log n), a learnable) ride the flash kernel; a
user's
element-wise one (softplus(s + b − log n), b learnable; ReLU(s)^p·r with a constant p) walks the
tiles with autograd for f′. Both are pinned to independent float64 NumPy formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from precision import assert_close
from sharpattn import attend
from sharpattn import normalizers as nz
from sharpattn.attention.fast import path_of
from sharpattn.attention.masking import Masking
from sharpattn.normalizers._contract import log_n
from sharpattn.normalizers.families import Adaptive, Elementwise, RowScaled, Sink

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


GROWN = RowScaled(grown_beta)
TANH_SINK = Sink(tanh_sink)
BY_ENTROPY = Adaptive(entropy_beta)
SOFTPLUS = Elementwise(softplus_f, shift_row)
RELU_POWER = Elementwise(relu_power_f, inverse_n, constants=("p",))

ENTRIES = {
    "grown": nz.Normalizer("test_grown", GROWN.weights, "softmax((1 + γ·log n)·s)", "-", True,
                           params=(nz.Param("gamma", 0.5, "γ", learnable=True),), family=GROWN),
    "by_entropy": nz.Normalizer("test_by_entropy", BY_ENTROPY.weights, "softmax((1 + a·H)·s)", "-",
                                True, params=(nz.Param("a", 0.4, "a", learnable=True),),
                                family=BY_ENTROPY),
    "tanh_sink": nz.Normalizer("test_tanh_sink", TANH_SINK.weights, "sink b = a·tanh(log n)", "-",
                               False, params=(nz.Param("strength", 0.5, "a", learnable=True),),
                               family=TANH_SINK),
    "softplus": nz.Normalizer("test_softplus", SOFTPLUS.weights, "softplus(s + b − log n)", "-",
                              False, params=(nz.Param("bias", 0.0, "b", learnable=True),),
                              family=SOFTPLUS),
    "relu_power": nz.Normalizer("test_relu_power", RELU_POWER.weights, "ReLU(s)^p / n", "-",
                                False, params=(nz.Param("p", 2.0, "p", low=1.0),),
                                family=RELU_POWER),
}  # fmt: skip


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
    learn = {p.name: torch.tensor([0.3, -0.2, 0.7, 0.1], dtype=torch.float64).view(1, 4, 1, 1)
             for p in nz.get(method).learnable}  # fmt: skip
    consts = {"p": 2.5} if name == "relu_power" else {}
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
        out = attend(qq, kk, vv, method, mask=mask, causal=causal, impl=impl, block_size=2,
                     **pp, **consts)  # fmt: skip
        assert_close(out, torch.from_numpy(want), n=9, msg=f"{impl} output")
        grads = torch.autograd.grad(out.square().sum(), [qq, kk, vv, *pp.values()])
        results[impl] = grads
    for impl in ("chunked", "fused"):
        names = ["q", "k", "v", *learn]
        for name_, g, ref in zip(names, results[impl], results["naive"], strict=True):
            assert_close(g, ref, n=9, ulps=32, msg=f"{impl} d/d{name_}")


@pytest.mark.parametrize("name", ["softplus", "relu_power"])
def test_the_element_wise_tile_path_passes_gradcheck(register_normalizer, name):
    """float64 gradcheck of the user's element-wise path on small tiles (rows cross tile edges)."""
    method = register_normalizer(ENTRIES[name])
    (q, k, v), mask = inputs(lq=5, lk=7)
    fast = path_of(nz.get(method))
    masking = Masking.build(mask, True, 5, 7, "cpu")
    extra = {"bias": torch.tensor([0.3, -0.2, 0.7, 0.1], dtype=torch.float64).view(1, 4, 1, 1)}
    if name == "relu_power":
        extra = {"p": 2.0}

    def f(q, k, v, *b):
        params = {"bias": b[0]} if b else extra
        return fast(q, k, v, masking, 0.4, False, blocks=(2, 3), **params)[0]

    args = [t.clone().requires_grad_() for t in (q, k, v)]
    if name == "softplus":
        args.append(extra["bias"].clone().requires_grad_())
    assert torch.autograd.gradcheck(f, args)


def test_statistics_of_a_user_family_come_from_its_tiles(register_normalizer):
    method = register_normalizer(ENTRIES["softplus"])
    (q, k, v), mask = inputs(dtype=torch.float32)
    _, fast = attend(q, k, v, method, mask=mask, impl="fused", return_stats=True)
    _, naive = attend(q, k, v, method, mask=mask, impl="naive", return_stats=True)
    assert_close(fast.mass, naive.mass, n=9, msg="mass")
    assert_close(fast.entropy, naive.entropy, n=9, ulps=32, msg="entropy")


def test_built_in_families_name_their_own_paths():
    assert nz.get("ssmax").family is not None and nz.get("ssmax").fused == "row_scaled"
    assert nz.get("sigmoid").family.kernel == "sigmoid" and nz.get("sigmoid").fused == "sigmoid"
    assert nz.get("sink").fused == "sink" and isinstance(nz.get("sink").family, Sink)
    assert nz.get("adaptive").family.kernel == "adaptive" and nz.get("adaptive").fused == "adaptive"
    names = ("softmax", "ssmax", "length_scaled", "llama4_temperature", "logn", "sink", "sigmoid")
    names += ("relu", "adaptive")
    for name in names:
        assert path_of(nz.get(name)) is not None, name


@pytest.mark.parametrize(
    "family, params, needle",
    [
        ("not a family", (), "family must be one of"),
        (RowScaled(beta=3.0), (), "beta must be a function"),
        (Elementwise(softplus_f, 1.0), (), "row must be a function"),
        (Elementwise(relu_power_f, inverse_n, constants=("q",)), (), "constant 'q'"),
        (Elementwise(relu_power_f, inverse_n, constants=("p",)),
         (nz.Param("p", 2.0, "p", learnable=True),), "learnable parameter p"),
    ],
)  # fmt: skip
def test_a_family_that_cannot_run_is_refused_in_one_sentence(family, params, needle):
    entry = nz.Normalizer("test_bad", softplus_f, "-", "-", False, params=params, family=family)
    with pytest.raises(ValueError, match=needle) as err:
        nz.register(entry)
    assert "test_bad" in str(err.value) and "\n" not in str(err.value)
    assert "test_bad" not in nz.available()
