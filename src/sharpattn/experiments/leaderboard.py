"""``sharpattn leaderboard``: every attention method, trained on the same sequence tasks with the
same seeds and budget, ranked by how far its accuracy carries beyond the training sizes.

The score of a (task, method, seed) is the normalised area under exact-match accuracy against
log2 size, from the smallest evaluated size to ``eval_factor`` × the largest training size
(:func:`.sequence.area`: 1 = solved at every size). Methods are ranked by their mean score over
tasks; each cell has its seeds' mean ± sd and a paired t-test against softmax (same seeds, same
test sequences). The engine is :mod:`.sequence`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from . import sequence as seq
from .report import image, write_report, write_table
from .runner import Progress

#: the profiles: --quick (minutes on 2 cores) and the full one
PROFILES: dict[str, dict[str, Any]] = {
    "quick": {"tasks": ("flip_flop",), "seeds": 2, "steps": 500, "batch": 32, "eval_sets": 48,
              "eval_factor": 8, "workers": 2},
    "paper": {"tasks": None, "seeds": 3, "steps": 3000, "batch": 32, "eval_sets": 256,
              "eval_factor": 64, "workers": 2},
}  # fmt: skip


FAMILY = "synthetic"  # the tasks this command runs


def make_config(profile: str = "quick", **overrides: Any) -> seq.SequenceConfig:
    """The configuration of a profile, with ``overrides`` (None values ignored)."""
    return seq.profile_config(PROFILES, profile, FAMILY, overrides)


def catalogue(cfg: seq.SequenceConfig) -> dict[str, Any]:
    """``--list``: the synthetic tasks and the methods, those ``cfg`` runs marked."""
    return seq.catalogue(cfg, FAMILY, tuple(seq.methods()))


def run(out: str | Path, cfg: seq.SequenceConfig, progress: Progress | None = None,
        ray: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Train and evaluate every task × method × seed (resuming), then write leaderboard.md/.csv,
    the accuracy-against-size PNG and report.md into ``out``."""
    folder, rows = seq.sweep(out, "leaderboard", cfg, progress, ray)
    table = rank(rows, list(cfg.tasks))
    write(folder.path, rows, table, cfg)
    return {"run": folder.path, "table": table, "rows": rows}


def rank(rows: list[dict[str, Any]], tasks: list[str]) -> list[dict[str, Any]]:
    """One entry per method, best first: its score per task (mean, sd, p against softmax) and
    overall (the mean over tasks, per seed, then over seeds; paired test against softmax)."""
    per = seq.measures(rows)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    out = []
    for m in methods:
        entry: dict[str, Any] = {"method": m, "tasks": {}}
        overall: dict[int, dict[str, float]] = {}
        base_overall: dict[int, dict[str, float]] = {}
        for t in tasks:
            if (t, m) not in per:
                continue
            base = per.get((t, "softmax"), {})
            entry["tasks"][t] = {
                key: seq.compare(per[(t, m)], base, key) for key in ("auc", "id", "ood", "largest")
            }
            for s, v in per[(t, m)].items():
                overall.setdefault(s, {"auc": 0.0, "n": 0})
                overall[s]["auc"] += v["auc"]
                overall[s]["n"] += 1
            for s, v in base.items():
                base_overall.setdefault(s, {"auc": 0.0, "n": 0})
                base_overall[s]["auc"] += v["auc"]
                base_overall[s]["n"] += 1
        mean_over = {s: {"auc": v["auc"] / v["n"]} for s, v in overall.items()}
        base_mean = {s: {"auc": v["auc"] / v["n"]} for s, v in base_overall.items()}
        entry["score"] = seq.compare(mean_over, base_mean, "auc")
        out.append(entry)
    out.sort(key=lambda e: -e["score"][0])
    return out


def _pm(mean: float, sd: float) -> str:
    return f"{mean:.3f}" if not np.isfinite(sd) else f"{mean:.3f} ± {sd:.3f}"


def _p(p: float) -> str:
    return "–" if not np.isfinite(p) else f"{p:.2g}"


def write(folder: Path, rows, table, cfg: seq.SequenceConfig) -> Path:
    tasks = list(cfg.tasks)
    header = ["rank", "method", "score", "p vs softmax"] + [f"{t}" for t in tasks]
    shown, raw = [], []
    for i, e in enumerate(table, 1):
        mean, sd, p = e["score"]
        cells = [e["tasks"].get(t, {}).get("auc") for t in tasks]
        shown.append([str(i), e["method"], _pm(mean, sd), _p(p)]
                     + ["n/a" if c is None else f"{_pm(c[0], c[1])} (p {_p(c[2])})" for c in cells])  # fmt: skip
        raw.append([i, e["method"], mean, p] + [None if c is None else c[0] for c in cells])
    md = write_table(folder, "leaderboard", header, shown, raw)
    detail_header = ["task", "method", "in distribution", "beyond training", "largest size",
                     "p (largest) vs softmax"]  # fmt: skip
    detail = []
    for t in tasks:
        for e in table:
            c = e["tasks"].get(t)
            if c is not None:
                detail.append([t, e["method"], _pm(*c["id"][:2]), _pm(*c["ood"][:2]),
                               _pm(*c["largest"][:2]), _p(c["largest"][2])])  # fmt: skip
    md_detail = write_table(folder, "accuracy", detail_header, detail)
    order = [e["method"] for e in table]
    seq.plot_curves(folder / "leaderboard.png", rows, tasks, order,
                    "Exact-match accuracy against size (shaded: training sizes)")  # fmt: skip
    sizes = {t: seq.sizes_of(cfg, t) for t in tasks}
    setup = (
        f"{cfg.seeds} seeds (first {cfg.seed}) per task × method; a {cfg.layers}-layer decoder, "
        f"d = {cfg.d_model}, {cfg.heads} heads, positions {cfg.positions}; AdamW lr {cfg.lr}, "
        f"{cfg.steps} steps of batch {cfg.batch}; {cfg.eval_sets} test sequences per size, the "
        "same for every method and seed. Sizes: "
        + "; ".join(
            f"{t} trained at {seq.task(t).train_sizes[0]}–{seq.task(t).train_sizes[1]}, "
            f"evaluated at {', '.join(map(str, s))}"
            for t, s in sizes.items()
        )  # fmt: skip
        + ".\n\nScore: the normalised area under exact-match accuracy against log2 size (1 = "
        "every test sequence solved at every size); the overall score is the mean over tasks. "
        "p: two-sided paired t-test against softmax over seeds (– with fewer than two seeds)."
    )
    untrainable = ", ".join(f"{k} ({v})" for k, v in seq.UNTRAINABLE.items())
    return write_report(
        folder,
        "Leaderboard: size generalisation of every attention method",
        [
            "## Setup\n\n" + setup + f"\n\nNot trained: {untrainable}.",
            "## Ranking\n\n" + md,
            image("leaderboard.png", "Accuracy against size, mean ± sd over seeds"),
            "## Accuracy in and beyond the training sizes\n\n" + md_detail,
        ],
    )
