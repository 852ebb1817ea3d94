"""Per-row attention statistics that every ``attend`` path can return (``return_stats=True``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..normalizers import entropy as weights_entropy
from ..normalizers._contract import compute_dtype

Tensor = torch.Tensor


@dataclass
class AttentionStats:
    """Statistics of each query row, every field ``[B, H, Lq]`` (float32 for 16-bit inputs).

    entropy: −Σ_j |w_ij|·log |w_ij| of the returned weights (natural log; 0 for empty rows). For
        non-negative weights the Shannon entropy; for ``signed``, whose weights can be negative
        (Σ_j |w_ij| = 1), the entropy of their magnitudes, the distribution it samples keys by.
    mass: Σ_j w_ij (1 for the softmax family; < 1 for sinks, whose missing mass is
        [`leftover_mass`][sharpattn.attention.stats.AttentionStats.leftover_mass]; 0 for rows that see no key).
    visible: n_i, the number of keys row i may attend to.
    lse: fused softmax-family paths only: log Σ_j exp(ℓ_ij) over the visible keys, ℓ the logits
        that made the output (s/θ, β·s, s·log n, ...; plain s for sinks); −inf (the log of an
        empty sum) for rows with no visible key. Absent when ``attend`` had to recompute a fused
        result on the chunked path (kernel overflow, see [`attend`][sharpattn.attention.attend]).
    beta: query-scaling and adaptive paths only: the factor the row's scores were multiplied by
        (adaptive β, 1/θ, s·log n, 1 + c·log n).
    softmax_entropy: adaptive only: H(softmax(s)) of the uncorrected scores, the input of β(H)
        (the exact entropy; the reference code's −Σ p·log(p + 1e-9) is at most n·1e-9 below it).
    """

    entropy: Tensor
    mass: Tensor
    visible: Tensor
    lse: Tensor | None = None
    beta: Tensor | None = None
    softmax_entropy: Tensor | None = None

    @property
    def leftover_mass(self) -> Tensor:
        """1 − Σ_j w_ij: the attention a row puts on no key (a sink normalizer's "null
        attention"). Not [`sharpattn.diagnostics.sink_mass`][sharpattn.diagnostics.sink_mass], the mean weight Ā_j a key
        receives (Guo et al.)."""
        return 1.0 - self.mass


def row_stats(shape, visible: Tensor, **fields: Tensor | None) -> AttentionStats:
    """Build [`AttentionStats`][sharpattn.attention.stats.AttentionStats] from ``[.., Lq|1, 1]``-shaped pieces, expanded to ``shape``
    ``[B, H, Lq]``; rows with no visible key get lse −inf, mass 0 and entropy 0."""
    visible = visible.squeeze(-1).expand(shape)
    empty = visible == 0
    out = {}
    for name, value in fields.items():
        if value is not None:
            value = value.squeeze(-1).expand(shape)
            if name == "lse":
                value = value.masked_fill(empty, float("-inf"))
            elif name in ("mass", "entropy", "softmax_entropy"):
                value = value.masked_fill(empty, 0.0)
        out[name] = value
    return AttentionStats(visible=visible, **out)


def stats_from_weights(weights: Tensor) -> tuple[Tensor, Tensor]:
    """(entropy, mass) of each row of ``weights`` ``[.., Lq, Lk]``, each ``[.., Lq, 1]``."""
    w = weights.to(compute_dtype(weights.dtype))
    magnitude = torch.where(w < 0, -w, w)  # signed weights: the entropy of |w| (not NaN)
    return weights_entropy(magnitude).unsqueeze(-1), w.sum(-1, keepdim=True)
