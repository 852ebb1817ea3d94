"""Every O(n)-memory fast path, found from a registry entry by `path_of`.

Each takes ``(q, k, v, masking, scale, want_stats, **params)`` and returns ``(output,
AttentionStats | None)``; `attend` runs it for ``impl="fused"`` and
``impl="auto"``. A method that declares a family (`sharpattn.normalizers.families`) runs
that family's path with its hooks: the row-scaled softmax family, the sink family and adaptive
temperature ride torch's flash kernel (`fused.row_scaled`, `fused.sink`, `fused.adaptive`),
the element-wise and row-normalised families walk key tiles (`tiled.elementwise`,
`tiled.row_normalised`), top-k, the entmax family and stick-breaking take their tile paths
(`top_k`, `sparse_tiled.sparse`, `stick`); a family that names a built-in kernel takes it (C++
loops, Triton). The other methods name a path of `FAST`: the normalizers
that walk tiles of the score matrix (`tiles`) with their own backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ..normalizers import Normalizer
from ..normalizers.families import (
    Adaptive,
    Elementwise,
    RowNormalised,
    RowScaled,
    Sink,
    Sparse,
    StickBreaking,
    TopK,
)
from . import fused
from .adaptive_tiled import adaptive
from .sparse_tiled import SPARSE_TILED, sparse
from .sparse_tiled import topk as _topk
from .stick_tiled import STICK, stick_breaking
from .tiled import TILED, elementwise, row_normalised

#: the built-in fast paths by the name a registry entry gives in ``Normalizer.fused``
FAST = dict(TILED)
FAST.update(STICK)
FAST.update(SPARSE_TILED)
FAST["adaptive"] = adaptive  # slabs where they run, else fused.adaptive


def top_k(family, q, k, v, masking, scale, want_stats, /, **params):
    """The fast path of a user's `TopK` method: the top-k path with k = ``family.count``."""
    count = int(family.count(**params))
    return _topk(q, k, v, masking, scale, want_stats, top_k=count)


def stick(family, q, k, v, masking, scale, want_stats, /, **params):
    """The fast path of a user's `StickBreaking` method: the stick-breaking tiles, given the
    parameters that family reads."""
    names = ("attend_current", "query_offset", "blocks")
    return stick_breaking(q, k, v, masking, scale, want_stats,
                          **{n: params[n] for n in names if n in params})  # fmt: skip


#: the family runners: ``runner(family, q, k, v, masking, scale, want_stats, **params)``
FAMILY_PATHS = {
    RowScaled.path: fused.row_scaled,
    Adaptive.path: fused.adaptive,
    Sink.path: fused.sink,
    Elementwise.path: elementwise,
    RowNormalised.path: row_normalised,
    TopK.path: top_k,
    Sparse.path: sparse,
    StickBreaking.path: stick,
}


def path_of(entry: Normalizer) -> Callable | None:
    """The fast path of a registry entry, or None when it has none: its family's runner bound to
    its family, else the built-in path its ``fused`` names. A family that names a built-in kernel
    (``sigmoid``, ``power``, ``adaptive``, ``entmax_tiled``, ...) takes that method's own path."""
    family = entry.family
    if getattr(family, "kernel", None) is not None:
        return FAST.get(family.kernel)
    if family is not None and family.path in FAMILY_PATHS:
        return functools.partial(FAMILY_PATHS[family.path], family)
    return FAST.get(entry.fused) if entry.fused is not None else None
