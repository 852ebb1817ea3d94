"""Kernels other than exp: polynomial, signed and rectified-exponential (softpick) attention."""

from __future__ import annotations

import torch

from ._contract import finish, masked_softmax, normalizer, prepare
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

    A row with no positive allowed score is all zeros. p >= 1. Computed as (r_i/max r)^p / Σ
    (r_j/max r)^p, r = ReLU(s), which never overflows. Invariant to positive scaling of the
    scores, not to shifts.
    """
    x, allowed = prepare(scores, mask, check_finite)
    r = torch.relu(x).masked_fill(~allowed, 0.0)
    top = r.amax(dim=-1, keepdim=True).detach()  # w does not depend on it
    u = (r / torch.where(top > 0, top, torch.ones_like(top))) ** p  # in [0, 1], max 1 if any > 0
    total = u.sum(dim=-1, keepdim=True)
    return finish(u / torch.where(total > 0, total, torch.ones_like(total)), scores)


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
    """
    x, allowed = prepare(scores, mask, check_finite)
    return finish(torch.sign(x) * masked_softmax(x.abs(), allowed), scores)


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
    x, allowed = prepare(scores, mask, check_finite)
    m = x.masked_fill(~allowed, 0.0).amax(dim=-1, keepdim=True).clamp_min(0.0).detach()
    # e^{−m}(e^{s} − 1), each branch on inputs where it cannot overflow (and so has finite grads)
    xp, xn = x.clamp_min(0.0), x.clamp_max(0.0)
    d = torch.where(
        x >= 0,
        torch.exp(xp - m) * -torch.expm1(-xp),  # s >= 0: e^{s−m}(1 − e^{−s})
        torch.exp(-m) * torch.expm1(xn),  # s < 0: e^{−m}(e^{s} − 1)
    ).masked_fill(~allowed, 0.0)
    total = d.abs().sum(dim=-1, keepdim=True)
    w = torch.relu(d) / torch.where(total > 0, total, torch.ones_like(total))
    return finish(w, scores)


power = register(
    Normalizer(
        name="power",
        fn=power,
        formula="ReLU(s_i)^p / Σ_j ReLU(s_j)^p (0 if no s_j > 0)",
        citation="Smith (blog), Softmax Attention is a Fluke",
        sums_to_one=False,
        fused="power",
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
        fused="signed",
    )
).fn
softpick = register(
    Normalizer(
        name="softpick",
        fn=softpick,
        formula="ReLU(e^{s_i} − 1) / Σ_j |e^{s_j} − 1|",
        citation="Zuhri et al. 2025, Softpick: rectified softmax",
        sums_to_one=False,
        fused="softpick",
    )
).fn
