"""Sparse normalizers: exact zeros outside a support (top-k, arg-max, sparsemax / entmax).

Each is a member of a family (`families.TopK`, `families.Sparse`), whose ``weights`` hold the
maths. sparsemax and α-entmax come from the ``entmax`` package (Peters, Niculae & Martins),
through `_entmax` (the same computations as Functions ``torch.compile`` can trace). They take
no mask, so disallowed keys get a finite logit low enough that the mapping gives them exactly
zero weight (below max − 1/(α−1)), and are zeroed again after. Both are shift-invariant, so they are given s − max s: at |s| = 1e8 in float32 the bisection's
bracket max − 1 would round to max (NaN weights) and a masked key's fill value would tie the
maximum (rows summing to 1/2); on s − max s neither happens.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from . import _entmax
from ._contract import masked_softmax, normalizer, on_device, prepare
from .families import Kernel, Sparse, TopK
from .registry import Normalizer, Param, register

Tensor = torch.Tensor


@normalizer
def topk(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    top_k: int = 8,
    check_finite: bool = True,
) -> Tensor:
    """softmax over the ``top_k`` largest allowed scores of each row, 0 elsewhere.

    Rows with fewer than ``top_k`` allowed keys keep them all (plain softmax). Ties at the k-th
    place are broken deterministically, in key order: every score above the k-th largest is
    kept, then the first keys (lowest index) whose score equals it, until ``top_k`` are kept.
    (Named ``top_k`` because ``k`` is the key tensor of [`attend`][sharpattn.attend].)
    """
    return TOPK.weights(scores, mask, check_finite=check_finite, top_k=top_k)


def _top_k(top_k: int = 8, **_) -> int:
    return top_k


def _one(**_) -> int:
    return 1


TOPK = TopK(_top_k, kernel=Kernel("topk_tiled", cpp=True, triton=True))
#: hardmax: top-1 (its straight-through gradient is the normalizer's own)
HARDMAX = TopK(_one, kernel=Kernel("hardmax", triton=True))


@normalizer
def hardmax(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    straight_through: bool = False,
    check_finite: bool = True,
) -> Tensor:
    """One-hot on the arg-max of the allowed scores of each row (ties: the first); the
    zero-temperature limit of softmax (Veličković et al. §3).

    Its gradient is zero almost everywhere. With ``straight_through=True`` the forward value is
    unchanged and the backward pass is softmax's (straight-through estimator).
    """
    # top-1: one-hot, constant near any input, so its gradient is 0 and the graph is dropped
    hard = HARDMAX.weights(scores, mask, check_finite=check_finite).detach()
    if straight_through:
        x, allowed = prepare(scores, mask, check_finite=False)
        soft = masked_softmax(x, allowed)
        hard = hard + (soft - soft.detach()).to(hard.dtype)
    return hard


#: α of the entmax family (entmax, asentmax; the tiled paths check a number α with it too): its
#: numerically safe range `_entmax.SAFE_ALPHA`, [1.01, 2.5] (measured; see there)
ALPHA = Param(
    "alpha",
    1.5,
    "α in [1.01, 2.5] (α → 1: softmax, α = 2: sparsemax; outside, the weights lose the dtype's "
    "precision)",
    low=_entmax.SAFE_ALPHA[0],
    high=_entmax.SAFE_ALPHA[1],
    tensor=True,
)
#: bisection steps (None: from the dtype, `_entmax.bisect_steps`); after ~1,100 halvings the
#: float64 bracket is below its smallest number, so more change nothing (the bound keeps a typo
#: from running for hours)
N_ITER = Param(
    "n_iter",
    None,
    "bisection steps (None: enough for the dtype's precision)",
    kind="int",
    low=1,
    high=10_000,
    optional=True,
)


@normalizer
def entmax(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    alpha: float | Tensor = 1.5,
    n_iter: int | None = None,
    check_finite: bool = True,
) -> Tensor:
    """α-entmax over the allowed keys (Peters et al. 2019): by bisection
    (``entmax.entmax_bisect``, ``n_iter`` steps, None: enough for the dtype's precision), α = 1.5
    and α = 2 (numbers) exactly by sorting.

    p = argmax_p ⟨p, s⟩ + H_α^T(p) over the simplex: p_i = [(α−1)s_i − τ]_+^{1/(α−1)} with τ
    such that Σ p = 1; α → 1 is softmax, α = 2 is sparsemax. α in [1.01, 2.5], the range where
    the weights keep the dtype's precision (`_entmax.SAFE_ALPHA`: below, the 1/(α−1)-th power
    turns the rounding of numbers near 1 into errors ~u/(α−1), and entmax(α) differs from softmax
    by ~1.8·(α−1), so neither is exact; above, a key at the threshold is as sensitive as
    δ^{1/(α−1)} to a rounding δ of its score). ``alpha`` may be a tensor broadcastable to
    ``[..., Lq, 1]`` (e.g. per head); its values are checked with ``check_finite``.
    """
    return ENTMAX.weights(scores, mask, check_finite=check_finite, alpha=alpha, n_iter=n_iter)


@normalizer
def sparsemax(scores: Tensor, mask: Tensor | None = None, *, check_finite: bool = True) -> Tensor:
    """sparsemax: the Euclidean projection of the scores onto the simplex (Martins & Astudillo
    2016), p_i = [s_i − τ]_+ with Σ p = 1 (α-entmax with α = 2), exact by sorting."""
    return SPARSEMAX.weights(scores, mask, check_finite=check_finite)


@normalizer
def entmax15(scores: Tensor, mask: Tensor | None = None, *, check_finite: bool = True) -> Tensor:
    """1.5-entmax (Peters et al. 2019): p_i = [s_i/2 − τ]_+² with Σ p = 1, exact by sorting."""
    return ENTMAX15.weights(scores, mask, check_finite=check_finite)


def asentmax_scale(
    n: Tensor,
    beta_pre: float | Tensor,
    gamma_pre: float | Tensor,
    delta: float = 1.0,
    gamma_max: float = 2.0,
) -> Tensor:
    """ASEntmax's scale of a row with n keys: θ = δ + softplus(beta_pre)·log(n + 1)^γ,
    γ = gamma_max·tanh(gamma_pre) (Vasylenko et al. 2026; see [`asentmax`][sharpattn.normalizers.sparse.asentmax]).

    ``n`` ``[..., Lq|1, 1]``; the parameters are numbers or tensors broadcastable to it (per head,
    or per query and head). Rows without a key (n = 0) are given n = 1 (they are zeroed anyway).
    """
    dtype = n.dtype
    b = on_device(beta_pre, dtype, n.device)
    g = on_device(gamma_pre, dtype, n.device)
    log_n1 = torch.log1p(n.clamp_min(1.0))  # >= log 2 > 0, so any real power is finite
    return delta + F.softplus(b) * torch.pow(log_n1, gamma_max * torch.tanh(g))


@normalizer
def asentmax(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    beta_pre: float | Tensor = 0.0,
    gamma_pre: float | Tensor = 0.0,
    delta: float = 1.0,
    gamma_max: float = 2.0,
    alpha: float = 1.5,
    n_iter: int | None = None,
    check_finite: bool = True,
) -> Tensor:
    """Adaptive-Scalable Entmax (Vasylenko, Pitorro, Martins & Treviso, ICLR 2026): α-entmax of
    θ·scores, θ = δ + β·log(n + 1)^γ, β = softplus(beta_pre), γ = gamma_max·tanh(gamma_pre).

    As the authors' code defines it (deep-spin/asentmax, ``synthetic/src/models/architectures/
    sparse_gemma.py``, ``attn_scale_type="adapt-softplus-tanh"``, the README's ASEntmax recipe):
    α = 1.5, δ = ``attn_scale_delta`` = 1, the range of γ ``attn_scale_gamma_range`` = 2, and the
    query rows multiplied by θ before q·kᵀ/√d. Their log term is log(position + 2) ("positions
    start at log 2", position 0-based), i.e. log(n + 1) with n the keys a causal query sees; here n
    is the row's allowed keys (`_contract.visible_keys`), the same without padding.

    There β and γ come from the layer input x_i of query i by a linear map with bias, per head:
    β_{h,i} = softplus(w_h·x_i + b_h). Here ``beta_pre`` / ``gamma_pre`` are those pre-activations:
    numbers, per-head tensors ``[1, H, 1, 1]`` (the biases b_h) or per-query tensors
    ``[B, H, Lq, 1]``. [`MultiheadAttention`][sharpattn.attention.MultiheadAttention] makes them per head and
    adds the linear map of the query's input (``Normalizer.query_dependent``). Defaults 0:
    β = log 2, γ = 0 (θ = 1 + log 2, no length dependence until trained).

    α = 1.5 is computed exactly by sorting (``entmax.entmax15``); other α in [1.01, 2.5] (the
    range where the weights keep the dtype's precision, see `entmax`) by bisection.
    """
    return ASENTMAX.weights(
        scores,
        mask,
        check_finite=check_finite,
        beta_pre=beta_pre,
        gamma_pre=gamma_pre,
        delta=delta,
        gamma_max=gamma_max,
        alpha=alpha,
        n_iter=n_iter,
    )


def _alpha(alpha: float | Tensor = 1.5, **_):
    return alpha


def _asentmax_theta(n: Tensor, beta_pre=0.0, gamma_pre=0.0, delta=1.0, gamma_max=2.0, **_):
    return asentmax_scale(n, beta_pre, gamma_pre, delta, gamma_max)


SPARSEMAX = Sparse(2.0, kernel=Kernel("sparsemax_tiled", cpp=True, triton=True))
ENTMAX15 = Sparse(1.5, kernel=Kernel("entmax15_tiled", cpp=True, triton=True))
ENTMAX = Sparse(_alpha, kernel=Kernel("entmax_tiled", cpp=True, triton=True))
ASENTMAX = Sparse(
    _alpha, scale=_asentmax_theta, kernel=Kernel("asentmax_tiled", cpp=True, triton=True)
)


topk = register(
    Normalizer(
        name="topk",
        fn=topk,
        family=TOPK,
        formula="softmax over the top_k largest s_j, 0 elsewhere",
        citation="—",
        sums_to_one=True,
        params=(Param("top_k", 8, "number of keys kept per row", kind="int", low=1),),
    )
).fn
hardmax = register(
    Normalizer(
        name="hardmax",
        fn=hardmax,
        formula="one-hot(argmax_j s_j), ties: first",
        citation="zero-temperature limit of softmax (Veličković et al. 2025, §3)",
        sums_to_one=True,
        family=HARDMAX,
        params=(Param("straight_through", False, "backward pass of softmax (straight-through)"),),
    )
).fn
sparsemax = register(
    Normalizer(
        name="sparsemax",
        fn=sparsemax,
        family=SPARSEMAX,
        formula="[s_i − τ]_+, Σ = 1",
        citation="Martins & Astudillo 2016, From Softmax to Sparsemax",
        sums_to_one=True,
    )
).fn
entmax15 = register(
    Normalizer(
        name="entmax15",
        fn=entmax15,
        family=ENTMAX15,
        formula="[s_i/2 − τ]_+², Σ = 1",
        citation="Peters, Niculae & Martins 2019, Sparse Sequence-to-Sequence Models",
        sums_to_one=True,
    )
).fn
entmax = register(
    Normalizer(
        name="entmax",
        fn=entmax,
        family=ENTMAX,
        formula="[(α−1)s_i − τ]_+^{1/(α−1)}, Σ = 1",
        citation="Peters, Niculae & Martins 2019; Correia et al. 2019",
        sums_to_one=True,
        params=(ALPHA, N_ITER),
    )
).fn
asentmax = register(
    Normalizer(
        name="asentmax",
        fn=asentmax,
        family=ASENTMAX,
        formula=(
            "α-entmax over θ·s_j, θ = δ + softplus(b)·log(n + 1)^{γ_max·tanh(c)} "
            "(b = beta_pre, c = gamma_pre; per query in MultiheadAttention)"
        ),
        citation="Vasylenko, Pitorro, Martins & Treviso, ICLR 2026 (ASEntmax; deep-spin/asentmax)",
        sums_to_one=True,
        params=(
            Param("beta_pre", 0.0, "b: pre-softplus scale β = softplus(b)", learnable=True),
            Param("gamma_pre", 0.0, "c: pre-tanh exponent γ = γ_max·tanh(c)", learnable=True),
            Param("delta", 1.0, "δ >= 0: the scale's offset (1 in the paper's code)", low=0.0),
            Param("gamma_max", 2.0, "γ_max >= 0: the range of γ (2 in the paper's code)", low=0.0),
            replace(ALPHA, doc="α in [1.01, 2.5] (1.5 in the paper)"),
            replace(N_ITER, doc="bisection steps (α != 1.5 only)"),
        ),
        query_dependent=("beta_pre", "gamma_pre"),
    )
).fn
