"""Statistics: over seeds (mean, standard deviation, a paired t-test per column, a paired effect
with its interval, the smallest detectable difference) and linear fits."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from scipy import stats


@dataclass
class PairedComparison:
    """Per column (e.g. per set size) summary of two methods measured on the same seeds."""

    mean_a: np.ndarray
    std_a: np.ndarray
    mean_b: np.ndarray
    std_b: np.ndarray
    p_value: np.ndarray  # two-sided paired t-test of b against a; NaN if undefined


def paired_comparison(a, b) -> PairedComparison:
    """Compare ``a`` and ``b``, arrays ``[seeds, columns]`` paired by seed (row).

    Standard deviations use ddof=1 (NaN for one seed). The p-value is scipy's two-sided
    ``ttest_rel`` per column; it is NaN with fewer than two seeds or when every difference is the
    same (0, or the same shift on every seed up to rounding: the differences' standard deviation
    is 0 and t undefined, where scipy would report p = 0).
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(
            f"a and b must be [seeds, columns] arrays of one shape: {a.shape} vs {b.shape}."
        )
    seeds = a.shape[0]
    if seeds >= 2:
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore", RuntimeWarning
            )  # zero variance -> NaN, reported as such
            p = np.asarray(stats.ttest_rel(b, a, axis=0).pvalue, dtype=np.float64)
        d = b - a
        rounding = 8 * np.finfo(np.float64).eps * (np.abs(a).max(0) + np.abs(b).max(0))
        p = np.where(np.ptp(d, axis=0) <= rounding, np.nan, p)
        std_a, std_b = a.std(axis=0, ddof=1), b.std(axis=0, ddof=1)
    else:
        p = np.full(a.shape[1], np.nan)
        std_a = std_b = np.full(a.shape[1], np.nan)
    return PairedComparison(a.mean(axis=0), std_a, b.mean(axis=0), std_b, p)


def linear_fit(x, y) -> tuple[float, float]:
    """Least-squares slope of ``y`` on ``x`` and its R² (scipy ``linregress``); NaN for both with
    fewer than three points, NaN R² when ``y`` is constant."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if len(x) < 3:
        return float("nan"), float("nan")
    fit = stats.linregress(x, y)
    return float(fit.slope), float(fit.rvalue**2) if np.ptp(y) > 0 else float("nan")


def holm(p_values) -> np.ndarray:
    """Holm-Bonferroni adjusted p-values of a family of tests (step-down: the i-th smallest of m
    multiplied by m - i + 1, kept monotone, capped at 1); NaN entries stay NaN and do not count
    in m. Reject at level a where the adjusted value is at most a."""
    p = np.asarray(p_values, dtype=np.float64)
    out = np.full(p.shape, np.nan)
    idx = np.flatnonzero(np.isfinite(p))
    order = idx[np.argsort(p[idx], kind="stable")]
    m, running = len(order), 0.0
    for i, j in enumerate(order):
        running = max(running, min(1.0, (m - i) * p[j]))
        out[j] = running
    return out


@dataclass
class PairedEffect:
    """A paired difference over seeds (b − a, one difference per seed): its ``mean``, the
    differences' standard deviation ``sd`` (ddof=1), the ``level`` t interval of the mean
    (``low``, ``high``) and the two-sided paired t-test ``p``; ``n`` seeds. NaN where undefined
    (fewer than two seeds; ``p`` and the interval also where every difference is the same)."""

    n: int
    mean: float
    sd: float
    low: float
    high: float
    p: float
    level: float = 0.95


def paired_effect(a, b, level: float = 0.95) -> PairedEffect:
    """The effect of b against a, paired by position (seed): mean of d = b − a, its sd, the t
    interval mean ± t_{(1+level)/2, n−1}·sd/√n and the paired t-test's p-value (as
    `paired_comparison`, NaN when every difference is the same)."""
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"a and b must pair one value per seed: {a.shape} vs {b.shape}.")
    d, n = b - a, len(a)
    if n == 0:
        return PairedEffect(
            0, float("nan"), float("nan"), float("nan"), float("nan"), float("nan"), level
        )
    mean = float(d.mean())
    if n < 2:
        return PairedEffect(n, mean, float("nan"), float("nan"), float("nan"), float("nan"), level)
    sd = float(d.std(ddof=1))
    p = float(paired_comparison(a[:, None], b[:, None]).p_value[0])
    if not np.isfinite(p):  # every difference the same: no spread to build an interval from
        return PairedEffect(n, mean, sd, float("nan"), float("nan"), float("nan"), level)
    half = float(stats.t.ppf((1 + level) / 2, n - 1)) * sd / np.sqrt(n)
    return PairedEffect(n, mean, sd, mean - half, mean + half, p, level)


def detectable(sd: float, n: int, alpha: float) -> float:
    """The smallest |mean paired difference| that a two-sided paired t-test over ``n`` seeds
    rejects at level ``alpha`` when the differences' standard deviation is ``sd``:
    t_{1−α/2, n−1}·sd/√n (NaN for n < 2 or an undefined sd)."""
    if n < 2 or not np.isfinite(sd):
        return float("nan")
    return float(stats.t.ppf(1 - alpha / 2, n - 1)) * sd / np.sqrt(n)


def detectable_at_power(sd: float, n: int, alpha: float, power: float = 0.8) -> float:
    """The smallest true mean paired difference δ that a two-sided paired t-test over ``n``
    seeds at level ``alpha`` detects with probability ``power`` when the differences are normal
    with standard deviation ``sd``: the δ where P(|T| > t_{1−α/2, n−1}) = power, T noncentral
    t with n − 1 degrees of freedom and noncentrality δ√n/sd (NaN for n < 2 or an undefined sd;
    0 when sd is 0)."""
    if n < 2 or not np.isfinite(sd):
        return float("nan")
    if sd == 0:
        return 0.0
    from scipy.optimize import brentq

    df, crit = n - 1, float(stats.t.ppf(1 - alpha / 2, n - 1))

    def short(nc: float) -> float:  # power at noncentrality nc, minus the power wanted
        # P(T < −crit | nc) as P(T > crit | −nc): scipy's far left tail (cdf) can be NaN
        lower = float(np.nan_to_num(stats.nct.sf(crit, df, -nc)))
        return float(stats.nct.sf(crit, df, nc)) + lower - power

    hi = crit + 10.0
    while short(hi) < 0:
        hi *= 2
    return brentq(short, 0.0, hi, xtol=1e-12) * sd / np.sqrt(n)


def verdict(effect: PairedEffect, adjusted_p: float, detect: float, alpha: float = 0.05) -> str:
    """One comparison's verdict in words: "better" or "worse" where the corrected p-value
    ``adjusted_p`` is at most ``alpha``; otherwise "not detectable at this power (detectable:
    ``detect``)", never a claim of no difference; "too few seeds" with one seed, and what the
    seeds show where every seed's difference is the same (no t-test)."""
    if np.isfinite(adjusted_p) and adjusted_p <= alpha:
        return "better" if effect.mean > 0 else "worse"
    if effect.n < 2:
        return "too few seeds"
    if not np.isfinite(effect.p):  # every seed's difference the same: no t-test
        if effect.mean == 0:
            return "the same score on every seed"
        return f"{effect.mean:+.3f} on every seed (no spread to test)"
    return f"not detectable at this power (detectable: {detect:.3f})"


@dataclass(frozen=True)
class SeedVerdict:
    """A reproduction's comparison over the randomised unit (seeds): the paired effect of the
    method against its baseline, the smallest true difference the run detects with 80 % power
    at ``alpha`` (``detectable``), the paper's effect in words, and the verdict."""

    effect: PairedEffect
    detectable: float
    paper: str
    verdict: str


def reproduction_verdict(
    a,
    b,
    *,
    paper: str,
    sign: int,
    alpha: float = 0.05,
    power: float = 0.8,
    paper_effect: float | None = None,
) -> SeedVerdict:
    """b against a paired over seeds (`paired_effect`), judged against the paper's claim that
    b − a has sign ``sign`` (+1 or −1): "reproduced" where the paired t-test rejects at
    ``alpha`` in that direction, "contradicted" where it rejects in the other, else "not
    detectable at this power (detectable: X; paper: ``paper``)", X the difference detected
    with probability ``power`` at the seeds' spread (`detectable_at_power`); "too few seeds"
    below two, and what the seeds show where their differences are all the same (no test: the
    same value on every seed, both at 0 on every seed, or one shift). Where the paper's effect
    is a number (``paper_effect``, b − a), a run that could detect it (detectable at most its
    size) and whose interval excludes it, without a significant change, is "not reproduced":
    the effect, if any, is smaller than the paper's."""
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 or -1, got {sign!r}.")
    effect = paired_effect(a, b)
    detect = detectable_at_power(effect.sd, effect.n, alpha, power)
    if np.isfinite(effect.p) and effect.p <= alpha:
        words = "reproduced" if np.sign(effect.mean) == sign else "contradicted"
    elif effect.n < 2:
        words = "too few seeds"
    elif not np.isfinite(effect.p):  # no spread: no test
        same = np.array_equal(np.asarray(a, dtype=float), np.asarray(b, dtype=float))
        if same:
            words = (
                "both at 0 on every seed (no test)"
                if not np.any(a)
                else ("the same on every seed (no test)")
            )
        else:
            words = f"{effect.mean:+.3g} on every seed (no spread to test)"
    elif (
        paper_effect is not None
        and detect <= abs(paper_effect)
        and not effect.low <= paper_effect <= effect.high
    ):
        words = (
            f"not reproduced: the paper's {paper_effect:+.3g} is outside the interval, and "
            f"the run detects {detect:.3g}"
        )
    else:
        words = f"not detectable at this power (detectable: {detect:.3g}; paper: {paper})"
    return SeedVerdict(effect, detect, paper, words)
