"""Softmax with a sink in the denominator ("softmax+1", learned attention sinks).

The sink is a virtual key with logit b that every query sees but whose value is zero: rows sum
to less than one, and the missing mass, 1 − Σ_j w_j = e^b / (e^b + Σ_j e^{s_j}), is the
"null attention" (Smith's blog), reported by [`sharpattn.normalizers.stats.null_attention`][sharpattn.normalizers.stats.null_attention].
"""

from __future__ import annotations

import torch

from ._contract import normalizer
from .families import Sink, log_n
from .registry import Normalizer, Param, register

Tensor = torch.Tensor


@normalizer
def sink(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    bias: float | Tensor = 0.0,
    bias_log_n: float | Tensor = 0.0,
    check_finite: bool = True,
) -> Tensor:
    """w_i = exp(s_i) / (exp(b) + Σ_j exp(s_j)) over the allowed keys, b = bias + bias_log_n·log n.

    b = 0 is "softmax+1" (Miller 2023); a learnable per-head b is gpt-oss's sink; ``bias_log_n``
    makes the sink depend on the length, as Smith's blog proposes. Both are learnable per head in
    [`MultiheadAttention`][sharpattn.MultiheadAttention]. A row with no allowed key gives all its mass to the sink
    (all-zero weights).
    """
    return SINK.weights(scores, mask, check_finite=check_finite, bias=bias, bias_log_n=bias_log_n)


def _sink_logit(n: Tensor, bias: float | Tensor = 0.0, bias_log_n: float | Tensor = 0.0, **_):
    """The sink's logit of a row with n visible keys: b = bias + bias_log_n·log n."""
    if not torch.is_tensor(bias_log_n) and bias_log_n == 0:  # a number: no per-row term
        return bias
    return bias + bias_log_n * log_n(n)


SINK = Sink(_sink_logit)


sink = register(
    Normalizer(
        name="sink",
        fn=sink,
        formula="exp(s_i) / (exp(b) + Σ_j exp(s_j)), b = b0 + b1·log n (b = 0: softmax+1)",
        citation="Miller 2023, Attention Is Off By One; Smith (blog); gpt-oss attention sinks",
        sums_to_one=False,
        params=(
            Param("bias", 0.0, "sink logit b0 (0 is softmax+1)", learnable=True),
            Param("bias_log_n", 0.0, "length dependence b1 of the sink logit", learnable=True),
        ),
        family=SINK,
    )
).fn
