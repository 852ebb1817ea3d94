"""Diagnostics: capture attention internals and measure dispersion and extreme tokens."""

from .capture import Capture, capture, head_ablation, side_by_side
from .metrics import (
    attention_on,
    classify_heads,
    delta_logit,
    dispersion_horizon,
    head_logit_spread,
    logit_spread,
    norm_ratio,
    qk_operator_norm,
    residual_peak,
    sink_logit_gap,
    sink_logit_stats,
    sink_mass,
    sink_tokens,
    spikiness,
    value_drain,
    weight_stats,
)

__all__ = [
    "Capture",
    "attention_on",
    "capture",
    "classify_heads",
    "delta_logit",
    "dispersion_horizon",
    "head_ablation",
    "head_logit_spread",
    "logit_spread",
    "norm_ratio",
    "qk_operator_norm",
    "residual_peak",
    "weight_stats",
    "side_by_side",
    "sink_logit_gap",
    "sink_logit_stats",
    "sink_mass",
    "sink_tokens",
    "spikiness",
    "value_drain",
]
