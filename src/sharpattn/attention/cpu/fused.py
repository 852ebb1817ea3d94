"""Fused attention paths: softmax-family normalizers without an ``[Lq, Lk]`` score matrix.

Each path runs torch's flash-attention kernel and moves the normalizer's maths outside it, so
extra memory is O(n):

* **query scaling** — softmax(f_i·s_ij) for a per-row/per-head factor f (1/θ, s·log n,
  1 + c·log n, Llama 4's and Qwen's β(n)): multiply row i of q by f_i, one fused call.
* **adaptive temperature** (Veličković et al., App. G) — a statistics pass over key tiles gives
  each row's entropy H_i (`softmax_entropy`, no p·V); β_i = β(H_i) scales q_i and one
  fused pass gives the output. On the CPU with the C++ loops, calls without a user mask or
  statistics take `adaptive_tiled` instead (one q·kᵀ for both).
* **sinks** — exp(s_i)/(exp(b) + Σ_j exp(s_j)) = softmax(s)_i·σ(lse − b): the softmax output
  times one factor per row. Its backward is the flash backward with lse replaced by
  log(exp(b) + Σ_j exp(s_j)) (a virtual key with score b and value 0). On CUDA the Triton
  kernel's lse carries the gradient instead; where neither runs, the virtual key is made real: `sink_as_key` appends it to k
  and v (one more head column carries b) and calls torch's public SDPA, fused on every device.

The kernel is the private ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` (returns
``(output, logsumexp)``; has autograd for the output, none for lse). On a CUDA tensor where
triton imports (`devices.triton_ready`) the passes that need the log-sum-exp (the sink,
adaptive's entropy, statistics) take the Triton softmax kernel instead
(`triton.softmax_attention`, lse differentiable), and the ones that do not, SDPA.
Where neither is there (another torch version, value size != key size on the CPU, CUDA without
triton) the paths fall back to `chunked_softmax_attention` (query blocks, O(block·Lk)).

Masks: the kernel takes an additive float mask (broadcast shapes accepted, so a padding mask
``[B, 1, 1, Lk]`` costs O(Lk)) and a top-left ``is_causal``. Our causal is bottom-right aligned:
Lq = Lk uses ``is_causal``; Lq > Lk drops the first Lq − Lk rows (they see no key) and uses
``is_causal``; Lk − Lq <= Lq prepends Lk − Lq dummy query rows (at most 2x the work) and uses
``is_causal``; Lk − Lq > Lq (short query blocks on a long cache, e.g. decoding) passes the
explicit ``[Lq, Lk]`` mask. A per-row user mask is passed as a float mask of its own shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...normalizers._contract import as_4d, compute_dtype
from ...normalizers.families import Kernel
from ..devices import backend, triton_kernels
from ..masking import Masking
from ..reference.chunked import chunked_softmax_attention
from ..stats import AttentionStats, row_stats
from . import decoding, native
from .tiles import BUFFERED_TILE_ELEMENTS, LN2, LOG2E, Grid

Tensor = torch.Tensor

_FLASH_NAME = "_scaled_dot_product_flash_attention_for_cpu"


def _private_op(name: str):
    try:
        return getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None


_FLASH = _private_op(_FLASH_NAME)
_FLASH_BWD = _private_op(_FLASH_NAME + "_backward")


def unit_stride(x: Tensor) -> Tensor:
    """``x`` with stride 1 in its last dimension (a copy only where it is not): the CPU flash
    kernel reads each row of q, k, v and its gradient as contiguous memory and returns wrong
    numbers, silently, for a transposed or sliced last dimension (torch's public SDPA copies
    too). Other strides (heads-last views, expanded batch or heads, offsets) it reads right."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def flash_kernel_available() -> bool:
    """Whether this torch build has the private CPU flash kernel (with log-sum-exp) and its
    backward, which the softmax family's fused paths call."""
    return _FLASH is not None and _FLASH_BWD is not None


def flash_available(q: Tensor, v: Tensor) -> bool:
    """True when the private CPU flash kernel (with log-sum-exp) can run these inputs."""
    return (
        flash_kernel_available()
        and q.device.type == "cpu"
        and q.shape[-1] == v.shape[-1]
        # the kernel kills the process (SIGFPE) on a zero-size dimension: those take the fallback
        and q.numel() > 0
        and v.numel() > 0
    )


# ---------------------------------------------------------------------------------------------
# The kernel call with our mask conventions


@dataclass(frozen=True)
class _Layout:
    lq: int  # query rows of the call
    pre: int  # dummy query rows prepended (causal, Lq < Lk)
    drop: int  # leading query rows left out (causal, Lq > Lk: they see no key)
    is_causal: bool
    mask: Tensor | None  # additive float mask for the kernel


def _layout(masking: Masking, dtype: torch.dtype) -> _Layout:
    m, pre, drop, is_causal = masking.mask, 0, 0, False
    if masking.causal:
        off = masking.offset
        if off <= masking.lq:
            is_causal = True
            pre, drop = max(off, 0), max(-off, 0)
            if masking.per_row and drop:
                m = m[..., drop:, :]
            elif masking.per_row and pre:  # the dummy rows' mask is irrelevant: they are dropped
                m = torch.cat([m[..., :1, :].expand(*m.shape[:-2], pre, m.shape[-1]), m], dim=-2)
        else:  # Lq < Lk / 2: an explicit bottom-right mask is cheaper than Lk − Lq dummy rows
            m = masking.dense()
    add = None
    if m is not None:
        add = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, float("-inf"))
    return _Layout(masking.lq, pre, drop, is_causal, add)


def _rows_in(x: Tensor, lay: _Layout) -> Tensor:
    """Lay out a ``[.., Lq | 1, ·]`` row tensor (q, a per-row bias) as the kernel sees it."""
    if x.shape[-2] == 1 and lay.lq != 1:  # broadcast over the rows (with Lq = 1 it is a row)
        return x
    if lay.drop:
        x = x[..., lay.drop :, :]
    if lay.pre:
        x = torch.cat([x.new_zeros(*x.shape[:-2], lay.pre, x.shape[-1]), x], dim=-2)
    return x


def _rows_out(x: Tensor, lay: _Layout) -> Tensor:
    """Undo `_rows_in` on a kernel result ``[B, H, Lq', ·]`` (dropped rows come back as 0)."""
    if lay.pre:
        x = x[..., lay.pre :, :]
    if lay.drop:
        x = torch.cat([x.new_zeros(*x.shape[:-2], lay.drop, x.shape[-1]), x], dim=-2)
    return x


def softmax_attention(
    q: Tensor, k: Tensor, v: Tensor, masking: Masking, scale: float
) -> tuple[Tensor, Tensor]:
    """softmax(scale·q·kᵀ)·v ``[B, H, Lq, Dv]`` and log-sum-exp ``[B, H, Lq, 1]`` (float32 for
    16-bit inputs), O(n) memory. lse is 0 here on rows with no visible key ([`AttentionStats`][sharpattn.attention.AttentionStats]
    reports −inf, the log of an empty sum) and carries no gradient
    on the kernel path (differentiable on the fallback)."""
    if _on_triton(q, k):
        out, lse = triton_kernels().softmax_attention(q, k, v, masking, scale)
        return out.to(q.dtype), torch.where(torch.isinf(lse), 0.0, lse)
    qw, kw, vw = one_head_size(q, k, v)
    if not flash_available(qw, vw):
        return chunked_softmax_attention(q, k, v, masking, scale)
    lay = _layout(masking, q.dtype)
    qw, kw, vw = unit_stride(_rows_in(qw, lay)), unit_stride(kw), unit_stride(vw)
    out, lse = _FLASH(qw, kw, vw, 0.0, lay.is_causal, attn_mask=lay.mask, scale=scale)
    return _rows_out(out[..., : v.shape[-1]], lay), _rows_out(lse.unsqueeze(-1), lay)


def one_head_size(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v with one head size where q's and v's differ (linear position biases add
    columns to q and k only, `positions.bias_columns`): all three zero-padded to a multiple of
    `KEY_ALIGN` at least as large as both. torch's fused kernels take one head size, and
    choose the O(n²)-memory reference path otherwise; zero columns change no score, and the
    output's padded columns (0) are cut by the caller. As they are where the sizes agree."""
    d, dv = q.shape[-1], v.shape[-1]
    if d == dv:
        return q, k, v
    width = -(-max(d, dv) // KEY_ALIGN) * KEY_ALIGN
    return F.pad(q, (0, width - d)), F.pad(k, (0, width - d)), F.pad(v, (0, width - dv))


#: the kernel record of softmax with its log-sum-exp (a Triton kernel; on the CPU and where it
#: cannot run, torch's flash attention and the block passes here)
SOFTMAX_LSE = Kernel("softmax", triton=True)


def _on_triton(q: Tensor, k: Tensor) -> bool:
    """Whether the softmax passes that need the log-sum-exp run the Triton kernel
    (`devices.backend`; not on an empty tensor)."""
    return q.numel() > 0 and k.numel() > 0 and backend(SOFTMAX_LSE, q.device, q.dtype) == "triton"


def softmax_output(q: Tensor, k: Tensor, v: Tensor, masking: Masking, scale: float) -> Tensor:
    """softmax(scale·q·kᵀ)·v only: the kernel, else torch's public SDPA (no lse needed), with
    one head size for q, k and v (`one_head_size`) so that SDPA keeps a fused kernel."""
    qw, kw, vw = one_head_size(q, k, v)
    if flash_available(qw, vw) or q.numel() == 0 or v.numel() == 0:  # empty: the block fallback
        return softmax_attention(q, k, v, masking, scale)[0]
    gqa = k.shape[1] != q.shape[1]
    dv = v.shape[-1]
    if masking.causal and masking.mask is None and masking.offset == 0:
        out = F.scaled_dot_product_attention(
            qw, kw, vw, is_causal=True, scale=scale, enable_gqa=gqa
        )
        return out[..., :dv]
    mask = masking.dense()
    out = F.scaled_dot_product_attention(qw, kw, vw, attn_mask=mask, scale=scale, enable_gqa=gqa)
    out = out[..., :dv]
    if mask is not None:  # rows with no visible key: 0, as in every other path
        out = out.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return out


def softmax_entropy(
    q: Tensor, k: Tensor, masking: Masking, scale: float, blocks=(None, None)
) -> tuple[Tensor, Tensor]:
    """Streamed entropy of p = softmax(scale·q·kᵀ) per row, and its lse, each ``[B, H, Lq, 1]``.

    One pass over key tiles that keeps, per row, a running maximum m, Z = Σ_j e^{s_j − m} and
    A = Σ_j e^{s_j − m}·(s_j − m) (App. G's statistics without p·V): H = log Z − A/Z, a sum of
    two non-negative terms (no cancellation), lse = m + log Z. Computed in base 2 (the scale
    folded into q carries log₂ e) in float32 for 16-bit inputs. The backward recomputes each
    tile: dH_i/ds_ij = −p_ij·(log p_ij + H_i) (3 matrix products per tile, against the flash
    backward's 5). lse carries no gradient; it is 0 for rows with no visible key (as the flash
    kernel's; [`AttentionStats`][sharpattn.attention.AttentionStats] reports −inf there).

    It is the exact entropy −Σ p·log p; the reference code's −Σ p·log(p + ε), ε = 1e-9, is below
    it by Σ_j p_j·log(1 + ε/p_j) ∈ [0, n·ε] (n visible keys; 3.3e-5 at n = 32k).
    """
    if q.numel() == 0 or k.numel() == 0:
        zero = torch.zeros(*q.shape[:3], 1, dtype=compute_dtype(q.dtype), device=q.device)
        return zero + 0.0 * (q.sum() + k.sum()), zero
    if _on_triton(q, k):
        return _entropy_by_values(q, k, masking, scale)
    h, lse = _EntropyPass.apply(q, k, masking, scale, blocks)
    return h, lse


def _entropy_by_values(q: Tensor, k: Tensor, masking: Masking, scale: float):
    """`softmax_entropy` on CUDA from one softmax call with the keys as values: s is linear in
    k, so Σ_j p_j·s_j = scale·q·(Σ_j p_j·k_j), and H = lse − Σ_j p_j·s_j (the Triton kernel's
    lse and output, float32, both differentiable: gradients through H need no pass of their
    own). The difference loses |s|·2⁻²⁴ or so to rounding (1e-5 nats at scores of 100)."""
    out, lse = triton_kernels().softmax_attention(q, k, k, masking, scale)
    seen = torch.isfinite(lse)
    lse = torch.where(seen, lse, 0.0)
    mean = scale * torch.linalg.vecdot(q.to(torch.float32), out).unsqueeze(-1)  # Σ_j p_j·s_j
    h = torch.where(seen, lse - mean, 0.0).clamp_min(0.0)
    return h, lse.detach()


def _entropy_forward(grid: Grid):
    """Per row (B, H, Lq, 1): the shift m (base 2), Z and a = A/Z, from one pass over the tiles."""
    shape = (grid.b, grid.h, grid.lq, 1)
    big = torch.finfo(grid.dtype).max
    m = torch.full(shape, -big, dtype=grid.dtype, device=grid.q.device)  # -big: no key yet
    z = torch.zeros_like(m)
    a = torch.zeros_like(m)
    for r0, r1 in grid.row_blocks():
        qb = grid.q_rows(r0, r1)
        # the block's running values, contiguous (one layout for every call: no recompiling)
        mb, zb, ab = (x[..., r0:r1, :].contiguous() for x in (m, z, a))
        for t in grid.tiles(r0, r1):
            s = grid.scores(qb, t)  # base-2 scores: log₂ e folded into q
            ends = grid.prefix(t) if grid.native else None
            if grid.native and native.usable(ends, t.masked, s, mb, zb, ab):
                native.entropy_forward(s, ends, mb, zb, ab)  # in place, one loop per row
                continue
            mb, zb, ab = entropy_tile(s, grid.keep(t), mb, zb, ab, big)
        m[..., r0:r1, :], z[..., r0:r1, :], a[..., r0:r1, :] = mb, zb, ab
    empty = z == 0
    z1 = torch.where(empty, torch.ones_like(z), z)
    return torch.where(empty, torch.zeros_like(m), m), z1, a / z1, empty


def entropy_tile(s: Tensor, keep: Tensor | None, m: Tensor, z: Tensor, a: Tensor, big: float):
    """One tile's update of the running (m, Z, A) of `_entropy_forward`: the new values
    (``s``, the tile's base-2 scores, is scratch; m, Z, A are not written). Not compiled: with
    ``torch.compile`` it gave wrong values (NaN) under ``ATEN_CPU_CAPABILITY=avx2`` on an AVX-512
    CPU while right on torch's own path, a cause not yet found (and it saved little: 1.90 → 1.78x
    SDPA's forward at n = 4,096)."""
    if keep is None:
        top = s.amax(-1, keepdim=True)
    else:  # disallowed scores -> 0, then −big for the maximum only
        s.mul_(keep)
        top = (s + (keep - 1.0) * big).amax(-1, keepdim=True)
    m_new = torch.maximum(m, top)
    seen_old, seen = m > -big, m_new > -big
    shift = torch.where(seen, m_new, torch.zeros_like(m_new))
    delta = torch.where(seen_old, m_new - m, torch.zeros_like(m))  # >= 0
    f = torch.where(seen_old, torch.exp2(-delta), torch.zeros_like(m))
    x = s.sub_(shift)  # <= 0 at allowed keys
    if keep is not None:  # a disallowed key's 0 − shift can be > 0: no overflow there
        x.clamp_max_(0.0)
    e = torch.exp2(x)
    if keep is not None:
        e.mul_(keep)
    a_new = (a - delta * z) * f + torch.linalg.vecdot(e, x).unsqueeze(-1)
    return m_new, z * f + e.sum(-1, keepdim=True), a_new


class _EntropyPass(torch.autograd.Function):
    """(H, lse) of softmax(scale·q·kᵀ) per row from tiles; the backward recomputes them."""

    @staticmethod
    def forward(ctx, q, k, masking, scale, blocks):
        grid = Grid(
            q,
            k,
            k,
            masking,
            scale * LOG2E,
            *blocks,
            fold_scale=True,
            budget=BUFFERED_TILE_ELEMENTS,
            reuse=True,
        )
        m, z, a, empty = _entropy_forward(grid)
        log2z = torch.log2(z)
        h = (LN2 * (log2z - a)).masked_fill_(empty, 0.0)  # nats; >= 0 up to rounding
        lse = (LN2 * (m + log2z)).masked_fill_(empty, 0.0)
        ctx.save_for_backward(q, k, m, z, a)
        ctx.masking, ctx.scale, ctx.blocks = masking, scale, blocks
        ctx.mark_non_differentiable(lse)
        return h.clamp_min_(0.0), lse

    @staticmethod
    def backward(ctx, gh, _glse):
        q, k, m, z, a = ctx.saved_tensors
        grid = Grid(q, k, k, ctx.masking, ctx.scale * LOG2E, *ctx.blocks, fold_scale=True)
        dq = torch.zeros_like(grid.q)
        dk = torch.zeros(grid.k.shape[:2] + grid.k.shape[3:], dtype=grid.dtype, device=dq.device)
        # dH/ds_j = −p_j·(log p_j + H) = −ln2·p_j·(x_j − a), x = s₂ − m (base 2), p = 2^x/Z
        coef = gh.to(grid.dtype) * (-LN2) / z
        for r0, r1 in grid.row_blocks():
            qb, dqb = grid.q_rows(r0, r1), dq[..., r0:r1, :]
            mb, ab, cb = m[..., r0:r1, :], a[..., r0:r1, :], coef[..., r0:r1, :]
            if grid.native:
                mb, ab, cb = mb.contiguous(), ab.contiguous(), cb.contiguous()
            for t in grid.tiles(r0, r1):
                s = grid.scores(qb, t)
                ends = grid.prefix(t) if grid.native else None
                if grid.native and native.usable(ends, t.masked, s, mb, ab, cb):
                    ds = native.entropy_backward(s, ends, mb, ab, cb)  # one loop per row
                else:
                    keep = grid.keep(t)
                    if keep is not None:
                        s.mul_(keep)
                    x = s.sub_(mb)
                    if keep is not None:
                        x.clamp_max_(0.0)
                    p = torch.exp2(x)
                    if keep is not None:
                        p.mul_(keep)
                    ds = x.sub_(ab).mul_(p).mul_(cb)  # dL/ds (natural-log scores)
                ds5 = grid.grouped(ds)
                kt = grid.k[..., t.c0 : t.c1, :]
                dqb.add_(torch.matmul(ds5, kt), alpha=ctx.scale)
                # q carries scale·log₂ e: dk = Σ_i ds_ij·scale·q_i
                dk[..., t.c0 : t.c1, :].add_(
                    torch.matmul(ds5.transpose(-2, -1), qb).sum(2), alpha=1.0 / LOG2E
                )
        return grid.heads(dq).to(q.dtype), dk.to(k.dtype), None, None, None


# ---------------------------------------------------------------------------------------------
# Query scaling: softmax(f_i·s_ij)


def row_tensor(factor, q: Tensor) -> Tensor:
    """A scalar or tensor factor as a ``[B|1, H|1, Lq|1, 1]`` tensor in q's compute dtype; a
    number by a fill on q's device (``torch.as_tensor`` of a number to a CUDA device is a
    copy from the host that synchronises)."""
    cd = compute_dtype(q.dtype)
    if not torch.is_tensor(factor):
        return torch.full((1, 1, 1, 1), float(factor), dtype=cd, device=q.device)
    factor = factor.to(device=q.device, dtype=cd)
    return as_4d(factor)


def positive_scale(q: Tensor, scale: float) -> tuple[Tensor, float]:
    """(q', scale') with scale'·q'·kᵀ = scale·q·kᵀ and scale' > 0: a scale <= 0 is carried by
    q (−q for a negative one, exact; q·0 for 0), since torch's CPU flash kernel gives NaN under
    a causal mask with a non-positive scale, and the paths that append score columns divide
    by the scale. ``scale`` is a Python number (no host synchronisation)."""
    if not scale <= 0:  # NaN too: left as it is
        return q, scale
    if scale < 0:
        return -q, -scale
    return q * 0.0, 1.0


def query_scaled(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masking: Masking,
    scale: float,
    factor,
    want_stats: bool,
    **extra_stats,
) -> tuple[Tensor, AttentionStats | None]:
    """softmax(f_i·s_ij) attention, s = scale·q·kᵀ, f a float or a tensor broadcastable to
    ``[B, H, Lq, 1]``: the rows of q carry f, then one fused call."""
    if torch.is_tensor(factor):
        ct = torch.promote_types(compute_dtype(q.dtype), factor.dtype)
        qs, sc = (q.to(ct) * (scale * factor.to(ct))).to(q.dtype), 1.0  # (B, H, Lq, D)
    else:
        qs, sc = positive_scale(q, scale * float(factor))  # β <= 0 is legal
    if decoding.applies(q, k, v, masking, want_stats, (factor,)):  # one pass over the cache
        return decoding.step("softmax", 0.0, 0.0, qs, k, v, masking, sc)[0].to(q.dtype), None
    if not want_stats:
        return softmax_output(qs, k, v, masking, sc), None
    out, lse = softmax_attention(qs, k, v, masking, sc)
    h, _ = softmax_entropy(qs, k, masking, sc)  # entropy of the returned weights
    one = torch.ones_like(h)
    beta = row_tensor(factor, q) * one
    return out, _stats(q, masking, entropy=h, mass=one, lse=lse, beta=beta, **extra_stats)


def _stats(q: Tensor, masking: Masking, **fields) -> AttentionStats:
    return row_stats(q.shape[:3], masking.visible_keys(), **fields)


def row_scaled(family, q, k, v, masking, scale, want_stats, **params):
    """The fast path of a `RowScaled` method:
    softmax(β_i·s_ij) with β = ``family.beta(n, **params)`` of the rows' visible keys n, folded
    into the rows of q (one fused call)."""
    n = masking.visible_keys(dtype=compute_dtype(q.dtype)) if family.counts else None
    beta = family.beta_of(n, (*q.shape[:3], 1), **params)
    return query_scaled(q, k, v, masking, scale, beta, want_stats)


# ---------------------------------------------------------------------------------------------
# Adaptive temperature


def adaptive(family, q, k, v, masking, scale, want_stats, **params):
    """The fast path of an `Adaptive` method in two passes (see the module docstring): β_i =
    ``family.beta(H_i, **params)`` with H_i the exact entropy of softmax(s)_i
    (`softmax_entropy`); then softmax(β_i·s_ij)·v with β_i folded into q_i. Gradients flow
    through β (adaptive's ``detach_beta`` stops them in its hook)."""
    h, _ = softmax_entropy(q, k, masking, scale)  # (B, H, Lq, 1)
    beta = family.beta_of(h, (*q.shape[:3], 1), **params)
    extra = {"softmax_entropy": h} if want_stats else {}
    return query_scaled(q, k, v, masking, scale, beta, want_stats, **extra)


# ---------------------------------------------------------------------------------------------
# Sinks: exp(s_i) / (exp(b) + Σ_j exp(s_j))


class _SinkAttention(torch.autograd.Function):
    """out_i = softmax(s_i)·v · σ(lse_i − b_i) on laid-out inputs, with the exact backward.

    The sink weights a_ij = exp(s_ij − L_i), L_i = log(exp(b_i) + Σ_j exp(s_ij)), are a softmax
    with one extra key (score b_i, value 0), so dL/ds_ij = a_ij·(g_i·v_j − g_i·out_i): the flash
    backward given L instead of lse and our output. dL/db_i = −(g_i·out_i)·(1 − σ(lse_i − b_i)).
    """

    @staticmethod
    def forward(ctx, q, k, v, b, add_mask, is_causal, scale):
        o, lse = _FLASH(q, k, v, 0.0, is_causal, attn_mask=add_mask, scale=scale)
        lse = lse.unsqueeze(-1)  # (B, H, Lq', 1), float32 for 16-bit inputs
        lse_sink = torch.logaddexp(lse, b.to(lse.dtype))  # log(exp(b) + Σ_j exp(s_j))
        w = torch.exp(lse - lse_sink)  # σ(lse − b)
        out = o.mul_(w.to(o.dtype))  # o itself is not needed again
        ctx.save_for_backward(q, k, v, out, lse_sink, w, add_mask)
        ctx.is_causal, ctx.scale, ctx.b_shape = is_causal, scale, b.shape
        return out, lse

    @staticmethod
    def backward(ctx, g, _g_lse):
        q, k, v, out, lse_sink, w, add_mask = ctx.saved_tensors
        g = g.contiguous()
        gq, gk, gv = _FLASH_BWD(
            g,
            q,
            k,
            v,
            out,
            lse_sink.squeeze(-1).contiguous(),
            0.0,
            ctx.is_causal,
            attn_mask=add_mask,
            scale=ctx.scale,
        )
        delta = (g.to(w.dtype) * out.to(w.dtype)).sum(-1, keepdim=True)  # g_i·out_i
        gb = (-delta * (1.0 - w)).sum_to_size(ctx.b_shape)
        return gq, gk, gv, gb, None, None, None


#: The head size of `sink_as_key`'s inputs is rounded up to a multiple of this: torch's
#: fused CUDA kernels (flash, memory-efficient) take head sizes in multiples of 8.
KEY_ALIGN = 8


def sink_key_fits(masking: Masking) -> bool:
    """Whether `sink_as_key` takes this masking with O(n) memory: no mask, a causal one
    whose queries end at the last key and see at least as many keys as there are queries
    beyond them (Lk − Lq <= Lq), or a user mask that is the same for every query row (padding);
    not a per-row mask or causal with a user mask (SDPA would need the dense ``[Lq, Lk]``)."""
    if masking.causal:
        return masking.mask is None and masking.offset <= masking.lq
    return not masking.per_row


def sink_as_key(q: Tensor, k: Tensor, v: Tensor, masking: Masking, scale: float, bias: Tensor):
    """Attention with a sink through torch's public SDPA, on any device: the sink is one more
    key, first in line, whose score is b_i and whose value is 0.

    q' = [q, b/scale, 0…], k' = [[0, 1, 0…], [k, 0, 0…]], v' = [[0…], [v, 0…]] (head size
    padded to `KEY_ALIGN`), so scale·q'·k'ᵀ gives the scores and b, and softmax over
    [sink, keys] gives exp(s_j)/(exp(b) + Σ exp(s)). Causal masks stay SDPA's top-left
    ``is_causal``: one dummy query row is prepended for the sink key, plus Lk − Lq for the
    bottom-right alignment (rows of a longer query that see no key are cut and come back 0).
    A padding mask gets an allowed sink column. Gradients, b's included, are SDPA's own.
    ``masking`` must pass `sink_key_fits`; ``bias`` is ``[B|1, H|1, Lq|1, 1]``."""
    b, h, lq, d = q.shape
    hk, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
    width = -(-max(d + 1, dv) // KEY_ALIGN) * KEY_ALIGN
    lay = _layout(masking, q.dtype)
    sink_row = 1 if masking.causal else 0  # the dummy row that sees only the sink key
    big = torch.finfo(q.dtype).max  # b/scale finite in q's dtype: a sink that large takes all
    col = (bias / scale).clamp(-big, big).to(q.dtype).expand(b, h, lq, 1)
    q2 = _rows_in(torch.cat([q, col, q.new_zeros(b, h, lq, width - d - 1)], dim=-1), lay)
    q2 = F.pad(q2, (0, 0, sink_row, 0))
    sink_key = k.new_zeros(b, hk, 1, width)
    sink_key[..., d] = 1.0
    k2 = torch.cat([sink_key, F.pad(k, (0, width - d))], dim=-2)
    v2 = torch.cat([v.new_zeros(b, hk, 1, width), F.pad(v, (0, width - dv))], dim=-2)
    add = lay.mask  # [B|1, H|1, 1, Lk|1] (a padding mask), with an allowed column for the sink
    if add is not None:
        add = F.pad(add.expand(*add.shape[:-1], lk), (1, 0))
    out = F.scaled_dot_product_attention(
        q2, k2, v2, attn_mask=add, is_causal=lay.is_causal, scale=scale, enable_gqa=hk != h
    )
    # rows that see no key (cut by _rows_in) come back 0: every weight is the sink's
    return _rows_out(out[..., sink_row:, :dv], lay)


def sink(family, q, k, v, masking, scale, want_stats, **params):
    """The fast path of a `Sink` method: weights exp(s_i)/(exp(b) + Σ_j exp(s_j)), b =
    ``family.bias(n, **params)`` of the rows' visible keys n (for the `sink` normalizer, b =
    bias + bias_log_n·log n; 0 is softmax+1).

    = softmax attention times σ(lse − b) per row.
    """
    n = masking.visible_keys(dtype=compute_dtype(q.dtype))
    bias = row_tensor(family.bias_of(n, (*q.shape[:3], 1), **params), q)
    if decoding.applies(q, k, v, masking, want_stats, (bias,)):  # one pass over the cache
        o, m, z = decoding.step("softmax", 0.0, 0.0, q, k, v, masking, scale)
        return (o * torch.sigmoid(m + torch.log(z) - bias)).to(q.dtype), None
    if _on_triton(q, k):  # a CUDA tensor: the Triton kernel's output and lse, both in float32
        o, lse = triton_kernels().softmax_attention(q, k, v, masking, scale)
        seen = torch.isfinite(lse)
        w = torch.where(seen, torch.sigmoid(torch.where(seen, lse, 0.0) - bias), 0.0)
        out = (o * w).to(q.dtype)
        lse = torch.where(seen, lse, 0.0).detach()
    elif flash_available(*(qkv := one_head_size(q, k, v))[::2]):
        lay = _layout(masking, q.dtype)
        qw, kw, vw = qkv
        q2, k2, v2 = unit_stride(_rows_in(qw, lay)), unit_stride(kw), unit_stride(vw)
        out, lse = _SinkAttention.apply(
            q2, k2, v2, _rows_in(bias, lay), lay.mask, lay.is_causal, scale
        )
        out, lse = _rows_out(out[..., : v.shape[-1]], lay), _rows_out(lse, lay)
        w = torch.sigmoid(lse.detach() - bias) if want_stats else None
    elif not want_stats and sink_key_fits(masking) and q.numel() > 0 and k.numel() > 0:
        return sink_as_key(q, k, v, masking, scale, bias), None
    else:
        o, lse = softmax_attention(q, k, v, masking, scale)  # no kernel: lse differentiable
        w = torch.sigmoid(lse - bias)  # (B, H, Lq, 1)
        out = (o * w).to(o.dtype)
    if not want_stats:
        return out, None
    h, _ = softmax_entropy(q, k, masking, scale)
    # a_j = w·p_j, so −Σ a_j·log a_j = w·(H(p) − log w)
    ent = w * (h - torch.log(w.clamp_min(torch.finfo(w.dtype).tiny)))
    return out, _stats(q, masking, entropy=ent, mass=w, lse=lse)
