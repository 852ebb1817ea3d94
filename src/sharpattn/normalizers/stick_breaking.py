"""Stick-breaking attention (Tan et al. 2025): each key, from the nearest back, takes a fraction
σ(s) of the stick the nearer keys have left.
"""

from __future__ import annotations

import torch

from ._contract import normalizer
from .families import Kernel, StickBreaking
from .registry import QUERY_OFFSET, Normalizer, Param, register

Tensor = torch.Tensor


@normalizer
def stick_breaking(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    attend_current: bool = False,
    query_offset: int | None = None,
    shift: float | Tensor = 0.0,
    shift_log_position: float = 0.0,
    check_finite: bool = True,
) -> Tensor:
    """w_ij = σ(s_ij)·Π_{j<k<i}(1 − σ(s_ik)) for the allowed keys j < i of query i.

    Causal only: each key, from the nearest back, takes the fraction σ(s_ij) of what the nearer
    keys left of the stick. Query i sits at key position i + (Lk − Lq) (bottom-right aligned, as
    ``attend(causal=True)``); a row whose allowed keys reach past that position raises
    ``ValueError``, so a missing causal mask is an error, not a silent result (with
    ``check_finite=False`` this check, which reads the mask, is skipped: keys past the query's
    position then take no share, as under the causal mask). As in the paper
    ("for each token before the current") the query's own key is excluded and the first query
    of a causal sequence is an all-zero row; ``attend_current=True`` includes it as the first
    piece of the stick (then j <= i and the product runs over j < k <= i). ``query_offset`` is the
    key position of the first query row (default Lk − Lq); a caller that passes a block of query
    rows (the chunked attention path) sets it. Masked keys (padding,
    −inf) take no share. Rows sum to 1 − Π_k(1 − σ(s_ik)) < 1.

    ``shift`` and ``shift_log_position`` add b_i = shift + shift_log_position·log(p_i) to every
    score of row i, p_i its 1-based key position (`families.score_shift`): a number or a
    per-head tensor (one that requires grad gets its gradient), and −1 for the −log i that lets
    a long row reach past its nearest keys.

    Computed in log space: log w_ij = log σ(s_ij) + Σ_{k>j} log σ(−s_ik), the sum a reversed,
    exclusive cumulative sum (O(Lq·Lk) memory); the maths is its family's (`STICK_BREAKING`).
    """
    return STICK_BREAKING.weights(
        scores,
        mask,
        check_finite=check_finite,
        attend_current=attend_current,
        query_offset=query_offset,
        shift=shift,
        shift_log_position=shift_log_position,
    )


STICK_BREAKING = StickBreaking(kernel=Kernel("stick_breaking", cpp=True, triton=True))


stick_breaking = register(
    Normalizer(
        name="stick_breaking",
        fn=stick_breaking,
        formula="σ(s_ij)·Π_{j<k<i}(1 − σ(s_ik)), j < i (causal only)",
        citation="Tan et al. 2025, Scaling Stick-Breaking Attention",
        sums_to_one=False,
        family=STICK_BREAKING,
        params=(
            Param("attend_current", False, "let query i take a share for its own key i"),
            Param("shift", 0.0, "score shift b0 added to every score of a row", tensor=True),
            Param(
                "shift_log_position",
                0.0,
                "score shift per log of the query's position (−1: −log i)",
            ),
            QUERY_OFFSET,
        ),
    )
).fn
