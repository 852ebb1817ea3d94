"""Dispersion as n grows: `sharpattn demo` (softmax vs adaptive temperature, Lemma 2.1) and
`sharpattn dispersion` (which normalizers keep a winner's weight).

For each size n: rows of n logits uniform in [−1, 1].

`sharpattn demo` (`run_demo`, the main job): those rows ("bounded"), and the same with one
"winner" item whose logit is 1 + margin ("margin"). For softmax and adaptive temperature: mean max
weight, entropy, the winner's weight and n·max weight, which Lemma 2.1 bounds by e^δ (δ = max − min
logit, θ = 1); the CLI then runs the dispersion table below over every method.

`sharpattn dispersion` (`run`): one logit per row (at a random position) replaced by a
winner at 1 + margin. For each normalizer: the winner's weight, the largest |weight|, the entropy
of the row (of |w| / Σ|w|, so unnormalised rows are comparable) and the total mass Σ|w|.
Lemma 2.1 (Veličković et al.): softmax's winner weight is at most e^{δ}/n (δ = 2 + margin, the
row's logit spread), so it falls as 1/n; the fitted log-log slope of winner weight vs n shows
which alternatives keep it (slope ~0) and which disperse (slope ~−1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .. import normalizers as nz
from ..diagnostics.metrics import logit_spread
from . import report, runner
from .runner import Progress, RunFolder, emit, write_metrics
from .runs import check_memory, read_json, write_json

# Purposes of a run seed (runner.generator(seed, purpose)): one independent stream per toy
_WINNER, _GAUSSIAN, _DEMO = range(3)

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
    g = runner.generator(seed, _WINNER)
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
        [r.method, str(r.n), f"{r.winner_weight:.4g}", f"{r.max_weight:.4g}", f"{r.entropy:.3f}",
         f"{r.total_mass:.4g}", fit[r.method]]
        for r in shown
    ]  # fmt: skip
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

    run_dir = _write_run(
        out, "dispersion", config, rows, ("Which normalizers disperse", text), draw
    )
    return run_dir, rows


def _write_run(out, experiment: str, config: dict, rows: list, text: tuple[str, str], draw) -> Path:
    """The run folder ``out`` (config.json: measurements are cheap, so another configuration
    replaces the last instead of being refused); metrics.json (``rows``), the figure
    (``draw(run_dir)``) and report.md (``text``: title, body)."""
    run_dir = RunFolder(out, experiment, config, identity=()).path
    write_metrics(run_dir, [asdict(r) for r in rows])
    draw(run_dir)
    report.write_report(run_dir, *text[:1], [text[1]])
    return run_dir


# ---------------------------------------------------------------- Smith's blog
#
# E. Smith, *Softmax Attention is a Fluke* (blog). Two toys, both drawn only as figures there:
# (1) ten scores, "subtracted and sum-normalised": "30% token 6, approximately 15% token 7 and
# 15% token 8 and so on"; softmax: "approximately ~99% token 6"; x³ "a pretty similar result";
# (2) Gaussian logits at n = 2, 5, 25 and 1,000: "the distribution becomes progressively more
# flat, entropy increases, and the largest value becomes much smaller".

SMITH_TOKENS = 10
SMITH_WINNER = 6  # "token 6" (0-based, as a plot's x axis)
#: The shares the blog states in its text for the sum-normalised scores and for softmax.
SMITH_QUOTED = {"sum": {6: 0.30, 7: 0.15, 8: 0.15}, "softmax": {6: 0.99}}
SMITH_SIZES = (2, 5, 25, 1000)


def smith_scores(
    quoted: dict[int, float] = SMITH_QUOTED["sum"],
    softmax_share: float = SMITH_QUOTED["softmax"][SMITH_WINNER],
    tokens: int = SMITH_TOKENS,
) -> np.ndarray:
    """Ten scores with the shares the blog quotes. The blog gives its scores only as a bar chart,
    so they are reconstructed from its text: after subtracting the minimum (token 0) and
    normalising by the sum, the quoted tokens get their quoted shares and the other tokens share
    the rest equally ("and so on"); the scale, which sum-normalisation cannot see, is the one at
    which softmax gives the largest token ``softmax_share``. Returns float64 scores, min 0."""
    from scipy.optimize import brentq

    rest = [i for i in range(1, tokens) if i not in quoted]
    left = 1.0 - sum(quoted.values())
    if not (left > 0 and rest and 0 < softmax_share < 1):
        raise ValueError("quoted shares must leave a positive rest for the other tokens.")
    shares = np.zeros(tokens)
    for i, v in quoted.items():
        shares[i] = v
    shares[rest] = left / len(rest)
    top = int(np.argmax(shares))

    def gap(c: float) -> float:
        x = c * shares
        p = np.exp(x - x.max())
        return p[top] / p.sum() - softmax_share

    return brentq(gap, 1e-9, 1e4, xtol=1e-12) * shares


def smith_toy(scores: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The three rows of the ten-score toy, through the library's normalizers: ``sum`` (scores
    minus their minimum, over their sum: ``power`` with p = 1), ``softmax`` and ``x^3`` (the
    shifted scores cubed, over their sum: ``power`` with p = 3)."""
    s = torch.as_tensor(smith_scores() if scores is None else scores, dtype=torch.float64)
    shifted = s - s.min()
    return {
        "sum": nz.get("power")(shifted, p=1.0).cpu().numpy(),
        "softmax": nz.get("softmax")(s).cpu().numpy(),
        "x^3": nz.get("power")(shifted, p=3.0).cpu().numpy(),
    }


@dataclass
class GaussianRow:
    n: int
    rows: int
    max_weight: float  # mean over rows of the largest softmax weight
    max_weight_se: float  # its standard error over rows
    entropy: float  # mean over rows, nats
    entropy_se: float
    log_n: float  # the entropy of the uniform row
    effective_support: float  # mean over rows of 1/Σ p²


def gaussian_logits(n: int, rows: int, generator: torch.Generator) -> torch.Tensor:
    """``[rows, n]`` float64 standard-normal logits."""
    return torch.randn(rows, n, generator=generator, dtype=torch.float64)


def gaussian_dispersion(
    sizes: Sequence[int] = SMITH_SIZES, rows: int = 10_000, seed: int = 0
) -> list[GaussianRow]:
    """Smith's second toy: softmax of N(0, 1) logits at each n, ``rows`` draws per size."""
    if not sizes or any(int(n) < 1 for n in sizes):
        raise ValueError(f"sizes must all be >= 1, got {list(sizes)}.")
    if rows < 2:
        raise ValueError(f"rows must be >= 2 (a standard error needs two), got {rows}.")
    check_memory(4 * 8 * rows * max(int(n) for n in sizes), f"{rows} rows of {max(sizes):,} logits")
    g = runner.generator(seed, _GAUSSIAN)
    out = []
    for n in sizes:
        w = nz.softmax(gaussian_logits(int(n), rows, g))
        top, h = nz.max_weight(w), nz.entropy(w)
        out.append(
            GaussianRow(
                n=int(n),
                rows=rows,
                max_weight=top.mean().item(),
                max_weight_se=(top.std() / math.sqrt(rows)).item(),
                entropy=h.mean().item(),
                entropy_se=(h.std() / math.sqrt(rows)).item(),
                log_n=math.log(n),
                effective_support=nz.effective_support(w).mean().item(),
            )
        )
    return out


def smith_toy_markdown(toy: dict[str, Sequence[float]]) -> str:
    """The ten-score toy's weights per token, beside the blog's quoted shares."""
    header = ["normalisation"] + [f"token {i}" for i in range(SMITH_TOKENS)] + ["blog (text)"]
    blog = {
        "sum": "30% / 15% / 15% on tokens 6 / 7 / 8",
        "softmax": "≈ 99% on token 6",
        "x^3": '"pretty similar" to softmax',
    }
    cells = [[name] + [f"{100 * v:.1f}%" for v in row] + [blog[name]] for name, row in toy.items()]
    return report.markdown_table(header, cells)


def smith_gauss_markdown(gauss: list[GaussianRow]) -> str:
    """Softmax of Gaussian logits per n: max weight, entropy, log n, effective support."""
    g_cells = [
        [f"{r.n:,}", f"{r.max_weight:.4f} ± {r.max_weight_se:.4f}",
         f"{r.entropy:.3f} ± {r.entropy_se:.3f}", f"{r.log_n:.3f}", f"{r.effective_support:.2f}"]
        for r in gauss
    ]  # fmt: skip
    return report.markdown_table(
        ["n", "max weight", "entropy (nats)", "log n (uniform)", "effective support"], g_cells
    )


def smith_markdown(toy: dict[str, np.ndarray], gauss: list[GaussianRow]) -> str:
    """The report section: the ten-score toy beside the blog's quoted shares, and the Gaussian
    dispersion table."""
    scores = smith_scores()
    return (
        "## Smith's toys (*Softmax Attention is a Fluke*)\n\n"
        "Ten scores. The blog draws its scores only as a bar chart; the scores here are rebuilt "
        "from its text: minus their minimum and over their sum, tokens 6, 7, 8 get its quoted 30%, "
        "15%, 15%, the other six non-minimal tokens share the remaining 40% equally, and the "
        "scale is the one at which softmax gives token 6 its quoted 99% (scores: "
        + ", ".join(f"{v:.2f}" for v in scores)
        + "). So the sum and softmax rows reproduce the blog by construction; the x³ row "
        "(shifted scores cubed, over their sum) is the measurement.\n\n"
        + smith_toy_markdown(toy)
        + f"\nGaussian logits: N(0, 1), softmax, {gauss[0].rows:,} rows per n (mean ± standard "
        "error; the blog shows one draw per n). Effective support: 1/Σp².\n\n"
        + smith_gauss_markdown(gauss)
    )


def read_smith(run_dir: str | Path) -> tuple[dict[str, list[float]], list[GaussianRow]]:
    """Smith's toy and Gaussian rows as a dispersion run wrote them (its smith.json)."""
    shape = {
        "toy": {"scores": [float]},
        "gaussian": [{f: float for f in GaussianRow.__annotations__}],
    }
    data = read_json(Path(run_dir) / "smith.json", shape)
    toy = {k: v for k, v in data["toy"].items() if k != "scores"}
    return toy, [GaussianRow(**r) for r in data["gaussian"]]


# ---------------------------------------------------------------- `sharpattn demo`

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
        g = runner.generator(seed, _DEMO)  # both settings draw the same rows
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
    header = ["setting", "method", "n", "max weight", "entropy", "winner weight", "n·max weight",
              "e^{δ/θ} bound"]  # fmt: skip
    cells = [
        [r.setting, r.method, str(r.n), f"{r.max_weight:.4g}", f"{r.entropy:.3f}",
         f"{r.winner_weight:.4g}" if r.setting == "margin" else "–",  # no winner: bounded
         f"{r.n_max_weight:.3f}", f"{r.lemma_bound:.3f}"]
        for r in rows
    ]  # fmt: skip
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
    run_dir = _write_run(
        out, "demo", config, rows, ("Dispersion demo", text),
        lambda d: plot_demo(rows, d / "dispersion.png"),
    )  # fmt: skip
    return run_dir, rows
