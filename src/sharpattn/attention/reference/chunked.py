"""Query-block attention: any normalizer with O(block·Lk) extra memory, forward and backward.

Rows of attention are independent (a normalizer sees one row of scores at a time), so the
queries are cut into blocks; each block's scores ``[B, H, block, Lk]`` are made, normalised,
multiplied by v and dropped. Under a causal mask a block's scores stop at its last row's causal
edge: keys hidden from every row of the block are never computed. In training each block is recomputed in the backward pass
(activation checkpointing), so the backward's memory is O(block·Lk) too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from ...normalizers._contract import compute_dtype
from .. import policy
from ..masking import Masking
from ..stats import stats_from_weights

Tensor = torch.Tensor


def default_block_size(b: int, h: int, lk: int) -> int:
    """Query rows per block so that one block's scores hold about `policy.CHUNK_ELEMENTS`
    entries."""
    return max(16, policy.CHUNK_ELEMENTS // max(1, b * h * lk))


def run_blocks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masking: Masking,
    scale: float,
    block_size: int | None,
    weigh: Callable[[Tensor, Tensor | None, int], tuple[Tensor, ...]],
) -> list[Tensor]:
    """For each block of query rows r0..r1: ``weigh(scores, mask, r0) -> (weights, *extras)``.

    Returns ``[output, *extras]`` with the blocks concatenated along the query axis; output is
    ``[B, H, Lq, Dv]``, each extra ``[B, H, Lq, ·]``. Grouped-query heads are handled by viewing
    q as ``[B, Hkv, H/Hkv, Lq, D]`` (no copy of k or v).
    """
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = h // hkv
    if block_size is None:
        block_size = default_block_size(b, h, lk)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}.")
    cd = compute_dtype(q.dtype)  # scores in float32 for 16-bit inputs: no fp16 overflow
    qg = q.to(cd).reshape(b, hkv, g, lq, d)  # (B, Hkv, G, Lq, D)
    kt = k.to(cd).unsqueeze(2).transpose(-2, -1)  # (B, Hkv, 1, D, Lk)
    vg = v.unsqueeze(2)  # (B, Hkv, 1, Lk, Dv)

    def block(qb: Tensor, r0: int, r1: int) -> tuple[Tensor, ...]:
        # keys past the block's causal edge are hidden from every row: never computed
        e = masking.key_end(r1)
        scores = torch.matmul(qb, kt[..., :e]).mul(scale).view(b, h, r1 - r0, e)  # (B,H,blk,e)
        weights, *extras = weigh(scores, masking.rows(r0, r1, e), r0)
        w = weights.to(v.dtype).reshape(b, hkv, g, r1 - r0, e)
        out = torch.matmul(w, vg[..., :e, :]).reshape(b, h, r1 - r0, v.shape[-1])  # (B,H,blk,Dv)
        return (out, *extras)

    recompute = torch.is_grad_enabled() and block_size < lq
    parts = []
    for r0 in range(0, lq, block_size):
        r1 = min(r0 + block_size, lq)
        qb = qg[..., r0:r1, :]
        if recompute:
            parts.append(checkpoint(block, qb, r0, r1, use_reentrant=False))
        else:
            parts.append(block(qb, r0, r1))
    if not parts:  # Lq = 0
        parts = [block(qg[..., :0, :], 0, 0)]
    return [torch.cat(p, dim=2) for p in zip(*parts, strict=True)]


def chunked_attend(
    fn: Callable,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masking: Masking,
    scale: float,
    *,
    block_size: int | None = None,
    want_stats: bool = False,
    check_finite: bool = True,
    positional: bool = False,
    params: dict,
) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
    """Attention with normalizer ``fn`` block by block; with ``want_stats`` also the rows'
    (entropy, mass), each ``[B, H, Lq, 1]``.

    A ``positional`` normalizer, whose rows depend on the query's key position (it takes
    ``query_offset``, as ``stick_breaking`` does), is told where each block starts: the key
    position of the caller's first row (its ``query_offset``, default Lk − Lq) plus the block's
    first row. A per-query
    tensor parameter ``[B|1, H|1, Lq, 1]`` (Lq > 1; e.g. ASEntmax's in MultiheadAttention) is cut
    into the block's rows.
    """
    lq, lk = q.shape[2], k.shape[2]
    start = params.get("query_offset")  # the key position of query row 0 (default Lk − Lq)
    start = lk - lq if start is None else start
    if positional:
        params = {name: value for name, value in params.items() if name != "query_offset"}

    def weigh(scores, mask, r0):
        extra = {"query_offset": start + r0} if positional else {}  # this block's first row
        rows = _block_rows(params, lq, r0, r0 + scores.shape[-2])
        w = fn(scores, mask, check_finite=check_finite, **rows, **extra)
        return (w, *stats_from_weights(w)) if want_stats else (w,)

    out, *extras = run_blocks(q, k, v, masking, scale, block_size, weigh)
    return out, (tuple(extras) if want_stats else None)


def _block_rows(params: dict, lq: int, r0: int, r1: int) -> dict:
    """``params`` with every per-query tensor ``[.., Lq, 1]`` (Lq > 1) cut to rows r0..r1."""
    if lq <= 1:
        return params
    return {
        name: value[..., r0:r1, :]
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[-2] == lq
        else value
        for name, value in params.items()
    }


def chunked_softmax_attention(
    q: Tensor, k: Tensor, v: Tensor, masking: Masking, scale: float, block_size: int | None = None
) -> tuple[Tensor, Tensor]:
    """(softmax attention output ``[B, H, Lq, Dv]``, log-sum-exp ``[B, H, Lq, 1]``) block by block.

    The fallback of the fused paths where torch's flash kernel with log-sum-exp is missing.
    Empty rows (Lk = 0 included) give output 0 and lse 0 (as the flash kernel does; the public
    [`AttentionStats`][sharpattn.attention.AttentionStats] reports −inf, the log of an empty sum); lse is differentiable here.
    """

    def weigh(scores, mask, r0):
        s = scores.to(compute_dtype(scores.dtype))
        if mask is None and s.shape[-1] > 0:
            lse = torch.logsumexp(s, dim=-1, keepdim=True)
            return torch.exp(s - lse), lse
        allowed = torch.ones_like(s, dtype=torch.bool) if mask is None else mask.expand_as(s)
        row_any = allowed.any(dim=-1, keepdim=True)
        # empty rows get all-zero logits (finite lse and gradient), then are zeroed
        s = s.masked_fill(~allowed, float("-inf")).masked_fill(~row_any, 0.0)
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        p = torch.exp(s - lse).masked_fill(~allowed, 0.0)
        return p, lse.masked_fill(~row_any, 0.0)

    out, lse = run_blocks(q, k, v, masking, scale, block_size, weigh)
    return out, lse
