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
    with standard deviation ``sd`` (`at_power` with the mean's standard error sd/√n and n − 1
    degrees of freedom; NaN for n < 2 or an undefined sd; 0 when sd is 0)."""
    if n < 2 or not np.isfinite(sd):
        return float("nan")
    return at_power(sd / np.sqrt(n), n - 1, alpha, power)


def at_power(se: float, df: float, alpha: float, power: float = 0.8) -> float:
    """The smallest true difference δ that a two-sided t-test of an estimate with standard
    error ``se`` and ``df`` degrees of freedom, at level ``alpha``, detects with probability
    ``power``: the δ where P(|T| > t_{1−α/2, df}) = power, T noncentral t with ``df`` degrees
    of freedom and noncentrality δ/se (NaN for an undefined se or df < 1; 0 when se is 0)."""
    if not (np.isfinite(se) and np.isfinite(df)) or df < 1:
        return float("nan")
    if se == 0:
        return 0.0
    from scipy.optimize import brentq

    crit = float(stats.t.ppf(1 - alpha / 2, df))

    def short(nc: float) -> float:  # power at noncentrality nc, minus the power wanted
        # P(T < −crit | nc) as P(T > crit | −nc): scipy's far left tail (cdf) can be NaN
        lower = float(np.nan_to_num(stats.nct.sf(crit, df, -nc)))
        return float(stats.nct.sf(crit, df, nc)) + lower - power

    hi = crit + 10.0
    while short(hi) < 0:
        hi *= 2
    return brentq(short, 0.0, hi, xtol=1e-12) * se


@dataclass
class WelchEffect:
    """The difference of two arms' means over independent seeds (b − a), where the arms may
    have different seeds and different numbers of them (unequal allocation): ``n`` and
    ``n_ref`` seeds in b and a, the difference ``mean``, its standard error ``se`` =
    √(s_b²/n + s_a²/n_ref), Welch–Satterthwaite's degrees of freedom ``df``, the ``level`` t
    interval (``low``, ``high``) and Welch's two-sided t-test ``p``. NaN where undefined (fewer
    than two seeds in an arm; ``p`` and the interval also where both arms have no spread)."""

    n: int
    n_ref: int
    mean: float
    se: float
    df: float
    low: float
    high: float
    p: float
    level: float = 0.95


def welch_effect(a, b, level: float = 0.95) -> WelchEffect:
    """The effect of b against a over independent seeds (`WelchEffect`): Welch's t-test and
    interval, which allow arms of different sizes and variances."""
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    na, nb = len(a), len(b)
    nan = float("nan")
    mean = float(b.mean() - a.mean()) if na and nb else nan
    if na < 2 or nb < 2:
        return WelchEffect(nb, na, mean, nan, nan, nan, nan, nan, level)
    va, vb = a.var(ddof=1) / na, b.var(ddof=1) / nb
    se = float(np.sqrt(va + vb))
    rounding = 8 * np.finfo(np.float64).eps * max(np.abs(a).max(), np.abs(b).max(), 1e-300)
    if se <= rounding:  # no spread in either arm: no test
        return WelchEffect(nb, na, mean, se, nan, nan, nan, nan, level)
    df = welch_df(float(a.std(ddof=1)), na, float(b.std(ddof=1)), nb)
    t = mean / se
    p = float(2 * stats.t.sf(abs(t), df))
    half = float(stats.t.ppf((1 + level) / 2, df)) * se
    return WelchEffect(nb, na, mean, se, df, mean - half, mean + half, p, level)


def welch_df(sd_a: float, n_a: int, sd_b: float, n_b: int) -> float:
    """Welch–Satterthwaite's degrees of freedom of a difference of two means of ``n_a`` and
    ``n_b`` independent values with standard deviations ``sd_a`` and ``sd_b`` (n − 1 of the arm
    with spread where the other has none; NaN where neither has)."""
    va, vb = sd_a**2 / n_a, sd_b**2 / n_b
    if va + vb == 0:
        return float("nan")
    return float((va + vb) ** 2 / (va**2 / (n_a - 1) + vb**2 / (n_b - 1)))


@dataclass
class CrossedEffect:
    """A paired difference measured on the same test items for every seed, seeds and items both
    samples (crossed random effects): ``n`` seeds, ``items`` test items, the grand ``mean`` of
    the differences, its standard error ``se`` from the variance components (``seed_var``,
    ``item_var``, ``resid_var``: σ²_seed/n + σ²_item/items + σ²_resid/(n·items)),
    Satterthwaite's degrees of freedom ``df``, the ``level`` t interval (``low``, ``high``) and
    the two-sided t-test ``p``. NaN where undefined (one seed, or no spread)."""

    n: int
    items: int
    mean: float
    se: float
    df: float
    low: float
    high: float
    p: float
    level: float = 0.95
    seed_var: float = float("nan")
    item_var: float = float("nan")
    resid_var: float = float("nan")


def crossed_effect(d, level: float = 0.95) -> CrossedEffect:
    """The effect of a method over seeds and test items together (`CrossedEffect`): ``d``
    ``[seeds, items]`` holds b − a per seed and item, the same items for every seed. Where the
    test set is a sample of the items a verdict generalises to, its spread counts too: the
    two-way ANOVA's mean squares (seeds MS_s, items MS_i, residual MS_e) give the variance
    components σ²_seed = (MS_s − MS_e)/items and σ²_item = (MS_i − MS_e)/n (negative estimates
    set to 0) and σ²_resid = MS_e; the mean's variance is σ²_seed/n + σ²_item/items +
    σ²_resid/(n·items), a combination of mean squares whose degrees of freedom are
    Satterthwaite's. One item is the paired t over seeds; one seed has no interval (the
    seed-to-seed spread is unknown)."""
    d = np.asarray(d, dtype=np.float64)
    if d.ndim != 2:
        raise ValueError(f"d must be [seeds, items], got shape {d.shape}.")
    n, w = d.shape
    nan = float("nan")
    mean = float(d.mean()) if d.size else nan
    if n < 2:
        return CrossedEffect(n, w, mean, nan, nan, nan, nan, nan, level)
    if w == 1:
        e = paired_effect(np.zeros(n), d[:, 0], level)
        se = e.sd / np.sqrt(n) if np.isfinite(e.sd) else nan
        return CrossedEffect(n, w, mean, se, n - 1.0, e.low, e.high, e.p, level, e.sd**2, 0.0, 0.0)
    rows, cols = d.mean(1), d.mean(0)
    ms_s = w * float(((rows - mean) ** 2).sum()) / (n - 1)
    ms_i = n * float(((cols - mean) ** 2).sum()) / (w - 1)
    resid = d - rows[:, None] - cols[None, :] + mean
    df_e = (n - 1) * (w - 1)
    ms_e = float((resid**2).sum()) / df_e
    seed_var, item_var = max(0.0, (ms_s - ms_e) / w), max(0.0, (ms_i - ms_e) / n)
    var, df = _crossed_variance(ms_s, ms_i, ms_e, n, w, seed_var > 0, item_var > 0)
    rounding = 8 * np.finfo(np.float64).eps * max(float(np.abs(d).max()), 1e-300)
    if not var > 0 or np.sqrt(var) <= rounding:
        return CrossedEffect(n, w, mean, 0.0, nan, nan, nan, nan, level, seed_var, item_var, ms_e)
    se = float(np.sqrt(var))
    half = float(stats.t.ppf((1 + level) / 2, df)) * se
    p = float(2 * stats.t.sf(abs(mean) / se, df))
    return CrossedEffect(
        n, w, mean, se, float(df), mean - half, mean + half, p, level, seed_var, item_var, ms_e
    )


def _crossed_variance(ms_s, ms_i, ms_e, n, w, seeds_vary: bool, items_vary: bool):
    """The variance of the grand mean of an n × w crossed design, σ²_seed/n + σ²_item/w +
    σ²_resid/(n·w), as Σ c·MS over its mean squares (a component estimated at 0 drops its
    term), and Satterthwaite's degrees of freedom of that combination."""
    c_s, c_i = float(seeds_vary), float(items_vary)
    terms = [
        (c_s * ms_s, n - 1.0),
        (c_i * ms_i, w - 1.0),
        ((1.0 - c_s - c_i) * ms_e, (n - 1.0) * (w - 1.0)),
    ]
    total = sum(t for t, _ in terms)
    if not total > 0:
        return 0.0, float("nan")
    return total / (n * w), total**2 / sum(t**2 / f for t, f in terms if t != 0)


def crossed_detectable(
    effect: CrossedEffect, seeds: int, items: int, alpha: float = 0.05, power: float = 0.8
) -> float:
    """The difference a run of ``seeds`` × ``items`` detects with probability ``power`` at
    ``alpha`` if its variance components are ``effect``'s (`crossed_effect`; the mean squares
    are their expectations, MS_s = σ²_resid + items·σ²_seed and MS_i = σ²_resid +
    seeds·σ²_item): how many seeds or test items a planned run needs. NaN where the components
    are undefined."""
    sv, iv, rv = effect.seed_var, effect.item_var, effect.resid_var
    if not all(np.isfinite(x) for x in (sv, iv, rv)) or seeds < 2 or items < 2:
        return float("nan")
    var, df = _crossed_variance(rv + items * sv, rv + seeds * iv, rv, seeds, items, sv > 0, iv > 0)
    return at_power(float(np.sqrt(var)), df, alpha, power)


def alpha_words(alpha: float, m: int = 1) -> str:
    """The level a detectable difference was computed at, in words: "α = 0.05" for one test;
    for one of ``m`` comparisons corrected by Holm, its strictest threshold "α/m = 0.05/23"."""
    return f"α = {alpha:g}" if m <= 1 else f"α/m = {alpha:g}/{m}"


def ceiling(reference: float, maximum: float, detect: float) -> str | None:
    """Where the reference arm's score ``reference`` is within the detectable difference
    ``detect`` of the score's ``maximum`` (1 for exact match), the test is at its ceiling: no
    arm can gain more than maximum − reference, less than the test detects. Then that in words,
    "at its ceiling: cannot show a gain larger than …"; None where there is room for a
    detectable gain or a number is undefined."""
    room = maximum - reference
    if not (np.isfinite(room) and np.isfinite(detect)) or room >= detect:
        return None
    return (
        f"at its ceiling: cannot show a gain larger than {room:.3g} (the reference's "
        f"{reference:.3g} against the maximum {maximum:g})"
    )


def verdict(
    effect: PairedEffect | WelchEffect,
    adjusted_p: float,
    detect: float,
    alpha: float = 0.05,
    *,
    m: int = 1,
    reference: float | None = None,
    maximum: float | None = None,
) -> str:
    """One comparison's verdict in words: "better" or "worse" where the corrected p-value
    ``adjusted_p`` is at most ``alpha``; otherwise "not detectable at this power (detectable at
    α/m = …: ``detect``)", ``detect`` computed at Holm's strictest threshold α/m over ``m``
    comparisons, never a claim of no difference, followed by "at its ceiling: …" (`ceiling`)
    where the reference arm's score ``reference`` is so near the score's ``maximum`` that no
    detectable gain is possible (a loss still may be); "too few seeds" with one seed, and what
    the seeds show where every seed's difference is the same (no t-test)."""
    if np.isfinite(adjusted_p) and adjusted_p <= alpha:
        return "better" if effect.mean > 0 else "worse"
    if min(effect.n, getattr(effect, "n_ref", effect.n)) < 2:
        return "too few seeds"
    if not np.isfinite(effect.p):  # every seed's difference the same: no t-test
        if effect.mean == 0:
            return "the same score on every seed"
        return f"{effect.mean:+.3f} on every seed (no spread to test)"
    words = f"not detectable at this power (detectable at {alpha_words(alpha, m)}: {detect:.3f})"
    limit = None if reference is None or maximum is None else ceiling(reference, maximum, detect)
    return words if limit is None else f"{words}; {limit}"


@dataclass(frozen=True)
class SeedVerdict:
    """A reproduction's comparison over the randomised unit (seeds): the paired effect of the
    method against its baseline, the smallest true difference the run detects with 80 % power
    at ``alpha`` (``detectable``), the paper's effect in words, and the verdict."""

    effect: PairedEffect
    detectable: float
    paper: str
    verdict: str
    adjusted_p: float = float("nan")
    m: int = 1


def reproduction_verdict(
    a,
    b,
    *,
    paper: str,
    sign: int,
    alpha: float = 0.05,
    power: float = 0.8,
    paper_effect: float | None = None,
    reference: float | None = None,
    maximum: float | None = None,
    adjusted_p: float | None = None,
    m: int = 1,
    effect: PairedEffect | CrossedEffect | None = None,
) -> SeedVerdict:
    """b against a paired over seeds (`paired_effect`), judged against the paper's claim that
    b − a has sign ``sign`` (+1 or −1): "reproduced" where the paired t-test rejects at
    ``alpha`` in that direction, "contradicted" where it rejects in the other, else "not
    detectable at this power (detectable at α = ``alpha``: X; paper: ``paper``)", X the
    difference detected with probability ``power`` at the seeds' spread
    (`detectable_at_power`); "too few seeds" below two, and what the seeds show where their differences are all the same (no test: the
    same value on every seed, both at 0 on every seed, or one shift). Where the paper's effect
    is a number (``paper_effect``, b − a), a run that could detect it (detectable at most its
    size) and whose interval excludes it, without a significant change, is "not reproduced":
    the effect, if any, is smaller than the paper's. Where the paper claims a gain (``sign``
    +1) and a's mean score ``reference`` is within the detectable difference of the score's
    ``maximum``, the verdict is "at its ceiling" (`ceiling`) instead of "not detectable" or
    "not reproduced": no gain as large as the run could detect is possible.

    One of a family of ``m`` comparisons (`reproduction_verdicts`): the decision is on its
    Holm-adjusted p-value ``adjusted_p`` and the detectable difference is computed at Holm's
    strictest threshold α/m, as the boards' are.

    ``effect``: the comparison's effect where it is not the paired one over seeds of ``a`` and
    ``b`` (each seed's score), e.g. `crossed_effect` over seeds and test items; its interval, p
    and standard error are then the verdict's."""
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 or -1, got {sign!r}.")
    if effect is None:
        effect = paired_effect(a, b)
    m = max(int(m), 1)
    decide = effect.p if adjusted_p is None else float(adjusted_p)
    if isinstance(effect, CrossedEffect):
        detect = at_power(effect.se, effect.df, alpha / m, power)
    else:
        detect = detectable_at_power(effect.sd, effect.n, alpha / m, power)
    level = alpha_words(alpha, m)
    at_ceiling = (
        ceiling(reference, maximum, detect)
        if sign == 1 and reference is not None and maximum is not None
        else None
    )
    if np.isfinite(decide) and decide <= alpha:
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
    elif at_ceiling is not None:
        words = f"{at_ceiling}; detectable at {level}: {detect:.3g}; paper: {paper}"
    elif (
        paper_effect is not None
        and detect <= abs(paper_effect)
        and not effect.low <= paper_effect <= effect.high
    ):
        words = (
            f"not reproduced: the paper's {paper_effect:+.3g} is outside the interval, and "
            f"the run detects {detect:.3g} at {level}"
        )
    else:
        words = (
            f"not detectable at this power (detectable at {level}: {detect:.3g}; paper: {paper})"
        )
    return SeedVerdict(effect, detect, paper, words, decide, m)


def reproduction_verdicts(comparisons: list[dict], *, alpha: float = 0.05, power: float = 0.8):
    """A page's family of comparisons judged together, Holm-corrected: each entry of
    ``comparisons`` is the keyword arguments of one `reproduction_verdict` (``a``, ``b``,
    ``paper``, ``sign`` and its options); each is decided on its Holm-adjusted p-value over
    the family (`holm`; comparisons without a test, such as both at 0 on every seed, do not
    count in m; a comparison given its ``effect``, e.g. `crossed_effect`, is tested by it) and
    its detectable difference is at α/m. A family of one is the plain test."""
    p = [
        c["effect"].p if c.get("effect") is not None else paired_effect(c["a"], c["b"]).p
        for c in comparisons
    ]
    adjusted = holm(p)
    m = int(np.isfinite(adjusted).sum())
    return [
        reproduction_verdict(**c, alpha=alpha, power=power, adjusted_p=q, m=m)
        for c, q in zip(comparisons, adjusted, strict=True)
    ]
