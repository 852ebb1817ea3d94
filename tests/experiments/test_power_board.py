"""The power board's pieces without training: Welch's effect and the power of its test against
independent computations (lab/stats.py), the plan file and the record of a planned run
(lab/plan.py), the power plan from a pilot's rows (experiments/leaderboard_power.py) and the
plateau rule of training until converged (sequence/training.py)."""

from __future__ import annotations

import io
import json
import math
import tarfile
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from sharpattn.experiments import leaderboard_power as power
from sharpattn.experiments.sequence import training
from sharpattn.lab import plan as planning
from sharpattn.lab.stats import (
    at_power,
    detectable_at_power,
    verdict,
    welch_df,
    welch_effect,
)


def _one_sentence(err: BaseException) -> str:
    """The message of ``err``: one line, one sentence, ending with a full stop."""
    words = str(err)
    assert "\n" not in words and words.endswith("."), words
    assert ". " not in words, words
    return words


# --- Welch's effect -------------------------------------------------------------------------------

#: three seeds of the reference against seventeen of the method, of unequal spreads
A3 = np.array([0.412, 0.471, 0.383])
B17 = np.random.default_rng(3).normal(0.5, 0.015, 17)


@pytest.mark.parametrize("level", [0.95, 0.9])
def test_welch_effect_is_scipys_welch_test_and_satterthwaites_interval(level):
    e = welch_effect(A3, B17, level)
    va, vb = A3.var(ddof=1) / 3, B17.var(ddof=1) / 17  # by hand, in float64
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 16)
    se = math.sqrt(va + vb)
    mean = B17.mean() - A3.mean()
    half = sps.t.ppf((1 + level) / 2, df) * se
    assert (e.n, e.n_ref, e.level) == (17, 3, level)
    assert e.mean == pytest.approx(mean, rel=1e-12)
    assert e.se == pytest.approx(se, rel=1e-12)
    assert e.df == pytest.approx(df, rel=1e-12)
    assert (e.low, e.high) == pytest.approx((mean - half, mean + half), rel=1e-10)
    assert 2 < df < 3  # the three noisy seeds dominate: close to their n − 1, not 18
    res = sps.ttest_ind(B17, A3, equal_var=False)
    assert e.p == pytest.approx(res.pvalue, rel=1e-10)
    ci = res.confidence_interval(level)
    assert (e.low, e.high) == pytest.approx((ci.low, ci.high), rel=1e-10)
    sd_a, sd_b = A3.std(ddof=1), B17.std(ddof=1)
    assert welch_df(sd_a, 3, sd_b, 17) == pytest.approx(df, rel=1e-12)
    flipped = welch_effect(B17, A3, level)  # the other way round: the same test
    assert flipped.mean == pytest.approx(-mean) and flipped.p == pytest.approx(e.p)
    assert (flipped.n, flipped.n_ref) == (3, 17)


@pytest.mark.filterwarnings("ignore:Precision loss:RuntimeWarning")  # scipy, a constant arm
def test_welch_without_spread_or_with_one_seed_has_no_test():
    same = welch_effect([0.5] * 3, [0.7] * 17)
    assert same.mean == pytest.approx(0.2)
    assert all(math.isnan(v) for v in (same.p, same.df, same.low, same.high))
    assert verdict(same, float("nan"), float("nan")) == "+0.200 on every seed (no spread to test)"
    # spread in one arm only: n − 1 of that arm, as scipy's test
    one_side = welch_effect([0.5] * 3, B17)
    assert one_side.df == pytest.approx(16) and welch_df(0.0, 3, 0.02, 17) == pytest.approx(16)
    assert one_side.p == pytest.approx(
        sps.ttest_ind(B17, [0.5] * 3, equal_var=False).pvalue, rel=1e-10
    )
    assert math.isnan(welch_df(0.0, 3, 0.0, 17))
    for a, b in (([0.5], B17), (A3, [0.6])):  # an arm of one seed
        e = welch_effect(a, b)
        assert np.isfinite(e.mean)
        assert all(math.isnan(v) for v in (e.se, e.df, e.low, e.high, e.p))
        assert verdict(e, float("nan"), float("nan")) == "too few seeds"
    assert math.isnan(welch_effect([], B17).mean)


@pytest.mark.parametrize("sd, sd_ref", [(0.03, 0.02), (0.02, 0.03)])
def test_welch_detectable_at_power_has_that_power_by_simulation(sd, sd_ref):
    """The plan's detectable difference of a method's 6 seeds against softmax's 17 at Holm's
    α/23 (noncentral t at Welch–Satterthwaite's df of the true spreads): Welch's test of
    simulated arms with that true difference rejects in about 80 % of 40,000 runs. The
    approximation ignores the spread of the estimated variances and df: measured, the power
    is 0.77 in both settings, so the tolerance is 0.04 (the simulation's own standard error is 0.002)."""
    n, n_ref, alpha = 6, 17, 0.05 / 23
    delta = power.detectable(sd, n, sd_ref, n_ref, alpha, 0.8, paired=False)
    se = math.sqrt(sd**2 / n + sd_ref**2 / n_ref)
    assert delta == pytest.approx(at_power(se, welch_df(sd_ref, n_ref, sd, n), alpha, 0.8))
    rng = np.random.default_rng(0)
    b = rng.normal(delta, sd, size=(40_000, n))
    a = rng.normal(0.0, sd_ref, size=(40_000, n_ref))
    rejected = np.mean(sps.ttest_ind(b, a, axis=1, equal_var=False).pvalue <= alpha)
    assert rejected == pytest.approx(0.8, abs=0.04)
    # paired: the paired t-test's own (`detectable_at_power`), over the reference's seeds
    paired = power.detectable(sd, n, sd_ref, n_ref, alpha, 0.8, paired=True)
    assert paired == pytest.approx(detectable_at_power(sd, n_ref, alpha, 0.8), rel=1e-12)
    assert math.isnan(power.detectable(sd, 1, sd_ref, n_ref, alpha, 0.8, paired=False))


def test_at_power_is_shared_by_the_paired_test_and_defined_where_it_can_be():
    for n in (2, 5, 17):
        assert detectable_at_power(0.04, n, 0.01) == at_power(0.04 / math.sqrt(n), n - 1, 0.01)
    assert at_power(0.0, 5, 0.05) == 0.0
    assert math.isnan(at_power(float("nan"), 5, 0.05))
    assert math.isnan(at_power(0.01, 0.5, 0.05)) and math.isnan(at_power(0.01, math.nan, 0.05))
    # more power or a stricter level needs a larger difference; more df a smaller one
    assert at_power(0.01, 5, 0.05, 0.9) > at_power(0.01, 5, 0.05, 0.8)
    assert at_power(0.01, 5, 0.05 / 23) > at_power(0.01, 5, 0.05) > at_power(0.01, 50, 0.05)


# --- the plan file --------------------------------------------------------------------------------

PLAN = {
    "experiment": "leaderboard",
    "tasks": ["two_back"],
    "seeds": {"softmax": 3, "sigmoid": 2},
    "alpha": 0.05,
    "commit": "a" * 40,
}


def test_a_plan_is_written_once_and_the_same_plan_passes(tmp_path):
    folder = tmp_path / "run"
    assert planning.read_plan(folder) is None
    assert planning.fix_plan(folder, PLAN) == PLAN
    written = (folder / "plan.json").read_text()
    assert json.loads(written) == PLAN == planning.read_plan(folder)
    again = json.loads(json.dumps(PLAN))  # as JSON gives it back
    assert planning.fix_plan(folder, again) == PLAN
    assert (folder / "plan.json").read_text() == written


def test_another_commit_or_another_plan_is_refused_in_one_sentence(tmp_path):
    planning.fix_plan(tmp_path, PLAN)
    written = (tmp_path / "plan.json").read_text()
    with pytest.raises(ValueError) as err:
        planning.fix_plan(tmp_path, {**PLAN, "commit": "b" * 40})
    words = _one_sentence(err.value)
    assert f"planned at commit {'a' * 12} and this code is at {'b' * 12}" in words
    assert f"git worktree add DIR {'a' * 12}" in words
    with pytest.raises(ValueError, match=r"planned otherwise \(seeds differ\)") as err:
        planning.fix_plan(tmp_path, {**PLAN, "seeds": {"softmax": 4, "sigmoid": 2}})
    assert "another --out" in _one_sentence(err.value)
    with pytest.raises(ValueError, match=r"\(alpha, power differ\)"):
        planning.fix_plan(tmp_path, {**PLAN, "alpha": 0.01, "power": 0.8})
    assert (tmp_path / "plan.json").read_text() == written  # refused: left as it was


@pytest.mark.parametrize("text, words", [("{not json", "JSONDecodeError"), ("[1]", "not a JSON")])
def test_a_damaged_plan_is_refused_in_one_sentence(tmp_path, text, words):
    (tmp_path / "plan.json").write_text(text)
    with pytest.raises(ValueError, match=f"is damaged \\({words}") as err:
        planning.fix_plan(tmp_path, PLAN)
    _one_sentence(err.value)


def test_the_pinned_commit_is_the_checkouts_and_refuses_uncommitted_changes(monkeypatch):
    here = {"commit": "c" * 40, "modified": False, "version": "9.9"}
    monkeypatch.setattr(planning, "code_version", lambda: here)
    assert planning.pinned_commit() == "c" * 40
    here["modified"] = True
    with pytest.raises(ValueError, match=f"uncommitted changes at {'c' * 12}") as err:
        planning.pinned_commit()
    assert "\n" not in str(err.value)
    assert planning.pinned_commit(allow_modified=True) == f"{'c' * 40} with uncommitted changes"
    here["commit"] = None  # an installed package
    assert planning.pinned_commit() == "sharpattn 9.9"


# --- the record -----------------------------------------------------------------------------------

JOB = "train/two_back/softmax/seed0"
KEPT = (
    "config.json",
    "plan.json",
    "report.md",
    f"{JOB}/rows-0123456789ab.json",
    f"{JOB}/checks.json",
    f"{JOB}/eval/softmax/n16.json",
)
LEFT = (
    f"{JOB}/model.safetensors",
    f"{JOB}/checkpoint.safetensors",
    f"{JOB}/metrics.jsonl",
    "heatmap.png",
    "leaderboard.png",
)


def _folder(path: Path, plan: dict = PLAN) -> Path:
    """A run folder holding each of `KEPT` and `LEFT` (its plan ``plan``)."""
    for name in KEPT + LEFT:
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(f"content of {name}")
    (path / "plan.json").write_text(json.dumps(plan))
    return path


def _names(record: Path) -> set[str]:
    with tarfile.open(record, "r:gz") as tar:
        return {m.name for m in tar.getmembers() if m.isfile()}


def test_pack_keeps_results_and_leaves_out_weights_logs_and_figures(tmp_path):
    run = _folder(tmp_path / "run")
    record = planning.pack(run, tmp_path / "out" / "r.tar.gz", {"wall": 12.34, "cpu": 20.01})
    assert record == tmp_path / "out" / "r.tar.gz"
    assert _names(record) == {f"run/{n}" for n in (*KEPT, "sittings.json")}
    sittings = json.loads((run / "sittings.json").read_text())
    assert len(sittings) == 1 and (sittings[0]["wall"], sittings[0]["cpu"]) == (12.3, 20.0)
    assert {"commit", "ended"} <= set(sittings[0])
    planning.pack(run, record, {"wall": 1.0, "cpu": 3.0})  # a second sitting is added
    assert [s["cpu"] for s in json.loads((run / "sittings.json").read_text())] == [20.0, 3.0]
    with tarfile.open(record, "r:gz") as tar:
        packed = json.loads(tar.extractfile("run/sittings.json").read())
    assert len(packed) == 2
    planning.pack(run, tmp_path / "plain.tar.gz")  # no seconds: no sitting added
    assert len(json.loads((run / "sittings.json").read_text())) == 2


def test_a_record_kept_in_its_own_run_folder_is_not_packed_into_the_next(tmp_path):
    run = _folder(tmp_path / "run")
    record = run / "record.tar.gz"
    for _ in range(3):  # one sitting after another
        planning.pack(run, record, {"wall": 1, "cpu": 1})
        assert _names(record) == {f"run/{n}" for n in (*KEPT, "sittings.json")}


def test_unpack_restores_the_record_and_keeps_what_the_folder_has(tmp_path):
    run = _folder(tmp_path / "run")
    record = planning.pack(run, tmp_path / "r.tar.gz", {"wall": 1, "cpu": 1})
    fresh = tmp_path / "elsewhere"  # another name: the record's folder is its root
    assert planning.unpack(record, fresh, PLAN) == len(KEPT) + 1
    for name in (*KEPT, "sittings.json"):
        assert (fresh / name).read_bytes() == (run / name).read_bytes()
    assert not any((fresh / name).exists() for name in LEFT)
    newer = tmp_path / "newer"
    (newer / JOB).mkdir(parents=True)
    (newer / JOB / "checks.json").write_text("this sitting's")
    assert planning.unpack(record, newer, PLAN) == len(KEPT)
    assert (newer / JOB / "checks.json").read_text() == "this sitting's"
    assert planning.unpack(record, newer, PLAN) == 0  # every file there already


def test_unpack_refuses_another_plan_or_commit_before_writing(tmp_path):
    record = planning.pack(_folder(tmp_path / "run"), tmp_path / "r.tar.gz")
    target = tmp_path / "target"
    with pytest.raises(ValueError, match=r"planned otherwise \(seeds differ\)") as err:
        planning.unpack(record, target, {**PLAN, "seeds": {"softmax": 17}})
    assert "another --record" in _one_sentence(err.value)
    with pytest.raises(ValueError, match="git worktree add DIR") as err:
        planning.unpack(record, target, {**PLAN, "commit": "d" * 40})
    _one_sentence(err.value)
    assert not target.exists()


def test_a_damaged_or_truncated_record_is_refused_in_one_sentence(tmp_path):
    whole = planning.pack(_folder(tmp_path / "run"), tmp_path / "r.tar.gz").read_bytes()
    for i, data in enumerate((whole[: len(whole) // 2], b"not a tar file at all", b"")):
        record = tmp_path / f"bad{i}.tar.gz"
        record.write_bytes(data)
        with pytest.raises(ValueError, match="is damaged") as err:
            planning.unpack(record, tmp_path / "target", PLAN)
        assert "another --out" in _one_sentence(err.value)
    with pytest.raises(ValueError, match="is damaged"):
        planning.unpack(tmp_path / "missing.tar.gz", tmp_path / "target", PLAN)
    assert not (tmp_path / "target").exists()


def _tar(path: Path, files: dict[str, str]) -> Path:
    """A .tar.gz of ``files`` ({member name: text}), made by hand in that order."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buffer.getvalue())
    return path


def test_a_record_naming_a_file_outside_its_folder_is_refused_before_writing(tmp_path):
    record = _tar(
        tmp_path / "evil.tar.gz",
        {
            "run/plan.json": json.dumps(PLAN),
            "run/config.json": "{}",
            "run/../escaped.json": "outside",
        },
    )
    target = tmp_path / "box" / "target"
    with pytest.raises(ValueError, match="names a file outside its run folder") as err:
        planning.unpack(record, target, PLAN)
    assert "run/../escaped.json" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "box" / "escaped.json").exists()
    assert not target.exists()  # refused as a whole: nothing of it written


def test_a_record_without_a_plan_or_a_single_folder_is_refused(tmp_path):
    bare = _tar(tmp_path / "bare.tar.gz", {"run/config.json": "{}"})
    with pytest.raises(ValueError, match="has no plan.json: it is not a planned run's record") as e:
        planning.unpack(bare, tmp_path / "t", PLAN)
    _one_sentence(e.value)
    two = _tar(tmp_path / "two.tar.gz", {"a/plan.json": json.dumps(PLAN), "b/x.json": "{}"})
    with pytest.raises(ValueError, match="no single run folder in it"):
        planning.unpack(two, tmp_path / "t", PLAN)
    assert not (tmp_path / "t").exists()


# --- the power plan from a pilot's rows -----------------------------------------------------------

TASKS = ["two_back", "flip_flop"]
#: {method: {task: [(score, train_seconds) per seed]}}; two_back and flip_flop train at 16-48,
#: so both evaluated sizes (16, 32) are in distribution and a seed's score is its accuracy
PILOT = {
    "softmax": {
        "two_back": [(0.95, 10.0), (0.90, 10.0), (0.97, 13.0), (0.92, 15.0)],
        "flip_flop": [(0.80, 20.0), (0.85, 22.0), (0.75, 21.0), (0.90, 25.0)],
    },
    "sigmoid": {  # seed 3 has two_back only: not in the overall score
        "two_back": [(0.60, 30.0), (0.70, 30.0), (0.65, 33.0), (0.99, 31.0)],
        "flip_flop": [(0.50, 40.0), (0.55, 44.0), (0.40, 41.0)],
    },
    "relu": {
        "two_back": [(0.91, 5.0), (0.93, 6.0), (0.89, 7.0)],
        "flip_flop": [(0.70, 8.0), (0.72, 8.0), (0.71, 9.0)],
    },
}
#: evaluated on softmax's models: softmax's score plus a shift per seed, softmax's seconds
SHIFT = {"two_back": [0.01, -0.02, 0.03, 0.0], "flip_flop": [0.02, 0.0, -0.01, 0.05]}


def _row(task: str, method: str, seed: int, size: int, acc: float, seconds: float) -> dict:
    return {
        "task": task,
        "method": method,
        "seed": seed,
        "size": size,
        "acc": acc,
        "token_acc": acc,
        "sets": 16,
        "length": 2 * size + 2,
        "skipped": False,
        "train_seconds": seconds,
        "train_steps": 100,
    }


def pilot_rows() -> list[dict]:
    """Rows as the sequence engine writes them: per (task, method, seed) one row per size, each
    with the job's training seconds."""
    rows = []
    for method, per in PILOT.items():
        for task, seeds in per.items():
            for seed, (acc, seconds) in enumerate(seeds):
                rows += [_row(task, method, seed, n, acc, seconds) for n in (16, 32)]
    for task, seeds in PILOT["softmax"].items():
        for seed, (acc, seconds) in enumerate(seeds):
            shifted = acc + SHIFT[task][seed]
            rows += [_row(task, "logn (inference)", seed, n, shifted, seconds) for n in (16, 32)]
    return rows


def _overall(method: str) -> dict[int, float]:
    per = PILOT[method]
    seeds = set.intersection(*(set(range(len(per[t]))) for t in TASKS))
    return {s: float(np.mean([per[t][s][0] for t in TASKS])) for s in sorted(seeds)}


METHODS = ["softmax", "sigmoid", "relu", "logn (inference)", "ssmax"]


def test_arms_read_each_methods_spread_cost_and_convergence_from_the_pilot():
    rows = pilot_rows()
    found = power.arms(rows, TASKS, METHODS)
    assert list(found) == METHODS
    soft, sig, relu = found["softmax"], found["sigmoid"], found["relu"]
    assert soft.sd == pytest.approx(np.std(list(_overall("softmax").values()), ddof=1))
    assert (soft.seeds, sig.seeds, relu.seeds) == (4, 3, 3)
    assert sig.sd == pytest.approx(np.std(list(_overall("sigmoid").values()), ddof=1))
    assert power.scores(rows, "sigmoid", TASKS) == pytest.approx(_overall("sigmoid"))
    # CPU a seed: per task the mean over seeds of each seed's training seconds (softmax's seeds
    # 0 and 1 both took 10 s on two_back: each counts), summed over the tasks
    assert soft.cpu == pytest.approx(np.mean([10, 10, 13, 15]) + np.mean([20, 22, 21, 25]))
    assert sig.cpu == pytest.approx(np.mean([30, 30, 33, 31]) + np.mean([40, 44, 41]))
    assert relu.cpu == pytest.approx(np.mean([5, 6, 7]) + np.mean([8, 8, 9]))
    # converged in distribution: the share of (task, seed) runs at 0.9 or more
    assert soft.converged == pytest.approx(5 / 8)
    assert sig.converged == pytest.approx(1 / 7)
    assert relu.converged == pytest.approx(2 / 6)
    assert not (soft.paired or sig.paired or relu.paired)
    # on softmax's models: paired, free, its sd that of the differences seed by seed
    logn = found["logn (inference)"]
    diffs = [np.mean([SHIFT[t][s] for t in TASKS]) for s in range(4)]
    assert logn.paired and logn.cpu == 0.0 and logn.seeds == 4
    assert logn.sd == pytest.approx(np.std(diffs, ddof=1))
    # a method the pilot did not run: no spread, the median CPU of those that train
    missing = found["ssmax"]
    assert math.isnan(missing.sd) and missing.seeds == 0 and math.isnan(missing.converged)
    assert missing.cpu == pytest.approx(np.median([soft.cpu, sig.cpu, relu.cpu]))
    assert power.same_models("adaptive (inference)") and not power.same_models("sigmoid")


def test_unconverged_lists_the_runs_below_the_threshold_in_order():
    low = power.unconverged(pilot_rows())
    assert low[0] == ("flip_flop", "logn (inference)", 0, pytest.approx(0.82))
    runs = {(t, m, s) for t, m, s, _ in low}
    assert ("two_back", "softmax", 1) not in runs and ("flip_flop", "softmax", 3) not in runs  # 0.9
    assert {("flip_flop", "sigmoid", 2), ("two_back", "relu", 2)} <= runs
    assert low == sorted(low)
    assert all(v < power.CONVERGED for *_, v in low)


def test_an_allocation_detects_and_costs_what_its_parts_say():
    found = power.arms(pilot_rows(), TASKS, METHODS)
    a = power.evaluate_allocation(found, 5, 9)
    level = 0.05 / 4  # four methods against softmax
    pooled = power.pooled_sd(found)
    assert pooled == pytest.approx(
        math.sqrt((found["sigmoid"].sd ** 2 + found["relu"].sd ** 2) / 2)
    )
    sd_ref = max(found["softmax"].sd, pooled)
    for m in ("sigmoid", "relu", "ssmax"):  # trained: Welch at the pooled spread
        assert a.detect[m] == pytest.approx(
            power.detectable(pooled, 5, sd_ref, 9, level, 0.8, False)
        )
    paired = detectable_at_power(found["logn (inference)"].sd, 9, level, 0.8)
    assert a.detect["logn (inference)"] == pytest.approx(paired)
    assert a.median == pytest.approx(np.median(list(a.detect.values())))
    trained = found["sigmoid"].cpu + found["relu"].cpu + found["ssmax"].cpu
    assert a.cpu == pytest.approx(5 * trained + 9 * found["softmax"].cpu)


def test_allocate_is_the_cheapest_allocation_that_detects_the_target():
    found = power.arms(pilot_rows(), TASKS, METHODS)
    most = 9
    grid = [
        power.evaluate_allocation(found, n, r)
        for n in range(2, most + 1)
        for r in range(n, most + 1)
    ]
    target = power.evaluate_allocation(found, 5, 7).median
    chosen = power.allocate(found, target, most=most)
    assert chosen is not None and chosen.median <= target
    assert chosen.reference_seeds >= chosen.seeds >= 2
    assert chosen.cpu == pytest.approx(min(a.cpu for a in grid if a.median <= target))
    cheaper = [a for a in grid if a.cpu < chosen.cpu]
    assert cheaper and all(a.median > target for a in cheaper)
    assert power.allocate(found, 1e-6, most=3) is None
    text = power.plan_text("pilot", found, TASKS, target, chosen)
    assert "**Cheapest allocation that detects" in text and "| ssmax | 0 |" in text
    assert "No allocation up to 60 seeds an arm detects 1e-06." in power.plan_text(
        "pilot", found, TASKS, 1e-6, None
    )


# --- the plateau rule -----------------------------------------------------------------------------


def _history(*accs: float, every: int = 10) -> list[dict]:
    return [{"step": every * (i + 1), "acc": a} for i, a in enumerate(accs)]


def test_plateaued_once_the_schedule_is_done_and_patience_checks_gained_nothing():
    flat = _history(0.5, 0.6, 0.605, 0.6099, 0.6)  # checks at 10 … 50, the schedule 50 steps
    assert training.plateaued(flat, 50, 50, 3, 0.01)
    assert training.plateaued(flat, 60, 50, 1, 0.01)
    assert not training.plateaued(flat, 40, 50, 3, 0.01)  # the schedule not done
    assert not training.plateaued(flat, 50, 50, 0, 0.01)  # off
    assert not training.plateaued(flat, 50, 50, 5, 0.01)  # no checks before the last five
    gained = _history(0.5, 0.6, 0.605, 0.6101, 0.6)  # one of the last three beat 0.6 by 0.01
    assert not training.plateaued(gained, 50, 50, 3, 0.01)
    assert training.plateaued(gained, 50, 50, 1, 0.01)  # the last one alone did not
    falling = _history(0.9, 0.5, 0.5, 0.5)  # below the best before them: plateaued
    assert training.plateaued(falling, 40, 40, 3, 0.01)


def test_one_check_sequence_of_noise_does_not_hold_off_the_plateau():
    """A run stuck at 0 whose checks solve one sequence of 64 now and then (1/64 ≈ 0.016) has
    plateaued at the default gain, 0.05: the rule is above the checks' noise."""
    stuck = _history(0.0, 0.0, 1 / 64, 0.0, 0.0, 1 / 64, every=250)
    assert training.plateaued(stuck, 1500, 1000, 4)
    assert not training.plateaued(stuck, 1500, 1000, 4, gain=0.01)
    rising = _history(0.0, 0.1, 0.2, 0.3, 0.35, 0.41, every=250)
    assert not training.plateaued(rising, 1500, 1000, 4)


def test_the_check_history_of_a_resumed_run_is_an_uninterrupted_runs(tmp_path):
    accs = {10: 0.2, 20: 0.4, 30: 0.5, 40: 0.55}
    for step, acc in accs.items():
        history = training._checked(tmp_path / "a", step, acc)
    assert history == [{"step": s, "acc": a} for s, a in accs.items()]
    (tmp_path / "b").mkdir()
    for step in (10, 20, 30):  # killed after the check at 30, checkpointed at 20
        training._checked(tmp_path / "b", step, accs[step] - 0.1 * (step == 30))
    for step in (20, 30, 40):  # resumed from step 20: its checks asked again
        resumed = training._checked(tmp_path / "b", step, accs[step])
    assert resumed == history
    path = training.CHECKS
    assert (tmp_path / "a" / path).read_text() == (tmp_path / "b" / path).read_text()
    assert training._checked(tmp_path / "b", 20, 0.9) == [
        {"step": 10, "acc": 0.2},
        {"step": 20, "acc": 0.9},
    ]


# --- the leaderboard's comparisons of unequal arms ------------------------------------------------


def _board(scores: dict[str, list[float]]) -> list[dict]:
    """Rows of two_back at one training size per (method, seed): the score is the accuracy."""
    return [
        _row("two_back", m, s, 16, v, 1.0) for m, vs in scores.items() for s, v in enumerate(vs)
    ]


def test_a_board_of_unequal_arms_tests_and_corrects_welchs_p_values():
    """Softmax on ten seeds, two methods on three: each comparison is Welch's over every seed
    of both arms, and the p-value shown, the one Holm corrects and the one the verdict reads
    are that test's (the paired test over the three shared seeds says otherwise)."""
    from sharpattn.experiments import leaderboard
    from sharpattn.lab.stats import PairedEffect, WelchEffect, holm

    soft = [0.30, 0.29, 0.31, 0.30, 0.31, 0.29, 0.30, 0.30, 0.31, 0.29]
    board = {"softmax": soft, "sigmoid": [0.35, 0.38, 0.32], "relu": [0.27, 0.26, 0.31]}
    table = leaderboard.rank(_board(board), ["two_back"], welch=True)
    by = {e["method"]: e for e in table}
    welch = {m: welch_effect(soft, board[m]) for m in ("sigmoid", "relu")}
    adjusted = holm([welch["sigmoid"].p, welch["relu"].p])
    for i, m in enumerate(("sigmoid", "relu")):
        e = by[m]
        assert isinstance(e["effect"], WelchEffect) and e["effect"].p == pytest.approx(welch[m].p)
        assert e["score"][0] == pytest.approx(np.mean(board[m]))
        assert e["score"][2] == pytest.approx(welch[m].p)  # the ranking's "p vs softmax"
        assert e["holm"] == pytest.approx(adjusted[i])
        cell = e["tasks"]["two_back"]
        assert cell["auc"][2] == pytest.approx(welch[m].p) == cell["effect"].p
        paired = sps.ttest_rel(board[m], soft[:3]).pvalue
        assert abs(paired - welch[m].p) > 0.01  # the two tests differ here
    # arms of equal seeds, paired as before: the p shown is the paired test's
    plain = {e["method"]: e for e in leaderboard.rank(_board(board), ["two_back"])}
    assert isinstance(plain["sigmoid"]["effect"], PairedEffect)
    paired = sps.ttest_rel(board["sigmoid"], soft[:3]).pvalue
    assert plain["sigmoid"]["score"][2] == pytest.approx(paired)
    assert plain["sigmoid"]["effect"].p == pytest.approx(paired)


def test_the_report_states_the_median_detectable_difference():
    """The report's sentence on the run's power: the median and range of each comparison's
    80 %-power difference (Welch's at α/m, recomputed here from the seeds), and how many are at
    most 0.05; nothing where no method is compared."""
    from sharpattn.experiments import leaderboard
    from sharpattn.lab.stats import at_power

    soft = [0.30, 0.29, 0.31, 0.30, 0.31, 0.29, 0.30, 0.30, 0.31, 0.29]
    board = {"softmax": soft, "sigmoid": [0.35, 0.38, 0.32], "relu": [0.27, 0.26, 0.31]}
    table = leaderboard.rank(_board(board), ["two_back"], welch=True)
    want = []
    for m in ("sigmoid", "relu"):
        w = welch_effect(soft, board[m])
        want.append(at_power(w.se, w.df, 0.05 / 2, 0.8))
    text = leaderboard._detectable(table)
    assert f"median {np.median(want):.3f}" in text
    assert f"range {min(want):.3f}–{max(want):.3f}" in text
    assert f"{sum(v <= 0.05 for v in want)} of 2 detect 0.05 or less" in text
    assert leaderboard._detectable([e for e in table if e["method"] == "softmax"]) == ""
