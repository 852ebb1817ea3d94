"""Tolerances from precision, not from one CPU.

Every floating-point comparison in the suite goes through :func:`assert_close`. Its bound is

    |actual − expected| ≤ ulps · ε(dtype) · √n · (magnitude + |expected|)

- ``ε(dtype)`` is the machine epsilon of the precision the *tested* value was computed in
  (float32: 1.19e-7, bfloat16: 7.8e-3, float64: 2.2e-16) — not of the reference, which is float64;
- ``magnitude`` is the size of the quantities the result was accumulated from (for an attention
  output: max |v|; for weights: 1); by default max |expected|. Absolute error of a sum scales with
  the size of its terms, not with the size of the result;
- ``n`` is the length of the reduction behind each element (keys summed over, the head dimension of
  a dot product, ...). Reassociating a sum of n terms (another SIMD width, another block size)
  moves it by O(n·ε) in the worst case and by O(√n·ε) with rounding errors of random sign
  (Higham & Mary, *A new approach to probabilistic rounding error analysis*, SISC 2019); √n is
  the bound used here, with ``ulps`` as its constant;
- ``ulps`` (default 8) absorbs the few operations in a row (exp, a division, a rescale). A test
  that loosens it says in a comment why that much error is expected (an error amplified by a
  derivative, a chain of dependent reductions, ...).

A test that checks something exact (masked weights are 0, bit-identical resume, integer counts)
does not use this helper: it compares with ``==`` / ``torch.equal``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

ULPS = 8.0

_NUMPY_TO_TORCH = {
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}


def _dtype_of(x) -> torch.dtype:
    if isinstance(x, torch.Tensor):
        return x.dtype if x.is_floating_point() else torch.float64
    arr = np.asarray(x)
    return _NUMPY_TO_TORCH.get(arr.dtype, torch.float64)


def eps(dtype) -> float:
    """Machine epsilon of a torch or NumPy floating dtype (float64 for anything else)."""
    if not isinstance(dtype, torch.dtype):
        dtype = _NUMPY_TO_TORCH.get(np.dtype(dtype), torch.float64)
    return float(torch.finfo(dtype).eps)


def tolerance(dtype, *, n: int = 1, magnitude: float = 1.0, ulps: float = ULPS) -> float:
    """Absolute bound ``ulps · ε(dtype) · √n · magnitude`` (see the module docstring)."""
    return ulps * eps(dtype) * math.sqrt(max(int(n), 1)) * float(magnitude)


def _as_float64(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64)
    return torch.from_numpy(np.array(x, dtype=np.float64))  # a copy: inputs may be read-only


def assert_close(
    actual,
    expected,
    *,
    dtype=None,
    n: int = 1,
    magnitude: float | None = None,
    ulps: float = ULPS,
    msg: str | None = None,
    equal_nan: bool = False,
) -> None:
    """Assert ``actual ≈ expected`` within the precision of ``dtype`` (default: ``actual``'s).

    ``actual``/``expected`` are tensors, arrays or numbers; both are compared in float64.
    ``magnitude`` defaults to max |expected| (at least max |actual| if expected is all zero).
    Infinities must match exactly; NaN fails unless ``equal_nan``.
    """
    dtype = _dtype_of(actual) if dtype is None else dtype
    a, e = _as_float64(actual), _as_float64(expected)
    if a.shape != e.shape:
        a, e = torch.broadcast_tensors(a, e)
    if magnitude is None:
        finite = e[torch.isfinite(e)]
        magnitude = float(finite.abs().max()) if finite.numel() else 0.0
        if magnitude == 0.0:
            fa = a[torch.isfinite(a)]
            magnitude = float(fa.abs().max()) if fa.numel() else 0.0
    rel = ulps * eps(dtype) * math.sqrt(max(int(n), 1))
    torch.testing.assert_close(
        a,
        e,
        atol=rel * float(magnitude),
        rtol=rel,
        equal_nan=equal_nan,
        msg=(lambda m: f"{msg}: {m}") if msg else None,
    )
