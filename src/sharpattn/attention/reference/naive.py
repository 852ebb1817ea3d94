"""The naive path: the whole score matrix, the normalizer's own function on it, then the
weighted values. Every fast path is held to it within precision."""

from __future__ import annotations

import torch

from ...normalizers._contract import compute_dtype
from ..masking import Masking
from ..stats import AttentionStats, row_stats, stats_from_weights

Tensor = torch.Tensor


def naive_attention(
    fn,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masking: Masking,
    scale: float,
    check_finite: bool,
    want_stats: bool,
    params: dict,
) -> tuple[Tensor, Tensor, AttentionStats | None]:
    """(output ``[B, H, Lq, Dv]``, weights ``[B, H, Lq, Lk]`` in q's dtype, statistics or None)
    of the normalizer ``fn`` on scale·q·kᵀ; grouped k and v (GQA) repeated to q's heads."""
    b, h, lq = q.shape[:3]
    hkv = k.shape[1]
    if hkv != h:
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
    cd = compute_dtype(q.dtype)
    # in float32 for 16-bit inputs, as the fused kernel accumulates: no fp16 overflow
    scores = torch.matmul(q.to(cd), k.to(cd).transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
    weights = fn(scores, masking.dense(), check_finite=check_finite, **params)
    weights = weights.to(q.dtype)
    out = torch.matmul(weights.to(v.dtype), v)  # (B, H, Lq, Dv)
    stats = None
    if want_stats:
        ent, mass = stats_from_weights(weights)
        stats = row_stats((b, h, lq), masking.visible_keys(), entropy=ent, mass=mass)
    return out, weights, stats
