"""Every O(n)-memory fast path by the name a registry entry gives in ``Normalizer.fused``.

Each takes ``(q, k, v, masking, scale, want_stats, **params)`` and returns ``(output,
AttentionStats | None)``; [`attend`][sharpattn.attention.attend] runs it for ``impl="fused"`` and
``impl="auto"``. The softmax family rides torch's flash kernel (`fused`); the other
normalizers walk tiles of the score matrix (`tiles`) with their own backward.
"""

from __future__ import annotations

from .adaptive_tiled import adaptive
from .fused import FUSED
from .sparse_tiled import SPARSE_TILED
from .stick_tiled import STICK
from .tiled import TILED

FAST = {**FUSED, **TILED}
FAST.update(STICK)
FAST.update(SPARSE_TILED)
FAST["adaptive"] = adaptive  # slabs where they run, else fused.adaptive
