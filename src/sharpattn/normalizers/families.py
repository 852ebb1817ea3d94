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
* `RowNormalised`: w_ij = u(s_ij, m_i)/Σ_j a(s_ij, m_i), m_i a row reference that keeps both
  finite (power, signed, softpick). Fast path: tiles with running sums; the built-in maps name
  their own kernels, a user's map runs two passes (m, then the sums) with autograd for u′, a′.
* `TopK`: softmax over the ``count`` largest scores of a row (top-k, hardmax). Fast path: a
  threshold per row, then one output pass (`sparse_tiled.topk`).
* `Sparse`: α-entmax(θ_i·s_ij) (sparsemax, 1.5-entmax, α-entmax, ASEntmax): a threshold τ_i per
  row. Fast path: candidates and Newton steps for τ, then one output pass (`sparse_tiled`).
* `StickBreaking`: σ(s_ij)·Π_{j<k<i}(1 − σ(s_ik)) (causal only). Fast path: log-space running
  sums over reversed key tiles (`stick_tiled`).

Hooks are plain functions of tensors (picklable: module-level functions, not lambdas, so a
sweep's worker processes can use them). ``n`` is a float tensor ``[..., Lq, 1]`` of the row's
visible keys (0 for a row that sees none: its weights are 0 whatever a hook returns, but a hook
must not give NaN there; `log_n` is log max(n, 1)). Hooks receive every
parameter of the method as keywords (``**params``), the learnable ones as tensors
``[1, H, 1, 1]``; gradients reach a parameter through what the hook returns.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from . import _entmax  # the entmax package's functions in a form torch.compile can trace
from ._contract import (
    HookError,
    as_4d,
    finish,
    fits,
    masked_softmax,
    on_device,
    prepare,
    shift_to_row_max,
    visible_keys,
)
from .stats import entropy

Tensor = torch.Tensor


def _what(value) -> str:
    """A hook's result in words: a tensor by its dtype and shape, anything else by its repr."""
    if torch.is_tensor(value):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def per_row(value, hook: str, rows: tuple) -> Any:
    """``value``, the result of a per-row hook (β, a sink's bias, r, θ, α), if it is one:
    a real number, or a floating tensor of one value per row of scores ``rows`` (``[..., Lq,
    1]``: a shape that broadcasts to it without growing it, e.g. ``[1, H, 1, 1]``); else
    `HookError`. Shapes and types only (no host synchronisation)."""
    if _is_real(value):
        return value
    if torch.is_tensor(value) and value.is_floating_point():
        if fits(value.shape, rows):
            return value
    raise HookError(
        f"its family's {hook} returned {_what(value)}; it must return a number or a floating "
        f"tensor of one value per row, broadcastable to [..., Lq, 1] (here {list(rows)})"
    )


def per_score(hook_fn: Callable, hook: str, x: Tensor, *args, **constants) -> Tensor:
    """``hook_fn(x, *args, **constants)`` for an element-wise hook (f, u, a, ref), checked: a
    floating tensor of the scores' shape (cast to their dtype), made without changing ``x`` in
    place; else `HookError`."""
    # (an inference tensor has no version counter; torch.compile traces no in-place check)
    version = None if torch.compiler.is_compiling() or x.is_inference() else x._version
    value = hook_fn(x, *args, **constants)
    if version is not None and x._version != version:
        raise HookError(
            f"its family's {hook} changed the scores in place; it must return a new tensor "
            "(torch.sigmoid(s), not s.sigmoid_())"
        )
    if torch.is_tensor(value) and value.is_floating_point() and value.shape == x.shape:
        return value.to(x.dtype)
    raise HookError(
        f"its family's {hook} returned {_what(value)} for scores of shape {list(x.shape)}; it "
        "must return a floating tensor of the scores' shape (one value per score)"
    )


@dataclass(frozen=True)
class Kernel:
    """The fast kernels of a built-in map, held by its family (``kernel=``): the one place that
    says what a map has, from which every backend reads its selector.

    * ``name``: the map's name in every backend: the C++ loops ``{loop}_{name}``
      (``attention/cpu/native/tiles.cpp``), the Triton kernels' ``MAP`` constant, and the key of
      its built-in path in ``attention.dispatch.fast.FAST`` for the families with their own paths
      (adaptive, top-k, the entmax family, stick-breaking).
    * ``tiles``: its maths on one tile of scores in PyTorch, a `TileMaths` class (the
      element-wise and row-normalised families; None for the others).
    * ``cpp``: whether it has C++ loops (float32 on the CPU); ``triton``: whether it has
      Triton kernels (CUDA).
    * ``row_grad``: whether its backward gives the gradient of the per-row values (sigmoid's
      learnable bias enters through them).

    ``attention.devices.backend`` chooses among them for a call, in one place.
    """

    name: str
    tiles: type | None = None
    cpp: bool = False
    triton: bool = False
    row_grad: bool = False


_LOG2E = 1.4426950408889634


def exp_(x: Tensor) -> Tensor:
    """e^x in place as 2^(x·log2 e): 64 µs per 2^18 float32 entries on a 2-core AMD EPYC
    against 157 µs for ``torch.exp`` (relative error |x|·ε more, as the scores' own rounding)."""
    return x.mul_(_LOG2E).exp2_()


def masked_(x: Tensor, keep: Tensor | None) -> Tensor:
    """x with a tile's disallowed entries set to 0, in place (``keep``: 1 where allowed, or None)."""
    return x if keep is None else x.mul_(keep)


class TileMaths:
    """A built-in map's maths on one tile ``s`` ``[B, H, r, c]`` of scores (disallowed entries
    0, ``mask`` the tile's 0/1 keep or None), in place where it can (both methods may overwrite
    ``s``); the tiled paths (``attention.cpu.tiled``) walk the tiles with it.

    * ``weights(s, ref, mask)``: element-wise maps return w (``ref`` the row tensor);
      normalised ones return (u, Σ_j a_j) relative to the row reference ``ref`` = m.
    * ``grad(s, dp, ref, mask[, d, z])``: (dL/ds, w) given dP = dO·vᵀ (and D = dO·out, Z).

    Normalised maps (``normalised``) also give ``ref_of(s)`` (the tile's candidate for m) and
    ``factor(m_old, m_new)``, the rescaling of sums taken relative to m_old. ``SHIFT_ABOVE``: a
    constant the map's C++ and Triton kernels read too (softpick's).
    """

    normalised = False
    SHIFT_ABOVE = 0.0
    #: the default of the map's power p, where it has one (relu's, power's)
    P = 0.0
    #: the name of the C++ loops a call runs (`Kernel.name`), set by the tiled path where they
    #: run; None: the PyTorch maths above
    native: str | None = None

    def __init__(self, **params):
        self.params = params

    @property
    def p(self) -> float:
        """The map's power p (a built-in's parameter; its default `P` where the call gives none)."""
        return float(self.params.get("p", self.P))

    def native_args(self) -> tuple[str | None, float, float]:
        """(the C++ loops' name, p, ``SHIFT_ABOVE``)."""
        return self.native, self.p, self.SHIFT_ABOVE


def log_n(n: Tensor) -> Tensor:
    """log n of each row's count of visible keys ``n`` (the ``n`` a hook receives), with n
    clamped to >= 1 so a row without a key gives 0, not −inf: the length term of a hook such as
    ``bias - log_n(n)`` (sigmoid, sinks) or ``s * log_n(n)`` (SSMax)."""
    return torch.log(n.clamp_min(1.0))


def _rows_of(x: Tensor) -> tuple:
    return (*x.shape[:-1], 1)


@dataclass(frozen=True)
class RowScaled:
    """softmax(β_i·s_ij) over the allowed keys of row i, β_i = ``beta(n_i, **params)``: a number
    or a tensor broadcastable to ``[..., Lq, 1]`` (any sign; β = 0 is the uniform row).
    Computed as softmax(β·(s − max s)), so no β overflows. ``counts=False``: β does not depend on
    n (a temperature), ``beta`` is called with n = None and no path counts the visible keys (a
    pass over a per-row mask: about an eighth of softmax attention's time with one)."""

    beta: Callable[..., Any]
    counts: bool = True
    #: the fast path that runs this family (`sharpattn.attention.dispatch.fast.path_of`)
    path: ClassVar[str] = "row_scaled"

    def weights(
        self, scores: Tensor, mask: Tensor | None = None, *, check_finite: bool = True, **params
    ) -> Tensor:
        """The family's maths on the whole score matrix: the naive path of its members."""
        x, allowed = prepare(scores, mask, check_finite)
        n = visible_keys(allowed, dtype=x.dtype) if self.counts else None
        return finish(masked_softmax(x, allowed, self.beta_of(n, _rows_of(x), **params)), scores)

    def beta_of(self, n, rows: tuple, **params):
        """β of rows ``rows`` (``[..., Lq, 1]``) with visible keys ``n``, checked (`per_row`)."""
        return per_row(self.beta(n, **params), "beta", rows)


@dataclass(frozen=True)
class Elementwise:
    """w_ij = ``f(s_ij, r_i, **constants)`` at the allowed keys (exactly 0 elsewhere), with the
    per-row value r_i = ``row(n_i, **params)``. Rows need not sum to one.

    ``f`` is element-wise in s (a weight depends on its own score and its row only) and must be
    finite for any finite s (shift or clamp inside it). It sees only the parameters named in
    ``constants`` (plain numbers, not learnable ones: on the tiles a parameter reaches ``f`` as a
    constant, so a gradient could not flow to it); a learnable parameter enters through ``row``,
    whose gradient the fast path gives. ``kernel``: a built-in map's `Kernel` record (sigmoid's,
    relu's: its tile maths, C++ loops, Triton kernels); None runs ``f`` itself on each tile (any
    device), its derivative by autograd."""

    f: Callable[..., Tensor]
    row: Callable[..., Any]
    constants: tuple[str, ...] = ()
    kernel: Kernel | None = None
    path: ClassVar[str] = "elementwise"

    def weights(
        self, scores: Tensor, mask: Tensor | None = None, *, check_finite: bool = True, **params
    ) -> Tensor:
        """The family's maths on the whole score matrix: the naive path of its members."""
        x, allowed = prepare(scores, mask, check_finite)
        r = self.row_of(visible_keys(allowed, dtype=x.dtype), _rows_of(x), **params)
        w = self.weight(x, r, **self.constants_of(params))
        return finish(w.masked_fill(~allowed, 0.0), scores)

    def row_of(self, n: Tensor, rows: tuple, **params):
        """r of rows ``rows`` with visible keys ``n``, checked (`per_row`)."""
        return per_row(self.row(n, **params), "row", rows)

    def weight(self, s: Tensor, r, **constants) -> Tensor:
        """f(s, r), checked (`per_score`)."""
        return per_score(self.f, "f", s, r, **constants)

    def constants_of(self, params: dict[str, Any]) -> dict[str, Any]:
        """The parameters ``f`` reads, from a call's ``params``."""
        return {name: params[name] for name in self.constants if name in params}


@dataclass(frozen=True)
class Adaptive:
    """softmax(β_i·s_ij) over the allowed keys of row i, β_i = ``beta(H_i, **params)`` from the
    entropy H_i (nats) of the row's softmax(s): a temperature that depends on how dispersed the
    row is. ``entropy_eps``: the naive path's entropy is −Σ p·log(p + eps) (adaptive temperature
    takes the reference code's 1e-9); the fast path computes the exact entropy (eps = 0), up
    to n·eps above it. ``kernel``: the `Kernel` record of a built-in path with this maths (adaptive's: the C++
    slabs on the CPU); None runs the two-pass path (the entropy streamed over key tiles, then
    one flash call with β-scaled queries), gradients through β included."""

    beta: Callable[..., Any]
    entropy_eps: float = 0.0
    kernel: Kernel | None = None
    path: ClassVar[str] = "adaptive"

    def weights(
        self, scores: Tensor, mask: Tensor | None = None, *, check_finite: bool = True, **params
    ) -> Tensor:
        """The family's maths on the whole score matrix: the naive path of its members."""
        x, allowed = prepare(scores, mask, check_finite)
        h = entropy(masked_softmax(x, allowed), eps=self.entropy_eps).unsqueeze(-1)
        return finish(masked_softmax(x, allowed, self.beta_of(h, _rows_of(x), **params)), scores)

    def beta_of(self, h: Tensor, rows: tuple, **params):
        """β of rows ``rows`` with entropies ``h``, checked (`per_row`)."""
        return per_row(self.beta(h, **params), "beta", rows)


@dataclass(frozen=True)
class Sink:
    """exp(s_ij) / (exp(b_i) + Σ_j exp(s_ij)) over the allowed keys of row i: softmax with one
    more key, of score b_i and value 0, that every query sees (rows sum to less than one; a row
    with no allowed key is all zeros, its mass on the sink). b_i = ``bias(n_i, **params)``, a
    number or a tensor broadcastable to ``[..., Lq, 1]``. Fast path: the softmax output times
    σ(lse − b) per row (flash kernel with log-sum-exp), or the sink as one more key of SDPA."""

    bias: Callable[..., Any]
    path: ClassVar[str] = "sink"

    def weights(
        self, scores: Tensor, mask: Tensor | None = None, *, check_finite: bool = True, **params
    ) -> Tensor:
        """The family's maths on the whole score matrix: the naive path of its members."""
        x, allowed = prepare(scores, mask, check_finite)
        b = self.bias_of(visible_keys(allowed, dtype=x.dtype), _rows_of(x), **params)
        b = on_device(b, x.dtype, x.device).expand(*x.shape[:-1], 1)
        # softmax over [keys..., sink]: the sink column is always allowed, so no row is empty
        logits = torch.cat([x.masked_fill(~allowed, float("-inf")), b], dim=-1)
        w = torch.softmax(logits, dim=-1)[..., :-1].masked_fill(~allowed, 0.0)
        return finish(w, scores)

    def bias_of(self, n: Tensor, rows: tuple, **params):
        """b of rows ``rows`` with visible keys ``n``, checked (`per_row`)."""
        return per_row(self.bias(n, **params), "bias", rows)


@dataclass(frozen=True)
class RowNormalised:
    """w_ij = u_ij / Σ_j a_ij over the allowed keys of row i (u_ij itself where the sum is 0,
    which is 0 for a map with |u| <= a), with
    u_ij = ``u(s_ij, m_i, **constants)`` and a_ij = ``a(s_ij, m_i, **constants)`` (``a`` None:
    a = u, w = u/Σu). Rows need not sum to one (|u| <= a gives Σ|w| <= 1).

    m_i is the row's reference: the largest of 0 and ``ref(s_ij)`` over its allowed keys
    (``ref`` element-wise; None: m = 0). It only keeps the numbers finite: u and a must scale
    alike with m (u(s, m)/a(s, m) and the ratios between keys do not depend on it, e.g. both
    carry e^{−m} or m^{−p}), so no gradient flows through it. ``u`` and ``a`` are element-wise
    in s, ``a`` >= 0, both finite for any finite s and m (with m above the row's ``ref``).
    ``constants``: the parameters they read (plain numbers, as `Elementwise`'s; a learnable
    parameter cannot enter this family). ``kernel``: a built-in map's `Kernel` record
    (power's, signed's, softpick's, StableMax's: running sums rescaled when m grows, C++ loops on
    the CPU, Triton on CUDA); None runs two passes over key tiles (m, then the sums; any
    device), u′ and a′ by autograd on each tile."""

    u: Callable[..., Tensor]
    a: Callable[..., Tensor] | None = None
    ref: Callable[..., Tensor] | None = None
    constants: tuple[str, ...] = ()
    kernel: Kernel | None = None
    path: ClassVar[str] = "row_normalised"

    def weights(
        self, scores: Tensor, mask: Tensor | None = None, *, check_finite: bool = True, **params
    ) -> Tensor:
        """The family's maths on the whole score matrix: the naive path of its members."""
        x, allowed = prepare(scores, mask, check_finite)
        m = self.reference(x, allowed)
        u, total = self.terms(x, m, allowed, **self.constants_of(params))
        return finish(u / torch.where(total > 0, total, torch.ones_like(total)), scores)

    def reference(self, x: Tensor, allowed: Tensor | None) -> Tensor:
        """m per row ``[..., r, 1]``, detached: max(0, max of ``ref`` over the allowed keys)."""
        if self.ref is None:
            return x.new_zeros(*x.shape[:-1], 1)
        r = per_score(self.ref, "ref", x.detach())
        r = r if allowed is None else r.masked_fill(~allowed, 0.0)
        return r.amax(dim=-1, keepdim=True).clamp_min(0.0)

    def terms(self, x: Tensor, m: Tensor, allowed: Tensor | None, **constants):
        """(u, Σ_j a) of scores ``x`` (a tile or the matrix) against the reference m, 0 at the
        keys ``allowed`` leaves out."""
        u = per_score(self.u, "u", x, m, **constants)
        a = u if self.a is None else per_score(self.a, "a", x, m, **constants)
        if allowed is not None:
            u, a = u.masked_fill(~allowed, 0.0), a.masked_fill(~allowed, 0.0)
        return u, a.sum(dim=-1, keepdim=True)

    def constants_of(self, params: dict[str, Any]) -> dict[str, Any]:
        """The parameters ``u`` and ``a`` read, from a call's ``params``."""
        return {name: params[name] for name in self.constants if name in params}


@dataclass(frozen=True)
class TopK:
    """softmax over the k_i = ``count(**params)`` largest allowed scores of each row, 0
    elsewhere (a row with fewer allowed keys keeps them all). Ties at the k-th place are broken
    in key order: every score above the k-th largest is kept, then the first keys whose score
    equals it. With k = 1 the weights are one-hot (hardmax) and their gradient is 0.

    ``count`` returns a plain integer >= 1 (a parameter, not a tensor). ``kernel``: the `Kernel`
    record of a built-in path with this maths (top-k's, hardmax's); None runs the top-k path
    (`sparse_tiled.topk`: a threshold per row from the tiles, then the kept keys) with k =
    ``count(**params)``, which is this maths whatever the plug-in."""

    count: Callable[..., int]
    kernel: Kernel | None = None
    path: ClassVar[str] = "topk"

    def weights(
        self, scores: Tensor, mask: Tensor | None = None, *, check_finite: bool = True, **params
    ) -> Tensor:
        """The family's maths on the whole score matrix: the naive path of its members."""
        x, allowed = prepare(scores, mask, check_finite)
        kk = min(self.count_of(**params), x.shape[-1])
        logits = x.masked_fill(~allowed, float("-inf"))
        tau = logits.topk(kk, dim=-1).values[..., -1:]  # the k-th largest (−inf: keep all allowed)
        above = logits > tau
        tie = (logits == tau) & allowed
        need = kk - above.sum(-1, keepdim=True)  # how many of the ties at τ are kept, in key order
        keep = above | (tie & (tie.cumsum(-1) <= need))
        return finish(masked_softmax(x, keep), scores)

    def count_of(self, **params) -> int:
        """k of a call with ``params``: an integer >= 1, else `HookError`."""
        k = self.count(**params)
        if isinstance(k, numbers.Integral) and not isinstance(k, bool) and k >= 1:
            return int(k)
        raise HookError(f"its family's count returned {_what(k)}; it must return an integer >= 1")


@dataclass(frozen=True)
class Sparse:
    """α-entmax of θ_i·s_ij over the allowed keys of row i (Peters, Niculae & Martins 2019):
    p_ij = [(α−1)·θ_i·s_ij − τ_i]_+^{1/(α−1)} with τ_i such that the row sums to one; α = 2 is
    sparsemax (Martins & Astudillo 2016), α → 1 softmax.

    ``alpha``: a number > 1, or a function of the parameters (``alpha(**params)``: a number or
    a tensor broadcastable to ``[..., Lq, 1]``, e.g. per head). ``scale``: θ_i =
    ``scale(n_i, **params)`` > 0 from the row's visible keys (None: θ = 1; ASEntmax's length
    scaling). Computed on θ·(s − max s) (shift invariant, so no score overflows); α = 2 and
    α = 1.5 (numbers) exactly by sorting, other α by ``n_iter`` bisection steps (a parameter of
    that name; None or absent: enough for the dtype's precision, `_entmax.bisect_steps`).
    ``kernel``: the `Kernel` record of a built-in path with this maths (sparsemax's,
    1.5-entmax's, α-entmax's, ASEntmax's); None runs the entmax
    family's tile path with this α and θ (threshold by Newton steps, then one output pass;
    gradients reach θ's parameters; a learnable α or α > 2 takes blocks of query rows, the
    naive maths with autograd)."""

    alpha: float | Callable[..., Any] = 1.5
    scale: Callable[..., Any] | None = None
    kernel: Kernel | None = None
    path: ClassVar[str] = "sparse"

    def alpha_of(self, params: dict[str, Any], rows: tuple | None = None):
        """α of a call with ``params``: the family's number, or its function's result checked
        (`per_row`, rows ``rows`` ``[..., Lq, 1]``; a number in `_entmax.SAFE_ALPHA`)."""
        if not callable(self.alpha):
            return self.alpha
        alpha = per_row(self.alpha(**params), "alpha", rows or (1, 1, 1, 1))
        low, high = _entmax.SAFE_ALPHA
        if not torch.is_tensor(alpha) and not low <= alpha <= high:
            raise HookError(
                f"its family's alpha returned {alpha!r}; it must be in [{low:g}, {high:g}]"
            )
        return alpha

    def scale_of(self, n: Tensor, rows: tuple, **params):
        """θ of rows ``rows`` with visible keys ``n``, checked (`per_row`)."""
        return per_row(self.scale(n, **params), "scale", rows)

    def weights(
        self, scores: Tensor, mask: Tensor | None = None, *, check_finite: bool = True, **params
    ) -> Tensor:
        """The family's maths on the whole score matrix: the naive path of its members."""
        x, allowed = prepare(scores, mask, check_finite)
        alpha = self.alpha_of(params, _rows_of(x))
        if torch.is_tensor(alpha):
            alpha = alpha.to(x.dtype)
            if check_finite:
                check_range(alpha, "alpha", *_entmax.SAFE_ALPHA)
        z = shift_to_row_max(x, allowed)
        if self.scale is not None:
            theta = self.scale_of(visible_keys(allowed, dtype=x.dtype), _rows_of(x), **params)
            if check_finite:
                check_range(theta, "scale", 0.0, math.inf, low_open=True)
            big = torch.finfo(x.dtype).max
            # θ > 0 and s − max s <= 0: θ·(s − max s) <= 0 cannot overflow to +inf
            z = (theta * z).clamp(-big, big)
        # a disallowed key below max − 1/(α − 1) gets exactly 0 (the entmax has no mask)
        z = torch.where(allowed, z, -1.0 / (alpha - 1.0) - 1.0)
        if not torch.is_tensor(alpha) and alpha == 2:
            p = _entmax.sparsemax(z, dim=-1)
        elif not torch.is_tensor(alpha) and alpha == 1.5:
            p = _entmax.entmax15(z, dim=-1)
        else:
            p = _entmax.entmax_bisect(z, alpha, -1, params.get("n_iter"))
        p = p.masked_fill(~allowed, 0.0).masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)
        return finish(p, scores)


@dataclass(frozen=True)
class StickBreaking:
    """Stick-breaking (Tan et al. 2025): w_ij = σ(s_ij)·Π_{j<k<i}(1 − σ(s_ik)) for the allowed
    keys j before query i's own key position i + ``query_offset`` (default Lk − Lq), or up to it
    with ``attend_current`` (the parameters of those names; the product then runs over
    j < k <= i). Causal only: an allowed key past the query's position raises ``ValueError``
    (with ``check_finite``, which reads the mask). Computed in log space, the product a reversed
    exclusive cumulative sum of log σ(−s). No hooks: a plug-in that declares it gets the
    stick-breaking tile path (log-space running sums over reversed key tiles), which is this
    maths, given every parameter of ``reads`` the method declares (a ``shift`` and
    ``shift_log_position`` included). A method of this family always takes ``query_offset``
    (the registry adds it where the entry leaves it out): a path that cuts the queries into
    blocks tells each block where it starts. ``kernel``: the built-in's `Kernel` record (the
    same path, C++ loops on the CPU, Triton on CUDA)."""

    kernel: Kernel | None = None
    path: ClassVar[str] = "stick_breaking"
    #: the parameters its maths reads (every path is given them, none other)
    reads: ClassVar[tuple[str, ...]] = (
        "attend_current",
        "query_offset",
        "shift",
        "shift_log_position",
    )

    def weights(
        self, scores: Tensor, mask: Tensor | None = None, *, check_finite: bool = True, **params
    ) -> Tensor:
        """The family's maths on the whole score matrix: the naive path of its members."""
        if torch.is_tensor(scores) and scores.dim() < 2:
            raise ValueError(
                "stick_breaking needs scores [..., Lq, Lk] (it reads the query position from "
                f"Lq), got shape {tuple(scores.shape)}."
            )
        x, allowed = prepare(scores, mask, check_finite)
        lq, lk = x.shape[-2], x.shape[-1]
        offset = params.get("query_offset")
        i = torch.arange(lq, device=x.device).unsqueeze(-1)
        j = torch.arange(lk, device=x.device)
        current = i + (lk - lq if offset is None else offset)  # (Lq, 1): the key position
        if check_finite and bool((allowed & (j > current)).any()):  # a host sync: checks only
            raise ValueError(
                "stick_breaking is causal only: query i may attend only to keys j <= i + "
                "(Lk − Lq); pass causal=True (or a mask inside the causal one)."
            )
        if not params.get("attend_current", False):
            allowed = allowed & (j < current)
        shift, per_position = params.get("shift", 0.0), params.get("shift_log_position", 0.0)
        if torch.is_tensor(shift) or torch.is_tensor(per_position) or shift or per_position:
            start = lk - lq if offset is None else offset  # query row 0's key position
            x = x + score_shift(lq, start, shift, per_position, x)
        log_keep = F.logsigmoid(-x).masked_fill(~allowed, 0.0)  # log(1 − σ(s_ik)), 0 if masked
        # Σ_{k>j} log_keep_k: cumulative sum from the right, shifted by one (no subtraction)
        later = F.pad(torch.cumsum(log_keep.flip(-1), dim=-1).flip(-1)[..., 1:], (0, 1))
        w = torch.exp(F.logsigmoid(x) + later).masked_fill(~allowed, 0.0)
        return finish(w, scores)


def check_range(value, hook: str, low: float, high: float, *, low_open: bool = False) -> None:
    """`HookError` unless every value of a hook's result (a number or a tensor) is in [low,
    high] (``low_open``: (low, high]). Reads a tensor on the host: only where values are
    checked."""
    t = torch.as_tensor(value).detach()
    bad = torch.isnan(t) | (t <= low if low_open else t < low) | (t > high)
    if bool(bad.any()):
        got = float(t[bad][0]) if t.dim() else float(t)
        if high == math.inf:
            where = f"{'>' if low_open else '>='} {low:g}"
        else:
            where = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
        raise HookError(f"its family's {hook} returned {got!r}; it must be {where}")


def score_shift(lq: int, offset: int, shift, shift_log_position, like: Tensor) -> Tensor:
    """Stick-breaking's score shift b_i = ``shift`` + ``shift_log_position``·log(i + offset + 1)
    ``[1|B, 1|H, Lq, 1]`` (query i's 1-based key position; −1 gives −log i, which keeps long rows
    from spending the stick on their nearest keys), in ``like``'s compute dtype; ``shift`` a
    number or a per-head (per-row) tensor."""
    cd = torch.promote_types(like.dtype, torch.float32)
    pos = torch.arange(1, lq + 1, dtype=cd, device=like.device).add_(offset).clamp_(min=1.0)
    b = on_device(shift_log_position, cd, like.device) * torch.log(pos)[:, None]
    b = on_device(shift, cd, like.device) + b
    return as_4d(b)


FAMILIES = (RowScaled, Adaptive, Sink, Elementwise, RowNormalised, TopK, Sparse, StickBreaking)

#: each family's hooks: (the functions it must have, those it may leave None)
HOOKS = {
    RowScaled: (("beta",), ()),
    Adaptive: (("beta",), ()),
    Sink: (("bias",), ()),
    Elementwise: (("f", "row"), ()),
    RowNormalised: (("u",), ("a", "ref")),
    TopK: (("count",), ()),
    Sparse: ((), ("scale",)),
    StickBreaking: ((), ()),
}


def check(family: Any, owner: str, params: tuple = (), learnable: tuple = ()) -> None:
    """Refuse (``ValueError``, one sentence naming ``owner``) a family that could not run: not
    one of `FAMILIES`, a hook that is not callable, a `Sparse` α that is neither a
    number > 1 nor a function, or an `Elementwise` or `RowNormalised` constant that is not a
    parameter of the method or is a learnable one."""
    if not isinstance(family, FAMILIES):
        names = ", ".join(f.__name__ for f in FAMILIES)
        raise ValueError(f"method {owner!r}: family must be one of {names}, got {family!r}.")
    kernel = getattr(family, "kernel", None)
    if isinstance(kernel, str):
        raise ValueError(
            f"method {owner!r}: the family names the built-in kernel {kernel!r} by name; a family "
            "holds a built-in map's Kernel record, or None to run its own hooks on the tiles."
        )
    if kernel is not None and not isinstance(kernel, Kernel):
        raise ValueError(
            f"method {owner!r}: the family's kernel must be a Kernel record or None, got {kernel!r}."
        )
    needed, optional = HOOKS[type(family)]
    for attr in needed + optional:
        hook = getattr(family, attr)
        if not callable(hook) and (attr in needed or hook is not None):
            raise ValueError(
                f"method {owner!r}: the family's {attr} must be a function"
                f"{'' if attr in needed else ' or None'}, got {hook!r}."
            )
    if isinstance(family, Sparse) and not callable(family.alpha):
        alpha = family.alpha
        low, high = _entmax.SAFE_ALPHA  # where the weights keep the dtype's precision
        number = isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
        if not (number and low <= alpha <= high):
            raise ValueError(
                f"method {owner!r}: the family's alpha must be a number in [{low:g}, {high:g}] "
                f"or a function of the parameters, got {family.alpha!r}."
            )
    if isinstance(family, (Elementwise, RowNormalised)):
        elementwise = isinstance(family, Elementwise)
        reads = "f" if elementwise else "u and a"
        enters = "let it enter through row" if elementwise else "this family has no learnable ones"
        for name in family.constants:
            if name not in params:
                raise ValueError(
                    f"method {owner!r}: its family's constant {name!r} is not one of its "
                    f"parameters ({', '.join(params) or 'it has none'})."
                )
            if name in learnable:
                raise ValueError(
                    f"method {owner!r}: learnable parameter {name} cannot be a constant of "
                    f"{reads} (no gradient reaches it on the tiles); {enters}."
                )


__all__ = [
    "FAMILIES",
    "Adaptive",
    "Elementwise",
    "HookError",
    "RowNormalised",
    "RowScaled",
    "Sink",
    "Sparse",
    "StickBreaking",
    "TopK",
    "check",
    "log_n",
]
