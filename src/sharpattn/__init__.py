"""sharpattn: sharp attention at any input size.

>>> import torch, sharpattn
>>> q = k = v = torch.randn(1, 4, 128, 32)
>>> out = sharpattn.attend(q, k, v, method="adaptive")
"""

from . import normalizers
from .attention import DropInMultiheadAttention, MultiheadAttention, attend, causal_mask, swap
from .attention.machine import info

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


def __getattr__(name):
    # sharpattn.hf (its functions need the `hf` extra, transformers) is imported only when asked for.
    # Not an alias: it imports sharpattn/hf.py, the one place sharpattn.hf is made the module
    # sharpattn.integrations.hf (needed for `import sharpattn.hf`, which never calls this).
    if name == "hf":
        import importlib

        return importlib.import_module(".hf", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
