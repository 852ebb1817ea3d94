"""App. C.3 of Guo et al.: the simplified model of Theorem 2 (`simplified_model`) trained by
Adam on Bigram-Backcopy, one `Trainer` run per seed like the one-layer transformer runs (the
same batches and evaluation sequences); the analysis of its dynamics (when each risk converges,
the log-fit of Δlogit), the study over seeds, its figures and report.md."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ...lab import report, runner
from ...lab.runner import Clock, Progress, RunFolder, Trainer, emit, write_metrics
from ...lab.stats import linear_fit
from ...tasks.bigram_backcopy import BigramBackcopy
from . import training
from .config import CONVERGED
from .simplified_model import (
    PAPER,
    SimplifiedConfig,
    build_model,
    measure,
    next_token_loss,
)
from .training import Run, eval_tokens, task_trainer

Tensor = torch.Tensor


# ----- training -------------------------------------------------------------------------------
def trainer(
    run_dir: str | Path,
    cfg: SimplifiedConfig,
    task: BigramBackcopy,
    progress: Progress | None = None,
    label: str = "",
) -> Trainer:
    """The runner's Trainer for one run (`backcopy.task_trainer`): with the same seed,
    batch and length, the simplified model sees the batches and evaluation sequences of the
    one-layer transformer run."""
    return task_trainer(
        run_dir,
        "backcopy-simplified",
        cfg,
        task,
        model=lambda: build_model(cfg, task),
        optimizer=lambda m: torch.optim.AdamW(
            m.parameters(), lr=cfg.lr, betas=cfg.betas, eps=1e-8, weight_decay=cfg.weight_decay
        ),
        loss=next_token_loss,
        measure=measure,
        log_at=cfg.log_at(),
        progress=progress,
        label=label,
    )


def train(
    run_dir: str | Path, cfg: SimplifiedConfig, task: BigramBackcopy | None = None, **kw
) -> Run:
    """`backcopy.train` with this model's `trainer` (``stop_at``, ``progress``,
    ``label`` as there)."""
    return training.train(run_dir, cfg, task, make=trainer, **kw)


# ----- analysis -------------------------------------------------------------------------------
def converged_steps(metrics: list[dict]) -> dict[str, int | None]:
    """The first logged step at which each excess risk is below `CONVERGED` (and both)."""
    out = {}
    for name, keys in (
        ("bigram", ("bigram_excess",)),
        ("backcopy", ("backcopy_excess",)),
        ("both", ("bigram_excess", "backcopy_excess")),
    ):
        out[name] = next((m["step"] for m in metrics if all(m[k] < CONVERGED for k in keys)), None)
    return out


def log_fit(metrics: list[dict], key: str = "delta_logit", start: int = 400) -> dict[str, float]:
    """Least squares of ``key`` on log(step) over the logged steps ≥ ``start`` (scipy
    ``linregress``): Theorem 2(a)'s y = a·log t + b. Also the R² of y on the step itself (a
    straight line in t, what Adam gives a constant gradient sign) for contrast."""
    steps = np.array([m["step"] for m in metrics], dtype=float)
    y = np.array([m[key] for m in metrics], dtype=float)
    sel = steps >= max(start, 1)
    slope, r2 = linear_fit(np.log(steps[sel]), y[sel])
    slope_t, r2_t = linear_fit(steps[sel], y[sel])
    intercept = (
        float(np.mean(y[sel]) - slope * np.mean(np.log(steps[sel]))) if sel.sum() else float("nan")
    )
    return {
        "from": int(max(start, 1)),
        "points": int(sel.sum()),
        "slope": slope,
        "intercept": intercept,
        "r2": r2,
        "r2_linear_in_t": r2_t,
        "slope_linear_in_t": slope_t,
    }


def _nan_to_none(obj):
    """NaN (an undefined fit or maximum) as None: results.json stays strict JSON."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_nan_to_none(v) for v in obj]
    return obj


def summary(run: Run) -> dict:
    """The numbers of one run for the report and results.json (None where undefined: a fit
    with fewer than three measurements, nothing measured from step `LATE` on)."""
    m = run.metrics
    first, last = m[0], m[-1]
    conv = converged_steps(m)
    late = [r for r in m if r["step"] >= LATE]
    return _nan_to_none(
        {
            "steps": run.steps_done,
            "train_seconds": run.seconds,
            "converged": conv,
            "bigram_excess": last["bigram_excess"],
            "backcopy_excess": last["backcopy_excess"],
            "bos_weight_0": first["bos_weight"],
            "bos_weight": last["bos_weight"],
            "prev_weight_trigger": last["prev_weight_trigger"],
            "delta_logit": last["delta_logit"],
            "alpha_band": [last["alpha_q05"], last["alpha_q95"]],
            "lambda": last["lambda"],
            "val_bos_0": first["val_bos"],
            "val_bos": last["val_bos"],
            "val_bos_min": min(r["val_bos"] for r in m),
            "val_other": last["val_other"],
            "beta_norm_0": first["beta_norm"],
            "beta_norm": last["beta_norm"],
            # the worst excess risks from step LATE on (transient spikes of training)
            "max_excess_late": [
                max((r[k] for r in late), default=float("nan"))
                for k in ("bigram_excess", "backcopy_excess")
            ],
            "log_fit": log_fit(m, "delta_logit", run.cfg.linear_until),
            "log_fit_late": log_fit(m, "delta_logit", max(LATE, run.cfg.linear_until)),
        }
    )


#: Fig. 4b's window: "Δlogit grows approximately linearly [in log step] between 1,000 and 10,000"
LATE = 1000


# ----- the study ------------------------------------------------------------------------------
def run(
    out: str | Path,
    *,
    seeds: int | None = None,
    steps: int | None = None,
    threads: int | None = 1,
    progress: Progress | None = None,
    task: BigramBackcopy | None = None,
    base: SimplifiedConfig | None = None,
) -> tuple[Path, dict]:
    """Train (or resume) the simplified model for ``seeds`` seeds (default 1) in
    ``out/runs/seed<k>`` and write ``out/report.md``, ``out/results.json``, ``out/dynamics.png``
    (Fig. 18) and ``out/statics.png`` (Fig. 17). ``base``: the configuration (default
    `PAPER`); ``steps`` overrides its training steps."""
    task = task or BigramBackcopy.tiny_shakespeare()
    base = base or PAPER
    if steps is not None:
        base = SimplifiedConfig(**{**base.to_dict(), "steps": steps})
    cfgs = {
        f"seed{s}": SimplifiedConfig(**{**base.to_dict(), "seed": s}) for s in range(seeds or 1)
    }
    record = {"study": "simplified", "runs": {k: c.to_dict() for k, c in cfgs.items()}}
    folder = RunFolder(out, "backcopy-study", record, identity=("study",))
    clock = Clock()
    runs: dict[str, Run] = {}
    with runner.threads(threads):
        for i, (name, cfg) in enumerate(cfgs.items()):
            emit(progress, "simplified", "runs", i, len(cfgs), note=name)
            runs[name] = train(folder / "runs" / name, cfg, task, progress=progress, label=name)
    sums = {k: summary(r) for k, r in runs.items()}
    results = {"study": "simplified", "wall_seconds": clock.wall, "runs": sums}
    write_metrics(folder, results, "results.json")
    write_figures(folder.path, runs, task)
    write_report(folder.path, runs, sums, task)
    return folder.path, results


# ----- figures and report ---------------------------------------------------------------------
def _axis(ax, knee: int, last: int) -> None:
    """Fig. 18's step axis: linear up to ``knee``, logarithmic after it (one knee-width per
    decade) up to step ``last``."""
    if knee < 1:
        ax.set_xscale("symlog", linthresh=1)
        return

    def fwd(x):
        x = np.asarray(x, dtype=float)
        return np.where(x <= knee, x, knee * (1 + np.log10(np.maximum(x, knee) / knee)))

    def inv(y):
        y = np.asarray(y, dtype=float)
        return np.where(y <= knee, y, knee * 10 ** (np.maximum(y, knee) / knee - 1))

    ax.set_xscale("function", functions=(fwd, inv))
    ax.axvline(knee, color="lightgray", lw=0.8, zorder=0)
    after = [m * 10**e for e in range(1, 9) for m in (1, 2, 5) if 2 * knee < m * 10**e <= last]
    ticks = [0, knee // 2, knee, *after[:: max(1, len(after) // 4)]]
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks], fontsize=7)


def _series(metrics: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    return (
        np.array([m["step"] for m in metrics], dtype=float),
        np.array([m[key] for m in metrics], dtype=float),
    )


def write_figures(out: Path, runs: dict[str, Run], task: BigramBackcopy) -> None:
    """dynamics.png (Fig. 18: excess risks, BOS weight, BOS logit with its log fit, value
    norms) and statics.png (Fig. 17: attention map and value norms of one sequence)."""
    colors = report.pyplot().get_cmap("tab10").colors
    with report.figure(out / "dynamics.png", 1, 4, figsize=(16, 3.8)) as (_, ax):
        for j, (name, r) in enumerate(runs.items()):
            c, knee, tag = colors[j % 10], r.cfg.linear_until, f" ({name})" if len(runs) > 1 else ""
            for key, ls, label in (
                ("bigram_excess", "-", "bigram"),
                ("backcopy_excess", "--", "backcopy"),
            ):
                ax[0].plot(*_series(r.metrics, key), ls=ls, color=c, label=label + tag)
            ax[1].plot(
                *_series(r.metrics, "bos_weight"), color=c, label="BOS, non-trigger queries" + tag
            )
            ax[1].plot(
                *_series(r.metrics, "prev_weight_trigger"),
                ls="--",
                color=c,
                label="previous key, trigger queries" + tag,
            )
            steps, dl = _series(r.metrics, "delta_logit")
            _, lo = _series(r.metrics, "alpha_q05")
            _, hi = _series(r.metrics, "alpha_q95")
            ax[2].plot(steps, dl, color=c, label="Δlogit (α over non-trigger queries)" + tag)
            ax[2].fill_between(steps, lo, hi, color=c, alpha=0.2, lw=0)
            fit = log_fit(r.metrics, "delta_logit", knee)
            t = steps[steps >= fit["from"]]
            ax[2].plot(
                t,
                fit["slope"] * np.log(t) + fit["intercept"],
                ls=":",
                color="k",
                label=f"{fit['slope']:.2f}·log t + {fit['intercept']:.2f}" + tag,
            )
            ax[3].plot(*_series(r.metrics, "val_bos"), color=c, label="‖Val_BOS‖ = ‖Oβ‖" + tag)
            ax[3].plot(
                *_series(r.metrics, "val_other"),
                ls="--",
                color=c,
                label="mean ‖Val‖ of the other positions" + tag,
            )
        titles = (
            "excess risk (nats)",
            "attention weight",
            "attention logit on BOS",
            "value-state norm",
        )
        knee = next(iter(runs.values())).cfg.linear_until
        last = max(r.metrics[-1]["step"] for r in runs.values())
        for a, title in zip(ax, titles, strict=True):
            _axis(a, knee, last)
            a.set_title(title, fontsize=9)
            a.set_xlabel(f"step (linear to {knee}, log after)", fontsize=8)
            a.legend(fontsize=6)
        ax[0].set_yscale("log")
    first = next(iter(runs.values()))
    seq = eval_tokens(first.cfg, task)[0, :32]
    from .figures import token_label

    with torch.no_grad():
        w = torch.softmax(first.model.scores(seq[None]), -1)[0].cpu().numpy()
        norms = first.model.value_norms(seq[None])[0].cpu().numpy()
    labels = [token_label(task, t) for t in seq]
    with report.figure(out / "statics.png", 1, 2, figsize=(12, 5)) as (_, ax):
        ax[0].imshow(w, cmap="Blues", vmin=0, vmax=1)
        ax[0].set_xticks(range(len(seq)), labels, fontsize=6)
        ax[0].set_yticks(range(len(seq)), labels, fontsize=6)
        for ticks in (ax[0].get_xticklabels(), ax[0].get_yticklabels()):
            for lab, t in zip(ticks, seq, strict=False):
                if int(t) < task.n_triggers:
                    lab.set_color("red")
        ax[0].set_title("attention weights (triggers in red)", fontsize=9)
        ax[0].set_xlabel("key", fontsize=8)
        ax[0].set_ylabel("query", fontsize=8)
        cols = ["black"] + ["tab:red" if int(t) < task.n_triggers else "tab:blue" for t in seq[1:]]
        ax[1].bar(range(len(seq)), norms, color=cols)
        ax[1].set_xticks(range(len(seq)), labels, fontsize=6)
        ax[1].set_title("‖Val‖ per position (BOS black = ‖Oβ‖, triggers red = 0)", fontsize=9)


def summary_markdown(results: dict) -> str:
    """The command's summary: per run, its steps, excess risks, BOS weight and logit, value
    norms, and the log fit of the BOS logit."""
    header = [
        "run",
        "steps",
        "bigram exc.",
        "backcopy exc.",
        "BOS weight",
        "Δlogit",
        "‖Oβ‖",
        "mean ‖Val_other‖",
        "log fit slope",
        "R²",
    ]
    keys = ("bigram_excess", "backcopy_excess", "bos_weight", "delta_logit", "val_bos", "val_other")
    rows = [
        [
            name,
            str(r["steps"]),
            *(report.cell(r[k]) for k in keys),
            report.cell(r["log_fit"]["slope"]),
            report.cell(r["log_fit"]["r2"]),
        ]
        for name, r in results["runs"].items()
    ]
    return report.markdown_table(header, rows)


def write_report(out: Path, runs: dict[str, Run], sums: dict, task: BigramBackcopy) -> Path:
    c = next(iter(runs.values())).cfg
    intro = (
        "Guo et al., *Active-Dormant Attention Heads*, App. C.3: the simplified model of "
        "Theorem 2 (Fig. 5, Eqs. 6-8) with a trainable Gaussian-initialised MLP and "
        "Val_BOS = O·β, trained on Bigram-Backcopy (V = "
        f"{task.V}, triggers {', '.join(repr(task.chars[i]) for i in task.triggers)}). "
        "`sharpattn reproduce backcopy-study simplified`.\n\n"
        f"Settings: AdamW lr {c.lr:g}, betas {c.betas}, weight decay {c.weight_decay:g}, batch "
        f"{c.batch} fresh sequences of {c.seq_len} tokens per step, {c.steps:,} steps, MLP "
        f"hidden width {c.hidden}; measured on {c.eval_batch} fixed sequences every "
        f"{c.linear_every} steps to step {c.linear_until} and at {c.n_log} log-spaced steps "
        f"after it. Training time: {sum(r.seconds for r in runs.values()):.0f} s in all."
    )
    header = [
        "run",
        "steps",
        "train s",
        "bigram < 0.1 at",
        "backcopy < 0.1 at",
        "bigram exc.",
        "backcopy exc.",
        "BOS weight start → end",
        "prev. weight (trig.)",
        "Δlogit",
        "α 5-95 %",
        "λ",
        "‖Oβ‖ start → min → end",
        "mean ‖Val_other‖",
        "‖β‖ start → end",
        f"max bigram / backcopy exc. from step {LATE:,}",
    ]
    rows = []
    for k, s in sums.items():
        rows.append(
            [
                k,
                s["steps"],
                s["train_seconds"],
                s["converged"]["bigram"],
                s["converged"]["backcopy"],
                s["bigram_excess"],
                s["backcopy_excess"],
                f"{s['bos_weight_0']:.3f} → {s['bos_weight']:.3f}",
                s["prev_weight_trigger"],
                s["delta_logit"],
                f"{s['alpha_band'][0]:.2f} … {s['alpha_band'][1]:.2f}",
                s["lambda"],
                f"{s['val_bos_0']:.3f} → {s['val_bos_min']:.3f} → {s['val_bos']:.3f}",
                s["val_other"],
                f"{s['beta_norm_0']:.2f} → {s['beta_norm']:.2f}",
                " / ".join(report.cell(v) for v in s["max_excess_late"]),
            ]
        )
    fit_rows = [
        [k, f["from"], f["points"], f["slope"], f["intercept"], f["r2"], f["r2_linear_in_t"]]
        for k, s in sums.items()
        for f in (s["log_fit"], s["log_fit_late"])
    ]
    first = next(iter(runs.values()))
    keys = {
        "bigram_excess": "bigram exc.",
        "backcopy_excess": "backcopy exc.",
        "bos_weight": "BOS weight",
        "delta_logit": "Δlogit",
        "lambda": "λ",
        "val_bos": "‖Oβ‖",
        "val_other": "mean ‖Val_other‖",
        "beta_norm": "‖β‖",
    }
    dyn = [[m["step"], *(m[k] for k in keys)] for m in first.metrics]
    sections = [
        intro,
        "## Runs\n\n"
        + report.markdown_table(header, rows, "l" + "r" * (len(header) - 1))
        + f"\nExcess risk = expected cross-entropy under the true next-token distribution minus "
        f"the exact Bayes risk (nats), the one-layer runs' definition; 'bigram < 0.1 at': the "
        f"first logged step with that excess risk below {CONVERGED}. BOS weight: mean over "
        "non-trigger queries; Δlogit: mean over non-trigger queries of the logit on BOS minus "
        "the mean logit on the other keys (= α of the query token, as the others are 0); "
        "α 5-95 %: over the non-trigger tokens; mean ‖Val_other‖: over the positions ≥ 1 "
        "(|ξ_k| for a non-trigger k, 0 for a trigger); 'max ... from step': the largest "
        "excess risks measured from that step on (transient spikes of training at lr 0.03 "
        "show there).",
        "## Log fit of the BOS logit\n\n"
        + report.markdown_table(
            [
                "run",
                "from step",
                "points",
                "slope per unit log t",
                "intercept",
                "R² (log t)",
                "R² (linear in t)",
            ],
            fit_rows,
        )
        + "\nLeast squares (scipy `linregress`) of Δlogit on log(step) over the logged steps "
        f"from the start of the log-scaled axis on, and from step {LATE} on (the window in which "
        "the paper sees the one-layer transformer's Δlogit grow linearly in log step, Fig. 4b). "
        "Theorem 2(a) predicts α(t) = ½ log t + O(1) "
        "for the gradient flow of the loss in α with β fixed; Adam's steps are not gradient-flow "
        "time, so the paper's claim (Fig. 18) is the shape: 'close to the logarithmic growth'.",
        report.image(
            "dynamics.png",
            "Fig. 18: dynamics (axis linear to step "
            f"{c.linear_until}, logarithmic after it; shaded: α over the non-trigger "
            "tokens, 5-95 %; dotted: the log fit).",
        ),
        report.image(
            "statics.png",
            "Fig. 17: attention weights and value norms of one "
            "evaluation sequence at the end of training (first run).",
        ),
        "## Dynamics (first run)\n\n" + report.markdown_table(["step", *keys.values()], dyn),
        "## The paper (App. C.3, Figs. 17-18)\n\n"
        "- the excess-risk curves match the one-layer transformer's (both fall to ~0, bigram "
        "first);\n- the BOS attention logit grows close to logarithmically (Theorem 2);\n"
        "- attention sink and value-state drain reinforce each other: non-trigger queries "
        "attend to BOS while ‖Val_BOS‖ shrinks (Fig. 17: BOS has the smallest value norm).",
    ]
    return report.write_report(out, "Bigram-Backcopy: the simplified model of App. C.3", sections)
