"""A user's normalizer, named ``package.module:attribute``: imported, probed against the contract
and registered under that name (``sharpattn leaderboard --method``).

The attribute is either a function under the contract, ``fn(scores, mask=None, **params)`` (it
has no parameters of its own beyond ``check_finite``), or a [`Normalizer`][sharpattn.normalizers.registry.Normalizer]
entry, whose ``Param(..., learnable=True)`` parameters are trained per head as the registry's
are. The module is imported with the current directory on ``sys.path`` (as ``python -m`` does).
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import sys
from dataclasses import replace

import torch

from .families import Elementwise, HookError, RowNormalised, per_score
from .registry import Normalizer, get, register

__all__ = ["PluginFailed", "ensure", "is_spec", "load", "probe"]

#: the probe's shape: batch, heads, queries = keys
_B, _H, _L = 2, 2, 6


def is_spec(name: str) -> bool:
    """Whether a method name is a plug-in's ``module:attribute`` (registry names have no colon)."""
    return ":" in name


def load(spec: str) -> Normalizer:
    """Import the normalizer ``spec`` names, probe it (`probe`) and register it under
    ``spec``; return its entry. A bad spec raises ``ValueError`` in one sentence."""
    module_name, _, attr = spec.partition(":")
    dotted = module_name.split(".")
    if not all(p.isidentifier() for p in dotted) or not attr.isidentifier():
        raise ValueError(
            f"method {spec!r} is not of the form package.module:function (a module to import, "
            "a colon, the name of a function or Normalizer in it)."
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # the current directory, as `python -m` has it
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and module_name.startswith(err.name):
            raise ValueError(
                f"method {spec!r}: no module named {err.name!r} in the current directory or on "
                "PYTHONPATH; run from the folder that holds it or add that folder to PYTHONPATH."
            ) from None
        raise ValueError(f"method {spec!r}: importing {module_name} failed: {_one(err)}.") from None
    except Exception as err:  # the user's module: any error it raises on import
        raise ValueError(f"method {spec!r}: importing {module_name} failed: {_one(err)}.") from None
    except SystemExit as err:  # sys.exit() at import: the module's doing, not the command's end
        raise ValueError(
            f"method {spec!r}: importing {module_name} called sys.exit with code {err.code!r}; "
            "a plug-in module must define its normalizer without exiting (put a script's code "
            "under `if __name__ == '__main__':`)."
        ) from None
    if not hasattr(module, attr):
        raise ValueError(f"method {spec!r}: module {module_name} has no attribute {attr!r}.")
    obj = getattr(module, attr)
    if isinstance(obj, Normalizer):
        entry = replace(obj, name=spec)
    elif callable(obj):
        entry = Normalizer(
            spec, obj, formula=f"{spec} (user's)", citation="user's", sums_to_one=False
        )
    else:
        raise ValueError(
            f"method {spec!r}: {module_name}.{attr} is a {type(obj).__name__}, not a function or "
            "Normalizer."
        )
    entry.validate()  # its parameters, query_dependent, ...: one sentence, before the probe
    if getattr(entry.family, "kernel", None) is not None:
        raise ValueError(
            f"method {spec!r}: its family holds the built-in kernel {getattr(entry.family.kernel, 'name', entry.family.kernel)!r}, "
            "which computes that method's maths, not yours; leave kernel=None (your f then runs "
            "on the tiles)."
        )
    if entry.fused is not None and entry.fused != getattr(entry.family, "path", None):
        raise ValueError(
            f"method {spec!r} names the fused path {entry.fused!r}; a plug-in gets a fast path "
            "by declaring its family (a named path is a built-in kernel of its own maths, which "
            "cannot be checked to equal yours), so leave fused=None."
        )
    probe(entry)
    return register(replace(entry, fn=_watched(entry)), replace=True)


class PluginFailed(ValueError):
    """A plug-in's function raised, or gave a NaN or infinite weight, while a model ran it (the
    message is a clause: what it did). ``sequence.run_job`` turns it into one sentence naming
    the method, the task and the step."""


def _watched(entry: Normalizer):
    """``entry.fn`` as the registry runs it for a plug-in: whatever it raises (``SystemExit``
    included; Ctrl-C is left alone) and a NaN or infinite weight at an allowed position become
    `PluginFailed`. Reading the weights is a host synchronisation, which a plug-in, not
    compiled and not on a fused path, can afford."""
    fn = entry.fn

    @functools.wraps(fn)
    def watched(scores, mask=None, **params):
        try:
            weights = fn(scores, mask, **params)
        except HookError as err:  # its family's hook: what it returned
            raise PluginFailed(err.clause) from None
        except (Exception, SystemExit) as err:
            raise PluginFailed(f"it raised {_one(err)}") from None
        if torch.is_tensor(weights) and not bool(torch.isfinite(weights).all()):
            if torch.is_tensor(scores) and bool((torch.isnan(scores) | (scores == math.inf)).any()):
                raise PluginFailed(
                    "the model had diverged before it (NaN or infinite scores reached it, e.g. "
                    "after a NaN or infinite gradient)"
                )
            raise PluginFailed("it gave a NaN or infinite weight")
        return weights

    return watched


def ensure(spec: str) -> Normalizer:
    """The registered entry of ``spec``, loading it first in a process that has not (a worker)."""
    try:
        return get(spec)
    except ValueError:
        return load(spec)


def probe(entry: Normalizer) -> None:
    """Call ``entry`` as attention does, on seeded scores ``[2, 2, 6, 6]`` under a causal mask
    whose first row is empty, its learnable parameters as ``[1, H, 1, 1]`` tensors at their
    defaults, and refuse (``ValueError``, one sentence) an error, a result of another shape or
    dtype, a non-finite weight, weights other than its family's maths gives (the fast path's),
    a weight at a masked position that is not exactly 0, or a non-finite gradient."""
    gen = torch.Generator().manual_seed(0)
    scores = (3 * torch.randn(_B, _H, _L, _L, generator=gen)).requires_grad_()
    mask = torch.ones(_L, _L, dtype=torch.bool).tril()
    mask[0] = False
    params = {
        p.name: torch.full((1, _H, 1, 1), float(p.default), requires_grad=True)
        for p in entry.learnable
    }
    if entry.family is not None:  # the registry gives a family's hooks every parameter
        params = {p.name: p.default for p in entry.params} | params
    what = f"method {entry.name!r}"
    try:
        weights = entry.fn(scores, mask, check_finite=True, **params)
    except HookError as err:
        raise ValueError(f"{what}: {err.clause} (on a probe input).") from None
    except (Exception, SystemExit) as err:  # the user's function: whatever it raises is the refusal
        raise ValueError(f"{what} raised on a probe input: {_one(err)}.") from None
    if not torch.is_tensor(weights) or weights.shape != scores.shape:
        got = tuple(weights.shape) if torch.is_tensor(weights) else type(weights).__name__
        raise ValueError(
            f"{what} returned {got} for scores of shape {tuple(scores.shape)}; it must return "
            "weights of the scores' shape."
        )
    if weights.dtype != scores.dtype:
        raise ValueError(f"{what} returned {weights.dtype} weights for {scores.dtype} scores.")
    if not bool(torch.isfinite(weights).all()):
        raise ValueError(f"{what} returned a NaN or infinite weight on finite probe scores.")
    if entry.family is not None:  # its fast path runs the family's maths: the same weights
        try:
            ref = entry.family.weights(scores.detach(), mask, check_finite=True, **params)
        except HookError as err:
            raise ValueError(f"{what}: {err.clause} (on a probe input).") from None
        except (Exception, SystemExit) as err:
            raise ValueError(f"{what}: its family raised on a probe input: {_one(err)}.") from None
        if not torch.allclose(ref, weights.detach(), rtol=1e-5, atol=1e-6):
            gap = float((ref - weights.detach()).abs().max())
            raise ValueError(
                f"{what}: its family's maths gives other weights than its function on a probe "
                f"input (largest difference {gap:.3g}); pass fn=family.weights."
            )
        try:
            _probe_hooks(entry.family, scores.detach(), params, what)
        except HookError as err:
            raise ValueError(f"{what}: {err.clause} (on a probe input).") from None
    if bool((weights.detach()[..., ~mask] != 0).any()):
        raise ValueError(
            f"{what} gave a nonzero weight at a masked position; masked entries must be exactly "
            "0 (start from normalizers._contract.prepare and re-apply its `allowed`)."
        )
    if weights.requires_grad:
        try:
            grads = torch.autograd.grad(
                (weights * torch.randn(weights.shape, generator=gen)).sum(),
                [scores, *(t for t in params.values() if torch.is_tensor(t))],
                allow_unused=True,
            )
        except (Exception, SystemExit) as err:
            raise ValueError(f"{what} failed in backward on a probe input: {_one(err)}.") from None
        if any(g is not None and not bool(torch.isfinite(g).all()) for g in grads):
            raise ValueError(f"{what} has a NaN or infinite gradient on a probe input.")


def _probe_hooks(family, scores: torch.Tensor, params: dict, what: str) -> None:
    """Refuse what the naive maths cannot show but the tiles would compute otherwise: an
    element-wise hook (`Elementwise`'s f, `RowNormalised`'s u, a and ref) whose result on a
    score depends on the other scores of its row (run on the whole rows, then on two halves of
    the keys, as tiles do), a negative a, or an a that sums to 0 on a row where u is not 0."""
    if isinstance(family, Elementwise):
        rows = (*scores.shape[:-1], 1)
        r = family.row_of(torch.ones(rows), rows, **params)
        hooks = {"f": (family.f, (r,))}
    elif isinstance(family, RowNormalised):
        m = family.reference(scores, None)
        hooks = {"u": (family.u, (m,)), "a": (family.a, (m,)), "ref": (family.ref, ())}
    else:
        return
    constants = family.constants_of(params)
    half = scores.shape[-1] // 2
    values = {}
    with torch.no_grad():
        for name, (fn, args) in hooks.items():
            if fn is None:
                continue
            kw = {} if name == "ref" else constants

            def run(s, fn=fn, name=name, args=args, kw=kw):
                return per_score(fn, name, s, *args, **kw)

            values[name] = whole = run(scores)
            parts = torch.cat([run(scores[..., :half]), run(scores[..., half:])], dim=-1)
            if not torch.allclose(whole, parts, rtol=1e-5, atol=1e-6, equal_nan=True):
                raise ValueError(
                    f"{what}: its family's {name} is not element-wise (its value at a score "
                    "changed with the other scores of its row on a probe input); the fast path "
                    "sees part of a row at a time, so it must depend on each score alone."
                )
    if "a" in values:
        u, a = values["u"], values["a"]
        if bool((a < 0).any()):
            raise ValueError(
                f"{what}: its family's a returned a negative value on a probe input; a must be "
                ">= 0."
            )
        if bool(((a.sum(-1) == 0) & (u.abs().sum(-1) > 0)).any()):
            raise ValueError(
                f"{what}: its family's a sums to 0 on a row where u does not (on a probe input); "
                "a must be > 0 wherever u is not 0 (|u| <= a)."
            )


def _one(err: BaseException) -> str:
    """An exception as a clause: its type and its message's first line, without a final stop."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0].rstrip('.')}" if lines else type(err).__name__
