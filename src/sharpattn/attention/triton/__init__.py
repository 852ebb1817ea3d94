"""The CUDA tier: Triton kernels of every map with a kernel record that says ``triton``.

`template` (the flash-style skeleton and its launch), `maps` (each map's per-score formulas),
`softmax` (softmax with its log-sum-exp), `sparse` (the entmax family), `topk` (top-k and
hardmax) and `stick` (stick-breaking). This package imports triton: the library reaches it only
through ``attention.devices.triton_kernels``, once ``devices.backend`` chose it. The tests run
these kernels on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``, read when the kernels
are defined, i.e. when this package is imported).
"""

from .softmax import softmax_attention
from .sparse import ENTMAX_STEPS_TENSOR, entmax_attention
from .stick import stick_attention
from .template import attention
from .topk import TOPK_MAX, topk_attention

__all__ = [
    "ENTMAX_STEPS_TENSOR",
    "TOPK_MAX",
    "attention",
    "entmax_attention",
    "softmax_attention",
    "stick_attention",
    "topk_attention",
]
