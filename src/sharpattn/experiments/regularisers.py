"""Table 1's baseline gap: which reading of App. A.4's "L2 regularisation with λ = 0.001".

The reproduction's trained softmax disperses more at 128–2,048 items than the paper's, while
matching it in distribution. The paper does not say how λ enters training; each reading of
`max_retrieval.REGULARISERS` is one change from the reproduction's default. This study trains
the same seeds under each (a max-retrieval run per reading in ``OUT/<name>``, their training
jobs on one pool of workers), evaluates each as Table 1, and compares every reading's baseline
and adaptive columns with the paper's: the mean gap over the sizes where the default falls
short, with its 95 % interval over seeds.

    OUT/config.json                 the study: the runs' shared configuration and the readings
    OUT/<name>/                     a max-retrieval run folder (config, train, eval, Table 1, report)
    OUT/<name>-lambda<λ>/           the same reading at another λ (``--lambdas``: a λ × convention
                                    sweep; the reading is named ``<name>@lambda=<λ>``)
    OUT/regularisers.{md,json}      the comparison; OUT/report.md

A reading whose training settings equal an existing max-retrieval run's (Table 1's ``--paper``
run is the "l2" reading of the paper profile) can take that run's trained seeds (``reuse``):
the same settings and seeds train the same model, so only the other readings are trained.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..lab import report
from ..lab.protocol import Result, option
from ..lab.runner import Clock, Progress, RunFolder, profile_settings, write_metrics
from ..lab.runs import read_json, write_atomic, write_json
from ..lab.stats import paired_effect
from . import max_retrieval as mr

PROFILES: dict[str, dict[str, Any]] = {
    "quick": dict(
        seeds=2, group=2, steps=2_000, sizes=mr.PAPER_SIZES[:8], test_sets=1_000, log_every=100
    ),
    # one ensemble of 5 seeds per reading, two single-threaded workers (as Table 1's --paper);
    # evaluated to 2,048 items, the largest size the comparison uses (`GAP_SIZES`)
    "paper": dict(
        seeds=5,
        group=5,
        workers=2,
        steps=100_000,
        sizes=mr.PAPER_SIZES[:8],
        test_sets=10_000,
        log_every=1_000,
    ),
}


def make_config(profile: str = "quick", **overrides: Any) -> mr.Config:
    """The shared run configuration of a profile (a key of PROFILES), with ``overrides``."""
    return mr.Config(**profile_settings(PROFILES, profile, overrides))


@dataclass
class Options:
    """The command's options (`protocol`)."""

    seeds: int | None = option(
        None,
        "Number of seeds (overrides the profile).",
        kind="count",
        maximum="seeds",
        show_default=False,
    )
    steps: int | None = option(
        None,
        "Adam steps per seed (overrides the profile).",
        kind="count",
        maximum="steps",
        show_default=False,
    )
    regularisers: str | None = option(
        None,
        "Comma-separated readings of the L2 term to train "
        "under (default: all four, see reproduce max-retrieval "
        "--regulariser).",
        kind="text",
        show_default=False,
    )
    lambdas: str | None = option(
        None,
        "Comma-separated values of λ to train each reading at "
        "(default: App. A.4's 0.001 only), e.g. 5e-4,1e-3,2e-3: a λ × "
        "convention sweep.",
        kind="text",
        show_default=False,
    )
    reuse: str | None = option(
        None,
        "A max-retrieval run folder whose trained seeds a reading "
        "with the same training settings takes instead of training them "
        "again (e.g. Table 1's --paper run for l2).",
        kind="folder",
        show_default=False,
    )
    checkpoint_every: int = option(1000, "", kind="checkpoint")
    threads: int | None = option(None, "", kind="threads")


@dataclass(frozen=True)
class Study:
    """What the study runs: the shared run configuration, the readings, and a run to reuse."""

    config: mr.Config
    regularisers: tuple[str, ...]
    reuse: str | None = None

    @property
    def workers(self) -> int:
        return self.config.workers


def configure(
    profile: str = "quick",
    *,
    regularisers: str | None = None,
    lambdas: str | None = None,
    reuse: str | None = None,
    seeds: int | None = None,
    **overrides: Any,
) -> Study:
    """The study of a profile with the command's options: more seeds train as one ensemble;
    ``lambdas``, each reading at each λ (`reading_name`)."""
    config = make_config(profile, seeds=seeds, **overrides)
    if seeds is not None:
        config = replace(config, group=seeds)
    names = list(mr.REGULARISERS)
    if regularisers is not None:  # given, even empty: never "all four"
        names = [r.strip() for r in regularisers.split(",") if r.strip()]
        unknown = [r for r in names if r not in mr.REGULARISERS]
        if unknown or not names:
            known = ", ".join(mr.REGULARISERS)
            raise ValueError(
                f"unknown regulariser {unknown[0]!r}; known: {known}."
                if unknown
                else f"--regularisers names no reading; name at least one of {known}."
            )
    values = [config.l2]
    if lambdas is not None:
        try:
            values = [float(x) for x in lambdas.split(",") if x.strip()]
        except ValueError:
            values = []
        if not values or not all(np.isfinite(x) and x >= 0 for x in values):
            raise ValueError(
                f"--lambdas must be values of λ >= 0, e.g. 5e-4,1e-3; got {lambdas!r}."
            )
    readings = [reading_name(n, x, config.l2) for x in dict.fromkeys(values) for n in names]
    return Study(config, tuple(readings), reuse)


def reading_name(regulariser: str, lam: float, default: float) -> str:
    """A reading of the L2 term: the convention's name at the default λ, ``NAME@lambda=X``
    at another."""
    return regulariser if lam == default else f"{regulariser}@lambda={lam:g}"


def parse_reading(reading: str) -> tuple[str, float | None]:
    """A reading's convention and its λ (None: the run configuration's), refusing an unknown
    convention or a malformed λ in one sentence."""
    name, _, lam = reading.partition("@lambda=")
    if name not in mr.REGULARISERS:
        raise ValueError(f"unknown regulariser {name!r}; known: {', '.join(mr.REGULARISERS)}.")
    if not lam:
        return name, None
    try:
        value = float(lam)
    except ValueError:
        value = float("nan")
    if not (np.isfinite(value) and value >= 0):
        raise ValueError(f"a reading's λ must be a number >= 0, got {reading!r}.")
    return name, value


def with_threads(study: Study, threads: int) -> Study:
    return replace(study, config=replace(study.config, threads=threads))


def plan(study: Study, profile: str) -> tuple[str, str, bool]:
    plain = make_config(profile)
    jobs = len(study.regularisers) * len(mr.groups(study.config))
    changed = (study.config.seeds, study.config.steps) != (plain.seeds, plain.steps)
    return (
        "reproduce max-retrieval-regularisers",
        f"{jobs} training jobs of {study.config.group} seeds",
        changed,
    )


def default_folder(study: Study, profile: str) -> str:
    return "runs/max-retrieval-regularisers"


def run_experiment(
    folder: str | Path, chosen: Study, progress: Progress | None = None, pool: str | None = None
) -> Result:
    result = study(
        folder, chosen.config, list(chosen.regularisers), progress, pool, reuse=chosen.reuse
    )
    title = "Max retrieval: Table 1's baseline under each reading of the L2 term"
    return Result(
        Path(folder), (("regularisers.md", title),), (), result, f"wrote {result['report']}"
    )


#: the sizes where the default reading's baseline fell 6–20 points below the paper's
GAP_SIZES = (128, 256, 512, 1024, 2048)


def gap_sizes(sizes) -> tuple[int, ...]:
    """`GAP_SIZES` among ``sizes``; where none is, every size beyond the training range."""
    inside = tuple(n for n in sizes if n in GAP_SIZES)
    return inside or tuple(n for n in sizes if n > mr.Config.max_items)


def _folder(out: Path, config: mr.Config, reading: str) -> tuple[Path, mr.Config]:
    """A reading's run folder (``OUT/NAME``, ``OUT/NAME-lambdaX`` at another λ) and config."""
    name, lam = parse_reading(reading)
    cfg = dataclasses.replace(config, regulariser=name, l2=config.l2 if lam is None else lam)
    folder = name if lam is None else f"{name}-lambda{lam:g}"
    return mr.open_run(out / folder, cfg), cfg


def reuse_training(source: str | Path, runs: dict[str, tuple[Path, mr.Config]]) -> list[str]:
    """Copy into each reading's folder the trained seed groups of the max-retrieval run
    ``source`` where its `TRAINING_SETTINGS <max_retrieval.TRAINING_SETTINGS>` equal the
    reading's and it has a group of the same seeds that the reading's folder lacks (an unfinished
    group resumes from its checkpoint). Returns the groups copied, as "reading/seeds"."""
    source = Path(source)
    if not (source / "config.json").is_file():
        raise ValueError(f"{source} is not a max-retrieval run folder (no config.json).")
    theirs = mr.read_config(source)
    copied = []
    for name, (path, cfg) in runs.items():
        if any(getattr(theirs, k) != getattr(cfg, k) for k in mr.TRAINING_SETTINGS):
            continue
        for seeds in mr.groups(cfg):
            src, dst = mr.group_dir(source, seeds), mr.group_dir(path, seeds)
            if src.is_dir() and not dst.exists():
                tmp = dst.with_name(dst.name + ".copying")
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.copytree(src, tmp)
                tmp.rename(dst)  # whole or absent: an interrupted copy is redone
                copied.append(f"{name}/{dst.name}")
    return copied


def study(
    out: str | Path,
    config: mr.Config,
    regularisers: list[str],
    progress: Progress | None = None,
    ray: str | None = None,
    reuse: str | Path | None = None,
) -> dict[str, Any]:
    """Train (or resume) ``config`` under each of ``regularisers``, evaluate each run as Table 1,
    and write the comparison; returns {"rows", "summary", "report"}. ``reuse``: a max-retrieval
    run whose trained seeds a reading with its training settings takes (`reuse_training`)."""
    if not regularisers:
        raise ValueError("name at least one regulariser.")
    for reading in regularisers:
        parse_reading(reading)  # refused before any work
    mr.check_sizes(config.sizes)
    mr.check_groups(config, ray)
    out = Path(out)
    RunFolder(
        out,
        "max-retrieval-regularisers",
        {"run": asdict(config), "regularisers": regularisers},
        identity=[f"run.{k}" for k in mr.TRAINING_SETTINGS if k != "regulariser"],
    )
    runs = {name: _folder(out, config, name) for name in regularisers}  # refused before any work
    if reuse is not None:
        copied = reuse_training(reuse, runs)
        if copied:  # kept in the study folder, so that a resumed study still says so
            before = read_json(out / "reused.json", dict) if (out / "reused.json").is_file() else {}
            groups = sorted({*before.get("groups", []), *copied})
            write_json(out / "reused.json", {"from": str(reuse), "groups": groups})
    clock = Clock()
    mr.train_runs(list(runs.values()), config, progress, ray)  # the readings share the workers
    trained = clock.wall
    for path, cfg in runs.values():
        mr.reproduce(path, cfg, progress, ray)  # trained: evaluates, writes Table 1 and report
    rows, summary = compare({name: path for name, (path, _) in runs.items()})
    summary["train_s"], summary["elapsed_s"] = trained, clock.wall
    if (out / "reused.json").is_file():
        summary["reused"] = read_json(out / "reused.json", dict)
    md = write_comparison(out, rows, summary)
    write_metrics(out, {"rows": rows, **summary}, "regularisers.json")
    path = report.write_report(
        out, "Max retrieval: which L2 convention matches Table 1's baseline", [md]
    )
    return {"rows": rows, "summary": summary, "report": path}


def _seed_accuracy(run: Path) -> dict[str, dict[int, dict[int, float]]]:
    """accuracy.json of a finished run: method -> seed -> size -> accuracy (%)."""
    raw = read_json(run / "accuracy.json", dict)
    return {
        m: {int(s): {int(n): float(a) for n, a in per.items()} for s, per in seeds.items()}
        for m, seeds in raw.items()
    }


def compare(runs: dict[str, Path]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per reading (rows): the in-distribution baseline; each column's mean gap to the paper over
    `gap_sizes` with its 95 % interval over seeds; the baseline's change against the default
    reading "l2" where it ran (paired over seeds: the same seeds' initialisations and batches);
    the logit spread δ and Σw² at the last logged step (from the training logs: a run packed
    without its weights is compared the same). The summary names the readings whose baseline interval
    holds the paper's column ("none" where none does)."""
    rows = []
    for name, run in runs.items():
        config = mr.read_config(run)
        acc = _seed_accuracy(run)
        seeds = sorted(acc["baseline"])
        sizes = gap_sizes(config.sizes)
        row: dict[str, Any] = {
            "regulariser": name,
            "convention": config.regulariser,
            "lambda": config.l2,
            "seeds": len(seeds),
            "gap_sizes": list(sizes),
        }
        first = min(config.sizes)
        row["in_distribution"] = float(np.mean([acc["baseline"][s][first] for s in seeds]))
        row["paper_in_distribution"] = mr.PAPER_TABLE1["baseline"].get(first)
        for col in ("baseline", "adaptive"):
            ours = [float(np.mean([acc[col][s][n] for n in sizes])) for s in seeds]
            paper = np.mean([mr.PAPER_TABLE1[col][n] for n in sizes])
            e = paired_effect(np.full(len(ours), paper), ours)
            row[col] = {
                "gap": e.mean,
                "low": e.low,
                "high": e.high,
                "per_seed": ours,
                "per_size": {
                    n: float(np.mean([acc[col][s][n] for s in seeds])) for n in config.sizes
                },
            }
        records = mr.training_records(run, config)
        last = [recs[-1] for recs in records.values()]
        row["delta"] = float(np.mean([r["delta"] for r in last]))
        row["sum_w2"] = float(
            np.mean([np.nan if r["sum_w2"] is None else r["sum_w2"] for r in last])
        )
        row["verdict"] = _verdict(row["baseline"])
        row["adaptive_verdict"] = _verdict(row["adaptive"])
        rows.append(row)
    default = next((r for r in rows if r["regulariser"] == "l2"), None)
    for row in rows:
        if default is not None and row is not default:
            e = paired_effect(default["baseline"]["per_seed"], row["baseline"]["per_seed"])
            row["versus_l2"] = {"effect": e.mean, "low": e.low, "high": e.high, "p": e.p}
    matching = [r["regulariser"] for r in rows if r["verdict"].startswith("consistent")]
    both = [r for r in matching if _row(rows, r)["adaptive_verdict"].startswith("consistent")]
    return rows, {"matching": matching or "none", "matching_both": both or "none"}


def _row(rows: list[dict[str, Any]], reading: str) -> dict[str, Any]:
    return next(r for r in rows if r["regulariser"] == reading)


def _verdict(gap: dict[str, float]) -> str:
    """The paper's column against a reading's interval: inside it ("consistent", with how wide
    the interval is, never "the same"), or below or above it."""
    lo, hi, g = gap["low"], gap["high"], gap["gap"]
    what = f"{g:+.1f} points [{lo:+.1f}, {hi:+.1f}]"
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return f"{what}: too few seeds for an interval"
    if lo <= 0 <= hi:
        return f"consistent with the paper's column ({what}, {hi - lo:.1f} points wide)"
    return f"{'below' if hi < 0 else 'above'} the paper's column ({what})"


def write_comparison(out: Path, rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """regularisers.md: the readings side by side, per size and summarised; returns it."""
    sizes = sorted(rows[0]["baseline"]["per_size"])
    gap = ", ".join(f"{n:,}" for n in rows[0]["gap_sizes"])
    per_size = report.markdown_table(
        ["size", "paper", *[r["regulariser"] for r in rows]],
        [
            [
                f"{n:,}",
                mr.paper_cell(mr.PAPER_TABLE1["baseline"].get(n)),
                *[f"{r['baseline']['per_size'][n]:.1f}" for r in rows],
            ]
            for n in sizes
        ],
    )
    summary_table = report.markdown_table(
        [
            "regulariser",
            "what",
            "seeds",
            f"baseline at {sizes[0]:,} (paper)",
            "baseline gap to the paper",
            "adaptive θ gap to the paper",
            "baseline vs l2 (p)",
            "δ at the end",
            "Σw² at the end",
            "verdict (baseline)",
            "verdict (adaptive θ)",
        ],
        [
            [
                r["regulariser"],
                _what(r),
                r["seeds"],
                f"{r['in_distribution']:.1f} ({mr.paper_cell(r['paper_in_distribution'])})",
                _gap(r["baseline"]),
                _gap(r["adaptive"]),
                _versus(r.get("versus_l2")),
                f"{r['delta']:.2f}",
                f"{r['sum_w2']:.0f}",
                r["verdict"],
                r.get("adaptive_verdict", "–"),
            ]
            for r in rows
        ],
        align="l" * 2 + "r" * 7 + "ll",
    )
    matching = summary["matching"]
    both = summary.get("matching_both", "none")
    reused = summary.get("reused")
    md = (
        f"Gap: the mean over {gap} items of ours − the paper's Table 1 (accuracy points), with "
        "its 95 % t interval over seeds (the paper's column taken as exact). Baseline vs l2: "
        "the same mean's change from the default reading, paired over seeds (each seed has the "
        "same initialisation and batches under every reading), 95 % interval and paired t-test "
        "p. δ: the logit spread on in-distribution probe sets at the last logged step; Σw² over "
        "all parameters; both means over seeds.\n\n"
        + summary_table
        + "\n**Readings whose interval holds the paper's baseline column:** "
        + (", ".join(matching) if isinstance(matching, list) else "none")
        + ".\n**Readings whose intervals hold both of the paper's columns (baseline and adaptive "
        + "θ):** "
        + (", ".join(both) if isinstance(both, list) else "none")
        + ".\n\n"
        + (
            f"Trained seeds taken from `{reused['from']}` (the same training settings and "
            f"seeds): {', '.join(reused['groups'])}.\n\n"
            if reused
            else ""
        )
        + "Baseline accuracy (%) per size, mean over seeds:\n\n"
        + per_size
    )
    write_atomic(out / "regularisers.md", md)
    return md


def _what(row: dict[str, Any]) -> str:
    """A reading in words: its convention, at its λ."""
    convention = row.get("convention", parse_reading(row["regulariser"])[0])
    what = mr.REGULARISERS[convention]
    lam = row.get("lambda")
    return what if lam is None else f"{what}; λ = {lam:g}"


def _versus(v: dict[str, float] | None) -> str:
    if v is None:
        return "–"
    if not np.isfinite(v["low"]):
        return f"{v['effect']:+.1f}"
    return f"{v['effect']:+.1f} [{v['low']:+.1f}, {v['high']:+.1f}] (p {v['p']:.2g})"


def _gap(g: dict[str, Any]) -> str:
    if not np.isfinite(g["low"]):
        return f"{g['gap']:+.1f}"
    return f"{g['gap']:+.1f} [{g['low']:+.1f}, {g['high']:+.1f}]"


__all__ = [
    "Options",
    "Study",
    "configure",
    "default_folder",
    "plan",
    "run_experiment",
    "with_threads",
    "GAP_SIZES",
    "PROFILES",
    "compare",
    "gap_sizes",
    "make_config",
    "parse_reading",
    "reading_name",
    "study",
    "write_comparison",
]
