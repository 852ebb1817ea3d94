"""Attention over any normalizer: the functional [`attend`][sharpattn.attend], [`MultiheadAttention`][sharpattn.MultiheadAttention], and [`DropInMultiheadAttention`][sharpattn.DropInMultiheadAttention] with [`swap`][sharpattn.swap] for models built on ``torch.nn.MultiheadAttention``."""

from .dropin import DropInMultiheadAttention, swap
from .functional import attend, causal_mask
from .mha import MultiheadAttention
from .selective import SelectiveConfig, parameter_overhead, selective_attend
from .stats import AttentionStats

__all__ = [
    "AttentionStats",
    "DropInMultiheadAttention",
    "MultiheadAttention",
    "SelectiveConfig",
    "attend",
    "causal_mask",
    "parameter_overhead",
    "selective_attend",
    "swap",
]
