"""Max retrieval's figures: accuracy against size, Figures 2/7 (attention over the largest
items), Figure 5 (the entropy of softmax_θ and its four regions) and Figure 9 (the logit spread
against its bound)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ... import normalizers as nz
from ...lab import report
from ...lab.runner import generator
from ...models import SetAttention
from ...tasks import sample_max_retrieval
from .config import STREAM_FIGURE, TEST_SEED, Config
from .evaluation import eval_methods


def plot_accuracy(
    path: Path, rows: list[dict[str, Any]], extra: dict[str, list[float]] | None = None
) -> None:
    """Accuracy vs size (log x), ours with ±std bands and the paper's curves dashed."""
    sizes = [r["size"] for r in rows]
    with report.figure(path, figsize=(7, 4.5), dpi=120) as (fig, ax):
        for key, label, color in (("baseline", "baseline", "C0"), ("adaptive", "adaptive θ", "C1")):
            mean = np.array([r[f"{key}_mean"] for r in rows])
            std = np.nan_to_num(np.array([r[f"{key}_std"] for r in rows]))
            ax.plot(sizes, mean, "o-", color=color, label=f"{label} (ours)")
            ax.fill_between(sizes, mean - std, mean + std, color=color, alpha=0.2)
            paper = [
                (n, r[f"paper_{key}"])
                for n, r in zip(sizes, rows, strict=True)
                if r[f"paper_{key}"] is not None
            ]
            if paper:
                ax.plot(
                    *zip(*paper, strict=True),
                    "s--",
                    color=color,
                    alpha=0.6,
                    label=f"{label} (paper)",
                )
        for label, values in (extra or {}).items():
            ax.plot(sizes, values, "^-", color="C2", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("number of items n (trained on 5–16)")
        ax.set_ylabel("accuracy (%)")
        ax.set_title("Max retrieval: accuracy vs set size")
        ax.grid(alpha=0.3)
        ax.legend()


@torch.inference_mode()
def plot_attention(
    path: Path, model: SetAttention, config: Config, max_size: int, sets: int = 32
) -> None:
    """Figures 2 and 7: weights of ``sets`` sets over their 16 largest-priority items (max
    rightmost), one panel per size 16, 32, …, ``max_size``; softmax above, adaptive below."""
    sizes = [16 * 2**i for i in range(int(math.log2(max(max_size, 16) / 16)) + 1)]
    g = generator(TEST_SEED, STREAM_FIGURE)
    methods = eval_methods(config)
    with report.figure(
        path,
        2,
        len(sizes),
        figsize=(1.6 * len(sizes) + 1.8, 6),
        squeeze=False,
        dpi=110,
        layout="constrained",
    ) as (fig, axes):
        for j, n in enumerate(sizes):
            b = sample_max_retrieval(sets, n, g)
            top = b.priority.argsort(dim=-1)[:, -16:]  # (sets, 16), max rightmost
            for i, (label, (method, params)) in enumerate(methods.items()):
                _, w = model(b.x, b.q, method=method, return_weights=True, **params)
                ax = axes[i, j]
                im = ax.imshow(
                    w.gather(-1, top).cpu().numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1
                )
                ax.set_xticks([])
                ax.set_yticks([])
                if i == 0:
                    ax.set_title(f"n = {n:,}", fontsize=9)
                if j == 0:
                    ax.set_ylabel(
                        "softmax"
                        if label == "baseline" and method == "softmax"
                        else (method if label == "baseline" else "adaptive θ")
                    )
        fig.suptitle("Attention over the 16 largest items of 32 sets (max rightmost)")
        fig.colorbar(im, ax=axes, shrink=0.8, label="attention weight")


def fig5_boundaries(items: int = 10, floor: float | None = None) -> tuple[float, float]:
    """(λ*, θ*): the lines that split Figure 5 into its four regions.

    λ*: the λ > 0 where the logits a_i = λ^i (i = 1…items) are all equal (the caption's
    degenerate case), the positive real root of λ^(items−1) = 1: below it the logits fall with i
    and lie in (0, λ) (spread λ − λ^items < 1), above it they grow with i and their spread
    λ^items − λ explodes. θ*: the largest temperature adaptive temperature applies, 1/floor
    (Fig. 4: θ = 1/max(poly(H), floor), floor = 1 by default, the registry's): below it
    softmax_θ sharpens the logits, above it flattens them.
    """
    if items < 2:
        raise ValueError(f"items must be >= 2 (one logit has no spread), got {items}.")
    if floor is None:
        floor = next(p.default for p in nz.get("adaptive").params if p.name == "floor")
    if not floor > 0:
        raise ValueError(f"floor must be > 0, got {floor}.")
    roots = np.roots([1.0] + [0.0] * (items - 2) + [-1.0])  # λ^(items−1) − 1
    (lam,) = [r.real for r in roots if abs(r.imag) < 1e-9 and r.real > 0]
    return float(lam), 1.0 / float(floor)


#: The four regions of Figure 5 (λ below/above λ*, θ below/above θ*).
FIG5_REGIONS = (
    ("λ < λ*, θ < θ*", "small spread, sharpened"),
    ("λ > λ*, θ < θ*", "growing spread, sharpened"),
    ("λ < λ*, θ > θ*", "small spread, flattened"),
    ("λ > λ*, θ > θ*", "growing spread, flattened"),
)


def entropy_landscape(items: int = 10, points: int = 200, top: float = 2.0):
    """(λ, θ, H): Figure 5's grid, H[θ, λ] the entropy of softmax_θ(a), a_i = λ^i, i = 1…items."""
    lam = torch.linspace(0.01, top, points, dtype=torch.float64)
    theta = torch.linspace(0.01, top, points, dtype=torch.float64)
    a = lam[:, None] ** torch.arange(1, items + 1, dtype=torch.float64)  # (λ, items)
    h = torch.stack([nz.entropy(nz.softmax(a, temperature=float(t))) for t in theta], dim=0)
    return lam.cpu().numpy(), theta.cpu().numpy(), h.cpu().numpy()


def region_entropies(items: int = 10, points: int = 200) -> list[dict[str, Any]]:
    """Mean, min and max entropy of Figure 5's grid in each of its four regions."""
    lam, theta, h = entropy_landscape(items, points)
    lam_star, theta_star = fig5_boundaries(items)
    out = []
    for (name, what), (lo_l, lo_t) in zip(
        FIG5_REGIONS, ((True, True), (False, True), (True, False), (False, False)), strict=True
    ):
        sel_l = lam < lam_star if lo_l else lam > lam_star
        sel_t = theta < theta_star if lo_t else theta > theta_star
        block = h[np.ix_(sel_t, sel_l)]
        out.append(
            {
                "region": name,
                "what": what,
                "mean": float(block.mean()),
                "min": float(block.min()),
                "max": float(block.max()),
            }
        )
    return out


def plot_entropy_landscape(path: Path, items: int = 10) -> tuple[float, float]:
    """Figure 5: entropy of softmax_θ(a) for a_i = λ^i, i = 1…10, over (λ, θ), with its four
    regions marked by the lines λ = λ* and θ = θ* of `fig5_boundaries` (returned)."""
    lam, theta, h = entropy_landscape(items)
    lam_star, theta_star = fig5_boundaries(items)
    with report.figure(path, figsize=(6.5, 5), dpi=120) as (fig, ax):
        im = ax.pcolormesh(lam, theta, h, shading="auto", cmap="magma")
        fig.colorbar(im, ax=ax, label="entropy H (nats)")
        ax.axvline(lam_star, color="cyan", lw=1.2, ls="--")
        ax.axhline(theta_star, color="cyan", lw=1.2, ls="--")
        spots = (
            ((lam[0] + lam_star) / 2, (theta[0] + theta_star) / 2),
            ((lam_star + lam[-1]) / 2, (theta[0] + theta_star) / 2),
            ((lam[0] + lam_star) / 2, (theta_star + theta[-1]) / 2),
            ((lam_star + lam[-1]) / 2, (theta_star + theta[-1]) / 2),
        )
        for (name, what), (x, y) in zip(FIG5_REGIONS, spots, strict=True):
            ax.text(x, y, f"{name}\n{what}", color="cyan", ha="center", va="center", fontsize=7)
        ax.set_xlabel(f"λ  (logits a_i = λ^i, i = 1…{items}); λ* = {lam_star:g}: all equal")
        ax.set_ylabel(f"temperature θ; θ* = {theta_star:g}: adaptive θ's largest")
        ax.set_title(
            f"Entropy of softmax_θ over {items} logits (max log {items} = {math.log(items):.2f})"
        )
    return lam_star, theta_star


def plot_logit_spread(path: Path, records: list[list[dict[str, float]]]) -> None:
    """Figure 9: logit spread δ and its Proposition 3.1 bound over training (mean ± std over seeds)."""
    steps = np.array([m["step"] for m in records[0]])
    with report.figure(path, figsize=(7, 4.5), dpi=120) as (fig, ax):
        for key, label, color in (
            ("delta", "logit spread δ", "C0"),
            ("bound", "bound 2·σmax(Q)·σmax(K)·‖y‖·max‖x_i‖ (Prop. 3.1)", "C3"),
        ):
            v = np.array([[m[key] for m in rec] for rec in records])
            mean, std = v.mean(0), (v.std(0) if len(records) > 1 else np.zeros(v.shape[1]))
            ax.plot(steps, mean, color=color, label=label)
            ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.2)
        ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_ylabel("logits (sets of 16)")
        ax.set_title(
            f"Logit spread vs its upper bound ({len(records)} seed{'s' * (len(records) > 1)})"
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
