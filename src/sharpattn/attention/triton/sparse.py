"""The entmax family's Triton kernel on CUDA: the threshold τ per row by Newton passes over
the key blocks, then one output pass; the backward is `template`'s with ``MAP = "entmax"``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..masking import Masking
from .maps import powers
from .template import (
    SPLIT_BLOCK_M,
    Launch,
    backward,
    block_scores,
    combine_block,
    key_splits,
    query_block,
    support_row,
    tile,
    unit_last,
)

Tensor = torch.Tensor


@triton.jit
def _entmax_sums(s, keep, c1, c0, p, POWER: tl.constexpr):
    """(t^e, t^{e−1}) [M, N] of t = [c1·s − c0]_+ at the allowed keys, 0 elsewhere (e = ``p``,
    a number or [M, 1])."""
    t = tl.where(keep, tl.maximum(c1 * s - c0, 0.0), 0.0)
    return powers(t, p, POWER)


@triton.jit
def _newton(s0, s1, tau, lo, up, p):
    """One safeguarded Newton step on G(τ) = (Σ_j t_j^e)^{1/e} − 1 from the sums s0 = Σ t^e and
    s1 = Σ t^{e−1} at τ: the bracket [lo, up] shrunk to the side of the root, then τ + G/|G′| =
    τ + (S0 − S0^{1−1/e})/S1 if it stays inside, else the bracket's middle. (τ, lo, up) [M]."""
    right = s0 < 1.0  # G(τ) < 0: τ is past the root
    lo = tl.where(right, lo, tau)
    up = tl.where(right, tau, up)
    lead = tl.exp2((1.0 - 1.0 / p) * tl.log2(tl.maximum(s0, 1e-30)))
    step = tau + (s0 - lead) / tl.maximum(s1, 1e-30)
    inside = (step >= lo) & (step <= up)
    return tl.where(inside, step, 0.5 * (lo + up)), lo, up


@triton.jit
def _slack(top):
    """How far below a row's threshold a key block's bound must lie to be skipped: a few float32
    roundings of the scores' size (t = c1·s − c0 and the bound c1·s − max round differently)."""
    return 1e-6 * (1.0 + tl.max(tl.abs(top), 0))


@triton.jit
def _entmax_forward_kernel(
    q_ptr, k_ptr, v_ptr, row_ptr, mask_ptr, out_ptr, r_ptr, m_ptr, z_ptr, sup_ptr,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    srb, srh, srm,
    smb, smh, smm, smn,
    sob, soh, som, sod,
    heads, group, lq, lk, d, dv, offset, scale,
    POWER: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, STEPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """α-entmax attention of one block of query rows, y = c1·s − max_j c1·s_j, with the row
    pair ``row`` = (c1, e) per row, c1 = (α−1)·θ and e = 1/(α−1) (α per head or row): a pass
    for the rows' maximum and visible keys n; passes of safeguarded Newton steps (`_newton`) on
    G(τ) from τ = −1 (G >= 0 there) inside the bracket [−1, −n^{1−α}], until no row's τ moves
    by more than float32's resolution of its scores, at most ``STEPS``; a last
    pass for out = Σ_j p_j·v_j / Σ_j p_j, p = [y − τ]_+^e, and r = Σ_j u_j·v_j / Σ_j u_j, u =
    [y − τ]_+^{e−1} (the backward's D_i = dO_i·r_i). Writes out, r (float32 [B, H, Lq, Dv]),
    c0 = max + τ and Z = Σ p per row.

    Block support, ``sup`` [B·H, query blocks, key blocks] (float32, zeros): the first Newton
    pass writes each key block's bound, the largest y over the block's rows and keys; a later
    pass skips a key block whose bound is below every row's τ (no weight there, t = 0), so the
    passes cost less as τ rises; the last pass overwrites the bound with 1 where some weight of
    the block may be nonzero, 0 where none is, for the backward kernels to skip the rest."""
    start_m, b, h, hk, offs_m, offs_d, offs_e, in_m, q = query_block(
        q_ptr, sqb, sqh, sqm, sqd, heads, group, lq, d, BLOCK_M, D_PAD, DV_PAD
    )
    at = row_ptr + b * srb + h * srh + offs_m * srm
    c1 = tl.load(at, mask=in_m, other=1.0)[:, None]
    e = tl.load(at + 1, mask=in_m, other=1.0)  # the pair's last dimension has stride 1
    sup = support_row(sup_ptr, lq, lk, BLOCK_M, BLOCK_N)
    hi = lk
    if CAUSAL:
        hi = tl.minimum(lk, start_m + BLOCK_M + offset)
    top = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    n = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s, keep = block_scores(q, k_ptr, skb, skh, skn, skd, b, h, hk, offs_m, offs_n, offs_d,
                                lq, lk, d, offset, scale, mask_ptr, smb, smh, smm, smn,
                                CAUSAL, HAS_MASK, PRECISION)  # fmt: skip
        top = tl.maximum(top, tl.max(tl.where(keep, c1 * s, -float("inf")), 1))
        n += tl.sum(keep.to(tl.float32), 1)
    top = tl.where(n > 0.0, top, 0.0)
    slack = _slack(top)
    live = n > 0.0
    lo = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0
    up = -tl.exp2((1.0 - (1.0 + 1.0 / e)) * tl.log2(tl.maximum(n, 1.0)))
    tau = lo
    # the first Newton pass, at τ = −1 (every key block), writes the blocks' bounds
    s0 = tl.zeros([BLOCK_M], dtype=tl.float32)
    s1 = tl.zeros([BLOCK_M], dtype=tl.float32)
    c0 = (top + tau)[:, None]
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s, keep = block_scores(q, k_ptr, skb, skh, skn, skd, b, h, hk, offs_m, offs_n, offs_d,
                                lq, lk, d, offset, scale, mask_ptr, smb, smh, smm, smn,
                                CAUSAL, HAS_MASK, PRECISION)  # fmt: skip
        y = tl.where(keep, c1 * s - top[:, None], -float("inf"))
        tl.store(sup + start_n // BLOCK_N, tl.max(tl.max(y, 1), 0))
        tp, tq = _entmax_sums(s, keep, c1, c0, e[:, None], POWER)
        s0 += tl.sum(tp, 1)
        s1 += tl.sum(tq, 1)
    before = tau
    tau, lo, up = _newton(s0, s1, tau, lo, up, e)
    # the next passes, until every row's τ moved by less than float32's resolution of the scores
    # (``tol``: the threshold is then as exact as y) or ``STEPS`` passes in all
    tol = 2.5e-7 * (1.0 + tl.abs(top))
    moving = tl.max(tl.where(live & (tl.abs(tau - before) > tol), 1, 0), 0)
    taken = 1
    while (taken < STEPS) & (moving > 0):
        low = tl.min(tl.where(live, tau, float("inf")), 0) - slack  # skip below every row's τ
        s0 = tl.zeros([BLOCK_M], dtype=tl.float32)
        s1 = tl.zeros([BLOCK_M], dtype=tl.float32)
        c0 = (top + tau)[:, None]
        for start_n in range(0, hi, BLOCK_N):
            if tl.load(sup + start_n // BLOCK_N) > low:
                offs_n = start_n + tl.arange(0, BLOCK_N)
                s, keep = block_scores(q, k_ptr, skb, skh, skn, skd, b, h, hk, offs_m, offs_n,
                                        offs_d, lq, lk, d, offset, scale, mask_ptr, smb, smh, smm,
                                        smn, CAUSAL, HAS_MASK, PRECISION)  # fmt: skip
                tp, tq = _entmax_sums(s, keep, c1, c0, e[:, None], POWER)
                s0 += tl.sum(tp, 1)
                s1 += tl.sum(tq, 1)
        before = tau
        tau, lo, up = _newton(s0, s1, tau, lo, up, e)
        moving = tl.max(tl.where(live & (tl.abs(tau - before) > tol), 1, 0), 0)
        taken += 1
    low = tl.min(tl.where(live, tau, float("inf")), 0) - slack
    c0 = (top + tau)[:, None]
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    z = tl.zeros([BLOCK_M], dtype=tl.float32)
    zu = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        if tl.load(sup + start_n // BLOCK_N) > low:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            s, keep = block_scores(q, k_ptr, skb, skh, skn, skd, b, h, hk, offs_m, offs_n,
                                    offs_d, lq, lk, d, offset, scale, mask_ptr, smb, smh, smm,
                                    smn, CAUSAL, HAS_MASK, PRECISION)  # fmt: skip
            near = tl.max(tl.max(tl.where(keep, c1 * s - c0, -float("inf")), 1), 0)
            tl.store(sup + start_n // BLOCK_N, tl.where(near > -slack, 1.0, 0.0))
            tp, tq = _entmax_sums(s, keep, c1, c0, e[:, None], POWER)
            v = tile(v_ptr, svb, svh, svn, svd, b, hk, offs_n, offs_e, lk, dv)
            acc += tl.dot(tp.to(v.dtype), v, input_precision=PRECISION)
            u_hi = tq.to(v.dtype)
            acc_u += tl.dot(u_hi, v, input_precision=PRECISION)
            if v.dtype != tl.float32:  # u to about 22 bits (r's rounding enters dθ over every key)
                acc_u += tl.dot((tq - u_hi.to(tl.float32)).to(v.dtype), v)
            z += tl.sum(tp, 1)
            zu += tl.sum(tq, 1)
        else:
            tl.store(sup + start_n // BLOCK_N, 0.0)
    acc = acc / tl.where(z > 0.0, z, 1.0)[:, None]
    acc_u = acc_u / tl.where(zu > 0.0, zu, 1.0)[:, None]
    rows = b * heads * lq + h * lq + offs_m
    tl.store(m_ptr + rows, tl.reshape(c0, [BLOCK_M]), mask=in_m)
    tl.store(z_ptr + rows, z, mask=in_m)
    where = offs_m[:, None] * som + offs_e[None, :] * sod
    inside = in_m[:, None] & (offs_e[None, :] < dv)
    tl.store(out_ptr + b * sob + h * soh + where, acc, mask=inside)
    tl.store(r_ptr + b * sob + h * soh + where, acc_u, mask=inside)


# ---------------------------------------------------------------------------------------------
# Decoding: the keys split among programs, the threshold over the whole cache

#: keys per chunk of the threshold kernel's passes over a row's buffered scores, and its warps:
#: 8 floats a thread a chunk, 32 chunks a pass at 64k keys (a pass is one program reading the
#: row from L2; not tuned on a GPU yet)
THRESHOLD_CHUNK = 2048
THRESHOLD_WARPS = 8


@triton.jit(do_not_specialize=["heads", "group", "lq", "lk", "d", "split_rows", "split_keys"])
def _entmax_scores_kernel(
    q_ptr, k_ptr, row_ptr, mask_ptr, y_ptr, pmax_ptr, pn_ptr,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    srb, srh, srm,
    smb, smh, smm, smn,
    heads, group, lq, lk, d, offset, scale, split_rows, split_keys,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Decoding, the first launch (`_split_forward`): c1·s of every key of split
    ``program_id(2)``, −inf where the row may not see it, into the row's buffer (contiguous
    float32 ``[B, H, Lq, Lk]`` at ``y_ptr``: one float per (row, key), which a decoding call's
    at most `SPLIT_MAX_LQ` rows keep O(Lk)), and the split's largest c1·s and count of visible
    keys per row (contiguous ``[splits, B, H, Lq]``, ``split_rows`` apart)."""
    start_m, b, h, hk, offs_m, offs_d, offs_e, in_m, q = query_block(
        q_ptr, sqb, sqh, sqm, sqd, heads, group, lq, d, BLOCK_M, D_PAD, DV_PAD
    )
    c1 = tl.load(row_ptr + b * srb + h * srh + offs_m * srm, mask=in_m, other=1.0)[:, None]
    split = tl.program_id(2)
    lo = split * split_keys
    hi = tl.minimum(lk, lo + split_keys)
    rows = b * heads * lq + h * lq + offs_m
    top = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    n = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):  # every block: the buffer is read whole
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s, keep = block_scores(q, k_ptr, skb, skh, skn, skd, b, h, hk, offs_m, offs_n, offs_d,
                                lq, lk, d, offset, scale, mask_ptr, smb, smh, smm, smn,
                                CAUSAL, HAS_MASK, PRECISION)  # fmt: skip
        y = tl.where(keep, c1 * s, -float("inf"))
        at = y_ptr + rows[:, None].to(tl.int64) * lk + offs_n[None, :]
        tl.store(at, y, mask=in_m[:, None] & (offs_n[None, :] < lk))
        top = tl.maximum(top, tl.max(y, 1))
        n += tl.sum(keep.to(tl.float32), 1)
    tl.store(pmax_ptr + split * split_rows + rows, top, mask=in_m)
    tl.store(pn_ptr + split * split_rows + rows, n, mask=in_m)


@triton.jit(do_not_specialize=["heads", "lq", "lk", "splits", "split_rows"])
def _entmax_threshold_kernel(
    row_ptr, y_ptr, pmax_ptr, pn_ptr, c0_ptr, top_ptr,
    srb, srh, srm,
    heads, lq, lk, splits, split_rows,
    POWER: tl.constexpr, STEPS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Decoding, the second launch: one program per row finds τ from the row's buffered
    scores as `_entmax_forward_kernel` does from its key blocks (the largest y and n from the
    splits' partials, safeguarded Newton passes from τ = −1 in [−1, −n^{1−α}] until τ moves by
    less than float32's resolution of the scores, at most ``STEPS``), each pass over the buffer
    (L2-resident) instead of the keys; stores c0 = max + τ and the max per row."""
    r = tl.program_id(0)
    i = r % lq
    h = (r // lq) % heads
    b = r // (lq * heads)
    e = tl.load(row_ptr + b * srb + h * srh + i * srm + 1)  # (the buffer holds c1·s)
    top = -float("inf")
    n = 0.0
    for split in range(0, splits):
        top = tl.maximum(top, tl.load(pmax_ptr + split * split_rows + r))
        n += tl.load(pn_ptr + split * split_rows + r)
    live = n > 0.0
    top = tl.where(live, top, 0.0)
    lo = -1.0
    up = -tl.exp2((1.0 - (1.0 + 1.0 / e)) * tl.log2(tl.maximum(n, 1.0)))
    tau = lo
    tol = 2.5e-7 * (1.0 + tl.abs(top))
    y_ptr += r.to(tl.int64) * lk
    taken = 0
    moving = 1
    while (taken < STEPS) & (moving > 0):
        c0 = top + tau
        s0 = tl.zeros([CHUNK], dtype=tl.float32)
        s1 = tl.zeros([CHUNK], dtype=tl.float32)
        for start in range(0, lk, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            y = tl.load(y_ptr + offs, mask=offs < lk, other=-float("inf"))
            tp, tq = powers(tl.maximum(y - c0, 0.0), e, POWER)
            s0 += tp
            s1 += tq
        before = tau
        tau, lo, up = _newton(tl.sum(s0, 0), tl.sum(s1, 0), tau, lo, up, e)
        moving = tl.where(live & (tl.abs(tau - before) > tol), 1, 0)
        taken += 1
    tl.store(c0_ptr + r, top + tau)
    tl.store(top_ptr + r, top)


@triton.jit(
    do_not_specialize=["heads", "group", "lq", "lk", "dv", "split_out", "split_rows", "split_keys"]
)
def _entmax_split_kernel(
    v_ptr, row_ptr, y_ptr, c0_ptr, top_ptr, part_ptr, partu_ptr, pz_ptr, pzu_ptr, sup_ptr,
    svb, svh, svn, svd,
    srb, srh, srm,
    spb, sph, spm, spd,
    heads, group, lq, lk, dv, split_out, split_rows, split_keys,
    POWER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DV_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Decoding, the third launch: split ``program_id(2)``'s share of the unsplit kernel's
    last pass, from the buffered scores: Σ p·v and Σ u·v (float32 ``[splits, B, H, Lq, Dv]``,
    ``split_out`` apart), Σ p and Σ u (``[splits, B, H, Lq]``), p = [y − c0]_+^e, u =
    [y − c0]_+^{e−1}, and its key blocks' support (1 where some weight may be nonzero)."""
    b, h, offs_m, offs_e, in_m, inside, rows = combine_block(heads, lq, dv, BLOCK_M, DV_PAD)
    hk = h // group
    e = tl.load(row_ptr + b * srb + h * srh + offs_m * srm + 1, mask=in_m, other=1.0)[:, None]
    c0 = tl.load(c0_ptr + rows, mask=in_m, other=0.0)[:, None]
    slack = _slack(tl.load(top_ptr + rows, mask=in_m, other=0.0))
    split = tl.program_id(2)
    lo = split * split_keys
    hi = tl.minimum(lk, lo + split_keys)
    sup = support_row(sup_ptr, lq, lk, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    z = tl.zeros([BLOCK_M], dtype=tl.float32)
    zu = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        at = y_ptr + rows[:, None].to(tl.int64) * lk + offs_n[None, :]
        y = tl.load(at, mask=in_m[:, None] & (offs_n[None, :] < lk), other=-float("inf"))
        near = tl.max(tl.max(y - c0, 1), 0)
        tl.store(sup + start_n // BLOCK_N, tl.where(near > -slack, 1.0, 0.0))
        if near > -slack:
            tp, tq = powers(tl.maximum(y - c0, 0.0), e, POWER)
            v = tile(v_ptr, svb, svh, svn, svd, b, hk, offs_n, offs_e, lk, dv)
            acc += tl.dot(tp.to(v.dtype), v, input_precision=PRECISION)
            u_hi = tq.to(v.dtype)
            acc_u += tl.dot(u_hi, v, input_precision=PRECISION)
            if v.dtype != tl.float32:  # u to about 22 bits, as the unsplit kernel
                acc_u += tl.dot((tq - u_hi.to(tl.float32)).to(v.dtype), v)
            z += tl.sum(tp, 1)
            zu += tl.sum(tq, 1)
    tl.store(pz_ptr + split * split_rows + rows, z, mask=in_m)
    tl.store(pzu_ptr + split * split_rows + rows, zu, mask=in_m)
    where = split * split_out + b * spb + h * sph + offs_m[:, None] * spm + offs_e[None, :] * spd
    tl.store(part_ptr + where, acc, mask=inside)
    tl.store(partu_ptr + where, acc_u, mask=inside)


@triton.jit(do_not_specialize=["heads", "lq", "dv", "splits", "split_rows"])
def _entmax_combine_kernel(
    part_ptr, partu_ptr, pz_ptr, pzu_ptr, out_ptr, r_ptr, z_ptr,
    sps, spb, sph, spm, spd,
    sob, soh, som, sod,
    heads, lq, dv, splits, split_rows,
    BLOCK_M: tl.constexpr, DV_PAD: tl.constexpr,
):  # fmt: skip
    """Decoding, the last launch: out = Σ_s Σp·v / Σ_s Σp and r = Σ_s Σu·v / Σ_s Σu (every
    split weighed with the same τ), and Z = Σ p, as the unsplit kernel stores them."""
    b, h, offs_m, offs_e, in_m, inside, rows = combine_block(heads, lq, dv, BLOCK_M, DV_PAD)
    at = b * spb + h * sph + offs_m[:, None] * spm + offs_e[None, :] * spd
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    z = tl.zeros([BLOCK_M], dtype=tl.float32)
    zu = tl.zeros([BLOCK_M], dtype=tl.float32)
    for split in range(0, splits):
        acc += tl.load(part_ptr + split * sps + at, mask=inside, other=0.0)
        acc_u += tl.load(partu_ptr + split * sps + at, mask=inside, other=0.0)
        z += tl.load(pz_ptr + split * split_rows + rows, mask=in_m, other=0.0)
        zu += tl.load(pzu_ptr + split * split_rows + rows, mask=in_m, other=0.0)
    acc = acc / tl.where(z > 0.0, z, 1.0)[:, None]
    acc_u = acc_u / tl.where(zu > 0.0, zu, 1.0)[:, None]
    tl.store(z_ptr + rows, z, mask=in_m)
    where = b * sob + h * soh + offs_m[:, None] * som + offs_e[None, :] * sod
    tl.store(out_ptr + where, acc, mask=inside)
    tl.store(r_ptr + where, acc_u, mask=inside)


def _split_forward(launch: Launch, q, k, v, out, r, c0, z, steps: int, splits: int) -> None:
    """The forward of a decoding call in four launches: the scores into a per-row buffer with
    each split's max and count (`_entmax_scores_kernel`), τ per row over the buffer
    (`_entmax_threshold_kernel`), each split's weighted sums (`_entmax_split_kernel`), then
    `_entmax_combine_kernel` into out, r and Z (c0 from the second). Query rows in blocks of
    `SPLIT_BLOCK_M`, keys in the launch's blocks."""
    b, h, lq, dv = launch.b, launch.h, launch.lq, launch.dv
    bn = launch.blocks[1]
    per = triton.cdiv(triton.cdiv(launch.lk, bn), splits) * bn  # keys per split
    f32 = dict(dtype=torch.float32, device=q.device)
    y = torch.empty(b, h, lq, launch.lk, **f32)
    pmax, pn, pz, pzu = (torch.empty(splits, b, h, lq, **f32) for _ in range(4))
    part, partu = (torch.empty(splits, b, h, lq, dv, **f32) for _ in range(2))
    top = launch.rows(q.device)
    mask, rs, ms = launch.common()
    blocks = triton.cdiv(lq, SPLIT_BLOCK_M)
    grid = (blocks, b * h, splits)
    rows = b * h * lq
    tiles = dict(BLOCK_M=SPLIT_BLOCK_M, BLOCK_N=bn, PRECISION=launch.precision)
    _entmax_scores_kernel[grid](
        q, k, launch.row, mask, y, pmax, pn, *q.stride(), *k.stride(), *rs, *ms,
        h, launch.group, lq, launch.lk, launch.d, launch.offset, launch.scale, rows, per,
        CAUSAL=launch.causal, HAS_MASK=launch.mask is not None, **tiles, **launch.pads,
    )  # fmt: skip
    _entmax_threshold_kernel[(rows,)](
        launch.row, y, pmax, pn, c0, top, *rs, h, lq, launch.lk, splits, rows,
        POWER=launch.power, STEPS=steps, CHUNK=THRESHOLD_CHUNK, num_warps=THRESHOLD_WARPS,
    )  # fmt: skip
    _entmax_split_kernel[grid](
        v, launch.row, y, c0, top, part, partu, pz, pzu, launch.support,
        *v.stride(), *rs, *part.stride()[1:],
        h, launch.group, lq, launch.lk, dv, part.stride(0), rows, per,
        POWER=launch.power, DV_PAD=launch.pads["DV_PAD"], **tiles,
    )  # fmt: skip
    _entmax_combine_kernel[(blocks, b * h)](
        part, partu, pz, pzu, out, r, z, *part.stride(), *out.stride(),
        h, lq, dv, splits, rows, BLOCK_M=SPLIT_BLOCK_M, DV_PAD=launch.pads["DV_PAD"],
    )  # fmt: skip


#: Newton passes of the α-entmax threshold, by α: from τ = −1 they reached float32 rounding of
#: the weights (against 200 bisection steps in float64) within 10 passes for sparsemax at n =
#: 4,096 with flat rows (scores ~0.05, supports of thousands of keys) and within 6 for α = 1.5,
#: 1.3 and 1.1 at scores from 0.05 to 100; a margin on top for longer rows. A tensor α (per
#: head or row) takes the most, sparsemax's
ENTMAX_STEPS = {2.0: 14}


ENTMAX_STEPS_DEFAULT = 10


#: Passes for a tensor α, never read on the host, so any α of the registry's range [1.01, 2.5]
#: (above 2 Newton on G slows down where a key enters the support): 14 reached float32 rounding
#: for heads at 1.01 and 2.5 on causal rows of 40 keys in the interpreter
#: (tests/paths/test_triton.py); 24 leaves a margin for long rows, and the passes stop once no
#: row's τ moves, so it costs only rows that need it
ENTMAX_STEPS_TENSOR = 24


class TritonEntmax(torch.autograd.Function):
    """α-entmax attention (α in (1, 2], a number or per head/row) of y = c1·s − max c1·s with
    the row pair ``row`` = (c1, e) ``[B|1, H|1, Lq|1, 2]``, c1 = (α−1)·θ and e = 1/(α−1) (θ = 1,
    or ASEntmax's scale; both differentiable), through `_entmax_forward_kernel` and the shared
    backward kernels (``MAP`` ``entmax``, visiting only the block pairs of the forward's block
    support): dL/ds = θ·u·(dP − r), u = [y − τ]_+^{e−1}, r_i = Σ_j u_ij·g_ij / Σ_j u_ij =
    dO_i·(Σ_j u_ij·v_j / Σ_j u_ij) from the forward's second output; dL/dc1_i = Σ_j
    dL/dy_ij·s_ij and dL/de_i (`entmax_exponent_grad`). ``power``: e when it is 1, 2 or 3 for
    every row (the kernels' cheaper powers), else 0."""

    @staticmethod
    def forward(ctx, q, k, v, row, power, steps, masking, scale, blocks):
        q, k, v = unit_last(q), unit_last(k), unit_last(v)
        launch = Launch("entmax", True, q, k, v, row, masking, scale, float(power), blocks)
        out = torch.empty(
            launch.b, launch.h, launch.lq, launch.dv, dtype=torch.float32, device=q.device
        )
        r = torch.empty_like(out)
        c0, z = launch.rows(q.device), launch.rows(q.device)
        mask, rs, ms = launch.common()
        sup = launch.support_table(q.device)
        bm, bn = launch.blocks
        switches = launch.switches()
        del switches["MAP"], switches["NORMALISED"], switches["SHIFT_ABOVE"]
        splits = key_splits(launch)
        launch.splits = splits
        if splits > 1:
            _split_forward(launch, q, k, v, out, r, c0, z, steps, splits)
        else:
            _entmax_forward_kernel[(triton.cdiv(launch.lq, bm), launch.b * launch.h)](
                q, k, v, launch.row, mask, out, r, c0, z, sup,
                *q.stride(), *k.stride(), *v.stride(), *rs, *ms, *out.stride(),
                launch.h, launch.group, launch.lq, launch.lk, launch.d, launch.dv,
                launch.offset, launch.scale, STEPS=steps, BLOCK_M=bm, BLOCK_N=bn, **switches,
            )  # fmt: skip
        ctx.save_for_backward(q, k, v, row, r, c0, z)
        ctx.launch = launch
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, g):
        q, k, v, row, r, c0, z = ctx.saved_tensors
        launch = ctx.launch
        want_row = ctx.needs_input_grad[3]
        g = unit_last(g.to(v.dtype))
        dq, dk, dv, drow = backward(launch, q, k, v, g, want_row, r, c0, z)
        if drow is not None:
            drow = drow.to(row.dtype).sum_to_size(row.shape)
        return dq, dk, dv, drow, None, None, None, None, None


def entmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masking: Masking,
    scale: float,
    alpha: float | Tensor,
    theta: Tensor | None = None,
    blocks: tuple[int, int] | None = None,
) -> Tensor:
    """α-entmax attention ``[B, H, Lq, Dv]`` in q's dtype of θ·(s − max s): α a number in
    [1.01, 2] (2: sparsemax) or a tensor in [1.01, 2.5] (never read on the host) broadcast to
    ``[B, H, Lq, 1]`` (per head: ``[1, H, 1, 1]``; differentiable), θ ``[B|1, H|1, Lq|1, 1]``
    (None: 1; differentiable)."""
    if torch.is_tensor(alpha):
        a = alpha.to(torch.float32)
        power, steps = 0, ENTMAX_STEPS_TENSOR
    else:
        a = torch.full((), float(alpha), dtype=torch.float32, device=q.device)  # no host copy
        e = 1.0 / (float(alpha) - 1.0)
        power = int(e) if e in (1.0, 2.0, 3.0) else 0
        steps = ENTMAX_STEPS.get(float(alpha), ENTMAX_STEPS_DEFAULT)
    a = a.reshape((1,) * (4 - a.dim()) + tuple(a.shape)) if a.dim() < 4 else a
    c1 = a - 1.0 if theta is None else theta.to(torch.float32) * (a - 1.0)
    e = 1.0 / (a - 1.0)
    c1, e = torch.broadcast_tensors(c1, e)
    row = torch.cat([c1, e], -1)
    return TritonEntmax.apply(q, k, v, row, power, steps, masking, scale, blocks)
