"""The report's figures: attention and value norms over a sequence, the interventions, the
training dynamics, the residual peaks and the ODE panels of the simplified model."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ...lab import report
from .findings import series
from .measures import internals
from .training import Run

Tensor = torch.Tensor


# ----- plots ----------------------------------------------------------------------------------
def token_label(task, t) -> str:
    """A tick label for a token: ⟨s⟩ for BOS, · for space, ↵ for newline."""
    if int(t) == task.bos:
        return "⟨s⟩"
    return {" ": "·", "\n": "↵"}.get(task.chars[int(t)], task.chars[int(t)])


@torch.no_grad()
def _attention_panel(ax, run: Run, task, seq: Tensor, n: int, title: str) -> None:
    """Fig. 2b / 7a: the attention map of one sequence."""
    _, cap = internals(run.model, seq[None, :n])
    w = cap["layers.0.attn.weights"][0].mean(0).cpu().numpy()
    im = ax.imshow(w, cmap="Blues", vmin=0, vmax=max(float(w.max()), 1e-9))
    ax.figure.colorbar(im, ax=ax, shrink=0.8, label="attention weight (mean over heads)")
    labels = [token_label(task, t) for t in seq[:n]]
    ax.set_xticks(range(n), labels, fontsize=6, rotation=90)
    ax.set_yticks(range(n), labels, fontsize=6)
    for tick_set in (ax.get_xticklabels(), ax.get_yticklabels()):
        for lab, t in zip(tick_set, seq[:n], strict=False):
            if int(t) < task.n_triggers:
                lab.set_color("red")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("key", fontsize=8)
    ax.set_ylabel("query (triggers in red)", fontsize=8)


@torch.no_grad()
def _value_norm_panel(ax, run: Run, task, seq: Tensor, n: int, name: str) -> None:
    """Fig. 2c: value-state norms per position of one sequence."""
    _, cap = internals(run.model, seq[None, :n])
    norms = cap["layers.0.attn.values"][0].mean(0).cpu().numpy()
    colors = ["tab:red" if int(t) < task.n_triggers else "tab:blue" for t in seq[1:n]]
    ax.bar(range(n), norms, color=["black", *colors])
    ax.set_xticks(range(n), [token_label(task, t) for t in seq[:n]], fontsize=6)
    ax.set_title(f"{name}: ‖Val‖ per position (BOS black, triggers red)", fontsize=9)


def _interventions_panel(ax, inter: list[dict], task) -> None:
    """Fig. 4a: excess risks with a sublayer zeroed."""
    names = [r["zeroed"] for r in inter]
    x = np.arange(len(names))
    ax.bar(x - 0.2, [r["bigram_excess"] for r in inter], 0.4, label="bigram excess risk")
    ax.bar(x + 0.2, [r["backcopy_excess"] for r in inter], 0.4, label="backcopy excess risk")
    ax.axhline(
        math.log(task.V), color="gray", ls="--", lw=1, label="log V (backcopy, random guess)"
    )
    ax.set_xticks(x, [f"zero {n}" if n != "none" else "none" for n in names], fontsize=8)
    ax.set_ylabel("nats")
    ax.legend(fontsize=7)
    ax.set_title("one layer, softmax: interventions", fontsize=9)


def _rescale(y: np.ndarray) -> np.ndarray:
    lo, hi = np.nanmin(y), np.nanmax(y)
    return (y - lo) / (hi - lo) if hi > lo else np.zeros_like(y)


def _dynamics_panel(ax, run: Run, title: str) -> None:
    """Fig. 4b / 7a: rescaled dynamics of a one-layer run."""
    for key, label in (
        ("bigram_excess", "bigram excess risk"),
        ("backcopy_excess", "backcopy excess risk"),
        ("layers.0.attn.bos_weight", "BOS weight"),
        ("layers.0.attn.delta_logit", "Δlogit"),
        ("layers.0.attn.val_bos", "‖Val_BOS‖"),
    ):
        steps, y = series(run.metrics, key)
        ax.plot(np.maximum(steps, 1), _rescale(y), marker=".", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("step (step 0 drawn at 1)")
    ax.set_ylabel("rescaled to [0, 1]")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def _residual_panel(ax, runs: dict[str, Run]) -> None:
    """Fig. 7c: BOS residual peak at layer 0's output over training."""
    for (name, run), color in zip(
        runs.items(), ("tab:blue", "tab:orange", "tab:green"), strict=False
    ):
        steps, bos = series(run.metrics, "layers.0.res_bos")
        _, other = series(run.metrics, "layers.0.res_other")
        ax.plot(steps, bos, marker=".", color=color, label=f"{name}: ‖Res_BOS‖")
        ax.plot(steps, other, ls="--", color=color, label=f"{name}: mean ‖Res_other‖")
    ax.set_xlabel("step")
    ax.set_ylabel("residual norm at layer 0's output")
    ax.set_title("three layers: BOS residual state (Fig. 7c)", fontsize=9)
    ax.legend(fontsize=7)


def _ode_panels(ax_a, ax_b, theory, task) -> None:
    sm, fa, fb, off, beta0, exact, alpha_fixed = theory
    t = fa.t[1:]
    moving = np.flatnonzero(np.isfinite(off))
    for v in moving[np.argsort(-sm.pi_tilde[moving])][:4]:
        ax_a.plot(t, fa.alpha[1:, v], label=f"α for {task.chars[v]!r}")
        ax_a.plot(t, 0.5 * np.log(t) + off[v], ls=":", color="gray")
    ax_a.set_xscale("log")
    ax_a.set_xlabel("t (gradient-flow time)")
    ax_a.set_title("Theorem 2(a): α(t) vs ½ log t + const (dotted)", fontsize=9)
    ax_a.legend(fontsize=7)
    if ax_b is None:
        return
    err = np.linalg.norm(fb.beta - exact, axis=1) / np.linalg.norm(beta0 - exact)
    printed = sm.beta_limit(alpha_fixed, beta0)
    err_p = np.linalg.norm(fb.beta - printed, axis=1) / np.linalg.norm(beta0 - printed)
    ax_b.plot(fb.t[1:], err[1:], label="to the per-component limit")
    ax_b.plot(fb.t[1:], err_p[1:], ls="--", label="to Theorem 2(b) as printed")
    ax_b.set_xscale("log")
    ax_b.set_yscale("log")
    ax_b.set_xlabel("t")
    ax_b.set_ylabel("‖β(t) − β*‖ / ‖β(0) − β*‖")
    ax_b.set_title("Theorem 2(b): β flow with α fixed", fontsize=9)
    ax_b.legend(fontsize=7)


def write_figures(out: Path, runs: dict[str, Run], inter, theory, task, seq: Tensor) -> None:
    """The report's PNGs, and summary.png for the README (sink map, dynamics, residual peak,
    Theorem 2(a))."""
    soft, relu = runs["1L-softmax-adam"], runs["1L-relu-adam"]
    three = {"Adam": "3L-softmax-adam", "SGD": "3L-softmax-sgd", "ReLU, Adam": "3L-relu-adam"}
    res_runs = {label: runs[name] for label, name in three.items()}
    with report.figure(out / "attention.png", 1, 2, figsize=(11, 5.5)) as (_, ax):
        _attention_panel(ax[0], soft, task, seq, 32, "softmax: non-triggers sink into BOS")
        _attention_panel(ax[1], relu, task, seq, 32, "ReLU(s)/n: no sink")
    with report.figure(out / "value_norms.png", 1, 2, figsize=(11, 3)) as (_, ax):
        _value_norm_panel(ax[0], soft, task, seq, 32, "softmax")
        _value_norm_panel(ax[1], relu, task, seq, 32, "ReLU")
    with report.figure(out / "interventions.png", figsize=(6, 3.5)) as (_, ax):
        _interventions_panel(ax, inter, task)
    with report.figure(out / "dynamics.png", 1, 2, figsize=(11, 3.8)) as (_, ax):
        _dynamics_panel(ax[0], soft, "one layer, softmax")
        _dynamics_panel(ax[1], relu, "one layer, ReLU attention")
    with report.figure(out / "residual_peak.png", figsize=(6, 3.5)) as (_, ax):
        _residual_panel(ax, res_runs)
    with report.figure(out / "theorem2.png", 1, 2, figsize=(11, 3.8)) as (_, ax):
        _ode_panels(ax[0], ax[1], theory, task)
    with report.figure(out / "summary.png", 2, 2, figsize=(11, 9)) as (_, ax):
        _attention_panel(ax[0, 0], soft, task, seq, 24, "softmax attention (Fig. 2b)")
        _dynamics_panel(ax[0, 1], soft, "one layer, softmax (Fig. 4b)")
        _residual_panel(ax[1, 0], res_runs)
        _ode_panels(ax[1, 1], None, theory, task)
