"""The per-tile element-wise work of the tiled paths, compiled with ``torch.compile``.

Eagerly, each element-wise op of a tile (a subtraction, an ``exp2``, a product with the mask, a
row sum) is one pass over the tile's scores; Inductor fuses them into one vectorised C++ loop.
Compiled here: the sparse maps' Newton steps and top-k's kept weights (``benchmarks/attention.py``
at n = 4,096, 2 threads, forward CPU time as a ratio to SDPA's: 1.5-entmax 2.43 → 1.70, α = 1.3
6.44 → 5.28, top-k 3.24 → 2.31). Softpick's forward measured slower compiled (1.64 → 1.79), and
adaptive's entropy tile gave wrong values compiled under ``ATEN_CPU_CAPABILITY=avx2`` on an
AVX-512 CPU: both stay eager. The tile functions
are pure but for their scratch scores, so the compiled and the eager function compute the same
maths and either can run at any time.

When the compiled one runs (`wanted`), from the environment variable ``SHARPATTN_COMPILE``:

* ``0``: never (the pure-PyTorch path everywhere);
* ``1``: on every CPU call (the tests use it to hold the compiled path to the eager one);
* unset or ``auto``: on CPU calls of at least `COMPILE_MIN` score entries (compiling costs
  a few seconds once per process and function, which only a long call repays) when a C++
  compiler is on the ``PATH`` and ATen's CPU path is vectorised (`vectorised`).

Never inside a graph that ``torch.compile`` is already tracing (the user's compile takes the
eager function in), never on another device (not measured here). A compilation that fails (no
working compiler, an unsupported op) warns once and leaves that function eager for the process.
"""

from __future__ import annotations

import functools
import os
import shutil
import warnings
from collections.abc import Callable

import torch

#: score entries (B·H·Lq·Lk) from which a CPU call's tiles use the compiled functions by default
COMPILE_MIN = 2**22

_ENV = "SHARPATTN_COMPILE"
_MODES = ("0", "1", "auto")


def mode() -> str:
    """``SHARPATTN_COMPILE``: "0", "1" or "auto" (unset or empty: "auto"); another value is
    refused in one sentence."""
    value = os.environ.get(_ENV, "").strip().lower() or "auto"
    if value not in _MODES:
        raise ValueError(f"{_ENV} must be 0, 1 or auto, got {value!r}.")
    return value


def compiler() -> str | None:
    """The path of the C++ compiler on the PATH (``CXX``, else c++, g++, clang++), or None."""
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    return None


@functools.cache
def compiler_found() -> bool:
    """Whether a C++ compiler Inductor could use is on the PATH (`compiler`); looked up
    once per process, not on every large call."""
    return compiler() is not None


def vectorised() -> bool:
    """Whether torch runs its own vectorised CPU path (``ATEN_CPU_CAPABILITY`` unset): with it
    set to ``default`` Inductor's CPU code failed to compile here (``BackendCompilerFailed``),
    and with ``avx2`` on an AVX-512 CPU a compiled entropy tile gave wrong values (NaN), so
    ``auto`` compiles only on torch's own path."""
    if os.environ.get("ATEN_CPU_CAPABILITY", "").strip():
        return False
    return torch.backends.cpu.get_cpu_capability().upper() not in ("DEFAULT", "NO AVX")


def wanted(device: torch.device, entries: int) -> bool:
    """Whether a call on ``device`` with ``entries`` score entries runs compiled tile functions."""
    choice = mode()
    if choice == "0" or device.type != "cpu" or torch.compiler.is_compiling():
        return False
    return choice == "1" or (entries >= COMPILE_MIN and compiler_found() and vectorised())


class TileFunction:
    """A pure per-tile function with a compiled twin: ``f(use, *args)`` runs the compiled one
    when ``use`` (from `wanted`, once per call), else the function itself."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.name = fn.__qualname__
        self._compiled: Callable | None = None
        self.broken: str | None = None  # why compiling failed, if it did

    def __call__(self, use: bool, *args):
        if not use or self.broken is not None:
            return self.fn(*args)
        try:
            if self._compiled is None:
                _allow_variants()
                self._compiled = torch.compile(self.fn, dynamic=True, fullgraph=True)
            return self._compiled(*args)
        except Exception as exc:  # no working compiler, an op Inductor cannot take
            self.broken = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            warnings.warn(
                f"sharpattn: compiling {self.name} failed ({self.broken}); it runs eagerly from "
                f"now on (set {_ENV}=0 to skip compiling).",
                RuntimeWarning,
                stacklevel=2,
            )
            return self.fn(*args)


#: compiled variants a tile function may need: per dtype, masked or not, and the mask's layout
#: (causal ``[r, c]``, padding ``[B, 1, 1, c]``, per row ``[B, H, r, c]``), for each kernel
VARIANTS = 64


def _allow_variants() -> None:
    """Raise dynamo's recompile limit (8 by default; only ever raised here) to `VARIANTS`:
    with ``fullgraph=True`` a function past the limit fails instead of running."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name) and getattr(config, name) < VARIANTS:
            setattr(config, name, VARIANTS)
            return


def tile_function(fn: Callable) -> TileFunction:
    """Decorator: ``fn`` as a `TileFunction`."""
    return TileFunction(fn)
