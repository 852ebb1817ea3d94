"""The leaderboard's power statistics (lab/stats.py): each formula against an independent
computation, and the report's comparisons table and verdict wording."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from sharpattn.experiments import leaderboard
from sharpattn.lab.stats import detectable, detectable_at_power, paired_effect, verdict

A = [0.31, 0.29, 0.35, 0.30, 0.27]
B = [0.36, 0.30, 0.41, 0.38, 0.29]


def test_paired_effect_is_scipys_paired_t_interval():
    e = paired_effect(A, B)
    d = np.subtract(B, A)
    res = sps.ttest_rel(B, A)
    ci = res.confidence_interval(0.95)
    assert e.n == 5 and e.mean == pytest.approx(d.mean(), rel=1e-12)
    assert e.sd == pytest.approx(np.std(d, ddof=1), rel=1e-12)
    assert (e.low, e.high) == pytest.approx((ci.low, ci.high), rel=1e-10)
    assert e.p == pytest.approx(res.pvalue, rel=1e-10)
    # one seed: a mean and nothing else; the same difference on every seed: no test
    one = paired_effect([0.1], [0.4])
    assert one.mean == pytest.approx(0.3) and math.isnan(one.sd) and math.isnan(one.p)
    same = paired_effect([0.1, 0.2, 0.3], [0.2, 0.3, 0.4])
    assert math.isnan(same.p) and math.isnan(same.low)


def test_detectable_is_where_the_t_test_starts_to_reject():
    """Differences of spread sd and mean just above (below) the threshold pass (fail) the test
    at that level, built from scratch and tested with scipy."""
    alpha, n = 0.05 / 22, 3
    shape = np.array([-1.0, 0.0, 1.0])  # sd 1
    sd = 0.04
    th = detectable(sd, n, alpha)
    assert th == pytest.approx(sps.t.ppf(1 - alpha / 2, n - 1) * sd / math.sqrt(n), rel=1e-12)
    for factor, rejects in ((1.001, True), (0.999, False)):
        d = th * factor + sd * shape
        p = sps.ttest_1samp(d, 0.0).pvalue
        assert (p <= alpha) == rejects
    assert math.isnan(detectable(sd, 1, alpha)) and math.isnan(detectable(float("nan"), 3, 0.05))


@pytest.mark.parametrize("n, alpha", [(3, 0.05 / 22), (10, 0.05 / 22), (10, 0.05)])
def test_detectable_at_power_has_that_power_by_simulation(n, alpha):
    """An independent check of the noncentral-t solution: simulated paired differences of that
    mean and spread are rejected in 80 % of 40,000 runs (± 3 standard errors)."""
    sd = 0.05
    delta = detectable_at_power(sd, n, alpha, 0.8)
    rng = np.random.default_rng(0)
    d = rng.normal(delta, sd, size=(40_000, n))
    t = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(n))
    crit = sps.t.ppf(1 - alpha / 2, n - 1)
    power = np.mean(np.abs(t) > crit)
    assert power == pytest.approx(0.8, abs=3 * math.sqrt(0.16 / 40_000))
    # above the threshold of the test itself, and the normal approximation's order of size
    assert delta > detectable(sd, n, alpha)
    assert detectable_at_power(0.0, n, alpha) == 0.0
    assert math.isnan(detectable_at_power(sd, 1, alpha))


def test_verdict_wording_never_claims_no_difference():
    e = paired_effect(A, B)
    assert verdict(e, 0.01, 0.2) == "better"
    assert verdict(paired_effect(B, A), 0.01, 0.2) == "worse"
    assert verdict(e, 0.3, 0.123) == "not detectable at this power (detectable at α = 0.05: 0.123)"
    # detectable at Holm's strictest threshold: the wording names it
    assert verdict(e, 0.3, 0.123, m=4).endswith("(detectable at α/m = 0.05/4: 0.123)")
    assert verdict(paired_effect([0.1], [0.2]), float("nan"), float("nan")) == "too few seeds"
    same = paired_effect([0.1, 0.2], [0.1, 0.2])
    assert verdict(same, float("nan"), 0.0) == "the same score on every seed"


def _rows(scores: dict[str, list[float]], task: str = "flip_flop"):
    """Rows of one size per (method, seed) whose accuracy is the score."""
    return [
        {
            "task": task,
            "method": m,
            "seed": s,
            "size": 16,
            "acc": v,
            "token_acc": v,
            "sets": 8,
            "length": 18,
            "skipped": False,
        }
        for m, vs in scores.items()
        for s, v in enumerate(vs)
    ]


def test_rank_states_every_comparison_with_its_interval_and_power():
    base = [0.30, 0.32, 0.28, 0.31, 0.29, 0.30, 0.33, 0.27, 0.30, 0.31]
    rows = _rows(
        {
            "softmax": base,
            "good": [b + 0.2 for b in base[:9]] + [0.52],
            "noisy": [b + (0.1 if i % 2 else -0.1) for i, b in enumerate(base)],
        }
    )
    table = leaderboard.rank(rows, ["flip_flop"])
    by = {e["method"]: e for e in table}
    good, noisy = by["good"], by["noisy"]
    assert good["power"]["verdict"] == "better"
    assert noisy["power"]["verdict"].startswith(
        "not detectable at this power (detectable at α/m = 0.05/2: "
    )
    # the family is the two methods compared with softmax: α/m = 0.025
    e = noisy["effect"]
    assert noisy["power"]["threshold"] == pytest.approx(detectable(e.sd, 10, 0.025))
    assert noisy["power"]["at_power"] == pytest.approx(detectable_at_power(e.sd, 10, 0.025))
    assert by["good"]["tasks"]["flip_flop"]["power"]["verdict"] == "better"
    shown, raw = leaderboard.effects(table, ["flip_flop"])
    assert [r[:2] for r in shown] == [
        ["overall", "good"],
        ["overall", "noisy"],
        ["flip_flop", "good"],
        ["flip_flop", "noisy"],
    ]
    assert len(shown[0]) == len(leaderboard.EFFECT_HEADER)
    assert shown[0][4].startswith("[+0.1") and "does not differ" not in str(shown)


def test_reproduction_verdict_reads_reproduced_contradicted_or_not_detectable():
    """The paper says b − a > 0: a clear gain reproduces it, a clear loss contradicts it, a
    noisy one is "not detectable" with the 80 %-power difference and the paper's effect."""
    from sharpattn.lab.stats import detectable_at_power, reproduction_verdict

    a = np.array([0.50, 0.52, 0.49, 0.51, 0.50])
    gain = reproduction_verdict(a, a + [0.10, 0.11, 0.09, 0.10, 0.12], paper="+0.02", sign=1)
    assert gain.verdict == "reproduced" and gain.effect.low > 0
    loss = reproduction_verdict(a, a - [0.10, 0.11, 0.09, 0.10, 0.12], paper="+0.02", sign=1)
    assert loss.verdict == "contradicted"
    noisy = reproduction_verdict(a[:2], a[:2] + [0.05, -0.03], paper="+0.02", sign=1)
    want = detectable_at_power(float(np.std([0.05, -0.03], ddof=1)), 2, 0.05, 0.8)
    assert noisy.verdict == (
        f"not detectable at this power (detectable at α = 0.05: {want:.3g}; paper: +0.02)"
    )
    assert noisy.effect.low < 0 < noisy.effect.high
    assert reproduction_verdict(a[:1], a[:1], paper="x", sign=-1).verdict == "too few seeds"
    with pytest.raises(ValueError, match="sign"):
        reproduction_verdict(a, a, paper="x", sign=0)


def test_a_family_of_verdicts_is_decided_on_holm_adjusted_p_values():
    """A page's comparisons judged together: each decided on its Holm-adjusted p-value (checked
    against scipy's paired t-test and Holm's step-down written out), the detectable difference
    at α/m, cells without a test (the same on every seed) outside m; a family of one is the
    plain verdict."""
    from scipy import stats as sps

    from sharpattn.lab.stats import detectable_at_power, reproduction_verdict, reproduction_verdicts

    a = np.array([0.50, 0.52, 0.49, 0.51, 0.50])
    gains = [
        [0.10, 0.11, 0.09, 0.10, 0.12],  # p ~ 1e-5: survives
        [0.04, -0.005, 0.05, 0.03, 0.02],  # p ~ 0.04 alone: not after Holm (x 2)
        [0.02, -0.03, 0.01, 0.00, -0.01],
        [0.0] * 5,  # no test
    ]
    family = [dict(a=a, b=a + g, paper="+0.02", sign=1) for g in gains]
    judged = reproduction_verdicts(family)
    raw = [sps.ttest_rel(a + g, a).pvalue for g in gains[:3]]
    assert 0.025 < raw[1] < 0.05 and raw[0] < raw[1] < raw[2]  # significant alone only
    order = np.argsort(raw)
    want, running = {}, 0.0
    for i, j in enumerate(order):  # Holm's step-down over the m = 3 tests
        running = max(running, min(1.0, (3 - i) * raw[j]))
        want[j] = running
    for j in range(3):
        assert judged[j].adjusted_p == pytest.approx(want[j], rel=1e-9)
        assert judged[j].m == 3
    assert np.isnan(judged[3].adjusted_p) and judged[3].verdict.startswith("the same")
    assert judged[0].verdict == "reproduced"
    alone = reproduction_verdict(**family[1])
    assert alone.verdict == "reproduced"
    assert judged[1].verdict.startswith("not detectable at this power (detectable at α/m = 0.05/3")
    sd = float(np.std(gains[1], ddof=1))
    assert judged[1].detectable == pytest.approx(detectable_at_power(sd, 5, 0.05 / 3))
    assert judged[1].detectable > alone.detectable
    [one] = reproduction_verdicts(family[1:2])
    assert (one.verdict, one.detectable, one.m) == (alone.verdict, alone.detectable, 1)


def test_a_run_that_could_see_the_papers_effect_and_did_not_says_not_reproduced():
    """Not significant, the paper's effect detectable and outside the interval: "not
    reproduced"; inside the interval, or beyond the run's power: "not detectable"."""
    import numpy as np

    from sharpattn.lab.stats import reproduction_verdict

    a = np.zeros(12)
    small = np.array(
        [0.003, -0.002, 0.001, -0.003, 0.002, -0.001, 0.0, 0.002, -0.002, 0.001, -0.001, 0.0]
    )
    v = reproduction_verdict(a, small, paper="-0.02", sign=-1, paper_effect=-0.02)
    assert v.verdict.startswith("not reproduced") and v.detectable < 0.02
    assert not v.effect.low <= -0.02 <= v.effect.high
    inside = reproduction_verdict(a, small, paper="-0.001", sign=-1, paper_effect=-0.001)
    assert inside.verdict.startswith("not detectable")
    noisy = reproduction_verdict(
        a[:3], [0.05, -0.04, 0.01], paper="-0.02", sign=-1, paper_effect=-0.02
    )
    assert noisy.verdict.startswith("not detectable") and noisy.detectable > 0.02


def test_a_reference_within_the_detectable_difference_of_the_maximum_is_at_its_ceiling():
    """Softmax at 0.979 of a maximum 1 with 0.144 detectable: no gain above 0.021 is possible, so
    the verdict says the test is at its ceiling, not that a larger gain is ruled out; with room
    for a detectable gain, the usual verdict."""
    from sharpattn.lab.stats import ceiling

    assert ceiling(0.979, 1.0, 0.144) == (
        "at its ceiling: cannot show a gain larger than 0.021 (the reference's 0.979 against the "
        "maximum 1)"
    )
    assert ceiling(0.5, 1.0, 0.144) is None
    assert ceiling(0.979, 1.0, float("nan")) is None
    e = paired_effect([0.97, 0.99, 0.98], [0.96, 1.0, 0.97])
    words = verdict(e, 0.6, 0.144, m=5, reference=0.98, maximum=1.0)
    # a loss may still be detectable: the verdict is not detectable, and at its ceiling for a gain
    assert words == (
        "not detectable at this power (detectable at α/m = 0.05/5: 0.144); at its ceiling: "
        "cannot show a gain larger than 0.02 (the reference's 0.98 against the maximum 1)"
    )
    assert verdict(e, 0.6, 0.01, m=5, reference=0.98, maximum=1.0) == (
        "not detectable at this power (detectable at α/m = 0.05/5: 0.010)"
    )
    assert verdict(e, 0.01, 0.144, reference=0.98, maximum=1.0) == "worse"  # a test still rejects


def test_a_reproduction_of_a_gain_near_the_maximum_is_at_its_ceiling():
    from sharpattn.lab.stats import reproduction_verdict

    a = np.array([0.98, 0.99, 0.97])
    b = np.array([0.99, 0.98, 0.99])
    v = reproduction_verdict(a, b, paper="+0.05", sign=1, reference=a.mean(), maximum=1.0)
    assert v.verdict.startswith("at its ceiling: cannot show a gain larger than 0.02 ")
    assert v.verdict.endswith(f"; detectable at α = 0.05: {v.detectable:.3g}; paper: +0.05")
    # a claimed loss is not bounded by the maximum
    down = reproduction_verdict(a, b, paper="-0.05", sign=-1, reference=a.mean(), maximum=1.0)
    assert down.verdict.startswith("not detectable")


def test_the_leaderboard_says_a_comparison_with_softmax_at_its_maximum_is_at_its_ceiling():
    base = [1.0, 0.96, 0.98]
    rows = _rows({"softmax": base, "near": [0.97, 0.99, 0.96], "far": [0.5, 0.6, 0.55]})
    by = {e["method"]: e for e in leaderboard.rank(rows, ["flip_flop"])}
    assert "; at its ceiling: cannot show a gain" in by["near"]["power"]["verdict"]
    assert "at its ceiling" in by["near"]["tasks"]["flip_flop"]["power"]["verdict"]
    assert by["far"]["power"]["verdict"] != by["near"]["power"]["verdict"]


def test_the_crossed_effect_covers_the_mean_over_seeds_and_items_at_its_level():
    """Seeds and test items both samples (crossed random effects, σ_seed = 1, σ_item = 2,
    σ_resid = 1.5): the 95 % interval of `crossed_effect` holds the true mean in 95 % of
    simulated runs (binomial 99.9 % band over 4,000), where the interval over seeds alone,
    which treats the items as the population, holds it far less often."""
    from scipy import stats as sps

    from sharpattn.lab.stats import crossed_effect

    g = np.random.default_rng(7)
    reps, n, w = 4000, 6, 8
    held = held_fixed = 0
    for _ in range(reps):
        d = 0.3 + g.normal(0, 1.0, (n, 1)) + g.normal(0, 2.0, (1, w)) + g.normal(0, 1.5, (n, w))
        e = crossed_effect(d)
        held += e.low <= 0.3 <= e.high
        rows = d.mean(1)
        half = sps.t.ppf(0.975, n - 1) * rows.std(ddof=1) / np.sqrt(n)
        held_fixed += rows.mean() - half <= 0.3 <= rows.mean() + half
    band = sps.binom.ppf([0.0005, 0.9995], reps, 0.95) / reps
    assert band[0] <= held / reps <= band[1]
    assert held_fixed / reps < 0.8


def test_the_crossed_effect_reduces_to_the_paired_t_and_matches_its_anova():
    """One item: the paired t over seeds. No item or seed effect in the data: the variance
    components are the ANOVA's (checked by hand); planned at the run's own size, the detectable
    difference is the run's."""
    from sharpattn.lab.stats import at_power, crossed_detectable, crossed_effect, paired_effect

    g = np.random.default_rng(3)
    d = g.normal(0.2, 1.0, (5, 1))
    one, paired = crossed_effect(d), paired_effect(np.zeros(5), d[:, 0])
    assert (one.low, one.high, one.p) == pytest.approx((paired.low, paired.high, paired.p))
    d = g.normal(0.0, 1.0, (4, 6))
    e = crossed_effect(d)
    grand, rows, cols = d.mean(), d.mean(1), d.mean(0)
    ms_s = 6 * ((rows - grand) ** 2).sum() / 3
    ms_i = 4 * ((cols - grand) ** 2).sum() / 5
    ms_e = ((d - rows[:, None] - cols[None, :] + grand) ** 2).sum() / 15
    assert e.resid_var == pytest.approx(ms_e)
    assert e.seed_var == pytest.approx(max(0.0, (ms_s - ms_e) / 6))
    assert e.item_var == pytest.approx(max(0.0, (ms_i - ms_e) / 4))
    var = e.seed_var / 4 + e.item_var / 6 + e.resid_var / 24
    assert e.se == pytest.approx(np.sqrt(var))
    # planning: more items shrink the detectable difference; the run's own size gives its own
    same = crossed_detectable(e, 4, 6)
    assert same == pytest.approx(at_power(e.se, e.df, 0.05))
    assert crossed_detectable(e, 4, 64) < same
    assert crossed_effect(np.full((3, 4), 0.5)).p != crossed_effect(np.full((3, 4), 0.5)).p
    assert np.isnan(crossed_effect(d[:1]).low)
    with pytest.raises(ValueError, match="seeds, items"):
        crossed_effect(d[0])


def test_a_family_member_given_its_own_effect_is_tested_by_it():
    """A comparison with a crossed effect (seeds × items) enters Holm with that effect's p."""
    from sharpattn.lab.stats import crossed_effect, holm, paired_effect, reproduction_verdicts

    g = np.random.default_rng(11)
    d = 0.05 + g.normal(0, 0.02, (6, 1)) + g.normal(0, 0.05, (1, 8)) + g.normal(0, 0.02, (6, 8))
    a = np.zeros(6)
    crossed = crossed_effect(d)
    other = [0.50, 0.52, 0.49, 0.51, 0.50, 0.53]
    family = [
        dict(a=a, b=d.mean(1), paper="+", sign=1, effect=crossed),
        dict(a=other, b=np.add(other, [0.01, -0.01, 0.02, 0.0, 0.01, -0.02]), paper="+", sign=1),
    ]
    judged = reproduction_verdicts(family)
    want = holm([crossed.p, paired_effect(family[1]["a"], family[1]["b"]).p])
    assert [v.adjusted_p for v in judged] == pytest.approx(list(want))
    assert judged[0].effect is crossed
