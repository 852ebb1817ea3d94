"""Table 1: ours beside the paper's per size, the gain over seeds with its interval, the
detectable gain and the verdict; written as markdown, CSV and JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ...lab import report
from ...lab.runs import write_atomic, write_json
from ...lab.stats import (
    alpha_words,
    detectable_at_power,
    paired_comparison,
    paired_effect,
    reproduction_verdicts,
)
from .config import PAPER_TABLE1


def table1(
    accuracy: dict[str, dict[int, dict[int, float]]],
    sizes,
    treatment: str = "adaptive",
    se: dict[str, dict[int, float]] | None = None,
    sets: dict[int, int] | None = None,
) -> list[dict[str, Any]]:
    """One row per size: ours (mean, std over seeds, paired t-test p) beside the paper's, and the
    gain over seeds (treatment − baseline, its 95 % interval, the gain detected with 80 % power
    and the verdict against the paper's gain where the paper found one, p ≤ 0.05; "–" where it
    did not). ``accuracy[method][seed][size]``; ``se[method][size]``: test-set standard error of
    the mean."""
    seeds = sorted(accuracy["baseline"])
    a = np.array([[accuracy["baseline"][s][n] for n in sizes] for s in seeds])
    b = np.array([[accuracy[treatment][s][n] for n in sizes] for s in seeds])
    cmp = paired_comparison(a, b)
    claimed = [
        j
        for j, n in enumerate(sizes)
        if PAPER_TABLE1["p_value"].get(n) is not None and PAPER_TABLE1["p_value"][n] <= 0.05
    ]
    judged = dict(
        zip(
            claimed,
            reproduction_verdicts(
                [dict(a=a[:, j], b=b[:, j], paper=_gain_words(sizes[j]), sign=1) for j in claimed]
            ),
            strict=True,
        )
    )
    rows = []
    for j, n in enumerate(sizes):
        row = {
            "size": n,
            "seeds": len(seeds),
            "baseline_mean": cmp.mean_a[j],
            "baseline_std": cmp.std_a[j],
            f"{treatment}_mean": cmp.mean_b[j],
            f"{treatment}_std": cmp.std_b[j],
            "p_value": cmp.p_value[j],
            "paper_baseline": PAPER_TABLE1["baseline"].get(n),
            "paper_adaptive": PAPER_TABLE1["adaptive"].get(n),
            "paper_p_value": PAPER_TABLE1["p_value"].get(n),
        }
        v = judged.get(j)
        effect = v.effect if v is not None else paired_effect(a[:, j], b[:, j])
        row.update(
            gain=effect.mean,
            gain_low=effect.low,
            gain_high=effect.high,
            detectable=v.detectable
            if v is not None
            else detectable_at_power(effect.sd, effect.n, 0.05),
            paper_gain=_paper_gain(n),
            p_holm=v.adjusted_p if v is not None else float("nan"),
            holm_m=v.m if v is not None else 0,
            verdict=v.verdict if v is not None else "–",
        )
        if se is not None:
            row["test_se"] = max(se["baseline"][n], se[treatment][n])
        if sets is not None:
            row["test_sets"] = sets[n]
        rows.append(row)
    return rows


def _paper_gain(n: int) -> float | None:
    """The paper's Table 1 gain at size ``n`` (adaptive − baseline, points), None where it has
    no row."""
    pa, pb = (PAPER_TABLE1[k].get(n) for k in ("baseline", "adaptive"))
    return None if pa is None else round(pb - pa, 1)


def _gain_words(n: int) -> str:
    gain = _paper_gain(n)
    return "–" if gain is None else f"{gain:+.1f}"


def verdict_table(rows: list[dict[str, Any]], label: str = "adaptive θ") -> str:
    """Markdown: per size, the gain over seeds with its 95 % interval, the p-value
    Holm-corrected over the sizes where the paper claims a gain, the gain detected with 80 %
    power (at Holm's strictest threshold where judged, at α = 0.05 elsewhere), the paper's gain
    and the verdict (where the paper claims a gain)."""
    m = max((r.get("holm_m", 1) for r in rows), default=1)

    def num(x: float) -> str:
        return "–" if x is None or not np.isfinite(x) else f"{x:+.1f}"

    return report.markdown_table(
        [
            "size",
            f"gain of {label} (ours)",
            "95 % interval (seeds)",
            "p, Holm",
            f"detectable (80 % power; {alpha_words(0.05, m)} where judged)",
            "gain (paper)",
            "verdict",
        ],
        [
            [
                f"{r['size']:,}",
                num(r["gain"]),
                "–"
                if not np.isfinite(r["gain_low"])
                else f"[{r['gain_low']:+.1f}, {r['gain_high']:+.1f}]",
                report.p_cell(r.get("p_holm", float("nan"))),
                "–" if not np.isfinite(r["detectable"]) else f"{r['detectable']:.1f}",
                num(r["paper_gain"]),
                r["verdict"],
            ]
            for r in rows
        ],
        align="rrrrrrl",
    )


def _fmt(mean, std) -> str:
    if std is None or not np.isfinite(std):
        return f"{mean:.1f}"
    return f"{mean:.1f} ± {std:.1f}"


def _fmt_p(p) -> str:
    return "n/a" if p is None or not np.isfinite(p) else f"{p:.2g}"


def paper_cell(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def write_table1(
    run: Path,
    rows: list[dict[str, Any]],
    name: str = "table1",
    treatment: str = "adaptive",
    label: str = "adaptive θ",
) -> str:
    """Write ``name``.md/.csv/.json into ``run``; return the markdown.

    With a ``treatment`` other than "adaptive" (the refit), rows that also carry "adaptive_mean"
    get a column for adaptive θ with the paper's coefficients too.
    """
    extra = treatment != "adaptive" and "adaptive_mean" in rows[0]
    se = "test_se" in rows[0]
    header = ["size", "baseline (ours)", "baseline (paper)"]
    header += ["adaptive θ (ours)"] if extra else []
    header += [f"{label} (ours)", "adaptive θ (paper)", "p (ours)", "p (paper)"]
    header += ["test sets", "test-set SE"] if se else []
    shown = []
    for r in rows:
        cells = [
            f"{r['size']:,}",
            _fmt(r["baseline_mean"], r["baseline_std"]),
            paper_cell(r["paper_baseline"]),
            *([_fmt(r["adaptive_mean"], r["adaptive_std"])] if extra else []),
            _fmt(r[f"{treatment}_mean"], r[f"{treatment}_std"]),
            paper_cell(r["paper_adaptive"]),
            _fmt_p(r["p_value"]),
            _fmt_p(r["paper_p_value"]),
            *([f"{r.get('test_sets', 0):,}", f"{r['test_se']:.2f}"] if se else []),
        ]
        shown.append(cells)
    md = report.markdown_table(header, shown, align="r" * len(header))
    write_atomic(run / f"{name}.md", md)
    write_atomic(run / f"{name}_verdicts.md", verdict_table(rows, label))
    cols = list(rows[0])
    write_atomic(run / f"{name}.csv", report.csv_text(cols, [[r[c] for c in cols] for r in rows]))
    write_json(run / f"{name}.json", [{k: _json_num(v) for k, v in r.items()} for r in rows])
    return md


def table_title(seeds: int) -> str:
    """The title of Table 1 as the command prints it."""
    return (
        "Max retrieval (Softmax is not Enough, Table 1): accuracy (%) by number of items, "
        f"mean ± sd over {seeds} seed{'s' if seeds != 1 else ''}"
    )


def table_note(rows: list[dict[str, Any]], seeds: int) -> str | None:
    """Why the table's ``p (ours)`` column says ``n/a`` where it does; None where it does not."""
    missing = [r for r in rows if r["p_value"] is None or not np.isfinite(r["p_value"])]
    if not missing:
        return None
    if seeds < 2:
        return (
            "p (ours) is n/a: the paired t-test over seeds needs at least two seeds and this run "
            "has one (the paper's: --seeds 10)."
        )
    return (
        "p (ours) is n/a where the t-test is undefined: every seed gave the same difference "
        "(e.g. both methods exact at the smallest sizes)."
    )


def _json_num(v):
    if isinstance(v, (float, np.floating)):
        return None if not np.isfinite(v) else float(v)
    return v
