"""Families: a normalizer's maths in the form its fast paths need.

A registry entry declares its family (``Normalizer(..., family=...)``) with the family's maths
hooks; ``attend`` then runs that family's fast path (O(n) memory, its own backward), and the
entry's naive function is `weights` of the family: the same hooks on the whole score
matrix, so each formula is written once. A user's normalizer (``sharpattn.normalizers.register``,
``sharpattn leaderboard --method module:name``) that declares a family gets its fast paths too.

* `RowScaled`: softmax(β_i·s_ij), β_i a function of the row's visible keys n_i and the
  parameters (temperature, SSMax, length scaling, Llama 4, log-n). Fast path: the rows of q
  scaled by β, then one flash-attention call (torch's SDPA on any device).
* `Elementwise`: w_ij = f(s_ij, r_i), r_i a function of n_i and the parameters (sigmoid,
  ReLU). Fast path: one pass over key tiles, out_i = Σ_j w_ij·v_j, a backward that recomputes
  each tile; the built-in maps name their own kernels (C++ loops on the CPU), a user's map runs
  its ``f`` on each tile with autograd for f′.

Hooks are plain functions of tensors (picklable: module-level functions, not lambdas, so a
sweep's worker processes can use them). ``n`` is a float tensor ``[..., Lq, 1]`` of the row's
visible keys (0 for a row that sees none: its weights are 0 whatever a hook returns, but a hook
must not give NaN there; `log_n` is log max(n, 1)). Hooks receive every
parameter of the method as keywords (``**params``), the learnable ones as tensors
``[1, H, 1, 1]``; gradients reach a parameter through what the hook returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ._contract import finish, masked_softmax, prepare, visible_keys
from .stats import entropy

Tensor = torch.Tensor


@dataclass(frozen=True)
class RowScaled:
    """softmax(β_i·s_ij) over the allowed keys of row i, β_i = ``beta(n_i, **params)``: a number
    or a tensor broadcastable to ``[..., Lq, 1]`` (any sign; β = 0 is the uniform row).
    Computed as softmax(β·(s − max s)), so no β overflows. ``counts=False``: β does not depend on
    n (a temperature), ``beta`` is called with n = None and no path counts the visible keys (a
    pass over a per-row mask: about an eighth of softmax attention's time with one)."""

    beta: Callable[..., Any]
    counts: bool = True
    #: the fast path that runs this family (`sharpattn.attention.fast.path_of`)
    path: ClassVar[str] = "row_scaled"

    def weights(self, scores: Tensor, mask: Tensor | None = None, *, check_finite: bool = True,
                **params) -> Tensor:  # fmt: skip
        """The family's maths on the whole score matrix: the naive path of its members."""
        x, allowed = prepare(scores, mask, check_finite)
        n = visible_keys(allowed, dtype=x.dtype) if self.counts else None
        return finish(masked_softmax(x, allowed, self.beta(n, **params)), scores)


@dataclass(frozen=True)
class Elementwise:
    """w_ij = ``f(s_ij, r_i, **constants)`` at the allowed keys (exactly 0 elsewhere), with the
    per-row value r_i = ``row(n_i, **params)``. Rows need not sum to one.

    ``f`` is element-wise in s (a weight depends on its own score and its row only) and must be
    finite for any finite s (shift or clamp inside it). It sees only the parameters named in
    ``constants`` (plain numbers, not learnable ones: on the tiles a parameter reaches ``f`` as a
    constant, so a gradient could not flow to it); a learnable parameter enters through ``row``,
    whose gradient the fast path gives. ``kernel``: the name of a built-in tile kernel with this
    maths (``"sigmoid"``, ``"relu"``: loops in C++ on the CPU); None runs ``f`` itself on each
    tile (any device), its derivative by autograd."""

    f: Callable[..., Tensor]
    row: Callable[..., Any]
    constants: tuple[str, ...] = ()
    kernel: str | None = None
    path: ClassVar[str] = "elementwise"

    def weights(self, scores: Tensor, mask: Tensor | None = None, *, check_finite: bool = True,
                **params) -> Tensor:  # fmt: skip
        """The family's maths on the whole score matrix: the naive path of its members."""
        x, allowed = prepare(scores, mask, check_finite)
        r = self.row(visible_keys(allowed, dtype=x.dtype), **params)
        w = self.f(x, r, **self.constants_of(params))
        return finish(w.masked_fill(~allowed, 0.0), scores)

    def constants_of(self, params: dict[str, Any]) -> dict[str, Any]:
        """The parameters ``f`` reads, from a call's ``params``."""
        return {name: params[name] for name in self.constants if name in params}


@dataclass(frozen=True)
class Adaptive:
    """softmax(β_i·s_ij) over the allowed keys of row i, β_i = ``beta(H_i, **params)`` from the
    entropy H_i (nats) of the row's softmax(s): a temperature that depends on how dispersed the
    row is. ``entropy_eps``: the naive path's entropy is −Σ p·log(p + eps) (adaptive temperature
    takes the reference code's 1e-9); the fast path computes the exact entropy (eps = 0), up
    to n·eps above it. ``kernel``: a built-in path with this maths (``"adaptive"``: the C++
    slabs on the CPU); None runs the two-pass path (the entropy streamed over key tiles, then
    one flash call with β-scaled queries), gradients through β included."""

    beta: Callable[..., Any]
    entropy_eps: float = 0.0
    kernel: str | None = None
    path: ClassVar[str] = "adaptive"

    def weights(self, scores: Tensor, mask: Tensor | None = None, *, check_finite: bool = True,
                **params) -> Tensor:  # fmt: skip
        """The family's maths on the whole score matrix: the naive path of its members."""
        x, allowed = prepare(scores, mask, check_finite)
        h = entropy(masked_softmax(x, allowed), eps=self.entropy_eps).unsqueeze(-1)
        beta = self.beta(h, **params)
        return finish(masked_softmax(x, allowed, beta), scores)


@dataclass(frozen=True)
class Sink:
    """exp(s_ij) / (exp(b_i) + Σ_j exp(s_ij)) over the allowed keys of row i: softmax with one
    more key, of score b_i and value 0, that every query sees (rows sum to less than one; a row
    with no allowed key is all zeros, its mass on the sink). b_i = ``bias(n_i, **params)``, a
    number or a tensor broadcastable to ``[..., Lq, 1]``. Fast path: the softmax output times
    σ(lse − b) per row (flash kernel with log-sum-exp), or the sink as one more key of SDPA."""

    bias: Callable[..., Any]
    path: ClassVar[str] = "sink"

    def weights(self, scores: Tensor, mask: Tensor | None = None, *, check_finite: bool = True,
                **params) -> Tensor:  # fmt: skip
        """The family's maths on the whole score matrix: the naive path of its members."""
        x, allowed = prepare(scores, mask, check_finite)
        b = self.bias(visible_keys(allowed, dtype=x.dtype), **params)
        b = torch.as_tensor(b, dtype=x.dtype, device=x.device).expand(*x.shape[:-1], 1)
        # softmax over [keys..., sink]: the sink column is always allowed, so no row is empty
        logits = torch.cat([x.masked_fill(~allowed, float("-inf")), b], dim=-1)
        w = torch.softmax(logits, dim=-1)[..., :-1].masked_fill(~allowed, 0.0)
        return finish(w, scores)


FAMILIES = (RowScaled, Adaptive, Sink, Elementwise)


def check(family: Any, owner: str, params: tuple = (), learnable: tuple = ()) -> None:
    """Refuse (``ValueError``, one sentence naming ``owner``) a family that could not run: not
    one of `FAMILIES`, a hook that is not callable, or an `Elementwise` constant
    that is not a parameter of the method or is a learnable one."""
    if not isinstance(family, FAMILIES):
        names = ", ".join(f.__name__ for f in FAMILIES)
        raise ValueError(f"method {owner!r}: family must be one of {names}, got {family!r}.")
    table = {RowScaled: ("beta",), Adaptive: ("beta",), Sink: ("bias",), Elementwise: ("f", "row")}
    hooks = next(names for kind, names in table.items() if isinstance(family, kind))
    for attr in hooks:
        if not callable(getattr(family, attr)):
            raise ValueError(
                f"method {owner!r}: the family's {attr} must be a function, got "
                f"{getattr(family, attr)!r}."
            )
    if isinstance(family, Elementwise):
        for name in family.constants:
            if name not in params:
                raise ValueError(
                    f"method {owner!r}: its family's constant {name!r} is not one of its "
                    f"parameters ({', '.join(params) or 'it has none'})."
                )
            if name in learnable:
                raise ValueError(
                    f"method {owner!r}: learnable parameter {name} cannot be a constant of f "
                    "(no gradient reaches it on the tiles); let it enter through row."
                )


__all__ = ["FAMILIES", "Adaptive", "Elementwise", "RowScaled", "Sink", "check"]
