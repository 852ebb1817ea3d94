"""report.md of a max-retrieval run, from what its folder holds."""

from __future__ import annotations

from pathlib import Path

from ... import normalizers as nz
from ...lab import report
from ...lab.runs import read_json
from . import figures
from .config import REGULARISERS, read_config

#: summary.json (timings of the latest invocation), as the report reads it
SUMMARY = {
    "elapsed_s": float,
    "train_s": float,
    "eval_s": float,
    "steps_per_s": (float, type(None)),
}


def write_report(run: Path) -> Path:
    """report.md from what the run folder holds (Table 1, refit table, figures, speed)."""
    run = Path(run)
    config = read_config(run)
    summary = read_json(run / "summary.json", SUMMARY) if (run / "summary.json").is_file() else {}
    parts = [
        f"{config.seeds} seed(s) × {config.steps:,} Adam steps (lr {config.lr:g}, batch {config.batch}, "
        f"n ~ U{{{config.min_items}..{config.max_items}}}, regulariser `{config.regulariser}`: "
        f"{REGULARISERS[config.regulariser]}, λ = {config.l2:g}); trained normalizer "
        f"`{config.method}`; adaptive θ with coefficients `{config.coefficients}` at inference only. "
        f"{config.test_sets:,} test sets per size, the same for every seed and method; p: paired "
        "t-test over seeds (scipy `ttest_rel`); test-set SE: the standard error, over test sets, of "
        "the seeds' mean accuracy (the larger of the two columns).\n",
    ]
    if summary.get("steps_per_s"):
        parts.append(
            f"Training: {config.group} seed(s) per batched ensemble, {summary['steps_per_s']:.0f} "
            f"steps/s per seed. Wall time {summary['elapsed_s']:.0f} s: training "
            f"{summary['train_s']:.0f} s, evaluation {summary['eval_s']:.0f} s (this invocation; "
            "a resumed run counts only what it did).\n"
        )
    for name, title in (
        ("table1", "Table 1"),
        ("table1_refit", "Table 1 with the refitted temperature (App. F)"),
    ):
        if (run / f"{name}.md").is_file():
            parts.append(f"## {title}\n\n{(run / f'{name}.md').read_text()}")
        if (run / f"{name}_verdicts.md").is_file():
            parts.append(
                "Verdict over seeds, the unit that was randomised: the gain (accuracy points) "
                "with its 95 % t interval, the gain a paired t-test at 0.05 detects with 80 % "
                "power at the seeds' spread, and, where the paper found a gain (its p ≤ 0.05), "
                "reproduced / contradicted / not detectable at this power.\n\n"
                + (run / f"{name}_verdicts.md").read_text()
            )
    if (run / "fit_temperature.json").is_file():
        fit = read_json(run / "fit_temperature.json", {"coefficients": [float], "samples": int})
        coeffs = ", ".join(f"{c:.4g}" for c in fit["coefficients"])
        parts.append(
            f"Refitted β(H) = polyval([{coeffs}], H) from {fit['samples']:,} sets "
            f"(paper: {list(nz.COEFFICIENTS['icml'])}); file `fit_temperature.json`, usable as "
            "`adaptive(coefficients=path)`.\n"
        )
    regions = figures.region_entropies()
    lam_star, theta_star = figures.fig5_boundaries()
    parts.append(
        f"## Figure 5's four regions (λ* = {lam_star:g}, θ* = {theta_star:g})\n\n"
        + report.markdown_table(
            ["region", "logits / temperature", "mean H", "min H", "max H"],
            [
                [
                    r["region"],
                    r["what"],
                    f"{r['mean']:.3f}",
                    f"{r['min'] + 0.0:.3f}",
                    f"{r['max']:.3f}",
                ]
                for r in regions
            ],
        )
    )
    if (run / "corollary_b1.md").is_file():
        parts.append(
            "## Corollary B.1: {v_a, v_b, …, v_b} is misclassified once n is large\n\n"
            + (run / "corollary_b1.md").read_text()
        )
    for png, caption in (
        ("accuracy.png", "Accuracy vs set size, ours (±std) and the paper's."),
        (
            "attention.png",
            "Figures 2/7: attention over the 16 largest items of 32 sets; softmax above, adaptive θ below.",
        ),
        (
            "entropy_landscape.png",
            "Figure 5: entropy of softmax_θ over 10 logits a_i = λ^i, its four regions split at "
            "λ* (all logits equal) and θ* (the largest θ adaptive temperature applies).",
        ),
        (
            "logit_spread.png",
            "Figure 9: logit spread δ and the Proposition 3.1 bound during training.",
        ),
        ("fit_temperature.png", "Figure 6: the temperature fit, ours and the paper's."),
    ):
        if (run / png).is_file():
            parts.append(report.image(png, caption))
    return report.write_report(
        run, "Max retrieval (Veličković et al., *Softmax is not Enough*, App. A, Table 1)", parts
    )
