"""Attention over any normalizer: the functional [`attend`][sharpattn.attend] and [`MultiheadAttention`][sharpattn.MultiheadAttention]."""

from .functional import attend, causal_mask
from .mha import MultiheadAttention
from .selective import SelectiveConfig, parameter_overhead, selective_attend
from .stats import AttentionStats

__all__ = [
    "AttentionStats",
    "MultiheadAttention",
    "SelectiveConfig",
    "attend",
    "causal_mask",
    "parameter_overhead",
    "selective_attend",
]
