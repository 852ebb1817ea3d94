"""E. Smith's blog, *Softmax Attention is a Fluke*: its two toys (ten scores normalised several
ways; Gaussian logits at growing n), with the shares its text states."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ... import normalizers as nz
from ...lab import report, runner
from ...lab.runs import check_memory, read_json

# ---------------------------------------------------------------- Smith's blog
#
# E. Smith, *Softmax Attention is a Fluke* (blog). Two toys, both drawn only as figures there:
# (1) ten scores, "subtracted and sum-normalised": "30% token 6, approximately 15% token 7 and
# 15% token 8 and so on"; softmax: "approximately ~99% token 6"; x³ "a pretty similar result";
# (2) Gaussian logits at n = 2, 5, 25 and 1,000: "the distribution becomes progressively more
# flat, entropy increases, and the largest value becomes much smaller".

#: the Gaussian toy's stream of a run seed (runner.generator(seed, stream))
STREAM_GAUSSIAN = 1
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
    g = runner.generator(seed, STREAM_GAUSSIAN)
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
        [
            f"{r.n:,}",
            f"{r.max_weight:.4f} ± {r.max_weight_se:.4f}",
            f"{r.entropy:.3f} ± {r.entropy_se:.3f}",
            f"{r.log_n:.3f}",
            f"{r.effective_support:.2f}",
        ]
        for r in gauss
    ]
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
