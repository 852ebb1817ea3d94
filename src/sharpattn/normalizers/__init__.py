"""Normalizers: scores ``[..., Lq, Lk]`` -> attention weights, all behind one contract.

``fn(scores, mask=None, **params) -> weights``; see :mod:`sharpattn.normalizers._contract`.
Look a method up by name with :func:`get`; :func:`available` lists them.
"""

from ._contract import masked_softmax, prepare
from .registry import Normalizer, Param, available, get, markdown_table, register, unregister
from .softmax import (
    COEFFICIENTS,
    adaptive,
    adaptive_beta,
    entropy_crossings,
    polyval,
    resolve_coefficients,
    softmax,
)
from .stats import effective_support, entropy, max_weight, null_attention

__all__ = [
    "COEFFICIENTS",
    "Normalizer",
    "Param",
    "adaptive",
    "adaptive_beta",
    "available",
    "effective_support",
    "entropy",
    "entropy_crossings",
    "get",
    "markdown_table",
    "masked_softmax",
    "max_weight",
    "null_attention",
    "polyval",
    "prepare",
    "register",
    "resolve_coefficients",
    "softmax",
    "unregister",
]

# Importing a module registers its normalizers; this order is the order of `available()`.
from . import scaled, sinks, unnormalised, kernels, sparse, stick_breaking  # noqa: E402, F401, I001
