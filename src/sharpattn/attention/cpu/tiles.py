"""Tiles of the score matrix for the O(n)-memory attention paths.

The tiled paths (`tiled`, `sparse_tiled`, `stick_tiled`,
`adaptive_tiled`) never form the ``[Lq, Lk]`` score matrix: they walk query blocks of
``bq`` rows and, inside each, key tiles of ``bk`` columns, making one ``[B, H, bq, bk]`` tile of
scores at a time (extra memory O(bq·bk + n·D)). `Grid` is that walk, shared by all of
them; `Slabs` walks blocks of rows whose one tile is every key the block sees, for the
paths that need whole rows:

* causal tiles that the mask hides entirely are never visited (a query block stops at the last
  key its last row sees), tiles that the causal mask leaves fully visible carry no mask, and a
  tile's boolean mask is made only when read (the C++ loops take each row's end instead);
* grouped-query heads are a view: q as ``[B, Hkv, G, Lq, D]``, k and v as ``[B, Hkv, 1, Lk, ·]``,
  so no key or value is copied per query head;
* scores are computed in float32 for 16-bit inputs (as the naive path and the flash kernel do).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ...normalizers._contract import compute_dtype
from .. import policy
from ..masking import Masking
from ..policy import BUFFERED_TILE_ELEMENTS  # noqa: F401 (fused.py reads it from here)
from . import native

Tensor = torch.Tensor

#: ln 2 and log₂ e: the entropy passes work in base 2
LN2, LOG2E = math.log(2.0), 1.0 / math.log(2.0)


def device_budget(budget: int, device: torch.device) -> int:
    """A tile budget in score entries for ``device``: ``budget`` on the CPU, ``budget`` ×
    `policy.DEVICE_TILE_FACTOR` (or ``SHARPATTN_DEVICE_TILES``) elsewhere."""
    if device.type == "cpu":
        return budget
    factor = os.environ.get("SHARPATTN_DEVICE_TILES", "").strip()
    if factor.isdigit() and int(factor) > 0:
        return budget * int(factor)
    return budget * policy.DEVICE_TILE_FACTOR


def tile_sizes(bh: int, lq: int, lk: int, budget: int | None = None) -> tuple[int, int]:
    """(bq, bk): query rows and key columns per tile for ``bh`` = B·H heads, about ``budget``
    (default `policy.TILE_ELEMENTS`) score entries per tile, square where the sizes allow, each
    at least 16."""
    budget = policy.TILE_ELEMENTS if budget is None else budget
    per_head = max(256, budget // max(1, bh))
    side = 16
    while side * side * 4 <= per_head:
        side *= 2
    bq = min(max(lq, 1), side)
    bk = min(max(lk, 1), max(16, per_head // bq))
    return bq, bk


def row_tiles(bh: int, lq: int, lk: int) -> tuple[int, int]:
    """(bq, bk) for a forward pass over tiles of whole rows where they fit: about
    `policy.ROW_TILE_ELEMENTS` entries, at least `policy.ROW_TILE_ROWS` rows while within
    `policy.ROW_TILE_MAX`; beyond, tiles of ROW_TILE_ROWS rows and as many keys as fit. The
    q·kᵀ and p·v products need some 128 rows to run at speed, and a row's sums, taken in one
    tile, need no rescaling."""
    most, fewest = policy.ROW_TILE_MAX, policy.ROW_TILE_ROWS
    rows = min(max(lq, 1), fewest)
    if bh * rows * max(lk, 1) > most:
        return rows, max(16, min(lk, most // (bh * rows)))
    return slab_rows(bh, lq, lk, policy.ROW_TILE_ELEMENTS, fewest, most), max(lk, 1)


@dataclass
class Tile:
    """Key columns ``c0:c1`` of query rows ``r0:r1``. ``masked``: whether some key of the tile is
    hidden from some row; ``mask`` is then the tile's boolean mask (broadcastable to
    ``[B, H, r1 − r0, c1 − c0]``, True = may attend), made on first use (the C++ loops take a
    causal tile's row ends instead), else None."""

    r0: int
    r1: int
    c0: int
    c1: int
    masked: bool
    make_mask: Callable[[], Tensor | None] | None = field(default=None, repr=False)
    _mask: Tensor | None = field(default=None, init=False, repr=False)

    @property
    def mask(self) -> Tensor | None:
        if self._mask is None and self.masked and self.make_mask is not None:
            self._mask = self.make_mask()
        return self._mask


class Grid:
    """The tiles of one attention call: inputs laid out once, scores made tile by tile.

    ``q`` ``[B, H, Lq, D]``, ``k`` ``[B, Hkv, Lk, D]``, ``v`` ``[B, Hkv, Lk, Dv]``. Every tensor
    the grid hands out is in the compute dtype (float32 for 16-bit inputs). ``bq``/``bk``
    override `tile_sizes`. ``diagonal``: row i sees only keys j <= i + ``diagonal`` (the
    walk stops there and tile masks hold it); default Lk − Lq when ``masking.causal``, else no
    limit. A path whose rows end elsewhere (stick-breaking's j < i + Lk − Lq) passes its own;
    ``masking.causal`` is then not read.
    """

    def __init__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        masking: Masking,
        scale: float,
        bq: int | None = None,
        bk: int | None = None,
        fold_scale: bool = False,
        diagonal: int | None = None,
        budget: int | None = None,
        reuse: bool = False,
    ):
        b, h, lq, d = q.shape
        hkv, lk = k.shape[1], k.shape[2]
        self.b, self.h, self.hkv, self.g = b, h, hkv, h // hkv
        self.lq, self.lk, self.d, self.dv = lq, lk, d, v.shape[-1]
        self.masking, self.scale = masking, scale
        if diagonal is None and masking.causal:
            diagonal = masking.offset
        self.diagonal = diagonal
        self.dtype = compute_dtype(q.dtype)
        budget = policy.TILE_ELEMENTS if budget is None else budget
        auto_q, auto_k = tile_sizes(b * h, lq, lk, device_budget(budget, q.device))
        self.bq, self.bk = bq or auto_q, bk or auto_k
        self.q = q.to(self.dtype).reshape(b, hkv, self.g, lq, d)  # (B, Hkv, G, Lq, D)
        #: ``fold_scale``: the query rows carry the scale (one product per block of rows
        #: instead of one pass per tile): `q_rows` returns scale·q and `scores`
        #: multiplies by nothing. `q` itself stays unscaled (no copy of the whole q)
        self.folded = fold_scale
        self.k = k.to(self.dtype).unsqueeze(2)  # (B, Hkv, 1, Lk, D)
        self.v = v.to(self.dtype).unsqueeze(2)  # (B, Hkv, 1, Lk, Dv)
        #: whether tiles with every key visible may run the C++ loops (`native`)
        self.native = native.wanted(q.device, self.dtype)
        #: ``reuse``: the tile-sized tensors a pass makes (`scores`, `product`, and
        #: the buffers of `buffer`) are views of a few buffers allocated once, so each
        #: must be used up before the next tile's (eagerly and outside autograd only: a traced
        #: or recorded graph gets fresh tensors). A fresh multi-MiB tile is an ``mmap`` or a
        #: heap growth whose pages the kernel faults in and zeroes again, depending on the
        #: allocator's history in the process; the buffers make the cost the same in every one
        self.reuse = reuse and not torch.compiler.is_compiling()
        self._buffers: dict[str, Tensor] = {}

    # -- the walk ----------------------------------------------------------------------------

    def row_blocks(self) -> Iterator[tuple[int, int]]:
        for r0 in range(0, self.lq, self.bq):
            yield r0, min(r0 + self.bq, self.lq)

    def key_end(self, r0: int, r1: int) -> int:
        """One past the last key any row of ``r0:r1`` may see (causal: row i sees j <= i + Lk −
        Lq, or `diagonal`); 0 when none does."""
        if self.diagonal is None:
            return self.lk
        return max(0, min(self.lk, r1 + self.diagonal))

    def tiles(self, r0: int, r1: int) -> Iterator[Tile]:
        """The key tiles of query rows ``r0:r1`` that some row may see, in key order."""
        end = self.key_end(r0, r1)
        for c0 in range(0, end, self.bk):
            yield self.tile(r0, r1, c0, min(c0 + self.bk, end))

    def tile(self, r0: int, r1: int, c0: int, c1: int) -> Tile:
        """The tile of rows ``r0:r1`` and keys ``c0:c1``, its mask made when first read."""
        diag = self.diagonal
        masked = self.masking.mask is not None or (diag is not None and c1 - 1 > r0 + diag)
        return Tile(r0, r1, c0, c1, masked, functools.partial(self.tile_mask, r0, r1, c0, c1))

    def tile_mask(self, r0: int, r1: int, c0: int, c1: int) -> Tensor | None:
        m = self.masking
        mask = None
        if m.mask is not None:
            mask = m.mask[..., r0:r1, :] if m.per_row else m.mask
            if mask.shape[-1] != 1:  # a mask broadcast over the keys stays as it is
                mask = mask[..., c0:c1]
        diag = self.diagonal
        if diag is not None and c1 - 1 > r0 + diag:  # some key of the tile is after some row
            i = torch.arange(r0, r1, device=m.device).unsqueeze(-1)
            causal = torch.arange(c0, c1, device=m.device) <= i + diag
            mask = causal if mask is None else mask & causal
        return mask

    def prefix(self, t: Tile) -> Tensor | None:
        """For a tile whose only mask is causal: how many of its keys each of its rows sees
        (int32 ``[r]``, a prefix of the tile's keys), for `native`; else None."""
        if not t.masked or self.masking.mask is not None or self.diagonal is None:
            return None
        return prefix_ends(t.r0, t.r1, t.c0, t.c1, self.diagonal, self.masking.device)

    # -- tensors of a tile -------------------------------------------------------------------

    def keep(self, t: Tile) -> Tensor | None:
        """The tile's mask as 0/1 in the compute dtype (None: every key visible). Masking by a
        product: ``masked_fill``/``where`` with a boolean mask ran at ~800 µs per 2^18 entries on
        the 2-core AMD EPYC, a product at ~30 µs (the scores it multiplies are finite)."""
        return None if t.mask is None else t.mask.to(self.dtype)

    def q_rows(self, r0: int, r1: int) -> Tensor:
        """``[B, Hkv, G, r, D]`` query rows, times the scale where the grid folds it in."""
        rows = self.q[..., r0:r1, :]
        return rows * self.scale if self.folded else rows

    def scores(self, qb: Tensor, t: Tile) -> Tensor:
        """scale·q·kᵀ of the tile, ``[B, H, r, c]`` (qb from `q_rows`); with ``reuse``,
        a view of the grid's ``"scores"`` buffer, overwritten by the next call."""
        s = self.product(qb, self.k[..., t.c0 : t.c1, :].transpose(-2, -1), "scores")
        if not self.folded:
            s.mul_(self.scale)
        return s.view(self.b, self.h, t.r1 - t.r0, t.c1 - t.c0)

    def product(self, a: Tensor, b: Tensor, name: str) -> Tensor:
        """``a @ b`` for a tile-sized product, written into buffer ``name`` where it may be."""
        if not self.reuse or (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
            return torch.matmul(a, b)
        shape = batch_shape(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
        return torch.matmul(a, b, out=self.buffer(name, shape, a))

    def buffer(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """An uninitialised tile-sized tensor of ``shape`` (at most B·H·bq·bk entries) in
        ``like``'s dtype and device: a view of the grid's buffer ``name`` with ``reuse``, else
        a new tensor."""
        if not self.reuse:
            return like.new_empty(shape)
        buf = self._buffers.get(name)
        if buf is None:
            buf = self._buffers[name] = like.new_empty(self.b * self.h * self.bq * self.bk)
        return buf[: math.prod(shape)].view(shape)

    def weigh(self, w: Tensor, t: Tile) -> Tensor:
        """w·v for a ``[B, H, r, c]`` weight tile: ``[B, Hkv, G, r, Dv]``."""
        w5 = w.view(self.b, self.hkv, self.g, t.r1 - t.r0, t.c1 - t.c0)
        return torch.matmul(w5, self.v[..., t.c0 : t.c1, :])

    def heads(self, x: Tensor) -> Tensor:
        """``[B, Hkv, G, ·, ·]`` → ``[B, H, ·, ·]``."""
        return x.reshape(self.b, self.h, *x.shape[-2:])

    def grouped(self, x: Tensor) -> Tensor:
        """``[B, H, ·, ·]`` → ``[B, Hkv, G, ·, ·]``."""
        return x.reshape(self.b, self.hkv, self.g, *x.shape[-2:])

    def empty_out(self) -> Tensor:
        return torch.zeros(
            self.b, self.hkv, self.g, self.lq, self.dv, dtype=self.dtype, device=self.q.device
        )


def prefix_ends(r0: int, r1: int, c0: int, c1: int, diagonal: int, device) -> Tensor:
    """How many of keys ``c0:c1`` each row of ``r0:r1`` sees when row i sees keys j <= i +
    ``diagonal``: int32 ``[r1 − r0]``, the ``ends`` of the C++ loops."""
    i = torch.arange(r0, r1, dtype=torch.int32, device=device)
    return (i + (diagonal - c0 + 1)).clamp_(0, c1 - c0)


def batch_shape(a: tuple, b: tuple) -> tuple:
    """The broadcast of two batch shapes that broadcast (``torch.broadcast_shapes`` costs ~30 µs
    a call, most of a decoding step's Python time on the tiles)."""
    n = max(len(a), len(b))
    a = (1,) * (n - len(a)) + tuple(a)
    b = (1,) * (n - len(b)) + tuple(b)
    return tuple(y if x == 1 else x for x, y in zip(a, b, strict=True))


def row_slice(x, lq: int, r0: int, r1: int):
    """A per-row parameter ``[.., Lq | 1, 1]`` (or a number) cut to rows ``r0:r1``."""
    if torch.is_tensor(x) and x.dim() >= 2 and x.shape[-2] == lq and lq > 1:
        return x[..., r0:r1, :]
    return x


# -- slabs: whole rows of a query block --------------------------------------------------------


def slab_rows(bh: int, lq: int, lk: int, budget: int, fewest: int, most: int) -> int:
    """Query rows per slab (a block's scores over every key it may see, B·H·rows·Lk entries):
    about ``budget`` entries, at least ``fewest`` rows while the slab stays within ``most``
    entries, at least 1."""
    per_row = max(1, bh * max(lk, 1))
    rows = max(budget // per_row, min(fewest, most // per_row))
    return max(1, min(max(lq, 1), rows))


class Slabs:
    """The query blocks of ``bq`` rows of one call, each as one tile over keys 0:c1 (every
    key the block sees): for paths that need whole rows (the entmax family's threshold, top-k,
    adaptive temperature's statistics before its weights). Also the backward's shared steps."""

    def __init__(self, grid: Grid, bq: int):
        self.grid, self.bq = grid, bq
        self.rows = (grid.b, grid.h, grid.lq, 1)

    def blocks(self) -> Iterator[Tile]:
        g = self.grid
        for r0 in range(0, g.lq, self.bq):
            r1 = min(r0 + self.bq, g.lq)
            c1 = g.key_end(r0, r1)
            if c1 > 0:  # else no row of the block sees a key: output 0, no gradient
                yield g.tile(r0, r1, 0, c1)

    def masked_scores(self, t: Tile) -> Tensor:
        """The block's scores ``[B, H, r, c1]``, −inf where masked."""
        return self.masked(self.grid.scores(self.grid.q_rows(t.r0, t.r1), t), t)

    @staticmethod
    def masked(s: Tensor, t: Tile) -> Tensor:
        """Scores ``s`` of block ``t`` with −inf where masked (in place)."""
        return s if t.mask is None else s.masked_fill_(~t.mask, float("-inf"))

    def zeros(self) -> Tensor:
        g = self.grid
        return torch.zeros(self.rows, dtype=g.dtype, device=g.q.device)

    def grads(self, d_out):
        g = self.grid
        return (
            g.grouped(d_out.to(g.dtype)),
            torch.zeros_like(g.q),
            torch.zeros_like(g.k),
            torch.zeros_like(g.v),
        )

    def g_scores(self, go: Tensor, t: Tile) -> Tensor:
        """g_ij = dO_i·v_j ``[B, H, r, c1]``."""
        g = self.grid
        gv = torch.matmul(go[..., t.r0 : t.r1, :], g.v[..., : t.c1, :].transpose(-2, -1))
        return g.heads(gv)

    def accumulate(self, t: Tile, ds: Tensor, p: Tensor, go: Tensor, dq, dk, dv) -> None:
        """dq, dk, dv of one block from ds = dL/ds (already times the scale) and the weights
        (dk from the grid's q: times the scale again where the grid folds it into q)."""
        g = self.grid
        r, c1 = t.r1 - t.r0, t.c1
        ds5 = g.grouped(ds)  # (B, Hkv, G, r, c1)
        dq[..., t.r0 : t.r1, :] = torch.matmul(ds5, g.k[..., :c1, :])
        flat = (g.b, g.hkv, 1, g.g * r)  # the G query heads of a key head as one row set
        qf = g.q_rows(t.r0, t.r1).reshape(*flat, g.d)
        dk[..., :c1, :] += torch.matmul(ds5.reshape(*flat, c1).transpose(-2, -1), qf)
        pf = g.grouped(p).reshape(*flat, c1)
        gf = go[..., t.r0 : t.r1, :].reshape(*flat, g.dv)
        dv[..., :c1, :] += torch.matmul(pf.transpose(-2, -1), gf)

    def finish_grads(self, q, k, v, dq, dk, dv):
        g = self.grid
        return g.heads(dq).to(q.dtype), dk.squeeze(2).to(k.dtype), dv.squeeze(2).to(v.dtype)
