"""O(n)-memory attention for the sparse normalizers: sparsemax, 1.5-entmax, α-entmax, ASEntmax
and top-k, forward and backward, without an ``[Lq, Lk]`` score matrix.

Mechanism (chosen by measurement; costs in the README and ``benchmarks/sparse_tiled.py``): queries are cut into blocks of ``bq``
rows, and the block's scores over every key it may see, a ``[B, H, bq, Lk']`` slab of about
`policy.SPARSE_SLAB_ELEMENTS` entries, are made once (a causal block stops at its last visible key, as in
`Grid`) and normalised in place:

* y = (α−1)·θ·(s − max s) over the allowed keys (θ = 1 except for ASEntmax), clamped at −2:
  every y < −1 has weight exactly 0 (p_max <= 1 gives τ >= −1), so masked keys and rows without
  a key (made uniform, then zeroed) need no special case and no value is ever −inf or NaN;
* τ with Σ_j [y_j − τ]_+^{1/(α−1)} = 1, in a fixed number of steps and no host synchronisation:
  the exact threshold of `CANDIDATES` candidates, the maxima of as many chunks of keys
  (the sort formula for sparsemax and 1.5-entmax, safeguarded Newton from the bound
  max_k (c_k − k^{1−α}) for other α), is a lower bound of the row's τ (the τ of any subset of
  the keys is), exact when each key of the support is the largest of its chunk; then
  `NEWTON_STEPS` safeguarded Newton steps on the whole row (`_newton`), which from
  the left converge monotonically for α <= 2 (for sparsemax a step is Michelot's projection
  step). ``torch.topk`` of the row would be a better start but costs ~40 elementwise passes.
  The weights are finally divided by their sum, so every row sums to one even where the steps
  have not converged (measured errors at `NEWTON_STEPS`). α > 2 (slow convergence) and a
  learnable α take the query-block path (`entmax`);
* output = p·v; per row, only (max s, τ, 1/Σp) are kept for the backward.

The backward (a `torch.autograd.Function`) recomputes the block's scores and applies the
closed-form Jacobian, never the solver's iterations: with g_j = dO·v_j and u_j = p_j^{2−α} on the
support (1 for sparsemax), dz_j = u_j·(g_j − Σ_l u_l g_l / Σ_l u_l), ds = θ·dz, dθ = Σ_j dz_j·
(s_j − max s); top-k takes softmax's Jacobian on its kept keys. Five GEMMs per block in all
(q·kᵀ, dO·vᵀ, ds·k, dsᵀ·q, pᵀ·dO), as flash attention's backward.

Top-k: the threshold is the k-th largest allowed score; ties at it are broken in key order (the
lowest key index wins), as the naive [`topk`][sharpattn.normalizers.sparse.topk].
"""

from __future__ import annotations

import torch

from ...normalizers._contract import compute_dtype, on_device
from ...normalizers.families import Kernel
from ...normalizers.sparse import ALPHA, ENTMAX, TOPK, asentmax_scale
from .. import policy
from ..devices import backend, triton_kernels
from ..masking import Masking
from ..reference.chunked import chunked_attend
from ..stats import AttentionStats, row_stats
from . import decoding, native
from .tiles import Grid, Slabs, device_budget, row_slice, slab_rows

Tensor = torch.Tensor

#: Candidates per row (the maxima of as many chunks of keys) whose exact threshold starts the
#: solver: a lower bound of the row's τ (the τ of any subset of the keys is), exact when every
#: key of the support is the largest of its chunk (always when Lk' < 2·CANDIDATES). 32, not 64:
#: torch.sort of 32 values per row is ~8x cheaper than of 64 (0.04 vs 0.34 ms per 256 rows).
CANDIDATES = 32
#: Newton steps on the whole row after the candidates' threshold, per kind. Measured (float64,
#: 32 candidates, n = 4,096 and 16,384, scores of attention with gains 0.1 to 3, error of the
#: weights against the sorted solution): sparsemax exact after 4 (Michelot's steps: finite;
#: 3 suffice for gains >= 0.3), 1.5-entmax within 5e-6 after 5 for gain 0.1 (supports of ~1,600
#: of 16k keys), 1e-10 for gains >= 0.3. With 8 candidates at n = 300
#: (tests/paths/test_sparse_tiled.py) sparsemax and 1.5-entmax need 4. A step costs ~0.1x
#: SDPA's forward at n = 4,096. Other α <= 2 (Newton on G, see `_newton`): α = 1.3
#: reached float64 rounding after 4 steps with 8 candidates at n = 300 and with 64 at
#: n = 2,000; each step costs a ``pow`` pass (~0.6x SDPA's forward at n = 4,096).
#: Rows are renormalised, so an unconverged row has a slightly wide support, never a wrong sum.
NEWTON_STEPS = {"sparsemax": 4, "entmax15": 5, "entmax": 4}
#: Steps for a tensor α (per head), never read on the host, whose heads may have α up to the
#: registry's 2.5 (see `_newton`, `needs_blocks`): 12 reached float64 rounding for α = 2.6
#: (n = 300 to 2,000).
TENSOR_ALPHA_STEPS = 12
#: Newton steps on the candidates for α other than 1.5 and 2 (no sort formula).
CANDIDATE_STEPS = 12
#: y below this has weight 0 for every α (τ >= −1); masked keys are set to it.
FLOOR = -2.0


def block_rows(bh: int, lq: int, lk: int, budget: int | None = None) -> int:
    """Query rows per block: about ``budget`` (default `policy.SPARSE_SLAB_ELEMENTS`) score
    entries, at least `policy.SPARSE_MIN_ROWS` while the slab stays under
    `policy.SPARSE_SLAB_MAX`, at least 1."""
    budget = policy.SPARSE_SLAB_ELEMENTS if budget is None else budget
    return slab_rows(bh, lq, lk, budget, policy.SPARSE_MIN_ROWS, policy.SPARSE_SLAB_MAX)


# ---------------------------------------------------------------------------------------------
# The threshold


def _exponent(alpha):
    return 1.0 / (alpha - 1.0)


def _weights(t: Tensor, kind: str, e) -> Tensor:
    """[t]_+^{1/(α−1)} from t = [y − τ]_+ (in place where the kind allows)."""
    if kind == "sparsemax":
        return t
    if kind == "entmax15":
        return t.square_()
    if torch.compiler.is_compiling():
        return _powers(t, e)[0]
    return t.pow_(e)


def _powers(t: Tensor, e) -> tuple[Tensor, Tensor]:
    """(t^e, t^{e−1}) of t >= 0, both 0 where t = 0 (e > 0). Compiled, as 2^{e·log₂ t} and
    2^{(e−1)·log₂ t}: Inductor fuses them into one loop at ~1.3 ms per 2^20 entries here against
    ~4.8 ms for its ``pow`` and a division (relative error ~3e-7 in float32); eagerly ``pow``
    and a division, each one pass (log₂ and two exp₂ would be three). ``t`` is overwritten."""
    if torch.compiler.is_compiling():
        lg = torch.log2(t)  # −inf at 0: 2^{−inf} = 0
        p1 = torch.where(t > 0, torch.exp2(lg * (e - 1.0)), 0.0)  # e < 1 (α > 2): inf at 0
        return torch.exp2(lg * e), p1
    p = t.pow(e)
    return p, torch.div(p, t.clamp_(min=torch.finfo(t.dtype).tiny), out=t)


def _candidates(y: Tensor) -> Tensor:
    """The largest y of each of about `CANDIDATES` chunks of consecutive keys, sorted
    descending ``[.., C]``: every key when the row has fewer than 2·CANDIDATES. One pass and a
    small sort (``torch.topk`` of the row costs ~40x a pass: 4 ms per 2^20 scores for K = 64)."""
    c1 = y.shape[-1]
    width = max(1, c1 // CANDIDATES)
    cut = (c1 // width) * width
    cand = y[..., :cut].unflatten(-1, (cut // width, width)).amax(-1)
    if cut < c1:
        cand = torch.cat([cand, y[..., cut:].amax(-1, keepdim=True)], dim=-1)
    return cand.sort(-1, descending=True).values


def _lower_bound(c: Tensor, alpha) -> Tensor:
    """max_k (c_k − k^{1−α}) of sorted (descending) candidates: there the top k weigh >= 1/k
    each, so Σ p >= 1 and τ is at least this, for the candidates and for the whole row."""
    rho = torch.arange(1, c.shape[-1] + 1, dtype=c.dtype, device=c.device)
    return (c - rho.pow(1.0 - alpha)).amax(-1, keepdim=True)


def _candidate_tau(
    c: Tensor,
    kind: str,
    alpha,
    e,
    lo: Tensor,
    hi: Tensor,
    native_ok: bool = False,
) -> Tensor:
    """The exact τ of the sorted (descending) candidates ``c`` ``[.., K]``, ``[.., 1]``;
    ``native_ok``: other α's steps run as `native`'s loop (a number α only), else as
    `_solve`."""
    kk = c.shape[-1]
    rho = torch.arange(1, kk + 1, dtype=c.dtype, device=c.device)
    if kind == "sparsemax":
        tau = (c.cumsum(-1) - 1.0) / rho
        support = (c > tau).sum(-1, keepdim=True).clamp_min(1)
        return tau.gather(-1, support - 1)
    if kind == "entmax15":
        mean = c.cumsum(-1) / rho
        mean_sq = (c * c).cumsum(-1) / rho
        delta = (1.0 - rho * (mean_sq - mean * mean)) / rho
        tau = mean - delta.clamp_min(0.0).sqrt()
        support = (tau <= c).sum(-1, keepdim=True).clamp_min(1)
        return tau.gather(-1, support - 1)
    # any α: safeguarded steps from the lower bound (eagerly ~25 small ops a step; the native
    # loop does them per row, see docs/performance.md)
    if native_ok and native.usable(None, False, c, lo, hi):
        return native.sparse_solve(kind, e, c.clone(), lo, lo, hi, CANDIDATE_STEPS)[0]
    return _solve(c, lo, lo, hi, kind, e, CANDIDATE_STEPS)


def _bracket(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """The solver's state: the bracket [lo, hi] of τ."""
    return lo, hi


def _newton(y: Tensor, tau: Tensor, br: tuple, kind: str, e, buf=None):
    """One safeguarded Newton step on f(τ) = Σ_j [y_j − τ]_+^e − 1, e = 1/(α−1) (sparsemax),
    or on G(τ) = (Σ_j [y_j − τ]_+^e)^{1/e} − 1 (any other α), both decreasing with the same root.

    α <= 2: f and G are convex, so from the left (our start) Newton converges monotonically (for
    sparsemax a step is Michelot's projection step; G, the e-norm of the support's y − τ, is
    linear on a one-key support and nearly so otherwise, so it needs fewer steps than f). α > 2:
    G is concave between kinks, and its slope unbounded where a key enters the support (t^{e−1},
    e < 1), which slows Newton down (measured: 12 steps for α = 2.6, many more for α = 4; see
    `entmax`). Safeguard: the bracket [lo, hi] (f(lo) >= 0 >= f(hi)) is narrowed by the
    sign of f(τ), and a step that leaves it, or returns onto its far end (an earlier iterate:
    a cycle at a kink), is replaced by the midpoint. Returns (τ, state)."""
    lo, hi = br
    t = torch.sub(y, tau, out=buf).clamp_(min=0.0) if buf is not None else (y - tau).clamp_(0.0)
    tiny = torch.finfo(t.dtype).tiny
    if kind == "sparsemax":
        f = t.sum(-1, keepdim=True) - 1.0
        slope = torch.sign(t).sum(-1, keepdim=True)  # the support size (no bool → int64 copy)
    elif kind == "entmax15":  # G = ‖t‖₂ − 1, the general step with e = 2
        slope = t.sum(-1, keepdim=True)
        total = t.square_().sum(-1, keepdim=True)
        norm = total.sqrt()
        f = norm - 1.0
        slope = slope * norm / total.clamp_min(tiny)
    else:
        p, p1 = _powers(t, e)
        total = p.sum(-1, keepdim=True)
        norm = total.pow(1.0 / e)
        f = norm - 1.0
        slope = norm / total.clamp_min(tiny) * p1.sum(-1, keepdim=True)
    right = f < 0
    lo, hi = torch.where(right, lo, tau), torch.where(right, tau, hi)
    step = tau + f / slope.clamp_min(tiny)
    # inside the bracket, but not back onto its far end (an earlier iterate): that cycles at a
    # kink of f, where a key enters the support
    far = torch.where(right, lo, hi)
    inside = (step >= lo) & (step <= hi) & ((step != far) | (far == tau))
    return torch.where(inside, step, 0.5 * (lo + hi)), (lo, hi)


def _solve(y: Tensor, tau: Tensor, lo: Tensor, hi: Tensor, kind: str, e, steps: int) -> Tensor:
    """τ of a block after ``steps`` safeguarded Newton steps from ``tau`` (`_newton`),
    the bracket [lo, hi]; ``y`` is not written."""
    buf, br = torch.empty_like(y), _bracket(lo, hi)
    for _ in range(steps):
        tau, br = _newton(y, tau, br, kind, e, buf)
    return tau


def _final_weights(y: Tensor, tau: Tensor, kind: str, e) -> tuple[Tensor, Tensor]:
    """The block's weights [y − τ]_+^{1/(α−1)} before normalising, and their row sums (``y``
    is overwritten)."""
    p = _weights(y.sub_(tau).clamp_(min=0.0), kind, e)
    return p, p.sum(-1, keepdim=True)


# ---------------------------------------------------------------------------------------------
# Shared by both Functions


def _Walk(q, k, v, masking, scale) -> Slabs:
    """The query blocks of one call (`Slabs`) at this module's slab size."""
    g = Grid(q, k, v, masking, scale)
    return Slabs(
        g, block_rows(g.b * g.h, g.lq, g.lk, device_budget(policy.SPARSE_SLAB_ELEMENTS, q.device))
    )


def _row_any(s_max: Tensor) -> Tensor:
    """1.0 for rows that see a key (their largest masked score is not −inf), else 0.0."""
    return (s_max > float("-inf")).to(s_max.dtype)


def _entropy(p: Tensor, inv: Tensor, total: Tensor) -> Tensor:
    """−Σ w log w of w = inv·p (``inv`` 0 on empty rows), without forming w."""
    plogp = (p * torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))).sum(-1, keepdim=True)
    return -inv * plogp - (total * inv) * torch.log(torch.where(inv > 0, inv, 1.0))


# ---------------------------------------------------------------------------------------------
# The entmax family


class _EntmaxAttention(torch.autograd.Function):
    """α-entmax(θ·(s − max s))·v, s = scale·q·kᵀ; ``theta`` None or ``[.., Lq|1, 1]``."""

    @staticmethod
    def forward(ctx, q, k, v, theta, kind, alpha, masking, scale, want_stats):
        steps = TENSOR_ALPHA_STEPS if torch.is_tensor(alpha) else NEWTON_STEPS[kind]
        walk = _Walk(q, k, v, masking, scale)
        grid, lq = walk.grid, walk.grid.lq
        out = grid.empty_out()
        m_all, tau_all, inv_all = walk.zeros(), walk.zeros(), walk.zeros()
        ent_all = walk.zeros() if want_stats else None
        th = None if theta is None else theta.to(grid.dtype)
        al = alpha.to(grid.dtype) if torch.is_tensor(alpha) else alpha
        for t in walk.blocks():
            r0, r1 = t.r0, t.r1
            a = row_slice(al, lq, r0, r1)
            e, coef = _exponent(a), a - 1.0
            if th is not None:
                coef = coef * row_slice(th, lq, r0, r1)
            ends = grid.prefix(t) if grid.native else None
            whole = grid.native and (r0, r1, t.c0, t.c1) == (0, lq, 0, grid.lk)
            if whole and decoding.reading():  # attend checks k and v from what the passes read
                s = decoding.scores(q, k, scale)
            else:
                s = grid.scores(grid.q_rows(r0, r1), t)
            if grid.native and native.usable(ends, t.masked, s):  # the same, one loop per row
                y, m, live, cand = native.sparse_prepare(s, ends, coef, FLOOR, CANDIDATES)
                cand = cand.sort(-1, descending=True).values
            else:
                s = walk.masked(s, t)
                m = s.amax(-1, keepdim=True)
                live = _row_any(m)
                m = torch.where(live > 0, m, 0.0)
                y = s.sub_(m).mul_(coef).clamp_(min=FLOOR)  # masked (−inf) and overflow: FLOOR
                cand = _candidates(y)
            lo = _lower_bound(cand, a)  # τ's bracket for the whole row: p_max >= 1/c1
            hi = cand[..., :1] - torch.as_tensor(float(t.c1), dtype=y.dtype).pow(1.0 - a)
            loops = grid.native and not torch.is_tensor(e)  # the loops take one α per call
            tau = _candidate_tau(cand, kind, a, e, lo, hi, loops)
            tau = tau.clamp(lo, hi)
            if loops and native.usable(None, False, y, lo, hi):
                tau, p, total = native.sparse_solve(kind, e, y, tau, lo, hi, steps)  # per row
            else:
                tau = _solve(y, tau, lo, hi, kind, e, steps)
                p, total = _final_weights(y, tau, kind, e)
            inv = live / total
            if whole and decoding.reading():
                out[..., r0:r1, :] = grid.grouped(decoding.values(p, v)) * grid.grouped(inv)
            else:
                out[..., r0:r1, :] = grid.weigh(p, t) * grid.grouped(inv)
            m_all[..., r0:r1, :] = m
            tau_all[..., r0:r1, :] = tau
            inv_all[..., r0:r1, :] = inv
            if want_stats:
                ent_all[..., r0:r1, :] = _entropy(p, inv, total)
        ctx.save_for_backward(q, k, v, theta, m_all, tau_all, inv_all)
        ctx.kind, ctx.alpha, ctx.masking, ctx.scale = kind, alpha, masking, scale
        out = grid.heads(out).to(q.dtype)
        mass = (inv_all > 0).to(grid.dtype)  # Σ w = Σ p·(1/Σ p): 1 on rows that see a key
        if ent_all is None:
            ent_all = torch.zeros_like(mass)  # not asked for
        ctx.mark_non_differentiable(ent_all, mass)
        return out, ent_all, mass

    @staticmethod
    def backward(ctx, d_out, _d_ent, _d_mass):
        q, k, v, theta, m_all, tau_all, inv_all = ctx.saved_tensors
        kind, alpha = ctx.kind, ctx.alpha
        walk = _Walk(q, k, v, ctx.masking, ctx.scale)
        lq, cd = walk.grid.lq, walk.grid.dtype
        go, dq, dk, dv = walk.grads(d_out)
        want_theta = theta is not None and ctx.needs_input_grad[3]
        dtheta = walk.zeros() if want_theta else None
        th = None if theta is None else theta.to(cd)
        al = alpha.to(cd) if torch.is_tensor(alpha) else alpha
        tiny, big = torch.finfo(cd).tiny, torch.finfo(cd).max
        for t in walk.blocks():
            r0, r1 = t.r0, t.r1
            a = row_slice(al, lq, r0, r1)
            e = _exponent(a)
            th_r = None if th is None else row_slice(th, lq, r0, r1)
            coef = (a - 1.0) if th_r is None else (a - 1.0) * th_r
            inv = inv_all[..., r0:r1, :]
            x = walk.masked_scores(t).sub_(m_all[..., r0:r1, :]).clamp_(min=-big)  # s − m
            tt = (x * coef).clamp_(min=FLOOR).sub_(tau_all[..., r0:r1, :]).clamp_(min=0.0)
            # u = dp/dz = t^{1/(α−1) − 1} = p^{2−α} on the support (0 on rows without a key)
            if kind == "sparsemax":
                u = (tt > 0).to(cd)
                p = tt.mul_(inv)
            elif kind == "entmax15":
                u = tt.clone()
                p = tt.square_().mul_(inv)
            else:
                p = tt.pow(e)
                u = p / tt.clamp_(min=tiny)
                p.mul_(inv)
            u.mul_(inv > 0)
            g = walk.g_scores(go, t)
            ug = g.mul_(u)
            ratio = ug.sum(-1, keepdim=True) / u.sum(-1, keepdim=True).clamp_min(tiny)
            dz = ug.sub_(u.mul_(ratio))  # u·(g − Σ u g / Σ u)
            if want_theta:  # z = θ·x: dθ = Σ_j dz_j·x_j (x finite; dz = 0 where masked)
                dtheta[..., r0:r1, :] = (dz * x).sum(-1, keepdim=True)
            ds = dz.mul_(ctx.scale if th_r is None else th_r * ctx.scale)
            walk.accumulate(t, ds, p, go, dq, dk, dv)
        grads = walk.finish_grads(q, k, v, dq, dk, dv)
        if want_theta:
            dtheta = dtheta.sum_to_size(theta.shape).to(theta.dtype)
        return (*grads, dtheta, None, None, None, None, None)


# ---------------------------------------------------------------------------------------------
# Top-k


def _keep(s: Tensor, tau: Tensor, need: Tensor) -> Tensor:
    """The kept keys: s > τ, and the first ``need`` keys (in key order) with s = τ."""
    eq = s == tau
    rank = eq.cumsum(-1, dtype=torch.int32)
    return (s > tau) | (eq & (rank <= need.to(torch.int32)))


def _kept_exp(x: Tensor, keep: Tensor) -> Tensor:
    """exp(x) on the kept keys (x = s − max s <= 0), 0 elsewhere; x and ``keep`` are
    overwritten. x is clamped at −80 (a pass ~10x cheaper than ``torch.where``) because exp of
    −inf (masked keys) is ~5x slower than of a finite x: a kept key below the row's maximum by
    more than 80 weighs e^−80 ≈ 2e-35 instead of less, below float64's ε."""
    return x.clamp_(min=-80.0).exp_().masked_fill_(keep.logical_not_(), 0.0)


def _topk_weights(s: Tensor, tau: Tensor, need: Tensor, shift: Tensor) -> tuple[Tensor, Tensor]:
    """exp(s − shift) on the kept keys (`_keep`), 0 elsewhere, and its row sums (``s``
    is scratch)."""
    keep = _keep(s, tau, need)
    p = _kept_exp(s.sub_(shift), keep)
    return p, p.sum(-1, keepdim=True)


class _TopkAttention(torch.autograd.Function):
    """softmax over each row's ``top_k`` largest allowed scores (ties: lowest key index)·v."""

    @staticmethod
    def forward(ctx, q, k, v, top_k, masking, scale, want_stats):
        walk = _Walk(q, k, v, masking, scale)
        grid = walk.grid
        out = grid.empty_out()
        tau_all, need_all, lse_all = walk.zeros(), walk.zeros(), walk.zeros()
        ent_all = walk.zeros() if want_stats else None
        for t in walk.blocks():
            r0, r1 = t.r0, t.r1
            s = walk.masked_scores(t)
            vals = s.topk(min(top_k, t.c1), dim=-1, sorted=True).values
            tau = vals[..., -1:]  # −inf where the row has fewer allowed keys: keep them all
            need = (vals == tau).sum(-1, keepdim=True).to(s.dtype)  # the ties among the top k
            m = vals[..., :1]
            live = _row_any(m)
            m = torch.where(live > 0, m, 0.0)
            p, total = _topk_weights(s, tau, need, m)
            inv = live / torch.where(live > 0, total, 1.0)
            out[..., r0:r1, :] = grid.weigh(p, t) * grid.grouped(inv)
            tau_all[..., r0:r1, :] = tau
            need_all[..., r0:r1, :] = need
            # p = exp(s − lse) on the kept keys; +inf on rows without a key: p = 0
            lse_all[..., r0:r1, :] = torch.where(live > 0, m + torch.log(total), float("inf"))
            if want_stats:
                ent_all[..., r0:r1, :] = _entropy(p, inv, total)
        out = grid.heads(out)
        ctx.save_for_backward(q, k, v, out, tau_all, need_all, lse_all)
        ctx.masking, ctx.scale = masking, scale
        mass = (lse_all < float("inf")).to(grid.dtype)
        if ent_all is None:
            ent_all = torch.zeros_like(mass)  # not asked for
        ctx.mark_non_differentiable(ent_all, mass)
        return out.to(q.dtype), ent_all, mass

    @staticmethod
    def backward(ctx, d_out, _d_ent, _d_mass):
        q, k, v, out, tau_all, need_all, lse_all = ctx.saved_tensors
        walk = _Walk(q, k, v, ctx.masking, ctx.scale)
        go, dq, dk, dv = walk.grads(d_out)
        delta = walk.grid.heads(go) * out  # Σ_j p_j g_j = dO_i·out_i
        delta = delta.sum(-1, keepdim=True)
        for t in walk.blocks():
            r0, r1 = t.r0, t.r1
            s = walk.masked_scores(t)
            tau, need = tau_all[..., r0:r1, :], need_all[..., r0:r1, :]
            p, _ = _topk_weights(s, tau, need, lse_all[..., r0:r1, :])
            g = walk.g_scores(go, t)
            ds = g.sub_(delta[..., r0:r1, :]).mul_(p).mul_(ctx.scale)  # p·(g − Δ)
            walk.accumulate(t, ds, p, go, dq, dk, dv)
        return (*walk.finish_grads(q, k, v, dq, dk, dv), None, None, None, None)


def _key_rows(grid: Grid, idx: Tensor) -> Tensor:
    """Row numbers in ``grid.k`` / ``grid.v`` flattened to ``[B·Hkv·Lk, ·]`` of the keys
    ``idx`` ``[B, H, r, kk]`` (query head h reads key head h // G), flattened."""
    dev = idx.device
    kv_head = torch.arange(grid.h, device=dev) // grid.g
    base = (torch.arange(grid.b, device=dev).unsqueeze(-1) * grid.hkv + kv_head) * grid.lk
    return (idx + base[:, :, None, None]).reshape(-1)


class _TopkSelected(torch.autograd.Function):
    """Top-k from each row's selected keys: the C++ loop (`native.topk_select`) finds a
    row's ``top_k`` largest visible scores with their key indices in one sweep over the block's
    scores; the output gathers those keys' values (B·H·Lq·top_k·Dv products, not a GEMM over
    every key), and the (index, weight) pairs are kept, O(Lq·top_k), so the backward needs no
    score at all: with g_j = dO·v_j, ds_j = w_j·(g_j − dO·out)·scale, dq = Σ_j ds_j·k_j, and
    dk, dv are scattered back to the kept keys. Float32 CPU calls with no mask or a causal one."""

    @staticmethod
    def forward(ctx, q, k, v, top_k, masking, scale, want_stats):
        walk = _Walk(q, k, v, masking, scale)
        grid = walk.grid
        kk = max(1, min(top_k, grid.lk))
        shape = (grid.b, grid.h, grid.lq, kk)
        idx_all = torch.zeros(shape, dtype=torch.int64, device=grid.q.device)
        w_all = torch.zeros(shape, dtype=grid.dtype, device=grid.q.device)
        out = grid.empty_out()
        keys = grid.b * grid.hkv * grid.lk
        vf = grid.v.reshape(keys, grid.dv)
        slots = torch.arange(kk, device=grid.q.device)
        for t in walk.blocks():
            r0, r1 = t.r0, t.r1
            # a decoding step whose checks attend takes from what the two products read
            whole = (r0, r1, t.c0, t.c1) == (0, grid.lq, 0, grid.lk) and decoding.reading()
            if whole:
                s = decoding.scores(q, k, scale)
            else:
                s = grid.scores(grid.q_rows(r0, r1), t)
            vals, idx, count = native.topk_select(s, grid.prefix(t), kk)
            valid = slots < count.unsqueeze(-1)
            m = vals[..., :1]  # the row's largest (0 on a row without keys)
            p = torch.where(valid, vals - m, 0.0).exp_().mul_(valid)
            total = p.sum(-1, keepdim=True)
            w = p.div_(torch.where(total > 0, total, 1.0))
            if whole:  # every value row read once (the check), only the kept ones weighed
                dense = s.zero_().scatter_add_(-1, idx, w)  # empty slots add 0 at key 0
                out[...] = grid.grouped(decoding.values(dense, v))
            else:
                vg = vf.index_select(0, _key_rows(grid, idx)).view(*w.shape, grid.dv)
                out[..., r0:r1, :] = grid.grouped(torch.matmul(w.unsqueeze(-2), vg).squeeze(-2))
            idx_all[..., r0:r1, :] = idx
            w_all[..., r0:r1, :] = w
        out = grid.heads(out)
        ctx.save_for_backward(q, k, v, out, idx_all, w_all)
        ctx.masking, ctx.scale = masking, scale
        mass = (w_all.sum(-1, keepdim=True) > 0).to(grid.dtype)
        if want_stats:
            tiny = torch.finfo(grid.dtype).tiny
            ent = -(w_all * w_all.clamp_min(tiny).log()).sum(-1, keepdim=True)
        else:
            ent = torch.zeros_like(mass)  # not asked for
        ctx.mark_non_differentiable(ent, mass)
        return out.to(q.dtype), ent, mass

    @staticmethod
    def backward(ctx, d_out, _d_ent, _d_mass):
        q, k, v, out, idx_all, w_all = ctx.saved_tensors
        grid = Grid(q, k, v, ctx.masking, ctx.scale)
        go = d_out.to(grid.dtype)
        delta = (go * out).sum(-1, keepdim=True)  # Σ_j w_j g_j = dO_i·out_i
        keys = grid.b * grid.hkv * grid.lk
        kf, vf = grid.k.reshape(keys, grid.d), grid.v.reshape(keys, grid.dv)
        dkf, dvf = torch.zeros_like(kf), torch.zeros_like(vf)
        qh = grid.heads(grid.q)
        dq = torch.empty_like(qh)
        kk = idx_all.shape[-1]
        step = max(1, policy.TOPK_GATHER_ENTRIES // max(1, grid.b * grid.h * kk))
        for r0 in range(0, grid.lq, step):
            r1 = min(r0 + step, grid.lq)
            rows = _key_rows(grid, idx_all[..., r0:r1, :])
            w = w_all[..., r0:r1, :]
            gb = go[..., r0:r1, :]
            vg = vf.index_select(0, rows).view(*w.shape, grid.dv)
            g = torch.matmul(vg, gb.unsqueeze(-1)).squeeze(-1)  # g_j = dO·v_j
            ds = g.sub_(delta[..., r0:r1, :]).mul_(w).mul_(ctx.scale)
            kg = kf.index_select(0, rows).view(*w.shape, grid.d)
            dq[..., r0:r1, :] = torch.matmul(ds.unsqueeze(-2), kg).squeeze(-2)
            pairs = rows.numel()
            dkf.index_add_(
                0, rows, (ds.unsqueeze(-1) * qh[..., r0:r1, None, :]).view(pairs, grid.d)
            )
            dvf.index_add_(0, rows, (w.unsqueeze(-1) * gb.unsqueeze(-2)).view(pairs, grid.dv))
        dk = dkf.view(grid.b, grid.hkv, grid.lk, grid.d)
        dv = dvf.view(grid.b, grid.hkv, grid.lk, grid.dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def selects(q: Tensor, masking: Masking, top_k: int) -> bool:
    """Whether a top-k call takes `_TopkSelected` (the C++ selection)."""
    if masking.mask is not None or not 1 <= top_k <= policy.TOPK_SELECT_MAX_K:
        return False
    if q.numel() == 0 or masking.lk == 0:  # nothing to select: the slab path's empty cases
        return False
    return native.wanted(q.device, compute_dtype(q.dtype))


# ---------------------------------------------------------------------------------------------
# The fast paths (``FAST`` entries)


def _on_triton(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, want_stats: bool) -> bool:
    """Whether a call of the map with kernel record ``kernel`` runs its Triton kernels
    (`devices.backend`), with nothing empty."""
    return (
        min(q.numel(), k.numel(), v.numel()) > 0
        and backend(kernel, q.device, q.dtype, want_stats) == "triton"
    )


def _stats(q, masking, want_stats, ent, mass) -> AttentionStats | None:
    if not want_stats:
        return None
    return row_stats(q.shape[:3], masking.visible_keys(), entropy=ent, mass=mass)


def _check_alpha(alpha) -> None:
    """α in the registry's range (`ALPHA`, [1.01, 2.5]): a number always (no host
    synchronisation); a tensor's values are checked by ``attend`` (with ``check_finite`` only,
    as every tensor parameter's), never read here."""
    if not torch.is_tensor(alpha):
        ALPHA.check(alpha, "entmax")


def needs_blocks(alpha) -> bool:
    """A learnable α (the gradient in α is the naive normalizer's) or a number α > 2 (where
    Newton's steps converge slowly, see `_newton`) take the query-block path. A tensor α is
    never read (no host synchronisation): every head of it in the registry's range, up to 2.5,
    runs here with `TENSOR_ALPHA_STEPS` steps (float64 rounding for α up to ~2.6)."""
    if torch.is_tensor(alpha):
        return alpha.requires_grad
    return alpha > 2.0


def _kind(alpha) -> str:
    if torch.is_tensor(alpha):
        return "entmax"
    return {2.0: "sparsemax", 1.5: "entmax15"}.get(float(alpha), "entmax")


def _on_kernel(q, k, v, want_stats, alpha) -> bool:
    """Whether an entmax-family call runs CUDA's kernel (`_on_triton`): a number α in
    [1.01, 2], or a tensor (per head or row, learnable too; never read: the kernel takes every α
    of the registry's range, with `triton.ENTMAX_STEPS_TENSOR` passes at most)."""
    if not _on_triton(ENTMAX.kernel, q, k, v, want_stats):
        return False
    return torch.is_tensor(alpha) or alpha <= 2.0


def _entmax_family(q, k, v, masking, scale, want_stats, kind, alpha, theta=None, kernel=None):
    """``kernel``: `_on_kernel` where the caller has it (one look at a tensor α a call)."""
    if kernel is None:
        kernel = _on_kernel(q, k, v, want_stats, alpha)
    if kernel:  # CUDA: one kernel
        out = triton_kernels().entmax_attention(q, k, v, masking, scale, alpha, theta)
        return out, None
    out, ent, mass = _EntmaxAttention.apply(q, k, v, theta, kind, alpha, masking, scale, want_stats)
    return out, _stats(q, masking, want_stats, ent, mass)


def _chunked(method, q, k, v, masking, scale, want_stats, params):
    """The query-block path (autograd through the naive normalizer): for a learnable α."""
    from ...normalizers import get

    out, pieces = chunked_attend(
        get(method).fn,
        q,
        k,
        v,
        masking,
        scale,
        want_stats=want_stats,
        check_finite=False,
        params=params,
    )
    return out, _stats(q, masking, want_stats, *(pieces or (None, None)))


def sparsemax(q, k, v, masking: Masking, scale: float, want_stats: bool):
    """sparsemax attention (α = 2): exact threshold of the top-K, then Newton on the row."""
    return _entmax_family(q, k, v, masking, scale, want_stats, "sparsemax", 2.0)


def entmax15(q, k, v, masking: Masking, scale: float, want_stats: bool):
    """1.5-entmax attention."""
    return _entmax_family(q, k, v, masking, scale, want_stats, "entmax15", 1.5)


def entmax(q, k, v, masking: Masking, scale: float, want_stats: bool, *, alpha=1.5, n_iter=None):
    """α-entmax attention, α a number or a tensor (per head) in [1.01, 2.5]. ``n_iter`` (the
    naive path's bisection steps) is not used here: the threshold comes from the candidates and
    Newton steps. A learnable α (a tensor that requires grad) and a number α > 2 (see
    `needs_blocks`) take the query-block path (`chunked_attend`: O(block·Lk) memory, the naive
    normalizer's bisection and autograd), which differentiates in α; a tensor α runs here with
    `TENSOR_ALPHA_STEPS` steps. On CUDA the kernel takes every number α up to 2 and every
    tensor, a learnable one too (`_on_kernel`)."""
    _check_alpha(alpha)
    kernel = _on_kernel(q, k, v, want_stats, alpha)
    if not kernel and needs_blocks(alpha):
        params = dict(alpha=alpha, n_iter=n_iter)
        return _chunked("entmax", q, k, v, masking, scale, want_stats, params)
    return _entmax_family(q, k, v, masking, scale, want_stats, _kind(alpha), alpha, None, kernel)


def asentmax(
    q,
    k,
    v,
    masking: Masking,
    scale: float,
    want_stats: bool,
    *,
    beta_pre=0.0,
    gamma_pre=0.0,
    delta=1.0,
    gamma_max=2.0,
    alpha=1.5,
    n_iter=None,
):
    """ASEntmax attention: α-entmax of θ·(s − max s), θ from the row's visible keys
    (`asentmax_scale`); gradients flow to ``beta_pre`` and
    ``gamma_pre`` through θ."""
    _check_alpha(alpha)
    kernel = _on_kernel(q, k, v, want_stats, alpha)
    if not kernel and needs_blocks(alpha):
        params = dict(
            beta_pre=beta_pre,
            gamma_pre=gamma_pre,
            delta=delta,
            gamma_max=gamma_max,
            alpha=alpha,
            n_iter=n_iter,
        )
        return _chunked("asentmax", q, k, v, masking, scale, want_stats, params)
    cd = compute_dtype(q.dtype)
    theta = asentmax_scale(masking.visible_keys(dtype=cd), beta_pre, gamma_pre, delta, gamma_max)
    return _entmax_family(q, k, v, masking, scale, want_stats, _kind(alpha), alpha, theta, kernel)


def sparse(family, q, k, v, masking: Masking, scale: float, want_stats: bool, /, **params):
    """The fast path of a user's `Sparse` method: α-entmax of θ·(s − max s) with α =
    ``family.alpha_of(params)`` and θ = ``family.scale(n, **params)`` of the rows' visible keys,
    as `asentmax` (the query-block path, through ``family.weights``, where α needs it)."""
    params.pop("blocks", None)
    alpha = family.alpha_of(params, (*q.shape[:3], 1))
    _check_alpha(alpha)
    kernel = _on_kernel(q, k, v, want_stats, alpha)
    if not kernel and needs_blocks(alpha):
        out, pieces = chunked_attend(
            family.weights,
            q,
            k,
            v,
            masking,
            scale,
            want_stats=want_stats,
            check_finite=False,
            params=params,
        )
        return out, _stats(q, masking, want_stats, *(pieces or (None, None)))
    theta = None
    if family.scale is not None:
        n = masking.visible_keys(dtype=compute_dtype(q.dtype))
        theta = on_device(family.scale_of(n, (*q.shape[:3], 1), **params), n.dtype, q.device)
    return _entmax_family(q, k, v, masking, scale, want_stats, _kind(alpha), alpha, theta, kernel)


def topk(q, k, v, masking: Masking, scale: float, want_stats: bool, *, top_k=8):
    """softmax over the ``top_k`` largest allowed scores of each row (ties: lowest key index)."""
    if _on_triton(TOPK.kernel, q, k, v, want_stats) and top_k <= triton_kernels().TOPK_MAX:  # CUDA
        return triton_kernels().topk_attention(q, k, v, masking, scale, top_k), None
    fn = _TopkSelected if selects(q, masking, top_k) else _TopkAttention
    out, ent, mass = fn.apply(q, k, v, top_k, masking, scale, want_stats)
    return out, _stats(q, masking, want_stats, ent, mass)


#: The fast paths of this module by registry ``fused`` name.
SPARSE_TILED = {
    "sparsemax_tiled": sparsemax,
    "entmax15_tiled": entmax15,
    "entmax_tiled": entmax,
    "asentmax_tiled": asentmax,
    "topk_tiled": topk,
}
