"""``sharpattn reproduce clrs``: *Softmax is not Enough* §4.2 / Fig. 8 in small.

The paper fine-tunes Gemma 2B on the thirty CLRS-Text algorithms with and without adaptive
temperature — applied in training *and* at inference, since re-applying it at inference only did
not work there — and plots accuracy against problem size in and beyond the training sizes. Here a
tiny decoder is trained from scratch per algorithm, method and seed on CLRS-Text-style traces
(`sharpattn.tasks.clrs_text`), with softmax and with adaptive temperature in training, and
evaluated up to ``eval_factor`` × the largest training size; per algorithm, accuracy in and out
of distribution with paired tests over seeds, and the figure in Fig. 8's shape. The engine is
`sequence`; the leaderboard runs every other method on the same tasks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..lab.protocol import Result
from ..lab.report import (
    decimals,
    figure,
    image,
    interval,
    markdown_table,
    mean_sd,
    p_cell,
    write_report,
    write_table,
)
from ..lab.runner import Progress
from ..lab.stats import alpha_words, reproduction_verdicts
from . import sequence as seq
from .paper_numbers import CLRS_FIG8

METHODS = ("softmax", "adaptive")
#: the claim tested (Fig. 8): adaptive temperature ahead of softmax beyond the training sizes
PAPER_CLAIM = CLRS_FIG8
PROFILES: dict[str, dict[str, Any]] = {
    "quick": {
        "methods": METHODS,
        "seeds": 2,
        "steps": 1500,
        "batch": 32,
        "eval_sets": 64,
        "eval_factor": 16,
        "workers": 2,
        "tasks": ("minimum", "binary_search", "insertion_sort", "naive_string_matcher"),
    },
    "paper": {
        "methods": METHODS,
        "tasks": None,
        "seeds": 5,
        "steps": 5000,
        "batch": 32,
        "eval_sets": 256,
        "eval_factor": 64,
        "workers": 2,
    },
}


FAMILY = "clrs"  # the tasks this command runs


def make_config(profile: str = "quick", **overrides: Any) -> seq.SequenceConfig:
    """The configuration of a profile (softmax and adaptive), with ``overrides``."""
    return seq.profile_config(PROFILES, profile, FAMILY, overrides)


def catalogue(cfg: seq.SequenceConfig) -> dict[str, Any]:
    """``--list``: the clrs tasks and the methods, those ``cfg`` runs marked."""
    return seq.catalogue(cfg, FAMILY, METHODS)


def run(
    out: str | Path,
    cfg: seq.SequenceConfig,
    progress: Progress | None = None,
    ray: str | None = None,
) -> dict[str, Any]:
    folder, rows = seq.sweep(out, "clrs", cfg, progress, ray)
    table = summarize(rows, list(cfg.tasks), list(cfg.methods))
    write(folder.path, rows, table, cfg)
    return {"run": folder.path, "table": table, "rows": rows}


# --- the experiment protocol (`protocol.Experiment`) ------------------------------------------

Options = seq.SequenceOptions
check_memory = seq.check_memory  # the sweep's memory, refused before any work


def plan(cfg: seq.SequenceConfig, profile: str) -> tuple[str, str, bool]:
    """The cost key, the jobs, and whether options changed the profile's work."""
    changed = seq.changes_work(cfg, make_config(profile))
    return "reproduce clrs", f"{len(seq.jobs('', cfg))} training jobs", changed


def default_folder(cfg: seq.SequenceConfig, profile: str) -> str:
    return f"runs/clrs-{profile}"


def run_experiment(
    folder: str | Path,
    cfg: seq.SequenceConfig,
    progress: Progress | None = None,
    pool: str | None = None,
) -> Result:
    result = run(folder, cfg, progress, pool)
    return Result(
        result["run"], (("clrs.md", None),), ("report.md", "fig8.png", "bars.png"), result
    )


def summarize(
    rows, tasks: list[str], methods: list[str], spans: dict[str, tuple[int, int]] | None = None
) -> list[dict[str, Any]]:
    """Per algorithm and method: in-distribution and out-of-distribution accuracy (mean, sd and
    the paired p-value against the first method, softmax); ``spans`` as in
    `sequence.measures`."""
    per = seq.measures(rows, spans)
    out = []
    for t in tasks:
        base = per.get((t, methods[0]), {})
        for m in methods:
            if (t, m) in per:
                out.append(
                    {
                        "task": t,
                        "method": m,
                        **{
                            k: seq.compare(per[(t, m)], base, k)
                            for k in ("id", "ood", "auc", "id_token", "ood_token")
                        },
                    }
                )
    return out


def seed_verdicts(
    rows, tasks: list[str], methods: list[str], spans: dict[str, tuple[int, int]] | None = None
) -> list[dict[str, Any]]:
    """Per algorithm and method after the first (softmax): its out-of-distribution exact match
    against the first's over the seeds both have, as a `stats.reproduction_verdict` of the
    paper's claim that it is ahead (`PAPER_CLAIM`, from `paper_numbers`); the page's
    comparisons are one family, Holm-corrected (`stats.reproduction_verdicts`)."""
    per = seq.measures(rows, spans)
    cells, comparisons = [], []
    for t in tasks:
        base = per.get((t, methods[0]), {})
        for m in methods[1:]:
            mine = per.get((t, m), {})
            seeds = sorted(set(base) & set(mine))
            a, b = ([d[s]["ood"] for s in seeds] for d in (base, mine))
            cells.append((t, m))
            comparisons.append(dict(a=a, b=b, paper=PAPER_CLAIM.words, sign=PAPER_CLAIM.sign))
    return [
        {"task": t, "method": m, "verdict": v}
        for (t, m), v in zip(cells, reproduction_verdicts(comparisons), strict=True)
    ]


def verdict_markdown(judged: list[dict[str, Any]], baseline: str) -> str:
    """`seed_verdicts` as a table: the change, its 95 % interval over seeds, the p-value and
    its Holm correction over the page's comparisons, the change the paired t-test detects with
    80 % power at Holm's strictest threshold, and the verdict."""
    m = max((j["verdict"].m for j in judged), default=1)
    header = [
        "algorithm",
        "method",
        f"out of distribution: change vs {baseline}",
        "95 % interval (seeds)",
        "p (seeds)",
        f"p, Holm over {m}",
        f"detectable (80 % power, {alpha_words(0.05, m)})",
        "verdict",
    ]
    body = [
        [
            j["task"],
            j["method"],
            f"{j['verdict'].effect.mean:+.3f}",
            interval(j["verdict"].effect),
            p_cell(j["verdict"].effect.p),
            p_cell(j["verdict"].adjusted_p),
            decimals(j["verdict"].detectable if np.isfinite(j["verdict"].effect.p) else np.nan),
            j["verdict"].verdict,
        ]
        for j in judged
    ]
    return markdown_table(header, body, "llrrrrrl")


def _pm(c) -> str:
    return mean_sd(c[0], c[1])


def write(folder: Path, rows, table, cfg: seq.SequenceConfig) -> Path:
    methods = list(cfg.methods)
    header = [
        "algorithm",
        "method",
        "in distribution",
        "out of distribution",
        "p",
        "tokens in",
        "tokens out",
        "p",
    ]
    keys = ("id", "ood", "id_token", "ood_token")
    shown = [
        [
            e["task"],
            e["method"],
            _pm(e["id"]),
            _pm(e["ood"]),
            p_cell(e["ood"][2]),
            _pm(e["id_token"]),
            _pm(e["ood_token"]),
            p_cell(e["ood_token"][2]),
        ]
        for e in table
    ]
    raw = [
        [
            e["task"],
            e["method"],
            *(e[k][0] for k in keys[:2]),
            e["ood"][2],
            *(e[k][0] for k in keys[2:]),
            e["ood_token"][2],
        ]
        for e in table
    ]
    md = write_table(folder, "clrs", header, shown, raw)
    seq.plot_curves(
        folder / "fig8.png",
        rows,
        list(cfg.tasks),
        methods,
        "Accuracy against problem size (shaded: training sizes)",
        colors={"softmax": "tab:blue", "adaptive": "tab:red"},
    )
    plot_bars(folder / "bars.png", table, list(cfg.tasks), methods)
    wins = [
        (t, m)
        for t in cfg.tasks
        for m in methods[1:]
        for e in table
        if e["task"] == t and e["method"] == m
        for b in table
        if b["task"] == t and b["method"] == methods[0] and e["ood"][0] > b["ood"][0]
    ]
    judged = seed_verdicts(rows, list(cfg.tasks), methods)
    signif = [
        j
        for j in judged
        if (j["task"], j["method"]) in wins
        and np.isfinite(j["verdict"].adjusted_p)
        and j["verdict"].adjusted_p <= 0.05
    ]
    m = max((j["verdict"].m for j in judged), default=1)
    summary = (
        f"Out of distribution, {methods[1] if len(methods) > 1 else ''} is ahead of "
        f"{methods[0]} on {len(wins)} of {len(cfg.tasks)} algorithms; {len(signif)} of those "
        "differences are significant at 0.05 (paired t-test over seeds, Holm over the "
        f"{m} comparison{'s' * (m != 1)} with a test). The paper (Fig. 8, "
        "Gemma 2B fine-tuned on thirty algorithms) reports an advantage of adaptive temperature "
        "on nearly all of them."
    )
    setup = (
        f"{cfg.seeds} seeds per algorithm × method; a {cfg.layers}-layer decoder (d = "
        f"{cfg.d_model}, {cfg.heads} heads, positions {cfg.positions}) trained from scratch with "
        f"the method in every attention layer (adaptive temperature in training and at "
        f"inference, as §4.2 does); AdamW lr {cfg.lr}, {cfg.steps} steps of batch {cfg.batch}; "
        f"{cfg.eval_sets} test sequences per size, the same for both methods and every seed. "
        "Accuracy: exact match of the whole answer (teacher-forced argmax, which for a "
        "deterministic answer is what greedy decoding gives); tokens: the share of answer tokens "
        "right. In distribution: the evaluated sizes inside the training range; out of "
        "distribution: the larger ones. p: two-sided paired t-test against softmax over seeds "
        "(out of distribution)."
    )
    over_seeds = (
        (
            "Over seeds, the unit that was randomised (each seed trains both methods from its own "
            "initialisation and batches), out-of-distribution exact match, against the paper's "
            f"claim ({PAPER_CLAIM.words}): the paired change, its 95 % t interval, its p-value "
            "and the p-value Holm-corrected over the page's comparisons (the verdict's), the "
            "change a paired t-test detects with 80 % power at Holm's strictest threshold α/m, "
            "and the verdict.\n\n" + verdict_markdown(judged, methods[0])
        )
        if judged
        else ""
    )
    return write_report(
        folder,
        "CLRS-Text in small: softmax vs adaptive temperature (Softmax is not Enough, Fig. 8)",
        [
            "## Setup\n\n" + setup,
            "## Result\n\n" + summary + "\n\n" + md,
            over_seeds,
            image("fig8.png", "Accuracy against size per algorithm, mean ± sd over seeds"),
            image("bars.png", "Accuracy in and out of distribution per algorithm"),
        ],
    )


def plot_bars(path: Path, table, tasks: list[str], methods: list[str]) -> None:
    """Grouped bars: per algorithm, each method's in- and out-of-distribution accuracy."""
    with figure(path, figsize=(max(6.0, 1.1 * len(tasks) + 2), 3.8)) as (_fig, ax):
        x = np.arange(len(tasks))
        width = 0.8 / (2 * len(methods))
        colors = ["tab:blue", "tab:red", "tab:green", "tab:orange"]
        for j, m in enumerate(methods):
            for k, (key, hatch) in enumerate((("id", ""), ("ood", "//"))):
                vals, errs = [], []
                for t in tasks:
                    e = next((e for e in table if e["task"] == t and e["method"] == m), None)
                    mean, sd, _ = e[key] if e else (np.nan, np.nan, np.nan)
                    vals.append(mean)
                    errs.append(0.0 if not np.isfinite(sd) else sd)
                offset = (2 * j + k - len(methods) + 0.5) * width
                ax.bar(
                    x + offset,
                    vals,
                    width,
                    yerr=errs,
                    color=colors[j % 4],
                    hatch=hatch,
                    alpha=0.85 if k == 0 else 0.5,
                    label=f"{m} ({'in' if key == 'id' else 'out of'} distribution)",
                )
        ax.set_xticks(x, tasks, rotation=30, ha="right", fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("exact-match accuracy")
        ax.legend(fontsize=7)
