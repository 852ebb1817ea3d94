"""The test table: one entry per registry method, with what the tests need to check it.

Each `Method` holds the method's independent float64 NumPy reference (one row at a time), the
parameter settings to test it with, and which fast-path kernels it has (the tiles of
``attention/cpu/tiled.py``, the C++ loops of ``attention/cpu/native.py``) with their settings. The
contract tests (tests/contract/test_normalizers_family.py, test_families.py) and the path tests
(tests/paths/test_tiled.py, test_native.py) are parametrized from it, so a new method is one
entry here (``test_every_method_is_in_the_table`` fails until it has one).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import brentq
from scipy.special import expit

from reference import adaptive as adaptive_matrix

H = 3  # heads in the contract tests' tensors


def per_head(*values):
    """A per-head tensor parameter ``[1, H, 1, 1]`` (float64), as MultiheadAttention passes."""
    return torch.tensor(values, dtype=torch.float64).view(1, H, 1, 1)


# ---------------------------------------------------------------------------------------------
# Independent float64 references, one row at a time. x: the row's scores at its allowed keys
# (in key order), p: the row's parameters (per-head values already picked). They return the
# weights of those keys; `reference` scatters them back and leaves disallowed keys at 0.
# ---------------------------------------------------------------------------------------------


def softmax_row(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def entmax_row(x, alpha):
    """α-entmax by root finding on τ: Σ_i [(α−1)x_i − τ]_+^{1/(α−1)} = 1 (Peters et al. 2019),
    on x − max x (α-entmax is shift invariant), so ±1e4 scores keep their digits."""
    z = (alpha - 1.0) * (x - x.max())

    def excess(tau):
        return (np.clip(z - tau, 0, None) ** (1.0 / (alpha - 1.0))).sum() - 1.0

    tau = brentq(excess, -1.0 - 1e-9, 0.0, xtol=1e-15, rtol=1e-15, maxiter=500)
    return np.clip(z - tau, 0, None) ** (1.0 / (alpha - 1.0))


def sparsemax_row(x):
    """Martins & Astudillo 2016, Alg. 1: sort, support size k(z), threshold τ."""
    x = x - x.max()
    zs = np.sort(x)[::-1]
    cs = np.cumsum(zs)
    ks = np.arange(1, len(x) + 1)
    k = ks[1 + ks * zs > cs].max()
    tau = (cs[k - 1] - 1.0) / k
    return np.clip(x - tau, 0, None)


def stick_row(x):
    """x: the row's pieces in key order (`reference` drops the query's own key unless kept)."""
    out = np.zeros_like(x)
    beta = expit(x)  # σ without overflow at ±1e4
    for j in range(len(x)):
        out[j] = beta[j] * np.prod(1.0 - beta[j + 1 :])
    return out


def sink_row(x, b):
    m = max(x.max(), b)
    return np.exp(x - m) / (np.exp(b - m) + np.exp(x - m).sum())


def llama4_row(x, p):
    """transformers' Llama4TextAttention: attn_scales = log1p(floor((position + 1) / floor_scale))
    · attn_scale + 1 on the queries, position + 1 = n (the row's keys)."""
    n = len(x)
    beta = math.log1p(math.floor(n / p.get("floor_scale", 8192))) * p.get("attn_scale", 0.1) + 1
    return softmax_row(beta * x)


def logn_row(x, p):
    """Qwen's modeling_qwen.py: logn_list = [math.log(i, L) if i > L else 1 for i in 1..],
    the query at position p scaled by logn_list[p], p + 1 = n."""
    n, length = len(x), p.get("train_length", 2048)
    return softmax_row((math.log(n, length) if n > length else 1.0) * x)


def asentmax_row(x, p):
    """deep-spin/asentmax sparse_gemma.py (adapt-softplus-tanh): θ = δ + softplus(b)·
    log(position + 2)^{γ_max·tanh(c)}, position + 2 = n + 1; α-entmax of θ·scores."""
    n = len(x)
    beta = np.logaddexp(0.0, p.get("beta_pre", 0.0))  # softplus
    gamma = p.get("gamma_max", 2.0) * math.tanh(p.get("gamma_pre", 0.0))
    theta = p.get("delta", 1.0) + beta * math.log(n + 1) ** gamma
    return entmax_row(theta * (x - x.max()), p.get("alpha", 1.5))


def softpick_row(x, p):
    """ReLU(e^x − 1)/Σ|e^x − 1| (Zuhri et al. 2025), numerator and denominator times e^{−m},
    m = max(0, max x), so that e^{1e4} is never formed."""
    m = max(0.0, float(x.max()))
    d = np.expm1(x) * math.exp(-m) if m < 600 else np.exp(x - m)
    total = np.abs(d).sum()
    return np.maximum(d, 0) / total if total > 0 else np.zeros_like(x)


def sigmoid_row(x, p):
    shift = p.get("bias", 0.0) - (math.log(len(x)) if p.get("subtract_log_n", True) else 0.0)
    return expit(x + shift)


def power_row(x, p):
    r = np.maximum(x, 0) ** p.get("p", 3.0)
    return r / r.sum() if r.sum() > 0 else r


def stablemax_row(x, p):
    """StableMax (Prieto et al. 2025, Grokking at the Edge of Numerical Stability):
    s(x_i)/Σ_j s(x_j), s(x) = x + 1 for x >= 0 and 1/(1 − x) for x < 0."""
    s = np.where(x >= 0, x + 1.0, 1.0 / (1.0 - np.minimum(x, 0.0)))
    return s / s.sum()


def topk_row(x, p):
    keep = np.isin(np.arange(len(x)), np.argsort(-x, kind="stable")[: p.get("top_k", 8)])
    return np.where(keep, softmax_row(np.where(keep, x, -np.inf)), 0.0)


def adaptive_row(x, p):
    """Veličković et al. Fig. 4 (tests/reference.py's), default coefficients."""
    return adaptive_matrix(x[None], None)[0]


def hardmax_row(x, p):
    return np.eye(len(x))[np.argmax(x)]


@dataclass(frozen=True)
class Method:
    """A registry method as the tests see it.

    * ``ref(x, p)``: the weights of a row's allowed scores x with parameters p, float64.
    * ``cases``: parameter settings for the contract tests (defaults, others, per-head tensors).
    * ``tiles``: settings for the test of its kernel on the tiles (``attention/cpu/tiled.py``;
      empty: it has none there).
    * ``loops``: the C++ loops its kernel has (``"normalised"``, ``"elementwise"``, or None)
      and ``loop_cases`` the settings they are tested with.
    * ``shift_invariant``, ``causal_only``: the properties the contract tests hold it to.
    * ``row_sum``: what its rows sum to where the registry does not say one
      (`test_documented_row_sum_property`): ``"sink"`` (< 1, the rest on the sink), ``"in (0,
      1)"`` or ``">= 0"`` (element-wise weights), ``"1 or 0"`` (0 without a positive score),
      ``"Σ|w| = 1"``, ``"softpick"`` (<= 1, 1 without negative scores, 0 without positive ones),
      ``"< 1"``.
    """

    name: str
    ref: Callable
    cases: tuple[dict, ...] = ({},)
    tiles: tuple[dict, ...] = ()
    loops: str | None = None
    loop_cases: tuple[dict, ...] = ()
    shift_invariant: bool = False
    causal_only: bool = False
    row_sum: str = "1"


_ENTRIES = [
    Method(
        "softmax", lambda x, p: softmax_row(x / p.get("temperature", 1.0)), shift_invariant=True
    ),
    Method("adaptive", adaptive_row, cases=(), shift_invariant=True),
    Method(
        "ssmax",
        lambda x, p: softmax_row(p.get("s", 0.43) * math.log(len(x)) * x),
        cases=({}, {"s": 1.3}, {"s": per_head(0.2, 0.43, 2.0)}),
        shift_invariant=True,
    ),
    Method(
        "length_scaled",
        lambda x, p: softmax_row((1 + p.get("c", 0.0) * math.log(len(x))) * x),
        cases=({}, {"c": 0.7}, {"c": per_head(0.05, 0.5, 3.0)}),
        shift_invariant=True,
    ),
    Method(
        "sink",
        lambda x, p: sink_row(x, p.get("bias", 0.0) + p.get("bias_log_n", 0.0) * math.log(len(x))),
        cases=(
            {},
            {"bias": 1.5},
            {"bias": per_head(-1.0, 0.0, 2.0), "bias_log_n": per_head(0.5, -1.0, 0.0)},
        ),
        row_sum="sink",
    ),
    Method(
        "sigmoid",
        sigmoid_row,
        cases=({}, {"bias": per_head(-1.0, 0.0, 2.0)}, {"subtract_log_n": False, "bias": 0.3}),
        tiles=({}, {"bias": 0.7}),
        loops="elementwise",
        loop_cases=({}, {"bias": -2.0, "subtract_log_n": False}),
        row_sum="in (0, 1)",
    ),
    Method(
        "relu",
        lambda x, p: np.maximum(x, 0) ** p.get("p", 1.0) / len(x),
        cases=({}, {"p": 2.0}),
        tiles=({}, {"p": 2.0}),
        loops="elementwise",
        loop_cases=({}, {"p": 2.0}, {"p": 1.5}),
        row_sum=">= 0",
    ),
    Method(
        "power",
        power_row,
        cases=({}, {"p": 1.0}, {"p": 5.0}),
        tiles=({}, {"p": 1.0}),
        loops="normalised",
        loop_cases=({}, {"p": 1.0}, {"p": 2.5}),
        row_sum="1 or 0",
    ),
    Method(
        "signed",
        lambda x, p: np.sign(x) * softmax_row(np.abs(x)),
        tiles=({},),
        loops="normalised",
        loop_cases=({},),
        row_sum="Σ|w| = 1",
    ),
    Method("topk", topk_row, cases=({}, {"top_k": 1}, {"top_k": 3}), shift_invariant=True),
    Method(
        "hardmax",
        hardmax_row,
        cases=({}, {"straight_through": True}),
        tiles=({},),
        shift_invariant=True,
    ),
    Method("sparsemax", lambda x, p: sparsemax_row(x), shift_invariant=True),
    Method("entmax15", lambda x, p: entmax_row(x, 1.5), shift_invariant=True),
    Method(
        "entmax",
        lambda x, p: entmax_row(x, p.get("alpha", 1.5)),
        cases=({}, {"alpha": 2.0}, {"alpha": 1.2}, {"alpha": per_head(1.1, 1.5, 2.4)}),
        shift_invariant=True,
    ),
    Method(
        "stick_breaking",
        lambda x, p: stick_row(x),
        cases=({}, {"attend_current": True}),
        causal_only=True,
        row_sum="< 1",
    ),
    Method(
        "softpick",
        softpick_row,
        tiles=({},),
        loops="normalised",
        loop_cases=({},),
        row_sum="softpick",
    ),
    Method("stablemax", stablemax_row, tiles=({},), loops="normalised", loop_cases=({},)),
    # small floor_scale / train_length so that β(n) varies across the rows of a causal mask
    Method(
        "llama4_temperature",
        llama4_row,
        cases=({}, {"floor_scale": 3, "attn_scale": 0.5}, {"floor_scale": 2, "attn_scale": 2.0}),
        shift_invariant=True,
    ),
    Method(
        "logn", logn_row, cases=({}, {"train_length": 3}, {"train_length": 2}), shift_invariant=True
    ),
    Method(
        "asentmax",
        asentmax_row,
        cases=(
            {},
            {"beta_pre": 1.0, "gamma_pre": 0.5},
            {"beta_pre": per_head(-1.0, 0.5, 2.0), "gamma_pre": per_head(-2.0, 0.0, 1.5)},
            {"alpha": 2.0, "delta": 0.5, "gamma_max": 1.0, "beta_pre": 0.3, "gamma_pre": -0.7},
        ),
        shift_invariant=True,
    ),
]
#: every method by name, in the registry's order where the tests need one
TABLE = {m.name: m for m in _ENTRIES}


def reference(method, scores, allowed, params):
    """``TABLE[method].ref`` row by row on ``[B, H, Lq, Lk]`` scores (a tensor) and the
    ``allowed`` boolean tensor, float64 NumPy; per-head tensor parameters give each head its
    value. stick_breaking's query does not see its own key unless ``attend_current``."""
    s = scores.detach().double().numpy()
    a = allowed.numpy()
    out = np.zeros_like(s)
    b_, h_, lq, lk = s.shape
    ref = TABLE[method].ref
    for b in range(b_):
        for h in range(h_):
            p = {k: (float(v.flatten()[h]) if torch.is_tensor(v) else v) for k, v in params.items()}
            for i in range(lq):
                ok = a[b, h, i].copy()
                if method == "stick_breaking" and not params.get("attend_current", False):
                    ok &= np.arange(lk) < i + (lk - lq)  # the query's own key is not a piece
                if ok.any():
                    out[b, h, i, ok] = ref(s[b, h, i, ok], p)
    return out


def case_id(case):
    """A test id for (method, params)."""
    m, p = case
    return m + "".join(f"-{k}={'tensor' if torch.is_tensor(v) else v}" for k, v in p.items())


#: (method, params) of every contract case
CASES = [(m.name, p) for m in _ENTRIES for p in m.cases]
#: (method, params) of every kernel on the tiles, and of every kernel with C++ loops (with the
#: loops' name)
TILES = [(m.name, p) for m in _ENTRIES for p in m.tiles]
LOOPS = [(m.name, p, m.loops) for m in _ENTRIES if m.loops for p in m.loop_cases]
