"""`sharpattn dispersion`: one winner logit at 1 + margin among n uniform ones; per normalizer,
the winner's weight, the largest |weight|, the entropy and the mass as n grows, and the fitted
log-log slope of the winner's weight (Lemma 2.1: softmax's falls as 1/n)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ... import normalizers as nz
from ...lab import report, runner
from ...lab.runner import Progress, RunFolder, emit, write_metrics
from ...lab.runs import check_memory, write_json
from .smith import gaussian_dispersion, smith_markdown, smith_scores, smith_toy

# Purposes of a run seed (runner.generator(seed, purpose)): one independent stream per toy
STREAM_WINNER = 0  # smith.STREAM_GAUSSIAN is 1, demo.STREAM_DEMO 2

DEFAULT_SIZES = tuple(4**k for k in range(2, 9))  # 16, 64, ..., 65536
#: Per-method settings for this experiment (all others run at their defaults). length_scaled's
#: default c = 0 (its value at the start of training) is softmax itself, so it runs with c = 1,
#: the log-n scaling of Chiang & Cholak. The query is not one of the n items, so the
#: stick-breaking query may take a share from every item (the nearest first).
METHOD_PARAMS: dict[str, dict] = {
    "length_scaled": {"c": 1.0},
    "stick_breaking": {"attend_current": True},
}
#: The plot's lower limit: weights below it are drawn off the axes.
PLOT_FLOOR = 1e-6


@dataclass
class Row:
    method: str
    n: int
    winner_weight: float  # mean over rows of the winner's weight
    max_weight: float  # mean over rows of max_j |w_j|
    entropy: float  # mean over rows of H(|w| / Σ|w|), nats
    total_mass: float  # mean over rows of Σ_j |w_j|


def uniform_logits(n: int, rows: int, generator: torch.Generator) -> torch.Tensor:
    """``[rows, 1, n]`` float64 logits uniform in [−1, 1]."""
    return torch.rand(rows, 1, n, generator=generator, dtype=torch.float64) * 2 - 1


def check_sizes(sizes: Sequence[int], margin: float, rows: int) -> None:
    """ValueError for sizes < 2, a margin that is not finite and > 0, or rows < 1; MemoryError
    (from `check_memory`) when rows × max(sizes) float64 arrays would not fit."""
    if not sizes or any(int(n) < 2 for n in sizes):
        raise ValueError(f"sizes must all be >= 2, got {list(sizes)}.")
    if not (margin > 0 and math.isfinite(margin)):
        raise ValueError(f"margin must be a finite number > 0, got {margin}.")
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}.")
    # float64 logits, weights and a normalizer's temporaries (sorts, cumulative sums): ~8 arrays
    check_memory(8 * 8 * rows * max(int(n) for n in sizes), f"{rows} rows of {max(sizes):,} logits")


def logits_with_winner(
    n: int, rows: int, margin: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, 1, n]`` float64 logits uniform in [−1, 1] with a winner at 1 + margin placed at a
    uniformly random position of each row; returns the logits and the winners' positions."""
    s = uniform_logits(n, rows, generator)
    where = torch.randint(n, (rows,), generator=generator)
    s[torch.arange(rows), 0, where] = 1.0 + margin
    return s, where


def measure(
    methods: Sequence[str] | None = None,
    sizes: Sequence[int] = DEFAULT_SIZES,
    margin: float = 2.0,
    rows: int = 32,
    seed: int = 0,
    progress: Progress | None = None,
) -> list[Row]:
    """One `Row` per (method, n), with a progress event after each."""
    methods = list(nz.available() if methods is None else methods)
    for m in methods:
        nz.get(m)  # unknown names raise ValueError listing the known ones
    if not methods:
        raise ValueError("methods must name at least one normalizer.")
    check_sizes(sizes, margin, rows)
    out: list[Row] = []
    g = runner.generator(seed, STREAM_WINNER)
    total = len(sizes) * len(methods)
    for n in sizes:
        s, where = logits_with_winner(int(n), rows, margin, g)
        for method in methods:
            w = nz.get(method)(s, **METHOD_PARAMS.get(method, {}))  # (rows, 1, n)
            a = w.abs()
            mass = a.sum(-1)  # (rows, 1)
            p = a / torch.where(mass > 0, mass, torch.ones_like(mass)).unsqueeze(-1)
            out.append(
                Row(
                    method=method,
                    n=int(n),
                    winner_weight=w[torch.arange(rows), 0, where].mean().item(),
                    max_weight=nz.max_weight(a).mean().item(),
                    entropy=nz.entropy(p).mean().item(),
                    total_mass=mass.mean().item(),
                )
            )
            emit(progress, "dispersion", f"{method} n={n}", len(out), total)
    return out


def slopes(rows: list[Row]) -> dict[str, float]:
    """Least-squares slope of log(winner weight) vs log(n) per method: −1 is softmax's 1/n
    dispersion, 0 keeps the winner. Sizes where the winner's weight is 0 (underflow, e.g.
    stick-breaking's early positions at large n) have no logarithm and are left out of the fit;
    `vanishes_at` names the first of them. NaN only when fewer than two sizes remain."""
    out = {}
    for method in dict.fromkeys(r.method for r in rows):
        mr = [r for r in rows if r.method == method and r.winner_weight > 0]
        if len(mr) < 2:
            out[method] = math.nan
            continue
        x = np.log([r.n for r in mr])
        y = np.log([r.winner_weight for r in mr])
        out[method] = float(np.polyfit(x, y, 1)[0])
    return out


def vanishes_at(rows: list[Row]) -> dict[str, int | None]:
    """The smallest n at which each method's mean winner weight is exactly 0 (None if never)."""
    out: dict[str, int | None] = {}
    for r in sorted(rows, key=lambda r: r.n):
        out.setdefault(r.method, None)
        if out[r.method] is None and r.winner_weight == 0:
            out[r.method] = r.n
    return out


def slope_text(rows: list[Row], digits: int = 2) -> dict[str, str]:
    """The slope of each method as printed: a number, "–" where undefined (a method without a
    winner weight, or fewer than two sizes), and "(0 from n=…)" where the weight underflowed."""
    fit, zero = slopes(rows), vanishes_at(rows)
    out = {}
    for method, value in fit.items():
        text = "–" if math.isnan(value) else f"{value:.{digits}f}"
        if zero.get(method) is not None:
            text += f" (0 from n={zero[method]})"
        out[method] = text
    return out


def plot(rows: list[Row], path: Path, margin: float) -> None:
    """Winner weight vs n on log axes, one curve per method, with softmax's Lemma 2.1 bound."""
    with report.figure(path, figsize=(10.5, 6), dpi=100) as (fig, ax):
        _plot_winner(ax, rows, margin)


def _plot_winner(ax, rows: list[Row], margin: float) -> None:
    # softmax, the reference every other curve is read against, is drawn last, in black and
    # thick, so the other methods' curves cannot hide it
    methods = sorted(dict.fromkeys(r.method for r in rows), key=lambda m: m == "softmax")
    cmap = report.pyplot().get_cmap("tab20")
    styles = ("o-", "s-", "^-", "D-", "v-")
    for i, method in enumerate(methods):
        mr = [r for r in rows if r.method == method and r.winner_weight > 0]
        soft = method == "softmax"
        ax.plot(
            [r.n for r in mr],
            [r.winner_weight for r in mr],
            "o-" if soft else styles[i % len(styles)],
            color="black" if soft else cmap(i % 20),
            ms=5 if soft else 3,
            lw=3 if soft else 1.2,
            alpha=1.0 if soft else 0.8,
            zorder=5 if soft else 2,
            label=method,
        )
    ns = sorted({r.n for r in rows})
    bound = math.exp(2.0 + margin)  # e^δ with δ = (1 + margin) − (−1)
    ax.plot(ns, [min(1.0, bound / n) for n in ns], "k--", lw=1, label="e^δ/n (Lemma 2.1)")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="n items",
        ylabel="winner weight (mean over rows)",
        title=f"Which normalizers disperse: logits in [-1, 1], one winner at 1 + {margin:g}",
    )
    ax.set_ylim(PLOT_FLOOR, 1.5)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))


def winner_markdown(rows: list[Row]) -> str:
    """The winner's weight per method (rows) and size (columns), and each method's slope."""
    fit, ns = slope_text(rows), sorted({r.n for r in rows})
    body = []
    for method in dict.fromkeys(r.method for r in rows):
        by_n = {r.n: r for r in rows if r.method == method}
        body.append([method, *(f"{by_n[n].winner_weight:.3g}" for n in ns), fit[method]])
    return report.markdown_table(["method", *(f"n={n}" for n in ns), "slope"], body)


def markdown_table(rows: list[Row], n: int | None = None) -> str:
    """Every method at every size (at size ``n`` only, if given; slopes over every size)."""
    fit = slope_text(rows, digits=3)
    shown = rows if n is None else [r for r in rows if r.n == n]
    header = [
        "method",
        "n",
        "winner weight",
        "max \\|w\\|",
        "entropy",
        "total mass Σ\\|w\\|",
        "slope",
    ]
    cells = [
        [
            r.method,
            str(r.n),
            f"{r.winner_weight:.4g}",
            f"{r.max_weight:.4g}",
            f"{r.entropy:.3f}",
            f"{r.total_mass:.4g}",
            fit[r.method],
        ]
        for r in shown
    ]
    return report.markdown_table(header, cells).rstrip("\n")


def run(
    out: str | Path = "runs/dispersion", *, progress: Progress | None = None, **kwargs
) -> tuple[Path, list[Row]]:
    """Measure; write config.json, metrics.json, winner_weight.png and report.md into ``out``."""
    config = {
        "methods": list(kwargs.get("methods") or nz.available()),
        "sizes": [int(n) for n in kwargs.get("sizes", DEFAULT_SIZES)],
        "margin": kwargs.get("margin", 2.0),
        "rows": kwargs.get("rows", 32),
        "seed": kwargs.get("seed", 0),
        "method_params": METHOD_PARAMS,
    }
    rows = measure(progress=progress, **kwargs)  # validates before anything is written
    toy, gauss = smith_toy(), gaussian_dispersion(seed=config["seed"])
    text = (
        f"Logits uniform in [−1, 1], one winner at 1 + {config['margin']:g} at a random position; "
        f"{config['rows']} rows per size, seed {config['seed']}. Weight columns are means over "
        "rows; entropy is that of |w| / Σ|w|; slope is the least-squares slope of log winner "
        "weight vs log n over the sizes where it is positive (−1: disperses like softmax's 1/n; 0: "
        'keeps the winner; "0 from n=…": the weight underflows to 0 there). Settings other than the defaults: '
        + (", ".join(f"{m} {p}" for m, p in METHOD_PARAMS.items()) or "none")
        + ". Stick-breaking's winner weight depends on how many items lie nearer the query than "
        "the winner, so its mean over rows is noisy and, for large n, astronomically small.\n\n"
        f"{markdown_table(rows)}\n\n![winner weight vs n](winner_weight.png)\n\n"
        f"{smith_markdown(toy, gauss)}"
    )

    def draw(run_dir: Path) -> None:
        plot(rows, run_dir / "winner_weight.png", config["margin"])
        smith = {"scores": smith_scores().tolist(), **{k: v.tolist() for k, v in toy.items()}}
        write_json(run_dir / "smith.json", {"toy": smith, "gaussian": [asdict(r) for r in gauss]})

    run_dir = write_run(out, "dispersion", config, rows, ("Which normalizers disperse", text), draw)
    return run_dir, rows


def write_run(out, experiment: str, config: dict, rows: list, text: tuple[str, str], draw) -> Path:
    """The run folder ``out`` (config.json: measurements are cheap, so another configuration
    replaces the last instead of being refused); metrics.json (``rows``), the figure
    (``draw(run_dir)``) and report.md (``text``: title, body)."""
    run_dir = RunFolder(out, experiment, config, identity=()).path
    write_metrics(run_dir, [asdict(r) for r in rows])
    draw(run_dir)
    report.write_report(run_dir, *text[:1], [text[1]])
    return run_dir
