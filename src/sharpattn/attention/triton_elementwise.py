"""Triton kernels of the element-wise family on CUDA: ``sigmoid`` and ``relu``, forward and backward.

Flash-style: each program holds a block of query rows (or of keys, for dk and dv) and walks the
other side's blocks, never forming the ``[Lq, Lk]`` score matrix. The family's maths is one
``@triton.jit`` function, `_weight`: w = f(s, row) and its slope f′(s, row) per score, a
``constexpr`` switch on the method, so another element-wise map is a few lines there:

* ``sigmoid``: w = σ(s + b_i), f′ = w·(1 − w), b_i the row tensor (bias − log n_i or bias);
* ``relu``: w = ReLU(s)^p / n_i, f′ = p·ReLU(s)^(p−1) / n_i, n_i the row tensor.

s = scale·q·kᵀ in float32 (the products accumulate in float32 for every input dtype; float32
inputs multiply in IEEE float32, not TF32), out_i = Σ_j w_ij·v_j with w cast to v's dtype, as
the naive path does. Backward (FlashAttention-2's structure): dP = dO·vᵀ, ds = dP·f′(s);
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

from .masking import Masking

Tensor = torch.Tensor

#: the method's number in the kernels' ``METHOD`` switch
METHODS = {"sigmoid": 0, "relu": 1}


@triton.jit
def _weight(s, row, p, METHOD: tl.constexpr, POWER: tl.constexpr):
    """(w, dw/ds) of scores ``s`` [M, N] (float32) given the row values ``row`` [M, 1].

    POWER (relu): 1 or 2 for p = 1 or 2 exactly, 0 for any other p >= 1 (through exp2/log2)."""
    if METHOD == 0:  # sigmoid: σ(s + b)
        w = 1.0 / (1.0 + tl.exp(-(s + row)))
        slope = w * (1.0 - w)
    else:  # relu: ReLU(s)^p / n
        r = tl.maximum(s, 0.0)
        if POWER == 1:
            w = r / row
            slope = tl.where(s > 0.0, 1.0 / row, 0.0)
        elif POWER == 2:
            w = r * r / row
            slope = 2.0 * r / row
        else:
            lr = tl.log2(tl.where(r > 0.0, r, 1.0))
            w = tl.where(r > 0.0, tl.exp2(p * lr), 0.0) / row
            slope = tl.where(r > 0.0, p * tl.exp2((p - 1.0) * lr), 0.0) / row
    return w, slope


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
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, row_ptr, mask_ptr, out_ptr,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    srb, srh, srm,
    smb, smh, smm, smn,
    sob, soh, som, sod,
    heads, group, lq, lk, d, dv, offset, scale, p,
    METHOD: tl.constexpr, POWER: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    hk = h // group  # the query head's key/value head (GQA)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_e = tl.arange(0, DV_PAD)
    q = tl.load(
        q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
        mask=(offs_m[:, None] < lq) & (offs_d[None, :] < d),
        other=0.0,
    )
    row = tl.load(row_ptr + b * srb + h * srh + offs_m * srm, mask=offs_m < lq, other=1.0)
    row = row[:, None]
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    hi = lk
    if CAUSAL:  # keys past the block's last row's causal edge are hidden from every row
        hi = tl.minimum(lk, start_m + BLOCK_M + offset)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(
            k_ptr + b * skb + hk * skh + offs_n[None, :] * skn + offs_d[:, None] * skd,
            mask=(offs_n[None, :] < lk) & (offs_d[:, None] < d),
            other=0.0,
        )  # kᵀ [D, N]
        s = tl.dot(q, k, input_precision=PRECISION) * scale
        w, _ = _weight(s, row, p, METHOD, POWER)
        keep = _visible(
            offs_m, offs_n, lq, lk, offset, mask_ptr, smb, smh, smm, smn, b, h, CAUSAL, HAS_MASK
        )
        w = tl.where(keep, w, 0.0)
        v = tl.load(
            v_ptr + b * svb + hk * svh + offs_n[:, None] * svn + offs_e[None, :] * svd,
            mask=(offs_n[:, None] < lk) & (offs_e[None, :] < dv),
            other=0.0,
        )
        acc += tl.dot(w.to(v.dtype), v, input_precision=PRECISION)
    tl.store(
        out_ptr + b * sob + h * soh + offs_m[:, None] * som + offs_e[None, :] * sod,
        acc.to(out_ptr.dtype.element_ty),
        mask=(offs_m[:, None] < lq) & (offs_e[None, :] < dv),
    )


@triton.jit
def _dkdv_kernel(
    q_ptr, k_ptr, v_ptr, row_ptr, mask_ptr, do_ptr, dk_ptr, dv_ptr,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    srb, srh, srm,
    smb, smh, smm, smn,
    sgb, sgh, sgm, sgd,
    kv_heads, group, lq, lk, d, dv, offset, scale, p,
    METHOD: tl.constexpr, POWER: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """dk, dv of one block of keys of one key/value head: every query head of its group, every
    query block that sees a key of the block. dk, dv are written contiguous [B, Hkv, Lk, ·]."""
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b = bh // kv_heads
    hk = bh % kv_heads
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    offs_e = tl.arange(0, DV_PAD)
    k = tl.load(
        k_ptr + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
        mask=(offs_n[:, None] < lk) & (offs_d[None, :] < d),
        other=0.0,
    )  # [N, D]
    v = tl.load(
        v_ptr + b * svb + hk * svh + offs_n[:, None] * svn + offs_e[None, :] * svd,
        mask=(offs_n[:, None] < lk) & (offs_e[None, :] < dv),
        other=0.0,
    )  # [N, Dv]
    dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    dvacc = tl.zeros([BLOCK_N, DV_PAD], dtype=tl.float32)
    lo = 0
    if CAUSAL:  # the first row that sees key start_n: i >= start_n − offset
        lo = tl.maximum(start_n - offset, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    for g in range(0, group):
        h = hk * group + g
        for start_m in range(lo, lq, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            in_m = offs_m < lq
            q = tl.load(
                q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=in_m[:, None] & (offs_d[None, :] < d),
                other=0.0,
            )  # [M, D]
            do = tl.load(
                do_ptr + b * sgb + h * sgh + offs_m[:, None] * sgm + offs_e[None, :] * sgd,
                mask=in_m[:, None] & (offs_e[None, :] < dv),
                other=0.0,
            )  # [M, Dv]
            row = tl.load(row_ptr + b * srb + h * srh + offs_m * srm, mask=in_m, other=1.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N]
            w, slope = _weight(s, row[:, None], p, METHOD, POWER)
            keep = _visible(
                offs_m, offs_n, lq, lk, offset, mask_ptr, smb, smh, smm, smn, b, h, CAUSAL,
                HAS_MASK,
            )  # fmt: skip
            w = tl.where(keep, w, 0.0)
            dvacc += tl.dot(tl.trans(w.to(do.dtype)), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # dO_i·v_j [M, N]
            ds = tl.where(keep, dp * slope, 0.0)
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
    q_ptr, k_ptr, v_ptr, row_ptr, mask_ptr, do_ptr, dq_ptr, drow_ptr,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    srb, srh, srm,
    smb, smh, smm, smn,
    sgb, sgh, sgm, sgd,
    heads, group, lq, lk, d, dv, offset, scale, p,
    METHOD: tl.constexpr, POWER: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    WANT_ROW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """dq of one block of query rows (and Σ_j ds_ij per row when WANT_ROW); dq is written
    contiguous [B, H, Lq, D], the row sums [B, H, Lq]."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    hk = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_e = tl.arange(0, DV_PAD)
    in_m = offs_m < lq
    q = tl.load(
        q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
        mask=in_m[:, None] & (offs_d[None, :] < d),
        other=0.0,
    )
    do = tl.load(
        do_ptr + b * sgb + h * sgh + offs_m[:, None] * sgm + offs_e[None, :] * sgd,
        mask=in_m[:, None] & (offs_e[None, :] < dv),
        other=0.0,
    )
    row = tl.load(row_ptr + b * srb + h * srh + offs_m * srm, mask=in_m, other=1.0)[:, None]
    dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    drow = tl.zeros([BLOCK_M], dtype=tl.float32)
    hi = lk
    if CAUSAL:
        hi = tl.minimum(lk, start_m + BLOCK_M + offset)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_n = offs_n < lk
        k = tl.load(
            k_ptr + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
            mask=in_n[:, None] & (offs_d[None, :] < d),
            other=0.0,
        )  # [N, D]
        v = tl.load(
            v_ptr + b * svb + hk * svh + offs_n[:, None] * svn + offs_e[None, :] * svd,
            mask=in_n[:, None] & (offs_e[None, :] < dv),
            other=0.0,
        )  # [N, Dv]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        _, slope = _weight(s, row, p, METHOD, POWER)
        keep = _visible(
            offs_m, offs_n, lq, lk, offset, mask_ptr, smb, smh, smm, smn, b, h, CAUSAL, HAS_MASK
        )
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = tl.where(keep, dp * slope, 0.0)
        if WANT_ROW:
            drow += tl.sum(ds, 1)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    rows = b * heads * lq + h * lq + offs_m
    tl.store(
        dq_ptr + rows[:, None] * d + offs_d[None, :],
        (dq * scale).to(dq_ptr.dtype.element_ty),
        mask=in_m[:, None] & (offs_d[None, :] < d),
    )
    if WANT_ROW:
        tl.store(drow_ptr + rows, drow, mask=in_m)


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

    def __init__(self, method, q, k, v, row, masking: Masking, scale, p, blocks):
        self.b, self.h, self.lq, self.d = q.shape
        self.hkv, self.lk, self.dv = k.shape[1], k.shape[2], v.shape[-1]
        self.group = self.h // self.hkv
        self.row = row.to(torch.float32).expand(self.b, self.h, self.lq, 1)
        self.mask = None
        if masking.mask is not None:  # a view: uint8 of the same bytes, broadcast strides
            self.mask = masking.mask.expand(self.b, self.h, self.lq, self.lk).view(torch.uint8)
        self.causal, self.offset = masking.causal, masking.offset
        self.scale, self.p = float(scale), float(p)
        self.method = METHODS[method]
        self.power = 1 if self.p == 1.0 else 2 if self.p == 2.0 else 0
        self.blocks = blocks or _blocks(q.dtype, self.d, self.dv)
        self.pads = {"D_PAD": _pad(self.d), "DV_PAD": _pad(self.dv)}
        # float32 products in IEEE float32 (TF32 would cost float32 inputs 3 decimal digits)
        self.precision = "ieee" if q.dtype == torch.float32 else "tf32"

    def common(self):
        mask = self.mask if self.mask is not None else self.row  # any pointer: never read
        ms = self.mask.stride() if self.mask is not None else (0, 0, 0, 0)
        return mask, self.row.stride()[:3], ms

    def switches(self):
        return dict(
            METHOD=self.method,
            POWER=self.power,
            CAUSAL=self.causal,
            HAS_MASK=self.mask is not None,
            PRECISION=self.precision,
            **self.pads,
        )


def forward(launch: _Launch, q, k, v) -> Tensor:
    out = torch.empty(launch.b, launch.h, launch.lq, launch.dv, dtype=q.dtype, device=q.device)
    mask, rs, ms = launch.common()
    bm, bn = launch.blocks
    grid = (triton.cdiv(launch.lq, bm), launch.b * launch.h)
    _forward_kernel[grid](
        q, k, v, launch.row, mask, out,
        *q.stride(), *k.stride(), *v.stride(), *rs, *ms, *out.stride(),
        launch.h, launch.group, launch.lq, launch.lk, launch.d, launch.dv, launch.offset,
        launch.scale, launch.p,
        BLOCK_M=bm, BLOCK_N=bn, **launch.switches(),
    )  # fmt: skip
    return out


def backward(launch: _Launch, q, k, v, g, want_row: bool):
    """(dq, dk, dv, Σ_j ds_ij per row [B, H, Lq, 1] or None)."""
    dq = torch.empty(launch.b, launch.h, launch.lq, launch.d, dtype=q.dtype, device=q.device)
    dk = torch.empty(launch.b, launch.hkv, launch.lk, launch.d, dtype=k.dtype, device=q.device)
    dv = torch.empty(launch.b, launch.hkv, launch.lk, launch.dv, dtype=v.dtype, device=q.device)
    drow = torch.empty(launch.b, launch.h, launch.lq, 1, dtype=torch.float32, device=q.device)
    mask, rs, ms = launch.common()
    bm, bn = launch.blocks
    sizes = (launch.group, launch.lq, launch.lk, launch.d, launch.dv, launch.offset)
    _dkdv_kernel[(triton.cdiv(launch.lk, bn), launch.b * launch.hkv)](
        q, k, v, launch.row, mask, g, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *rs, *ms, *g.stride(),
        launch.hkv, *sizes, launch.scale, launch.p,
        BLOCK_M=bm, BLOCK_N=bn, **launch.switches(),
    )  # fmt: skip
    _dq_kernel[(triton.cdiv(launch.lq, bm), launch.b * launch.h)](
        q, k, v, launch.row, mask, g, dq, drow,
        *q.stride(), *k.stride(), *v.stride(), *rs, *ms, *g.stride(),
        launch.h, *sizes, launch.scale, launch.p,
        WANT_ROW=want_row, BLOCK_M=bm, BLOCK_N=bn, **launch.switches(),
    )  # fmt: skip
    return dq, dk, dv, (drow if want_row else None)


class TritonElementwise(torch.autograd.Function):
    """out = Σ_j f(scale·q_i·k_j, row_i)·v_j through the kernels above, gradients for q, k, v and
    the row tensor (sigmoid's bias)."""

    @staticmethod
    def forward(ctx, q, k, v, row, method, masking, scale, p, blocks):
        q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
        launch = _Launch(method, q, k, v, row, masking, scale, p, blocks)
        out = forward(launch, q, k, v)
        ctx.save_for_backward(q, k, v, row)
        ctx.launch = launch
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, row = ctx.saved_tensors
        launch = ctx.launch
        want_row = ctx.needs_input_grad[3] and launch.method == METHODS["sigmoid"]
        dq, dk, dv, drow = backward(launch, q, k, v, _unit_last(g), want_row)
        if drow is not None:
            drow = drow.to(row.dtype).sum_to_size(row.shape)
        return dq, dk, dv, drow, None, None, None, None, None


def attention(
    method: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masking: Masking,
    scale: float,
    row: Tensor,
    p: float = 1.0,
    blocks: tuple[int, int] | None = None,
) -> Tensor:
    """``method``'s attention ``[B, H, Lq, Dv]`` in q's dtype: the row tensor ``row``
    ``[B|1, H|1, Lq|1, 1]`` (sigmoid's b_i, relu's n_i; differentiable for sigmoid), ``blocks``
    (query rows, keys) per block (default: `BLOCKS_16BIT` / `BLOCKS_FLOAT32`)."""
    return TritonElementwise.apply(q, k, v, row, method, masking, scale, p, blocks)
