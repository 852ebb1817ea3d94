"""Tiled fast paths of the element-wise and row-sum-normalised methods, and hardmax.

One pass over key tiles (`Grid`), never the ``[Lq, Lk]`` score matrix, with a
backward that recomputes each tile (5 matrix products per tile in all, as flash attention's):

* **element-wise** (``sigmoid``: σ(s + b − log n); ``relu``: ReLU(s)^p / n): each weight depends
  on its own score and its row only, so out_i = Σ_j w_ij·v_j accumulates directly; dL/ds_ij =
  dP_ij·w'(s_ij) with dP_ij = dO_i·v_j.
* **normalised by a row sum** (``power``, ``signed``, ``softpick``, ``stablemax``): w_ij =
  u_ij / Z_i with Z_i = Σ_j a_ij; u and a are taken relative to a running row reference m_i
  (the largest ReLU(s) for power, |s| for signed, max(0, s) for softpick, s(x) for StableMax),
  and the accumulators are rescaled when m grows, as flash attention does for softmax, so
  nothing overflows at any score size.
  dL/du_ij = (dP_ij − D_i)/Z_i-type terms with D_i = dO_i·out_i (one number per row).
* a user's **row-normalised** map (`RowNormalised` without a kernel): a first pass for m, then
  the sums relative to it (no rescaling), u′ and a′ by autograd on each tile.
* **hardmax**: a running (max, first arg-max) over the tiles, then one gathered value row per
  query; its straight-through backward is softmax attention's, from the flash kernel.

A built-in map's maths on one tile is its `TileMaths` class, beside its normalizer
(``normalizers/unnormalised.py``, ``normalizers/kernels.py``), named by its kernel record
(`families.Kernel`), which also says where else it runs (`devices.backend`): on CUDA in float32,
float16 and bfloat16 its Triton kernels (`attention.triton`, when triton imports); float64 and
calls that want statistics stay on the tiles.

On the CPU in float32 every built-in map's per-tile work runs in the C++ loops of `native`, and
the forward walks row tiles (`row_tiles`: 128 rows and 2^20 scores, whole rows
where they fit): the q·kᵀ and p·v products run at speed with 128 rows, and a tile stays near
the cache. The backward, with three tile-sized buffers, keeps square tiles.

Each formula is the normalizer's own (``normalizers/unnormalised.py``, ``kernels.py``,
``sparse.py``); the tests hold these paths to the naive one within precision, with gradients.
"""

from __future__ import annotations

import functools

import torch

from ...normalizers._contract import compute_dtype
from ...normalizers.families import Kernel, TileMaths, masked_, per_score
from ...normalizers.sparse import HARDMAX
from .. import policy
from ..devices import backend, triton_kernels
from ..masking import Masking
from ..stats import AttentionStats, row_stats
from . import decoding, native
from .fused import row_tensor, softmax_output
from .tiles import Grid, row_slice, row_tiles

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------------
# A user's maps on one tile of scores (the built-in maps' are beside their normalizers)


class _Family(TileMaths):
    """A user's element-wise map (`Elementwise`): w =
    f(s, r) on each tile, its derivatives in s and r by autograd on the tile (no loops)."""

    def __init__(self, family, **params):
        super().__init__(**family.constants_of(params))
        self.family = family

    def weights(self, s, row, mask):
        return masked_(self.family.weight(s, row, **self.params), mask)

    def grad(self, s, dp, row, mask):
        """(dL/ds, w, dL/dr per row): r expanded to one value per row of the tile; the
        derivatives by ``torch.func.vjp`` (which torch.compile traces; a w that does not depend
        on s or r gets a zero derivative)."""
        r1 = row.detach().expand(*s.shape[:-1], 1)
        w, pull = torch.func.vjp(
            functools.partial(self.family.weight, **self.params), s.detach(), r1
        )
        ds, dr = pull(masked_(dp.to(w.dtype), mask))
        return ds, masked_(w.detach(), mask), dr


class _RowFamily(TileMaths):
    """A user's row-normalised map (`RowNormalised`): u and a on each tile, their derivatives by
    autograd on the tile. The row reference m is found by a first pass (`row_normalised`) and
    held fixed, so the running sums never need rescaling (``factor`` is 1)."""

    normalised = True

    def __init__(self, family, m0, **params):
        super().__init__(**family.constants_of(params))
        self.family, self.m0 = family, m0

    def ref_of(self, s):
        return torch.zeros_like(s[..., :1])  # m is m0 from the start

    def factor(self, m_old, m_new):
        return torch.ones_like(m_new)

    def weights(self, s, m, mask):
        family = self.family
        u = masked_(per_score(family.u, "u", s, m, **self.params), mask)
        a = u if family.a is None else masked_(per_score(family.a, "a", s, m, **self.params), mask)
        return u, a.sum(-1, keepdim=True)

    def grad(self, s, dp, m, mask, d, z):
        # w = u/Z, Z = Σ a: dL/ds = (u′·dP − a′·D)/Z, u′ and a′ by torch.func.vjp (traced by
        # torch.compile; a term that does not depend on s gets a zero derivative)
        family, params = self.family, self.params

        def terms(s1):
            u = per_score(family.u, "u", s1, m, **params)
            u = u if mask is None else u * mask  # not in place: u may be s1 itself
            if family.a is None:
                return u, u
            a = per_score(family.a, "a", s1, m, **params)
            return u, (a if mask is None else a * mask)

        (u, a), pull = torch.func.vjp(terms, s.detach())
        if family.a is None:
            (ds,) = pull((dp - d, torch.zeros_like(u)))
        else:
            (ds,) = pull((dp, (-d).expand_as(a)))
        return ds.div_(z), u.detach().div_(z)


# ---------------------------------------------------------------------------------------------
# One pass over the tiles, forward and backward


def _grid(q, k, v, masking, scale, blocks) -> Grid:
    """Every pass here uses each tile up before the next: buffered tiles of
    `policy.BUFFERED_TILE_ELEMENTS` scores."""
    return Grid(
        q,
        k,
        v,
        masking,
        scale,
        *blocks,
        fold_scale=True,
        budget=policy.BUFFERED_TILE_ELEMENTS,
        reuse=True,
    )


def _forward(grid: Grid, kernel: TileMaths, row: Tensor):
    """(output ``[B, Hkv, G, Lq, Dv]``, m, Z) — m and Z ``[B, H, Lq, 1]`` for normalised kernels."""
    out = grid.empty_out()
    shape = (grid.b, grid.h, grid.lq, 1)
    m = torch.zeros(shape, dtype=grid.dtype, device=out.device) if kernel.normalised else None
    if getattr(kernel, "m0", None) is not None:  # a reference found beforehand (`_RowFamily`)
        m = kernel.m0.clone()
    z = torch.zeros_like(m) if kernel.normalised else None
    for r0, r1 in grid.row_blocks():
        qb, rb = grid.q_rows(r0, r1), row_slice(row, grid.lq, r0, r1)
        acc = out[..., r0:r1, :]
        if kernel.normalised:  # contiguous: one layout for every call (no recompiling)
            mb, zb = m[..., r0:r1, :].contiguous(), z[..., r0:r1, :]
        loops = grid.native and kernel.native is not None
        if loops and not kernel.normalised:  # the row values, one per row, for the loops
            rb = rb.to(grid.dtype).expand(grid.b, grid.h, r1 - r0, 1).contiguous()
        for t in grid.tiles(r0, r1):
            s = grid.scores(qb, t)
            ends = grid.prefix(t) if loops else None
            if loops and not kernel.normalised and native.usable(ends, t.masked, s, rb):
                name, p, _ = kernel.native_args()  # one C++ loop per row
                acc += grid.weigh(native.elementwise_forward(name, p, s, ends, rb), t)
                continue
            if loops and kernel.normalised and native.usable(ends, t.masked, s, mb):
                mb, f, u, total = native.normalised_forward(*kernel.native_args(), s, ends, mb)
            else:
                keep = grid.keep(t)
                s = masked_(s, keep)  # disallowed scores 0: no overflow there
                if not kernel.normalised:
                    acc += grid.weigh(kernel.weights(s, rb, keep), t)
                    continue
                mb, f, u, total = _normalised_tile(kernel, s, keep, mb)
            zb.mul_(f).add_(total)
            acc.mul_(grid.grouped(f)).add_(grid.weigh(u, t))
        if kernel.normalised:
            m[..., r0:r1, :] = mb
            acc.div_(grid.grouped(torch.where(zb > 0, zb, torch.ones_like(zb))))
    return out, m, z


def _decode(maths: TileMaths, q, k, v, masking: Masking, scale: float, row) -> Tensor:
    """A decoding step (`decoding.applies`): the map's C++ loop in one pass over the cache
    (`decoding.step`), without the tile walk (a grid, an autograd function, per-tile
    bookkeeping: about 0.25 ms a call on the 2-core AMD EPYC, as much as SDPA's whole step over
    4,096 keys)."""
    name, p, shift = maths.native_args()
    rows = None if maths.normalised else row
    return decoding.step(name, p, shift, q, k, v, masking, scale, rows)[0].to(q.dtype)


def _normalised_tile(kernel: TileMaths, s: Tensor, keep: Tensor | None, m: Tensor):
    """A normalised kernel's forward on one tile: the new row reference m', the rescaling of
    the sums taken relative to m, and (u, Σ_j a_j) relative to m' (``s`` is scratch). Not
    compiled: with torch.compile softpick's forward measured slower (1.79x SDPA against 1.64x
    eagerly, n = 4,096, 2 threads), and Inductor's vectorised CPU ``expm1`` (torch 2.13) is
    e^x − 1, which loses softpick's precision at scores near 0 (ATen's eager one does not)."""
    m_new = torch.maximum(m, kernel.ref_of(s))
    u, total = kernel.weights(s, m_new, keep)
    return m_new, kernel.factor(m, m_new), u, total


def _backward(grid: Grid, kernel: TileMaths, row, m, z, out5, g5, want_row: bool):
    dq = torch.zeros_like(grid.q)
    dk = torch.zeros(grid.k.shape[:2] + grid.k.shape[3:], dtype=grid.dtype, device=dq.device)
    dv = torch.zeros(grid.v.shape[:2] + grid.v.shape[3:], dtype=grid.dtype, device=dq.device)
    drow = torch.zeros(grid.b, grid.h, grid.lq, 1, dtype=grid.dtype, device=dq.device)
    d_all = None
    if kernel.normalised:  # D_i = dO_i·out_i
        d_all = grid.heads((g5 * out5).sum(-1, keepdim=True))
    for r0, r1 in grid.row_blocks():
        qb, gb = grid.q_rows(r0, r1), g5[..., r0:r1, :]
        rb = row_slice(row, grid.lq, r0, r1)
        loops = grid.native and kernel.native is not None
        if kernel.normalised:
            mb, zb, db = m[..., r0:r1, :], z[..., r0:r1, :], d_all[..., r0:r1, :]
            zb = torch.where(zb > 0, zb, torch.ones_like(zb))
            if loops:
                mb, db = mb.contiguous(), db.contiguous()
        elif loops:  # the row values, one per row, for the loops
            rn = rb.to(grid.dtype).expand(grid.b, grid.h, r1 - r0, 1).contiguous()
        dqb = dq[..., r0:r1, :]
        for t in grid.tiles(r0, r1):
            s = grid.scores(qb, t)
            vt = grid.v[..., t.c0 : t.c1, :]
            dp = grid.heads(grid.product(gb, vt.transpose(-2, -1), "dp"))  # dO_i·v_j
            ends = grid.prefix(t) if loops else None
            dr = ()
            if loops and not kernel.normalised and native.usable(ends, t.masked, s, dp, rn):
                name, p, _ = kernel.native_args()  # one loop per row
                ds, w = native.elementwise_backward(name, p, s, ends, dp, rn)
            elif loops and kernel.normalised and native.usable(ends, t.masked, s, dp, mb, db, zb):
                w = grid.buffer("w", s.shape, s)
                ds, w = native.normalised_backward(
                    *kernel.native_args(), s, ends, dp, mb, db, zb, w
                )
            else:
                keep = grid.keep(t)
                s = masked_(s, keep)
                if kernel.normalised:
                    ds, w = kernel.grad(s, dp, mb, keep, db, zb)
                else:  # a user's map also gives dL/dr; the built-in ones' r is a shift of s
                    ds, w, *dr = kernel.grad(s, dp, rb, keep)
                ds = masked_(ds, keep)
            if want_row:
                drow[..., r0:r1, :] += dr[0] if dr else ds.sum(-1, keepdim=True)
            ds5, w5 = grid.grouped(ds), grid.grouped(w)
            kt = grid.k[..., t.c0 : t.c1, :]
            dqb.add_(torch.matmul(ds5, kt), alpha=grid.scale)
            # q carries the scale (fold_scale), so dk = Σ_i ds_ij·(scale·q_i)
            dk[..., t.c0 : t.c1, :] += torch.matmul(ds5.transpose(-2, -1), qb).sum(2)
            dv[..., t.c0 : t.c1, :] += torch.matmul(w5.transpose(-2, -1), gb).sum(2)
    return dq, dk, dv, (drow if want_row else None)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, row, kernel, masking, scale, blocks):
        tiles = blocks
        loops = kernel.native is not None and native.wanted(q.device, compute_dtype(q.dtype))
        if blocks == (None, None) and loops:
            # the loops' forward on tiles of whole rows where they fit (module docstring)
            tiles = row_tiles(q.shape[0] * q.shape[1], masking.lq, masking.lk)
        grid = _grid(q, k, v, masking, scale, tiles)
        out5, m, z = _forward(grid, kernel, row)
        ctx.save_for_backward(q, k, v, row, out5, m, z)
        ctx.kernel, ctx.masking, ctx.scale, ctx.blocks = kernel, masking, scale, blocks
        return grid.heads(out5).to(q.dtype)

    @staticmethod
    def backward(ctx, g):
        q, k, v, row, out5, m, z = ctx.saved_tensors
        grid = _grid(q, k, v, ctx.masking, ctx.scale, ctx.blocks)
        want_row = ctx.needs_input_grad[3]
        dq, dk, dv, drow = _backward(
            grid, ctx.kernel, row, m, z, out5, grid.grouped(g.to(grid.dtype)), want_row
        )
        if want_row:
            drow = drow.sum_to_size(row.shape)
        return (
            grid.heads(dq).to(q.dtype),
            dk.to(k.dtype),
            dv.to(v.dtype),
            drow,
            None,
            None,
            None,
            None,
        )


def _stats(grid: Grid, kernel: TileMaths, row, m, z) -> tuple[Tensor, Tensor]:
    """(entropy −Σ|w|·log|w|, mass Σ w) per row, ``[B, H, Lq, 1]``: one more pass, no matrix."""
    ent = torch.zeros(grid.b, grid.h, grid.lq, 1, dtype=grid.dtype, device=grid.q.device)
    mass = torch.zeros_like(ent)
    with torch.no_grad():
        for r0, r1 in grid.row_blocks():
            qb, rb = grid.q_rows(r0, r1), row_slice(row, grid.lq, r0, r1)
            for t in grid.tiles(r0, r1):
                keep = grid.keep(t)
                s = masked_(grid.scores(qb, t), keep)
                if kernel.normalised:
                    zb = z[..., r0:r1, :]
                    u, _ = kernel.weights(s, m[..., r0:r1, :], keep)
                    w = u / torch.where(zb > 0, zb, torch.ones_like(zb))
                else:
                    w = kernel.weights(s, rb, keep)
                ent[..., r0:r1, :] -= torch.special.xlogy(w.abs(), w.abs()).sum(-1, keepdim=True)
                mass[..., r0:r1, :] += w.sum(-1, keepdim=True)
    return ent, mass


def empty_result(q, k, v, masking: Masking, want_stats: bool):
    """The result of a call with nothing to attend to (B, Lq or Lk = 0, or empty values): zeros
    ``[B, H, Lq, Dv]``, connected to the graph, and zero statistics."""
    out = q.new_zeros(*q.shape[:3], v.shape[-1]) + 0.0 * (q.sum() + k.sum() + v.sum())
    if not want_stats:
        return out, None
    zero = torch.zeros(q.shape[:3] + (1,), dtype=torch.float32, device=q.device)
    return out, row_stats(q.shape[:3], masking.visible_keys(), entropy=zero, mass=zero)


def tiled_attention(
    maths: TileMaths,
    kernel: Kernel | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masking: Masking,
    scale: float,
    want_stats: bool,
    row: Tensor,
    blocks: tuple[int | None, int | None] = (None, None),
) -> tuple[Tensor, AttentionStats | None]:
    """Attention with the tile maths ``maths`` over tiles; ``row`` a per-row tensor
    ``[B|1, H|1, Lq|1, 1]`` the maths reads (sigmoid's bias, relu's n), differentiable.

    ``kernel``, the kernel record of a built-in map (None for a user's map), says where else the
    call may run (`devices.backend`): the Triton kernels on CUDA (``blocks`` then sets their
    block sizes when both are given), the C++ loops on the CPU in float32; float64 inputs and
    ``want_stats=True`` stay on the tiles."""
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return empty_result(q, k, v, masking, want_stats)
    where = backend(kernel, q.device, q.dtype, want_stats)
    if where == "triton":
        fixed = blocks if None not in blocks else None
        out = triton_kernels().attention(kernel, maths, q, k, v, masking, scale, row, fixed)
        return out, None
    maths.native = kernel.name if where == "cpp" else None
    if (
        where == "cpp"
        and blocks == (None, None)
        and decoding.applies(q, k, v, masking, want_stats, (row,))
    ):
        return _decode(maths, q, k, v, masking, scale, row), None
    out = _TiledAttention.apply(q, k, v, row, maths, masking, scale, blocks)
    if not want_stats:
        return out, None
    grid = _grid(q.detach(), k.detach(), v.detach(), masking, scale, blocks)
    m = z = None
    if maths.normalised:
        with torch.no_grad():
            _, m, z = _forward(grid, maths, row.detach())
    ent, mass = _stats(grid, maths, row.detach(), m, z)
    return out, row_stats(q.shape[:3], masking.visible_keys(), entropy=ent, mass=mass)


# ---------------------------------------------------------------------------------------------
# The registry's fast paths


def elementwise(family, q, k, v, masking, scale, want_stats, /, *, blocks=None, **params):
    """The fast path of an `Elementwise` method: w_ij = f(s_ij, r_i) over tiles, r =
    ``family.row(n, **params)`` of the rows' visible keys; a built-in map's tile maths and
    kernels (``family.kernel``), else ``f`` itself on each tile."""
    n = masking.visible_keys(dtype=compute_dtype(q.dtype))
    row = row_tensor(family.row_of(n, (*q.shape[:3], 1), **params), q)
    kernel = family.kernel
    if kernel is not None:
        maths = kernel.tiles(**family.constants_of(params))
    else:
        maths = _Family(family, **params)
    blocks = blocks or (None, None)
    return tiled_attention(maths, kernel, q, k, v, masking, scale, want_stats, row, blocks)


def row_normalised(family, q, k, v, masking, scale, want_stats, /, *, blocks=None, **params):
    """The fast path of a `RowNormalised` method. A built-in map (``family.kernel``): one pass
    with running sums, rescaled when the row reference m grows. A user's map: a first pass over
    the tiles for each row's reference m (the largest of 0 and ``family.ref`` over its visible
    keys), then the tiles' sums u·v and a relative to it, without rescaling."""
    blocks = blocks or (None, None)
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return empty_result(q, k, v, masking, want_stats)
    kernel, zero = family.kernel, row_tensor(0.0, q)
    if kernel is not None:
        maths = kernel.tiles(**family.constants_of(params))
        return tiled_attention(maths, kernel, q, k, v, masking, scale, want_stats, zero, blocks)
    grid = _grid(q.detach(), k.detach(), v.detach(), masking, scale, blocks)
    m = torch.zeros(grid.b, grid.h, grid.lq, 1, dtype=grid.dtype, device=q.device)
    if family.ref is not None:
        with torch.no_grad():
            for r0, r1 in grid.row_blocks():
                qb, mb = grid.q_rows(r0, r1), m[..., r0:r1, :]
                for t in grid.tiles(r0, r1):
                    keep = grid.keep(t)
                    s = masked_(grid.scores(qb, t), keep)
                    r = masked_(per_score(family.ref, "ref", s), keep)
                    mb.copy_(torch.maximum(mb, r.amax(-1, keepdim=True)))
    maths = _RowFamily(family, m, **params)
    return tiled_attention(maths, None, q, k, v, masking, scale, want_stats, zero, blocks)


def hardmax(q, k, v, masking, scale, want_stats, *, straight_through=False, blocks=None):
    """One-hot arg-max attention (ties: the first key): a running (max, arg-max) over the tiles,
    then the chosen value row per query; ``straight_through`` adds softmax attention's gradient
    for q and k (its forward value cancels)."""
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return empty_result(q, k, v, masking, want_stats)
    where = backend(HARDMAX.kernel, q.device, q.dtype, want_stats)
    if not straight_through and where == "triton":
        fixed = blocks if blocks is not None and None not in blocks else None
        out = triton_kernels().topk_attention(q, k, v, masking, scale, 1, fixed)  # k = 1
        return out, None
    grid = Grid(q.detach(), k.detach(), v.detach(), masking, scale, *(blocks or (None, None)))
    shape = (grid.b, grid.h, grid.lq, 1)
    best = torch.full(shape, float("-inf"), dtype=grid.dtype, device=q.device)
    idx = torch.zeros(shape, dtype=torch.long, device=q.device)
    with torch.no_grad():
        for r0, r1 in grid.row_blocks():
            qb = grid.q_rows(r0, r1)
            bb, ib = best[..., r0:r1, :], idx[..., r0:r1, :]
            for t in grid.tiles(r0, r1):
                s = grid.scores(qb, t)
                if t.mask is not None:
                    s = s.masked_fill(~t.mask, float("-inf"))
                top, at = s.max(-1, keepdim=True)  # the first maximum of the tile
                better = top > bb  # strictly: an earlier tile keeps a tie
                ib.copy_(torch.where(better, at + t.c0, ib))
                bb.copy_(torch.where(better, top, bb))
    seen = best > float("-inf")  # rows that see a key
    idx5 = grid.grouped(idx).expand(*grid.grouped(idx).shape[:-1], grid.dv)
    vg = v.unsqueeze(2).expand(grid.b, grid.hkv, grid.g, grid.lk, grid.dv)
    out = grid.heads(torch.gather(vg, 3, idx5)) * seen.to(v.dtype)
    if straight_through:
        soft = softmax_output(q, k, v.detach(), masking, scale)
        out = out + (soft - soft.detach()).to(out.dtype)
    if not want_stats:
        return out, None
    one = seen.to(grid.dtype)
    stats = row_stats(q.shape[:3], masking.visible_keys(), entropy=torch.zeros_like(one), mass=one)
    return out, stats


TILED = {HARDMAX.kernel.name: hardmax}
