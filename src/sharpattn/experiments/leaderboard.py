"""``sharpattn leaderboard``: every attention method, trained on the same sequence tasks with the
same seeds and budget, ranked by how far its accuracy carries beyond the training sizes.

The score of a (task, method, seed) is the normalised area under exact-match accuracy against
log2 size, from the smallest evaluated size to ``eval_factor`` × the largest training size
(`sequence.area`: 1 = solved at every size). Methods are ranked by their mean score over
tasks; each cell has its seeds' mean ± sd and a paired t-test against softmax (same seeds, same
test sequences). The engine is `sequence`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from ..lab.protocol import Result, option
from ..lab.report import (
    decimals,
    figure,
    image,
    interval,
    markdown_table,
    write_report,
    write_table,
)
from ..lab.runner import Clock, Progress, read_config
from ..lab.stats import (
    PairedEffect,
    WelchEffect,
    at_power,
    detectable,
    detectable_at_power,
    holm,
    paired_effect,
    verdict,
    welch_effect,
)
from ..normalizers import plugin
from . import sequence as seq

#: the standard profile's training steps where they are not its 2,000, chosen by softmax's
#: in-distribution exact match measured at lr 3e-3 (one seed): two_back and local_count 1.000
#: at 1,000 steps; passkey 0.926 and flip_flop 0.793 at 1,000; copy 1.000 and reverse 0.914 at
#: 2,000; sort 0.25 at 1,000 and 0.64 at 2,000 (lr 1e-3). mqar stays at 2,000: softmax was at
#: 0.004 after 4,000 steps, so more would buy nothing
STANDARD_STEPS = {
    "two_back": 1000,
    "local_count": 1000,
    "passkey": 1500,
    "flip_flop": 1500,
    "reverse": 2500,
    "sort": 2500,
}

#: the power board's tasks: those whose scores vary between methods and seeds on the standard
#: board (mqar and sort carry 0.3 % of its variance and 38 % of its cost)
POWER_TASKS = ("flip_flop", "passkey", "reverse", "copy", "local_count", "two_back")
#: its methods: every one but entmax (α = 1.5 by default: the same models as entmax15, six times
#: slower) and logn trained (it equals softmax at the training sizes: evaluated on softmax's
#: models instead, as ``logn (inference)``)
POWER_METHODS = (
    "softmax",
    "adaptive",
    "ssmax",
    "length_scaled",
    "llama4_temperature",
    "logn (inference)",
    "sink",
    "sigmoid",
    "relu",
    "power",
    "signed",
    "softpick",
    "stablemax",
    "topk",
    "sparsemax",
    "entmax15",
    "asentmax",
    "stick_breaking",
    "stick_breaking_shifted",
    "adaptive (inference)",
    "selective_q",
    "selective_v",
    "selective_qv",
    "gated",
)
#: its training steps per task: the standard profile's (the length of the learning-rate
#: schedule). Training stops earlier once the model solves the training sizes (``converge``);
#: a run not converged by then trains on at the final rate up to twice as long (``extend``),
#: unless its checks have stopped improving (``plateau``)
POWER_STEPS = {t: STANDARD_STEPS.get(t, 2000) for t in POWER_TASKS}

#: the profiles: --quick (minutes on 2 cores), --standard (every task and method, hours),
#: --power (the informative tasks with converged training and the seeds its plan chose; run in
#: sittings, `leaderboard_power`) and --paper (the standard's training with 5 seeds, evaluated
#: to 256x). Both sample test
#: sequences adaptively and stop a run's larger sizes after two at exact-match 0
#: (`sequence.SequenceConfig`)
#: the long profiles' training and test sampling (`PROFILES`)
_TRAINING = {"steps": 2000, "task_steps": STANDARD_STEPS, "lr": 3e-3, "batch": 32}
_TESTS = {"eval_sets": 256, "eval_se": 0.04, "eval_min": 32, "stop_zeros": 2, "workers": 2}
PROFILES: dict[str, dict[str, Any]] = {
    "quick": {
        "tasks": ("flip_flop",),
        "seeds": 2,
        "steps": 500,
        "batch": 32,
        "eval_sets": 48,
        "eval_factor": 8,
        "workers": 2,
    },
    "standard": {"tasks": None, "seeds": 3, **_TRAINING, **_TESTS, "eval_factor": 16},
    "power": {
        "tasks": POWER_TASKS,
        "methods": POWER_METHODS,
        "seeds": 6,
        "arm_seeds": {"softmax": 17},
        **_TRAINING,
        "task_steps": POWER_STEPS,
        "converge": 0.98,
        "check_every": 250,
        "check_sets": 64,
        "extend": 2.0,
        "plateau": 4,
        "plateau_gain": 0.05,
        **_TESTS,
        "eval_factor": 16,
        "planned": True,
    },
    "paper": {"tasks": None, "seeds": 5, **_TRAINING, **_TESTS, "eval_factor": 256},
}


FAMILY = "synthetic"  # the tasks this command runs


def make_config(
    profile: str = "quick",
    out: str | Path | None = None,
    plugins: tuple[str, ...] = (),
    plan_from: str | None = None,
    detect: float | None = None,
    **overrides: Any,
) -> seq.SequenceConfig:
    """The configuration of a profile, with ``overrides`` (None values ignored).

    ``plugins``: users' normalizers (``package.module:function``, `normalizers.plugin`),
    imported and probed here (a bad one is refused before any work) and added to the methods.
    With plug-ins and ``out`` an existing leaderboard run, that run's stored configuration is
    the base instead of the profile (its tasks, methods, seeds and training), so the plug-ins
    join it and its other methods resume from what they have; ``overrides`` still apply.
    ``plan_from`` and ``detect`` are `early`'s (``--plan-from``): they configure nothing."""
    for spec in plugins:  # imported and probed: a bad one is refused before anything else
        plugin.load(spec)
    stored = Path(out) / "config.json" if out is not None else None
    if plugins and stored is not None and stored.is_file():
        fields = seq.SequenceConfig.__dataclass_fields__
        base = {k: v for k, v in read_config(out, "leaderboard").items() if k in fields}
        given = {k: v for k, v in overrides.items() if v is not None}
        cfg = seq.SequenceConfig(**{**base, **given})
    else:
        cfg = seq.profile_config(PROFILES, profile, FAMILY, overrides)
    if cfg.record is not None and not cfg.planned:  # an option the run would not use
        raise ValueError(
            f"--record applies to a planned run (--power): the {profile} profile's run is not "
            "packed into a record."
        )
    if plugins:
        cfg = replace(cfg, methods=tuple(dict.fromkeys((*cfg.methods, *plugins))))
    seq.resolve(cfg.methods)  # unknown methods, bad plug-ins: one sentence, before any work
    for name in cfg.tasks:
        seq.task(name)
    return cfg


def early(cfg: seq.SequenceConfig, given: dict[str, Any]) -> str | None:
    """``--plan-from RUN``: the power plan (`leaderboard_power.plan_text`) of ``cfg``'s tasks and
    methods from that pilot, for a median detectable difference of ``--detect`` (0.05); the
    command prints it and runs nothing. None without ``--plan-from``."""
    source = given.get("plan_from")
    if source is None:
        if given.get("detect") is not None:
            raise ValueError("--detect sets what --plan-from plans for: give --plan-from too.")
        return None
    from . import leaderboard_power as power

    target = given.get("detect") or 0.05
    _, rows = power.read_rows(source)
    ran = sorted({r["task"] for r in rows})
    missing = [t for t in cfg.tasks if t not in ran]
    if missing:  # no spread to plan them from: a table of NaN would read as a plan
        raise ValueError(
            f"{source} has no finished runs of {', '.join(missing)}, so it cannot plan them: "
            f"choose among the tasks it ran with --tasks ({', '.join(ran) or 'none'})."
        )
    found = power.arms(rows, list(cfg.tasks), list(cfg.methods))
    best = power.allocate(found, target, ALPHA, POWER)
    return power.plan_text(str(source), found, list(cfg.tasks), target, best, ALPHA, POWER)


def catalogue(cfg: seq.SequenceConfig) -> dict[str, Any]:
    """``--list``: the synthetic tasks and the methods, those ``cfg`` runs marked."""
    return seq.catalogue(cfg, FAMILY, tuple(dict.fromkeys((*seq.methods(), *cfg.methods))))


def run(
    out: str | Path,
    cfg: seq.SequenceConfig,
    progress: Progress | None = None,
    ray: str | None = None,
) -> dict[str, Any]:
    """Train and evaluate every task × method × seed (resuming), then write leaderboard.md/.csv,
    the accuracy-against-size PNG and report.md into ``out``.

    A plug-in that fails in training or evaluation (raises, or gives a NaN or infinite weight
    or loss) stops its own jobs; the other methods run to the end and the reports cover them.
    ``failed`` in the result has one sentence per failed plug-in (the command prints the table,
    then these, and exits with code 2); where no method is left, ``ValueError`` instead."""
    if cfg.planned:
        folder, rows = _sitting(out, cfg, progress, ray)
    else:
        folder, rows = seq.sweep(out, "leaderboard", cfg, progress, ray)
    rows, failed = seq.failures(rows)
    if not rows:
        raise ValueError(f"{'; '.join(failed)}; no method finished, so no report was written.")
    table = rank(rows, list(cfg.tasks), welch=bool(cfg.arm_seeds))
    write(folder.path, rows, table, cfg)
    if cfg.planned and cfg.record is not None:  # the record carries the sitting's report too
        from ..lab.plan import pack

        pack(folder.path, cfg.record)
    return {"run": folder.path, "table": table, "rows": rows, "failed": failed}


def plan_of(cfg: seq.SequenceConfig) -> dict[str, Any]:
    """A planned run's plan (`lab.plan.fix_plan`): what it trains, how it is analysed and the
    commit it is pinned to (with uncommitted changes it says so), fixed in its folder before
    the first job."""
    from ..lab.plan import pinned_commit
    from . import leaderboard_power as power

    c = cfg.to_dict()
    chosen = seq.resolve(cfg.methods)
    return {
        "experiment": "leaderboard",
        "tasks": list(cfg.tasks),
        "methods": list(cfg.methods),
        "reference": power.REFERENCE,
        # a method on another's models has as many seeds as those models (`sequence.jobs`)
        "seeds": {
            m.name: max(seq.seeds_of(cfg, o.name) for o in chosen if o.recipe == m.recipe)
            for m in chosen
        },
        "first_seed": cfg.seed,
        "comparisons": f"each method against {power.REFERENCE} on the overall score (the mean "
        "score over the tasks), and on each task; Holm over the methods in each family",
        "analysis": "Welch's t-test over independent seeds; a method evaluated on "
        f"{power.REFERENCE}'s models paired with it seed by seed",
        "alpha": ALPHA,
        "power": POWER,
        "converged": f"mean exact match at least {power.CONVERGED:g} over the training sizes; "
        "a run below it is listed in the report and scored as measured",
        "training": {k: c[k] for k in seq.IDENTITY if k != "seed"},
        "evaluation": {
            k: c[k]
            for k in ("eval_factor", "eval_sets", "eval_batch", "eval_se", "eval_min", "stop_zeros")
        },
        # the command refuses uncommitted changes unless --allow-dirty; the plan then says so
        "commit": pinned_commit(allow_modified=True),
    }


def _sitting(
    out: str | Path, cfg: seq.SequenceConfig, progress: Progress | None, ray: str | None
) -> tuple[Any, list[dict[str, Any]]]:
    """One sitting of a planned run: its record unpacked into ``out`` (where ``cfg.record``
    exists), its plan fixed there before the first job, the sweep, and the record written
    again after it, also when it is interrupted (Ctrl-C), with this sitting's wall and CPU
    time added to the record's sittings."""
    from ..lab import plan as planning

    plan = plan_of(cfg)
    record = Path(cfg.record) if cfg.record is not None else None
    if record is not None and record.is_file():
        planning.unpack(record, out, plan)
    planning.fix_plan(out, plan)
    clock = Clock(children=True)  # the workers' CPU time too
    try:
        return seq.sweep(out, "leaderboard", cfg, progress, ray)
    finally:
        if record is not None:
            planning.pack(out, record, {"wall": clock.wall, "cpu": clock.cpu})


# --- the experiment protocol (`protocol.Experiment`) ------------------------------------------


@dataclass
class Options(seq.SequenceOptions):
    """The sweep's options, then the leaderboard's own: which methods, users' plug-ins, and
    the models of another run."""

    methods: tuple[str, ...] | None = option(
        None, "Comma-separated methods (default: every one).", kind="names", show_default=False
    )
    plugins: tuple[str, ...] = option(
        (),
        "Your own normalizer (a function or Normalizer, "
        "imported from the current directory or PYTHONPATH), "
        "added to the methods; with an existing --out it joins "
        "that run. Repeatable.",
        kind="plugins",
        name="--method",
        metavar="MODULE:FUNCTION",
        show_default=False,
    )
    models: str | None = option(
        None,
        "Evaluate the models another leaderboard run trained "
        "(same profile and training options), writing this run's "
        "evaluations and report into --out: e.g. more sizes for a few "
        "tasks. That folder is only read; a method, task or seed it has "
        "no model for is refused.",
        kind="folder",
        name="--models-from",
        show_default=False,
    )
    plan_from: str | None = option(
        None,
        "Print the power board's plan from this run folder or record (a pilot): each "
        "method's seed-to-seed spread and CPU time, and the seeds per arm that detect "
        "--detect at the board's Holm level; then exit without running.",
        kind="text",
        metavar="RUN_OR_RECORD",
        show_default=False,
    )
    detect: float | None = option(
        None,
        "With --plan-from: the median detectable difference in score to plan for (80 % "
        "power, Holm over the comparisons) [default: 0.05].",
        kind="positive",
        maximum=1.0,
        show_default=False,
    )
    record: str | None = option(
        None,
        "A planned run's record (.tar.gz): unpacked into --out before the run where it "
        "exists (refused if made at another commit or with another plan), and written "
        "after it, or when it is interrupted, with every finished job's rows.",
        kind="file",
        metavar="FILE.tar.gz",
        show_default=False,
    )


check_memory = seq.check_memory  # the sweep's memory, refused before any work


def plan(cfg: seq.SequenceConfig, profile: str) -> tuple[str, str, bool]:
    """The cost key, the jobs, and whether options changed the profile's work."""
    changed = seq.changes_work(cfg, make_config(profile))
    return "leaderboard", f"{len(seq.jobs('', cfg))} training jobs", changed


def default_folder(cfg: seq.SequenceConfig | None, profile: str) -> str:
    return f"runs/leaderboard-{profile}"


def run_experiment(
    folder: str | Path,
    cfg: seq.SequenceConfig,
    progress: Progress | None = None,
    pool: str | None = None,
) -> Result:
    """`run` as the protocol calls it; a failed plug-in is the Result's error, after the table."""
    result = run(folder, cfg, progress, pool)
    error = None
    if result["failed"]:  # the other methods are reported; the command still failed
        error = (
            f"{'; '.join(result['failed'])}; the report covers the other methods, and the "
            "same command resumes the failed jobs from what they saved (delete their "
            f"folders under {result['run']}/train to train them afresh)."
        )
    return Result(
        result["run"],
        (("leaderboard.md", None),),
        ("report.md", "leaderboard.csv", "leaderboard.png"),
        result,
        error=error,
    )


def rank(rows: list[dict[str, Any]], tasks: list[str], welch: bool = False) -> list[dict[str, Any]]:
    """One entry per method, best first: its score per task (mean, sd, p against softmax) and
    overall (the mean over tasks, per seed, then over seeds; paired test against softmax).
    ``welch`` (a board whose arms have different seeds): each effect against softmax is
    Welch's over every seed of both arms, except for a method evaluated on softmax's own models,
    which stays paired (`leaderboard_power.same_models`)."""
    from .leaderboard_power import same_models

    per = seq.measures(rows)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    out = []
    for m in methods:
        paired = not welch or same_models(m)
        entry: dict[str, Any] = {"method": m, "tasks": {}}
        for t in tasks:
            if (t, m) not in per:
                continue
            base = per.get((t, "softmax"), {})
            entry["tasks"][t] = {
                key: seq.compare(per[(t, m)], base, key) for key in ("auc", "id", "ood", "largest")
            }
        has = [t for t in tasks if (t, m) in per]
        mine, base = overall(per, m, has), overall(per, "softmax", has)
        entry["score"] = seq.compare(mine, base, "auc")
        entry["effect"] = _effect(mine, base, "auc", paired)
        entry["reference"] = _reference(mine, base, "auc")
        for t in entry["tasks"]:
            theirs = per.get((t, "softmax"), {})
            entry["tasks"][t]["effect"] = _effect(per[(t, m)], theirs, "auc", paired)
            entry["tasks"][t]["reference"] = _reference(per[(t, m)], theirs, "auc")
        if not paired:  # Welch's is the test: its p is the one shown, corrected and judged
            entry["score"] = (*entry["score"][:2], entry["effect"].p)
            for c in entry["tasks"].values():
                c["auc"] = (*c["auc"][:2], c["effect"].p)
        out.append(entry)
    out.sort(key=lambda e: -e["score"][0])
    adjusted = holm([e["score"][2] for e in out])  # the family: every method against softmax
    for e, p in zip(out, adjusted, strict=True):
        e["holm"] = float(p)
        e["power"] = _power(e["effect"], e["holm"], _family(adjusted), e["reference"])
    for t in tasks:  # per task, the family is that task's methods against softmax
        cells = [e["tasks"][t] for e in out if t in e["tasks"]]
        adjusted = holm([c["effect"].p for c in cells])
        for c, p in zip(cells, adjusted, strict=True):
            c["holm"] = float(p)
            c["power"] = _power(c["effect"], c["holm"], _family(adjusted), c["reference"])
    return out


#: the significance level of the leaderboard's verdicts (before Holm's correction) and the power
#: its detectable difference is stated at
ALPHA, POWER = 0.05, 0.8


def _effect(
    per: dict[int, dict[str, float]],
    base: dict[int, dict[str, float]],
    key: str,
    paired: bool = True,
):
    """The paired effect (`stats.paired_effect`) of ``per`` against ``base`` on the seeds both
    have; not ``paired``, Welch's (`stats.welch_effect`) over every seed of each."""
    if not paired:
        return welch_effect([v[key] for v in base.values()], [v[key] for v in per.values()])
    seeds = sorted(set(per) & set(base))
    return paired_effect([base[s][key] for s in seeds], [per[s][key] for s in seeds])


def _reference(per: dict[int, dict[str, float]], base: dict[int, dict[str, float]], key: str):
    """The reference arm's (``base``'s) mean score on the seeds both have (NaN where none)."""
    seeds = sorted(set(per) & set(base))
    return float(np.mean([base[s][key] for s in seeds])) if seeds else float("nan")


#: the largest score (`sequence.area`: solved at every size)
MAXIMUM = 1.0


def _detectable(table: list[dict[str, Any]]) -> str:
    """The run's power in one sentence (a paragraph, or nothing with no comparison): the median
    and range over the methods of the overall difference each comparison with softmax detects
    with 80 % power at Holm's strictest level, and how many detect 0.05 or less."""
    found = [e["power"]["at_power"] for e in table if e["method"] != "softmax"]
    found = [float(v) for v in found if np.isfinite(v)]
    if not found:
        return ""
    return (
        f"**What the run can detect:** over the {len(found)} comparisons of the overall score "
        f"with softmax, the difference detected with {POWER * 100:.0f} % power at α/m is a median "
        f"{np.median(found):.3f} (range {min(found):.3f}–{max(found):.3f}); "
        f"{sum(v <= 0.05 for v in found)} of {len(found)} detect 0.05 or less.\n\n"
    )


def _family(adjusted) -> int:
    """How many tests a Holm family has (its finite p-values)."""
    return int(np.isfinite(np.asarray(adjusted, dtype=float)).sum())


def _power(
    effect: PairedEffect | WelchEffect, adjusted: float, m: int, reference: float = float("nan")
) -> dict[str, Any]:
    """What a comparison in a Holm family of ``m`` tests could detect: ``threshold``, the
    smallest mean paired difference that passes Holm's strictest threshold α/m at the observed
    spread of the differences; ``at_power``, the smallest true difference a test at α/m detects
    with 80 % power at that spread; and the ``verdict`` in words (`stats.verdict`: at its
    ceiling where softmax's score ``reference`` leaves less than that to gain)."""
    level = ALPHA / max(1, m)
    if isinstance(effect, WelchEffect):
        at_power_ = at_power(effect.se, effect.df, level, POWER)
        ok = np.isfinite(effect.df)
        threshold = float(stats.t.ppf(1 - level / 2, effect.df)) * effect.se if ok else np.nan
    else:
        at_power_ = detectable_at_power(effect.sd, effect.n, level, POWER)
        threshold = detectable(effect.sd, effect.n, level)
    return {
        "threshold": threshold,
        "at_power": at_power_,
        "verdict": verdict(
            effect, adjusted, at_power_, ALPHA, m=m, reference=reference, maximum=MAXIMUM
        ),
    }


def overall(
    per: dict[tuple[str, str], dict[int, dict[str, float]]], method: str, tasks: list[str]
) -> dict[int, dict[str, float]]:
    """{seed: {"auc": the method's mean score over the tasks it has}} (per from seq.measures)."""
    sums: dict[int, list[float]] = {}
    for t in tasks:
        for s, v in per.get((t, method), {}).items():
            sums.setdefault(s, []).append(v["auc"])
    return {s: {"auc": float(np.mean(v))} for s, v in sums.items()}


def against_all(rows: list[dict[str, Any]], method: str, tasks: list[str]) -> list[dict[str, Any]]:
    """``method`` against every other method of ``rows``: per other method its overall score, the
    paired difference (``method`` − it, mean over seeds) and the paired t-test p-value, overall
    and per task (the same seeds and test sequences; uncorrected for the number of comparisons)."""
    per = seq.measures(rows)
    mine = overall(per, method, tasks)
    out = []
    for other in dict.fromkeys(r["method"] for r in rows):
        if other == method:
            continue
        theirs = overall(per, other, tasks)
        seeds = sorted(set(mine) & set(theirs))
        diff = {s: {"auc": mine[s]["auc"] - theirs[s]["auc"]} for s in seeds}
        out.append(
            {
                "method": other,
                "score": seq.compare(theirs, theirs, "auc")[:2],
                "diff": seq.compare(diff, diff, "auc")[:2] if diff else (float("nan"),) * 2,
                "p": seq.compare(mine, theirs, "auc")[2],
                "tasks": {
                    t: seq.compare(per.get((t, method), {}), per[(t, other)], "auc")[2]
                    for t in tasks
                    if (t, other) in per and (t, method) in per
                },
            }
        )
    return out


def _pm(mean: float, sd: float) -> str:
    return f"{mean:.3f}" if not np.isfinite(sd) else f"{mean:.3f} ± {sd:.3f}"


def _p(p: float) -> str:
    return "–" if not np.isfinite(p) else f"{p:.2g}"


def _versus(rows, method: str, tasks: list[str]) -> str:
    """A user's method against every other one: a report section (`against_all`)."""
    header = ["method", "its score", f"{method} − it", "p", *(f"p {t}" for t in tasks)]
    body = [
        [
            c["method"],
            _pm(*c["score"]),
            _pm(*c["diff"]),
            _p(c["p"]),
            *(_p(c["tasks"].get(t, float("nan"))) for t in tasks),
        ]
        for c in against_all(rows, method, tasks)
    ]
    return (
        f"## {method} against every method\n\nPaired over seeds on the same test sequences: the "
        f"difference of scores ({method} minus the method, mean ± sd over seeds) and the two-sided "
        f"paired t-test p-value, overall and per task; uncorrected for the {len(body)} "
        f"comparison{'s' * (len(body) != 1)} (Bonferroni: multiply by their number).\n\n"
        + markdown_table(header, body)
    )


EFFECT_HEADER = [
    "task",
    "method",
    "seeds",
    "effect (method − softmax)",
    "95 % interval",
    "p",
    "p (Holm)",
    "detectable at α/m",
    "detectable (80 % power, α/m)",
    "verdict",
]


def effects(table: list[dict[str, Any]], tasks: list[str]) -> tuple[list[list], list[list]]:
    """Every comparison against softmax, overall (task "overall") then per task, as shown and
    as raw values (`EFFECT_HEADER`): the paired effect with its interval, p, Holm's p, what the
    run could detect and the verdict."""
    shown, raw = [], []
    for t in ["overall", *tasks]:
        for e in table:
            if e["method"] == "softmax":
                continue
            c = e if t == "overall" else e["tasks"].get(t)
            if c is None:
                continue
            f, pw = c["effect"], c["power"]
            seeds = f"{f.n} vs {f.n_ref}" if isinstance(f, WelchEffect) else str(f.n)
            shown.append(
                [
                    t,
                    e["method"],
                    seeds,
                    "–" if not np.isfinite(f.mean) else f"{f.mean:+.3f}",
                    interval(f),
                    _p(f.p),
                    _p(c["holm"]),
                    decimals(pw["threshold"]),
                    decimals(pw["at_power"]),
                    pw["verdict"],
                ]
            )
            raw.append(
                [
                    t,
                    e["method"],
                    seeds if isinstance(f, WelchEffect) else f.n,
                    f.mean,
                    f"{f.low};{f.high}",
                    f.p,
                    c["holm"],
                    pw["threshold"],
                    pw["at_power"],
                    pw["verdict"],
                ]
            )
    return shown, raw


#: how the report reads the comparisons table (docs/leaderboard.md says the same)
EFFECTS_TEXT = (
    "Every method against softmax, overall and per task. **Effect**: the mean over seeds of the "
    "paired difference (the method's score minus softmax's on the same seed and test "
    "sequences). **95 % interval**: the t interval of that mean over the seeds' differences. "
    "**p**: the two-sided paired t-test; **p (Holm)**: Holm-corrected over the m methods "
    "compared with softmax (overall: one family; per task: one family per task). "
    "**Detectable at α/m**: the smallest mean difference that would pass Holm's strictest "
    "threshold α/m (α = 0.05) at the observed seed-to-seed spread of the differences, "
    "t_{1−α/2m, n−1}·sd/√n with n seeds: no smaller effect can be called, whatever its sign. "
    "**Detectable (80 % power)**: the smallest true difference a paired t-test at α/m would "
    "detect with probability 0.8 at that spread (noncentral t). **Verdict**: better or worse "
    "where Holm rejects at α = 0.05; otherwise not detectable at this power, with the 80 %-power "
    "difference and the level it was computed at (α/m = 0.05/m): an interval that spans 0 says "
    "the run cannot tell, not that the methods are alike. Where softmax's score is within that "
    "difference of the maximum (1), the test is at its ceiling: it cannot show a gain larger "
    "than 1 minus softmax's score."
)


def heat_map(path: Path, table: list[dict[str, Any]], tasks: list[str]) -> None:
    """Method × task: each cell the mean score over seeds (rows in ranking order, the overall
    score as the last column), its value printed in the cell. The figure is sized from the
    number of methods and tasks and from the longest method name, never below what the colour
    bar and its (wrapped) label need, so a one-task map is as legible as an eight-task one."""
    grid = np.array(
        [
            [e["tasks"].get(t, {}).get("auc", (np.nan,))[0] for t in tasks] + [e["score"][0]]
            for e in table
        ]
    )
    cols = [*tasks, "overall"]
    names = [e["method"] for e in table]
    label_in = 0.075 * max((len(n) for n in names), default=4)  # 8-point names, inches
    tick_in = 0.06 * max(len(c) for c in cols)  # rotated task names below the cells
    width = 0.35 + label_in + 0.62 * len(cols) + 1.15  # names, cells, colour bar and label
    height = max(3.2, 0.45 + tick_in + 0.3 * len(table))
    with figure(path, figsize=(width, height), layout="constrained") as (fig, ax):
        im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(cols)), cols, rotation=35, ha="right", fontsize=8)
        ax.set_yticks(range(len(table)), names, fontsize=8)
        for (i, j), v in np.ndenumerate(grid):
            if np.isfinite(v):
                ax.text(
                    j,
                    i,
                    f"{v:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black" if v > 0.6 else "white",
                )
        ax.axvline(len(tasks) - 0.5, color="white", lw=2)
        bar = fig.colorbar(im, ax=ax, fraction=0.08, pad=0.03)
        bar.set_label("score: area under accuracy\nagainst log size", fontsize=8)
        bar.ax.tick_params(labelsize=7)


def _steps(cfg: seq.SequenceConfig) -> str:
    """'3000 steps', or the steps per task where they differ."""
    per = {t: seq.steps_of(cfg, t) for t in cfg.tasks}
    if len(set(per.values())) == 1:
        return f"{next(iter(per.values()))} steps"
    return "steps per task (" + ", ".join(f"{t} {n}" for t, n in per.items()) + ")"


def _sampling(cfg: seq.SequenceConfig, rows) -> str:
    """The report's sentences on how many test sequences each size got and the stopping rule."""
    fired = seq.stopping(rows)
    if cfg.eval_se > 0:
        text = (
            f"Test sequences are drawn in blocks of {cfg.eval_batch} from one stream per (task, "
            f"size), so every method and seed sees the same ones, until the cell's Agresti-Coull "
            f"standard error is at most {cfg.eval_se:g} (after at least {cfg.eval_min}), or "
            f"{cfg.eval_sets} are spent: {fired['sequences']:,} sequences over {fired['cells']:,} "
            f"evaluated cells ({fired['sequences'] / max(1, fired['cells']):.0f} per cell)."
        )
    else:
        text = f"{cfg.eval_sets} test sequences per size, the same for every method and seed."
    text += _test_share(rows)
    if cfg.stop_zeros:
        text += (
            f" Stopping rule: after {cfg.stop_zeros} consecutive sizes beyond the training range "
            f"at exact-match 0, a run's larger sizes are not evaluated and count as 0. It fired "
            f"in {fired['stopped']} of {fired['runs']} runs (task × method × seed), skipping "
            f"{fired['skipped']} of {fired['cells'] + fired['skipped']} cells."
        )
    return text


def _test_share(rows) -> str:
    """A sentence on the test sequences' sampling against the seeds' spread of the score
    (`sequence.test_sampling`): the median ratio of the two sds over (task, method) and the
    cells where test sampling is more than half the seeds' spread."""
    shares = {k: v for k, v in seq.test_sampling(rows).items() if np.isfinite(v["ratio"])}
    if not shares:
        return ""
    ratios = [v["ratio"] for v in shares.values()]
    over = sorted(f"{t}/{m} ({v['ratio']:.2f})" for (t, m), v in shares.items() if v["ratio"] > 0.5)
    return (
        " Test sampling against the seeds: the standard error of a run's score from its test "
        "sequences alone (binomial per size, Agresti–Coull) is a median "
        f"{np.median(ratios):.2f} of the score's sd over seeds (over {len(ratios)} task × "
        "method cells with a spread); "
        + (
            f"it is more than half of it in {len(over)}: {', '.join(over)}, where more test "
            "sequences would narrow the comparison."
            if over
            else "under half of it in every cell."
        )
    )


#: how a board with unequal seeds compares (the report's setup says it)
WELCH_TEXT = (
    "The arms have different numbers of seeds, so each effect against softmax is the "
    "difference of the two arms' means over all their seeds, with Welch's t interval and test "
    "(Welch–Satterthwaite degrees of freedom; seeds columns read 'method vs softmax'); a method "
    "evaluated on softmax's own models is paired with it seed by seed."
)


def _converging(cfg: seq.SequenceConfig, rows) -> str:
    """The report's sentence on training until converged, with the steps the runs took."""
    if not cfg.converge:
        return ""
    steps: dict[tuple[str, str, int], int] = {}
    for r in rows:
        if r.get("train_steps") is not None:
            steps[(r["task"], r["method"], r["seed"])] = int(r["train_steps"])
    per_task = {}
    for (t, _, _), n in steps.items():
        per_task.setdefault(t, []).append(n)
    took = "; ".join(
        f"{t} median {int(np.median(v)):,} (range {min(v):,}–{max(v):,})"
        for t, v in per_task.items()
    )
    extend = (
        f" A run not converged when its schedule ends trains on at the final rate, up to "
        f"{cfg.extend:g}× its steps"
        if cfg.extend > 1
        else ""
    )
    plateau = (
        f", unless {cfg.plateau} checks in a row have not raised its best check accuracy by "
        f"{cfg.plateau_gain:g}"
        if cfg.plateau and extend
        else ""
    )
    return (
        f"Training stops early once the model's exact match is at least {cfg.converge:g} at every "
        f"training size on {cfg.check_sets} check sequences each (checked every "
        f"{cfg.check_every} steps; the check sequences are not the test sequences); the steps "
        f"above are the length of the learning-rate schedule.{extend}{plateau}"
        f"{'.' if extend else ''} Steps trained: {took or 'none recorded'}. "
    )


def _unconverged_section(rows) -> str:
    """The runs below `leaderboard_power.CONVERGED` in distribution, listed: they are scored as
    measured, and the reader sees which they are."""
    from .leaderboard_power import CONVERGED, unconverged

    low = unconverged(rows)
    steps = {(r["task"], r["method"], r["seed"]): r.get("train_steps") for r in rows}
    head = (
        f"## Runs not converged in distribution\n\nA run is converged where its mean exact "
        f"match over the training sizes is at least {CONVERGED:g}. The others are scored as "
        "measured (a method that does not learn a task scores what it scores) and listed here, "
        "so no average hides them."
    )
    if not low:
        return head + " Every run is converged."
    runs = len({(r["task"], r["method"], r["seed"]) for r in rows})
    body = [
        [t, m, str(s), f"{v:.3f}", "–" if steps.get((t, m, s)) is None else f"{steps[(t, m, s)]:,}"]
        for t, m, s, v in low
    ]
    return (
        head
        + f" {len(low)} of {runs} runs are below it.\n\n"
        + markdown_table(["task", "method", "seed", "in distribution", "steps trained"], body)
    )


def _plan_section(folder: Path) -> str:
    """A planned run's plan, as its folder holds it (`lab.plan`)."""
    from ..lab.plan import read_plan

    plan = read_plan(folder) or {}
    lines = [
        f"- **{k}:** {json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in plan.items()
    ]
    return (
        "## The plan\n\nFixed in `plan.json` before the first job; a later sitting with another "
        "plan or at another commit is refused.\n\n" + "\n".join(lines)
    )


def write(folder: Path, rows, table, cfg: seq.SequenceConfig) -> Path:
    tasks = list(cfg.tasks)
    header = ["rank", "method", "score", "p vs softmax", "p (Holm)"] + [f"{t}" for t in tasks]
    shown, raw = [], []
    for i, e in enumerate(table, 1):
        mean, sd, p = e["score"]
        cells = [e["tasks"].get(t, {}).get("auc") for t in tasks]
        shown.append(
            [str(i), e["method"], _pm(mean, sd), _p(p), _p(e["holm"])]
            + ["n/a" if c is None else f"{_pm(c[0], c[1])} (p {_p(c[2])})" for c in cells]
        )
        raw.append(
            [i, e["method"], mean, p, e["holm"]] + [None if c is None else c[0] for c in cells]
        )
    md = write_table(folder, "leaderboard", header, shown, raw)
    heat_map(folder / "heatmap.png", table, tasks)
    detail_header = [
        "task",
        "method",
        "in distribution",
        "beyond training",
        "largest size",
        "p (largest) vs softmax",
    ]
    detail = []
    for t in tasks:
        for e in table:
            c = e["tasks"].get(t)
            if c is not None:
                detail.append(
                    [
                        t,
                        e["method"],
                        _pm(*c["id"][:2]),
                        _pm(*c["ood"][:2]),
                        _pm(*c["largest"][:2]),
                        _p(c["largest"][2]),
                    ]
                )
    md_detail = write_table(folder, "accuracy", detail_header, detail)
    md_effects = write_table(folder, "effects", EFFECT_HEADER, *effects(table, tasks))
    cells = seq.failure_cells(rows)
    shown_f, raw_f = seq.failure_table(cells)
    write_table(folder, "failures", seq.FAILURE_HEADER, shown_f, raw_f)
    last = {}  # the largest such size of each (task, method), for the report
    for c, row in zip(cells, shown_f, strict=True):
        last[(c["task"], c["method"])] = row
    failures_section = (
        "## What the models answered where they failed\n\n" + seq.FAILURES_TEXT + " Below, the "
        "largest such size of each task and method; `failures.md` and `failures.csv` have "
        "every one.\n\n" + markdown_table(seq.FAILURE_HEADER, list(last.values()))
        if cells
        else "## What the models answered where they failed\n\nNo cell beyond the training "
        "sizes is at exact match 0 on every seed."
    )
    added = [e["method"] for e in table if plugin.is_spec(e["method"])]
    versus = [_versus(rows, m, tasks) for m in added]
    order = [e["method"] for e in table]
    seq.plot_curves(
        folder / "leaderboard.png",
        rows,
        tasks,
        order,
        "Exact-match accuracy against size (shaded: training sizes)",
    )
    sizes = {t: seq.sizes_of(cfg, t) for t in tasks}
    arms = "".join(f", {n} for {m}" for m, n in (cfg.arm_seeds or {}).items())
    setup = (
        f"{cfg.seeds} seeds (first {cfg.seed}) per task × method{arms}; a {cfg.layers}-layer "
        f"decoder, "
        f"d = {cfg.d_model}, {cfg.heads} heads, positions {cfg.positions}; AdamW lr {cfg.lr}, "
        f"{_steps(cfg)} of batch {cfg.batch}. "
        + _converging(cfg, rows)
        + _sampling(cfg, rows)
        + " Sizes: "
        + "; ".join(
            f"{t} trained at {seq.task(t).train_sizes[0]}–{seq.task(t).train_sizes[1]}, "
            f"evaluated at {', '.join(map(str, s))}"
            for t, s in sizes.items()
        )
        + ".\n\nScore: the normalised area under exact-match accuracy against log2 size (1 = "
        "every test sequence solved at every size); the overall score is the mean over tasks. "
        "p: two-sided paired t-test against softmax over seeds (– with fewer than two seeds); "
        "p (Holm): the same, Holm-Bonferroni adjusted for the number of methods compared with "
        "softmax; the per-task p-values are uncorrected."
    )
    if cfg.arm_seeds:
        setup += " " + WELCH_TEXT
    untrainable = ", ".join(f"{k} ({v})" for k, v in seq.UNTRAINABLE.items())
    return write_report(
        folder,
        "Leaderboard: size generalisation of every attention method",
        [
            "## Setup\n\n" + setup + f"\n\nNot trained: {untrainable}.",
            "## Ranking\n\n" + md,
            image("heatmap.png", "Score per method and task, mean over seeds"),
            image("leaderboard.png", "Accuracy against size, mean ± sd over seeds"),
            "## Against softmax: effects, intervals and what the run could detect\n\n"
            + EFFECTS_TEXT
            + "\n\n"
            + _detectable(table)
            + md_effects,
            "## Accuracy in and beyond the training sizes\n\n" + md_detail,
            _unconverged_section(rows),
            *([_plan_section(folder)] if cfg.planned else []),
            failures_section,
            *versus,
        ],
    )
