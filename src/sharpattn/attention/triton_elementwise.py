"""Triton kernels on CUDA of the element-wise maps (``sigmoid``, ``relu``) and of the maps
normalised by a row sum (``power``, ``signed``, ``softpick``, ``stablemax``, and ``softmax`` with its
log-sum-exp, `softmax_attention`, for the sink and adaptive temperature), forward and backward.

Flash-style: each program holds a block of query rows (or of keys, for dk and dv) and walks the
other side's blocks, never forming the ``[Lq, Lk]`` score matrix. One set of kernels serves
every map through ``constexpr`` switches: ``MAP``, the name of its kernel record
(`families.Kernel`), and ``NORMALISED``; each formula is one ``@triton.jit`` function:

* element-wise, `_weight`: w = f(s, row) and its slope f′(s, row) per score, so another
  element-wise map is a few lines there. ``sigmoid``: w = σ(s + b_i), f′ = w·(1 − w), b_i the
  row tensor (bias − log n_i or bias); ``relu``: w = ReLU(s)^p / n_i, f′ = p·ReLU(s)^(p−1) / n_i.
* normalised, w_ij = u_ij / Z_i with Z_i = Σ_j a_ij, `_normalised` (u, a): ``power`` u = a =
  (ReLU(s)/m)^p; ``signed`` u = sign(s)·e^{|s| − m}, a = e^{|s| − m}; ``softpick`` u = ReLU(d),
  a = |d|, d = e^{−m}(e^{s} − 1) formed as ``tiled._Softpick`` does (`_softpick_shift`, with
  an expm1 that keeps its precision near s = 0, `_expm1`). u and a are taken relative to a
  running row reference m (`_reference`: the largest ReLU(s), |s|, max(0, s)) and the
  accumulators are rescaled when m grows (`_factor`), as flash attention does for softmax, so
  nothing overflows at any score size; the forward stores m and Z per row for the backward.
  Their gradients, `_grad` (as ``tiled``'s ``grad``): with D_i = dO_i·out_i (one number per row,
  taken in PyTorch), power ds = (dP − D)·p·(r/m)^{p−1}/(m·Z), signed ds = (sign(s)·dP − D)·w,
  softpick ds = (1[d > 0]·dP − sign(d)·D)·e^{s − m}/Z. ``softmax``: u = a = e^{s − m}, m the
  largest allowed score (−inf until a row sees one), ds = (dP − D)·w, and the log-sum-exp
  lse = m + log Z is an output with a gradient: it enters as D − ∂L/∂lse.

s = scale·q·kᵀ in float32 (the products accumulate in float32 for every input dtype; float32
inputs multiply in IEEE float32, not TF32), out_i = Σ_j w_ij·v_j with w cast to v's dtype, as
the naive path does (normalised: Σ_j u_ij·v_j in float32, divided by Z_i at the end). Backward (FlashAttention-2's structure): dP = dO·vᵀ, ds from `_grad`;
one kernel over key blocks gives dv_j = Σ_i w_ij·dO_i and dk_j = scale·Σ_i ds_ij·q_i, looping
over the query blocks that see the keys and over the query heads of the key's group (so GQA
needs no atomic adds and no float32 scratch per query head: each program owns its dk and dv
rows, deterministic); one kernel over query blocks gives dq_i = scale·Σ_j ds_ij·k_j and, for
sigmoid's learnable bias, the row sums Σ_j ds_ij (PyTorch sums them to the bias's shape).

Masks are computed in the kernel: the causal edge j <= i + (Lk − Lq) from indices (blocks wholly
above it are never visited), a user boolean mask read through its broadcast strides (stride 0,
never densified), the row tensor likewise. Rows that see no key give 0 and zero gradients.

This module imports triton; `tiled` imports it only for CUDA tensors (`wanted`
there). The tests run these kernels on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``,
read when the kernels are defined, i.e. when this module is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..normalizers.families import Kernel, TileMaths
from .masking import Masking

Tensor = torch.Tensor


@triton.jit
def _powers(t, p, POWER: tl.constexpr):
    """(t^p, t^{p−1}) of t >= 0 (the second 0 where t = 0); POWER: 1, 2 or 3 for that whole p,
    0 for any other p >= 1 (through exp2/log2)."""
    if POWER == 1:
        tp = t
        tq = tl.where(t > 0.0, 1.0, 0.0)
    elif POWER == 2:
        tp = t * t
        tq = t
    elif POWER == 3:
        tq = t * t
        tp = tq * t
    else:
        lt = tl.log2(tl.where(t > 0.0, t, 1.0))
        tp = tl.where(t > 0.0, tl.exp2(p * lt), 0.0)
        tq = tl.where(t > 0.0, tl.exp2((p - 1.0) * lt), 0.0)
    return tp, tq


@triton.jit
def _expm1(x):
    """e^x − 1 without the cancellation near 0: a degree-8 Taylor polynomial for |x| < 0.5
    (relative error below 1e-8), e^x − 1 beyond (as ``native/tiles.cpp``'s ``fast_expm1``)."""
    t = 1.0 / 40320.0
    t = t * x + 1.0 / 5040.0
    t = t * x + 1.0 / 720.0
    t = t * x + 1.0 / 120.0
    t = t * x + 1.0 / 24.0
    t = t * x + 1.0 / 6.0
    t = t * x + 0.5
    t = t * x + 1.0
    return tl.where(tl.abs(x) < 0.5, t * x, tl.exp(x) - 1.0)


@triton.jit
def _sign(x):
    return tl.where(x > 0.0, 1.0, tl.where(x < 0.0, -1.0, 0.0))


@triton.jit
def _stablemax(x):
    """StableMax's s(x): x + 1 for x >= 0, 1/(1 − x) below."""
    return tl.where(x >= 0.0, x + 1.0, 1.0 / (1.0 - tl.minimum(x, 0.0)))


@triton.jit
def _weight(s, row, p, MAP: tl.constexpr, POWER: tl.constexpr):
    """(w, dw/ds) of scores ``s`` [M, N] (float32) given the row values ``row`` [M, 1]
    (element-wise methods)."""
    if MAP == "sigmoid":  # σ(s + b)
        w = 1.0 / (1.0 + tl.exp(-(s + row)))
        slope = w * (1.0 - w)
    else:  # relu: ReLU(s)^p / n
        tp, tq = _powers(tl.maximum(s, 0.0), p, POWER)
        w = tp / row
        slope = p * tq / row
    return w, slope


@triton.jit
def _reference(s, keep, MAP: tl.constexpr):
    """A block's candidate [M] for the row reference m of scores ``s`` [M, N] (disallowed ones
    0): the largest ReLU(s) (power), |s| (signed), max(0, s) (softpick), the largest allowed s
    (softmax; −inf where none is), StableMax's s of the largest score (`_stablemax`)."""
    if MAP == "signed":
        ref = tl.max(tl.abs(s), 1)
    elif MAP == "softmax":
        ref = tl.max(tl.where(keep, s, -float("inf")), 1)
    elif MAP == "stablemax":
        ref = _stablemax(tl.max(s, 1))
    else:
        ref = tl.maximum(tl.max(s, 1), 0.0)
    return ref


@triton.jit
def _softpick_shift(m, SHIFT_ABOVE: tl.constexpr):
    """(c, A, B) per row of softpick's d = A·expm1(s − c) + B = e^{−m}(e^{s} − 1): c = 0, A =
    e^{−m}, B = 0 while m <= SHIFT_ABOVE (exact near s = 0), c = m, A = 1, B = 1 − e^{−m} beyond."""
    far = m > SHIFT_ABOVE
    c = tl.where(far, m, 0.0)
    return c, tl.exp(c - m), tl.where(far, -_expm1(-m), 0.0)


@triton.jit
def _factor(m_old, m_new, p, MAP: tl.constexpr, POWER: tl.constexpr):
    """The rescaling [M] of sums taken relative to m_old once the reference is m_new >= m_old."""
    if MAP == "power":  # ((m_old/m_new)^p; 0 while no score was positive)
        f, _ = _powers(m_old / tl.where(m_new > 0.0, m_new, 1.0), p, POWER)
    elif MAP == "stablemax":  # m_old/m_new (0 before the first key)
        f = m_old / tl.where(m_new > 0.0, m_new, 1.0)
    else:
        f = tl.exp(m_old - m_new)
    return f


@triton.jit
def _normalised(s, m, p, MAP: tl.constexpr, POWER: tl.constexpr, SHIFT_ABOVE: tl.constexpr):
    """(u, a) of scores ``s`` [M, N] relative to the row reference ``m`` [M, 1], w = u / Σ_j a_j:
    power u = a = (ReLU(s)/m)^p, signed u = sign(s)·e^{|s| − m} and a = e^{|s| − m}, softpick
    u = ReLU(d) and a = |d|, d = e^{−m}(e^{s} − 1), StableMax u = a = s(x)/m."""
    if MAP == "power":
        u, _ = _powers(tl.maximum(s, 0.0) / tl.where(m > 0.0, m, 1.0), p, POWER)
        a = u
    elif MAP == "softmax":  # e^{s − m}, m the largest allowed score
        u = tl.exp(tl.minimum(s - m, 0.0))
        a = u
    elif MAP == "stablemax":
        u = _stablemax(s) / tl.where(m > 0.0, m, 1.0)
        a = u
    elif MAP == "signed":
        a = tl.exp(tl.abs(s) - m)
        u = _sign(s) * a
    else:
        c, big_a, big_b = _softpick_shift(m, SHIFT_ABOVE)
        d = big_a * _expm1(s - c) + big_b
        u = tl.maximum(d, 0.0)
        a = tl.abs(d)
    return u, a


@triton.jit
def _grad(
    s, dp, row, m, z, dd, p,
    MAP: tl.constexpr, NORMALISED: tl.constexpr, POWER: tl.constexpr, SHIFT_ABOVE: tl.constexpr,
):  # fmt: skip
    """(w, dL/ds, dL/dy) [M, N] of scores ``s`` given dP = dO·vᵀ: the element-wise ``row``, or
    the normalised m, Z (> 0) and D = dO·out per row (each [M, 1]), as ``tiled``'s ``grad``
    (dL/dy: α-entmax's gradient in y = c1·s, for c1's; the others' dL/ds):
    power ds = (dP − D)·p·(r/m)^{p−1}/(m·Z), signed ds = (sign(s)·dP − D)·w, softpick ds =
    (1[d > 0]·dP − sign(d)·D)·e^{s − m}/Z with e^{s − m} = d + A − B, StableMax ds =
    (dP − D)·s′(x)/(m·Z) with s′ = 1 for x >= 0, 1/(1 − x)² below."""
    if not NORMALISED:
        w, slope = _weight(s, row, p, MAP, POWER)
        ds = dp * slope
    elif MAP == "power":
        m1 = tl.where(m > 0.0, m, 1.0)
        tp, tq = _powers(tl.maximum(s, 0.0) / m1, p, POWER)
        w = tp / z
        ds = (dp - dd) * tq * (p / (m1 * z))
    elif MAP == "stablemax":
        mz = tl.where(m > 0.0, m, 1.0) * z
        below = 1.0 / (1.0 - tl.minimum(s, 0.0))
        w = tl.where(s >= 0.0, s + 1.0, below) / mz
        ds = (dp - dd) * tl.where(s >= 0.0, 1.0, below * below) / mz
    elif MAP == "signed":
        sign = _sign(s)
        w = sign * tl.exp(tl.abs(s) - m) / z
        ds = (sign * dp - dd) * w
    elif MAP == "softmax":  # D carries the log-sum-exp's gradient (D − dL/dlse)
        w = tl.exp(tl.minimum(s - m, 0.0)) / z
        ds = (dp - dd) * w
    elif MAP == "topk":  # softmax on the kept keys (the caller's keep), m = lse
        w = tl.exp(tl.minimum(s - m, 0.0))
        ds = (dp - dd) * w
    elif MAP == "entmax":  # t = [c1·s − c0]_+, w = t^e/Z, dL/dy = e·t^{e−1}·(dP − r)
        tp, tq = _powers(tl.maximum(row * s - m, 0.0), p, POWER)
        w = tp / z
        dy = (dp - dd) * tq * p
        ds = dy * row
    else:
        c, big_a, big_b = _softpick_shift(m, SHIFT_ABOVE)
        d = big_a * _expm1(s - c) + big_b
        pos = d > 0.0
        w = tl.where(pos, d, 0.0) / z
        ds = (tl.where(pos, dp, 0.0) - _sign(d) * dd) * (d + (big_a - big_b)) / z
    if MAP != "entmax":
        dy = ds
    return w, ds, dy


@triton.jit
def _visible(
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
def _tile(ptr, sb, sh, sr, sc, b, h, offs_r, offs_c, n_r, n_c):
    """The block ``[len(offs_r), len(offs_c)]`` of the ``[B, H, rows, cols]`` tensor at ``ptr``
    (strides sb, sh, sr, sc) at batch b and head h; 0 outside ``n_r`` rows and ``n_c`` columns."""
    return tl.load(
        ptr + b * sb + h * sh + offs_r[:, None] * sr + offs_c[None, :] * sc,
        mask=(offs_r[:, None] < n_r) & (offs_c[None, :] < n_c),
        other=0.0,
    )


@triton.jit
def _query_block(q_ptr, sqb, sqh, sqm, sqd, heads, group, lq, d,
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
    q = _tile(q_ptr, sqb, sqh, sqm, sqd, b, h, offs_m, offs_d, lq, d)
    return start_m, b, h, hk, offs_m, offs_d, offs_e, in_m, q


@triton.jit
def _block_scores(q, k_ptr, skb, skh, skn, skd, b, h, hk, offs_m, offs_n, offs_d, lq, lk, d,
                  offset, scale, mask_ptr, smb, smh, smm, smn,
                  CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """(s, keep) [M, N] of one key block: s = scale·q·kᵀ (float32) and which keys each row
    sees (`_visible`); kᵀ is loaded [D, N]."""
    k = tl.load(
        k_ptr + b * skb + hk * skh + offs_n[None, :] * skn + offs_d[:, None] * skd,
        mask=(offs_n[None, :] < lk) & (offs_d[:, None] < d),
        other=0.0,
    )
    s = tl.dot(q, k, input_precision=PRECISION) * scale
    keep = _visible(
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
def _support_row(sup_ptr, lq, lk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where a forward program's query block starts in the block support [B·H, query blocks,
    key blocks] (one entry per key block from there)."""
    return sup_ptr + (tl.program_id(1) * tl.cdiv(lq, BLOCK_M) + tl.program_id(0)) * tl.cdiv(
        lk, BLOCK_N
    )


@triton.jit
def _has_support(
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
    heads, group, lq, lk, d, dv, offset, scale, p,
    MAP: tl.constexpr, NORMALISED: tl.constexpr, POWER: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SHIFT_ABOVE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """out of one block of query rows; the normalised methods also write each row's reference
    m and sum Z (contiguous [B, H, Lq], float32) for the backward."""
    start_m, b, h, hk, offs_m, offs_d, offs_e, in_m, q = _query_block(
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
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s, keep = _block_scores(q, k_ptr, skb, skh, skn, skd, b, h, hk, offs_m, offs_n, offs_d,
                                lq, lk, d, offset, scale, mask_ptr, smb, smh, smm, smn,
                                CAUSAL, HAS_MASK, PRECISION)  # fmt: skip
        if MAP == "softmax":  # flash attention; m = −inf until a row sees a key
            m_new = tl.maximum(m, _reference(s, keep, MAP))
            m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
            f = tl.exp(m - m_use)  # 0 while nothing was seen
            w, a = _normalised(s, m_use[:, None], p, MAP, POWER, SHIFT_ABOVE)
            z = z * f + tl.sum(tl.where(keep, a, 0.0), 1)
            acc = acc * f[:, None]
            m = m_new
        elif NORMALISED:  # flash-style: the sums rescaled when m grows
            s = tl.where(keep, s, 0.0)  # disallowed scores 0: no overflow there
            m_new = tl.maximum(m, _reference(s, keep, MAP))
            f = _factor(m, m_new, p, MAP, POWER)
            w, a = _normalised(s, m_new[:, None], p, MAP, POWER, SHIFT_ABOVE)
            z = z * f + tl.sum(tl.where(keep, a, 0.0), 1)
            acc = acc * f[:, None]
            m = m_new
        else:
            w, _ = _weight(s, row, p, MAP, POWER)
        w = tl.where(keep, w, 0.0)
        v = _tile(v_ptr, svb, svh, svn, svd, b, hk, offs_n, offs_e, lk, dv)
        acc += tl.dot(w.to(v.dtype), v, input_precision=PRECISION)
    if NORMALISED:
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
def _kept(s, tau, last, offs_n):
    """Top-k's kept keys [M, N] among the allowed ones: s > τ, or s = τ at a key index up to
    ``last`` (the last tie kept, in key order; −1: none)."""
    return (s > tau) | ((s == tau) & (offs_n[None, :].to(tl.float32) <= last))


@triton.jit
def _entmax_sums(s, keep, c1, c0, p, POWER: tl.constexpr):
    """(t^e, t^{e−1}) [M, N] of t = [c1·s − c0]_+ at the allowed keys, 0 elsewhere (e = ``p``,
    a number or [M, 1])."""
    t = tl.where(keep, tl.maximum(c1 * s - c0, 0.0), 0.0)
    return _powers(t, p, POWER)


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
    start_m, b, h, hk, offs_m, offs_d, offs_e, in_m, q = _query_block(
        q_ptr, sqb, sqh, sqm, sqd, heads, group, lq, d, BLOCK_M, D_PAD, DV_PAD
    )
    at = row_ptr + b * srb + h * srh + offs_m * srm
    c1 = tl.load(at, mask=in_m, other=1.0)[:, None]
    e = tl.load(at + 1, mask=in_m, other=1.0)  # the pair's last dimension has stride 1
    sup = _support_row(sup_ptr, lq, lk, BLOCK_M, BLOCK_N)
    hi = lk
    if CAUSAL:
        hi = tl.minimum(lk, start_m + BLOCK_M + offset)
    top = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    n = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s, keep = _block_scores(q, k_ptr, skb, skh, skn, skd, b, h, hk, offs_m, offs_n, offs_d,
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
        s, keep = _block_scores(q, k_ptr, skb, skh, skn, skd, b, h, hk, offs_m, offs_n, offs_d,
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
                s, keep = _block_scores(q, k_ptr, skb, skh, skn, skd, b, h, hk, offs_m, offs_n,
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
            s, keep = _block_scores(q, k_ptr, skb, skh, skn, skd, b, h, hk, offs_m, offs_n,
                                    offs_d, lq, lk, d, offset, scale, mask_ptr, smb, smh, smm,
                                    smn, CAUSAL, HAS_MASK, PRECISION)  # fmt: skip
            near = tl.max(tl.max(tl.where(keep, c1 * s - c0, -float("inf")), 1), 0)
            tl.store(sup + start_n // BLOCK_N, tl.where(near > -slack, 1.0, 0.0))
            tp, tq = _entmax_sums(s, keep, c1, c0, e[:, None], POWER)
            v = _tile(v_ptr, svb, svh, svn, svd, b, hk, offs_n, offs_e, lk, dv)
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
    start_m, b, h, hk, offs_m, offs_d, offs_e, in_m, q = _query_block(
        q_ptr, sqb, sqh, sqm, sqd, heads, group, lq, d, BLOCK_M, D_PAD, DV_PAD
    )
    hi = lk
    if CAUSAL:
        hi = tl.minimum(lk, start_m + BLOCK_M + offset)
    top = tl.zeros([BLOCK_M, K], dtype=tl.float32) - float("inf")
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s, keep = _block_scores(q, k_ptr, skb, skh, skn, skd, b, h, hk, offs_m, offs_n, offs_d,
                                lq, lk, d, offset, scale, mask_ptr, smb, smh, smm, smn,
                                CAUSAL, HAS_MASK, PRECISION)  # fmt: skip
        new = _block_top(tl.where(keep, s, -float("inf")), K, BLOCK_N)  # ascending
        top = tl.sort(tl.maximum(top, new), descending=True)
    rank = tl.arange(0, K)[None, :]
    tau = tl.max(tl.where(rank == top_k - 1, top, -float("inf")), 1)  # −inf: keep every key
    need = tl.sum(((top == tau[:, None]) & (rank < top_k)).to(tl.float32), 1)
    m = tl.max(top, 1)
    m = tl.where(m == -float("inf"), 0.0, m)
    sup = _support_row(sup_ptr, lq, lk, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    z = tl.zeros([BLOCK_M], dtype=tl.float32)
    ties = tl.zeros([BLOCK_M], dtype=tl.float32)  # ties at τ met so far
    last = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s, keep = _block_scores(q, k_ptr, skb, skh, skn, skd, b, h, hk, offs_m, offs_n, offs_d,
                                lq, lk, d, offset, scale, mask_ptr, smb, smh, smm, smn,
                                CAUSAL, HAS_MASK, PRECISION)  # fmt: skip
        eq = keep & (s == tau[:, None])
        order = ties[:, None] + tl.cumsum(eq.to(tl.float32), 1)
        tie_kept = eq & (order <= need[:, None])
        last = tl.maximum(last, tl.max(tl.where(tie_kept, offs_n[None, :].to(tl.float32), -1.0), 1))
        ties += tl.sum(eq.to(tl.float32), 1)
        kept = keep & ((s > tau[:, None]) | tie_kept)
        any_kept = tl.max(tl.max(kept.to(tl.float32), 1), 0)
        tl.store(sup + start_n // BLOCK_N, any_kept)
        if any_kept > 0.0:
            w = tl.where(kept, tl.exp(tl.minimum(s - m[:, None], 0.0)), 0.0)
            z += tl.sum(w, 1)
            v = _tile(v_ptr, svb, svh, svn, svd, b, hk, offs_n, offs_e, lk, dv)
            acc += tl.dot(w.to(v.dtype), v, input_precision=PRECISION)
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
    forward found a weight that may be nonzero, `_has_support`). dk, dv are written contiguous
    [B, Hkv, Lk, ·]."""
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b = bh // kv_heads
    hk = bh % kv_heads
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    offs_e = tl.arange(0, DV_PAD)
    k = _tile(k_ptr, skb, skh, skn, skd, b, hk, offs_n, offs_d, lk, d)  # [N, D]
    v = _tile(v_ptr, svb, svh, svn, svd, b, hk, offs_n, offs_e, lk, dv)  # [N, Dv]
    dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    dvacc = tl.zeros([BLOCK_N, DV_PAD], dtype=tl.float32)
    lo = 0
    if CAUSAL:  # the first row that sees key start_n: i >= start_n − offset
        lo = tl.maximum(start_n - offset, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    for g in range(0, group):
        h = hk * group + g
        for start_m in range(lo, lq, BLOCK_M):
            if _has_support(
                sup_ptr, b, h, heads, start_m, start_n, lq, lk, BLOCK_M, BLOCK_N, SUPPORT
            ):
                offs_m = start_m + tl.arange(0, BLOCK_M)
                q = _tile(q_ptr, sqb, sqh, sqm, sqd, b, h, offs_m, offs_d, lq, d)  # [M, D]
                do = _tile(do_ptr, sgb, sgh, sgm, sgd, b, h, offs_m, offs_e, lq, dv)  # [M, Dv]
                row, m, z, dd, pr = _rows(row_ptr, srb, srh, srm, m_ptr, z_ptr, dd_ptr, b, h,
                                          heads, lq, offs_m, p, MAP, NORMALISED)  # fmt: skip
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N]
                keep = _visible(
                    offs_m, offs_n, lq, lk, offset, mask_ptr, smb, smh, smm, smn, b, h, CAUSAL,
                    HAS_MASK,
                )  # fmt: skip
                if MAP == "topk":  # the kept keys: above τ, and ties at τ up to the last kept
                    keep = keep & _kept(s, row, z, offs_n)
                s = tl.where(keep, s, 0.0)
                dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # dO_i·v_j [M, N]
                w, ds, _ = _grad(s, dp, row, m, z, dd, pr, MAP, NORMALISED, POWER, SHIFT_ABOVE)
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
    and dL/de per row, `_entmax_exponent_grad`); dq is written contiguous [B, H, Lq, D], the
    row sums [B, H, Lq] (α-entmax: [B, H, Lq, 2]). With SUPPORT only the key blocks where the
    forward found a weight that may be nonzero (`_has_support`)."""
    start_m, b, h, hk, offs_m, offs_d, offs_e, in_m, q = _query_block(
        q_ptr, sqb, sqh, sqm, sqd, heads, group, lq, d, BLOCK_M, D_PAD, DV_PAD
    )
    do = _tile(do_ptr, sgb, sgh, sgm, sgd, b, h, offs_m, offs_e, lq, dv)
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
        if _has_support(sup_ptr, b, h, heads, start_m, start_n, lq, lk, BLOCK_M, BLOCK_N, SUPPORT):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = _tile(k_ptr, skb, skh, skn, skd, b, hk, offs_n, offs_d, lk, d)  # [N, D]
            v = _tile(v_ptr, svb, svh, svn, svd, b, hk, offs_n, offs_e, lk, dv)  # [N, Dv]
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            keep = _visible(offs_m, offs_n, lq, lk, offset, mask_ptr, smb, smh, smm, smn, b, h,
                            CAUSAL, HAS_MASK)  # fmt: skip
            if MAP == "topk":  # the kept keys: above τ, and ties at τ up to the last kept one
                keep = keep & _kept(s, row, z, offs_n)
            s = tl.where(keep, s, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            w, ds, dy = _grad(s, dp, row, m, z, dd, pr, MAP, NORMALISED, POWER, SHIFT_ABOVE)
            ds = tl.where(keep, ds, 0.0)
            if WANT_ROW:
                if MAP == "entmax":
                    dc1, de = _entmax_exponent_grad(s, keep, w, dy, dp, row, m, dd)
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


@triton.jit
def _entmax_exponent_grad(s, keep, w, dy, dp, c1, c0, dd):
    """α-entmax's row gradients [M] from one key block: dL/dc1 = Σ_j dL/dy_j·s_j, taken as
    Σ_j dL/dy_j·(s_j − c0/c1) (Σ_j dL/dy_j = 0, and the shift near the row's largest score
    keeps the terms small), and dL/de at fixed y = Σ_j w_j·ln t_j·(dP_j − D) with t = [c1·s −
    c0]_+ (from Σ_j t_j^e = 1 held by τ: ∂w_j/∂e = w_j·ln t_j − u_j·Σ_k w_k·ln t_k / Σ_k u_k,
    u = t^{e−1}, and D = dO·r, r = Σ_k u_k·v_k / Σ_k u_k)."""
    shift = tl.where(c1 != 0.0, c0 / tl.where(c1 != 0.0, c1, 1.0), 0.0)
    dc1 = tl.sum(tl.where(keep, dy * (s - shift), 0.0), 1)
    t = c1 * s - c0
    pos = keep & (t > 0.0)
    lt = tl.log(tl.where(pos, t, 1.0))
    de = tl.sum(tl.where(pos, w * lt * (dp - dd), 0.0), 1)
    return dc1, de


# ---------------------------------------------------------------------------------------------
# Launching


#: (query rows, keys) per block of the forward and the dq kernel; the dk/dv kernel uses
#: (keys, query rows) the other way round. Not tuned on a GPU yet: FlashAttention-2's Triton
#: tutorial's order of size, halved for float32 at head dims above 64 (twice the registers).
BLOCKS_16BIT = (64, 64)
BLOCKS_FLOAT32 = (32, 32)


def _pad(n: int) -> int:
    """A head dimension rounded up to a power of 2, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(n))


def _blocks(dtype: torch.dtype, d: int, dv: int) -> tuple[int, int]:
    if dtype == torch.float32 and max(d, dv) > 64:
        return BLOCKS_FLOAT32
    return BLOCKS_16BIT


def _unit_last(t: Tensor) -> Tensor:
    """``t`` with a unit stride in its last dimension (coalesced loads); other strides kept."""
    return t if t.stride(-1) == 1 else t.contiguous()


class _Launch:
    """What every kernel of one call shares: sizes, strides of the broadcast tensors, switches."""

    def __init__(
        self, name, normalised, q, k, v, row, masking: Masking, scale, p, blocks, shift=0.0
    ):
        self.b, self.h, self.lq, self.d = q.shape
        self.hkv, self.lk, self.dv = k.shape[1], k.shape[2], v.shape[-1]
        self.group = self.h // self.hkv
        self.row = row.to(torch.float32).expand(self.b, self.h, self.lq, row.shape[-1])
        self.support = None  # the forward's block support, for the backward to skip blocks
        self.mask = None
        if masking.mask is not None:  # a view: uint8 of the same bytes, broadcast strides
            self.mask = masking.mask.expand(self.b, self.h, self.lq, self.lk).view(torch.uint8)
        self.causal, self.offset = masking.causal, masking.offset
        self.scale, self.p = float(scale), float(p)
        self.name, self.normalised, self.shift = name, normalised, shift
        self.row_grad = False  # whether the backward gives the row tensor's gradient
        self.power = int(self.p) if self.p in (1.0, 2.0, 3.0) else 0
        self.blocks = blocks or _blocks(q.dtype, self.d, self.dv)
        self.pads = {"D_PAD": _pad(self.d), "DV_PAD": _pad(self.dv)}
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


def forward(launch: _Launch, q, k, v):
    """(out, m, Z): m and Z ``[B, H, Lq]`` float32 for the normalised methods, else None. Their
    out is float32 too (the backward's D = dO·out from a 16-bit out measured 4-5x the error of
    the eager path in dq, power with p = 3); the caller casts it."""
    m = z = None
    dtype = q.dtype
    if launch.normalised:
        m, z = launch.rows(q.device), launch.rows(q.device)
        dtype = torch.float32
    out = torch.empty(launch.b, launch.h, launch.lq, launch.dv, dtype=dtype, device=q.device)
    mask, rs, ms = launch.common()
    bm, bn = launch.blocks
    grid = (triton.cdiv(launch.lq, bm), launch.b * launch.h)
    _forward_kernel[grid](
        q, k, v, launch.row, mask, out,
        launch.row if m is None else m, launch.row if z is None else z,  # never written
        *q.stride(), *k.stride(), *v.stride(), *rs, *ms, *out.stride(),
        launch.h, launch.group, launch.lq, launch.lk, launch.d, launch.dv, launch.offset,
        launch.scale, launch.p,
        BLOCK_M=bm, BLOCK_N=bn, **launch.switches(),
    )  # fmt: skip
    return out, m, z


def backward(launch: _Launch, q, k, v, g, want_row: bool, out=None, m=None, z=None, glse=None):
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
        q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
        launch = _Launch(
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
        dq, dk, dv, drow = backward(launch, q, k, v, _unit_last(g), want_row, *normalised)
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


class TritonSoftmax(torch.autograd.Function):
    """(out, lse) of softmax(scale·q·kᵀ)·v with out in float32 and lse = m + log Z ``[B, H, Lq,
    1]`` (−inf on rows that see no key), both differentiable (the sink's σ(lse − b), adaptive's
    entropy lse − Σ p·s take gradients through lse)."""

    @staticmethod
    def forward(ctx, q, k, v, masking, scale, blocks):
        q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
        row = q.new_ones(1, 1, 1, 1, dtype=torch.float32)  # read by no softmax kernel
        launch = _Launch("softmax", True, q, k, v, row, masking, scale, 1.0, blocks)
        out, m, z = forward(launch, q, k, v)
        ctx.save_for_backward(q, k, v, out, m, z)
        ctx.launch = launch
        return out, (m + torch.log(z)).unsqueeze(-1)

    @staticmethod
    def backward(ctx, g, glse):
        q, k, v, out, m, z = ctx.saved_tensors
        g = _unit_last(g.to(v.dtype))  # dO in the inputs' dtype, as the flash backward takes it
        dq, dk, dv, _ = backward(ctx.launch, q, k, v, g, False, out, m, z, glse)
        return dq, dk, dv, None, None, None


def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masking: Masking,
    scale: float,
    blocks: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """softmax attention ``[B, H, Lq, Dv]`` (float32) and its log-sum-exp ``[B, H, Lq, 1]``
    (float32, −inf on rows that see no key), both with gradients, through the kernels above."""
    return TritonSoftmax.apply(q, k, v, masking, scale, blocks)


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
    dL/dy_ij·s_ij and dL/de_i (`_entmax_exponent_grad`). ``power``: e when it is 1, 2 or 3 for
    every row (the kernels' cheaper powers), else 0."""

    @staticmethod
    def forward(ctx, q, k, v, row, power, steps, masking, scale, blocks):
        q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
        launch = _Launch("entmax", True, q, k, v, row, masking, scale, float(power), blocks)
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
        _entmax_forward_kernel[(triton.cdiv(launch.lq, bm), launch.b * launch.h)](
            q, k, v, launch.row, mask, out, r, c0, z, sup,
            *q.stride(), *k.stride(), *v.stride(), *rs, *ms, *out.stride(),
            launch.h, launch.group, launch.lq, launch.lk, launch.d, launch.dv, launch.offset,
            launch.scale, STEPS=steps, BLOCK_M=bm, BLOCK_N=bn, **switches,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, row, r, c0, z)
        ctx.launch = launch
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, g):
        q, k, v, row, r, c0, z = ctx.saved_tensors
        launch = ctx.launch
        want_row = ctx.needs_input_grad[3]
        g = _unit_last(g.to(v.dtype))
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


class TritonTopk(torch.autograd.Function):
    """Top-k attention (softmax over each row's ``top_k`` largest allowed scores, ties in key
    order) through `_topk_forward_kernel` and the shared backward kernels (``MAP`` ``topk``:
    softmax's gradient on the kept keys, found again from τ and the last kept tie)."""

    @staticmethod
    def forward(ctx, q, k, v, top_k, masking, scale, blocks):
        q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
        zero = q.new_zeros(1, 1, 1, 1)
        launch = _Launch("topk", True, q, k, v, zero, masking, scale, 1.0, blocks)
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
        _topk_forward_kernel[(triton.cdiv(launch.lq, bm), launch.b * launch.h)](
            q, k, v, mask, out, lse, tau, last, sup,
            *q.stride(), *k.stride(), *v.stride(), *ms, *out.stride(),
            launch.h, launch.group, launch.lq, launch.lk, launch.d, launch.dv, launch.offset,
            launch.scale, int(top_k),
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
        g = _unit_last(g.to(v.dtype))
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
