"""Kernels other than exp: polynomial, signed, rectified-exponential (softpick) and StableMax
attention."""

from __future__ import annotations

import torch

from ._contract import normalizer
from .families import Kernel, RowNormalised, TileMaths, exp_, masked_
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


class _PowerTiles(TileMaths):
    """u = (ReLU(s)/m)^p, a = u, m the row's largest ReLU(s) (1 while it is 0)."""

    normalised = True
    P = 3.0

    def ref_of(self, s):
        return s.amax(-1, keepdim=True).clamp_min_(0.0)

    def factor(self, m_old, m_new):
        ratio = m_old / torch.where(m_new > 0, m_new, torch.ones_like(m_new))
        return ratio**self.p  # m_old = 0: the sums were 0 (no positive score yet)

    def weights(self, s, m, mask):
        m1 = torch.where(m > 0, m, torch.ones_like(m))
        u = s.relu_().div_(m1).pow_(self.p)  # disallowed scores are 0: u = 0
        return u, u.sum(-1, keepdim=True)

    def grad(self, s, dp, m, mask, d, z):
        # w = u/Z: dL/du = (dP − D)/Z; du/ds = p·(r/m)^{p−1}/m for s > 0
        p = self.p
        m1 = torch.where(m > 0, m, torch.ones_like(m))
        r = s.relu_().div_(m1)  # r/m in [0, 1]
        slope = r.pow(p - 1) if p != 1 else torch.sign(r)
        ds = dp.sub(d).mul_(slope).mul_(p / (m1 * z))
        return ds, r.pow_(p).div_(z)


POWER = RowNormalised(
    _power_u,
    ref=torch.relu,
    constants=("p",),
    kernel=Kernel("power", _PowerTiles, cpp=True, triton=True),
)


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


class _SignedTiles(TileMaths):
    """u = sign(s)·e^{|s| − m}, a = e^{|s| − m}, m the row's largest |s|."""

    normalised = True

    def ref_of(self, s):
        return s.abs().amax(-1, keepdim=True)

    def factor(self, m_old, m_new):
        return torch.exp(m_old - m_new)

    def weights(self, s, m, mask):
        sign = torch.sign(s)
        a = masked_(exp_(s.abs_().sub_(m)), mask)
        total = a.sum(-1, keepdim=True)
        return a.mul_(sign), total

    def grad(self, s, dp, m, mask, d, z):
        # w = sign·p, p = softmax(|s|): dL/ds = sign·p·(sign·dP − D) = w·(sign·dP − D)
        sign = torch.sign(s)
        w = masked_(exp_(s.abs_().sub_(m)), mask).div_(z).mul_(sign)
        return dp.mul(sign).sub_(d).mul_(w), w


SIGNED = RowNormalised(
    _signed_u,
    _signed_a,
    ref=torch.abs,
    kernel=Kernel("signed", _SignedTiles, cpp=True, triton=True),
)


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


class _SoftpickTiles(TileMaths):
    """d = e^{−m}(e^{s} − 1), u = ReLU(d), a = |d|, m = max(0, max s).

    Per row, d = A·expm1(s − c) + B with c = 0 where m <= 60 (A = e^{−m}, B = 0: e^{−m}·expm1(s),
    exact near s = 0 and finite as s <= m <= 60) and c = m beyond (A = 1, B = 1 − e^{−m}: the
    cancellation near s = 0 costs ε against a row sum >= 1 − e^{−60}).
    """

    normalised = True
    SHIFT_ABOVE = 60.0

    def ref_of(self, s):
        return s.amax(-1, keepdim=True).clamp_min_(0.0)

    def factor(self, m_old, m_new):
        return torch.exp(m_old - m_new)

    def _d(self, s, m, mask):
        far = m > self.SHIFT_ABOVE
        c = torch.where(far, m, torch.zeros_like(m))
        a = torch.exp(c - m)
        b = torch.where(far, -torch.expm1(-m), torch.zeros_like(m))
        return masked_(s.sub_(c).expm1_().mul_(a).add_(b), mask), a, b

    def weights(self, s, m, mask):
        d, _, _ = self._d(s, m, mask)
        total = d.abs().sum(-1, keepdim=True)  # (vector_norm(d, 1) is 7× slower here)
        return d.relu_(), total

    def grad(self, s, dp, m, mask, d, z):
        # w = ReLU(d)/Σ|d|: dL/dd = (1[d > 0]·dP − sign(d)·D)/Z, dd/ds = e^{s − m} = d + A − B
        dd, a, b = self._d(s, m, mask)
        ds = torch.relu(dd).sign_().mul_(dp).sub_(torch.sign(dd).mul_(d))
        ds.mul_(dd + (a - b)).div_(z)
        return ds, dd.relu_().div_(z)


SOFTPICK = RowNormalised(
    _softpick_u,
    _softpick_a,
    ref=_identity,
    kernel=Kernel("softpick", _SoftpickTiles, cpp=True, triton=True),
)


@normalizer
def stablemax(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    check_finite: bool = True,
) -> Tensor:
    """w_i = s(x_i) / Σ_j s(x_j) with s(x) = x + 1 for x >= 0 and 1/(1 − x) below (Prieto et al.
    2025, *Grokking at the Edge of Numerical Stability*): softmax with exp replaced by a map that
    grows linearly, so no weight underflows to 0 and none overflows.

    s > 0 everywhere: rows sum to one. Computed as s(x_i)/m over Σ_j s(x_j)/m, m = max_j s(x_j).
    Not shift or scale invariant.
    """
    return STABLEMAX.weights(scores, mask, check_finite=check_finite)


def _stablemax_s(s: Tensor) -> Tensor:
    """s(x): x + 1 for x >= 0, 1/(1 − x) below (each branch on inputs where it is finite)."""
    return torch.where(s >= 0, s.clamp_min(0.0) + 1.0, 1.0 / (1.0 - s.clamp_max(0.0)))


def _stablemax_u(s: Tensor, m: Tensor) -> Tensor:
    return _stablemax_s(s) / torch.where(m > 0, m, torch.ones_like(m))


class _StablemaxTiles(TileMaths):
    """u = a = s(x)/m, m the row's largest s(x) (s of its largest score: s is increasing)."""

    normalised = True

    def ref_of(self, s):
        return _stablemax_s(s.amax(-1, keepdim=True))

    def factor(self, m_old, m_new):
        return m_old / torch.where(m_new > 0, m_new, torch.ones_like(m_new))

    def weights(self, s, m, mask):
        u = masked_(_stablemax_u(s, m), mask)
        return u, u.sum(-1, keepdim=True)

    def grad(self, s, dp, m, mask, d, z):
        # w = u/Z: dL/ds = (dP − D)·s′(x)/(m·Z), s′ = 1 for x >= 0, 1/(1 − x)² below
        below = 1.0 / (1.0 - s.clamp_max(0.0))
        slope = torch.where(s >= 0, torch.ones_like(s), below * below)
        m1 = torch.where(m > 0, m, torch.ones_like(m))
        w = masked_(_stablemax_u(s, m), mask).div_(z)
        return dp.sub(d).mul_(slope).div_(m1 * z), w


STABLEMAX = RowNormalised(
    _stablemax_u,
    ref=_stablemax_s,
    kernel=Kernel("stablemax", _StablemaxTiles, cpp=True, triton=True),
)


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
stablemax = register(
    Normalizer(
        name="stablemax",
        fn=stablemax,
        formula="s(x_i) / Σ_j s(x_j), s(x) = x + 1 (x >= 0), 1/(1 − x) (x < 0)",
        citation="Prieto et al. 2025, Grokking at the Edge of Numerical Stability",
        sums_to_one=True,
        family=STABLEMAX,
    )
).fn
