"""Kernels other than exp: polynomial, signed and rectified-exponential (softpick) attention."""

from __future__ import annotations

import torch

from ._contract import normalizer
from .families import RowNormalised
from .registry import Normalizer, Param, register

Tensor = torch.Tensor


@normalizer
def power(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    p: float = 3.0,
    check_finite: bool = True,
) -> Tensor:
    """w_i = ReLU(s_i)^p / Σ_j ReLU(s_j)^p over the allowed keys (Smith's polynomial kernel).

    A row with no positive allowed score is all zeros. p >= 1. Computed as (r_i/m)^p / Σ
    (r_j/m)^p, r = ReLU(s), m = max r, which never overflows. Invariant to positive scaling of
    the scores, not to shifts.
    """
    return POWER.weights(scores, mask, check_finite=check_finite, p=p)


def _power_u(s: Tensor, m: Tensor, p: float = 3.0) -> Tensor:
    """(ReLU(s)/m)^p in [0, 1] (m = 1 while the row has no positive score)."""
    return (torch.relu(s) / torch.where(m > 0, m, torch.ones_like(m))) ** p


POWER = RowNormalised(_power_u, ref=torch.relu, constants=("p",), kernel="power")


@normalizer
def signed(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    check_finite: bool = True,
) -> Tensor:
    """w_i = sign(s_i)·exp(|s_i|) / Σ_j exp(|s_j|): softmax over |s| with the sign re-applied.

    Smith's "why only positive?": strongly negative scores get large negative weights. Σ_j |w_j|
    = 1 (except for exact zeros: sign(0) = 0). Not shift invariant; discontinuous at s = 0.
    Computed relative to m = max |s| (every exponent <= 0).
    """
    return SIGNED.weights(scores, mask, check_finite=check_finite)


def _signed_a(s: Tensor, m: Tensor) -> Tensor:
    return torch.exp(s.abs() - m)


def _signed_u(s: Tensor, m: Tensor) -> Tensor:
    return torch.sign(s) * _signed_a(s, m)


SIGNED = RowNormalised(_signed_u, _signed_a, ref=torch.abs, kernel="signed")


@normalizer
def softpick(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    check_finite: bool = True,
) -> Tensor:
    """w_i = ReLU(e^{s_i} − 1) / Σ_j |e^{s_j} − 1| over the allowed keys (Zuhri et al. 2025).

    Rows sum to one when every score is >= 0, to less otherwise, to 0 when none is positive.
    Numerator and denominator are multiplied by e^{−m}, m = max(0, max_j s_j), and e^{s} − 1 is
    formed without cancellation (expm1), so ±1e4 scores stay finite.
    """
    return SOFTPICK.weights(scores, mask, check_finite=check_finite)


def _softpick_d(s: Tensor, m: Tensor) -> Tensor:
    """e^{−m}(e^{s} − 1), each branch on inputs where it cannot overflow (finite gradients)."""
    sp, sn = s.clamp_min(0.0), s.clamp_max(0.0)
    return torch.where(
        s >= 0,
        torch.exp(sp - m) * -torch.expm1(-sp),  # s >= 0: e^{s−m}(1 − e^{−s})
        torch.exp(-m) * torch.expm1(sn),  # s < 0: e^{−m}(e^{s} − 1)
    )


def _softpick_u(s: Tensor, m: Tensor) -> Tensor:
    return torch.relu(_softpick_d(s, m))


def _softpick_a(s: Tensor, m: Tensor) -> Tensor:
    return _softpick_d(s, m).abs()


def _identity(s: Tensor) -> Tensor:
    return s


SOFTPICK = RowNormalised(_softpick_u, _softpick_a, ref=_identity, kernel="softpick")


power = register(
    Normalizer(
        name="power",
        fn=power,
        formula="ReLU(s_i)^p / Σ_j ReLU(s_j)^p (0 if no s_j > 0)",
        citation="Smith (blog), Softmax Attention is a Fluke",
        sums_to_one=False,
        family=POWER,
        params=(Param("p", 3.0, "power p >= 1", low=1.0),),
    )
).fn
signed = register(
    Normalizer(
        name="signed",
        fn=signed,
        formula="sign(s_i)·exp(|s_i|) / Σ_j exp(|s_j|)  (Σ_j |w_j| = 1)",
        citation="Smith (blog), Softmax Attention is a Fluke",
        sums_to_one=False,
        family=SIGNED,
    )
).fn
softpick = register(
    Normalizer(
        name="softpick",
        fn=softpick,
        formula="ReLU(e^{s_i} − 1) / Σ_j |e^{s_j} − 1|",
        citation="Zuhri et al. 2025, Softpick: rectified softmax",
        sums_to_one=False,
        family=SOFTPICK,
    )
).fn
