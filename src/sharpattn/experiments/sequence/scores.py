"""Measures over seeds: the area under accuracy against log size, per-seed scores, paired
comparisons and accuracy curves."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from .choices import methods
from .config import task

# ---------------------------------------------------------------------------------------------
# Measures over seeds
# ---------------------------------------------------------------------------------------------


def area(sizes: list[int], acc: list[float]) -> float:
    """Normalised area under accuracy against log size (1 = solved at every size): the
    trapezoid rule on log2 size, divided by the log2 range. One size: its accuracy."""
    if len(sizes) == 1:
        return float(acc[0])
    x = np.log2(np.asarray(sizes, dtype=float))
    y = np.asarray(acc, dtype=float)
    return float(np.trapezoid(y, x) / (x[-1] - x[0]))


def area_weights(sizes: list[int]) -> np.ndarray:
    """The weights w of `area`: area = Σ w_i·acc_i (the trapezoid rule's on log2 size, over the
    log2 range; one size: 1)."""
    if len(sizes) == 1:
        return np.ones(1)
    x = np.log2(np.asarray(sizes, dtype=float))
    half = np.diff(x) / 2
    w = np.zeros(len(x))
    w[:-1] += half
    w[1:] += half
    return w / (x[-1] - x[0])


def test_sampling(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """{(task, method): {"test_sd", "seed_sd", "ratio"}}: how much of a run's score (`area`) the
    test sequences' sampling explains against the seeds' spread. ``test_sd``: the standard
    error of a run's score from its test sequences alone, Σ w_i²·p̃_i(1 − p̃_i)/n_i over its
    sizes (binomial exact match over each size's n_i sequences, with Agresti–Coull's p̃ =
    (k + 2)/(n + 4) so that sizes at 0 or 1 count; a size the stopping rule skipped has none),
    as the root of its mean over seeds; ``seed_sd``: the score's sd over seeds (ddof 1; NaN for
    one seed); ``ratio``: test_sd / seed_sd (NaN where the seeds do not differ)."""
    groups: dict[tuple[str, str], dict[int, list[dict[str, Any]]]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["method"]), {}).setdefault(r["seed"], []).append(r)
    out = {}
    for key, seeds in groups.items():
        variances, scores = [], []
        for rs in seeds.values():
            rs = sorted(rs, key=lambda r: r["size"])
            w = area_weights([r["size"] for r in rs])
            var = 0.0
            for wi, r in zip(w, rs, strict=True):
                n = int(r.get("sets", 0))
                if n > 0 and not r.get("skipped"):
                    p = (r["acc"] * n + 2) / (n + 4)
                    var += wi**2 * p * (1 - p) / n
            variances.append(var)
            scores.append(area([r["size"] for r in rs], [r["acc"] for r in rs]))
        test_sd = float(np.sqrt(np.mean(variances)))
        seed_sd = float(np.std(scores, ddof=1)) if len(scores) > 1 else float("nan")
        ratio = test_sd / seed_sd if seed_sd > 0 else float("nan")
        out[key] = {"test_sd": test_sd, "seed_sd": seed_sd, "ratio": ratio}
    return out


def per_seed(rows, key) -> dict[tuple, dict[int, float]]:
    """{(task, method): {seed: key(rows of that task, method, seed)}}."""
    groups: dict[tuple, dict[int, list]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["method"]), {}).setdefault(r["seed"], []).append(r)
    return {
        k: {s: key(sorted(v, key=lambda r: r["size"])) for s, v in g.items()}
        for k, g in groups.items()
    }


def auc_of(rows) -> float:
    return area([r["size"] for r in rows], [r["acc"] for r in rows])


def _mean(values: list[float]) -> float:
    """The mean of the finite ``values`` (a size the stopping rule skipped has no token
    accuracy); NaN where there is none."""
    finite = [v for v in values if np.isfinite(v)]
    return float(np.mean(finite)) if finite else float("nan")


def stopping(rows: list[dict[str, Any]]) -> dict[str, int]:
    """How often the stopping rule fired: ``runs`` (task, method, seed) in all, ``stopped`` of
    them with skipped sizes, ``cells`` evaluated, ``skipped`` cells, and ``sequences`` drawn."""
    runs = {(r["task"], r["method"], r["seed"]) for r in rows}
    stopped = {(r["task"], r["method"], r["seed"]) for r in rows if r.get("skipped")}
    skipped = sum(bool(r.get("skipped")) for r in rows)
    return {
        "runs": len(runs),
        "stopped": len(stopped),
        "cells": len(rows) - skipped,
        "skipped": skipped,
        "sequences": sum(int(r["sets"]) for r in rows),
    }


def measures(
    rows: list[dict[str, Any]], spans: dict[str, tuple[int, int]] | None = None
) -> dict[tuple[str, str], dict[int, dict[str, float]]]:
    """{(task, method): {seed: measures}} with ``auc`` (`area` of accuracy over the
    evaluated sizes), ``id`` (mean accuracy at the sizes inside the task's training range),
    ``ood`` (mean accuracy beyond it), ``largest`` (accuracy at the largest size), and
    ``id_token`` / ``ood_token`` (the same means of answer-token accuracy). ``spans``: training
    ranges {task: (lo, hi)} where they are not the tasks' own."""
    out: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["method"], r["seed"]), []).append(r)
    for (name, method, seed), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["size"])
        hi = _span(name, spans)[1]
        inside = [r["acc"] for r in rs if r["size"] <= hi]
        beyond = [r["acc"] for r in rs if r["size"] > hi]
        tok_in = [r["token_acc"] for r in rs if r["size"] <= hi]
        tok_out = [r["token_acc"] for r in rs if r["size"] > hi]
        out.setdefault((name, method), {})[seed] = {
            "auc": area([r["size"] for r in rs], [r["acc"] for r in rs]),
            "id": _mean(inside),
            "ood": _mean(beyond),
            "largest": rs[-1]["acc"],
            "id_token": _mean(tok_in),
            "ood_token": _mean(tok_out),
        }
    return out


def compare(per: dict[int, dict[str, float]], base: dict[int, dict[str, float]], key: str):
    """Mean ± sd of ``key`` over seeds and the paired t-test p-value against ``base`` (seeds
    both have; NaN with fewer than two)."""
    from ...lab.stats import paired_comparison

    seeds = sorted(set(per) & set(base))
    a = np.array([[base[s][key]] for s in seeds]) if seeds else np.zeros((0, 1))
    b = np.array([[per[s][key]] for s in seeds]) if seeds else np.zeros((0, 1))
    values = np.array([per[s][key] for s in sorted(per)])
    sd = float(values.std(ddof=1)) if len(values) > 1 else float("nan")
    p = float(paired_comparison(a, b).p_value[0]) if len(seeds) >= 2 else float("nan")
    return float(values.mean()), sd, p


def curves(rows, name: str) -> dict[str, tuple[list[int], list[float], list[float]]]:
    """{method: (sizes, mean accuracy, sd)} of one task, over seeds."""
    by: dict[str, dict[int, list[float]]] = {}
    for r in rows:
        if r["task"] == name:
            by.setdefault(r["method"], {}).setdefault(r["size"], []).append(r["acc"])
    out = {}
    for method, d in by.items():
        sizes = sorted(d)
        out[method] = (
            sizes,
            [float(np.mean(d[s])) for s in sizes],
            [float(np.std(d[s], ddof=1)) if len(d[s]) > 1 else 0.0 for s in sizes],
        )
    return out


def _span(name: str, spans: dict[str, tuple[int, int]] | None) -> tuple[int, int]:
    """The training range of task ``name``: its entry of ``spans``, else the task's own."""
    return tuple((spans or {}).get(name) or task(name).train_sizes)


def plot_curves(
    path: Path,
    rows,
    names: list[str],
    methods_: list[str],
    title: str,
    colors: dict[str, str] | None = None,
    spans: dict[str, tuple[int, int]] | None = None,
) -> None:
    """One panel per task: accuracy against size (log scale), a line per method (± sd over seeds
    as a band when there are at most four methods), the training range shaded (the shape of
    *Softmax is not Enough* Fig. 8; ``spans`` as in `measures`); the legend has a panel of
    its own where the grid has one free, else a column beside the grid. Every method has its
    own colour, line style and marker (`report.method_styles`, in the order of `methods`, so a
    method looks the same in every figure); ``colors`` overrides a method's colour."""
    from ...lab.report import figure, method_styles

    cols = min(4, len(names))
    nrows = math.ceil(len(names) / cols)
    spare_panel = len(names) % cols != 0  # the legend's own panel, else a column of its own
    ncol = 1 + len(methods_) // 14  # legend columns
    side = 0.0 if spare_panel else 1.7 * ncol  # inches for the legend's column
    size = (3.8 * cols + side, 3.0 * nrows + 0.4)
    with figure(path, nrows, cols, figsize=size, squeeze=False) as (fig, axes):
        styles = method_styles(methods_, catalogue=list(methods()))
        for method, color in (colors or {}).items():
            if method in styles:
                styles[method]["color"] = color
        bands = len(methods_) <= 4
        for i, name in enumerate(names):
            ax = axes[i // cols][i % cols]
            lo, hi = _span(name, spans)
            ax.axvspan(lo, hi, color="0.9", zorder=0)
            data = curves(rows, name)
            for method in methods_:
                if method not in data:
                    continue
                sizes, mean, sd = data[method]
                style = styles[method]
                ax.plot(sizes, mean, ms=3.5, lw=1.2, label=method, **style)
                color = style["color"]
                if bands:
                    low = [m - s for m, s in zip(mean, sd, strict=True)]
                    high = [m + s for m, s in zip(mean, sd, strict=True)]
                    ax.fill_between(sizes, low, high, alpha=0.12, color=color, lw=0)
            ax.set_xscale("log", base=2)
            ax.set_ylim(-0.03, 1.03)
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("size", fontsize=8)
            ax.set_ylabel("exact-match accuracy", fontsize=8)
        for k in range(len(names), nrows * cols):
            axes[k // cols][k % cols].axis("off")
        handles, labels = axes[0][0].get_legend_handles_labels()
        if spare_panel:
            spare = axes[len(names) // cols][len(names) % cols]
            spare.legend(
                handles,
                labels,
                loc="center",
                fontsize=7,
                ncol=1 + len(labels) // 14,
                title=title,
                title_fontsize=8,
                frameon=False,
            )
        else:  # beside the grid, in the width added for it
            from matplotlib.layout_engine import TightLayoutEngine

            fig.set_layout_engine(TightLayoutEngine(rect=(0, 0, 1 - side / size[0], 0.97)))
            fig.legend(
                handles,
                labels,
                loc="center right",
                fontsize=7,
                frameon=False,
                bbox_to_anchor=(1.0, 0.5),
                ncol=ncol,
            )
            fig.suptitle(title, fontsize=9)
