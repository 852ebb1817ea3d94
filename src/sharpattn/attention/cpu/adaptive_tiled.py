"""Adaptive temperature (Veličković et al., App. G) on slabs of whole rows: one q·kᵀ serves both
the entropy that sets β and the weights, so the forward is two matrix products, as softmax's.

Queries are cut into blocks of ``bq`` rows; a block's scores over every key it sees, a
``[B, H, bq, Lk']`` slab (`Slabs`), are made once, in base 2 (the scale folded into
q carries log₂ e). Per row, from the slab:

* m = max_j s_j, Z = Σ_j 2^{x_j} and a = Σ_j 2^{x_j}·x_j / Z with x = s − m, so that
  H = ln 2·(log₂ Z − a), the exact entropy of softmax(s) (`softmax_entropy`'s
  statistics, here over the whole row at once);
* β = β(H) (`beta_from_entropy`, the normalizer's own);
* w_j = 2^{β·x_j − c}/Z', c = max_j β·x_j (0 for β >= 0), Z' = Σ_j 2^{β·x_j − c}, and the
  block's output w·v.

The backward (a `torch.autograd.Function`) recomputes each slab and takes, per row, with
g_j = dO·v_j and D = dO·out:  dL/ds_j = β·w_j·(g_j − D) − g_H·ln 2·p_j·(x_j − a), p = 2^x/Z (the
entropy's own derivative, as `softmax_entropy`'s backward), g_H = β'(H)·dL/dβ and
dL/dβ = ln 2·Σ_j x_j·w_j·(g_j − D); then the five products of flash attention's backward. With
``detach_beta`` the second term is left out.

On the CPU in float32 the per-row work runs in the C++ loops of `native` (one or two
sweeps per row while it is in cache); elsewhere, and for tiles with a mask other than causal, in
PyTorch. `adaptive` takes this path where the loops run and the slab fits
(`slabs_wanted`); every other call, and every call that asks for statistics, takes
`adaptive` (a statistics pass over key tiles, then the flash kernel).
"""

from __future__ import annotations

import torch

from ...normalizers._contract import compute_dtype
from ...normalizers.softmax import ADAPTIVE, beta_from_entropy, resolve_coefficients
from .. import policy
from ..masking import Masking
from . import decoding, native
from .fused import LN2, LOG2E, entropy_tile
from .fused import adaptive as adaptive_two_pass
from .tiles import Grid, Slabs, device_budget, slab_rows

Tensor = torch.Tensor


def _rows_of(bh: int, lq: int, lk: int, device: torch.device, parts: float = 1) -> int:
    """Rows per slab, for ``parts`` slab-sized buffers' worth of rows within the memory of one
    (the backward: `policy.ADAPTIVE_BACKWARD_PARTS`)."""
    budget = int(device_budget(policy.ADAPTIVE_SLAB_ELEMENTS, device) / parts)
    most = int(policy.ADAPTIVE_SLAB_MAX / parts)
    return slab_rows(bh, lq, lk, budget, max(1, int(policy.ADAPTIVE_MIN_ROWS / parts)), most)


def slabs_wanted(q: Tensor, k: Tensor, v: Tensor, masking: Masking) -> bool:
    """Whether `adaptive` takes the slab path: the C++ loops run (a float32 compute dtype
    on the CPU), no mask but the causal one, and `policy.ADAPTIVE_FEWEST_ROWS` rows of one key
    head's query heads fit `policy.ADAPTIVE_SLAB_MAX`."""
    fewest = min(policy.ADAPTIVE_FEWEST_ROWS, q.shape[-2])
    return (
        masking.mask is None
        and q.numel() > 0
        and k.numel() > 0
        and v.numel() > 0
        and (q.shape[1] // k.shape[1]) * fewest * k.shape[-2] <= policy.ADAPTIVE_SLAB_MAX
        and native.wanted(q.device, compute_dtype(q.dtype))
    )


def _head_groups(q: Tensor, k: Tensor) -> list[tuple[int, int, int, int]]:
    """(batch start, end, key-head start, end) of groups of heads whose slab of
    `policy.ADAPTIVE_MIN_ROWS` rows fits `policy.ADAPTIVE_SLAB_MAX`: the whole call where it
    does."""
    b, h, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    most = policy.ADAPTIVE_SLAB_MAX
    per_kv = (h // hkv) * min(policy.ADAPTIVE_MIN_ROWS, lq) * lk  # one key head's query heads
    if b * hkv * per_kv <= most:
        return [(0, b, 0, hkv)]
    if hkv * per_kv <= most:  # whole items, several per group
        step = max(1, most // (hkv * per_kv))
        return [(b0, min(b0 + step, b), 0, hkv) for b0 in range(0, b, step)]
    step = max(1, most // per_kv)
    return [(i, i + 1, h0, min(h0 + step, hkv)) for i in range(b) for h0 in range(0, hkv, step)]


def adaptive(q, k, v, masking, scale, want_stats, **params):
    """Adaptive-temperature attention: on slabs (module docstring) where
    `slabs_wanted`, else `adaptive`, whose parameters ``params`` are."""
    tensors = [p for p in params.values() if torch.is_tensor(p)]
    if decoding.applies(q, k, v, masking, want_stats, tensors):  # one pass over the cache
        return _decoded(q, k, v, masking, scale, **params), None
    if want_stats or not slabs_wanted(q, k, v, masking):
        return adaptive_two_pass(ADAPTIVE, q, k, v, masking, scale, want_stats, **params)
    return _on_slabs(q, k, v, masking, scale, **params), None


def _decoded(
    q, k, v, masking, scale, *, coefficients="icml", threshold=0.5, floor=1.0, detach_beta=False
):
    """A decoding step (`decoding.adaptive_step`); no gradient is wanted, so ``detach_beta``
    changes nothing."""
    coef = tuple(float(c) for c in resolve_coefficients(coefficients))
    out = decoding.adaptive_step(q, k, v, masking, scale, coef, float(threshold), float(floor))
    return out.to(q.dtype)


def _on_slabs(
    q, k, v, masking, scale, *, coefficients="icml", threshold=0.5, floor=1.0, detach_beta=False
):
    """`adaptive_slabs`, in groups of heads where one slab of all of them is too large."""
    coef = tuple(float(c) for c in resolve_coefficients(coefficients))
    rule = (coef, float(threshold), float(floor), bool(detach_beta))
    groups = _head_groups(q, k)
    if len(groups) == 1:
        return adaptive_slabs(q, k, v, masking, scale, rule)
    g = q.shape[1] // k.shape[1]
    outs = [
        adaptive_slabs(
            q[b0:b1, h0 * g : h1 * g], k[b0:b1, h0:h1], v[b0:b1, h0:h1], masking, scale, rule
        )
        for b0, b1, h0, h1 in groups
    ]
    if groups[0][2:] == (0, k.shape[1]):  # groups of whole items
        return torch.cat(outs, dim=0)
    per_item = len(groups) // q.shape[0]
    items = [torch.cat(outs[i : i + per_item], dim=1) for i in range(0, len(outs), per_item)]
    return torch.cat(items, dim=0)


def adaptive_slabs(q: Tensor, k: Tensor, v: Tensor, masking: Masking, scale: float, rule):
    """The slab path itself (any mask, dtype and device; module docstring): ``rule`` =
    (coefficients, threshold, floor, detach_beta) of β(H)."""
    return _AdaptiveSlabs.apply(q, k, v, masking, scale, rule)


def _walk(q, k, v, masking, scale, parts: float = 1) -> Slabs:
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    bq = _rows_of(b * h, lq, lk, q.device, parts)
    # one tile per slab: the grid's buffers (``reuse``) are slab-sized
    grid = Grid(q, k, v, masking, scale * LOG2E, bq=bq, bk=max(lk, 1), fold_scale=True, reuse=True)
    return Slabs(grid, bq)


def _shift(m: Tensor, big: float) -> Tensor:
    """The rows' maxima, 0 for rows that see no key (m still −big)."""
    return torch.where(m > -big, m, torch.zeros_like(m))


def _tempered(x: Tensor, keep: Tensor | None, beta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(2^{β·x − c} over the allowed keys, c, the row sums) from x = s − m (any finite value
    where masked), in PyTorch; the C++ loop is in `adaptive_forward`."""
    big = torch.finfo(x.dtype).max
    low = x if keep is None else x + (1.0 - keep) * big
    c = torch.where(beta < 0, beta * low.amin(-1, keepdim=True), torch.zeros_like(beta))
    w = x.mul(beta).sub_(c).clamp_max_(0.0).exp2_()  # <= 0 at allowed keys
    if keep is not None:
        w.mul_(keep)
    return w, c, w.sum(-1, keepdim=True)


class _AdaptiveSlabs(torch.autograd.Function):
    """softmax(β(H_i)·s_ij)·v on slabs, s = scale·q·kᵀ, H_i the entropy of softmax(s_i)."""

    @staticmethod
    def forward(ctx, q, k, v, masking, scale, rule):
        coef, threshold, floor, detach = rule
        walk = _walk(q, k, v, masking, scale)
        grid = walk.grid
        big = torch.finfo(grid.dtype).max
        out = grid.empty_out()
        # per row: m, Z, a, β, c, Z' (a row that sees no key: m = −big, Z = Z' = 0)
        rows = walk.zeros().expand(6, *walk.rows).clone()
        rows[0].fill_(-big)
        for t in walk.blocks():
            r0, r1 = t.r0, t.r1
            s = grid.scores(grid.q_rows(r0, r1), t)  # base 2
            ends = grid.prefix(t) if grid.native else None
            if grid.native and native.usable(ends, t.masked, s):  # one call, two sweeps per row
                stats = native.adaptive_forward(s, ends, coef, threshold, floor)
                w, zt = s, stats[5]
            else:
                m, z, a = rows[:3, ..., r0:r1, :].clone().unbind(0)
                keep = grid.keep(t)
                m, z, a = entropy_tile(s, keep, m, z, a, big)  # s becomes x = s − m
                beta = _beta(z, a, coef, threshold, floor)
                w, c, zt = _tempered(s, keep, beta)
                stats = torch.stack((m, z, a, beta, c, zt))
            inv = torch.where(zt > 0, 1.0 / zt, torch.zeros_like(zt))
            out[..., r0:r1, :] = grid.weigh(w, t) * grid.grouped(inv)
            rows[..., r0:r1, :] = stats
        out = grid.heads(out)
        ctx.save_for_backward(q, k, v, out, rows)
        ctx.masking, ctx.scale, ctx.rule = masking, scale, rule
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, rows = ctx.saved_tensors
        coef, threshold, floor, detach = ctx.rule
        walk = _walk(q, k, v, ctx.masking, ctx.scale, parts=policy.ADAPTIVE_BACKWARD_PARTS)
        grid = walk.grid
        big = torch.finfo(grid.dtype).max
        go, dq, dk, dv = walk.grads(d_out)
        dd = (grid.heads(go) * out).sum(-1, keepdim=True)  # D_i = dO_i·out_i
        h = _entropy(rows[1], rows[2])
        if detach:
            dbeta = torch.zeros_like(h)
        else:  # β'(H) row by row (β acts on each row alone); torch.func traces in a graph
            dbeta = torch.func.grad(lambda x: beta_from_entropy(x, coef, threshold, floor).sum())(
                h.detach()
            )
        rows = (*rows.unbind(0), dd, dbeta)
        for t in walk.blocks():
            r0, r1 = t.r0, t.r1
            m, z, a, beta, c, zt, d, db = (x[..., r0:r1, :].contiguous() for x in rows)
            s = grid.scores(grid.q_rows(r0, r1), t)
            vt = grid.v[..., : t.c1, :].transpose(-2, -1)
            dp = grid.heads(grid.product(go[..., r0:r1, :], vt, "dp"))  # dO·vᵀ
            ends = grid.prefix(t) if grid.native else None
            if grid.native and native.usable(ends, t.masked, s, dp, m, z, a, beta, c, zt, d, db):
                ds, w = native.tempered_backward(s, dp, ends, m, z, a, beta, c, zt, d, db)
            else:
                ds, w = _backward_tile(s, dp, grid.keep(t), m, z, a, beta, c, zt, d, db, big)
            walk.accumulate(t, ds, w, go, dq, dk, dv)
        dq.mul_(ctx.scale)
        dk.mul_(1.0 / LOG2E)  # the grid's q carries scale·log₂ e (Slabs.accumulate)
        return (*walk.finish_grads(q, k, v, dq, dk, dv), None, None, None)


def _entropy(z: Tensor, a: Tensor) -> Tensor:
    """H = ln 2·(log₂ Z − a) per row (0 where no key: Z = 0), >= 0."""
    empty = z == 0
    h = LN2 * (torch.log2(torch.where(empty, torch.ones_like(z), z)) - a)
    return h.masked_fill_(empty, 0.0).clamp_min_(0.0)


def _beta(z: Tensor, a: Tensor, coef, threshold, floor) -> Tensor:
    """β(H) per row from the statistics (a still Σ 2^x·x, divided by Z here in place)."""
    a.div_(torch.where(z == 0, torch.ones_like(z), z))
    return beta_from_entropy(_entropy(z, a), coef, threshold, floor).contiguous()


def _backward_tile(s, dp, keep, m, z, a, beta, c, zt, d, dbeta, big):
    """(dL/ds, w) of one slab in PyTorch (``s`` base-2 scores and ``dp`` = dO·vᵀ are scratch);
    the C++ loop is `tempered_backward`."""
    if keep is not None:
        s.mul_(keep)
    x = s.sub_(_shift(m, big))
    if keep is not None:
        x.clamp_max_(0.0)
    w = x.mul(beta).sub_(c).clamp_max_(0.0).exp2_()
    izt = torch.where(zt > 0, 1.0 / zt, torch.zeros_like(zt))
    w.mul_(izt if keep is None else keep * izt)
    t = dp.sub_(d).mul_(w)  # w·(g − D)
    gh = dbeta * LN2 * torch.linalg.vecdot(x, t).unsqueeze(-1)  # β'(H)·dL/dβ
    iz = torch.where(z > 0, 1.0 / z, torch.zeros_like(z))
    p = x.exp2() if keep is None else x.exp2().mul_(keep)
    ds = t.mul_(beta).sub_(p.mul_(x.sub_(a)).mul_(gh * LN2 * iz))
    return ds, w
