"""The per-score formulas of every map the Triton kernels run, one ``@triton.jit`` function
each, switched on the ``MAP`` constant (the name of the map's kernel record, `families.Kernel`)
and the ``NORMALISED`` flag. A new map is a branch in each of these functions; the kernels of
`template` need no change.

* element-wise, `map_weight`: w = f(s, row) and its slope f′(s, row) per score. ``sigmoid``:
  w = σ(s + b_i), f′ = w·(1 − w), b_i the row tensor (bias − log n_i or bias); ``relu``: w =
  ReLU(s)^p / n_i, f′ = p·ReLU(s)^(p−1) / n_i.
* normalised, w_ij = u_ij / Z_i with Z_i = Σ_j a_ij, `map_normalised` (u, a): ``power`` u = a =
  (ReLU(s)/m)^p; ``signed`` u = sign(s)·e^{|s| − m}, a = e^{|s| − m}; ``softpick`` u = ReLU(d),
  a = |d|, d = e^{−m}(e^{s} − 1) formed as its tile maths does (`softpick_shift`, with an expm1
  that keeps its precision near s = 0, `expm1`); ``stablemax`` u = a = s(x)/m, s(x) = x + 1
  for x >= 0 and 1/(1 − x) below. u and a are taken relative to a running row reference m
  (`map_reference`) and the accumulators are rescaled when m grows (`map_factor`), as flash
  attention does for softmax, so nothing overflows at any score size.
* their gradients, `map_grad`: with D_i = dO_i·out_i (one number per row, taken in PyTorch),
  power ds = (dP − D)·p·(r/m)^{p−1}/(m·Z), signed ds = (sign(s)·dP − D)·w, softpick ds =
  (1[d > 0]·dP − sign(d)·D)·e^{s − m}/Z, stablemax ds = (dP − D)·s′(x)/(m·Z). ``softmax``: u =
  a = e^{s − m}, m the largest allowed score (−inf until a row sees one), ds = (dP − D)·w, and
  the log-sum-exp lse = m + log Z is an output with a gradient: it enters as D − ∂L/∂lse.
  ``entmax`` and ``topk`` (`sparse`, `topk`) share the backward kernels through their branches.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def powers(t, p, POWER: tl.constexpr):
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
def expm1(x):
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
def sign_of(x):
    return tl.where(x > 0.0, 1.0, tl.where(x < 0.0, -1.0, 0.0))


@triton.jit
def stablemax(x):
    """StableMax's s(x): x + 1 for x >= 0, 1/(1 − x) below."""
    return tl.where(x >= 0.0, x + 1.0, 1.0 / (1.0 - tl.minimum(x, 0.0)))


@triton.jit
def map_weight(s, row, p, MAP: tl.constexpr, POWER: tl.constexpr):
    """(w, dw/ds) of scores ``s`` [M, N] (float32) given the row values ``row`` [M, 1]
    (element-wise methods)."""
    if MAP == "sigmoid":  # σ(s + b)
        w = 1.0 / (1.0 + tl.exp(-(s + row)))
        slope = w * (1.0 - w)
    else:  # relu: ReLU(s)^p / n
        tp, tq = powers(tl.maximum(s, 0.0), p, POWER)
        w = tp / row
        slope = p * tq / row
    return w, slope


@triton.jit
def map_reference(s, keep, MAP: tl.constexpr):
    """A block's candidate [M] for the row reference m of scores ``s`` [M, N] (disallowed ones
    0): the largest ReLU(s) (power), |s| (signed), max(0, s) (softpick), the largest allowed s
    (softmax; −inf where none is), StableMax's s of the largest score (`stablemax`)."""
    if MAP == "signed":
        ref = tl.max(tl.abs(s), 1)
    elif MAP == "softmax":
        ref = tl.max(tl.where(keep, s, -float("inf")), 1)
    elif MAP == "stablemax":
        ref = stablemax(tl.max(s, 1))
    else:
        ref = tl.maximum(tl.max(s, 1), 0.0)
    return ref


@triton.jit
def softpick_shift(m, SHIFT_ABOVE: tl.constexpr):
    """(c, A, B) per row of softpick's d = A·expm1(s − c) + B = e^{−m}(e^{s} − 1): c = 0, A =
    e^{−m}, B = 0 while m <= SHIFT_ABOVE (exact near s = 0), c = m, A = 1, B = 1 − e^{−m} beyond."""
    far = m > SHIFT_ABOVE
    c = tl.where(far, m, 0.0)
    return c, tl.exp(c - m), tl.where(far, -expm1(-m), 0.0)


@triton.jit
def map_factor(m_old, m_new, p, MAP: tl.constexpr, POWER: tl.constexpr):
    """The rescaling [M] of sums taken relative to m_old once the reference is m_new >= m_old."""
    if MAP == "power":  # ((m_old/m_new)^p; 0 while no score was positive)
        f, _ = powers(m_old / tl.where(m_new > 0.0, m_new, 1.0), p, POWER)
    elif MAP == "stablemax":  # m_old/m_new (0 before the first key)
        f = m_old / tl.where(m_new > 0.0, m_new, 1.0)
    else:
        f = tl.exp(m_old - m_new)
    return f


@triton.jit
def map_normalised(s, m, p, MAP: tl.constexpr, POWER: tl.constexpr, SHIFT_ABOVE: tl.constexpr):
    """(u, a) of scores ``s`` [M, N] relative to the row reference ``m`` [M, 1], w = u / Σ_j a_j:
    power u = a = (ReLU(s)/m)^p, signed u = sign(s)·e^{|s| − m} and a = e^{|s| − m}, softpick
    u = ReLU(d) and a = |d|, d = e^{−m}(e^{s} − 1), StableMax u = a = s(x)/m."""
    if MAP == "power":
        u, _ = powers(tl.maximum(s, 0.0) / tl.where(m > 0.0, m, 1.0), p, POWER)
        a = u
    elif MAP == "softmax":  # e^{s − m}, m the largest allowed score
        u = tl.exp(tl.minimum(s - m, 0.0))
        a = u
    elif MAP == "stablemax":
        u = stablemax(s) / tl.where(m > 0.0, m, 1.0)
        a = u
    elif MAP == "signed":
        a = tl.exp(tl.abs(s) - m)
        u = sign_of(s) * a
    else:
        c, big_a, big_b = softpick_shift(m, SHIFT_ABOVE)
        d = big_a * expm1(s - c) + big_b
        u = tl.maximum(d, 0.0)
        a = tl.abs(d)
    return u, a


@triton.jit
def map_grad(
    s,
    dp,
    row,
    m,
    z,
    dd,
    p,
    MAP: tl.constexpr,
    NORMALISED: tl.constexpr,
    POWER: tl.constexpr,
    SHIFT_ABOVE: tl.constexpr,
):
    """(w, dL/ds, dL/dy) [M, N] of scores ``s`` given dP = dO·vᵀ: the element-wise ``row``, or
    the normalised m, Z (> 0) and D = dO·out per row (each [M, 1]), as the map's TileMaths.grad
    (dL/dy: α-entmax's gradient in y = c1·s, for c1's; the others' dL/ds):
    power ds = (dP − D)·p·(r/m)^{p−1}/(m·Z), signed ds = (sign(s)·dP − D)·w, softpick ds =
    (1[d > 0]·dP − sign(d)·D)·e^{s − m}/Z with e^{s − m} = d + A − B, StableMax ds =
    (dP − D)·s′(x)/(m·Z) with s′ = 1 for x >= 0, 1/(1 − x)² below."""
    if not NORMALISED:
        w, slope = map_weight(s, row, p, MAP, POWER)
        ds = dp * slope
    elif MAP == "power":
        m1 = tl.where(m > 0.0, m, 1.0)
        tp, tq = powers(tl.maximum(s, 0.0) / m1, p, POWER)
        w = tp / z
        ds = (dp - dd) * tq * (p / (m1 * z))
    elif MAP == "stablemax":
        mz = tl.where(m > 0.0, m, 1.0) * z
        below = 1.0 / (1.0 - tl.minimum(s, 0.0))
        w = tl.where(s >= 0.0, s + 1.0, below) / mz
        ds = (dp - dd) * tl.where(s >= 0.0, 1.0, below * below) / mz
    elif MAP == "signed":
        sign = sign_of(s)
        w = sign * tl.exp(tl.abs(s) - m) / z
        ds = (sign * dp - dd) * w
    elif MAP == "softmax":  # D carries the log-sum-exp's gradient (D − dL/dlse)
        w = tl.exp(tl.minimum(s - m, 0.0)) / z
        ds = (dp - dd) * w
    elif MAP == "topk":  # softmax on the kept keys (the caller's keep), m = lse
        w = tl.exp(tl.minimum(s - m, 0.0))
        ds = (dp - dd) * w
    elif MAP == "entmax":  # t = [c1·s − c0]_+, w = t^e/Z, dL/dy = e·t^{e−1}·(dP − r)
        tp, tq = powers(tl.maximum(row * s - m, 0.0), p, POWER)
        w = tp / z
        dy = (dp - dd) * tq * p
        ds = dy * row
    else:
        c, big_a, big_b = softpick_shift(m, SHIFT_ABOVE)
        d = big_a * expm1(s - c) + big_b
        pos = d > 0.0
        w = tl.where(pos, d, 0.0) / z
        ds = (tl.where(pos, dp, 0.0) - sign_of(d) * dd) * (d + (big_a - big_b)) / z
    if MAP != "entmax":
        dy = ds
    return w, ds, dy


@triton.jit
def topk_kept(s, tau, last, offs_n):
    """Top-k's kept keys [M, N] among the allowed ones: s > τ, or s = τ at a key index up to
    ``last`` (the last tie kept, in key order; −1: none)."""
    return (s > tau) | ((s == tau) & (offs_n[None, :].to(tl.float32) <= last))


@triton.jit
def entmax_exponent_grad(s, keep, w, dy, dp, c1, c0, dd):
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
