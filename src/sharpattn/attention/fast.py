"""Every O(n)-memory fast path, found from a registry entry by `path_of`.

Each takes ``(q, k, v, masking, scale, want_stats, **params)`` and returns ``(output,
AttentionStats | None)``; `attend` runs it for ``impl="fused"`` and
``impl="auto"``. A method that declares a family (`sharpattn.normalizers.families`) runs
that family's path with its hooks: the row-scaled softmax family, the sink family and adaptive
temperature ride torch's flash kernel (`fused.row_scaled`, `fused.sink`, `fused.adaptive`),
the element-wise family walks key tiles (`tiled.elementwise`); a family that names a built-in
kernel takes it (C++ loops, Triton). The other methods name a path of `FAST`: the normalizers
that walk tiles of the score matrix (`tiles`) with their own backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ..normalizers import Normalizer
from ..normalizers.families import Adaptive, Elementwise, RowScaled, Sink
from . import fused
from .adaptive_tiled import adaptive
from .sparse_tiled import SPARSE_TILED
from .stick_tiled import STICK
from .tiled import TILED, elementwise

#: the built-in fast paths by the name a registry entry gives in ``Normalizer.fused``
FAST = dict(TILED)
FAST.update(STICK)
FAST.update(SPARSE_TILED)
FAST["adaptive"] = adaptive  # slabs where they run, else fused.adaptive

#: the family runners: ``runner(family, q, k, v, masking, scale, want_stats, **params)``
FAMILY_PATHS = {
    RowScaled.path: fused.row_scaled,
    Adaptive.path: fused.adaptive,
    Sink.path: fused.sink,
    Elementwise.path: elementwise,
}


def path_of(entry: Normalizer) -> Callable | None:
    """The fast path of a registry entry, or None when it has none: its family's runner bound to
    its family, else the built-in path its ``fused`` names. A family that names a built-in kernel
    (``sigmoid``, ``relu``, ``adaptive``) takes that method's own path."""
    family = entry.family
    if getattr(family, "kernel", None) is not None:
        return FAST.get(family.kernel)
    if family is not None and family.path in FAMILY_PATHS:
        return functools.partial(FAMILY_PATHS[family.path], family)
    return FAST.get(entry.fused) if entry.fused is not None else None
