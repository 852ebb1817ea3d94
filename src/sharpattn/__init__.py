"""sharpattn: sharp attention at any input size.

>>> import torch, sharpattn
>>> q = k = v = torch.randn(1, 4, 128, 32)
>>> out = sharpattn.attend(q, k, v, method="adaptive")

The names below are imported on first use (`__getattr__`), so ``import sharpattn`` and the
``sharpattn`` command's ``--help`` do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from . import normalizers
    from .attention import DropInMultiheadAttention, MultiheadAttention, attend, causal_mask, swap
    from .attention.dispatch.machine import info

__version__ = "0.1.0"
__all__ = [
    "DropInMultiheadAttention",
    "MultiheadAttention",
    "__version__",
    "attend",
    "causal_mask",
    "info",
    "normalizers",
    "swap",
]

#: each lazily imported name and the module that defines it (None: the name is a subpackage)
_LAZY = {
    "DropInMultiheadAttention": ".attention",
    "MultiheadAttention": ".attention",
    "attend": ".attention",
    "causal_mask": ".attention",
    "swap": ".attention",
    "info": ".attention.dispatch.machine",
    "normalizers": None,
    # sharpattn.hf (its functions need the `hf` extra, transformers) is imported only when asked
    # for. Not an alias: it imports sharpattn/hf.py, the one place sharpattn.hf is made the
    # module sharpattn.integrations.hf (needed for `import sharpattn.hf`, which never calls this).
    "hf": None,
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = _LAZY[name]
    if where is None:
        return importlib.import_module(f".{name}", __name__)
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
