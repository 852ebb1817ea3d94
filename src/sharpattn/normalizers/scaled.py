"""Length-scaled softmax: the inverse temperature grows with log n, so a fixed logit margin keeps
its winner as n grows (Scalable-Softmax; the position temperature of selective attention).

"n" is the number of allowed keys of the row (:func:`._contract.visible_keys`).
"""

from __future__ import annotations

import torch

from ._contract import (
    finish,
    log_n,
    masked_softmax,
    nonnegative,
    normalizer,
    prepare,
    visible_keys,
)
from .registry import Normalizer, Param, register

Tensor = torch.Tensor


def ssmax_beta(log_n: Tensor, s: float | Tensor) -> Tensor:
    """SSMax's inverse temperature of a row, s·log n (shared with the fused query-scaling path)."""
    return s * log_n


def length_scaled_beta(log_n: Tensor, c: float | Tensor) -> Tensor:
    """length_scaled's inverse temperature of a row, 1 + c·log n with c >= 0 (shared with the
    fused query-scaling path)."""
    return 1.0 + nonnegative(c, "c") * log_n


@normalizer
def ssmax(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    s: float | Tensor = 0.43,
    check_finite: bool = True,
) -> Tensor:
    """Scalable-Softmax: softmax(s·log(n)·scores) over the allowed keys (Nakanishi 2025).

    ``s`` is the scaling parameter, learnable per head in :class:`MultiheadAttention` (0.43 is
    the value reported for SSMax). Any real ``s`` is accepted (s < 0 reverses the ranking; s = 0
    is uniform). A row with one key (n = 1, log n = 0) puts weight 1 on it.
    """
    x, allowed = prepare(scores, mask, check_finite)
    beta = ssmax_beta(log_n(visible_keys(allowed, dtype=x.dtype)), s)  # (..., Lq, 1)
    return finish(masked_softmax(x, allowed, beta), scores)


@normalizer
def length_scaled(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    c: float | Tensor = 0.0,
    check_finite: bool = True,
) -> Tensor:
    """softmax((1 + c·log n)·scores) over the allowed keys, c >= 0.

    The functional form of selective attention's position temperature (Zhang et al. 2024) and
    of Chiang & Cholak's (2022) log-length scaling; c = 0 is softmax. A plain-number ``c`` must
    be >= 0; a tensor ``c`` (the learnable per-head parameter) is clamped at 0 with a
    straight-through gradient (see :func:`._contract.nonnegative`).
    """
    x, allowed = prepare(scores, mask, check_finite)
    beta = length_scaled_beta(log_n(visible_keys(allowed, dtype=x.dtype)), c)  # (..., Lq, 1)
    return finish(masked_softmax(x, allowed, beta), scores)


register(
    Normalizer(
        name="ssmax",
        fn=ssmax,
        formula="softmax over s·log(n)·s_j (scaling s learnable per head)",
        citation="Nakanishi 2025, Scalable-Softmax Is Superior for Attention",
        sums_to_one=True,
        params=(Param("s", 0.43, "scaling parameter s (0.43 reported for SSMax)", learnable=True),),
        fused="ssmax",
    )
)
register(
    Normalizer(
        name="length_scaled",
        fn=length_scaled,
        formula="softmax over (1 + c·log n)·s_j, c >= 0 (learnable per head)",
        citation="Zhang et al. 2024, Selective Attention; Chiang & Cholak 2022",
        sums_to_one=True,
        params=(
            Param("c", 0.0, "log-length coefficient c >= 0 (c = 0 is softmax)", learnable=True),
        ),
        fused="length_scaled",
    )
)
