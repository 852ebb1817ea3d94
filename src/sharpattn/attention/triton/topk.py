"""Top-k attention on CUDA (hardmax: k = 1): each row's k largest scores merged block by block,
then softmax on the kept keys; the backward is `template`'s with ``MAP = "topk"``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..masking import Masking
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
def _block_top(s, K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The K largest of each row of ``s`` [M, BLOCK_N] (BLOCK_N >= K, both powers of 2), in
    ascending order: for K <= 8 the row maximum taken K times (each time the first one
    removed), else a sort and its last K."""
    if K <= 8:
        cols = tl.arange(0, BLOCK_N)[None, :]
        slot = tl.arange(0, K)[None, :]
        x = tl.zeros([s.shape[0], K], dtype=tl.float32) - float("inf")
        for r in tl.static_range(K):
            at = tl.argmax(s, 1)
            x = tl.where(slot == K - 1 - r, tl.max(s, 1)[:, None], x)
            s = tl.where(cols == at[:, None], -float("inf"), s)
        return x
    x = tl.sort(s)
    if BLOCK_N > K:
        x = tl.reshape(x, [x.shape[0], BLOCK_N // K, K])
        last = tl.arange(0, BLOCK_N // K)[None, :, None] == BLOCK_N // K - 1
        x = tl.max(tl.where(last, x, -float("inf")), 1)
    return x


@triton.jit
def _threshold(top, top_k, K: tl.constexpr):
    """(τ, how many of the top k tie at τ, m) [M] of each row's K largest allowed scores
    ``top`` [M, K], descending: τ the ``top_k``-th largest (−inf: fewer keys, keep every one),
    m the largest (0 where the row sees no key)."""
    rank = tl.arange(0, K)[None, :]
    tau = tl.max(tl.where(rank == top_k - 1, top, -float("inf")), 1)
    need = tl.sum(((top == tau[:, None]) & (rank < top_k)).to(tl.float32), 1)
    m = tl.max(top, 1)
    return tau, need, tl.where(m == -float("inf"), 0.0, m)


@triton.jit
def _kept(s, keep, offs_n, tau, need, ties, last):
    """(kept [M, N], the ties at τ met so far, the last kept tie's key index) after one key
    block: the allowed keys above τ and, in key order, the ties at τ while fewer than ``need``
    were met (``ties``: those met in the blocks before)."""
    eq = keep & (s == tau[:, None])
    order = ties[:, None] + tl.cumsum(eq.to(tl.float32), 1)
    tie_kept = eq & (order <= need[:, None])
    last = tl.maximum(last, tl.max(tl.where(tie_kept, offs_n[None, :].to(tl.float32), -1.0), 1))
    kept = keep & ((s > tau[:, None]) | tie_kept)
    return kept, ties + tl.sum(eq.to(tl.float32), 1), last


@triton.jit
def _kept_sums(
    q, k_ptr, v_ptr, mask_ptr, sup,
    skb, skh, skn, skd, svb, svh, svn, svd, smb, smh, smm, smn,
    b, h, hk, offs_m, offs_d, offs_e, lq, lk, d, dv, offset, scale,
    lo, hi, tau, need, m, ties,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DV_PAD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The output pass over keys ``lo``-``hi`` (`_kept` from ``ties``, the ties at τ met
    before): Σ w·v and Σ w over the kept keys, w = exp(s − m), the last kept tie's key index
    (−1: none), and each key block's support stored at ``sup``."""
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    z = tl.zeros([BLOCK_M], dtype=tl.float32)
    last = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s, keep = block_scores(q, k_ptr, skb, skh, skn, skd, b, h, hk, offs_m, offs_n, offs_d,
                                lq, lk, d, offset, scale, mask_ptr, smb, smh, smm, smn,
                                CAUSAL, HAS_MASK, PRECISION)  # fmt: skip
        kept, ties, last = _kept(s, keep, offs_n, tau, need, ties, last)
        any_kept = tl.max(tl.max(kept.to(tl.float32), 1), 0)
        tl.store(sup + start_n // BLOCK_N, any_kept)
        if any_kept > 0.0:
            w = tl.where(kept, tl.exp(tl.minimum(s - m[:, None], 0.0)), 0.0)
            z += tl.sum(w, 1)
            v = tile(v_ptr, svb, svh, svn, svd, b, hk, offs_n, offs_e, lk, dv)
            acc += tl.dot(w.to(v.dtype), v, input_precision=PRECISION)
    return acc, z, last


@triton.jit
def _topk_forward_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, m_ptr, tau_ptr, last_ptr, sup_ptr,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    smb, smh, smm, smn,
    sob, soh, som, sod,
    heads, group, lq, lk, d, dv, offset, scale, top_k,
    K: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Top-k attention of one block of query rows: a pass that keeps each row's K largest
    allowed scores (the block's top K merged into the running ones: the elementwise maximum of
    one list descending and the other ascending holds the K largest of both, then a sort), so
    τ = the ``top_k``-th largest and how many of the top k tie at τ; then an output pass:
    softmax over the kept keys (above τ, and the first ties at τ in key order). Writes out,
    lse, τ and the key index of the last kept tie (−1: none) per row, and the block support
    ``sup`` [B·H, query blocks, key blocks]: 1 where the block holds a kept key, else 0 (the
    backward visits those blocks only)."""
    start_m, b, h, hk, offs_m, offs_d, offs_e, in_m, q = query_block(
        q_ptr, sqb, sqh, sqm, sqd, heads, group, lq, d, BLOCK_M, D_PAD, DV_PAD
    )
    hi = lk
    if CAUSAL:
        hi = tl.minimum(lk, start_m + BLOCK_M + offset)
    top = tl.zeros([BLOCK_M, K], dtype=tl.float32) - float("inf")
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s, keep = block_scores(q, k_ptr, skb, skh, skn, skd, b, h, hk, offs_m, offs_n, offs_d,
                                lq, lk, d, offset, scale, mask_ptr, smb, smh, smm, smn,
                                CAUSAL, HAS_MASK, PRECISION)  # fmt: skip
        new = _block_top(tl.where(keep, s, -float("inf")), K, BLOCK_N)  # ascending
        top = tl.sort(tl.maximum(top, new), descending=True)
    tau, need, m = _threshold(top, top_k, K)
    sup = support_row(sup_ptr, lq, lk, BLOCK_M, BLOCK_N)
    ties = tl.zeros([BLOCK_M], dtype=tl.float32)  # ties at τ met so far
    acc, z, last = _kept_sums(q, k_ptr, v_ptr, mask_ptr, sup,
                              skb, skh, skn, skd, svb, svh, svn, svd, smb, smh, smm, smn,
                              b, h, hk, offs_m, offs_d, offs_e, lq, lk, d, dv, offset, scale,
                              0, hi, tau, need, m, ties,
                              CAUSAL, HAS_MASK, BLOCK_M, BLOCK_N, DV_PAD, PRECISION)  # fmt: skip
    acc = acc / tl.where(z > 0.0, z, 1.0)[:, None]
    rows = b * heads * lq + h * lq + offs_m
    tl.store(m_ptr + rows, tl.where(z > 0.0, m + tl.log(tl.where(z > 0.0, z, 1.0)), 0.0), mask=in_m)
    tl.store(tau_ptr + rows, tau, mask=in_m)
    tl.store(last_ptr + rows, last, mask=in_m)
    tl.store(
        out_ptr + b * sob + h * soh + offs_m[:, None] * som + offs_e[None, :] * sod,
        acc,
        mask=in_m[:, None] & (offs_e[None, :] < dv),
    )


@triton.jit
def _merge(top, lst):
    """The K largest of ``top`` [M, K] (descending) and ``lst`` [M, K] (ascending), descending:
    their elementwise maximum holds them (the bitonic merge's first step), sorted."""
    return tl.sort(tl.maximum(top, lst), descending=True)


@triton.jit(do_not_specialize=["heads", "group", "lq", "lk", "d", "split_rows", "split_keys"])
def _topk_lists_kernel(
    q_ptr, k_ptr, mask_ptr, list_ptr,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    smb, smh, smm, smn,
    heads, group, lq, lk, d, offset, scale, split_rows, split_keys,
    K: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Decoding, the first launch (`_split_forward`): each row's K largest allowed scores among
    the ``split_keys`` keys of split ``program_id(2)``, descending (−inf where it has fewer),
    at ``list_ptr`` (contiguous ``[splits, B, H, Lq, K]``, ``split_rows`` = B·H·Lq rows a
    split)."""
    start_m, b, h, hk, offs_m, offs_d, offs_e, in_m, q = query_block(
        q_ptr, sqb, sqh, sqm, sqd, heads, group, lq, d, BLOCK_M, D_PAD, DV_PAD
    )
    hi = lk
    if CAUSAL:
        hi = tl.minimum(lk, start_m + BLOCK_M + offset)
    split = tl.program_id(2)
    lo = split * split_keys
    hi = tl.minimum(hi, lo + split_keys)
    top = tl.zeros([BLOCK_M, K], dtype=tl.float32) - float("inf")
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s, keep = block_scores(q, k_ptr, skb, skh, skn, skd, b, h, hk, offs_m, offs_n, offs_d,
                                lq, lk, d, offset, scale, mask_ptr, smb, smh, smm, smn,
                                CAUSAL, HAS_MASK, PRECISION)  # fmt: skip
        top = _merge(top, _block_top(tl.where(keep, s, -float("inf")), K, BLOCK_N))
    rows = split * split_rows + b * heads * lq + h * lq + offs_m
    at = list_ptr + rows[:, None] * K + tl.arange(0, K)[None, :]
    tl.store(at, top, mask=in_m[:, None])


@triton.jit(do_not_specialize=["heads", "group", "lq", "lk", "d", "dv", "split_rows", "split_keys"])
def _topk_split_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, list_ptr, part_ptr, pz_ptr, plast_ptr, m_ptr, tau_ptr,
    sup_ptr,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    smb, smh, smm, smn,
    spb, sph, spm, spd,
    heads, group, lq, lk, d, dv, offset, scale, top_k, splits, split_out, split_rows,
    split_keys,
    K: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Decoding, the second launch: the program of split ``program_id(2)`` merges every
    split's list (`_topk_lists_kernel`) into the row's K largest, so τ, the ties at τ the top
    k take and the largest score m (the same in every program of the row), counts the ties at
    τ in the earlier splits' lists (a split holding more ties than its list shows has at least
    as many in its list as the top k take, so the count that matters is exact), then walks its
    own keys as the unsplit kernel's output pass does: partial Σ w·v (float32 ``[splits, B,
    H, Lq, Dv]``, ``split_out`` apart), Σ w and the last kept tie's key index (``[splits, B,
    H, Lq]``, ``split_rows`` apart), its key blocks' support; split 0 stores m and τ."""
    start_m, b, h, hk, offs_m, offs_d, offs_e, in_m, q = query_block(
        q_ptr, sqb, sqh, sqm, sqd, heads, group, lq, d, BLOCK_M, D_PAD, DV_PAD
    )
    split = tl.program_id(2)
    rows = b * heads * lq + h * lq + offs_m
    rank = tl.arange(0, K)[None, :]
    top = tl.zeros([BLOCK_M, K], dtype=tl.float32) - float("inf")
    for other in range(0, splits):  # each list loaded ascending
        at = list_ptr + (other * split_rows + rows)[:, None] * K + (K - 1 - rank)
        top = _merge(top, tl.load(at, mask=in_m[:, None], other=-float("inf")))
    tau, need, m = _threshold(top, top_k, K)
    ties = tl.zeros([BLOCK_M], dtype=tl.float32)  # ties at τ in the earlier splits
    for other in range(0, split):
        at = list_ptr + (other * split_rows + rows)[:, None] * K + rank
        lst = tl.load(at, mask=in_m[:, None], other=-float("inf"))
        ties += tl.sum((lst == tau[:, None]).to(tl.float32), 1)
    hi = lk
    if CAUSAL:
        hi = tl.minimum(lk, start_m + BLOCK_M + offset)
    lo = split * split_keys
    hi = tl.minimum(hi, lo + split_keys)
    sup = support_row(sup_ptr, lq, lk, BLOCK_M, BLOCK_N)
    acc, z, last = _kept_sums(q, k_ptr, v_ptr, mask_ptr, sup,
                              skb, skh, skn, skd, svb, svh, svn, svd, smb, smh, smm, smn,
                              b, h, hk, offs_m, offs_d, offs_e, lq, lk, d, dv, offset, scale,
                              lo, hi, tau, need, m, ties,
                              CAUSAL, HAS_MASK, BLOCK_M, BLOCK_N, DV_PAD, PRECISION)  # fmt: skip
    tl.store(pz_ptr + split * split_rows + rows, z, mask=in_m)
    tl.store(plast_ptr + split * split_rows + rows, last, mask=in_m)
    where = b * spb + h * sph + offs_m[:, None] * spm + offs_e[None, :] * spd
    tl.store(part_ptr + split * split_out + where, acc, mask=in_m[:, None] & (offs_e[None, :] < dv))
    if split == 0:
        tl.store(m_ptr + rows, m, mask=in_m)
        tl.store(tau_ptr + rows, tau, mask=in_m)


@triton.jit(do_not_specialize=["heads", "lq", "dv", "splits", "split_rows"])
def _topk_combine_kernel(
    part_ptr, pz_ptr, plast_ptr, out_ptr, lse_ptr, last_ptr,
    sps, spb, sph, spm, spd,
    sob, soh, som, sod,
    heads, lq, dv, splits, split_rows,
    BLOCK_M: tl.constexpr, DV_PAD: tl.constexpr,
):  # fmt: skip
    """Decoding, the last launch: out = Σ_s acc_s / Σ_s Z_s (every split weighed against the
    same m), lse = m + log Z (read from ``lse_ptr``, where the second launch stored m), and
    the last kept tie, as the unsplit kernel stores them."""
    b, h, offs_m, offs_e, in_m, inside, rows = combine_block(heads, lq, dv, BLOCK_M, DV_PAD)
    part_ptr += b * spb + h * sph + offs_m[:, None] * spm + offs_e[None, :] * spd
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    z = tl.zeros([BLOCK_M], dtype=tl.float32)
    last = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0
    for split in range(0, splits):
        acc += tl.load(part_ptr + split * sps, mask=inside, other=0.0)
        z += tl.load(pz_ptr + split * split_rows + rows, mask=in_m, other=0.0)
        last = tl.maximum(
            last, tl.load(plast_ptr + split * split_rows + rows, mask=in_m, other=-1.0)
        )
    acc = acc / tl.where(z > 0.0, z, 1.0)[:, None]
    m = tl.load(lse_ptr + rows, mask=in_m, other=0.0)
    tl.store(
        lse_ptr + rows, tl.where(z > 0.0, m + tl.log(tl.where(z > 0.0, z, 1.0)), 0.0), mask=in_m
    )
    tl.store(last_ptr + rows, last, mask=in_m)
    tl.store(
        out_ptr + b * sob + h * soh + offs_m[:, None] * som + offs_e[None, :] * sod,
        acc,
        mask=inside,
    )


def _split_forward(launch: Launch, q, k, v, out, lse, tau, last, width: int, top_k, splits):
    """The forward of a decoding call in three launches: each split's K largest scores per row
    (`_topk_lists_kernel`), each split's weighted sums against the merged lists
    (`_topk_split_kernel`), then `_topk_combine_kernel` into ``out``, lse, τ and the last kept
    tie. Query rows in blocks of `SPLIT_BLOCK_M`, keys in the launch's blocks."""
    b, h, lq, dv = launch.b, launch.h, launch.lq, launch.dv
    bn = launch.blocks[1]
    per = triton.cdiv(triton.cdiv(launch.lk, bn), splits) * bn  # keys per split
    lists = torch.empty(splits, b, h, lq, width, dtype=torch.float32, device=q.device)
    part = torch.empty(splits, b, h, lq, dv, dtype=torch.float32, device=q.device)
    pz, plast = (torch.empty(splits, b, h, lq, dtype=torch.float32, device=q.device) for _ in "zl")
    mask, _, ms = launch.common()
    blocks = triton.cdiv(lq, SPLIT_BLOCK_M)
    sizes = (h, launch.group, lq, launch.lk, launch.d)
    common = dict(K=width, CAUSAL=launch.causal, HAS_MASK=launch.mask is not None,
                  BLOCK_M=SPLIT_BLOCK_M, BLOCK_N=bn, PRECISION=launch.precision, **launch.pads)  # fmt: skip
    _topk_lists_kernel[(blocks, b * h, splits)](
        q, k, mask, lists, *q.stride(), *k.stride(), *ms,
        *sizes, launch.offset, launch.scale, b * h * lq, per, **common,
    )  # fmt: skip
    _topk_split_kernel[(blocks, b * h, splits)](
        q, k, v, mask, lists, part, pz, plast, lse, tau, launch.support,
        *q.stride(), *k.stride(), *v.stride(), *ms, *part.stride()[1:],
        *sizes, dv, launch.offset, launch.scale, int(top_k), splits, part.stride(0),
        b * h * lq, per, **common,
    )  # fmt: skip
    _topk_combine_kernel[(blocks, b * h)](
        part, pz, plast, out, lse, last, *part.stride(), *out.stride(),
        h, lq, dv, splits, b * h * lq, BLOCK_M=SPLIT_BLOCK_M, DV_PAD=launch.pads["DV_PAD"],
    )  # fmt: skip


class TritonTopk(torch.autograd.Function):
    """Top-k attention (softmax over each row's ``top_k`` largest allowed scores, ties in key
    order) through `_topk_forward_kernel` and the shared backward kernels (``MAP`` ``topk``:
    softmax's gradient on the kept keys, found again from τ and the last kept tie)."""

    @staticmethod
    def forward(ctx, q, k, v, top_k, masking, scale, blocks):
        q, k, v = unit_last(q), unit_last(k), unit_last(v)
        zero = q.new_zeros(1, 1, 1, 1)
        launch = Launch("topk", True, q, k, v, zero, masking, scale, 1.0, blocks)
        bm, bn = launch.blocks
        width = max(2, triton.next_power_of_2(top_k))
        if width > bn:  # the merge needs a block of keys at least as wide as the kept list
            bn = width
        out = torch.empty(
            launch.b, launch.h, launch.lq, launch.dv, dtype=torch.float32, device=q.device
        )
        lse, tau, last = (launch.rows(q.device) for _ in range(3))
        mask, _, ms = launch.common()
        launch.blocks = (bm, bn)  # the backward walks the forward's blocks (its support)
        sup = launch.support_table(q.device)
        splits = key_splits(launch)
        launch.splits = splits
        if splits > 1:
            _split_forward(launch, q, k, v, out, lse, tau, last, width, top_k, splits)
        else:
            _topk_forward_kernel[(triton.cdiv(launch.lq, bm), launch.b * launch.h)](
                q, k, v, mask, out, lse, tau, last, sup,
                *q.stride(), *k.stride(), *v.stride(), *ms, *out.stride(),
                launch.h, launch.group, launch.lq, launch.lk, launch.d, launch.dv,
                launch.offset, launch.scale, int(top_k),
                K=width, CAUSAL=launch.causal, HAS_MASK=launch.mask is not None,
                BLOCK_M=bm, BLOCK_N=bn, PRECISION=launch.precision, **launch.pads,
            )  # fmt: skip
        launch.row = tau.unsqueeze(-1)  # the backward reads τ as the row tensor
        ctx.save_for_backward(q, k, v, out, lse, last)
        ctx.launch, ctx.top_k = launch, top_k
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse, last = ctx.saved_tensors
        g = unit_last(g.to(v.dtype))
        dq, dk, dv, _ = backward(ctx.launch, q, k, v, g, False, out, lse, last)
        if ctx.top_k == 1:  # one weight of 1: no gradient in the scores (not rounding's)
            dq, dk = torch.zeros_like(dq), torch.zeros_like(dk)
        return dq, dk, dv, None, None, None, None


def topk_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masking: Masking,
    scale: float,
    top_k: int,
    blocks: tuple[int, int] | None = None,
) -> Tensor:
    """Top-k attention ``[B, H, Lq, Dv]`` in q's dtype (``top_k`` = 1: hardmax, the first
    arg-max); ``top_k`` up to `TOPK_MAX`."""
    return TritonTopk.apply(q, k, v, int(top_k), masking, scale, blocks)


#: the largest ``top_k`` the kernel keeps per row (a list of next_power_of_2(top_k) scores)
TOPK_MAX = 128
