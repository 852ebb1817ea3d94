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
from .softmax import COEFFICIENTS, adaptive_beta, entropy_crossings, polyval, resolve_coefficients
from . import scaled, sinks, unnormalised, kernels, sparse, stick_breaking  # noqa: F401

# isort: on
from .registry import freeze_built_ins
from .stats import effective_support, entropy, max_weight, null_attention

freeze_built_ins()  # every method above is sharpattn's own; any registered later is a user's
#: every built-in method under its registry name (the registry's list, not a second one)
BUILT_IN = tuple(available())
globals().update({name: get(name).fn for name in BUILT_IN})

__all__ = [
    "COEFFICIENTS",
    "Normalizer",
    "Param",
    "adaptive_beta",
    "available",
    "effective_support",
    "entropy",
    "entropy_crossings",
    "get",
    "markdown_table",
    "max_weight",
    "null_attention",
    "polyval",
    "register",
    "resolve_coefficients",
    "unregister",
    *BUILT_IN,
]
