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
import math
from collections.abc import Callable

import torch

from ...normalizers import Normalizer
from ...normalizers._entmax import SAFE_ALPHA
from ...normalizers.families import (
    Adaptive,
    Elementwise,
    RowNormalised,
    RowScaled,
    Sink,
    Sparse,
    StickBreaking,
    TopK,
    check_range,
)
from .. import policy
from ..cpu import decoding, fused
from ..cpu.adaptive_tiled import adaptive
from ..cpu.sparse_tiled import SPARSE_TILED, needs_blocks, selects, sparse
from ..cpu.sparse_tiled import topk as _topk
from ..cpu.stick_tiled import DECODE_MIN_KEYS as STICK_DECODE_MIN_KEYS
from ..cpu.stick_tiled import STICK, stick_breaking
from ..cpu.tiled import TILED, elementwise, row_normalised

#: the built-in fast paths by the name a registry entry gives in ``Normalizer.fused``
FAST = dict(TILED)
FAST.update(STICK)
FAST.update(SPARSE_TILED)
FAST["adaptive"] = adaptive  # slabs where they run, else fused.adaptive


def top_k(family, q, k, v, masking, scale, want_stats, /, **params):
    """The fast path of a user's `TopK` method: the top-k path with k = ``family.count``."""
    count = family.count_of(**params)
    return _topk(q, k, v, masking, scale, want_stats, top_k=count)


def stick(family, q, k, v, masking, scale, want_stats, /, **params):
    """The fast path of a user's `StickBreaking` method: the stick-breaking tiles, given the
    parameters that family reads (``StickBreaking.reads``: its score shift too)."""
    names = (*family.reads, "blocks")
    return stick_breaking(
        q, k, v, masking, scale, want_stats, **{n: params[n] for n in names if n in params}
    )


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
    with a path of its own (``adaptive``, ``entmax_tiled``, ``stick_breaking``, ...) takes it; the
    element-wise and row-normalised families' runners take their kernel record themselves."""
    family = entry.family
    kernel = getattr(family, "kernel", None)
    if kernel is not None and kernel.tiles is None:  # a built-in path of its own
        return FAST.get(kernel.name)
    if family is not None and family.path in FAMILY_PATHS:
        return functools.partial(FAMILY_PATHS[family.path], family)
    return FAST.get(entry.fused) if entry.fused is not None else None


def beta_bound(entry: Normalizer, params: dict, lk: int) -> float | None:
    """An upper bound of |β| over every row of a `RowScaled` or `Adaptive` method's call (1.0
    for other methods), from ``params`` with every default filled in, or None where the
    family's ``beta`` cannot be evaluated apart from a call.

    β is evaluated on a grid of the quantity it depends on: the visible keys n of 1 to ``lk``
    (log-spaced integers and ``lk``) or the entropy H of 0 to log ``lk`` (1,025 points); a
    temperature is read as it is. A tensor parameter (learnable) is read on the host: call it
    only where ``attend`` may synchronise (``check_finite``). Bounds from numbers alone are
    kept (`_number_bound`)."""
    family = entry.family
    if not isinstance(family, (RowScaled, Adaptive)):
        return 1.0
    if any(torch.is_tensor(p) for p in params.values()):
        return _bound(family, params, lk)
    try:
        return _number_bound(family, tuple(sorted(params.items())), lk)
    except TypeError:  # an unhashable parameter (a list of coefficients)
        return _bound(family, params, lk)


@functools.lru_cache(maxsize=256)
def _number_bound(family, items: tuple, lk: int) -> float | None:
    return _bound(family, dict(items), lk)


@functools.lru_cache(maxsize=64)
def _grid(adaptive: bool, lk: int) -> torch.Tensor:
    lk = max(lk, 1)
    if adaptive:  # entropies of 0 to log lk nats
        return torch.linspace(0.0, math.log(lk), 1025, dtype=torch.float64).unsqueeze(-1)
    n = torch.logspace(0.0, math.log10(lk), 513, dtype=torch.float64).round()
    return torch.cat([torch.unique(n), torch.full((1,), float(lk), dtype=torch.float64)])[:, None]


def _bound(family, params: dict, lk: int) -> float | None:
    grid = None
    if isinstance(family, Adaptive) or family.counts:
        grid = _grid(isinstance(family, Adaptive), lk)
        tensors = [p for p in params.values() if torch.is_tensor(p)]
        if tensors and tensors[0].device.type != "cpu":
            grid = grid.to(device=tensors[0].device, dtype=torch.float32)
    try:
        with torch.no_grad():
            beta = family.beta(grid, **params)
            if torch.is_tensor(beta):
                beta = beta.detach().abs().amax().item() if beta.numel() else 0.0
            return abs(float(beta))
    except Exception:  # a user's β that needs a call's own shapes: not bounded here
        return None


def check_hook_values(entry: Normalizer, params: dict, masking, rows: tuple) -> None:
    """`HookError` where a user's `Sparse` method's hooks give a value outside their range on
    a call with ``params``: α (a tensor, read here) outside `_entmax.SAFE_ALPHA`, θ <= 0 on a
    row of the call (``masking``'s visible keys, rows ``rows`` = ``[B, H, Lq, 1]``). The naive
    maths checks the same on its rows. Reads tensors on the host: only with ``check_finite``."""
    family = entry.family
    if not isinstance(family, Sparse) or family.kernel is not None:
        return  # a built-in's hooks stay in range on the values its parameters accept
    alpha = family.alpha_of(params, rows)
    if torch.is_tensor(alpha):
        check_range(alpha, "alpha", *SAFE_ALPHA)
    if family.scale is not None:
        with torch.no_grad():
            n = masking.visible_keys(dtype=torch.float32)
            check_range(family.scale_of(n, rows, **params), "scale", 0.0, math.inf, low_open=True)


def scores_in_range(
    entry: Normalizer, params: dict, q, k, scale: float, bound: float, exact: float | None = None
) -> bool:
    """Whether the flash kernel of a row-scaled or adaptive method keeps its gradients within
    precision: |β|·|s| below `policy.FUSED_SCALED_SCORE_MAX` for every score, with ``bound`` >=
    max |s| (``attend``'s D·max|q|·max|k|·|scale|) and, where that is too loose, the
    Cauchy–Schwarz bound max_i ‖q_i‖·max_j ‖k_j‖·|scale| (one pass over q and k), or ``exact``,
    the largest |β·s| itself where a decoding step computed every score. Reads tensors on the
    host: ``attend`` calls it only with ``check_finite``."""
    if not isinstance(entry.family, (RowScaled, Adaptive)):
        return True
    beta = beta_bound(entry, params, k.shape[-2])
    top = policy.FUSED_SCALED_SCORE_MAX
    if beta is None or beta * bound < top:
        return True
    if q.numel() == 0 or k.numel() == 0:
        return True
    if not math.isfinite(beta):
        return False
    if exact is not None:
        return exact < top
    with torch.no_grad():
        # in the compute dtype (a float64 copy of a long KV cache cost more than the attention
        # of a decoding step); every norm is at most √D·max|x|, which attend's range check keeps
        # finite, and the margin covers the rounding of D-term sums many times over
        cd = torch.promote_types(q.dtype, torch.float32)
        nq, nk = (
            float(torch.linalg.vector_norm(t.detach(), dim=-1, dtype=cd).amax()) * (1 + 1e-4)
            for t in (q, k)
        )
    return beta * nq * nk * abs(scale) < top


def decodes(entry: Normalizer, q, k, v, masking, want_stats: bool, params: dict) -> bool:
    """Whether the fast path of ``entry`` runs this call as a decoding step on the CPU
    (`decoding.applies`: passes over the cache that report what they read of k and v, so that
    ``attend`` checks them from that): the row-scaled softmax family, the sinks, the
    element-wise and row-normalised maps with C++ loops, adaptive temperature's own path,
    stick-breaking's whole rows, the entmax family's slab and top-k's selection. Where a path
    reads less after all, ``attend`` reads k and v itself afterwards."""
    family = entry.family
    path = path_of(entry)
    full = {p.name: p.default for p in entry.params}
    full.update(params)
    if isinstance(family, Adaptive):
        if path is not adaptive:
            return False
    elif isinstance(family, StickBreaking):
        if path is not stick_breaking or params.get("blocks") is not None:
            return False
        if k.shape[2] < STICK_DECODE_MIN_KEYS:
            return False
    elif isinstance(family, TopK):
        if path is not _topk or not selects(q, masking, full["top_k"]):
            return False
    elif isinstance(family, Sparse):
        if family.kernel is None or family.kernel.name not in SPARSE_TILED:
            return False
        alpha = family.alpha_of(params, (*q.shape[:3], 1))
        if params.get("blocks") is not None or needs_blocks(alpha):
            return False
    elif isinstance(family, (Elementwise, RowNormalised)):
        kernel = family.kernel
        if kernel is None or kernel.tiles is None or not kernel.cpp:
            return False
        if params.get("blocks") is not None:
            return False
    elif not isinstance(family, (RowScaled, Sink)):
        return False
    tensors = [p for p in params.values() if torch.is_tensor(p)]
    return decoding.applies(q, k, v, masking, want_stats, tensors)
