"""App. F: refit the temperature polynomial β(H) = 1/θ_opt on a run's trained models (Figure 6)
and evaluate Table 1 with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ... import normalizers as nz
from ...lab import report
from ...lab.runner import Progress, emit, generator, numpy_generator
from ...lab.runs import write_json
from ...models import SetAttention
from ...tasks import sample_max_retrieval
from .config import STREAM_FIT, STREAM_SCATTER, TEST_SEED, read_config
from .evaluation import check_sizes, eval_methods, evaluate
from .page import write_report
from .tables import table1, write_table1
from .training import load_model

Tensor = torch.Tensor


THETA_GRID = tuple(round(0.1 * i, 1) for i in range(1, 101))  # (0, 10] step 0.1


def optimal_temperature(e: Tensor, target: Tensor, grid=THETA_GRID) -> Tensor:
    """θ_opt per row: the grid θ maximising softmax(e/θ)[target] (first on ties), ``(B,)``.

    ``e`` ``(B, n)`` logits, ``target`` ``(B,)`` the item to retrieve.
    """
    thetas = torch.tensor(grid, dtype=torch.float64)
    e = e.to(torch.float64)
    z = e[None] / thetas[:, None, None]  # (G, B, n)
    log_p = z.gather(-1, target[None, :, None].expand(len(grid), -1, 1))[..., 0] - z.logsumexp(-1)
    return thetas[log_p.argmax(0)]  # (B,)


#: bytes per item of the fit's float64 logits over the θ grid (`optimal_temperature`: e/θ,
#: its exponentials for logsumexp, the result); with ``_ITEM_BYTES``, 2.3 times the 1,911 bytes
#: per item measured (peak RSS growth of `collect_fit_data` at n = 2^16)
_FIT_BYTES = 3 * 8 * len(THETA_GRID)


def fit_chunk(n: int) -> int:
    """Sets of ``n`` items the temperature fit takes at once (about 2^20 logits over the grid)."""
    return max(1, (1 << 20) // (n * len(THETA_GRID)))


def collect_fit_data(
    model: SetAttention, sizes, sets: int, generator: torch.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(H, 1/θ_opt) over sets whose max-priority item does not get the largest logit (App. F)."""
    hs, betas = [], []
    with torch.inference_mode():
        for n in sizes:
            chunk = fit_chunk(n)
            for start in range(0, sets, chunk):
                b = sample_max_retrieval(min(chunk, sets - start), n, generator)
                e = model.scores(b.x, b.q).to(torch.float64)  # (B, n)
                keep = e.argmax(-1) != b.argmax
                if not bool(keep.any()):
                    continue
                e, target = e[keep], b.argmax[keep]
                # H of softmax(e) as the adaptive normalizer computes it (reference code's eps).
                hs.append(nz.entropy(torch.softmax(e, -1), eps=1e-9).cpu().numpy())
                betas.append(1.0 / optimal_temperature(e, target).cpu().numpy())
    if not hs:
        raise ValueError("no set had its max item below another item's logit; nothing to fit.")
    return np.concatenate(hs), np.concatenate(betas)


def fit_temperature(
    run: Path,
    sizes=None,
    sets: int = 256,
    degree: int = 4,
    seeds: list[int] | None = None,
    evaluate_refit: bool = True,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Refit β(H) = 1/θ_opt (App. F) on the trained models of ``run``; write fit_temperature.json
    (which ``adaptive(coefficients=path)`` reads), Figure 6 and Table 1 with the refit."""
    run = Path(run)
    config = read_config(run)
    sizes = tuple(sizes or config.sizes)
    check_sizes(sizes, per_item=_FIT_BYTES, chunk=fit_chunk)  # before any work
    seeds = list(range(config.seeds)) if seeds is None else list(seeds)
    hs, betas = [], []
    for i, s in enumerate(seeds):
        emit(progress, "temperature fit", f"seed {s}", i, len(seeds))
        h, beta = collect_fit_data(
            load_model(run, config, s), sizes, sets, generator(s, STREAM_FIT)
        )
        hs.append(h)
        betas.append(beta)
    emit(progress, "temperature fit", "done", len(seeds), len(seeds))
    h, beta = np.concatenate(hs), np.concatenate(betas)
    if len(h) <= degree:
        raise ValueError(
            f"only {len(h)} usable sets for a degree-{degree} fit; use more --sets or larger --sizes."
        )
    coefficients = np.polyfit(h, beta, degree)  # highest power first, as numpy.polyval
    path = run / "fit_temperature.json"
    write_json(
        path,
        {
            "coefficients": [float(c) for c in coefficients],
            "degree": degree,
            "samples": int(len(h)),
            "sizes": list(sizes),
            "sets_per_size": sets,
            "seeds": seeds,
            "theta_grid": [THETA_GRID[0], THETA_GRID[-1], 0.1],
            "paper_coefficients": list(nz.COEFFICIENTS["icml"]),
        },
    )
    nz.resolve_coefficients(str(path))  # what adaptive(coefficients=path) will read
    plot_fit(run / "fit_temperature.png", h, beta, coefficients)
    out: dict[str, Any] = {"path": path, "coefficients": coefficients, "samples": len(h)}
    if evaluate_refit:
        methods = {**eval_methods(config), "refit": ("adaptive", {"coefficients": str(path)})}
        result = evaluate(run, config, methods, progress)
        acc, se, sets = result["accuracy"], result["se_of_mean"], result["test_sets"]
        rows = table1(acc, config.sizes, treatment="refit", se=se, sets=sets)
        for r, base in zip(rows, table1(acc, config.sizes, se=se, sets=sets), strict=True):
            r["adaptive_mean"], r["adaptive_std"] = base["adaptive_mean"], base["adaptive_std"]
        write_table1(run, rows, name="table1_refit", treatment="refit", label="adaptive θ, refit")
        out["rows"] = rows
    write_report(run)
    return out


def plot_fit(path: Path, h: np.ndarray, beta: np.ndarray, coefficients) -> None:
    """Figure 6: (H, 1/θ_opt) samples, our degree-4 fit and the paper's polynomial."""
    with report.figure(path, figsize=(7, 4.5), dpi=120) as (fig, ax):
        rng = numpy_generator(TEST_SEED, STREAM_SCATTER)  # which samples the figure draws
        idx = rng.choice(len(h), size=min(len(h), 4000), replace=False)
        ax.scatter(h[idx], beta[idx], s=4, alpha=0.3, color="gray", label=f"samples ({len(h):,})")
        grid = np.linspace(0, max(float(h.max()), 1.0), 300)
        ax.plot(grid, np.polyval(coefficients, grid), color="C0", lw=2, label="our fit")
        ax.plot(
            grid,
            np.polyval(nz.COEFFICIENTS["icml"], grid),
            "--",
            color="C3",
            lw=2,
            label="paper (ICML Fig. 6)",
        )
        ax.axhline(1.0, color="k", lw=0.5)
        ax.set_xlabel("entropy H of softmax(e)")
        ax.set_ylabel("1/θ_opt")
        ax.set_ylim(0, max(3.0, float(np.quantile(beta, 0.99))))
        ax.set_title("Adaptive temperature: polynomial fit of 1/θ_opt against H (App. F)")
        ax.grid(alpha=0.3)
        ax.legend()
