"""Statistics: over seeds (mean, standard deviation, a paired t-test per column) and linear fits."""

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
