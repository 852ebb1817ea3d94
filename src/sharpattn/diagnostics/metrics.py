"""Dispersion and extreme-token metrics on captured scores, weights, values and residuals.

Dispersion (Veličković et al., Lemma 2.1): with logits in [m, M], δ = M − m, every softmax_θ weight
is at most e^{δ/θ}/n, so beyond n* = e^{δ/θ}/ε items every weight is below ε.
Extreme tokens (Guo et al., Active-Dormant Attention Heads, Fig. 25 and §1): sink mass
Ā_j = (1/(n−j)) Σ_{i≥j} A_ij, sink tokens = the top-2 by Ā, value-state drain
‖Val_sink‖ / mean ‖Val_other‖, residual-state peak ‖Res_sink‖ / mean ‖Res_other‖, and active vs
dormant heads by the change in loss when a head's output is zeroed (that test runs the model:
[`sharpattn.diagnostics.capture.head_ablation`][sharpattn.diagnostics.capture.head_ablation]).
Selective attention (Zhang et al., Sec. 4.1, Fig. 2): spikiness ‖s‖₁ / (‖s‖₂²·L) of a weight row
over its L visible keys (1 = uniform, 1/L = one-hot) and the operator norm of the combined
query-key matrix W = W_q·W_kᵀ per head. Pure functions of tensors; nothing here imports the
capture machinery.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..normalizers.stats import effective_support, entropy, max_weight

__all__ = [
    "attention_on",
    "classify_heads",
    "delta_logit",
    "dispersion_horizon",
    "head_logit_spread",
    "logit_spread",
    "norm_ratio",
    "qk_operator_norm",
    "residual_peak",
    "sink_logit_gap",
    "sink_logit_stats",
    "sink_mass",
    "sink_tokens",
    "spikiness",
    "value_drain",
    "weight_stats",
]

Tensor = torch.Tensor


def weight_stats(weights: Tensor) -> dict[str, Tensor]:
    """Per query row ``[..., Lq]``: entropy, max weight and effective support (normalizers.stats)."""
    return {
        "entropy": entropy(weights),
        "max_weight": max_weight(weights),
        "support": effective_support(weights),
    }


def logit_spread(scores: Tensor, mask: Tensor | None = None) -> Tensor:
    """δ = max − min of each row's scores over its allowed keys, ``[..., Lq]`` (Lemma 2.1).

    ``-inf`` scores count as masked; a row with no allowed key gives NaN.
    """
    allowed = scores != float("-inf")
    if mask is not None:
        allowed = allowed & mask
    s = scores.double()
    hi = s.masked_fill(~allowed, float("-inf")).amax(dim=-1)
    lo = s.masked_fill(~allowed, float("inf")).amin(dim=-1)
    return torch.where(allowed.any(dim=-1), hi - lo, torch.full_like(hi, float("nan")))


def head_logit_spread(scores: Tensor, mask: Tensor | None = None) -> Tensor:
    """δ of each head ``[..., H]`` for scores ``[..., H, Lq, Lk]``: the largest row spread, so
    every query of the head has its logits within δ (NaN if no row has an allowed key)."""
    rows = logit_spread(scores, mask)
    filled = torch.nan_to_num(rows, nan=float("-inf")).amax(dim=-1)
    return torch.where(torch.isfinite(filled), filled, torch.full_like(filled, float("nan")))


def dispersion_horizon(delta, theta: float | Tensor = 1.0, eps: float = 0.01) -> Tensor:
    """n* = e^{δ/θ}/ε: for n > n* items Lemma 2.1 puts every softmax_θ weight below ε (float64)."""
    if not 0 < eps < 1:
        raise ValueError(f"eps must be in (0, 1), got {eps!r}.")
    delta = torch.as_tensor(delta, dtype=torch.float64)
    theta = torch.as_tensor(theta, dtype=torch.float64)
    if bool((theta <= 0).any()):
        raise ValueError("theta must be > 0.")
    return torch.exp(delta / theta) / eps


def sink_mass(weights: Tensor, queries: str = "after") -> Tensor:
    """Ā_j = (1/(n−j)) Σ_{i=j}^{n−1} A_ij: mean attention key j gets from queries i >= j.

    weights ``[..., n, n]`` (self-attention, queries and keys the same tokens) -> ``[..., n]``.
    ``queries="after"`` is Guo et al.'s definition (causal models, where only i >= j can see j);
    ``queries="all"`` averages over every query, for bidirectional encoders, where the last keys
    would otherwise be judged by one or two queries.
    """
    n = weights.shape[-1]
    if weights.shape[-2] != n:
        raise ValueError(
            f"sink_mass needs square self-attention weights [..., n, n], got {tuple(weights.shape)}."
        )
    if queries == "all":
        return weights.double().mean(dim=-2)
    if queries != "after":
        raise ValueError(f"queries must be 'after' or 'all', got {queries!r}.")
    lower = torch.ones(n, n, dtype=torch.bool, device=weights.device).tril()  # i >= j
    total = (weights.double() * lower).sum(dim=-2)
    count = torch.arange(n, 0, -1, device=weights.device, dtype=torch.float64)  # n − j
    return total / count


def spikiness(weights: Tensor, visible: Tensor | int | None = None) -> Tensor:
    """‖s‖₁ / (‖s‖₂²·L) per row ``[..., Lq]`` of weights ``[..., Lq, Lk]`` (Zhang et al., Fig. 2):
    1 for a uniform row over its L keys, 1/L for a one-hot row; smaller is spikier.

    ``visible``: L per row (broadcastable to ``[..., Lq]``, e.g. ``arange(1, Lq + 1)`` under a
    causal mask, where masked weights are 0); default ``Lk``. Computed in float64.
    """
    w = weights.double()
    n = weights.shape[-1] if visible is None else torch.as_tensor(visible, device=w.device)
    if bool((torch.as_tensor(n) < 1).any()):
        raise ValueError("spikiness needs at least one visible key per row.")
    return w.abs().sum(-1) / (w.square().sum(-1) * n)


def qk_operator_norm(wq: Tensor, wk: Tensor) -> Tensor:
    """‖W_q,h·W_k,hᵀ‖₂ (largest singular value) per head (Zhang et al., Lemma 1 / Fig. 2).

    ``wq``, ``wk``: ``[..., d, hd]`` (columns = one head's query / key features, e.g. a
    ``nn.Linear`` weight's rows of head h, transposed) -> ``[...]``, float64.
    """
    if wq.shape != wk.shape:
        raise ValueError(
            f"W_q and W_k must have one shape, got {tuple(wq.shape)} and {tuple(wk.shape)}."
        )
    w = wq.double() @ wk.double().transpose(-1, -2)  # (..., d, d)
    return torch.linalg.matrix_norm(w, ord=2)


def sink_tokens(mass: Tensor, k: int = 2) -> Tensor:
    """Indices ``[..., k]`` of the k tokens with the largest sink mass Ā (largest first)."""
    k = min(k, mass.shape[-1])
    return mass.topk(k, dim=-1).indices


def norm_ratio(norms: Tensor, token: Tensor | int) -> Tensor:
    """‖x_token‖ / mean_{j ≠ token} ‖x_j‖ for norms ``[..., n]`` and a token index per row."""
    n = norms.shape[-1]
    if n < 2:
        raise ValueError("a norm ratio needs at least two tokens.")
    token = torch.as_tensor(token, device=norms.device).expand(norms.shape[:-1])
    x = norms.double()
    own = x.gather(-1, token.unsqueeze(-1)).squeeze(-1)
    others = (x.sum(dim=-1) - own) / (n - 1)
    return own / others


def value_drain(value_norms: Tensor, sink: Tensor | int) -> Tensor:
    """Value-state drain ‖Val_sink‖ / mean ‖Val_other‖ per head (values ``[..., H, n]``)."""
    return norm_ratio(value_norms, sink)


def residual_peak(residual: Tensor, sink: Tensor | int) -> Tensor:
    """Residual-state peak ‖Res_sink‖ / mean ‖Res_other‖ (residual states ``[..., n, d]``)."""
    return norm_ratio(residual.double().norm(dim=-1), sink)


def classify_heads(delta: Mapping[tuple[int, int], float], threshold: float) -> dict:
    """``"active"`` where zeroing the head raised the loss by more than ``threshold``, else
    ``"dormant"``."""
    if not math.isfinite(threshold) or threshold < 0:
        raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}.")
    return {h: ("active" if d > threshold else "dormant") for h, d in delta.items()}


# ----- the sink's logit (Guo et al., Sec. 3 and Table 1) ----------------------------------------


def sink_logit_gap(scores: Tensor) -> Tensor:
    """Δ_n = s(n, 0) − mean_{1≤i≤n} s(n, i) for every query n of ``scores`` ``[..., T, T]``: how
    far above the other visible keys the first key's logit is (keys after the query are ignored,
    whatever they hold: capture stores them as -inf). ``[..., T]``; Δ_0 = s(0, 0)."""
    t = scores.shape[-1]
    others = torch.ones(t, t, dtype=torch.bool, device=scores.device).tril()
    others[:, 0] = False  # keys 1..n
    mean = scores.masked_fill(~others, 0.0).sum(-1) / others.sum(-1).clamp_min(1)
    return scores[..., 0] - mean


def _after_first(query: Tensor) -> Tensor:
    q = query.clone()
    q[:, 0] = False  # position 0 has no other key
    return q


def delta_logit(scores: Tensor, query: Tensor) -> float:
    """Mean of `sink_logit_gap` over the selected queries (``query`` ``[B, T]``, n ≥ 1) and the
    heads of ``scores`` ``[B, H, T, T]``."""
    return float(sink_logit_gap(scores).mean(1)[_after_first(query)].mean())


def attention_on(weights: Tensor, query: Tensor, offset: int | None = None) -> float:
    """Mean weight of ``weights`` ``[B, H, T, T]`` (over the selected queries ``query``
    ``[B, T]`` and the heads) on key 0 (``offset=None``) or on the key ``offset`` positions back
    (1: the previous token)."""
    w = weights.mean(1)  # (B, T, T)
    if offset is None:
        col = w[..., 0]
    else:
        col = torch.diagonal(w, offset=-offset, dim1=-2, dim2=-1)  # (B, T - offset)
        col = torch.nn.functional.pad(col, (offset, 0))
        query = query.clone()
        query[:, :offset] = False
    return float(col[query].mean())


def sink_logit_stats(scores: Tensor, tokens: Tensor, query: Tensor) -> dict[str, float]:
    """Guo et al.'s Table 1 / Fig. 10b from ``scores`` ``[B, T, T]`` (one head, or heads
    averaged), ``tokens`` and the selected queries ``query`` ``[B, T]`` (position 0 never
    counts): for each token v at a selected query, the mean over its positions n of s(n, 0) and
    of `sink_logit_gap`. Returns the number of such tokens, the mean and the population standard
    deviation across tokens of their first-key logits, their mean gap and ``rel_spread`` = that
    standard deviation / that mean gap (small: every query gives the sink about the same
    logit)."""
    sc = scores.double()
    first, gap = sc[..., 0], sink_logit_gap(sc)  # (B, T)
    q = _after_first(query)
    per_first, per_gap = [], []
    for v in torch.unique(tokens[q]).tolist():
        sel = q & (tokens == v)
        per_first.append(float(first[sel].mean()))
        per_gap.append(float(gap[sel].mean()))
    b, d = torch.tensor(per_first, dtype=torch.float64), torch.tensor(per_gap, dtype=torch.float64)
    std = float(b.std(correction=0))
    return {
        "tokens": len(per_first),
        "bos_logit_mean": float(b.mean()),
        "bos_logit_std": std,
        "delta_mean": float(d.mean()),
        "rel_spread": std / float(d.mean()),
    }
