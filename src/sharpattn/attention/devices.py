"""Where a call runs: the one choice among a map's kernels (`backend`) and the one readiness
check of the Triton kernels (`triton_ready`: CUDA tensors only).

triton is an optional dependency (the ``gpu`` extra): it is imported on first need, and a
machine without it keeps every path in PyTorch.
"""

from __future__ import annotations

import functools
import os

import torch

from ..normalizers._contract import compute_dtype
from ..normalizers.families import Kernel
from .cpu import native


@functools.cache
def triton_kernels():
    """The CUDA tier (``attention.triton``), or None where triton is not installed (an optional
    import, made on first need)."""
    try:
        from . import triton as kernels
    except ImportError:
        return None
    return kernels


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


def backend(
    kernel: Kernel | None, device: torch.device, dtype: torch.dtype, want_stats: bool = False
) -> str:
    """Where a call of a map with the kernel record ``kernel`` runs (None: a user's map, which
    has no kernels of its own): ``"triton"`` where it has Triton kernels, no statistics are
    wanted (the kernels give none) and `triton_ready`; else ``"cpp"`` where it has C++ loops
    and they may run (`native.wanted`: float32 on the CPU, built); else ``"tiles"``, its maths
    in PyTorch (any device and dtype)."""
    if kernel is None:
        return "tiles"
    if kernel.triton and not want_stats and triton_ready(device, dtype):
        return "triton"
    if kernel.cpp and native.wanted(device, compute_dtype(dtype)):
        return "cpp"
    return "tiles"
