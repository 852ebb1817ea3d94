"""Whether a call may run the Triton kernels (`triton_elementwise`): CUDA tensors only.

triton is an optional dependency (the ``gpu`` extra): it is imported on first need, and a
machine without it keeps every path in PyTorch.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_kernels():
    """`triton_elementwise`, or None where triton is not installed (an optional import)."""
    try:
        from . import triton_elementwise
    except ImportError:
        return None
    return triton_elementwise


def triton_ready(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether Triton kernels may run on tensors of ``device`` and ``dtype``: a CUDA tensor,
    float32/float16/bfloat16 (float64 stays on the tiles), not inside a user's
    ``torch.compile`` (the tiles are traceable; the kernels' launch is not registered with it),
    not ``SHARPATTN_TRITON=0`` (the tiles instead: to compare, or to step around a kernel), and
    triton importable."""
    return (
        device.type == "cuda"
        and os.environ.get("SHARPATTN_TRITON", "1").strip() != "0"
        and dtype != torch.float64
        and not torch.compiler.is_compiling()
        and triton_kernels() is not None
    )
