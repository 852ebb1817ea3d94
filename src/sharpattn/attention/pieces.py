"""A call with structure (packed documents, a window, padding) cut into pieces without it.

Every query row sees one interval of keys ``[lo_i, hi_i)`` (`Structure.bounds`). Consecutive
rows whose intervals move the same way form a piece that any path runs as an ordinary call on
its own slices of q, k and v:

* **full**: the same keys for every row (a document without ``causal``, the rows past a padded
  sequence's end): keys ``[lo, hi)``, no mask;
* **causal**: the same first key and the last key on the diagonal (a document with ``causal``):
  keys ``[lo, hi_last)`` with ``causal=True``;
* **band**: blocks of rows of a sliding window (the interval moves with the row), or of rows whose
  intervals change irregularly: keys ``[min lo, max hi)`` with a small dense mask of the block
  (rows × (block + window) entries, never rows × Lk).

Rows that see no key are left out (their output is 0). Keys outside every piece are never read:
packed documents cost what the documents cost attended one by one, a window what its band costs.
A method's row statistics (n for the length-scaled family, adaptive's entropy, the sink's
denominator) come out right without any path knowing: a piece holds exactly the keys its rows
may see. Positions stay those of the whole call: a piece tells a positional method (stick-breaking)
where its first row sits among its keys, and stick-breaking's log-position shift is computed for
the whole call first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..normalizers.families import StickBreaking, score_shift
from .masking import Masking
from .stats import AttentionStats, row_stats

Tensor = torch.Tensor

#: at most this many rows in one band block (fewer where the band is narrow)
BAND_ROWS = 1024
#: runs of rows shorter than this are merged with their neighbours into band blocks of at most
#: ``MERGED_ROWS`` rows (a row alone is a piece of its own kind, but thousands of one-row pieces
#: would cost a call each)
SHORT_RUN = 32
MERGED_ROWS = 256


@dataclass(frozen=True)
class Piece:
    """Batch rows ``b0:b1``, query rows ``r0:r1`` and keys ``c0:c1`` of a call, and how its rows
    see its keys: ``"full"``, ``"causal"`` or ``"band"`` (``mask`` then ``[r, c]`` boolean)."""

    b0: int
    b1: int
    r0: int
    r1: int
    c0: int
    c1: int
    kind: str
    mask: Tensor | None = None


def cut(masking: Masking, b: int) -> list[Piece]:
    """The pieces of a call with structure, in batch then row order."""
    lo, hi = masking.structure.bounds(0, masking.lq, masking.lq, masking.lk, masking.causal)
    if lo.shape[0] == 1:
        groups = [(0, b, lo[0], hi[0])]
    else:  # consecutive batch rows that see the same keys share their pieces
        groups = []
        for i in range(b):
            if groups and torch.equal(groups[-1][2], lo[i]) and torch.equal(groups[-1][3], hi[i]):
                groups[-1] = (groups[-1][0], i + 1, lo[i], hi[i])
            else:
                groups.append((i, i + 1, lo[i], hi[i]))
    pieces = []
    for b0, b1, rlo, rhi in groups:
        pieces += [Piece(b0, b1, *rest) for rest in _row_pieces(rlo, rhi, masking.device)]
    return pieces


def _row_pieces(lo: Tensor, hi: Tensor, device) -> list[tuple]:
    """(r0, r1, c0, c1, kind, mask) of one batch group's rows, from its intervals ``[Lq]``."""
    lq = lo.shape[0]
    if lq == 0:
        return []
    active = hi > lo
    dl, dh = lo.diff(), hi.diff()
    both = active[1:] & active[:-1]
    # what keeps row i with row i − 1: 0 the same keys, 1 one more key at the end (causal),
    # 2 the interval moved by one (a band); every other step is a break of its own
    step = torch.full((lq - 1,), -1, dtype=torch.int64)
    step[both & (dl == 0) & (dh == 0)] = 0
    step[both & (dl == 0) & (dh == 1)] = 1
    step[both & (dl == 1) & (dh == 1)] = 2
    # runs of equal steps: row r0 .. r1 − 1 hold the same relation throughout
    change = torch.ones(lq, dtype=torch.bool)
    change[1:] = step < 0
    if lq > 2:
        change[2:] |= (step[1:] != step[:-1]) & (step[1:] >= 0)
    starts = change.nonzero().flatten().tolist() + [lq]
    kinds = {0: "full", 1: "causal", 2: "band"}
    runs = []  # (r0, r1, kind)
    for r0, r1 in zip(starts[:-1], starts[1:], strict=True):
        if not bool(active[r0]):
            continue  # an empty row stays alone (its step is a break)
        kind = kinds[int(step[r0])] if r1 - r0 > 1 else "full"
        runs.append((r0, r1, kind))
    lo_l, hi_l = lo.tolist(), hi.tolist()
    out: list[tuple] = []
    pending: list[tuple[int, int]] = []  # short runs, each next to the one before

    def flush():
        if pending:
            out.extend(_bands(pending[0][0], pending[-1][1], lo, hi, device, MERGED_ROWS))
            pending.clear()

    for r0, r1, kind in runs:
        if kind != "band" and r1 - r0 < SHORT_RUN:  # merged with its neighbours
            if pending and (pending[-1][1] != r0 or r1 - pending[0][0] > MERGED_ROWS):
                flush()
            pending.append((r0, r1))
            continue
        flush()
        if kind == "band":
            out.extend(_bands(r0, r1, lo, hi, device, None))
        elif kind == "full":
            out.append((r0, r1, lo_l[r0], hi_l[r0], "full", None))
        else:
            out.append((r0, r1, lo_l[r0], hi_l[r1 - 1], "causal", None))
    flush()
    return out


def _bands(r0: int, r1: int, lo: Tensor, hi: Tensor, device, rows: int | None) -> list[tuple]:
    """Rows ``r0:r1`` in blocks, each over the keys its rows see with a dense block mask (rows
    that see nothing inside a block are kept: their mask row is empty)."""
    if rows is None:
        width = int((hi[r0:r1] - lo[r0:r1]).max())
        rows = max(64, min(BAND_ROWS, width))
    out = []
    for a in range(r0, r1, rows):
        z = min(a + rows, r1)
        blo, bhi = lo[a:z], hi[a:z]
        seen = bhi > blo
        if not bool(seen.any()):
            continue
        c0, c1 = int(blo[seen].min()), int(bhi[seen].max())
        j = torch.arange(c0, c1)
        m = (j >= blo[:, None]) & (j < bhi[:, None])
        out.append((a, z, c0, c1, "band", m.to(device)))
    return out


class _Slices(torch.autograd.Function):
    """Views ``x[b0:b1, :, s0:s1]`` of one tensor for many (possibly overlapping) ranges; the
    backward adds each piece's gradient into one zero tensor (slicing piece by piece would
    make a whole-size gradient per piece)."""

    @staticmethod
    def forward(ctx, x, ranges):
        ctx.ranges, ctx.shape = ranges, x.shape
        return tuple(x[b0:b1, :, s0:s1] for b0, b1, s0, s1 in ranges)

    @staticmethod
    def backward(ctx, *grads):
        like = next((g for g in grads if g is not None), None)
        if like is None:
            return None, None
        dx = like.new_zeros(ctx.shape)
        for (b0, b1, s0, s1), g in zip(ctx.ranges, grads, strict=True):
            if g is not None:
                dx[b0:b1, :, s0:s1] += g
        return dx, None


def _slices(x: Tensor, ranges: list[tuple]) -> tuple[Tensor, ...]:
    if not ranges:
        return ()
    if torch.is_grad_enabled() and x.requires_grad:
        return _Slices.apply(x, tuple(ranges))
    return tuple(x[b0:b1, :, s0:s1] for b0, b1, s0, s1 in ranges)


def _cut_param(value, b: int, lq: int, p: Piece):
    """A parameter cut to the piece's batch and query rows (a tensor ``[B|1, H|1, Lq|1, 1]``,
    leading 1s may be left out; other values as they are)."""
    if not torch.is_tensor(value) or value.dim() < 2:
        return value
    if value.dim() == 4 and value.shape[0] == b and b > 1:
        value = value[p.b0 : p.b1]
    if value.shape[-2] == lq and lq > 1:
        value = value[..., p.r0 : p.r1, :]
    return value


def _cut_mask(mask: Tensor | None, p: Piece) -> Tensor | None:
    """The user mask ``[B|1, H|1, Lq|1, Lk|1]`` cut to the piece."""
    if mask is None:
        return None
    if mask.shape[0] != 1:
        mask = mask[p.b0 : p.b1]
    if mask.shape[-2] != 1:
        mask = mask[..., p.r0 : p.r1, :]
    if mask.shape[-1] != 1:
        mask = mask[..., p.c0 : p.c1]
    return mask


def run_pieces(
    run: Callable,
    entry,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masking: Masking,
    params: dict,
    want_stats: bool,
) -> tuple[Tensor, AttentionStats | None]:
    """``run(q, k, v, masking, params) -> (out, stats)`` on each piece of a call with structure,
    the outputs put back in place (0 for rows that see no key); with ``want_stats`` the
    statistics too (n from the whole call's structure)."""
    b, h, lq = q.shape[:3]
    lk = masking.lk
    pieces = cut(masking, b)
    params = dict(params)
    positional = entry.positional
    start = params.get("query_offset")
    start = lk - lq if start is None else int(start)
    if isinstance(entry.family, StickBreaking):
        shift, slope = params.get("shift", 0.0), params.get("shift_log_position", 0.0)
        if torch.is_tensor(slope) or slope:  # positions of the whole call, not of a piece
            params["shift"] = score_shift(lq, start, shift, slope, q)
            params["shift_log_position"] = 0.0
    qs = _slices(q, [(p.b0, p.b1, p.r0, p.r1) for p in pieces])
    ks = _slices(k, [(p.b0, p.b1, p.c0, p.c1) for p in pieces])
    vs = _slices(v, [(p.b0, p.b1, p.c0, p.c1) for p in pieces])
    outs, stats = [], []
    for p, qp, kp, vp in zip(pieces, qs, ks, vs, strict=True):
        mask = _cut_mask(masking.mask, p)
        if p.kind == "band":
            local = p.mask.view(1, 1, *p.mask.shape)
            mask = local if mask is None else mask & local
        sub = Masking.build(mask, p.kind == "causal", p.r1 - p.r0, p.c1 - p.c0, masking.device)
        pp = {name: _cut_param(value, b, lq, p) for name, value in params.items()}
        if positional:  # where the piece's first row sits among the piece's keys
            pp["query_offset"] = start + p.r0 - p.c0
        out, st = run(qp, kp, vp, sub, pp)
        outs.append(out)
        stats.append(st)
    out = _assemble(outs, pieces, (b, h, lq, v.shape[-1]), v)
    if not pieces and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        # no row sees a key: the output is 0, still a function of q, k and v (gradient 0), as
        # every path's is (an empty slice's sum is an exact 0, whatever the values)
        out = out + sum(t[:, :, :0].sum() for t in (q, k, v))
    if not want_stats:
        return out, None
    return out, _assemble_stats(stats, pieces, (b, h, lq), masking, v)


def _assemble(parts: list[Tensor], pieces: list[Piece], shape: tuple, like: Tensor) -> Tensor:
    """``[B, H, Lq, ·]`` from the pieces' rows, zeros between them (by concatenation: the
    gradient of each piece is its slice, nothing is written in place)."""
    b, h, lq, d = shape
    dtype = parts[0].dtype if parts else like.dtype
    rows_of: dict[tuple[int, int], list] = {}
    for p, x in zip(pieces, parts, strict=True):
        rows_of.setdefault((p.b0, p.b1), []).append((p.r0, p.r1, x))
    batches, at = [], 0
    for (b0, b1), rows in sorted(rows_of.items()):
        if b0 > at:
            batches.append(like.new_zeros((b0 - at, h, lq, d), dtype=dtype))
        cols, r = [], 0
        for r0, r1, x in rows:
            if r0 > r:
                cols.append(like.new_zeros((b1 - b0, h, r0 - r, d), dtype=dtype))
            cols.append(x.expand(b1 - b0, h, r1 - r0, d))
            r = r1
        if r < lq:
            cols.append(like.new_zeros((b1 - b0, h, lq - r, d), dtype=dtype))
        batches.append(torch.cat(cols, dim=2))
        at = b1
    if at < b:
        batches.append(like.new_zeros((b - at, h, lq, d), dtype=dtype))
    return torch.cat(batches, dim=0)


def _assemble_stats(stats, pieces, shape, masking: Masking, like: Tensor) -> AttentionStats:
    """The pieces' statistics in place; rows of no piece see no key, which `row_stats` fills in
    (β there is 0). A field some piece lacks (lse after a recompute) is left out."""
    fields = {}
    for name in ("entropy", "mass", "lse", "beta", "softmax_entropy"):
        parts = [getattr(s, name) for s in stats]
        if any(x is None for x in parts) or not (parts or name in ("entropy", "mass")):
            fields[name] = None
            continue
        base = parts[0] if parts else like  # no piece: every row empty, zeros
        fields[name] = _assemble([x.unsqueeze(-1) for x in parts], pieces, (*shape, 1), base)
    return row_stats(shape, masking.visible_keys(), **fields)
