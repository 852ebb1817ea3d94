"""Stick-breaking attention over tiles: O(n) memory, forward and backward.

The normalizer (`sharpattn.normalizers.stick_breaking`) gives query i, at key position
c_i = i + offset, the weights

    log w_ij = log σ(s_ij) + Σ_{j<k, k allowed} log σ(−s_ik)

over its allowed keys j < c_i (j <= c_i with ``attend_current``, the sum then running to c_i).
The sum is what the nearer keys took of the stick, so each query block walks its key tiles
(`Grid`, with the row's last key as the grid's ``diagonal``) from the nearest back,
carrying Σ log σ(−s) of the tiles already done: inside a tile the exclusive sum from the right is
one cumulative sum, the blockwise log-space scan of the stick-breaking attention kernels.

Keys and values are laid out once in reversed order, so that a tile's scores come out of the
product with the nearest key first and the sum from the right is a plain ``cumsum`` along the
row, started from the carry (no flip of the scores, no subtraction: the running sum is added in
the order the naive path adds it).

Backward (recomputing the tiles, the same walk): with g_ij = dO_i·v_j and D_i = dO_i·out_i =
Σ_j w_ij·g_ij,

    dL/ds_ik = w_ik·g_ik·σ(−s_ik) − σ(s_ik)·Σ_{j<k} w_ij·g_ij = w_ik·g_ik − σ(s_ik)·A_ik,
    A_ik = Σ_{j<=k} w_ij·g_ij = D_i − Σ_{j>k} w_ij·g_ij,

the last sum carried from the right like the forward's (5 matrix products per tile, as flash
attention's backward). D_i comes from a first walk over the row block's tiles with the very
products w·g of the second (2 more matrix products per tile), and D and the running sum are
float64: A_ik is tiny at the far keys, and D = dO·out in float32 left about eps·|D| there, which
every far key's σ(s_ik) took again (dq's error grew as the row's length, about 1,000× the eager
float32 error at 4k keys). The whole-row path sums A_ik from the row's first key instead, which
needs no D.

On float32 CPU tiles that are unmasked or causal, the element-wise work of a tile (log σ, the
running sums, exp; in backward the second running sum and dL/ds) runs in one C++ loop per row
(`native.stick_forward`, `native.stick_backward`), the same sums in the same order.

Decoding (a few query rows, at most `DECODE_ROWS`, against a key cache of at least
`DECODE_MIN_KEYS`; ``blocks`` not given) takes whole rows instead (`_rows_forward`,
`_rows_backward`): the rows' scores over every key they may see at once (``[B, H, Lq, Lk]``,
small with Lq small; in chunks of batch entries and key heads of about `DECODE_ELEMENTS`
scores), keys in their own order, so k and v are not reversed (a copy of the whole cache: most
of a decoding step's time on the tiles, 8-10x SDPA's step at Lq = 1). The sums from the right
run in the C++ loops per row back from its last visible key (`native.stick_forward_rows`,
`native.stick_backward_rows`; float32 compute, causal or no user mask), else in PyTorch with a
flip of the scores: the same sums in the same order as one tile over the whole row.

On CUDA in float32, float16 and bfloat16 without statistics (`devices.backend`), the same walk runs
as Triton kernels (`triton.stick`: one program per block of query rows, key blocks from the
diagonal back, the running sums carried in registers; dk and dv added atomically), unless
``SHARPATTN_TRITON=0``; float64 and calls that want statistics stay on the tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...normalizers.families import exp_, score_shift
from ...normalizers.stick_breaking import STICK_BREAKING
from .. import policy
from ..devices import backend, triton_kernels
from ..masking import Masking
from ..positions import append_columns
from ..stats import AttentionStats, row_stats
from . import decoding, native
from .tiled import empty_result
from .tiles import Grid, Tile

Tensor = torch.Tensor

#: the naive normalizer's words (``normalizers/stick_breaking.py``)
CAUSAL_ERROR = (
    "stick_breaking is causal only: query i may attend only to keys j <= i + (Lk − Lq); "
    "pass causal=True (or a mask inside the causal one)."
)


#: a call with at most this many query rows, at least `DECODE_MIN_KEYS` keys and no ``blocks``
#: takes the whole-row path
DECODE_ROWS = 16
#: below this many keys both paths are one small tile per row block and cost about the same
#: (Lq 1 and 16, Lk 64, B1 H8 D64 on the 2-core machine: 140-200 µs, the tiles 15-20% more),
#: and such calls stay on the tiles, whose loops ``tests/paths/test_compile.py`` expects there
DECODE_MIN_KEYS = 64
#: about the most score entries one chunk of the whole-row path holds (32 MiB in float32)
DECODE_ELEMENTS = 2**23


@dataclass(frozen=True)
class _Walk:
    """What the forward and backward need besides q, k and v to lay out the same tiles."""

    masking: Masking
    scale: float
    blocks: tuple[int | None, int | None]
    diagonal: int  # row i's last key is i + diagonal
    rows: bool = False  # the whole-row path (decoding): keys in order, no tiles

    def grid(self, q: Tensor, k: Tensor, v: Tensor):
        """(grid, k and v with the keys reversed, ``[B, Hkv, 1, Lk, ·]``; None on the
        whole-row path, which reads the grid's own k and v)."""
        grid = Grid(
            q, k, v, self.masking, self.scale, *self.blocks, fold_scale=True, diagonal=self.diagonal
        )
        if self.rows:
            return grid, None, None
        return grid, grid.k.flip(-2), grid.v.flip(-2)


def _tile(grid: Grid, krev: Tensor, qb: Tensor, t: Tile, loops: bool = False):
    """(scores, keep, ends) of tile ``t`` with its keys reversed (nearest first),
    ``[B, H, r, c]``. With ``loops`` (the call may use `native`) and a tile the loops take,
    ``ends`` is its `prefix` (or None: every key visible) and ``keep`` is
    ``False``: the scores are left as they are, for the loops. Otherwise disallowed scores are 0
    (finite arithmetic) and ``keep`` is the mask as 0/1 or None."""
    a, b = grid.lk - t.c1, grid.lk - t.c0
    s = torch.matmul(qb, krev[..., a:b, :].transpose(-2, -1))
    s = s.view(grid.b, grid.h, t.r1 - t.r0, t.c1 - t.c0)
    if loops:
        ends = grid.prefix(t)
        if native.usable(ends, t.masked, s):
            return s, False, ends
    keep = None
    if t.mask is not None:
        keep = t.mask.flip(-1).to(grid.dtype)
        s.mul_(keep)  # a product, not masked_fill: 30× faster here (see tiled._masked_)
    return s, keep, None


def _log_weights(s: Tensor, keep: Tensor | None, carry: Tensor) -> tuple[Tensor, Tensor]:
    """(log w of the tile, the carry for the next tile to the left).

    ``carry`` ``[B, H, r, 1]``: Σ log σ(−s) over the allowed keys of the tiles to the right.
    log w_j = log σ(s_j) + carry + Σ_{k before j in the reversed tile} log σ(−s_k): one
    cumulative sum of [carry, log σ(−s)], whose last entry is the next carry.
    """
    c = s.shape[-1]
    log_pos = F.logsigmoid(s)
    log_neg = log_pos - s  # log σ(−s) = log σ(s) − s, exact where either is tiny
    if keep is not None:
        log_neg.mul_(keep)
    run = torch.cat((carry, log_neg), dim=-1).cumsum_(-1)
    return log_pos.add_(run[..., :c]), run[..., c:]


def _from_right(x: Tensor) -> Tensor:
    """Σ_{k>j} x_k along the last dim, added from the last entry back (the tiles' order)."""
    rev = x.flip(-1)
    run = torch.cat((torch.zeros_like(rev[..., :1]), rev[..., :-1]), dim=-1).cumsum_(-1)
    return run.flip(-1)


def _row_log_weights(s: Tensor, keep: Tensor | None) -> Tensor:
    """log w of whole rows, keys in order (the whole-row path without the C++ loops): log σ(s_j)
    + Σ_{k>j} log σ(−s_k) over the allowed keys; ``s`` made 0 where ``keep`` is 0 (in place:
    finite arithmetic there, as `_tile`)."""
    if keep is not None:
        s.mul_(keep)
    log_pos = F.logsigmoid(s)
    log_neg = log_pos - s
    if keep is not None:
        log_neg.mul_(keep)
    return log_pos.add_(_from_right(log_neg))


@dataclass(frozen=True)
class _Rows:
    """The whole-row path's layout: the one tile of every query row over keys ``0:c1`` (every
    key some row may see), its row ends for the C++ loops (``loops``) or its 0/1 mask
    (``keep``, None: every key visible), and the chunks of (batch, key head) it runs in."""

    c1: int
    loops: bool
    ends: Tensor | None
    keep: Tensor | None
    chunks: tuple[tuple[slice, slice], ...]

    @staticmethod
    def of(grid: Grid) -> _Rows:
        c1 = grid.key_end(0, grid.lq)
        if c1 == 0:  # no row sees a key
            return _Rows(0, False, None, None, ())
        t = grid.tile(0, grid.lq, 0, c1)
        ends = grid.prefix(t) if grid.native else None
        loops = grid.native and not (t.masked and ends is None)
        keep = None if loops or t.mask is None else t.mask.to(grid.dtype)
        per_head = grid.g * grid.lq * c1
        if grid.b * grid.hkv * per_head <= DECODE_ELEMENTS:
            chunks = ((slice(None), slice(None)),)
        else:
            n = max(1, DECODE_ELEMENTS // per_head)
            chunks = tuple(
                (slice(b, b + 1), slice(h, min(h + n, grid.hkv)))
                for b in range(grid.b)
                for h in range(0, grid.hkv, n)
            )
        return _Rows(c1, loops, ends, keep, chunks)

    def keep_of(self, grid: Grid, bs: slice, hs: slice) -> Tensor | None:
        """The 0/1 mask of chunk (``bs``, ``hs``), broadcastable to its ``[b, h, Lq, c1]``."""
        m = self.keep
        if m is not None and m.dim() >= 4 and m.shape[-4] != 1:
            m = m[bs]
        if m is not None and m.dim() >= 3 and m.shape[-3] != 1:  # the chunk's query heads
            h0, h1, _ = hs.indices(grid.hkv)
            m = m.narrow(-3, h0 * grid.g, (h1 - h0) * grid.g)
        return m


def _chunk(grid: Grid, x: Tensor, bs: slice, hs: slice) -> Tensor:
    """``[B, Hkv, G, Lq, ·]`` cut to a chunk, as ``[b, hkv, G·Lq, ·]`` (one product per head)."""
    x = x[bs, hs]
    return x.reshape(x.shape[0], x.shape[1], grid.g * grid.lq, x.shape[-1])


def _rows_forward(walk: _Walk, q, k, v, want_stats: bool):
    """`_forward` on whole rows, keys in order (the decoding path)."""
    grid, _, _ = walk.grid(q, k, v)
    out = grid.empty_out()
    rows = (grid.b, grid.h, grid.lq, 1)
    ent = torch.zeros(rows if want_stats else 0, dtype=grid.dtype, device=out.device)
    mass = torch.zeros_like(ent)
    lay = _Rows.of(grid)
    if lay.c1 == 0:  # no row sees a key: output 0
        return out, ent, mass
    if decoding.reading() and lay.loops and not want_stats:
        # attend checks k and v from what the two products read (one pass over each, every key:
        # past a row's end its weights are 0)
        s = decoding.scores(q, k, walk.scale)
        ends = lay.ends  # the rows' visible keys, which end at c1 where the tile has no ends
        if ends is None:
            ends = torch.full((grid.lq,), lay.c1, dtype=torch.int32, device=s.device)
        return grid.grouped(decoding.values(native.stick_forward_rows(s, ends), v)), ent, mass
    qs = grid.q_rows(0, grid.lq)
    for bs, hs in lay.chunks:
        kc, vc = grid.k[bs, hs, 0, : lay.c1], grid.v[bs, hs, 0, : lay.c1]
        s = torch.matmul(_chunk(grid, qs, bs, hs), kc.transpose(-2, -1))
        nb, nh = s.shape[:2]
        s4 = s.view(nb, nh * grid.g, grid.lq, lay.c1)
        heads = slice(hs.indices(grid.hkv)[0] * grid.g, hs.indices(grid.hkv)[1] * grid.g)
        if lay.loops:
            stats = ()
            if want_stats:
                stats = (s.new_empty(s4.shape[:3] + (1,)), s.new_empty(s4.shape[:3] + (1,)))
            w = native.stick_forward_rows(s, lay.ends, *stats)
            if want_stats:
                ent[bs, heads], mass[bs, heads] = stats
        else:
            keep = lay.keep_of(grid, bs, hs)
            log_w = _row_log_weights(s4, keep)
            w4 = torch.exp(log_w)
            if keep is not None:
                w4.mul_(keep)
            if want_stats:
                ent[bs, heads] = -(w4 * log_w).sum(-1, keepdim=True)
                mass[bs, heads] = w4.sum(-1, keepdim=True)
            w = w4.view(s.shape)
        out[bs, hs] = torch.matmul(w, vc).view(nb, nh, grid.g, grid.lq, grid.dv)
    return out, ent, mass


def _rows_backward(walk: _Walk, q, k, v, g: Tensor):
    """`_backward` on whole rows, keys in order (the decoding path); A_k summed from the first
    key, so no D is needed."""
    grid, _, _ = walk.grid(q, k, v)
    g5 = grid.grouped(g.to(grid.dtype))
    dq = torch.zeros_like(grid.q)
    dk = torch.zeros(grid.k.shape[:2] + grid.k.shape[3:], dtype=grid.dtype, device=dq.device)
    dv = torch.zeros(grid.v.shape[:2] + grid.v.shape[3:], dtype=grid.dtype, device=dq.device)
    lay = _Rows.of(grid)
    if lay.c1 == 0:
        return grid.heads(dq), dk, dv
    qs = grid.q_rows(0, grid.lq)
    for bs, hs in lay.chunks:
        kc, vc = grid.k[bs, hs, 0, : lay.c1], grid.v[bs, hs, 0, : lay.c1]
        qc, gc = _chunk(grid, qs, bs, hs), _chunk(grid, g5, bs, hs)
        s = torch.matmul(qc, kc.transpose(-2, -1))
        gv = torch.matmul(gc, vc.transpose(-2, -1))  # g_ij = dO_i·v_j
        if lay.loops:
            ds, w = native.stick_backward_rows(s, gv, lay.ends)
        else:
            nb, nh = s.shape[:2]
            view = (nb, nh * grid.g, grid.lq, lay.c1)
            keep = lay.keep_of(grid, bs, hs)
            s4, gv4 = s.view(view), gv.view(view)
            w4 = exp_(_row_log_weights(s4, keep))
            if keep is not None:
                w4.mul_(keep)
            wg = gv4.mul_(w4)  # w_ij·g_ij
            # dL/ds = w·g − σ(s)·A, A_k = Σ_{j<=k} w·g from the first key (not D − Σ_{j>k} w·g,
            # whose rounding of D every far key's σ(s) would take again)
            ds4 = torch.sigmoid(s4).mul_(wg.cumsum(-1)).neg_().add_(wg)
            if keep is not None:
                ds4.mul_(keep)
            ds, w = ds4.view(s.shape), w4.view(s.shape)
        dq[bs, hs] = torch.matmul(ds, kc).mul_(grid.scale).view(dq[bs, hs].shape)
        # q carries the scale (fold_scale), so dk = Σ_i ds_ij·(scale·q_i)
        dk[bs, hs, : lay.c1] = torch.matmul(ds.transpose(-2, -1), qc)
        dv[bs, hs, : lay.c1] = torch.matmul(w.transpose(-2, -1), gc)
    return grid.heads(dq), dk, dv


def _forward(walk: _Walk, q, k, v, want_stats: bool):
    """(output ``[B, Hkv, G, Lq, Dv]``, entropy, mass ``[B, H, Lq, 1]`` or empty tensors)."""
    grid, krev, vrev = walk.grid(q, k, v)
    out = grid.empty_out()
    rows = (grid.b, grid.h, grid.lq, 1)
    ent = torch.zeros(rows if want_stats else 0, dtype=grid.dtype, device=out.device)
    mass = torch.zeros_like(ent)
    for r0, r1 in grid.row_blocks():
        qb, acc = grid.q_rows(r0, r1), out[..., r0:r1, :]
        block = (grid.b, grid.h, r1 - r0, 1)
        carry = torch.zeros(block, dtype=grid.dtype, device=out.device)
        ent_b = torch.zeros(block if want_stats else 0, dtype=grid.dtype, device=out.device)
        mass_b = torch.zeros_like(ent_b)
        for t in reversed(list(grid.tiles(r0, r1))):
            s, keep, ends = _tile(grid, krev, qb, t, grid.native)
            if keep is False:  # the C++ loop: log weights, running sum and exp in two sweeps
                carry = carry.contiguous()
                stats = (ent_b, mass_b) if want_stats else ()
                w = native.stick_forward(s, ends, carry, *stats)
                acc += torch.matmul(grid.grouped(w), vrev[..., grid.lk - t.c1 : grid.lk - t.c0, :])
                continue
            log_w, carry = _log_weights(s, keep, carry)
            if want_stats:
                w = torch.exp(log_w)
                if keep is not None:
                    w.mul_(keep)
                ent_b -= (w * log_w).sum(-1, keepdim=True)
                mass_b += w.sum(-1, keepdim=True)
            else:
                w = exp_(log_w)
                if keep is not None:
                    w.mul_(keep)
            w5 = grid.grouped(w)
            acc += torch.matmul(w5, vrev[..., grid.lk - t.c1 : grid.lk - t.c0, :])
        if want_stats:
            ent[..., r0:r1, :] = ent_b
            mass[..., r0:r1, :] = mass_b
    return out, ent, mass


def _tile_weights(grid: Grid, krev, vrev, qb, gb, t: Tile, carry: Tensor):
    """(scores, keep, ends, gv, the next carry, and the tile's weights where the C++ loop does
    not give them) of tile ``t`` in the backward's walk: g = dO·vᵀ, and on the PyTorch route the
    weights (0 where not allowed)."""
    a, b = grid.lk - t.c1, grid.lk - t.c0
    s, keep, ends = _tile(grid, krev, qb, t, grid.native)
    gv = grid.heads(torch.matmul(gb, vrev[..., a:b, :].transpose(-2, -1)))  # g_ij = dO_i·v_j
    w = None
    if keep is not False:
        log_w, carry = _log_weights(s, keep, carry)
        w = exp_(log_w)
        if keep is not None:
            w.mul_(keep)
    return s, keep, ends, gv, carry, w


def _row_sums(grid: Grid, krev, vrev, qb, gb, tiles, rows: int) -> Tensor:
    """D_i = Σ_j w_ij·g_ij of a block of rows over all their keys, float64 ``[B, H, r, 1]``:
    a first walk over the tiles with the very products the second takes (the same weights, from
    the same loop, times the same g), so that D − Σ_{j>k} w·g, tiny at the far keys, holds no
    rounding of D (dO·out in float32 left about eps·|D| there, which every far key's σ(s) took
    again: dq's error grew as the row's length)."""
    carry = torch.zeros(grid.b, grid.h, rows, 1, dtype=grid.dtype, device=qb.device)
    total = torch.zeros(carry.shape, dtype=torch.float64, device=qb.device)
    for t in tiles:
        s, keep, ends, gv, carry, w = _tile_weights(grid, krev, vrev, qb, gb, t, carry)
        if keep is False:  # the C++ loop of the second walk, its ds unused here
            carry = carry.contiguous()
            later = torch.zeros(carry.shape, dtype=torch.float64, device=qb.device)
            _, w = native.stick_backward(s, gv, ends, carry, later, later.clone())
        total += gv.mul_(w).sum(-1, keepdim=True, dtype=torch.float64)
    return total


def _backward(walk: _Walk, q, k, v, g: Tensor):
    """dq, dk, dv by two walks per block of rows over its tiles, nearest keys first: D per row
    (`_row_sums`), then the gradients."""
    grid, krev, vrev = walk.grid(q, k, v)
    g5 = grid.grouped(g.to(grid.dtype))
    dq = torch.zeros_like(grid.q)
    dkr = torch.zeros(grid.k.shape[:2] + grid.k.shape[3:], dtype=grid.dtype, device=dq.device)
    dvr = torch.zeros(grid.v.shape[:2] + grid.v.shape[3:], dtype=grid.dtype, device=dq.device)
    for r0, r1 in grid.row_blocks():
        qb, gb, dqb = grid.q_rows(r0, r1), g5[..., r0:r1, :], dq[..., r0:r1, :]
        tiles = list(reversed(list(grid.tiles(r0, r1))))
        db = _row_sums(grid, krev, vrev, qb, gb, tiles, r1 - r0)
        carry = torch.zeros(grid.b, grid.h, r1 - r0, 1, dtype=grid.dtype, device=dq.device)
        later = torch.zeros_like(db)  # Σ w·g over the keys of the tiles to the right
        for t in tiles:
            a, b, c = grid.lk - t.c1, grid.lk - t.c0, t.c1 - t.c0
            s, keep, ends, gv, carry, w = _tile_weights(grid, krev, vrev, qb, gb, t, carry)
            if keep is False:  # the C++ loop: the same sums in a few sweeps per row
                carry, later = carry.contiguous(), later.contiguous()
                ds, w = native.stick_backward(s, gv, ends, carry, later, db)
            else:
                wg = gv.mul_(w)  # w_ij·g_ij
                # Σ_{j>k} w·g in float64, then the next tile's
                run = torch.cat((later, wg.to(torch.float64)), dim=-1).cumsum_(-1)
                later = run[..., c:]
                # dL/ds = w·g − σ(s)·A, A_k = Σ_{j<=k} w·g = D − Σ_{j>k} w·g
                a_k = run[..., :c].neg_().add_(db).to(grid.dtype)
                ds = torch.sigmoid(s).mul_(a_k).neg_().add_(wg)
                if keep is not None:
                    ds.mul_(keep)
            ds5, w5 = grid.grouped(ds), grid.grouped(w)
            dqb.add_(torch.matmul(ds5, krev[..., a:b, :]), alpha=grid.scale)
            # q carries the scale (fold_scale), so dk = Σ_i ds_ij·(scale·q_i)
            dkr[..., a:b, :] += torch.matmul(ds5.transpose(-2, -1), qb).sum(2)
            dvr[..., a:b, :] += torch.matmul(w5.transpose(-2, -1), gb).sum(2)
    return grid.heads(dq), dkr.flip(-2), dvr.flip(-2)


class _StickAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, walk, want_stats):
        run = _rows_forward if walk.rows else _forward
        out5, ent, mass = run(walk, q, k, v, want_stats)
        ctx.save_for_backward(q, k, v)
        ctx.walk = walk
        ctx.mark_non_differentiable(ent, mass)
        b, h, lq, _ = q.shape
        return out5.reshape(b, h, lq, out5.shape[-1]).to(q.dtype), ent, mass

    @staticmethod
    def backward(ctx, g, _ent, _mass):
        q, k, v = ctx.saved_tensors
        run = _rows_backward if ctx.walk.rows else _backward
        dq, dk, dv = run(ctx.walk, q, k, v, g)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _sees_past_itself(masking: Masking, offset: int) -> bool:
    """Whether some query i may see a key j > i + ``offset`` (its own position): the naive
    normalizer's ValueError. Decided from the sizes alone when ``causal=True`` (the causal mask
    keeps every row at or before its position) or there is no user mask; otherwise the mask is
    read, and the answer costs one host synchronisation."""
    lq, lk = masking.lq, masking.lk
    if masking.causal and offset >= masking.offset:
        return False
    if masking.mask is None:  # row i sees keys 0..last(i); the first row that sees any decides
        i = max(0, -masking.offset) if masking.causal else 0
        last = min(lk - 1, i + masking.offset) if masking.causal else lk - 1
        return i < lq and last > i + offset
    step = max(1, policy.STICK_CHECK_ELEMENTS // max(1, lk))
    j = torch.arange(lk, device=masking.device)
    bad = torch.zeros((), dtype=torch.bool, device=masking.device)
    for r0 in range(0, lq, step):
        r1 = min(r0 + step, lq)
        late = j > torch.arange(r0, r1, device=masking.device).unsqueeze(-1) + offset
        bad = bad | (masking.rows(r0, r1) & late).any()
    return bool(bad)


def stick_breaking(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masking: Masking,
    scale: float,
    want_stats: bool,
    *,
    attend_current: bool = False,
    query_offset: int | None = None,
    shift=0.0,
    shift_log_position=0.0,
    blocks: tuple[int | None, int | None] | None = None,
) -> tuple[Tensor, AttentionStats | None]:
    """Stick-breaking attention (``normalizers.stick_breaking``) over tiles, O(n) memory.

    A score shift b_i (``shift`` + ``shift_log_position``·log of the query's 1-based key
    position, `score_shift`) rides one more head column: q gets b_i/scale, every key 1, so
    each path (tiles, C++ loops, Triton) computes s_ij + b_i with its own products, and b's
    gradient (a ``shift`` tensor that requires grad) comes through the concatenation.

    ``query_offset``: the key position of query row 0 (default Lk − Lq, as ``causal=True``).
    A mask that lets a query see a key after its own position raises the naive path's
    ValueError; with ``causal=True`` (and the default offset) that cannot happen and nothing is
    checked (no host synchronisation); without it the sizes decide, or, with a user mask, one
    reading of the mask. ``blocks``: (rows, keys) per tile, default `tiles.tile_sizes`; without
    it, calls of at most `DECODE_ROWS` query rows and at least `DECODE_MIN_KEYS` keys take the
    whole-row path (decoding).

    On CUDA (`devices.backend`: float32, float16 and bfloat16, no statistics) the Triton kernels
    of `triton.stick` run instead, with ``blocks`` as their block sizes when both are powers
    of 2 from 16 to 128; float64 and ``want_stats=True`` stay on the tiles.
    """
    lq, lk = masking.lq, masking.lk
    offset = lk - lq if query_offset is None else int(query_offset)
    if q.shape[0] == 0 or lq == 0 or lk == 0:  # no score at all: nothing to check (as naive)
        return empty_result(q, k, v, masking, want_stats)
    if _sees_past_itself(masking, offset):
        raise ValueError(CAUSAL_ERROR)
    if v.numel() == 0:
        return empty_result(q, k, v, masking, want_stats)
    # the last key of row i: i + offset with attend_current, else the one before; the user mask
    # is inside it (checked above), and inside the causal one when causal=True
    diagonal = offset if attend_current else offset - 1
    if masking.causal:
        diagonal = min(diagonal, masking.offset)
    if torch.is_tensor(shift) or torch.is_tensor(shift_log_position) or shift or shift_log_position:
        b = score_shift(lq, offset, shift, shift_log_position, q)
        q, k = append_columns(q, k, b, k.new_ones(1, 1, 1, 1), scale)
    if backend(STICK_BREAKING.kernel, q.device, q.dtype, want_stats) == "triton":
        kernels = triton_kernels()
        return kernels.stick_attention(q, k, v, masking, scale, diagonal, blocks), None
    # decoding: whole rows, keys in order
    rows = blocks is None and lq <= DECODE_ROWS and lk >= DECODE_MIN_KEYS
    walk = _Walk(masking, scale, tuple(blocks or (None, None)), diagonal, rows)
    out, ent, mass = _StickAttention.apply(q, k, v, walk, want_stats)
    if not want_stats:
        return out, None
    return out, row_stats(q.shape[:3], masking.visible_keys(), entropy=ent, mass=mass)


STICK = {"stick_breaking": stick_breaking}
