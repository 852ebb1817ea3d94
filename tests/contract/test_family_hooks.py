"""A family's hooks are checked where their results are used: a hook that returns what its
family cannot use (a per-row value of the wrong shape or type, a weight map that is not a
floating tensor of the scores' shape, one that changes the scores in place, a top-k count that
is not an integer >= 1, an entmax α or θ out of range) is refused on every path (naive, chunked,
fused) in one sentence naming the method and the hook, and a plug-in's probe refuses it before
any model is built; so does an element-wise hook that is not element-wise (the tiles see part of
a row) and a row-normalised ``a`` that sums to 0 where ``u`` does not. Hooks that look odd but
have one meaning (a float64 map on float32 scores, a map that ignores s) give the same numbers
on every path."""

from __future__ import annotations

import pytest
import torch

from precision import assert_close
from sharpattn import attend
from sharpattn import normalizers as nz
from sharpattn.normalizers import plugin
from sharpattn.normalizers.families import (
    Elementwise,
    HookError,
    RowNormalised,
    RowScaled,
    Sink,
    Sparse,
    TopK,
)


def zero_row(n, **_):
    return 0.0


def f_int(s, r):
    return (s > 0).int()


def f_bool(s, r):
    return s > 0


def f_in_place(s, r):
    return s.sigmoid_()


def f_row_softmax(s, r):
    return torch.softmax(s, dim=-1)


def f_float64(s, r):
    return torch.sigmoid(s + r).double()


def f_constant(s, r):
    return torch.full_like(s, 0.25)


def u_exp(s, m):
    return torch.exp(s - m)


def a_zero(s, m):
    return torch.zeros_like(s)


def identity_ref(s):
    return s


def beta_per_head(n, **_):
    return torch.ones(2)


def beta_transposed(n, **_):
    return torch.ones(1, 2, 1, 6)


def beta_none(n, **_):
    return None


def beta_text(n, **_):
    return "2"


def count_half(**_):
    return 2.5


def count_bool(**_):
    return True


def alpha_one(**_):
    return 1.0


def theta_negative(n, **_):
    return -torch.ones_like(n)


def bias_per_head(n, **_):
    return torch.zeros(2)


REFUSED = {
    "f_int": (Elementwise(f_int, zero_row), "f returned a int32 tensor"),
    "f_bool": (Elementwise(f_bool, zero_row), "f returned a bool tensor"),
    "f_in_place": (Elementwise(f_in_place, zero_row), "f changed the scores in place"),
    "beta_per_head": (RowScaled(beta_per_head), "beta returned a float32 tensor of shape \\[2\\]"),
    "beta_transposed": (RowScaled(beta_transposed), "beta returned .* shape \\[1, 2, 1, 6\\]"),
    "beta_none": (RowScaled(beta_none), "beta returned None"),
    "beta_text": (RowScaled(beta_text), "beta returned '2'"),
    "bias_per_head": (Sink(bias_per_head), "bias returned a float32 tensor of shape \\[2\\]"),
    "count_half": (TopK(count_half), "count returned 2.5; it must return an integer >= 1"),
    "count_bool": (TopK(count_bool), "count returned True"),
    "alpha_one": (Sparse(alpha_one), "alpha returned 1.0; it must be in \\[1.01, 2.5\\]"),
    "theta_negative": (Sparse(1.5, scale=theta_negative), "scale returned -1.0; it must be > 0"),
}


def entry(name, family):
    return nz.Normalizer(f"test_hook_{name}", family.weights, "-", "-", False, family=family)


def qkv(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 6, 4, generator=g, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_hook_that_returns_what_its_family_cannot_use_is_refused_on_every_path(
    register_normalizer, name
):
    family, needle = REFUSED[name]
    method = register_normalizer(entry(name, family))
    q, k, v = qkv()
    for impl in ("naive", "chunked", "fused"):
        with pytest.raises(ValueError, match=needle) as err:
            attend(q.requires_grad_(), k, v, method, causal=True, impl=impl).sum().backward()
        assert isinstance(err.value, HookError)
        assert str(err.value).startswith(f"method {method!r}: its family's"), impl
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=needle) as err:  # a plug-in: refused by its probe
        plugin.probe(entry(name, family))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "family, needle",
    [
        (Elementwise(f_row_softmax, zero_row), "its family's f is not element-wise"),
        (RowNormalised(u_exp, a_zero, ref=identity_ref), "its family's a sums to 0"),
    ],
)
def test_a_plug_in_whose_tiles_would_differ_is_refused_by_its_probe(family, needle):
    with pytest.raises(ValueError, match=needle) as err:
        plugin.probe(entry("probe", family))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("f", [f_float64, f_constant])
def test_a_hook_with_one_meaning_gives_it_on_every_path(register_normalizer, f):
    """A float64 map on float32 scores is cast to their dtype; a map that does not depend on s
    has a zero derivative in s on the tiles too (where autograd alone would refuse)."""
    method = register_normalizer(entry(f.__name__, Elementwise(f, zero_row)))
    plugin.probe(entry(f.__name__, Elementwise(f, zero_row)))
    q, k, v = qkv()
    outs = {}
    for impl in ("naive", "chunked", "fused"):
        qq, vv = q.clone().requires_grad_(), v.clone().requires_grad_()
        out = attend(qq, k, vv, method, causal=True, impl=impl)
        assert out.dtype == torch.float32
        grads = torch.autograd.grad(out.square().sum(), (qq, vv), allow_unused=True)
        outs[impl] = (out, *(torch.zeros_like(qq) if g is None else g for g in grads))
    for impl in ("chunked", "fused"):
        for got, want in zip(outs[impl], outs["naive"], strict=True):
            assert_close(got, want, n=6)
