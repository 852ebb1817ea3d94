"""`sharpattn demo`: softmax against adaptive temperature on bounded rows and on rows with a
winner, as n grows (Lemma 2.1's bound on n·max weight)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import normalizers as nz
from ...diagnostics.metrics import logit_spread
from ...lab import report, runner
from .winner import check_sizes, uniform_logits, write_run

# ---------------------------------------------------------------- `sharpattn demo`

#: the demo's stream of a run seed (runner.generator(seed, stream))
STREAM_DEMO = 2
DEMO_METHODS = ("softmax", "adaptive")
DEMO_SIZES = (16, 64, 256, 1024, 4096, 16384)


def adaptive_note(coefficients: str = "icml") -> str:
    """Where the adaptive polynomial stops sharpening, computed from its coefficients."""
    (to_one,) = nz.entropy_crossings(coefficients, 1.0)[-1:]
    (to_zero,) = nz.entropy_crossings(coefficients, 0.0)[-1:]
    h = torch.linspace(0.5, to_one, 4001, dtype=torch.float64)
    beta_max = float(nz.polyval(nz.resolve_coefficients(coefficients), h).max())
    return (
        f"Adaptive temperature (θ = 1/β) sharpens small sets, but β ≤ {beta_max:.2f} and the "
        f"{coefficients} polynomial falls below 1 at entropy H ≈ {to_one:.2f} nats (below 0 at "
        f"H ≈ {to_zero:.2f}), from where the floor makes β = 1: at large n it disperses exactly "
        "like softmax."
    )


@dataclass
class DemoRow:
    setting: str
    method: str
    n: int
    max_weight: float
    entropy: float
    winner_weight: float
    n_max_weight: float
    lemma_bound: float  # e^{δ/θ}: Lemma 2.1's bound on n·max weight (θ = 1/β for adaptive)


def demo_logits(
    n: int, rows: int, margin: float | None, generator: torch.Generator
) -> torch.Tensor:
    """``[rows, 1, n]`` logits uniform in [−1, 1]; item 0 set to 1 + margin if margin is given."""
    s = uniform_logits(n, rows, generator)
    if margin is not None:
        s[..., 0] = 1.0 + margin
    return s


def measure_demo(
    sizes=DEMO_SIZES, rows: int = 256, margin: float = 2.0, seed: int = 0, methods=DEMO_METHODS
) -> list[DemoRow]:
    """The demo's table: one `DemoRow` per (setting, method, n)."""
    check_sizes(sizes, margin, rows)
    out: list[DemoRow] = []
    for setting, m in (("bounded", None), ("margin", margin)):
        g = runner.generator(seed, STREAM_DEMO)  # both settings draw the same rows
        for n in sizes:
            s = demo_logits(n, rows, m, g)
            delta = logit_spread(s)  # (rows, 1): each row's δ = max − min logit
            for method in methods:
                w = nz.get(method)(s)
                # The effective inverse temperature of the row: 1 for softmax, β for adaptive.
                beta = nz.adaptive_beta(s) if method == "adaptive" else torch.ones_like(s[..., :1])
                out.append(
                    DemoRow(
                        setting=setting,
                        method=method,
                        n=n,
                        max_weight=nz.max_weight(w).mean().item(),
                        entropy=nz.entropy(w).mean().item(),
                        winner_weight=w[..., 0].mean().item() if m is not None else math.nan,
                        n_max_weight=(n * nz.max_weight(w)).max().item(),
                        lemma_bound=torch.exp(beta.squeeze(-1) * delta).max().item(),
                    )
                )
    return out


def plot_demo(rows: list[DemoRow], path: Path) -> None:
    """Max weight and entropy vs n (log axes), softmax vs adaptive, with Lemma 2.1's bounds."""
    settings = sorted({r.setting for r in rows}, key=["bounded", "margin"].index)
    size = (5.5 * len(settings), 8)
    with report.figure(path, 2, len(settings), figsize=size, squeeze=False, dpi=110) as (fig, axes):
        _plot_demo(fig, axes, rows, settings)


def _plot_demo(fig, axes, rows: list[DemoRow], settings: list[str]) -> None:
    for col, setting in enumerate(settings):
        sub = [r for r in rows if r.setting == setting]
        ns = sorted({r.n for r in sub})
        ax, ax_h = axes[0, col], axes[1, col]
        for method in dict.fromkeys(r.method for r in sub):
            mr = [r for r in sub if r.method == method]
            ax.plot(
                [r.n for r in mr], [r.max_weight for r in mr], "o-", label=f"{method}: max weight"
            )
            ax_h.plot([r.n for r in mr], [r.entropy for r in mr], "o-", label=method)
        bound = max(r.lemma_bound for r in sub if r.method == "softmax")
        ax.plot(ns, [bound / n for n in ns], "k--", lw=1, label="Lemma 2.1 (softmax): e^δ/n")
        ax.plot(ns, [1 / (bound * n) for n in ns], "k:", lw=1, label="Lemma 2.1 (softmax): e^-δ/n")
        ax_h.plot(ns, [math.log(n) for n in ns], "k--", lw=1, label="log n (uniform)")
        ax.set(xscale="log", yscale="log", xlabel="n items", ylabel="mean max weight")
        ax.set_title(
            f"{setting} logits"
            + (" (one winner above by a margin)" if setting == "margin" else " in [-1, 1]")
        )
        ax_h.set(xscale="log", xlabel="n items", ylabel="mean entropy (nats)")
        ax.legend(fontsize=8)
        ax_h.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax_h.grid(True, which="both", alpha=0.3)
    fig.suptitle(
        "Softmax must disperse (Lemma 2.1); adaptive temperature sharpens but cannot stop it"
    )


def demo_markdown_table(rows: list[DemoRow]) -> str:
    header = [
        "setting",
        "method",
        "n",
        "max weight",
        "entropy",
        "winner weight",
        "n·max weight",
        "e^{δ/θ} bound",
    ]
    cells = [
        [
            r.setting,
            r.method,
            str(r.n),
            f"{r.max_weight:.4g}",
            f"{r.entropy:.3f}",
            f"{r.winner_weight:.4g}" if r.setting == "margin" else "–",  # no winner: bounded
            f"{r.n_max_weight:.3f}",
            f"{r.lemma_bound:.3f}",
        ]
        for r in rows
    ]
    return report.markdown_table(header, cells, align="llrrrrrr").rstrip("\n")


def run_demo(out: str | Path = "runs/demo", **kwargs) -> tuple[Path, list[DemoRow]]:
    """Measure the demo, then write config.json, metrics.json, dispersion.png and report.md into
    ``out`` (the CLI's `sharpattn demo` then runs `run` into ``out/dispersion``)."""
    config = {"sizes": list(kwargs.get("sizes", DEMO_SIZES)), **kwargs}
    config["sizes"] = [int(n) for n in config["sizes"]]
    rows = measure_demo(**kwargs)  # validates before anything is written
    text = (
        "Logits uniform in [−1, 1] (`bounded`), and the same with one winner at 1 + margin "
        "(`margin`). Lemma 2.1: every softmax_θ weight is at most e^{δ/θ}/n (δ = max − min logit "
        "of the row), so n·max weight stays below e^{δ/θ} for all n while the max weight itself "
        f"falls as 1/n. {adaptive_note()}\n\n"
        f"{demo_markdown_table(rows)}\n\n![dispersion](dispersion.png)\n"
    )
    run_dir = write_run(
        out,
        "demo",
        config,
        rows,
        ("Dispersion demo", text),
        lambda d: plot_demo(rows, d / "dispersion.png"),
    )
    return run_dir, rows
