"""Normalizers: scores ``[..., Lq, Lk]`` -> attention weights, all behind one contract.

``fn(scores, mask=None, **params) -> weights``; see `sharpattn.normalizers._contract`.
Look a method up by name with [`get`][sharpattn.normalizers.get]; [`available`][sharpattn.normalizers.available] lists them. Every built-in method is
also importable under its registry name (``from sharpattn.normalizers import sparsemax``).

``__all__`` lists the public names: the registry, every built-in method, adaptive's temperature
polynomial and the row statistics. The contract's building blocks for writing a normalizer
(``prepare``, ``masked_softmax``, ``finish``, ...) are imported from their module,
``sharpattn.normalizers._contract``; a family's hooks and their length term ``log_n`` from
``sharpattn.normalizers.families``.
"""

from .registry import Normalizer, Param, available, get, markdown_table, register, unregister

# Importing a module registers its normalizers; this order is the order of `available()`.
# isort: off
from .softmax import (
    COEFFICIENTS,
    adaptive,
    adaptive_beta,
    entropy_crossings,
    polyval,
    resolve_coefficients,
    softmax,
)
from .scaled import length_scaled, llama4_temperature, logn, ssmax
from .sinks import sink
from .unnormalised import relu, sigmoid
from .kernels import power, signed, softpick, stablemax
from .sparse import asentmax, entmax, entmax15, hardmax, sparsemax, topk
from .stick_breaking import stick_breaking

# isort: on
from .registry import freeze_built_ins
from .stats import effective_support, entropy, max_weight, null_attention

freeze_built_ins()  # every method above is sharpattn's own; any registered later is a user's

__all__ = [
    "COEFFICIENTS",
    "Normalizer",
    "Param",
    "adaptive",
    "adaptive_beta",
    "asentmax",
    "available",
    "effective_support",
    "entmax",
    "entmax15",
    "entropy",
    "entropy_crossings",
    "get",
    "hardmax",
    "length_scaled",
    "llama4_temperature",
    "logn",
    "markdown_table",
    "max_weight",
    "null_attention",
    "polyval",
    "power",
    "register",
    "relu",
    "resolve_coefficients",
    "sigmoid",
    "signed",
    "sink",
    "softmax",
    "softpick",
    "sparsemax",
    "ssmax",
    "stablemax",
    "stick_breaking",
    "topk",
    "unregister",
]
