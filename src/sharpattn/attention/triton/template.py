"""The flash-style skeleton every map's Triton kernels share (the maps' formulas: `maps`):
the block loads, masks, the forward kernel and the two backward kernels, and their launch.

Each program holds a block of query rows (or of keys, for dk and dv) and walks the other
side's blocks, never forming the ``[Lq, Lk]`` score matrix. s = scale·q·kᵀ in float32 (the
products accumulate in float32 for every input dtype; float32 inputs multiply in IEEE float32,
not TF32), out_i = Σ_j w_ij·v_j with w cast to v's dtype, as the naive path does (normalised:
Σ_j u_ij·v_j in float32, divided by Z_i at the end); the forward of a normalised map stores m
and Z per row for the backward. Backward (FlashAttention-2's structure): dP = dO·vᵀ, ds from
`maps.map_grad`; one kernel over key blocks gives dv_j = Σ_i w_ij·dO_i and dk_j = scale·Σ_i
ds_ij·q_i, looping over the query blocks that see the keys and over the query heads of the
key's group (so GQA needs no atomic adds and no float32 scratch per query head: each program
owns its dk and dv rows, deterministic); one kernel over query blocks gives dq_i = scale·Σ_j
ds_ij·k_j and, where the kernel record says ``row_grad`` (sigmoid's learnable bias), the row
sums Σ_j ds_ij (PyTorch sums them to the bias's shape).

Decoding (split-K, "flash-decoding"): a call with few query rows against many keys (`key_splits`)
would be only B·H programs; its forward cuts the keys into splits of whole key blocks, a third
grid axis, each program writing partial sums to float32 scratch, and `_combine_kernel` adds them
up: a sum for the element-wise maps; for the normalised ones each split's (acc, m, Z) rescaled
to the largest m with the map's `map_factor`, then divided by Z, m and Z stored as the unsplit
forward stores them (the backward is the same). Only the order of the float32 sums changes.

Masks are computed in the kernel: the causal edge j <= i + (Lk − Lq) from indices (blocks wholly
above it are never visited), a user boolean mask read through its broadcast strides (stride 0,
never densified), the row tensor likewise. Rows that see no key give 0 and zero gradients.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...normalizers.families import Kernel, TileMaths
from ..masking import Masking
from .maps import (
    entmax_exponent_grad,
    map_factor,
    map_grad,
    map_normalised,
    map_reference,
    map_weight,
    topk_kept,
)

Tensor = torch.Tensor


@triton.jit
def visible(
    offs_m,
    offs_n,
    lq,
    lk,
    offset,
    mask_ptr,
    smb,
    smh,
    smm,
    smn,
    b,
    h,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    """[M, N] True where query offs_m sees key offs_n (in range, causal edge, user mask)."""
    keep = (offs_m[:, None] < lq) & (offs_n[None, :] < lk)
    if CAUSAL:
        keep = keep & (offs_n[None, :] <= offs_m[:, None] + offset)
    if HAS_MASK:
        ptrs = mask_ptr + b * smb + h * smh + offs_m[:, None] * smm + offs_n[None, :] * smn
        keep = keep & (tl.load(ptrs, mask=keep, other=0) != 0)
    return keep


@triton.jit
def tile(ptr, sb, sh, sr, sc, b, h, offs_r, offs_c, n_r, n_c):
    """The block ``[len(offs_r), len(offs_c)]`` of the ``[B, H, rows, cols]`` tensor at ``ptr``
    (strides sb, sh, sr, sc) at batch b and head h; 0 outside ``n_r`` rows and ``n_c`` columns."""
    return tl.load(
        ptr + b * sb + h * sh + offs_r[:, None] * sr + offs_c[None, :] * sc,
        mask=(offs_r[:, None] < n_r) & (offs_c[None, :] < n_c),
        other=0.0,
    )


@triton.jit
def query_block(q_ptr, sqb, sqh, sqm, sqd, heads, group, lq, d,
                 BLOCK_M: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr):  # fmt: skip
    """What a program over a block of query rows starts from: (start_m, b, h, the query head's
    key/value head hk (GQA), offs_m, offs_d, offs_e, in_m, the block of q [M, D])."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    hk = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_e = tl.arange(0, DV_PAD)
    in_m = offs_m < lq
    q = tile(q_ptr, sqb, sqh, sqm, sqd, b, h, offs_m, offs_d, lq, d)
    return start_m, b, h, hk, offs_m, offs_d, offs_e, in_m, q


@triton.jit
def combine_block(heads, lq, dv, BLOCK_M: tl.constexpr, DV_PAD: tl.constexpr):
    """What a program of a split forward's later launches starts from, over a block of query
    rows of one (batch, head): (b, h, offs_m, offs_e, in_m, inside [M, DV_PAD], rows: the
    rows' places in a contiguous [B, H, Lq])."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    offs_e = tl.arange(0, DV_PAD)
    in_m = offs_m < lq
    inside = in_m[:, None] & (offs_e[None, :] < dv)
    return b, h, offs_m, offs_e, in_m, inside, b * heads * lq + h * lq + offs_m


@triton.jit
def block_scores(q, k_ptr, skb, skh, skn, skd, b, h, hk, offs_m, offs_n, offs_d, lq, lk, d,
                  offset, scale, mask_ptr, smb, smh, smm, smn,
                  CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """(s, keep) [M, N] of one key block: s = scale·q·kᵀ (float32) and which keys each row
    sees (`visible`); kᵀ is loaded [D, N]."""
    k = tl.load(
        k_ptr + b * skb + hk * skh + offs_n[None, :] * skn + offs_d[:, None] * skd,
        mask=(offs_n[None, :] < lk) & (offs_d[:, None] < d),
        other=0.0,
    )
    s = tl.dot(q, k, input_precision=PRECISION) * scale
    keep = visible(
        offs_m, offs_n, lq, lk, offset, mask_ptr, smb, smh, smm, smn, b, h, CAUSAL, HAS_MASK
    )
    return s, keep


@triton.jit
def _rows(row_ptr, srb, srh, srm, m_ptr, z_ptr, dd_ptr, b, h, heads, lq, offs_m, p,
          MAP: tl.constexpr, NORMALISED: tl.constexpr):  # fmt: skip
    """The backward's per-row values [M, 1] of query rows offs_m of head h: the element-wise
    row tensor, or the normalised m, Z (1 where 0: rows with nothing to weigh) and D = dO·out
    (contiguous [B, H, Lq]); and the exponent: ``p``, or α-entmax's e = 1/(α−1) per row (the
    row pair's second entry)."""
    in_m = offs_m < lq
    if NORMALISED:
        rows = b * heads * lq + h * lq + offs_m
        m = tl.load(m_ptr + rows, mask=in_m, other=0.0)[:, None]
        z = tl.load(z_ptr + rows, mask=in_m, other=1.0)[:, None]
        if MAP != "topk":  # top-k's z is the last kept tie's key index
            z = tl.where(z > 0.0, z, 1.0)
        dd = tl.load(dd_ptr + rows, mask=in_m, other=0.0)[:, None]
        row = m
        at = row_ptr + b * srb + h * srh + offs_m * srm
        if MAP == "entmax":  # and c1 and e per row
            row = tl.load(at, mask=in_m, other=1.0)[:, None]
            p = tl.load(at + 1, mask=in_m, other=1.0)[:, None]
        elif MAP == "topk":  # and τ per row
            row = tl.load(at, mask=in_m, other=1.0)[:, None]
    else:
        row = tl.load(row_ptr + b * srb + h * srh + offs_m * srm, mask=in_m, other=1.0)[:, None]
        m = row
        z = row
        dd = row
    return row, m, z, dd, p


@triton.jit
def support_row(sup_ptr, lq, lk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where a forward program's query block starts in the block support [B·H, query blocks,
    key blocks] (one entry per key block from there)."""
    return sup_ptr + (tl.program_id(1) * tl.cdiv(lq, BLOCK_M) + tl.program_id(0)) * tl.cdiv(
        lk, BLOCK_N
    )


@triton.jit
def has_support(
    sup_ptr,
    b,
    h,
    heads,
    start_m,
    start_n,
    lq,
    lk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUPPORT: tl.constexpr,
):
    """Whether the backward visits the block pair (query rows from start_m, keys from start_n):
    always, or (SUPPORT) where the forward's block support says a weight may be nonzero."""
    go = True
    if SUPPORT:
        at = ((b * heads + h) * tl.cdiv(lq, BLOCK_M) + start_m // BLOCK_M) * tl.cdiv(lk, BLOCK_N)
        go = tl.load(sup_ptr + at + start_n // BLOCK_N) > 0.0
    return go


@triton.jit
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, row_ptr, mask_ptr, out_ptr, m_ptr, z_ptr,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    srb, srh, srm,
    smb, smh, smm, smn,
    sob, soh, som, sod,
    heads, group, lq, lk, d, dv, offset, scale, p, split_out, split_rows, split_keys,
    MAP: tl.constexpr, NORMALISED: tl.constexpr, POWER: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SHIFT_ABOVE: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """out of one block of query rows; the normalised methods also write each row's reference
    m and sum Z (contiguous [B, H, Lq], float32) for the backward. With SPLIT (decoding,
    `key_splits`) the program walks only the ``split_keys`` keys of split ``program_id(2)`` and
    writes its partial sums, undivided, at ``split_out`` (out) and ``split_rows`` (m, Z) times
    the split past the pointers, in float32 (softmax's m stays −inf where the split saw no
    key); `_combine_kernel` adds them up."""
    start_m, b, h, hk, offs_m, offs_d, offs_e, in_m, q = query_block(
        q_ptr, sqb, sqh, sqm, sqd, heads, group, lq, d, BLOCK_M, D_PAD, DV_PAD
    )
    row = tl.load(row_ptr + b * srb + h * srh + offs_m * srm, mask=offs_m < lq, other=1.0)
    row = row[:, None]
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    m = tl.zeros([BLOCK_M], dtype=tl.float32)  # the running row reference (normalised)
    if MAP == "softmax":  # the largest allowed score so far: none yet
        m = m - float("inf")
    z = tl.zeros([BLOCK_M], dtype=tl.float32)  # Σ_j a_ij relative to m
    hi = lk
    if CAUSAL:  # keys past the block's last row's causal edge are hidden from every row
        hi = tl.minimum(lk, start_m + BLOCK_M + offset)
    lo = 0
    if SPLIT:  # this split's keys only; its partial sums at its own place in the scratch
        split = tl.program_id(2)
        lo = split * split_keys
        hi = tl.minimum(hi, lo + split_keys)
        out_ptr += split * split_out
        m_ptr += split * split_rows
        z_ptr += split * split_rows
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s, keep = block_scores(q, k_ptr, skb, skh, skn, skd, b, h, hk, offs_m, offs_n, offs_d,
                                lq, lk, d, offset, scale, mask_ptr, smb, smh, smm, smn,
                                CAUSAL, HAS_MASK, PRECISION)  # fmt: skip
        if MAP == "softmax":  # flash attention; m = −inf until a row sees a key
            m_new = tl.maximum(m, map_reference(s, keep, MAP))
            m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
            f = tl.exp(m - m_use)  # 0 while nothing was seen
            w, a = map_normalised(s, m_use[:, None], p, MAP, POWER, SHIFT_ABOVE)
            z = z * f + tl.sum(tl.where(keep, a, 0.0), 1)
            acc = acc * f[:, None]
            m = m_new
        elif NORMALISED:  # flash-style: the sums rescaled when m grows
            s = tl.where(keep, s, 0.0)  # disallowed scores 0: no overflow there
            m_new = tl.maximum(m, map_reference(s, keep, MAP))
            f = map_factor(m, m_new, p, MAP, POWER)
            w, a = map_normalised(s, m_new[:, None], p, MAP, POWER, SHIFT_ABOVE)
            z = z * f + tl.sum(tl.where(keep, a, 0.0), 1)
            acc = acc * f[:, None]
            m = m_new
        else:
            w, _ = map_weight(s, row, p, MAP, POWER)
        w = tl.where(keep, w, 0.0)
        v = tile(v_ptr, svb, svh, svn, svd, b, hk, offs_n, offs_e, lk, dv)
        acc += tl.dot(w.to(v.dtype), v, input_precision=PRECISION)
    if NORMALISED:
        if not SPLIT:  # (a split's sums are combined first: `_combine_kernel`)
            acc = acc / tl.where(z > 0.0, z, 1.0)[:, None]
            if MAP == "softmax":  # rows that see no key: m = 0 (and Z = 0)
                m = tl.where(m == -float("inf"), 0.0, m)
        rows = b * heads * lq + h * lq + offs_m
        tl.store(m_ptr + rows, m, mask=offs_m < lq)
        tl.store(z_ptr + rows, z, mask=offs_m < lq)
    tl.store(
        out_ptr + b * sob + h * soh + offs_m[:, None] * som + offs_e[None, :] * sod,
        acc.to(out_ptr.dtype.element_ty),
        mask=(offs_m[:, None] < lq) & (offs_e[None, :] < dv),
    )


@triton.jit
def _combine_kernel(
    part_ptr,
    pm_ptr,
    pz_ptr,
    out_ptr,
    m_ptr,
    z_ptr,
    sps,
    spb,
    sph,
    spm,
    spd,
    sob,
    soh,
    som,
    sod,
    heads,
    lq,
    dv,
    splits,
    split_rows,
    p,
    MAP: tl.constexpr,
    NORMALISED: tl.constexpr,
    POWER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DV_PAD: tl.constexpr,
):
    """out of one block of query rows from the ``splits`` partial results of the split forward
    (float32 ``[splits, B, H, Lq, Dv]`` at ``part_ptr``, strides sps, spb, sph, spm, spd; the
    normalised maps' partial m and Z contiguous ``[splits, B, H, Lq]``, ``split_rows`` apart):
    the element-wise maps' sum over the splits; the normalised maps' common reference m (the
    largest split's: the unsplit kernel's running m at its end), each split's sums rescaled to
    it with the map's own `map_factor`, out = Σ acc / Σ Z, and m and Z stored as the unsplit
    forward stores them."""
    b, h, offs_m, offs_e, in_m, inside, rows = combine_block(heads, lq, dv, BLOCK_M, DV_PAD)
    part_ptr += b * spb + h * sph + offs_m[:, None] * spm + offs_e[None, :] * spd
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    if NORMALISED:
        m = tl.zeros([BLOCK_M], dtype=tl.float32)  # as the forward's running m starts
        if MAP == "softmax":
            m = m - float("inf")
        for split in range(0, splits):
            m = tl.maximum(m, tl.load(pm_ptr + split * split_rows + rows, mask=in_m, other=0.0))
        m_use = m
        if MAP == "softmax":  # −inf: no split saw a key (every factor 0)
            m_use = tl.where(m == -float("inf"), 0.0, m)
        z = tl.zeros([BLOCK_M], dtype=tl.float32)
        for split in range(0, splits):
            ms = tl.load(pm_ptr + split * split_rows + rows, mask=in_m, other=0.0)
            f = map_factor(ms, m_use, p, MAP, POWER)
            z += f * tl.load(pz_ptr + split * split_rows + rows, mask=in_m, other=0.0)
            acc += f[:, None] * tl.load(part_ptr + split * sps, mask=inside, other=0.0)
        acc = acc / tl.where(z > 0.0, z, 1.0)[:, None]
        tl.store(m_ptr + rows, m_use, mask=in_m)
        tl.store(z_ptr + rows, z, mask=in_m)
    else:
        for split in range(0, splits):
            acc += tl.load(part_ptr + split * sps, mask=inside, other=0.0)
    tl.store(
        out_ptr + b * sob + h * soh + offs_m[:, None] * som + offs_e[None, :] * sod,
        acc.to(out_ptr.dtype.element_ty),
        mask=inside,
    )


@triton.jit
def _dkdv_kernel(
    q_ptr, k_ptr, v_ptr, row_ptr, mask_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, z_ptr, dd_ptr,
    sup_ptr,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    srb, srh, srm,
    smb, smh, smm, smn,
    sgb, sgh, sgm, sgd,
    heads, kv_heads, group, lq, lk, d, dv, offset, scale, p,
    MAP: tl.constexpr, NORMALISED: tl.constexpr, POWER: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SHIFT_ABOVE: tl.constexpr, SUPPORT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """dk, dv of one block of keys of one key/value head: every query head of its group, every
    query block that sees a key of the block (with SUPPORT, of those only the blocks where the
    forward found a weight that may be nonzero, `has_support`). dk, dv are written contiguous
    [B, Hkv, Lk, ·]."""
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b = bh // kv_heads
    hk = bh % kv_heads
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    offs_e = tl.arange(0, DV_PAD)
    k = tile(k_ptr, skb, skh, skn, skd, b, hk, offs_n, offs_d, lk, d)  # [N, D]
    v = tile(v_ptr, svb, svh, svn, svd, b, hk, offs_n, offs_e, lk, dv)  # [N, Dv]
    dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    dvacc = tl.zeros([BLOCK_N, DV_PAD], dtype=tl.float32)
    lo = 0
    if CAUSAL:  # the first row that sees key start_n: i >= start_n − offset
        lo = tl.maximum(start_n - offset, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    for g in range(0, group):
        h = hk * group + g
        for start_m in range(lo, lq, BLOCK_M):
            if has_support(
                sup_ptr, b, h, heads, start_m, start_n, lq, lk, BLOCK_M, BLOCK_N, SUPPORT
            ):
                offs_m = start_m + tl.arange(0, BLOCK_M)
                q = tile(q_ptr, sqb, sqh, sqm, sqd, b, h, offs_m, offs_d, lq, d)  # [M, D]
                do = tile(do_ptr, sgb, sgh, sgm, sgd, b, h, offs_m, offs_e, lq, dv)  # [M, Dv]
                row, m, z, dd, pr = _rows(row_ptr, srb, srh, srm, m_ptr, z_ptr, dd_ptr, b, h,
                                          heads, lq, offs_m, p, MAP, NORMALISED)  # fmt: skip
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N]
                keep = visible(
                    offs_m, offs_n, lq, lk, offset, mask_ptr, smb, smh, smm, smn, b, h, CAUSAL,
                    HAS_MASK,
                )  # fmt: skip
                if MAP == "topk":  # the kept keys: above τ, and ties at τ up to the last kept
                    keep = keep & topk_kept(s, row, z, offs_n)
                s = tl.where(keep, s, 0.0)
                dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # dO_i·v_j [M, N]
                w, ds, _ = map_grad(s, dp, row, m, z, dd, pr, MAP, NORMALISED, POWER, SHIFT_ABOVE)
                w = tl.where(keep, w, 0.0)
                dvacc += tl.dot(tl.trans(w.to(do.dtype)), do, input_precision=PRECISION)
                ds = tl.where(keep, ds, 0.0)
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    out = b * kv_heads * lk + hk * lk + offs_n  # dk, dv rows (contiguous)
    tl.store(
        dk_ptr + out[:, None] * d + offs_d[None, :],
        (dk * scale).to(dk_ptr.dtype.element_ty),
        mask=(offs_n[:, None] < lk) & (offs_d[None, :] < d),
    )
    tl.store(
        dv_ptr + out[:, None] * dv + offs_e[None, :],
        dvacc.to(dv_ptr.dtype.element_ty),
        mask=(offs_n[:, None] < lk) & (offs_e[None, :] < dv),
    )


@triton.jit
def _dq_kernel(
    q_ptr, k_ptr, v_ptr, row_ptr, mask_ptr, do_ptr, dq_ptr, drow_ptr, m_ptr, z_ptr, dd_ptr,
    sup_ptr,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    srb, srh, srm,
    smb, smh, smm, smn,
    sgb, sgh, sgm, sgd,
    heads, group, lq, lk, d, dv, offset, scale, p,
    MAP: tl.constexpr, NORMALISED: tl.constexpr, POWER: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SHIFT_ABOVE: tl.constexpr, WANT_ROW: tl.constexpr, SUPPORT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """dq of one block of query rows (and Σ_j ds_ij per row when WANT_ROW; α-entmax: dL/dc1
    and dL/de per row, `entmax_exponent_grad`); dq is written contiguous [B, H, Lq, D], the
    row sums [B, H, Lq] (α-entmax: [B, H, Lq, 2]). With SUPPORT only the key blocks where the
    forward found a weight that may be nonzero (`has_support`)."""
    start_m, b, h, hk, offs_m, offs_d, offs_e, in_m, q = query_block(
        q_ptr, sqb, sqh, sqm, sqd, heads, group, lq, d, BLOCK_M, D_PAD, DV_PAD
    )
    do = tile(do_ptr, sgb, sgh, sgm, sgd, b, h, offs_m, offs_e, lq, dv)
    row, m, z, dd, pr = _rows(
        row_ptr, srb, srh, srm, m_ptr, z_ptr, dd_ptr, b, h, heads, lq, offs_m, p, MAP, NORMALISED
    )
    dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    drow = tl.zeros([BLOCK_M], dtype=tl.float32)
    dexp = tl.zeros([BLOCK_M], dtype=tl.float32)
    hi = lk
    if CAUSAL:
        hi = tl.minimum(lk, start_m + BLOCK_M + offset)
    for start_n in range(0, hi, BLOCK_N):
        if has_support(sup_ptr, b, h, heads, start_m, start_n, lq, lk, BLOCK_M, BLOCK_N, SUPPORT):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = tile(k_ptr, skb, skh, skn, skd, b, hk, offs_n, offs_d, lk, d)  # [N, D]
            v = tile(v_ptr, svb, svh, svn, svd, b, hk, offs_n, offs_e, lk, dv)  # [N, Dv]
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            keep = visible(offs_m, offs_n, lq, lk, offset, mask_ptr, smb, smh, smm, smn, b, h,
                            CAUSAL, HAS_MASK)  # fmt: skip
            if MAP == "topk":  # the kept keys: above τ, and ties at τ up to the last kept one
                keep = keep & topk_kept(s, row, z, offs_n)
            s = tl.where(keep, s, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            w, ds, dy = map_grad(s, dp, row, m, z, dd, pr, MAP, NORMALISED, POWER, SHIFT_ABOVE)
            ds = tl.where(keep, ds, 0.0)
            if WANT_ROW:
                if MAP == "entmax":
                    dc1, de = entmax_exponent_grad(s, keep, w, dy, dp, row, m, dd)
                    drow += dc1
                    dexp += de
                else:
                    drow += tl.sum(ds, 1)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    rows = b * heads * lq + h * lq + offs_m
    tl.store(
        dq_ptr + rows[:, None] * d + offs_d[None, :],
        (dq * scale).to(dq_ptr.dtype.element_ty),
        mask=in_m[:, None] & (offs_d[None, :] < d),
    )
    if WANT_ROW:
        if MAP == "entmax":  # [B, H, Lq, 2]: (dL/dc1, dL/de)
            tl.store(drow_ptr + 2 * rows, drow, mask=in_m)
            tl.store(drow_ptr + 2 * rows + 1, dexp, mask=in_m)
        else:
            tl.store(drow_ptr + rows, drow, mask=in_m)


#: (query rows, keys) per block of the forward and the dq kernel; the dk/dv kernel uses
#: (keys, query rows) the other way round. Not tuned on a GPU yet: FlashAttention-2's Triton
#: tutorial's order of size, halved for float32 at head dims above 64 (twice the registers).
BLOCKS_16BIT = (64, 64)


BLOCKS_FLOAT32 = (32, 32)


#: decoding: the forward of a call with at most SPLIT_MAX_LQ query rows and at least
#: SPLIT_MIN_LK keys splits the keys among programs (`key_splits`): about SPLIT_PROGRAMS
#: programs (two per SM of an H200's 132, rounded), each split at least SPLIT_MIN_BLOCKS key
#: blocks long, the query rows in blocks of SPLIT_BLOCK_M (tl.dot's smallest). SPLIT_MAX_LQ <=
#: SPLIT_BLOCK_M: a split call's rows are one query block, as the top-k and entmax forwards'
#: block support (read by the backward with its own query blocks) takes them. Not tuned on a
#: GPU yet.
SPLIT_MAX_LQ = 16
SPLIT_MIN_LK = 1024
SPLIT_PROGRAMS = 256
SPLIT_MIN_BLOCKS = 4
SPLIT_BLOCK_M = 16


def pad(n: int) -> int:
    """A head dimension rounded up to a power of 2, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(n))


def default_blocks(dtype: torch.dtype, d: int, dv: int) -> tuple[int, int]:
    if dtype == torch.float32 and max(d, dv) > 64:
        return BLOCKS_FLOAT32
    return BLOCKS_16BIT


def unit_last(t: Tensor) -> Tensor:
    """``t`` with a unit stride in its last dimension (coalesced loads); other strides kept."""
    return t if t.stride(-1) == 1 else t.contiguous()


class Launch:
    """What every kernel of one call shares: sizes, strides of the broadcast tensors, switches."""

    def __init__(
        self, name, normalised, q, k, v, row, masking: Masking, scale, p, blocks, shift=0.0
    ):
        self.b, self.h, self.lq, self.d = q.shape
        self.hkv, self.lk, self.dv = k.shape[1], k.shape[2], v.shape[-1]
        self.group = self.h // self.hkv
        self.row = row.to(torch.float32).expand(self.b, self.h, self.lq, row.shape[-1])
        self.support = None  # the forward's block support, for the backward to skip blocks
        self.splits = 1  # the key splits the forward ran (`key_splits`)
        self.mask = None
        if masking.mask is not None:  # a view: uint8 of the same bytes, broadcast strides
            self.mask = masking.mask.expand(self.b, self.h, self.lq, self.lk).view(torch.uint8)
        self.causal, self.offset = masking.causal, masking.offset
        self.scale, self.p = float(scale), float(p)
        self.name, self.normalised, self.shift = name, normalised, shift
        self.row_grad = False  # whether the backward gives the row tensor's gradient
        self.power = int(self.p) if self.p in (1.0, 2.0, 3.0) else 0
        self.blocks = blocks or default_blocks(q.dtype, self.d, self.dv)
        self.pads = {"D_PAD": pad(self.d), "DV_PAD": pad(self.dv)}
        # float32 products in IEEE float32 (TF32 would cost float32 inputs 3 decimal digits)
        self.precision = "ieee" if q.dtype == torch.float32 else "tf32"

    def common(self):
        mask = self.mask if self.mask is not None else self.row  # any pointer: never read
        ms = self.mask.stride() if self.mask is not None else (0, 0, 0, 0)
        return mask, self.row.stride()[:3], ms

    def rows(self, device) -> Tensor:
        """A float32 ``[B, H, Lq]`` per-row buffer."""
        return torch.empty(self.b, self.h, self.lq, dtype=torch.float32, device=device)

    def support_table(self, device) -> Tensor:
        """The block support the entmax and top-k forward kernels write and the backward
        reads: float32 ``[B·H, query blocks, key blocks]``, zeros (blocks never visited, above
        the causal edge, have no support). n²/(64·64) entries per head at the 16-bit blocks:
        1 MiB of float32 at 32k tokens, an eighth of a bfloat16 q of head size 64."""
        bm, bn = self.blocks
        shape = (self.b * self.h, triton.cdiv(self.lq, bm), triton.cdiv(self.lk, bn))
        self.support = torch.zeros(shape, dtype=torch.float32, device=device)
        return self.support

    def switches(self):
        return dict(
            MAP=self.name,
            NORMALISED=self.normalised,
            POWER=self.power,
            CAUSAL=self.causal,
            HAS_MASK=self.mask is not None,
            SHIFT_ABOVE=self.shift,
            PRECISION=self.precision,
            **self.pads,
        )


def key_splits(launch: Launch) -> int:
    """How many splits of the keys the forward runs (1: the unsplit kernel). A decoding call
    (Lq <= `SPLIT_MAX_LQ`, Lk >= `SPLIT_MIN_LK`) would be B·H programs, each walking every key
    (on an H200's 132 SMs, 8-32 of them for a batch of one): the keys are cut into splits of
    whole key blocks, as many as bring the programs to about `SPLIT_PROGRAMS` while each split
    keeps at least `SPLIT_MIN_BLOCKS` key blocks, evened out (the last split is never more
    than one block short of the others)."""
    if launch.lq > SPLIT_MAX_LQ or launch.lk < SPLIT_MIN_LK:
        return 1
    blocks = triton.cdiv(launch.lk, launch.blocks[1])
    programs = launch.b * launch.h * triton.cdiv(launch.lq, SPLIT_BLOCK_M)
    splits = min(triton.cdiv(SPLIT_PROGRAMS, programs), blocks // SPLIT_MIN_BLOCKS)
    if splits < 2:
        return 1
    return triton.cdiv(blocks, triton.cdiv(blocks, splits))  # no split left empty


def forward(launch: Launch, q, k, v):
    """(out, m, Z): m and Z ``[B, H, Lq]`` float32 for the normalised methods, else None. Their
    out is float32 too (the backward's D = dO·out from a 16-bit out measured 4-5x the error of
    the eager path in dq, power with p = 3); the caller casts it. A decoding call may split the
    keys (`key_splits`, `_split_forward`)."""
    m = z = None
    dtype = q.dtype
    if launch.normalised:
        m, z = launch.rows(q.device), launch.rows(q.device)
        dtype = torch.float32
    out = torch.empty(launch.b, launch.h, launch.lq, launch.dv, dtype=dtype, device=q.device)
    splits = key_splits(launch)
    launch.splits = splits
    if splits > 1:
        _split_forward(launch, q, k, v, out, m, z, splits)
        return out, m, z
    mask, rs, ms = launch.common()
    bm, bn = launch.blocks
    grid = (triton.cdiv(launch.lq, bm), launch.b * launch.h)
    _forward_kernel[grid](
        q, k, v, launch.row, mask, out,
        launch.row if m is None else m, launch.row if z is None else z,  # never written
        *q.stride(), *k.stride(), *v.stride(), *rs, *ms, *out.stride(),
        launch.h, launch.group, launch.lq, launch.lk, launch.d, launch.dv, launch.offset,
        launch.scale, launch.p, 0, 0, launch.lk,
        BLOCK_M=bm, BLOCK_N=bn, SPLIT=False, **launch.switches(),
    )  # fmt: skip
    return out, m, z


def _split_forward(launch: Launch, q, k, v, out, m, z, splits: int) -> None:
    """The forward of a decoding call in two launches: `_forward_kernel` over (query blocks of
    `SPLIT_BLOCK_M` rows, B·H, ``splits``), each program writing its split's partial sums to
    float32 scratch (``[splits, B, H, Lq, Dv]``, and m and Z ``[splits, B, H, Lq]`` for the
    normalised maps), then `_combine_kernel` into ``out`` (and m, Z)."""
    b, h, lq, dv = launch.b, launch.h, launch.lq, launch.dv
    bn = launch.blocks[1]
    per = triton.cdiv(triton.cdiv(launch.lk, bn), splits) * bn  # keys per split
    part = torch.empty(splits, b, h, lq, dv, dtype=torch.float32, device=q.device)
    pm = pz = launch.row  # never written (element-wise)
    if launch.normalised:
        pm, pz = (torch.empty(splits, b, h, lq, dtype=torch.float32, device=q.device) for _ in "mz")
    mask, rs, ms = launch.common()
    bm = SPLIT_BLOCK_M
    blocks = triton.cdiv(lq, bm)
    strides = (*q.stride(), *k.stride(), *v.stride(), *rs, *ms, *part.stride()[1:])
    sizes = (h, launch.group, lq, launch.lk, launch.d, dv, launch.offset, launch.scale, launch.p)
    split = (part.stride(0), b * h * lq, per)  # split_out, split_rows, split_keys
    pointers = (q, k, v, launch.row, mask, part, pm, pz)
    grid = (blocks, b * h, splits)
    _forward_kernel[grid](
        *pointers, *strides, *sizes, *split, BLOCK_M=bm, BLOCK_N=bn, SPLIT=True, **launch.switches()
    )
    m = launch.row if m is None else m  # never written (element-wise)
    z = launch.row if z is None else z
    combine = dict(MAP=launch.name, NORMALISED=launch.normalised, POWER=launch.power)
    _combine_kernel[(blocks, b * h)](
        *(part, pm, pz, out, m, z, *part.stride(), *out.stride()),
        *(h, lq, dv, splits, b * h * lq, launch.p),
        BLOCK_M=bm,
        DV_PAD=launch.pads["DV_PAD"],
        **combine,
    )


def backward(launch: Launch, q, k, v, g, want_row: bool, out=None, m=None, z=None, glse=None):
    """(dq, dk, dv, Σ_j ds_ij per row [B, H, Lq, 1] or None; α-entmax: its (dL/dc1, dL/de)
    [B, H, Lq, 2]); with the launch's block support only the blocks it marks; the normalised methods need the
    forward's ``out``, m and Z (D_i = dO_i·out_i is taken here, one number per row); softmax
    takes the gradient of its log-sum-exp too (``glse`` [B, H, Lq, 1] or None): ∂lse_i/∂s_ij =
    w_ij, so it enters as D_i − glse_i."""
    dq = torch.empty(launch.b, launch.h, launch.lq, launch.d, dtype=q.dtype, device=q.device)
    dk = torch.empty(launch.b, launch.hkv, launch.lk, launch.d, dtype=k.dtype, device=q.device)
    dv = torch.empty(launch.b, launch.hkv, launch.lk, launch.dv, dtype=v.dtype, device=q.device)
    width = 2 if launch.name == "entmax" else 1  # α-entmax: dL/dc1 and dL/de
    drow = torch.empty(launch.b, launch.h, launch.lq, width, dtype=torch.float32, device=q.device)
    mask, rs, ms = launch.common()
    sup = launch.support if launch.support is not None else launch.row  # never read if None
    rows = (launch.row,) * 3  # any pointers: never read
    if launch.normalised:
        dd = torch.linalg.vecdot(g.to(torch.float32), out)
        if glse is not None:
            dd = dd - glse.to(torch.float32).squeeze(-1)
        rows = (m, z, dd.contiguous())
    bm, bn = launch.blocks
    sizes = (launch.group, launch.lq, launch.lk, launch.d, launch.dv, launch.offset)
    support = launch.support is not None
    _dkdv_kernel[(triton.cdiv(launch.lk, bn), launch.b * launch.hkv)](
        q, k, v, launch.row, mask, g, dk, dv, *rows, sup,
        *q.stride(), *k.stride(), *v.stride(), *rs, *ms, *g.stride(),
        launch.h, launch.hkv, *sizes, launch.scale, launch.p,
        SUPPORT=support, BLOCK_M=bm, BLOCK_N=bn, **launch.switches(),
    )  # fmt: skip
    _dq_kernel[(triton.cdiv(launch.lq, bm), launch.b * launch.h)](
        q, k, v, launch.row, mask, g, dq, drow, *rows, sup,
        *q.stride(), *k.stride(), *v.stride(), *rs, *ms, *g.stride(),
        launch.h, *sizes, launch.scale, launch.p,
        WANT_ROW=want_row, SUPPORT=support, BLOCK_M=bm, BLOCK_N=bn, **launch.switches(),
    )  # fmt: skip
    return dq, dk, dv, (drow if want_row else None)


class TritonElementwise(torch.autograd.Function):
    """out = Σ_j w(scale·q_i·k_j)·v_j through the kernels above, gradients for q, k, v and the
    row tensor (sigmoid's bias)."""

    @staticmethod
    def forward(ctx, q, k, v, row, kernel, maths, masking, scale, blocks):
        q, k, v = unit_last(q), unit_last(k), unit_last(v)
        launch = Launch(
            kernel.name,
            maths.normalised,
            q,
            k,
            v,
            row,
            masking,
            scale,
            maths.p,
            blocks,
            maths.SHIFT_ABOVE,
        )
        launch.row_grad = kernel.row_grad
        out, m, z = forward(launch, q, k, v)
        if launch.normalised:  # out in float32, kept for D = dO·out
            ctx.save_for_backward(q, k, v, row, out, m, z)
            out = out.to(q.dtype)
        else:
            ctx.save_for_backward(q, k, v, row)
        ctx.launch = launch
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, row, *normalised = ctx.saved_tensors
        launch = ctx.launch
        want_row = ctx.needs_input_grad[3] and launch.row_grad
        dq, dk, dv, drow = backward(launch, q, k, v, unit_last(g), want_row, *normalised)
        if drow is not None:
            drow = drow.to(row.dtype).sum_to_size(row.shape)
        return dq, dk, dv, drow, None, None, None, None, None


def attention(
    kernel: Kernel,
    maths: TileMaths,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masking: Masking,
    scale: float,
    row: Tensor,
    blocks: tuple[int, int] | None = None,
) -> Tensor:
    """The attention ``[B, H, Lq, Dv]`` in q's dtype of the map with kernel record ``kernel``
    (its ``MAP``) and tile maths ``maths`` (whether it is normalised, its p and ``SHIFT_ABOVE``):
    the row tensor ``row`` ``[B|1, H|1, Lq|1, 1]`` (sigmoid's b_i, relu's n_i; differentiable
    where the record says ``row_grad``), ``blocks`` (query rows, keys) per block (default:
    `BLOCKS_16BIT` / `BLOCKS_FLOAT32`)."""
    return TritonElementwise.apply(q, k, v, row, kernel, maths, masking, scale, blocks)
