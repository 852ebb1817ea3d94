"""Stick-breaking attention as Triton kernels on CUDA, forward and backward.

The weights are the normalizer's (`sharpattn.normalizers.stick_breaking`): query i's allowed
keys j <= i + ``diagonal`` (the caller's `stick_tiled._Walk.diagonal`: the key before the
query's own position, or that position with ``attend_current``), inside a user mask, take

    log w_ij = log σ(s_ij) + Σ_{j<k, k allowed} log σ(−s_ik)

each of the stick that the nearer keys left. Each program holds a block of query rows and walks
the key blocks from the diagonal back to key 0, nearest first, carrying per row the running
Σ log σ(−s) of the keys already passed (`_weights`). A key block is loaded in reversed order
(nearest key first), so the sum over the nearer keys inside it is an exclusive cumulative sum
along the block (`_exclusive_cumsum`: the inclusive sum less each key's own term, both in
float64, so that the large log σ(−s) of a key with a large score does not leave its float32
rounding in the sums of its neighbours). log σ(x) = min(x, 0) −
log1p(e^{−|x|}) (`_log_sigmoid`), finite at any score, and log w <= 0, so nothing overflows.
Masked keys (the user mask, past the diagonal, past Lk) take no share and give no log σ(−s).
out_i = Σ_j w_ij·v_j with w cast to v's dtype, accumulated in float32.

Backward (`map_grad`, as ``stick_tiled``): with g_ij = dO_i·v_j,

    dL/ds_ik = w_ik·g_ik − σ(s_ik)·A_ik,   A_ik = D_i − Σ_{j>k} w_ij·g_ij,   D_i = Σ_j w_ij·g_ij,

the last sum carried from the diagonal outwards in the same walk as the forward's log carry
(and inside a block the same exclusive scan). D comes from a first walk over the same key
blocks with the very products w·g of the second, and both sums are float64: A_ik is tiny at the
far keys, and D = dO·out in float32 left about eps·|D| there, which every far key's σ(s_ik)
took again (dq's error grew as the row's length). One kernel over query blocks gives dq and adds
each block's dk_j = scale·Σ_i ds_ij·q_i and dv_j = Σ_i w_ij·dO_i into float32 buffers with
atomic adds: a key's gradient needs, for every query row, the sums over all the keys nearer to
that query, which only a walk over those keys gives, so a kernel over key blocks (as
`triton_elementwise`'s, without atomics) would either walk them again for each key block
(O(n³)) or store them per (row, key block) (O(n²/block) memory). The float32 sums of dk and dv
are therefore not bitwise reproducible from run to run (rounding-level differences).

s = scale·q·kᵀ in float32 (float32 inputs multiply in IEEE float32, not TF32). Rows that see
no key give 0 and zero gradients. Causal only (the caller, `stick_tiled.stick_breaking`, has
refused masks that see past a query's position); GQA by ``h // group``; Dv != D and head dims
up to 128 by padded loads.

This module imports triton; `stick_tiled` imports it only for CUDA tensors. The tests run
these kernels on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..masking import Masking
from .template import (
    SPLIT_BLOCK_M,
    combine_block,
    key_splits,
    pad,
    query_block,
    tile,
    unit_last,
    visible,
)

Tensor = torch.Tensor


@triton.jit
def _log_sigmoid(x):
    """log σ(x) = min(x, 0) − log1p(e^{−|x|}), log1p(t) = log(1 + t)·t/((1 + t) − 1) (exact to
    a few ulps where 1 + t rounds, t where it rounds to 1)."""
    t = tl.exp(-tl.abs(x))
    u = 1.0 + t
    small = u == 1.0
    log1p = tl.where(small, t, tl.log(u) * (t / tl.where(small, 1.0, u - 1.0)))
    return tl.minimum(x, 0.0) - log1p


@triton.jit
def _exclusive_cumsum(x):
    """Σ_{p' < p} x[:, p'] along the block's keys (nearest first), float32 [M, N]: the running
    sum and the subtraction of x_p in float64, whose rounding (N·2^-53 of Σ|x|) stays far below
    float32's. In float32 the subtraction would leave eps·|x_p| in key p's sum; measured in the
    interpreter with q times 30 (scores to ~100): output errors of 6-7 ulps of max |v| instead
    of 3 (q times 300: 26-33 instead of 3-12; the scores' own float32 rounding grows with them
    either way)."""
    x64 = x.to(tl.float64)
    return (tl.cumsum(x64, 1) - x64).to(tl.float32)


@triton.jit
def _weights(s, keep, carry):
    """(w, log σ(s), the next carry) of scores ``s`` [M, N] (disallowed ones 0), keys nearest
    first: log w = log σ(s) + carry + Σ over the nearer keys of the block of log σ(−s), w = 0
    where not ``keep``; ``carry`` [M] is Σ log σ(−s) over the allowed keys already passed."""
    log_pos = _log_sigmoid(s)
    log_neg = tl.where(keep, log_pos - s, 0.0)  # log σ(−s) = log σ(s) − s
    log_w = log_pos + (carry[:, None] + _exclusive_cumsum(log_neg))
    w = tl.where(keep, tl.exp(log_w), 0.0)
    return w, log_pos, carry + tl.sum(log_neg, 1)


@triton.jit
def map_grad(w, log_pos, gv, keep, dd, later):
    """(dL/ds [M, N], the next ``later``) given g = dO·vᵀ: dL/ds_ik = w_ik·g_ik − σ(s_ik)·A_ik,
    A_ik = D_i − Σ_{j>k} w_ij·g_ij; ``later`` [M] is Σ w·g over the keys already passed and
    ``dd`` [M] is D = Σ_j w_ij·g_ij over the row (`_row_sums`), both float64."""
    wg = w * gv
    wg64 = wg.to(tl.float64)
    a = ((dd - later)[:, None] - (tl.cumsum(wg64, 1) - wg64)).to(tl.float32)
    ds = wg - tl.exp(log_pos) * a
    return tl.where(keep, ds, 0.0), later + tl.sum(wg64, 1)


@triton.jit
def _key_blocks(start_m, lk, diag, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """How many key blocks (from key 0) hold a key that rows start_m.. start_m + BLOCK_M − 1
    may see: those up to the last row's diagonal."""
    hi = tl.minimum(lk, start_m + BLOCK_M + diag)
    return (tl.maximum(hi, 0) + BLOCK_N - 1) // BLOCK_N


@triton.jit
def _block_weights(q, do, k_ptr, v_ptr, mask_ptr, skb, skh, skn, skd, svb, svh, svn, svd,
                   smb, smh, smm, smn, b, h, hk, offs_m, offs_n, offs_d, offs_e, lq, lk, d, dv,
                   diag, scale, carry, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """One key block of the backward's walks (both take it from here, so their weights and g
    are the same numbers): (k [N, D], keep, w as the forward's out took it (rounded to v's
    dtype), log σ(s), g = dO·vᵀ [M, N], the next carry)."""
    k = tile(k_ptr, skb, skh, skn, skd, b, hk, offs_n, offs_d, lk, d)  # [N, D]
    v = tile(v_ptr, svb, svh, svn, svd, b, hk, offs_n, offs_e, lk, dv)  # [N, Dv]
    keep = visible(offs_m, offs_n, lq, lk, diag, mask_ptr, smb, smh, smm, smn, b, h, True, HAS_MASK)
    s = tl.where(keep, tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale, 0.0)
    w, log_pos, carry = _weights(s, keep, carry)
    w = w.to(v.dtype).to(tl.float32)
    gv = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    return k, keep, w, log_pos, gv, carry


@triton.jit
def _row_sums(q, do, k_ptr, v_ptr, mask_ptr, skb, skh, skn, skd, svb, svh, svn, svd,
              smb, smh, smm, smn, b, h, hk, offs_m, offs_d, offs_e, lq, lk, d, dv, diag,
              scale, blocks, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """D_i = Σ_j w_ij·g_ij over the keys the rows see, float64 [M]: the backward's first walk,
    the same blocks in the same order with the very weights and g of the second
    (`_block_weights`), so that D − Σ_{j>k} w·g, tiny at the far keys, holds no rounding of D."""
    carry = tl.zeros([BLOCK_M], dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float64)
    for t in range(0, blocks):
        offs_n = (blocks - 1 - t) * BLOCK_N + (BLOCK_N - 1) - tl.arange(0, BLOCK_N)
        _, _, w, _, gv, carry = _block_weights(q, do, k_ptr, v_ptr, mask_ptr, skb, skh, skn,
                                               skd, svb, svh, svn, svd, smb, smh, smm, smn, b,
                                               h, hk, offs_m, offs_n, offs_d, offs_e, lq, lk,
                                               d, dv, diag, scale, carry, HAS_MASK, PRECISION)  # fmt: skip
        total += tl.sum((w * gv).to(tl.float64), 1)
    return total


#: the sizes, which differ from call to call: not specialised (one compilation serves every
#: sequence length; the strides still are, for the loads)
SIZES = ["heads", "group", "lq", "lk", "d", "dv", "diag"]


@triton.jit(do_not_specialize=SIZES + ["split_out", "split_rows", "split_blocks"])
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, carry_ptr,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    smb, smh, smm, smn,
    sob, soh, som, sod,
    heads, group, lq, lk, d, dv, diag, scale, split_out, split_rows, split_blocks,
    HAS_MASK: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """out (float32) of one block of query rows. With SPLIT (decoding, `_split_forward`) the
    program walks only the ``split_blocks`` key blocks of split ``program_id(2)``, its own
    stick from its nearest key (the carry starts at 0 there), and writes its partial out and
    its Σ log σ(−s) over its allowed keys (contiguous [B, H, Lq]) at ``split_out`` and
    ``split_rows`` times the split past ``out_ptr`` and ``carry_ptr``."""
    start_m, b, h, hk, offs_m, offs_d, offs_e, in_m, q = query_block(
        q_ptr, sqb, sqh, sqm, sqd, heads, group, lq, d, BLOCK_M, D_PAD, DV_PAD
    )
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    carry = tl.zeros([BLOCK_M], dtype=tl.float32)
    blocks = _key_blocks(start_m, lk, diag, BLOCK_M, BLOCK_N)
    first = 0  # the first key block this program walks (it walks them last)
    if SPLIT:
        split = tl.program_id(2)
        first = split * split_blocks
        blocks = tl.minimum(blocks, first + split_blocks)
        out_ptr += split * split_out
        carry_ptr += split * split_rows
    for t in range(0, blocks - first):  # from the diagonal back, each block's nearest key first
        offs_n = (blocks - 1 - t) * BLOCK_N + (BLOCK_N - 1) - tl.arange(0, BLOCK_N)
        k = tl.load(
            k_ptr + b * skb + hk * skh + offs_n[None, :] * skn + offs_d[:, None] * skd,
            mask=(offs_n[None, :] < lk) & (offs_d[:, None] < d),
            other=0.0,
        )  # kᵀ [D, N]
        keep = visible(
            offs_m, offs_n, lq, lk, diag, mask_ptr, smb, smh, smm, smn, b, h, True, HAS_MASK
        )
        s = tl.where(keep, tl.dot(q, k, input_precision=PRECISION) * scale, 0.0)
        w, _, carry = _weights(s, keep, carry)
        v = tile(v_ptr, svb, svh, svn, svd, b, hk, offs_n, offs_e, lk, dv)
        acc += tl.dot(w.to(v.dtype), v, input_precision=PRECISION)
    if SPLIT:
        tl.store(carry_ptr + b * heads * lq + h * lq + offs_m, carry, mask=in_m)
    tl.store(
        out_ptr + b * sob + h * soh + offs_m[:, None] * som + offs_e[None, :] * sod,
        acc,
        mask=(offs_m[:, None] < lq) & (offs_e[None, :] < dv),
    )


@triton.jit(do_not_specialize=["heads", "lq", "dv", "splits", "split_rows"])
def _combine_kernel(
    part_ptr, carry_ptr, out_ptr,
    sps, spb, sph, spm, spd,
    sob, soh, som, sod,
    heads, lq, dv, splits, split_rows,
    BLOCK_M: tl.constexpr, DV_PAD: tl.constexpr,
):  # fmt: skip
    """out of one block of query rows from the ``splits`` partial outs of the split forward
    (float32 ``[splits, B, H, Lq, Dv]``, strides sps, spb, sph, spm, spd) and their carries
    (contiguous ``[splits, B, H, Lq]``, ``split_rows`` apart): a split's weights are what its
    own stick gave times the stick the later (nearer) splits left, so out_i = Σ_s out_s,i ·
    exp(Σ_{s' > s} carry_s',i), the splits taken from the last."""
    b, h, offs_m, offs_e, in_m, inside, rows = combine_block(heads, lq, dv, BLOCK_M, DV_PAD)
    part_ptr += b * spb + h * sph + offs_m[:, None] * spm + offs_e[None, :] * spd
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    later = tl.zeros([BLOCK_M], dtype=tl.float32)  # Σ log σ(−s) over the nearer splits
    for t in range(0, splits):
        split = splits - 1 - t
        part = tl.load(part_ptr + split * sps, mask=inside, other=0.0)
        acc += tl.exp(later)[:, None] * part
        later += tl.load(carry_ptr + split * split_rows + rows, mask=in_m, other=0.0)
    tl.store(
        out_ptr + b * sob + h * soh + offs_m[:, None] * som + offs_e[None, :] * sod,
        acc,
        mask=inside,
    )


@triton.jit(do_not_specialize=SIZES + ["kv_heads"])
def _backward_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, do_ptr, dq_ptr, dk_ptr, dv_ptr,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    smb, smh, smm, smn,
    sgb, sgh, sgm, sgd,
    heads, kv_heads, group, lq, lk, d, dv, diag, scale,
    HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """dq of one block of query rows (contiguous [B, H, Lq, D]), and its share of dk and dv
    added into float32 buffers (contiguous [B, Hkv, Lk, ·]), in two walks over the key blocks:
    D (`_row_sums`), then the gradients."""
    start_m, b, h, hk, offs_m, offs_d, offs_e, in_m, q = query_block(
        q_ptr, sqb, sqh, sqm, sqd, heads, group, lq, d, BLOCK_M, D_PAD, DV_PAD
    )
    do = tile(do_ptr, sgb, sgh, sgm, sgd, b, h, offs_m, offs_e, lq, dv)
    rows = b * heads * lq + h * lq + offs_m
    blocks = _key_blocks(start_m, lk, diag, BLOCK_M, BLOCK_N)
    dd = _row_sums(q, do, k_ptr, v_ptr, mask_ptr, skb, skh, skn, skd, svb, svh, svn, svd,
                   smb, smh, smm, smn, b, h, hk, offs_m, offs_d, offs_e, lq, lk, d, dv, diag,
                   scale, blocks, HAS_MASK, BLOCK_M, BLOCK_N, PRECISION)  # fmt: skip
    dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    carry = tl.zeros([BLOCK_M], dtype=tl.float32)
    later = tl.zeros([BLOCK_M], dtype=tl.float64)
    for t in range(0, blocks):
        offs_n = (blocks - 1 - t) * BLOCK_N + (BLOCK_N - 1) - tl.arange(0, BLOCK_N)
        in_n = offs_n < lk
        k, keep, w, log_pos, gv, carry = _block_weights(q, do, k_ptr, v_ptr, mask_ptr, skb, skh,
                                                        skn, skd, svb, svh, svn, svd, smb, smh,
                                                        smm, smn, b, h, hk, offs_m, offs_n,
                                                        offs_d, offs_e, lq, lk, d, dv, diag,
                                                        scale, carry, HAS_MASK, PRECISION)  # fmt: skip
        ds, later = map_grad(w, log_pos, gv, keep, dd, later)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        keys = b * kv_heads * lk + hk * lk + offs_n
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION) * scale
        tl.atomic_add(
            dk_ptr + keys[:, None] * d + offs_d[None, :],
            dk,
            mask=in_n[:, None] & (offs_d[None, :] < d),
        )
        dvb = tl.dot(tl.trans(w.to(do.dtype)), do, input_precision=PRECISION)
        tl.atomic_add(
            dv_ptr + keys[:, None] * dv + offs_e[None, :],
            dvb,
            mask=in_n[:, None] & (offs_e[None, :] < dv),
        )
    tl.store(
        dq_ptr + rows[:, None] * d + offs_d[None, :],
        (dq * scale).to(dq_ptr.dtype.element_ty),
        mask=in_m[:, None] & (offs_d[None, :] < d),
    )


# ---------------------------------------------------------------------------------------------
# Launching


#: warps per program: with 4, every block size below spills registers in the backward
NUM_WARPS = 8


def _default_blocks(dtype: torch.dtype, d: int, dv: int) -> tuple[int, int]:
    """(query rows, keys) per block: the largest sizes whose kernels, with `NUM_WARPS` and a
    user mask, compile for sm_90 without register spills (ptxas's resource usage; not timed on
    a GPU): 16-bit (64, 32), at head dims above 64 (32, 64); float32 (its products on the
    FMA units, not tensor cores) (64, 32), at head dims above 64 (16, 32)."""
    wide = max(d, dv) > 64
    if dtype == torch.float32:
        return (16, 32) if wide else (64, 32)
    return (32, 64) if wide else (64, 32)


def _fits(blocks) -> bool:
    """Whether (rows, keys) per block suit the kernels: powers of 2 from 16 (tl.dot's smallest)
    to 128 (a tile's scores live in registers; the tiles' sizes, thousands, do not)."""
    return all(n is not None and 16 <= n <= 128 and n & (n - 1) == 0 for n in blocks)


class Launch:
    """What the kernels of one call share: sizes, the mask's broadcast strides, switches."""

    def __init__(self, q, k, v, masking: Masking, scale, diagonal, blocks):
        self.b, self.h, self.lq, self.d = q.shape
        self.hkv, self.lk, self.dv = k.shape[1], k.shape[2], v.shape[-1]
        self.group = self.h // self.hkv
        self.mask = None
        if masking.mask is not None:  # a view: uint8 of the same bytes, broadcast strides
            self.mask = masking.mask.expand(self.b, self.h, self.lq, self.lk).view(torch.uint8)
        self.diag, self.scale = int(diagonal), float(scale)
        self.blocks = blocks if blocks is not None and _fits(blocks) else None
        self.blocks = self.blocks or _default_blocks(q.dtype, self.d, self.dv)
        self.grid = (triton.cdiv(self.lq, self.blocks[0]), self.b * self.h)
        # float32 products in IEEE float32 (TF32 would cost float32 inputs 3 decimal digits)
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        self.switches = dict(
            HAS_MASK=self.mask is not None,
            BLOCK_M=self.blocks[0],
            BLOCK_N=self.blocks[1],
            D_PAD=pad(self.d),
            DV_PAD=pad(self.dv),
            PRECISION=precision,
            num_warps=NUM_WARPS,
        )

    def mask_args(self, any_tensor: Tensor):
        if self.mask is None:  # any pointer: never read
            return any_tensor, (0, 0, 0, 0)
        return self.mask, self.mask.stride()


def forward(launch: Launch, q, k, v) -> Tensor:
    """out ``[B, H, Lq, Dv]`` in float32; a decoding call may split the keys
    (`template.key_splits`, `_split_forward`)."""
    out = torch.empty(
        launch.b, launch.h, launch.lq, launch.dv, dtype=torch.float32, device=q.device
    )
    splits = key_splits(launch)
    if splits > 1:
        _split_forward(launch, q, k, v, out, splits)
        return out
    mask, ms = launch.mask_args(out)
    _forward_kernel[launch.grid](
        q, k, v, mask, out, out,  # (no carry written)
        *q.stride(), *k.stride(), *v.stride(), *ms, *out.stride(),
        launch.h, launch.group, launch.lq, launch.lk, launch.d, launch.dv, launch.diag,
        launch.scale, 0, 0, 0, SPLIT=False, **launch.switches,
    )  # fmt: skip
    return out


def _split_forward(launch: Launch, q, k, v, out, splits: int) -> None:
    """The forward of a decoding call in two launches, as `template`'s: `_forward_kernel` over
    (query blocks of `SPLIT_BLOCK_M` rows, B·H, ``splits``), each program's partial out and
    carry in float32 scratch (``[splits, B, H, Lq, Dv]`` and ``[splits, B, H, Lq]``), then
    `_combine_kernel` into ``out``."""
    b, h, lq, dv = launch.b, launch.h, launch.lq, launch.dv
    per = triton.cdiv(triton.cdiv(launch.lk, launch.blocks[1]), splits)  # key blocks a split
    part = torch.empty(splits, b, h, lq, dv, dtype=torch.float32, device=q.device)
    carry = torch.zeros(splits, b, h, lq, dtype=torch.float32, device=q.device)
    mask, ms = launch.mask_args(out)
    blocks = triton.cdiv(lq, SPLIT_BLOCK_M)
    switches = dict(launch.switches, BLOCK_M=SPLIT_BLOCK_M)
    _forward_kernel[(blocks, b * h, splits)](
        q, k, v, mask, part, carry,
        *q.stride(), *k.stride(), *v.stride(), *ms, *part.stride()[1:],
        h, launch.group, lq, launch.lk, launch.d, dv, launch.diag, launch.scale,
        part.stride(0), b * h * lq, per, SPLIT=True, **switches,
    )  # fmt: skip
    _combine_kernel[(blocks, b * h)](
        part, carry, out, *part.stride(), *out.stride(), h, lq, dv, splits, b * h * lq,
        BLOCK_M=SPLIT_BLOCK_M, DV_PAD=launch.switches["DV_PAD"],
    )  # fmt: skip


def backward(launch: Launch, q, k, v, g):
    """(dq, dk, dv) in the inputs' dtypes."""
    dq = torch.empty(launch.b, launch.h, launch.lq, launch.d, dtype=q.dtype, device=q.device)
    dk = torch.zeros(
        launch.b, launch.hkv, launch.lk, launch.d, dtype=torch.float32, device=q.device
    )
    dv = torch.zeros(
        launch.b, launch.hkv, launch.lk, launch.dv, dtype=torch.float32, device=q.device
    )
    mask, ms = launch.mask_args(dk)
    _backward_kernel[launch.grid](
        q, k, v, mask, g, dq, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *ms, *g.stride(),
        launch.h, launch.hkv, launch.group, launch.lq, launch.lk, launch.d, launch.dv,
        launch.diag, launch.scale, **launch.switches,
    )  # fmt: skip
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class TritonStick(torch.autograd.Function):
    """Stick-breaking attention through the kernels above, gradients for q, k and v."""

    @staticmethod
    def forward(ctx, q, k, v, masking, scale, diagonal, blocks):
        q, k, v = unit_last(q), unit_last(k), unit_last(v)
        launch = Launch(q, k, v, masking, scale, diagonal, blocks)
        out = forward(launch, q, k, v)
        ctx.save_for_backward(q, k, v)
        ctx.launch = launch
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        g = unit_last(g.to(v.dtype))  # dO in the inputs' dtype for the products
        return (*backward(ctx.launch, q, k, v, g), None, None, None, None)


def stick_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masking: Masking,
    scale: float,
    diagonal: int,
    blocks: tuple[int | None, int | None] | None = None,
) -> Tensor:
    """Stick-breaking attention ``[B, H, Lq, Dv]`` in q's dtype: query i takes keys j <= i +
    ``diagonal`` inside ``masking``'s user mask (the causal edge is in ``diagonal``); ``blocks``
    (query rows, keys) per block when both are powers of 2 from 16 to 128, else the defaults
    (`_default_blocks`)."""
    return TritonStick.apply(q, k, v, masking, scale, diagonal, blocks)
