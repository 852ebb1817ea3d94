"""Decoding steps on the CPU: a few query rows against a long key/value cache in one C++ pass.

A step of at most `ROWS` query rows that wants no gradient reads each key and value row of the
cache once, in one parallel region (`native.decode`): the cache is split into runs of keys,
each (batch, key head, run) is one unit of work (its rows' scores, the map, Σ w·v), and the runs
are combined per row as flash decoding combines softmax's (a row-normalised map's sums rescaled
to the largest row reference). The element-wise and row-normalised maps (`tiled`) and the softmax
family and sinks (`fused`) take it, and adaptive temperature (`adaptive_tiled`) a pass of its own
with the same shape (`adaptive_step`: each row's entropy and β from its runs' moments, then the
weights of the scores the pass kept).

The same pass keeps the largest |k|, |v| and |β·s| it read and computed. The paths with a row
rule of their own (stick-breaking, top-k, the entmax family) take the step's two products from
`scores` and `values`, which read the cache once each and report the same. `attend` checks its
inputs (finite, and q·kᵀ within the dtype) by reading q, k and v; for a long cache that read
costs about as much as SDPA's whole step. Where a call will take this pass (`applies`), `attend` checks q alone
before it and k and v from what the pass reports (`collected`), so the cache is read once.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ...normalizers._contract import compute_dtype
from ..masking import Masking
from . import native
from .tiles import LOG2E, prefix_ends

Tensor = torch.Tensor

#: steps of at most this many query rows that want no gradient take the pass
ROWS = 16
#: keys per run at the least: more runs than this gives no unit enough keys to pay for itself
MIN_RUN = 512


@dataclass
class Reads:
    """What a call's decoding passes read of its cache: the largest |k| and |v| (each infinite
    or NaN where any value of that tensor is; None while no pass read that tensor whole), and
    the largest |β·s| of the scores they computed, with β each row's factor (the row-scaled
    family's, which q carries; adaptive temperature's own; 1 for the maps without one)."""

    k: float | None = None
    v: float | None = None
    score: float | None = None

    def add(self, k: float, v: float, score: float) -> None:
        """Take in one pass's magnitudes (None: not read by that pass)."""
        self.k, self.v, self.score = (
            _top(a, b) for a, b in zip((self.k, self.v, self.score), (k, v, score), strict=True)
        )

    @property
    def complete(self) -> bool:
        """Whether every key and value row was read."""
        return self.k is not None and self.v is not None


def _top(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return b if a is None else a
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


#: where `attend` collects what the passes read (`collected`), or None
_box: contextvars.ContextVar[Reads | None] = contextvars.ContextVar("sharpattn_reads", default=None)


@contextlib.contextmanager
def collected() -> Iterator[Reads]:
    """A `Reads` that every pass run inside the block reports to."""
    box = Reads()
    token = _box.set(box)
    try:
        yield box
    finally:
        _box.reset(token)


def reading() -> bool:
    """Whether `attend` collects what the passes read (it deferred its check of k and v); never
    in a graph that ``torch.compile`` traces (the check reads values on the host)."""
    if torch.compiler.is_compiling():
        return False
    return _box.get() is not None


def _report(k=None, v=None, score=None) -> None:
    box = _box.get()
    if box is not None:
        box.add(k, v, score)


def applies(q: Tensor, k: Tensor, v: Tensor, masking: Masking, want_stats: bool, grads) -> bool:
    """Whether a call takes the pass: float32 compute on the CPU with the C++ loops
    (`native.wanted`), at most `ROWS` query rows, every key visible or a causal mask, no
    statistics, and no gradient wanted for q, k, v or any tensor of ``grads``."""
    if q.shape[2] > ROWS or masking.mask is not None or masking.structure is not None:
        return False
    if want_stats or 0 in (*q.shape, *k.shape, *v.shape):
        return False
    if torch.is_grad_enabled() and any(
        torch.is_tensor(t) and t.requires_grad for t in (q, k, v, *grads)
    ):
        return False
    return native.wanted(q.device, compute_dtype(q.dtype))


def _runs(b: int, hkv: int, lk: int) -> int:
    """How many runs to split the keys into: enough units for every thread four times over,
    none shorter than `MIN_RUN` keys."""
    units = b * hkv
    want = math.ceil(4 * torch.get_num_threads() / units)
    return max(1, min(want, lk // MIN_RUN))


def _cache(x: Tensor, b: int) -> Tensor:
    """k or v as float32 ``[B, Hkv, Lk, D]`` with unit stride in the head dimension (a copy only
    for another dtype or layout)."""
    if x.dtype != torch.float32:
        x = x.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.expand(b, *x.shape[1:])


def _inputs(q: Tensor, k: Tensor, v: Tensor, masking: Masking, scale: float):
    """(q·scale float32 contiguous, k and v as `_cache`, the causal rows' `prefix_ends` or None,
    the runs) of one pass."""
    b, lq, lk = q.shape[0], q.shape[2], k.shape[2]
    qs = (q.float() * scale).contiguous()
    ends = prefix_ends(0, lq, 0, lk, masking.offset, q.device) if masking.causal else None
    return qs, _cache(k, b), _cache(v, b), ends, _runs(b, k.shape[1], lk)


def step(
    name: str,
    p: float,
    shift: float,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masking: Masking,
    scale: float,
    row: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(output, m, Z), float32, of one step with the map ``name`` (``softmax``, or a kernel
    record's name) and its constants ``p`` and ``shift``; m and Z ``[B, H, Lq, 1]`` are a
    normalised map's row reference and Σ a relative to it (softmax: log-sum-exp = m + log Z),
    undefined for an element-wise map. ``row``: the element-wise maps' per-row values. The pass
    must apply (`applies`)."""
    qs, kc, vc, ends, runs = _inputs(q, k, v, masking, scale)
    rows = None
    if row is not None:
        rows = row.float().expand(*q.shape[:3], 1).contiguous()
    out, m, z, mags = native.decode(name, p, shift, qs, kc, vc, ends, rows, runs)
    if reading():
        _report(*mags.tolist())
    return out, m, z


def adaptive_step(q, k, v, masking: Masking, scale: float, coef, threshold, floor) -> Tensor:
    """The output, float32, of one adaptive-temperature step (β(H) from ``coef``, ``threshold``
    and ``floor``, `adaptive_forward`'s rule) in one pass over the cache; its magnitudes go to
    `collected` as `step`'s do, the largest |β·s| with each row's own β. The pass must apply."""
    qs, kc, vc, ends, runs = _inputs(q, k, v, masking, scale * LOG2E)
    out, mags = native.decode_adaptive(qs, kc, vc, ends, coef, threshold, floor, runs)
    if reading():
        mk, mv, top = mags.tolist()
        _report(mk, mv, top / LOG2E)
    return out


def scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """scale·q·kᵀ ``[B, H, Lq, Lk]``, float32, of a step in one pass over the keys (each key row
    read once; max |k| and max |s| reported to `collected`)."""
    b = q.shape[0]
    qs = (q.float() * scale).contiguous()
    s, mags = native.decode_scores(qs, _cache(k, b), _runs(b, k.shape[1], k.shape[2]))
    if reading():
        mk, _, top = mags.tolist()
        _report(k=mk, score=top)
    return s


def values(w: Tensor, v: Tensor) -> Tensor:
    """w·v ``[B, H, Lq, Dv]``, float32, of a step's weights ``[B, H, Lq, Lk]`` in one pass over
    the values (each value row read once, zero weights skipped; max |v| reported to
    `collected`)."""
    b = w.shape[0]
    w = w.float().contiguous()
    out, mags = native.decode_values(w, _cache(v, b), _runs(b, v.shape[1], v.shape[2]))
    if reading():
        _report(v=float(mags[1]))
    return out
